"""The measurements sandbox_roundtrip.py and sandbox_isolation.py both take, so their columns are
measured the same way. Imported as a sibling module (the scripts run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from recursa.context import build_payload
from recursa.sandbox import Sandbox

MB = 1_000_000

# 64 plain llm_query call-backs at once, each from its own user thread in the sandbox.
THREADED_CALLS = (
    "import threading\n"
    "_ts = [threading.Thread(target=llm_query, args=('x',)) for _ in range(64)]\n"
    "for _th in _ts: _th.start()\n"
    "for _th in _ts: _th.join()\n"
)


class Handler:
    """Answers at once, or after `delay` per prompt; a batched call's prompts run concurrently."""

    def __init__(self) -> None:
        self.delay = 0.0

    async def one(self) -> str:
        if self.delay:
            await asyncio.sleep(self.delay)
        return "ok"

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        if fn == "llm_query_batched":
            return await asyncio.gather(*(self.one() for _ in args["prompts"]))
        return await self.one()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms" if seconds < 0.01 else f"{seconds * 1000:.1f} ms"


class Table:
    """Rows of figures, one column per sandbox kind, printed in the order they were first put."""

    def __init__(self, kinds: list[str], column: int) -> None:
        self.kinds = kinds
        self.column = column
        self.rows: dict[str, dict[str, str]] = {}

    def put(self, row: str, kind: str, value: str) -> None:
        self.rows.setdefault(row, {})[kind] = value

    def print(self) -> None:
        width = max(map(len, self.rows)) + 2
        print("".ljust(width) + "".join(k.rjust(self.column) for k in self.kinds))
        for row, values in self.rows.items():
            print(row.ljust(width) + "".join(values.get(k, "-").rjust(self.column) for k in self.kinds))


async def startup(make: Callable[[], Sandbox], n: int = 10) -> tuple[float, float]:
    """(median start() time, median time the worker spent hardening itself; 0 where it does not)."""
    times, harden = [], []
    for _ in range(n):
        sb = make()
        started = time.perf_counter()
        await sb.start(Handler())
        times.append(time.perf_counter() - started)
        report = getattr(getattr(sb, "_hardening", None), "last_report", None) or {}
        harden.append(float(report.get("duration_ms", 0.0)) / 1000)
        await sb.close()
    return statistics.median(times), statistics.median(harden)


async def exec_round_trip(sb: Sandbox, n: int = 200) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        await sb.execute("pass", 10)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def callback_round_trip(sb: Sandbox, n: int = 200) -> float:
    # Timed inside the sandbox, so the exec round trip around the loop does not count.
    code = (
        "import time, statistics\n"
        "_t = []\n"
        f"for _ in range({n}):\n"
        "    _s = time.perf_counter(); llm_query('x'); _t.append(time.perf_counter() - _s)\n"
        "statistics.median(_t)"
    )
    result = await sb.execute(code, 30)
    return float(result.stdout)


async def fan_out(sb: Sandbox, handler: Handler, code: str = THREADED_CALLS) -> float:
    """Seconds `code` takes while the host handler needs 100 ms a call-back."""
    handler.delay = 0.1
    started = time.perf_counter()
    try:
        result = await sb.execute(code, 30)
    finally:
        handler.delay = 0.0
    elapsed = time.perf_counter() - started
    assert result.error is None, result.error  # a failed cell would pass for a fast one
    return elapsed


async def round_trips(sb: Sandbox, handler: Handler, table: Table, kind: str) -> None:
    """The rows both scripts take from a started sandbox (whose handler is `handler`)."""
    await sb.execute("pass", 10)  # the first cell pays one-off costs the medians should not see
    table.put("exec round trip (median of 200)", kind, ms(await exec_round_trip(sb)))
    table.put("call-back round trip (median of 200)", kind, ms(await callback_round_trip(sb)))
    threads = statistics.median([await fan_out(sb, handler) for _ in range(5)])
    table.put("64 call-backs from 64 threads, 100 ms handler (median of 5)", kind, ms(threads))


async def context_load(make: Callable[[], Sandbox], size: int, repeat: int = 3) -> tuple[float, float]:
    """(median build_payload time, median load_context time into a fresh sandbox) over `repeat` runs.
    A payload is built for every load: loading releases it into the REPL (the worker frees the
    buffer's pages as it reads them), as a run does with its context."""
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
    encodes, loads = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        payload = build_payload(text)
        encodes.append(time.perf_counter() - started)
        sb = make()
        await sb.start(Handler())
        try:
            started = time.perf_counter()
            await sb.load_context(payload)
            loads.append(time.perf_counter() - started)
            check = await sb.execute("len(context)", 30)
            assert int(check.stdout) == size, check
        finally:
            await sb.close()
            payload.close()
        gc.collect()
    return statistics.median(encodes), statistics.median(loads)
