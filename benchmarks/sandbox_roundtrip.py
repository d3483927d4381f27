"""Sandbox latency: startup, exec and call-back round trips, call-back fan-out, context loading.

    python benchmarks/sandbox_roundtrip.py [--big] [--inprocess]

--big adds a 1 GB context; --inprocess adds a column for the (unisolated) in-process REPL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Callable

from _sandbox_common import MB, Handler, Table, context_load, fan_out, ms, round_trips, startup

from recursa.sandbox import InProcessSandbox, Sandbox, SubprocessSandbox

BATCHED_CALLS = "_r = llm_query_batched(['x'] * 64)"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--big", action="store_true", help="also load a 1 GB context")
    parser.add_argument("--inprocess", action="store_true", help="add the in-process REPL column")
    args = parser.parse_args()
    makers: dict[str, Callable[[], Sandbox]] = {"subprocess": SubprocessSandbox}
    if args.inprocess:
        makers["inprocess"] = InProcessSandbox
    table = Table(list(makers), column=14)
    put = table.put
    for kind, make in makers.items():
        put("startup (median of 10)", kind, ms((await startup(make))[0]))
        handler = Handler()
        sb = make()
        await sb.start(handler)
        try:
            await round_trips(sb, handler, table, kind)
            batched = statistics.median([await fan_out(sb, handler, BATCHED_CALLS) for _ in range(5)])
            put("llm_query_batched(64), host fans out, 100 ms each (median of 5)", kind, ms(batched))
        finally:
            await sb.close()
        sizes = [200 * MB] + ([1000 * MB] if args.big else [])
        for size in sizes:
            encoded, loaded = await context_load(make, size)
            put(f"context {size // MB} MB: build_payload (host)", kind, ms(encoded))
            put(f"context {size // MB} MB: load_context, median of 3", kind, ms(loaded))

    table.print()


if __name__ == "__main__":
    asyncio.run(main())
