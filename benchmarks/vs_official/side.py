"""Runs one case on one engine and prints one JSON line (run by run.py, never imported).

    python side.py --engine recursa|official|minrlm --base-url URL --question Q [--context-mb N] ...

The official package and minrlm run under the interpreters of their own virtual environments, so
this file imports no engine at module level and uses only the standard library otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT_MODEL = "bench-root"
SUB_MODEL = "bench-sub"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memfd_mb(pids: list[int]) -> float:
    """Pages held by the memfds open in these processes, each counted once (a memfd's pages are in
    no process's RSS while nobody maps it). Only the run's own: the machine's Shmem figure moves
    with every other process's shared memory on a busy machine."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if not os.readlink(path).startswith("/memfd:"):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total / 2**20


def _rss_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, except a child between vfork and exec: it shares this process's
    memory (the user's context string included) and reports all of it as its own, which a sampler
    catches more often the busier the machine is (it read as 2x the context)."""
    found, queue, own = [], [pid], _cmdline(pid)
    while queue:
        for task in Path(f"/proc/{queue.pop()}/task").glob("*"):
            try:
                kids = [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
            kids = [k for k in kids if _cmdline(k) != own]
            found += kids
            queue += kids
    return found


class MemoryPeaks(threading.Thread):
    """Samples every few ms: this process's RSS, the pages of the run's memfds (the context buffer) and
    the RSS of the largest process below this one (the REPL worker; its fork snapshots and helpers
    share or hold little, so summing them would count the worker's pages twice). Keeps the peak of
    the buffer and of the three together: what the run holds at once."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.running = True
        self.start_values = self._sample()
        self.peaks = dict(self.start_values)

    @staticmethod
    def _sample() -> dict[str, float]:
        kids = descendants(os.getpid())
        host, buffer = rss_mb(), memfd_mb([os.getpid(), *kids])
        worker = max((_rss_of(p) for p in kids), default=0.0)
        return {"shmem": buffer, "at_once": host + buffer + worker}

    def run(self) -> None:
        while self.running:
            for key, value in self._sample().items():
                self.peaks[key] = max(self.peaks[key], value)
            time.sleep(0.002)

    def stop(self) -> dict[str, float]:
        self.running = False
        self.join()
        return {key: max(0.0, self.peaks[key] - self.start_values[key]) for key in self.peaks}


def child_pids() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def run_recursa(args: argparse.Namespace, context: str, trace_dir: str) -> tuple[str, int]:
    from recursa import RLM

    rlm = RLM(
        f"openai/{ROOT_MODEL}",
        sub_model=f"openai/{SUB_MODEL}",
        base_url=args.base_url,
        api_key="local",
        trace_dir=trace_dir,
        max_depth=args.max_depth,
        max_iterations=args.max_iterations,
        max_concurrency=args.concurrency,
    )
    result = rlm.run(args.question, context)
    size = os.path.getsize(result.trace_path) if result.trace_path else 0
    return str(result.answer), size


def run_official(args: argparse.Namespace, context: str, trace_dir: str) -> tuple[str, int]:
    from rlm import RLM
    from rlm.logger import RLMLogger

    # Its JSONL trajectory is the official counterpart of a trace; off by default there.
    logger = None if args.no_trace else RLMLogger(log_dir=trace_dir)
    kwargs = {"base_url": args.base_url, "api_key": "local"}
    rlm = RLM(
        backend="openai",
        backend_kwargs={"model_name": ROOT_MODEL, **kwargs},
        environment="local",
        max_depth=args.max_depth,
        max_iterations=args.max_iterations,
        other_backends=["openai"],
        other_backend_kwargs=[{"model_name": SUB_MODEL, **kwargs}],
        logger=logger,
    )
    result = rlm.completion(context, root_prompt=args.question)
    path = logger.log_file_path if logger is not None else None
    size = os.path.getsize(path) if path and os.path.exists(path) else 0
    return str(result.response), size


def run_minrlm(args: argparse.Namespace, context: str, trace_dir: str) -> tuple[str, int]:
    from minrlm import RLM  # its default class (RLMReasoning), as its README uses it

    # Its defaults except the limits a long benchmark would hit: 6 iterations (the cases take up to
    # 11 turns; the others get 40 too), 120 s per completion, and 100 sub-calls per run (the
    # fan-out case makes up to 1,024). It has one model for the root and its sub-calls, and runs
    # code with exec() in this process. Its JSONL log (log_dir) is its counterpart of a trace.
    rlm = RLM(
        model=ROOT_MODEL,
        base_url=args.base_url,
        api_key="local",
        max_iterations=args.max_iterations,
        max_time_seconds=3600,
        max_sub_llm_calls=1_000_000,
        log_dir=None if args.no_trace else trace_dir,
    )
    result = rlm.completion(args.question, context)
    path = result.log_file_path
    size = os.path.getsize(path) if path and os.path.exists(path) else 0
    return str(result.response), size


def run_recursive_llm(args: argparse.Namespace, context: str, trace_dir: str) -> tuple[str, int]:
    # LiteLLM fetches its model price list from the network at import unless told to use its copy.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from rlm import RLM  # recursive-llm's module has the official package's name (own venv)

    # Its defaults (a spawned worker process running RestrictedPython, LiteLLM for the calls),
    # with the sub-model named and the others' iteration limit. It keeps no log on disk.
    rlm = RLM(
        model=f"openai/{ROOT_MODEL}",
        recursive_model=f"openai/{SUB_MODEL}",
        api_base=args.base_url,
        api_key="local",
        max_depth=args.max_depth,
        max_iterations=args.max_iterations,
    )
    return str(rlm.complete(args.question, context)), 0


RUNNERS = {
    "recursa": run_recursa,
    "official": run_official,
    "minrlm": run_minrlm,
    "recursive-llm": run_recursive_llm,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=sorted(RUNNERS), required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--question", required=True)
    ap.add_argument("--context-mb", type=float, default=0.001)
    ap.add_argument("--max-depth", type=int, default=1)
    ap.add_argument("--max-iterations", type=int, default=40)
    ap.add_argument(
        "--no-trace", type=int, default=0, help="official, minrlm: no trajectory log (their default)"
    )
    ap.add_argument(
        "--mark-cpu", type=int, default=0, help="1: name this process in the question (PID[n]) for the server"
    )
    ap.add_argument("--concurrency", type=int, default=64, help="recursa max_concurrency (its default)")
    ap.add_argument("--sample-memory", type=int, default=0, help="sample peak memory every 2 ms (costs CPU)")
    args = ap.parse_args()
    # Import the engine before the baseline so its modules are not counted as context memory.
    if args.engine == "recursa":
        import recursa  # noqa: F401
    elif args.engine == "minrlm":
        import minrlm  # noqa: F401
    else:
        if args.engine == "recursive-llm":
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import rlm  # noqa: F401  (the official package's module, or recursive-llm's)
    context = "abcdefghij" * max(1, int(args.context_mb * 2**20) // 10)
    baseline_mb = rss_mb()
    if args.mark_cpu:  # the scripted server reads this process tree's CPU time at each root request
        args.question += f" PID[{os.getpid()}]"
    out: dict[str, Any] = {"engine": args.engine, "pid": os.getpid()}
    # Only for the memory case: walking /proc every 2 ms takes CPU and the GIL from the engine it
    # measures (20 child RLMs: ~80 processes to walk), which timed cases would count as the engine's.
    memory = MemoryPeaks() if args.sample_memory else None
    if memory is not None:
        memory.start()
    threads_before = {t.ident for t in threading.enumerate()}  # the sampler is not the run's
    with tempfile.TemporaryDirectory() as trace_dir:
        started = time.perf_counter()
        try:
            answer, trace_bytes = RUNNERS[args.engine](args, context, trace_dir)
            out.update(answer=answer, trace_bytes=trace_bytes)
        except Exception as exc:  # reported as the result of the case, not a crash of the table
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        returned = time.perf_counter()
        # Quiet: no threads the run started are left and no child process is alive.
        deadline = returned + 5.0
        while time.perf_counter() < deadline:
            extra = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
            if not extra and not child_pids():
                break
            time.sleep(0.001)
        quiet = time.perf_counter()
        extra = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    out.update(
        started_at=started,
        returned_at=returned,
        wall_s=returned - started,
        quiet_s=quiet - returned,
        left_threads=extra,
        left_children=len(child_pids()),
        context_mb=len(context) / 2**20,
        host_peak_above_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mb,
        sampled_peaks_mb=memory.stop() if memory is not None else {},
        children_peak_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
