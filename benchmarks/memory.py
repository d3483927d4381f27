"""Peak memory and trace size against context size.

Each size runs in a fresh process, which samples every few ms, at the same instant: its own memory,
the pages held by the context's memfd (every `/memfd:` file open in this process or its children,
counted once, from its allocated blocks) and the memory of every process below it (the REPL worker,
its fork snapshots, bwrap). Memory is the proportional set size without shared memory (a page
shared by n processes counts 1/n in each), so a snapshot adds only the pages it has copied. "at
once" is the peak of the three together, above the start, minus the same for a run with a 1 KB
context (the interpreter and lazily imported modules are not the context's cost). Counting the memfd itself rather than the
machine's `Shmem` keeps other processes' shared memory out of the figure on a busy machine.

    python benchmarks/memory.py [--sizes-mb 10,100,1000] [--kind str|list] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from vs_official.side import descendants, memfd_mb  # one way of counting for both scripts

LINE = "Date: Jan 01, 2020 || User: 12345 || Instance: what is the capital of some country?\n"


def _pss(pid: int | str) -> int:
    """Proportional set size without shared memory: a page shared by n processes counts 1/n in
    each, so a fork (a snapshot, or a child between fork and exec) adds only what it copies, and
    a memfd a process maps is left to the memfd's own count."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Pss_Anon:", "Pss_File:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


class Sampler(threading.Thread):
    """Peaks of the host's memory, the context memfd, the REPL processes', and of the three at the
    same instant."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.running = True
        self.start_values = self.sample()
        self.peaks = dict(self.start_values)

    @staticmethod
    def sample() -> dict[str, int]:
        me = os.getpid()
        # A child between vfork and exec shares this process's memory (the context string
        # included) and reports all of it: counted, it read as a second copy of the context.
        kids = descendants(me)  # without a child between vfork and exec (see side.py)
        worker = sum(_pss(p) for p in kids)
        host, memfd = _pss(me), int(memfd_mb([me, *kids]) * 2**20)
        return {"host": host, "memfd": memfd, "worker": worker, "at_once": host + memfd + worker}

    def run(self) -> None:
        while self.running:
            for key, value in self.sample().items():
                self.peaks[key] = max(self.peaks[key], value)
            time.sleep(0.002)

    def stop(self) -> dict[str, int]:
        self.running = False
        self.join()
        return {key: self.peaks[key] - self.start_values[key] for key in self.peaks}


def child(size: int, kind: str) -> None:
    """One run in this (fresh) process; prints one JSON line."""
    from recursa import RLM
    from recursa.scripted import register

    @register("bench-mem")
    def _factory():  # two cells that touch the context, then the answer
        def policy(messages: list[dict]) -> str:
            done = sum(1 for m in messages if m["role"] == "assistant")
            if done < 2:
                return "```repl\nprint(len(context))\n```"
            return "FINAL(done)"

        return policy

    if kind == "str":
        context: str | list[str] = LINE * max(1, size // len(LINE))
        chars = len(context)
    else:
        pieces = [LINE * 100] * max(1, size // (len(LINE) * 100))
        context = [s[:-1] + str(i) for i, s in enumerate(pieces)]  # distinct objects, like real data
        chars = sum(map(len, context))
    sampler = Sampler()
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        result = RLM("scripted/bench-mem", trace_dir=tmp, max_iterations=5).run("q", context)
        peaks = sampler.stop()
        if result.answer != "done":
            sys.exit(f"the run did not finish: {result.stop_reason}: {str(result.answer)[:200]}")
        trace_bytes = os.path.getsize(result.trace_path)
    print(json.dumps({"chars": chars, "trace_bytes": trace_bytes, **peaks}), flush=True)


def run_child(size: int, kind: str) -> dict[str, int]:
    cmd = [sys.executable, __file__, "--child", str(size), "--kind", kind]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"memory run of {size:,} bytes failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="10,100,1000")
    ap.add_argument("--kind", default="str", choices=["str", "list"])
    ap.add_argument("--repeat", type=int, default=1, help="runs per size (each row is one run)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.kind)
        return
    idle = run_child(1000, args.kind)
    mb = 2**20
    print(f"context kind: {args.kind}; figures above a run with a 1 KB context; 3 root turns\n")
    print("| context | host + | memfd peak | worker + | at once | at once / context | trace |")
    print("|---|---|---|---|---|---|---|")
    for size in (int(x) for x in args.sizes_mb.split(",")):
        for _ in range(args.repeat):
            row = run_child(size * mb, args.kind)
            host, worker = row["host"] - idle["host"], row["worker"] - idle["worker"]
            at_once = row["at_once"] - idle["at_once"]
            print(
                f"| {row['chars'] / mb:.0f} MB | {host / mb:.0f} MB | {row['memfd'] / mb:.0f} MB "
                f"| {worker / mb:.0f} MB | {at_once / mb:.0f} MB | {at_once / row['chars']:.2f}x "
                f"| {row['trace_bytes'] / 1024:.1f} KB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
