"""Fan-out: N `llm_query_batched` prompts through recursa's openai client against a latency-modelled
server (0.2 s per request, 64 slots) running in its own process, as a real model server would.
Prints the batch's wall time (from the trace's exec event) against the ideal
ceil(N / slots) * latency, and the same for a plain `llm_query` loop and for 16 user threads.

Two more rows give the floor of the HTTP client recursa's model clients use: the same N POSTs
through aiohttp alone (one fresh session per row, `concurrency` at a time, timed around the gather),
once with new connections, as each RLM run starts, and once over connections opened beforehand
(`aiohttp+`). What the `batched` rows take beyond them is what recursa's own layers cost.

The server's own times for each batched row (from its ledger) say where the rest goes: `spread ms`,
from the first request's arrival to the first wave's last (`slots`-th); `refill ms`, the median
time from a reply leaving the server to the freed slot's next request arriving; `outside ms`, the
batch's wall time not spent between the first arrival and the last reply (the REPL's call reaching
the host and the answers going back).

`--server lean` (the default) is benchmarks/_lean_server.py, which costs ~0.07 ms of CPU per
request; `--server fake` is recursa.testing.FakeServer (~0.7 ms per request, which on two shared
cores alone holds 256 calls to ~0.9 s whatever the client does).

    python benchmarks/fanout.py [--sizes 16,64,256,1024] [--latency 0.2] [--slots 64] [--concurrency 64]
        [--repeat 1] [--server lean|fake]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from recursa import RLM
from recursa.trace import load

PATTERNS = {
    "batched": "answers = llm_query_batched([f'item {{i}}' for i in range({n})])",
    "loop": "answers = [llm_query(f'item {{i}}') for i in range({n})]",
    "threads": (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(16) as pool:\n"
        "    answers = list(pool.map(llm_query, [f'item {{i}}' for i in range({n})]))"
    ),
}


def responder(model: str, messages: list[dict]) -> str:
    if model == "bench-sub":
        return "ok"
    if not any(m["role"] == "assistant" for m in messages):
        question = messages[1]["content"]
        pattern, n = question.split("<question>\n", 1)[1].split("\n", 1)[0].split(":")
        return "```repl\n" + PATTERNS[pattern].format(n=int(n)) + "\nprint(len(answers))\n```"
    return "FINAL_VAR(answers)"


def serve(port: int, latency: float, slots: int, kind: str) -> None:
    if kind == "lean":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _lean_server import LeanServer

        async def run() -> None:
            server = await LeanServer(responder, latency, slots).serve(port)
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
            server.close()

        asyncio.run(run())
        return
    from recursa.testing.fake_server import FakeServer

    with FakeServer(responder=responder, latency_s=latency, slots=slots, port=port):
        print("ready", flush=True)
        sys.stdin.read()


class FullCollections:
    """When this process ran full garbage collections, and for how long (time.time() values)."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, float]] = []
        self._began = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.time()
        else:
            self.runs.append((self._began, time.time() - self._began))

    def within(self, start: float, end: float) -> float:
        return sum(took for began, took in self.runs if start <= began <= end)


def measure(base_url: str, pattern: str, n: int, concurrency: int = 64) -> tuple[float, float]:
    """(the batch's wall time, when it ended as a time.time() value)."""
    with tempfile.TemporaryDirectory() as tmp:
        rlm = RLM(
            "openai/bench-root",
            sub_model="openai/bench-sub",
            base_url=base_url,
            api_key="local",
            trace_dir=tmp,
            max_concurrency=concurrency,
        )
        result = rlm.run(f"{pattern}:{n}", "x" * 1000)
        assert isinstance(result.value, list) and len(result.value) == n, result
        cell = load(result.trace_path).root.of_type("exec")[0]
        return cell["duration_s"], cell["ts"]


async def _aiohttp_alone(base_url: str, n: int, concurrency: int, preconnect: bool) -> float:
    import aiohttp

    body = json.dumps({"model": "bench-sub", "messages": [{"role": "user", "content": "item 0"}]}).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer local"}
    url = f"{base_url}/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if preconnect:  # a GET the server answers 404 to, only to leave a kept-alive connection behind

            async def connect() -> None:
                async with session.get(f"{base_url}/connect") as resp:
                    await resp.read()

            await asyncio.gather(*(connect() for _ in range(concurrency)))
        gate = asyncio.Semaphore(concurrency)

        async def post() -> None:
            async with gate, session.post(url, data=body, headers=headers) as resp:
                json.loads(await resp.read())

        started = time.perf_counter()
        await asyncio.gather(*(post() for _ in range(n)))
        return time.perf_counter() - started


def aiohttp_alone(base_url: str, n: int, concurrency: int, preconnect: bool) -> tuple[float, float]:
    """(wall time, when it ended as a time.time() value) of n POSTs through aiohttp alone."""
    wall = asyncio.run(_aiohttp_alone(base_url, n, concurrency, preconnect))
    return wall, time.time()


def server_times(root_url: str, slots: int) -> tuple[float, float, float] | None:
    """(spread, median refill, first arrival to last reply) in seconds, from the server's ledger."""
    with urllib.request.urlopen(f"{root_url}/ledger") as r:
        ledger: list[dict[str, Any]] = json.load(r)
    subs = [x for x in ledger if x["model"] == "bench-sub"]
    if not subs:
        return None
    arrivals = sorted(x["received_at"] for x in subs)
    finishes = sorted(x["finished_at"] for x in subs)
    refills = [arrivals[k] - finishes[k - slots] for k in range(slots, len(arrivals))]
    spread = arrivals[min(slots, len(arrivals)) - 1] - arrivals[0]
    return spread, statistics.median(refills) if refills else 0.0, finishes[-1] - arrivals[0]


def reset(root_url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(f"{root_url}/ledger/reset", method="POST")) as r:
        r.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64, help="RLM(max_concurrency=...), recursa's default")
    ap.add_argument("--repeat", type=int, default=1, help="rows per pattern and size")
    ap.add_argument("--loop-size", type=int, default=64, help="prompts for the llm_query loop row")
    ap.add_argument("--server", choices=["lean", "fake"], default="lean", help="the model server (see above)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, args.latency, args.slots, args.server)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            str(port),
            "--latency",
            str(args.latency),
            "--slots",
            str(args.slots),
            "--server",
            args.server,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        root_url = f"http://127.0.0.1:{port}"
        base_url = f"{root_url}/v1"
        measure(base_url, "batched", 4)  # warm-up: imports, first connections
        print(
            f"fan-out through recursa's openai client, {args.latency} s per request, {args.slots} server "
            f"slots ({args.server} server), max_concurrency={args.concurrency}; each row a fresh RLM in a "
            "warm process"
        )
        print(
            f"{'pattern':>10} {'prompts':>8} {'wall s':>8} {'ideal s':>8} {'ratio':>6} "
            f"{'spread ms':>10} {'refill ms':>10} {'outside ms':>11} {'gc ms':>6}"
        )
        collections = FullCollections()
        rows = [("batched", n) for n in map(int, args.sizes.split(",")) for _ in range(args.repeat)]
        largest = max(map(int, args.sizes.split(",")))
        rows += [(alone, largest) for alone in ("aiohttp", "aiohttp+") for _ in range(args.repeat)]
        rows += [("threads", args.loop_size), ("loop", args.loop_size)]
        for pattern, n in rows:
            started = time.perf_counter()
            reset(root_url)
            if pattern.startswith("aiohttp"):
                wall, ended = aiohttp_alone(base_url, n, args.concurrency, pattern.endswith("+"))
            else:
                wall, ended = measure(base_url, pattern, n, args.concurrency)
            ideal = (
                n if pattern == "loop" else math.ceil(n / (16 if pattern == "threads" else args.slots))
            ) * args.latency
            with_ledger = pattern == "batched" or pattern.startswith("aiohttp")
            times = server_times(root_url, args.slots) if with_ledger else None
            extra = ""
            if times is not None:
                spread, refill, inside = times
                extra = f" {spread * 1e3:>10.1f} {refill * 1e3:>10.1f} {(wall - inside) * 1e3:>11.1f}"
                extra += f" {collections.within(ended - wall, ended) * 1e3:>6.1f}"
            print(
                f"{pattern:>10} {n:>8} {wall:>8.3f} {ideal:>8.3f} {wall / ideal:>6.2f}{extra}"
                + ("" if time.perf_counter() - started < 600 else "  (slow)")
            )
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
