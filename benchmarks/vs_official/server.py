"""The fake model server process for the side-by-side benchmarks (run by run.py; prints "ready PORT")."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _lean_server

from _lean_server import LeanServer
from responder import reply

from recursa.testing.fake_server import FakeServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="fanout")
    ap.add_argument("--latency", type=float, default=None)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument(
        "--lean",
        action="store_true",
        help="benchmarks/_lean_server.py (~0.07 ms of CPU per request) instead of FakeServer (~0.7 ms)",
    )
    args = ap.parse_args()
    if args.lean:
        asyncio.run(serve_lean(args.latency or 0.0, args.slots or 64))
        return
    with FakeServer(responder=reply, profile=args.profile, latency_s=args.latency, slots=args.slots) as srv:
        print(f"ready {srv.port}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin


async def serve_lean(latency: float, slots: int) -> None:
    server = await LeanServer(reply, latency, slots).serve(0)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
    server.close()


if __name__ == "__main__":
    main()
