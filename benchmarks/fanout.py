"""Fan-out: N `llm_query_batched` prompts through the real openai SDK against a latency-modelled
fake server (0.2 s per request, 64 slots) running in its own process, as a real model server
would. Prints the batch's wall time (from the trace's exec event) against the ideal
ceil(N / slots) * latency, and the same for a plain `llm_query` loop and for 16 user threads.

    python benchmarks/fanout.py [--sizes 16,64,256,1024] [--latency 0.2] [--slots 64] [--concurrency 64]
        [--repeat 1]
"""

from __future__ import annotations

import argparse
import math
import socket
import subprocess
import sys
import tempfile
import time

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


def serve(port: int, latency: float, slots: int) -> None:
    from recursa.testing.fake_server import FakeServer

    with FakeServer(responder=responder, latency_s=latency, slots=slots, port=port):
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes our stdin


def measure(base_url: str, pattern: str, n: int, concurrency: int = 64) -> float:
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
        return load(result.trace_path).root.of_type("exec")[0]["duration_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64, help="RLM(max_concurrency=...), recursa's default")
    ap.add_argument("--repeat", type=int, default=1, help="rows per pattern and size")
    ap.add_argument("--loop-size", type=int, default=64, help="prompts for the llm_query loop row")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, args.latency, args.slots)
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
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        base_url = f"http://127.0.0.1:{port}/v1"
        measure(base_url, "batched", 4)  # warm-up: imports, first connections
        print(
            f"fan-out through the openai SDK, {args.latency} s per request, {args.slots} server slots, "
            f"max_concurrency={args.concurrency}; each row a fresh RLM in a warm process"
        )
        print(f"{'pattern':>10} {'prompts':>8} {'wall s':>8} {'ideal s':>8} {'ratio':>6}")
        rows = [("batched", n) for n in map(int, args.sizes.split(",")) for _ in range(args.repeat)]
        rows += [("threads", args.loop_size), ("loop", args.loop_size)]
        for pattern, n in rows:
            started = time.perf_counter()
            wall = measure(base_url, pattern, n, args.concurrency)
            ideal = (
                n if pattern == "loop" else math.ceil(n / (16 if pattern == "threads" else args.slots))
            ) * args.latency
            print(
                f"{pattern:>10} {n:>8} {wall:>8.3f} {ideal:>8.3f} {wall / ideal:>6.2f}"
                + ("" if time.perf_counter() - started < 600 else "  (slow)")
            )
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
