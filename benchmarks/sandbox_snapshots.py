"""Fork snapshots: what they cost per exec, and how fast a killed cell's state comes back.

    python benchmarks/sandbox_snapshots.py [--big] [--repeat N] [--sizes-mb 200]

For a 200 MB context (and 1 GB with --big), ASCII and not: the exec round trip of `pass` with and
without snapshots, back to back (the difference is the snapshot's cost per exec: killing the
previous snapshot and forking the next, which the worker does right after answering) and after a
20 ms pause (as when the model is thinking: the fork is done by then, and what remains is the
copy-on-write faults the next cell takes), and the time a restore takes after a cell is killed. Also prints whether
transparent huge pages are available and how much of the worker's memory they back (the context
loader asks for them; see worker._advise_huge_pages).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from pathlib import Path
from typing import Any

from recursa.context import build_payload
from recursa.sandbox import SubprocessSandbox

MB = 1_000_000


async def handler(fn: str, args: dict[str, Any]) -> Any:
    return "ok"


def thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unavailable"


def huge_pages_kb(pid: int | None) -> str:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return f"{int(line.split()[1]) // 1024} MB"
    except (OSError, ValueError):
        pass
    return "?"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def round_trip(sb: SubprocessSandbox, n: int, pause: float = 0.0) -> float:
    times = []
    for _ in range(n):
        if pause:
            await asyncio.sleep(pause)
        started = time.perf_counter()
        await sb.execute("pass", 30)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def one(text: str, snapshots: bool, repeat: int) -> dict[str, str]:
    payload = build_payload(text)
    sb = SubprocessSandbox(snapshots=snapshots, grace_s=0.05)
    await sb.start(handler)
    try:
        started = time.perf_counter()
        await sb.load_context(payload)
        loaded = time.perf_counter() - started
        await sb.execute("pass", 30)
        out = {
            "load_context": ms(loaded),
            "exec round trip (median)": ms(await round_trip(sb, repeat)),
            "after a pause": ms(await round_trip(sb, repeat // 2, pause=0.02)),
            "worker AnonHugePages": huge_pages_kb(sb.pid),
        }
        if snapshots:
            restores = []
            for _ in range(3):
                r = await sb.execute("sum(range(10**13))", 0.05)
                assert r.restored, r
                restores.append(r.duration_s - 0.1)  # beyond the deadline and the grace period
            check = await sb.execute("len(context)", 30)
            assert int(check.stdout) == len(text), check
            out["restore after a kill (median of 3)"] = ms(statistics.median(restores))
        return out
    finally:
        await sb.close()
        payload.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--big", action="store_true", help="also 1 GB contexts")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--sizes-mb", default="200", help="context sizes (MB); --big adds 1000")
    args = parser.parse_args()
    print(f"transparent huge pages: {thp_setting()}")
    sizes = [int(x) * MB for x in args.sizes_mb.split(",")] + ([1000 * MB] if args.big else [])
    for size in sizes:
        for label, unit in (
            ("ASCII", "The quick brown fox jumps over the lazy dog. "),
            ("non-ASCII", "Größe "),
        ):
            text = (unit * (size // len(unit.encode()) + 1))[: size // len(unit.encode()) * len(unit)]
            gc.collect()
            without = await one(text, False, args.repeat)
            with_ = await one(text, True, args.repeat)
            del text
            gc.collect()
            base = float(without["exec round trip (median)"].split()[0])
            snap = float(with_["exec round trip (median)"].split()[0])
            print(f"\n{size // MB} MB {label} context")
            print(f"  load_context:                  {with_['load_context']}")
            print(f"  exec round trip, no snapshots: {without['exec round trip (median)']}")
            print(f"  exec round trip, snapshots:    {with_['exec round trip (median)']}")
            print(f"  snapshot cost per exec:        {snap - base:.2f} ms (back to back)")
            print(
                f"  after a 20 ms pause:           {with_['after a pause']} (no snapshots: {without['after a pause']})"
            )
            print(f"  restore after a kill:          {with_['restore after a kill (median of 3)']}")
            print(f"  worker memory in huge pages:   {with_['worker AnonHugePages']}")


if __name__ == "__main__":
    asyncio.run(main())
