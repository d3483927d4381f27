"""Bursts of REPL starts: hardened workers started anew against workers forked from a zygote.

    python benchmarks/worker_starts.py [--workers 20] [--rounds 3]

Each round starts `--workers` sandboxes at once (as `rlm_query_batched` over that many contexts
does) and runs one cell in each. Printed: the time until the first, the median and the last is
ready; the CPU the whole machine spent per worker (/proc/stat, so the workers' own time counts
even though bwrap's processes are not our children); and the host process's share of it. With a
fork server, its zygote is started before the round, as a call tree's root REPL would have.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from _sandbox_common import Handler, Table, ms

from recursa.sandbox import ForkServer, SubprocessSandbox
from recursa.sandbox.bwrap import find_bwrap


def machine_cpu_s() -> float:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait


async def burst(n: int, forked: bool) -> dict[str, float]:
    server = ForkServer() if forked else None
    warm = SubprocessSandbox(bwrap=None, fork_server=server)
    await warm.start(Handler())
    sandboxes = [SubprocessSandbox(bwrap=None, fork_server=server) for _ in range(n)]
    ready: list[float] = []
    cpu, host = machine_cpu_s(), time.process_time()
    started = time.perf_counter()

    async def one(sb: SubprocessSandbox) -> None:
        await sb.start(Handler())
        await sb.execute("x = 1", 10)
        ready.append(time.perf_counter() - started)

    await asyncio.gather(*(one(sb) for sb in sandboxes))
    cpu, host = machine_cpu_s() - cpu, time.process_time() - host
    forks = sum(bool(sb.isolation.get("forked")) for sb in sandboxes)
    await asyncio.gather(*(sb.close() for sb in [warm, *sandboxes]))
    if server is not None:
        await server.close()
    if forked and forks != n:
        sys.exit(f"only {forks} of {n} workers were forked ({server.unavailable if server else ''})")
    return {
        "first": min(ready),
        "median": statistics.median(ready),
        "last": max(ready),
        "cpu": cpu / n,
        "host": host / n,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if find_bwrap() is None:
        sys.exit("bubblewrap is not installed: a fork server needs it (apt-get install bubblewrap)")
    kinds = ["started anew", "forked"]
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):  # interleaved, so both see the same background load
        for kind in kinds:
            results[kind].append(await burst(args.workers, kind == "forked"))
    table = Table(kinds, 22)
    rows = {
        "first ready": "first",
        "median ready": "median",
        "last ready": "last",
        "machine CPU per worker": "cpu",
        "host CPU per worker": "host",
    }
    for row, key in rows.items():
        for kind in kinds:
            values = sorted(r[key] for r in results[kind])
            table.put(row, kind, f"{ms(values[0])}-{ms(values[-1])}" if len(values) > 1 else ms(values[0]))
    print(f"{args.workers} hardened workers (bwrap) starting at once, {args.rounds} rounds (min-max):\n")
    table.print()


if __name__ == "__main__":
    asyncio.run(main())
