"""Load: many RLM runs at once in one process, each with sub-calls and a child RLM.

Every run gets its own context (a seeded list of numbers) and must answer "sum|max|count" of it:
the root sums chunks with `llm_query_batched`, asks `llm_query` for the maximum, and hands the
count to a child RLM (`rlm_query`, max_depth=2) that asks its own `llm_query`. A run whose answer
is right therefore got every reply of its own tree back, and none of another run's.

Before and after the batch it counts the process's file descriptors (/proc/self/fd), threads
(threading.enumerate()), RSS and child processes (/proc), and while the runs go it samples how
many REPL workers exist at once. The fake OpenAI-compatible server runs in its own process, as a
real model server would, so its sockets and threads are not counted as ours.

    python benchmarks/load.py [--runs 200] [--sandbox auto] [--batches 1] [--latency 0.05] [--slots 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from recursa import RLM, Budget
from recursa.sandbox.proc import processes

ROOT_MODEL = "load-root"
SUB_MODEL = "load-sub"
CHUNK = 4
QUESTION = "Give sum|max|count of the numbers in the context."

ROOT_TURNS = (
    # Turn 1: sub-calls, batched and single.
    "```repl\n"
    "nums = context.split()\n"
    f"parts = llm_query_batched(['sum: ' + ' '.join(nums[k:k + {CHUNK}]) for k in range(0, len(nums), {CHUNK})])\n"
    "total = sum(int(p) for p in parts)\n"
    "biggest = llm_query('max: ' + context)\n"
    "print(total, biggest)\n"
    "```",
    # Turn 2: a child RLM with its own REPL counts the numbers.
    "```repl\ncount = rlm_query('How many numbers are there?', context=context)\n"
    "FINAL(f'{total}|{biggest}|{count}')\n```",
)
CHILD_TURNS = (
    "```repl\nn = llm_query('count: ' + context)\nprint(n)\n```",
    "FINAL_VAR(n)",
)


def responder(model: str, messages: list[dict[str, str]]) -> str:
    """The fake server's replies: scripted roots by model name, arithmetic for sub-calls."""
    if len(messages) > 1 and messages[0]["role"] == "system":
        turns = ROOT_TURNS if model == ROOT_MODEL else CHILD_TURNS
        done = sum(1 for m in messages if m["role"] == "assistant")
        return turns[min(done, len(turns) - 1)]
    op, _, rest = messages[-1]["content"].partition(": ")
    values = [int(v) for v in rest.split()]
    if op == "sum":
        return str(sum(values))
    if op == "max":
        return str(max(values))
    if op == "count":
        return str(len(values))
    return f"unknown request {op!r}"


def make_context(index: int) -> tuple[str, str]:
    """(context, expected answer) of run `index`: sizes and values differ from run to run."""
    rng = random.Random(index)
    nums = [rng.randint(1, 10_000) for _ in range(rng.randint(5, 24))]
    return " ".join(map(str, nums)), f"{sum(nums)}|{max(nums)}|{len(nums)}"


# -- what the process holds -------------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process, from /proc (Linux). Zombies included: a
    child the host never reaped is a leak too."""
    return {pid: (int(fields[1]), int(fields[3])) for pid, fields in processes()}


def descendants(table: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """Every process below this one."""
    table = _process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        for kid in children.get(todo.pop(), []):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def sandbox_processes(exclude: set[int]) -> tuple[int, int]:
    """(REPL sandboxes, processes below them) alive now. The host starts each local sandbox as a
    child in a session of its own (its worker, the keeper parent of its fork snapshots, bwrap's
    processes where bwrap is used, all below it)."""
    table = _process_table()
    below = descendants(table) - exclude
    me = os.getpid()
    sandboxes = sum(1 for pid in below if table[pid][0] == me and table[pid][1] == pid)
    return sandboxes, len(below)


def thread_count(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


@dataclass
class Snapshot:
    fds: int
    threads: int
    rss_mb: float
    children: set[int]
    thread_names: list[str] = field(default_factory=list)

    @classmethod
    def take(cls) -> Snapshot:
        gc.collect()
        threads = threading.enumerate()
        return cls(fd_count(), len(threads), rss_mb(), descendants(), sorted(t.name for t in threads))


def settle(before: Snapshot | None, timeout: float) -> Snapshot:
    """The state once no event loop runs, and closing sockets and exiting processes have caught up:
    a fake server in this process closes its side of a connection a moment after the client does."""
    deadline = time.monotonic() + timeout
    while True:
        now = Snapshot.take()
        if before is None:
            return now
        clean = now.fds <= before.fds and now.threads <= before.threads and now.children <= before.children
        if clean or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


# -- the batch --------------------------------------------------------------------------------


@dataclass
class LoadReport:
    runs: int
    correct: int
    wall_s: float
    latencies: list[float]
    peak: dict[str, float]  # the most sandboxes, processes, threads, fds and RSS seen at once
    before: Snapshot
    after: Snapshot
    errors: list[str]
    rss_trimmed_mb: float = float("nan")

    @property
    def leaked_pids(self) -> set[int]:
        return self.after.children - self.before.children

    @property
    def clean(self) -> bool:
        """Every answer right, and nothing left behind that was not there before."""
        b, a = self.before, self.after
        return (
            self.correct == self.runs and not self.leaked_pids and a.fds <= b.fds and a.threads <= b.threads
        )

    def table(self) -> str:
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) if lat else float("nan")
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan")
        b, a, pk = self.before, self.after, self.peak
        rows = [
            ("runs", f"{self.runs}"),
            ("correct answers", f"{self.correct}/{self.runs}"),
            ("wall time", f"{self.wall_s:.2f} s"),
            ("run latency p50 / p95 / max", f"{p50:.2f} / {p95:.2f} / {max(lat, default=0):.2f} s"),
            ("peak concurrent REPL sandboxes (their processes)", f"{pk['sandboxes']} ({pk['processes']})"),
            ("peak concurrent in-process REPL threads", f"{pk['repl_threads']}"),
            ("file descriptors before / peak / after", f"{b.fds} / {pk['fds']} / {a.fds}"),
            ("threads before / peak / after", f"{b.threads} / {pk['threads']} / {a.threads}"),
            ("child processes left", f"{len(self.leaked_pids)}"),
            ("RSS before / peak / after", f"{b.rss_mb:.0f} / {pk['rss']:.0f} / {a.rss_mb:.0f} MB"),
            ("RSS after malloc_trim", f"{self.rss_trimmed_mb:.0f} MB"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
        return "\n".join(lines)


def make_rlm(base_url: str, trace_dir: str, sandbox: str) -> RLM:
    return RLM(
        f"openai/{ROOT_MODEL}",
        sub_model=f"openai/{SUB_MODEL}",
        base_url=base_url,
        api_key="load-test-key",
        max_depth=2,
        max_iterations=6,
        sandbox=sandbox,
        trace_dir=trace_dir,
        budget=Budget(max_seconds=600),
        max_output_tokens=64,
    )


async def _batch(base_url: str, runs: int, sandbox: str, trace_dir: str, exclude: set[int]) -> dict:
    peak = {"sandboxes": 0, "processes": 0, "repl_threads": 0, "threads": 0, "fds": 0, "rss": 0.0}
    stop = asyncio.Event()

    async def sample() -> None:
        # /proc is walked in a thread: with hundreds of workers a walk takes a few ms.
        while not stop.is_set():
            try:
                sandboxes, processes = await asyncio.to_thread(sandbox_processes, exclude)
                now = {
                    "sandboxes": sandboxes,
                    "processes": processes,
                    "repl_threads": thread_count("recursa-inprocess-repl"),
                    "threads": threading.active_count(),
                    "fds": fd_count(),
                    "rss": rss_mb(),
                }
            except OSError:  # out of descriptors ourselves (a low `ulimit -n`): skip this sample
                now = {}
            for key, value in now.items():
                peak[key] = max(peak[key], value)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    async def one(index: int) -> tuple[bool, float, str]:
        context, expected = make_context(index)
        started = time.perf_counter()
        result = await make_rlm(base_url, trace_dir, sandbox).arun(QUESTION, context)
        ok = result.stop_reason == "final" and result.answer == expected
        why = f"run {index}: {result.stop_reason}, {result.answer!r} != {expected!r}: {result.error}"
        return ok, time.perf_counter() - started, "" if ok else why

    sampler = asyncio.create_task(sample())
    started = time.perf_counter()
    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(runs)), return_exceptions=True)
    finally:
        wall = time.perf_counter() - started
        stop.set()
        await sampler
    return {"outcomes": outcomes, "wall": wall, "peak": peak}


def run_load(
    base_url: str, runs: int, sandbox: str, trace_dir: str, *, batches: int = 1, settle_s: float = 10.0
) -> list[LoadReport]:
    """`batches` rounds of `runs` RLM runs at once, each round on a fresh event loop.

    "Before" is taken once, after one warm-up run (imports, the SDK's first use and the first
    worker start are one-off costs of a process, not leaks); each "after" once that round's loop is
    closed, as a server or notebook would see the process between batches. Every round is compared
    with the same "before", so a slow leak shows as growth from one round to the next.
    """
    warm_context, warm_expected = make_context(-1)
    warm = asyncio.run(make_rlm(base_url, trace_dir, sandbox).arun(QUESTION, warm_context))
    if warm.answer != warm_expected:
        raise RuntimeError(f"the warm-up run answered {warm.answer!r} ({warm.error}), not {warm_expected!r}")
    before = settle(None, 0)
    reports = []
    for _ in range(batches):
        batch = asyncio.run(_batch(base_url, runs, sandbox, trace_dir, before.children))
        after = settle(before, settle_s)
        latencies: list[float] = []
        errors: list[str] = []
        correct = 0
        for item in batch["outcomes"]:
            if isinstance(item, BaseException):
                errors.append(f"{type(item).__name__}: {item}")
                continue
            ok, latency, why = item
            correct += ok
            latencies.append(latency)
            if why:
                errors.append(why)
        report = LoadReport(runs, correct, batch["wall"], latencies, batch["peak"], before, after, errors)
        report.rss_trimmed_mb = trimmed_rss_mb()
        reports.append(report)
    return reports


def trimmed_rss_mb() -> float:
    """RSS after asking glibc to hand freed heap pages back to the kernel (malloc_trim): what is
    left is memory still in use, not the allocator's high-water mark. NaN where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return float("nan")
    return rss_mb()


# -- the fake server in its own process -------------------------------------------------------


def serve(port: int, latency: float, slots: int) -> None:
    from recursa.testing.fake_server import FakeServer

    with FakeServer(responder=responder, latency_s=latency, slots=slots, port=port):
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes our stdin


def start_server(latency: float, slots: int) -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--latency", str(latency), "--slots", str(slots)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        server.kill()
        raise RuntimeError("the fake server did not start")
    return server, f"http://127.0.0.1:{port}/v1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--sandbox", default="auto", help="auto | subprocess | inprocess")
    ap.add_argument("--latency", type=float, default=0.05, help="fake model latency per request (s)")
    ap.add_argument("--slots", type=int, default=256, help="fake server concurrency slots")
    ap.add_argument("--batches", type=int, default=1, help="rounds of --runs runs, one after another")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    # Asked for by name here: the in-process REPL's "no isolation" warning is known.
    warnings.filterwarnings("ignore", message='sandbox="inprocess"')
    if args.serve is not None:
        serve(args.serve, args.latency, args.slots)
        return
    server, base_url = start_server(args.latency, args.slots)
    try:
        with tempfile.TemporaryDirectory(prefix="recursa-load-") as traces:
            reports = run_load(base_url, args.runs, args.sandbox, traces, batches=args.batches)
            trace_files = len(list(Path(traces).glob("*.jsonl")))
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)
    print(
        f"{args.runs} concurrent runs x {args.batches} batch(es), sandbox={args.sandbox}, fake model "
        f"{args.latency * 1000:.0f} ms per request, {args.slots} server slots; {trace_files} traces"
    )
    failed = False
    for number, report in enumerate(reports, 1):
        print(f"\nbatch {number}\n{report.table()}")
        if report.errors:
            print(f"{len(report.errors)} problems, first 10:")
            for line in report.errors[:10]:
                print("  " + line)
        if report.leaked_pids:
            print(f"leaked processes: {sorted(report.leaked_pids)}")
        if report.after.thread_names != report.before.thread_names:
            print(
                f"threads before: {report.before.thread_names}\nthreads after:  {report.after.thread_names}"
            )
        failed = failed or not report.clean
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
