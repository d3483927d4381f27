"""Engine overhead per root turn, by context size, with an in-process scripted root (no network,
no model time): the time between consecutive turns minus the time the REPL spent running the
cell. Also the time from `run()` returning to the process being quiet (no teardown cost).

    python benchmarks/turn_overhead.py [--sizes-mb 1,100] [--turns 20]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time

from recursa import RLM
from recursa.scripted import register
from recursa.trace import load

TURNS = 20


@register("bench-turns")
def _factory():
    def policy(messages: list[dict]) -> str:
        done = sum(1 for m in messages if m["role"] == "assistant")
        if done < TURNS:
            return f"```repl\nx = {done}\nprint(x)\n```"
        return "FINAL(done)"

    return policy


def measure(size_mb: int, model_latency_s: float) -> dict[str, float]:
    context = "abcdefghij" * (size_mb * 2**20 // 10)
    with tempfile.TemporaryDirectory() as tmp:
        model = "scripted/bench-turns" + (f":latency={model_latency_s}" if model_latency_s else "")
        rlm = RLM(model, trace_dir=tmp, max_iterations=TURNS + 5)
        threads_before = threading.active_count()
        started = time.perf_counter()
        result = rlm.run("q", context)
        returned = time.perf_counter()
        returned_wall = time.time()
        assert result.answer == "done", result
        trace = load(result.trace_path)
        events = trace.events
        turn_ts = [e["ts"] for e in events if e["type"] == "turn"]
        exec_s = [e["duration_s"] for e in events if e["type"] == "exec"]
        # Gaps between turns 2..N: the model call, the exec, the engine's own work in between.
        gaps = [b - a for a, b in itertools.pairwise(turn_ts[1:])]
        overhead = [g - x - model_latency_s for g, x in zip(gaps, exec_s[1:], strict=False)]
        start_to_first_turn = turn_ts[0] - events[0]["ts"]
        return {
            "mb": size_mb,
            "turn_ms": statistics.median(gaps) * 1000,
            "exec_ms": statistics.median(exec_s) * 1000,
            "overhead_ms": statistics.median(overhead) * 1000,
            "setup_s": start_to_first_turn,
            "run_s": returned - started,
            "teardown_ms": (returned_wall - events[-1]["ts"]) * 1000,
            "threads_left": threading.active_count() - threads_before,
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="1,100")
    ap.add_argument(
        "--model-latency",
        default="0,0.01",
        help="seconds the scripted root takes per reply (0: instant; real models take far longer)",
    )
    args = ap.parse_args()
    print(f"{TURNS} root turns with a scripted in-process root; medians per turn")
    print(
        f"{'model s':>8} {'ctx MB':>7} {'turn ms':>8} {'exec ms':>8} {'engine ms':>10} {'setup s':>8} "
        f"{'teardown ms':>12} {'threads left':>13}"
    )
    for latency in map(float, args.model_latency.split(",")):
        for mb in map(int, args.sizes_mb.split(",")):
            r = measure(mb, latency)
            print(
                f"{latency:>8} {r['mb']:>7} {r['turn_ms']:>8.3f} {r['exec_ms']:>8.3f} {r['overhead_ms']:>10.3f} "
                f"{r['setup_s']:>8.3f} {r['teardown_ms']:>12.2f} {r['threads_left']:>13}"
            )


if __name__ == "__main__":
    main()
