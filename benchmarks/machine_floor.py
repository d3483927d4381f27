"""The machine's floors under a REPL round trip: what forking, copy-on-write and an idle CPU cost here.

    python benchmarks/machine_floor.py [--size-mb 100] [--repeat 30] [--pauses-ms 10,50]

No engine change removes these costs: they bound from below the engine's own time per root turn
(`benchmarks/turn_overhead.py`) on the machine this runs on. Standard library only, Linux; a row
whose OS feature is missing prints the reason instead of a figure. Each figure is the median over
--repeat runs, with the middle half of the runs (25th to 75th percentile) beside it. Nothing here
imports recursa: the processes measured are plain Python.

Fork snapshots (the worker forks itself after every cell to keep the state from before the next
one, so a snapshot per cell must fork, and the cell after it must take its faults):

- fork(): the parent's wall time in os.fork() in a fresh Python process holding nothing else, then
  holding a --size-mb ASCII str advised MADV_HUGEPAGE before it is written (as the worker's context
  loader, recursa/sandbox/worker/context.py, does), then the same str advised MADV_NOHUGEPAGE
  (4 KiB pages whatever the transparent huge page setting). The kernel copies the page tables of
  everything mapped: one entry per 2 MiB huge page, 512 for the same memory in 4 KiB pages.
- copy-on-write, per page: one byte written to each of 2,000 private anonymous 4 KiB pages (mmap
  MAP_PRIVATE | MAP_ANONYMOUS, each written once before): with no fork (the baseline: no fault),
  while a forked child that sleeps shares them (each write copies the page: a copy fault), and
  after that child has written every page itself (the parent's page is its own again and is
  taken back without a copy: a reuse fault).
- trivial cell: the minor faults (getrusage ru_minflt) and the wall time of compile() + exec() of
  a 2-line cell right after this process forked a child that sleeps, against the same cell with no
  fork before it. CPython writes reference counts all over its heap, so the first cell after each
  snapshot takes a few hundred copy faults.

Idle tax (a turn after the model's think time starts on a cold CPU): the same small work back to
back and right after sleeping each of --pauses-ms: compile() + exec() of the 2-line cell, json
dumps + loads of a small dict, a pure-Python loop, and a 64-byte round trip over a socketpair to a
forked echo process. While a process sleeps its core idles or runs something else; caches, TLBs
and branch predictors go cold, a virtual CPU may be descheduled, and waking a sleeping process on
another core takes longer than handing over to one that is about to wait.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MB = 1_000_000
PAGES = 2000
CELL = "x = sum(range(50))\ny = str(x) * 2\n"
SMALL = {"role": "user", "content": "what is the total?", "n": [1, 2, 3], "ok": True, "score": 0.5}
_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass
class Row:
    what: str
    case: str
    samples: list[float]
    unit: str  # "ms", "us" or "faults"
    note: str = ""
    skipped: str = ""  # why there is no figure


def fmt(value: float, unit: str) -> str:
    if unit == "faults":
        return f"{value:.0f}"
    return f"{value:.3f} ms" if unit == "ms" else f"{value:.2f} us"


def middle_half(samples: list[float], unit: str) -> str:
    if len(samples) < 2:
        return ""
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return f"{fmt(q1, unit)} - {fmt(q3, unit)}"


def minflt() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def thp_mode() -> str | None:
    try:
        text = _THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def memory_mb() -> tuple[float, float]:
    """This process's resident memory and the part of it in transparent huge pages, in MB."""
    rss = huge = 0.0
    for path, key in (("/proc/self/status", "VmRSS:"), ("/proc/self/smaps_rollup", "AnonHugePages:")):
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    value = int(line.split()[1]) * 1024 / MB
                    rss, huge = (value, huge) if key == "VmRSS:" else (rss, value)
        except (OSError, ValueError, IndexError):
            pass
    return rss, huge


# --- fork: in a fresh process per case, so one case's memory does not weigh on the next ---


def make_context(size: int, advice: int) -> str:
    """An ASCII str of `size` characters whose storage was advised before its first write.

    The worker's loader does the same (allocate, advise, fill): advice given after the pages are
    touched would leave them in 4 KiB pages until khugepaged gets round to them.
    """
    import ctypes

    new = ctypes.pythonapi.PyUnicode_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_ssize_t, ctypes.c_uint32]
    text = new(size, 127)
    data = id(text) + sys.getsizeof("") - 1  # a compact ASCII str's characters follow its header
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = (data + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (data + size) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        madvise(start, end - start, advice)
    ctypes.memset(data, ord("x"), size)
    return text


def probe_fork(kind: str, size_mb: int, repeat: int) -> None:
    """Run in a child process: time os.fork() `repeat` times and print the result as JSON."""
    advice = {"huge": _MADV_HUGEPAGE, "small": _MADV_NOHUGEPAGE}.get(kind)
    try:
        text = make_context(size_mb * MB, advice) if advice else ""
    except (ImportError, AttributeError) as exc:  # no ctypes, or no madvise in the C library
        print(json.dumps({"skip": f"cannot advise memory here ({exc})"}))
        return
    times = []
    for _ in range(repeat + 1):  # the first fork also faults in what the later ones reuse
        r, w = os.pipe()
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # a snapshot waits, holding the pages
            os._exit(0)
        times.append((time.perf_counter() - started) * 1000)
        os.close(r)
        os.close(w)
        os.waitpid(pid, 0)
    rss, huge = memory_mb()
    print(json.dumps({"ms": times[1:], "rss_mb": rss, "huge_mb": huge}))
    del text


def fork_rows(size_mb: int, repeat: int) -> list[Row]:
    rows = []
    mode = thp_mode()
    cases = [
        ("bare", "a bare Python process", ""),
        ("huge", f"holding a {size_mb} MB str, MADV_HUGEPAGE", ""),
        ("small", f"holding a {size_mb} MB str, MADV_NOHUGEPAGE", ""),
    ]
    if mode in (None, "never"):
        why = "no transparent huge pages here" if mode is None else "transparent huge pages are off (never)"
        cases[1] = (cases[1][0], cases[1][1], why)
    for kind, case, why in cases:
        if why:
            rows.append(Row("fork()", case, [], "ms", skipped=why))
            continue
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                *("--probe-fork", kind, "--size-mb", str(size_mb), "--repeat", str(max(repeat, 5))),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            sys.exit(f"the fork probe ({kind}) exited {done.returncode}:\n{done.stderr.strip()}")
        got = json.loads(done.stdout)
        if "skip" in got:
            rows.append(Row("fork()", case, [], "ms", skipped=got["skip"]))
            continue
        note = f"RSS {got['rss_mb']:.0f} MB, {got['huge_mb']:.0f} MB of it in huge pages"
        rows.append(Row("fork()", case, got["ms"], "ms", note))
    return rows


# --- copy-on-write faults, per page ---


def cow_rows(repeat: int) -> list[Row]:
    cases = [
        ("none", "write, no fork (baseline)"),
        ("copy", "copy fault (a sleeping child shares the page)"),
        ("reuse", "reuse fault (the child copied the page first)"),
    ]
    results: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode, _ in cases}
    for _ in range(repeat):
        for mode, _case in cases:
            per_page, faults = cow_once(mode)
            results[mode][0].append(per_page)
            results[mode][1].append(faults)
    rows = []
    for mode, case in cases:
        per_page, faults = results[mode]
        note = f"{statistics.median(faults):.2f} minor faults per page"
        rows.append(Row(f"copy-on-write, per 4 KiB page of {PAGES:,}", case, per_page, "us", note))
    return rows


def cow_once(mode: str) -> tuple[float, float]:
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, PAGES * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages even where THP is "always"
    view = memoryview(region)
    first, child_bytes, parent_bytes = b"\x01" * PAGES, b"\x02" * PAGES, b"\x03" * PAGES
    view[::page] = first  # present and private before any fork
    pid, go_w = 0, -1
    if mode != "none":
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)  # or the read below never sees the parent's end close
                if mode == "reuse":
                    view[::page] = child_bytes
                os.write(ready_w, b"r")
                os.read(go_r, 1)
            finally:
                os._exit(0)
        os.read(ready_r, 1)
        for fd in (go_r, ready_r, ready_w):
            os.close(fd)
    before = minflt()
    started = time.perf_counter()
    view[::page] = parent_bytes  # one byte per page, the loop in C
    elapsed = time.perf_counter() - started
    faults = minflt() - before
    if pid:
        os.close(go_w)
        os.waitpid(pid, 0)
    view.release()
    region.close()
    return elapsed * 1e6 / PAGES, faults / PAGES


# --- a trivial cell right after a fork ---


def run_cell(namespace: dict) -> None:
    exec(compile(CELL, "<cell>", "exec"), namespace)


def cell_rows(repeat: int) -> list[Row]:
    faults: dict[bool, list[float]] = {False: [], True: []}
    walls: dict[bool, list[float]] = {False: [], True: []}
    namespace: dict = {}
    for _ in range(repeat):
        for forked in (False, True):
            pid = w = 0
            if forked:
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(w)
                    os.read(r, 1)
                    os._exit(0)
                os.close(r)
            else:
                for _ in range(3):  # takes back, fault by fault, what the last fork left shared
                    run_cell(namespace)
            before = minflt()
            started = time.perf_counter()
            run_cell(namespace)
            walls[forked].append((time.perf_counter() - started) * 1000)
            faults[forked].append(minflt() - before)
            if forked:
                os.close(w)
                os.waitpid(pid, 0)
    what = "trivial cell, compile() + exec()"
    return [
        Row(what, "minor faults, no fork before it", faults[False], "faults"),
        Row(what, "minor faults, right after a fork", faults[True], "faults"),
        Row(what, "wall, no fork before it", walls[False], "ms"),
        Row(
            what,
            "wall, right after a fork",
            walls[True],
            "ms",
            extra(walls[True], statistics.median(walls[False])),
        ),
    ]


# --- the idle tax ---


def timed_after(work: Callable[[], object], pauses: list[float], repeat: int) -> dict[float, list[float]]:
    """Milliseconds per call of `work`: back to back (pause 0, after three unmeasured calls) and
    right after sleeping each pause; the cases take turns so that drift weighs on all alike."""
    out: dict[float, list[float]] = {0.0: [], **{p: [] for p in pauses}}
    for _ in range(repeat):
        for pause in out:
            if pause:
                time.sleep(pause)
            else:
                for _ in range(3):
                    work()
            started = time.perf_counter()
            work()
            out[pause].append((time.perf_counter() - started) * 1000)
    return out


def python_loop() -> int:
    total = 0
    for i in range(2000):
        total += i * i
    return total


def idle_rows(pauses: list[float], repeat: int) -> list[Row]:
    namespace: dict = {}
    works: list[tuple[str, Callable[[], object]]] = [
        ("compile() + exec() of a 2-line cell", lambda: run_cell(namespace)),
        ("json dumps + loads of a small dict", lambda: json.loads(json.dumps(SMALL))),
        ("pure-Python loop, 2,000 steps", python_loop),
    ]
    rows = []
    for what, work in works:
        rows += idle_case_rows(f"idle tax: {what}", timed_after(work, pauses, repeat))
    what = "idle tax: socketpair round trip, 64 bytes"
    if not hasattr(socket, "socketpair") or not hasattr(os, "fork"):
        return [*rows, Row(what, "", [], "ms", skipped="no socketpair or fork here")]
    return rows + idle_case_rows(what, ping_pong(pauses, repeat))


def ping_pong(pauses: list[float], repeat: int) -> dict[float, list[float]]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            while data := theirs.recv(4096):
                theirs.sendall(data)
        finally:
            os._exit(0)
    theirs.close()
    message = b"m" * 64

    def round_trip() -> None:
        ours.sendall(message)
        got = 0
        while got < len(message):
            got += len(ours.recv(4096))

    try:
        return timed_after(round_trip, pauses, repeat)
    finally:
        ours.close()  # end of file: the echo process exits
        os.waitpid(pid, 0)


def idle_case_rows(what: str, times: dict[float, list[float]]) -> list[Row]:
    base = statistics.median(times[0.0])
    rows = [Row(what, "back to back", times[0.0], "ms")]
    for pause, samples in times.items():
        if pause:
            rows.append(Row(what, f"after {pause * 1000:g} ms asleep", samples, "ms", extra(samples, base)))
    return rows


def extra(samples: list[float], base: float) -> str:
    """How much longer the median of `samples` (ms) is than `base`: the tax, absolute and relative."""
    median = statistics.median(samples)
    ratio = f" (x{median / base:.1f})" if base > 0 else ""
    return f"{median - base:+.3f} ms{ratio}"


# --- the report ---


def table(rows: list[Row]) -> str:
    lines = ["| what | case | median | middle half | runs | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.what} | {r.case} | - | - | 0 | skipped: {r.skipped} |")
            continue
        median = fmt(statistics.median(r.samples), r.unit)
        lines.append(
            f"| {r.what} | {r.case} | {median} | {middle_half(r.samples, r.unit)} | {len(r.samples)} | {r.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=100, help="the context str the fork rows hold (MB)")
    ap.add_argument("--repeat", type=int, default=30, help="runs per row (the fork rows take at least 5)")
    ap.add_argument("--pauses-ms", default="10,50", help="comma-separated sleeps before the idle rows")
    ap.add_argument("--probe-fork", choices=("bare", "huge", "small"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.size_mb < 1 or args.repeat < 1:
        ap.error("--size-mb and --repeat take a positive whole number")
    try:
        pauses = [float(p) / 1000 for p in args.pauses_ms.split(",") if p.strip()]
    except ValueError:
        ap.error(f"--pauses-ms takes comma-separated milliseconds, e.g. 10,50 (got {args.pauses_ms!r})")
    if not pauses or min(pauses) <= 0:
        ap.error("--pauses-ms takes one or more positive numbers of milliseconds, e.g. 10,50")
    if args.probe_fork:
        probe_fork(args.probe_fork, args.size_mb, args.repeat)
        return
    load = "{:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"transparent huge pages: {thp_mode() or 'unavailable'}, load average at start {load}\n"
    )
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        why = "needs Linux (fork, copy-on-write, /proc)"
        rows = [Row("fork(), copy-on-write, cell after a fork", "", [], "ms", skipped=why)]
    else:
        rows = fork_rows(args.size_mb, args.repeat) + cow_rows(args.repeat) + cell_rows(args.repeat)
    rows += idle_rows(pauses, args.repeat)
    print(table(rows))


if __name__ == "__main__":
    main()
