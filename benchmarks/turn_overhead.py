"""Engine time per root turn, by context size, with an in-process scripted root (no network).

    python benchmarks/turn_overhead.py [--sizes-mb 1,100] [--model-latency 0,0.01] [--snapshots on,off]

The scripted root is wrapped where the engine awaits it, and the REPL host's `execute` where the
engine awaits a cell, so every figure is a measured interval rather than a nominal one:

- model ms: the model call's own wall time (the scripted client's `complete`, including the
  overshoot of its `asyncio.sleep(latency)`, which is model time, not engine time);
- engine ms: from one model call returning to the next one starting, minus nothing: everything
  the engine does for a turn (parsing the reply, the cell, the trace, building the next prompt);
- round trip ms: the part of that spent in the host's `execute` (request to the REPL worker, the
  cell, the reply; with snapshots, a wait for the snapshot being taken, if it is not ready yet);
- exec ms: the part of the round trip the worker spent running the cell (its own clock);
- host ms: engine ms minus round trip: the engine's work outside the REPL.

Medians over turns 2..N (the first turn also waits for the REPL to start). Also setup s (`run()`
called to the first model call) and teardown ms (the trace's last event to `run()` returning).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from recursa import RLM
from recursa.lm.registry import register_provider
from recursa.sandbox import SubprocessSandbox
from recursa.scripted import register
from recursa.scripted.client import ScriptedClient
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


@dataclass
class Stamps:
    """perf_counter intervals of the model calls and of the cells, in the order they happened."""

    calls: list[tuple[float, float]] = field(default_factory=list)
    cells: list[tuple[float, float, float]] = field(default_factory=list)  # start, end, worker's exec s


STAMPS = Stamps()


class TimedClient:
    """The scripted client, with the start and end of every call recorded."""

    def __init__(self, inner: ScriptedClient) -> None:
        self.inner = inner
        self.provider = inner.provider

    async def complete(self, request: Any) -> Any:
        started = time.perf_counter()
        try:
            return await self.inner.complete(request)
        finally:
            STAMPS.calls.append((started, time.perf_counter()))

    async def aclose(self) -> None:
        await self.inner.aclose()


def _timed_provider(model: str, *, timeout: float | None = None, **_: Any) -> TimedClient:
    return TimedClient(ScriptedClient(model, timeout=timeout))


register_provider("timed", _timed_provider)


@contextlib.contextmanager
def timed_cells() -> Iterator[None]:
    """Record every cell the REPL host runs (for the length of one measurement)."""
    original = SubprocessSandbox.execute

    async def execute(self: SubprocessSandbox, code: str, timeout: float, **kw: Any) -> Any:
        started = time.perf_counter()
        result = await original(self, code, timeout, **kw)
        STAMPS.cells.append((started, time.perf_counter(), result.duration_s))
        return result

    SubprocessSandbox.execute = execute  # type: ignore[method-assign]
    try:
        yield
    finally:
        SubprocessSandbox.execute = original  # type: ignore[method-assign]


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


def measure(size_mb: int, model_latency_s: float, snapshots: bool) -> dict[str, float]:
    context = "abcdefghij" * (size_mb * 2**20 // 10)
    STAMPS.calls.clear()
    STAMPS.cells.clear()
    with tempfile.TemporaryDirectory() as tmp, timed_cells():
        model = "timed/bench-turns" + (f":latency={model_latency_s}" if model_latency_s else "")
        rlm = RLM(
            model,
            trace_dir=tmp,
            max_iterations=TURNS + 5,
            sandbox="subprocess",
            sandbox_options={"snapshots": snapshots},
        )
        threads_before = threading.active_count()
        started = time.perf_counter()
        result = rlm.run("q", context)
        returned = time.perf_counter()
        returned_wall = time.time()
        assert result.answer == "done", result
        events = load(result.trace_path).events
    calls = STAMPS.calls
    assert len(calls) == TURNS + 1, f"expected {TURNS + 1} model calls, saw {len(calls)}"
    engine, round_trip, worker, host = [], [], [], []
    for (_, ended), (next_start, _) in itertools.pairwise(calls[1:]):
        cells = [c for c in STAMPS.cells if ended <= c[0] and c[1] <= next_start]
        trip = sum(c[1] - c[0] for c in cells)
        engine.append(next_start - ended)
        round_trip.append(trip)
        worker.append(sum(c[2] for c in cells))
        host.append(next_start - ended - trip)
    return {
        "mb": size_mb,
        "model_ms": _median_ms([b - a for a, b in calls[1:]]),
        "engine_ms": _median_ms(engine),
        "round_trip_ms": _median_ms(round_trip),
        "exec_ms": _median_ms(worker),
        "host_ms": _median_ms(host),
        "setup_s": calls[0][0] - started,
        "run_s": returned - started,
        "teardown_ms": (returned_wall - events[-1]["ts"]) * 1000,
        "threads_left": threading.active_count() - threads_before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="1,100")
    ap.add_argument(
        "--model-latency",
        default="0,0.01",
        help="seconds the scripted root takes per reply (0: instant; real models take far longer)",
    )
    ap.add_argument("--snapshots", default="on", help="on, off, or on,off: the REPL's fork snapshots")
    args = ap.parse_args()
    modes = [m.strip() for m in args.snapshots.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        ap.error(f"--snapshots takes on, off or on,off, not {args.snapshots!r}")
    print(f"{TURNS} root turns with a scripted in-process root; medians per turn over turns 2..{TURNS}")
    print(
        "engine ms = one model call returning to the next starting (all the engine's time per turn);\n"
        "round trip ms = its part in the REPL host's execute; exec ms = the worker running the cell;\n"
        "host ms = engine ms - round trip ms; model ms = the model call's measured wall time\n"
    )
    print(
        f"{'snap':>4} {'model s':>8} {'ctx MB':>7} {'model ms':>9} {'engine ms':>10} {'round trip ms':>14} "
        f"{'exec ms':>8} {'host ms':>8} {'setup s':>8} {'teardown ms':>12} {'threads left':>13}"
    )
    for mode in modes:
        for latency in map(float, args.model_latency.split(",")):
            for mb in map(int, args.sizes_mb.split(",")):
                r = measure(mb, latency, mode == "on")
                print(
                    f"{mode:>4} {latency:>8} {r['mb']:>7} {r['model_ms']:>9.3f} {r['engine_ms']:>10.3f} "
                    f"{r['round_trip_ms']:>14.3f} {r['exec_ms']:>8.3f} {r['host_ms']:>8.3f} "
                    f"{r['setup_s']:>8.3f} {r['teardown_ms']:>12.2f} {r['threads_left']:>13}"
                )


if __name__ == "__main__":
    main()
