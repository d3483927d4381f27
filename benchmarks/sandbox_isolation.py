"""What isolation costs: the same latency figures for the in-process REPL, a plain worker process, the
hardened worker (rlimits, Landlock, seccomp) and the hardened worker inside bwrap namespaces.

    python benchmarks/sandbox_isolation.py [--no-snapshots] [--quick] [--caps]

--no-snapshots turns off the fork snapshot taken before each cell, to see the hardening alone;
--quick skips the 200 MB context; --caps adds columns with the resource caps turned off (no control
group, no tmpfs sizes: `Hardening(cgroups=False, max_shm_bytes=None, max_scratch_bytes=None)`), to
see what the caps cost. Columns whose layer this machine lacks (no bwrap) are left out.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from _sandbox_common import MB, Handler, Table, context_load, ms, round_trips, startup

from recursa.sandbox import Hardening, InProcessSandbox, Sandbox, SubprocessSandbox
from recursa.sandbox.bwrap import find_bwrap


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-snapshots", action="store_true", help="no fork snapshot before each cell")
    parser.add_argument("--quick", action="store_true", help="skip the 200 MB context")
    parser.add_argument("--caps", action="store_true", help="add columns with the resource caps off")
    args = parser.parse_args()
    snap = {"snapshots": not args.no_snapshots}
    uncapped = Hardening(cgroups=False, max_shm_bytes=None, max_scratch_bytes=None)
    makers: dict[str, Callable[[], Sandbox]] = {
        "inprocess": InProcessSandbox,
        "plain process": lambda: SubprocessSandbox(hardening=False, **snap),
        "hardened": lambda: SubprocessSandbox(**snap),
    }
    if args.caps:
        makers["hardened, caps off"] = lambda: SubprocessSandbox(hardening=uncapped, **snap)
    if find_bwrap() is not None:
        makers["hardened+bwrap"] = lambda: SubprocessSandbox(bwrap=True, **snap)
        if args.caps:
            makers["bwrap, caps off"] = lambda: SubprocessSandbox(bwrap=True, hardening=uncapped, **snap)
    table = Table(list(makers), column=22)
    put = table.put
    for kind, make in makers.items():
        started, harden = await startup(make)
        put("startup (median of 10)", kind, ms(started))
        if harden:
            put("  of which the worker hardening itself", kind, ms(harden))
        handler = Handler()
        sb = make()
        await sb.start(handler)
        try:
            put("isolation level", kind, str(sb.isolation.get("level", "?")))
            put("tasks capped by", kind, str(sb.isolation.get("tasks", "-")))
            await round_trips(sb, handler, table, kind)
        finally:
            await sb.close()
        if not args.quick:
            _encoded, loaded = await context_load(make, 200 * MB)
            put("context 200 MB: load_context (median of 3)", kind, ms(loaded))

    table.print()


if __name__ == "__main__":
    asyncio.run(main())
