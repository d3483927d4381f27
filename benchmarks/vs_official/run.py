"""recursa side by side with the official `rlms` package, minrlm and recursive-llm, on one fake server.

    python benchmarks/vs_official/run.py [all|fanout|depth|overhead|memory|cache] [--smoke] [--busy]
        [--engines recursa,official,minrlm,recursive-llm] [--repeat N] [--turns N] [--sizes-mb 1,100]
        [--official-python PATH] [--minrlm-python PATH] [--recursive-llm-python PATH]

The other engines (pinned: rlms==0.1.3, minrlm==0.1.5, recursive-llm==0.5.0) are installed by this
script, each into its own virtual environment (~/.cache/recursa/bench/rlms-0.1.3, .../minrlm-0.1.5,
.../recursive-llm-0.5.0), never into the project's. Every engine runs as a fresh process against the same fake server process
(recursa.testing.FakeServer with the scripted root in responder.py; for the fan-out case the lean
server of benchmarks/_lean_server.py, whose CPU per request does not hold the batch back), one case
at a time, and every table prints them all and their ratios to recursa. --busy runs the cases beside
a process that keeps one CPU busy (the depth target's setting).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

HERE = Path(__file__).resolve().parent
BENCH_VENVS = Path.home() / ".cache" / "recursa" / "bench"
# engine -> (PyPI distribution, pinned version); recursa runs under this interpreter.
PINNED = {
    "official": ("rlms", "0.1.3"),
    "minrlm": ("minrlm", "0.1.5"),
    "recursive-llm": ("recursive-llm", "0.5.0"),
}
ENGINES = ("recursa", "official", "minrlm", "recursive-llm")
LABELS = {e: e if e == "recursa" else f"{e} {PINNED[e][1]}" for e in ENGINES}
LABELS["official"] = "official 0.1.3"
# Engines the scripted root writes other code for (responder.py); the official package's question
# is recursa's, word for word.
OWN_DIALECT = ("minrlm", "recursive-llm")
# Engines whose REPL is a child process holding its own copy of the context.
REPL_IN_CHILD = ("recursa", "recursive-llm")
TRACE_IN_OVERHEAD = {
    "recursa": "JSONL",
    "official": "off (default)",
    "minrlm": "off (default)",
    "recursive-llm": "none on disk",
}
# What an engine cannot run in the fan-out and depth cases (the per-turn cases run on every engine).
NO_TIMED_CELLS = {
    "recursive-llm": "not run: its RestrictedPython REPL refuses the timed cell (names starting with _, imports)"
}


def venv_python(engine: str, given: str | None = None) -> str:
    """The interpreter of the engine's own virtual environment with its pinned package, made on
    first use (one per pin, so a new pin never changes the environment of an old one)."""
    if given:
        return given
    package, version = PINNED[engine]
    venv = BENCH_VENVS / f"{package}-{version}"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"]
    if python.exists() and subprocess.run(probe, capture_output=True, text=True).stdout.strip() == version:
        return str(python)
    print(f"installing {package}=={version} into {venv} ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"{package}=={version}"], check=True)
    return str(python)


class Server:
    """The fake server in its own process (as a real model server would be)."""

    def __init__(
        self, profile: str, latency: float | None = None, slots: int | None = None, lean: bool = False
    ) -> None:
        cmd = [sys.executable, str(HERE / "server.py"), "--profile", profile]
        cmd += ["--latency", str(latency)] if latency is not None else []
        cmd += ["--slots", str(slots)] if slots is not None else []
        cmd += ["--lean"] if lean else []
        self.cpu_dir = tempfile.TemporaryDirectory(prefix="recursa-bench-cpu-")
        env = {**os.environ, "BENCH_CPU_DIR": self.cpu_dir.name}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.root = f"http://127.0.0.1:{line[1]}"
        self.base_url = f"{self.root}/v1"

    def ledger(self) -> list[dict[str, Any]]:
        with urlopen(f"{self.root}/ledger") as r:
            return json.load(r)

    def cpu_marks(self, pid: int) -> list[tuple[float, int]]:
        """(time, CPU ns of the process tree) at each root request of the run in process `pid`."""
        path = Path(self.cpu_dir.name) / f"{pid}.txt"
        if not path.exists():
            return []
        return [(float(t), int(c)) for t, c in (ln.split() for ln in path.read_text().splitlines())]

    def reset(self, keep_cache: bool = False) -> None:
        query = "?keep_cache=true" if keep_cache else ""
        with urlopen(Request(f"{self.root}/ledger/reset{query}", method="POST")) as r:
            r.read()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.cpu_dir.cleanup()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.engines = [e for e in args.engines.split(",") if e]
        self.python = {"recursa": sys.executable}
        given = {
            "official": args.official_python,
            "minrlm": args.minrlm_python,
            "recursive-llm": args.recursive_llm_python,
        }
        for engine in self.engines:
            if engine != "recursa":
                self.python[engine] = venv_python(engine, given.get(engine))
        self.smoke = args.smoke
        self.repeat = max(1, args.repeat)
        self.turns = max(3, args.turns) if args.turns else None
        self.sizes_mb = [float(x) for x in args.sizes_mb.split(",") if x] if args.sizes_mb else None

    def side(
        self, srv: Server, engine: str, question: str, timeout: float = 900, warm: bool = False, **opts: Any
    ) -> dict[str, Any]:
        srv.reset(keep_cache=warm)
        if engine in OWN_DIALECT:  # the scripted root writes the engine's dialect (responder.py)
            question += f" ENGINE[{engine}]"
        cmd = [self.python[engine], str(HERE / "side.py"), "--engine", engine, "--base-url", srv.base_url]
        cmd += ["--question", question]
        for key, value in opts.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish in {timeout:.0f} s", "ledger": srv.ledger()}
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {done.returncode}: {' | '.join(tail)}"[:300], "ledger": srv.ledger()}
        out = json.loads(lines[-1])
        out["ledger"] = srv.ledger()
        out["cpu_marks"] = srv.cpu_marks(out["pid"]) if "pid" in out else []
        return out


def _elapsed(r: dict[str, Any]) -> tuple[int, float] | None:
    """(correct answers, seconds measured inside the REPL) from a timed case's answer."""
    try:
        count, secs = str(r.get("answer", "")).split()
        return int(count), float(secs)
    except ValueError:
        return None


def _fmt(x: float | None, unit: str = "s", digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f} {unit}".strip()


def _failure(r: dict[str, Any]) -> str:
    # One line: an engine's answer may be a whole prompt, and a table cell ends at a newline.
    return " ".join(f"failed: {r.get('error') or r.get('answer')}".split())[:120]


def _table(head: list[str], rows: list[list[str]]) -> None:
    """A Markdown table; short rows (a failed case) are padded with empty cells."""
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row + [""] * (len(head) - len(row))) + " |")
    print(flush=True)


def _engine_head() -> list[str]:
    return [LABELS[e] for e in ENGINES]


def _ratio_head() -> list[str]:
    return [f"{e}/recursa" for e in ENGINES if e != "recursa"]


def _timed_row(
    bench: Bench,
    srv: Server,
    label: str,
    question: str,
    n: int,
    ideal: float,
    unsupported: dict[str, str] | None = None,
    **opts: Any,
) -> list[str]:
    cells: dict[str, str] = {}
    secs: dict[str, float] = {}
    unsupported = {**NO_TIMED_CELLS, **(unsupported or {})}
    for engine in ENGINES:
        if engine not in bench.engines:
            cells[engine] = "not run"
            continue
        if engine in unsupported:
            cells[engine] = unsupported[engine]
            continue
        r = bench.side(srv, engine, question, **opts)
        got = _elapsed(r)
        if got is None:
            cells[engine] = _failure(r)
            continue
        count, secs[engine] = got
        note = "" if count == n else f" ({count}/{n} answers)"
        cells[engine] = f"{secs[engine]:.3f} s{note}"
    ratios = [
        f"{secs[e] / secs['recursa']:.1f}x" if e in secs and "recursa" in secs else "-"
        for e in ENGINES
        if e != "recursa"
    ]
    vs_ideal = f"{secs['recursa'] / ideal:.2f}" if "recursa" in secs and ideal else "-"
    return [label, str(n), *(cells[e] for e in ENGINES), _fmt(ideal), vs_ideal, *ratios]


def case_fanout(bench: Bench) -> None:
    latency, slots = (0.02, 64) if bench.smoke else (0.2, 64)
    sizes = [4, 8] if bench.smoke else [16, 64, 256, 1024]
    loop_n, thread_n = (4, 8) if bench.smoke else (256, 64)
    print(f"## fan-out: {latency} s per request, {slots} server slots (time inside the REPL cell)\n")
    head = ["pattern", "prompts", *_engine_head(), "ideal", "recursa/ideal", *_ratio_head()]
    rows = []
    # The lean server: FakeServer's ~0.7 ms of CPU per request alone holds 256 requests with 64 slots
    # to ~0.9 s on two shared cores, whatever the client (benchmarks/_lean_server.py).
    with Server("fanout", latency, slots, lean=True) as srv:
        bench.side(srv, "recursa", "warm-up BENCH[batched:4]")
        for n in sizes:
            ideal = math.ceil(n / slots) * latency
            for _ in range(bench.repeat):
                question = f"Fan out. BENCH[batched:{n}]"
                rows.append(_timed_row(bench, srv, "llm_query_batched", question, n, ideal))
        n = 2 * sizes[1]
        ideal = 2 * math.ceil(n / 2 / slots) * latency
        # Each of its batches runs under a new asyncio.run() with one AsyncOpenAI client, whose
        # connections belong to the first loop: the second batch raises "Event loop is closed".
        broken = {
            "minrlm": "not run: minrlm 0.1.5's second sub_llm_batch in a process fails (Event loop is closed)"
        }
        rows.append(
            _timed_row(
                bench, srv, "two batches in one cell", f"Twice. BENCH[twobatches:{n}]", n, ideal, broken
            )
        )
        ideal = math.ceil(thread_n / 16) * latency
        rows.append(
            _timed_row(
                bench,
                srv,
                "16 user threads, llm_query",
                f"Threads. BENCH[threads:{thread_n}]",
                thread_n,
                ideal,
            )
        )
        rows.append(
            _timed_row(bench, srv, "llm_query loop", f"Loop. BENCH[loop:{loop_n}]", loop_n, loop_n * latency)
        )
    _table(head, rows)
    if "minrlm" in bench.engines:
        print(
            "minrlm writes the same calls as sub_llm_batch([(prompt, '')...]) and sub_llm(prompt); its batches\n"
            "run all at once (no concurrency limit), its sub-calls go to the root model.\n"
        )


def case_depth(bench: Bench) -> None:
    latency = 0.02 if bench.smoke else 0.2
    many = 2 if bench.smoke else 20
    print(f"## depth 2: children of 3 turns each through rlm_query_batched, {latency} s per request\n")
    head = ["children", "prompts", *_engine_head(), "ideal", "recursa/ideal", *_ratio_head()]
    rows = []
    unsupported = {"minrlm": "not supported: no child RLMs (its sub_llm is one model call)"}
    with Server("fanout", latency, 64) as srv:
        for _ in range(bench.repeat):  # one child, then many: a change in the machine's load hits both
            for n in (1, many):
                rows.append(
                    _timed_row(
                        bench,
                        srv,
                        f"{n} child RLMs",
                        f"Delegate. BENCH[children:{n}]",
                        n,
                        3 * latency,
                        unsupported,
                        max_depth=2,
                    )
                )
    _table(head, rows)
    print(
        "ideal: one child's three model calls; recursa/ideal for 20 children is the target's 'x one child'.\n"
    )


def _turn_stats(r: dict[str, Any]) -> dict[str, float] | None:
    """The figures of one run of the per-turn case, from the server's ledger and CPU marks."""
    roots = sorted(
        (x for x in r.get("ledger", []) if x["model"] == "bench-root"), key=lambda x: x["received_at"]
    )
    if len(roots) < 3 or "returned_at" not in r:
        return None
    gaps = [b["received_at"] - a["finished_at"] for a, b in itertools.pairwise(roots)]
    return {
        # The first gap also waits for a REPL still starting (recursa's starts during the first call).
        "first_ms": gaps[0] * 1000,
        "turn_ms": statistics.median(gaps[1:]) * 1000,
        "cpu_ms": _cpu_per_turn(r.get("cpu_marks", [])),
        "setup_s": roots[0]["received_at"] - r["started_at"],
        "end_ms": (r["returned_at"] - roots[-1]["finished_at"]) * 1000,
        "quiet_ms": r["quiet_s"] * 1000,
    }


def _cpu_per_turn(marks: list[tuple[float, int]]) -> float:
    """Median CPU ms the client used between consecutive root requests, from the second on (as the
    turn gap); NaN without marks."""
    cpu = [c for _, c in sorted(marks)]
    steps = [(b - a) / 1e6 for a, b in itertools.pairwise(cpu)][1:]
    return statistics.median(steps) if steps else math.nan


def case_overhead(bench: Bench) -> None:
    sizes = bench.sizes_mb or ([0.01] if bench.smoke else [1, 100, 1000])
    turns = bench.turns or (3 if bench.smoke else 10)
    print(
        f"## per-turn overhead: {turns} root turns, instant model (server timestamps), "
        f"{bench.repeat} run(s) per engine and size, interleaved\n"
    )
    print(
        "turn: median gap between a root reply leaving the server and the next root request arriving\n"
        "(HTTP client + engine + a trivial cell) from the second reply on, the median over the runs;\n"
        "CPU / turn: CPU time the engine's process tree used from one root request to the next (read\n"
        "by the server from /proc at each request; the median over the same turns, then over the runs):\n"
        "the work per turn, which a busy machine delays but changes much less; the server's is not in it.\n"
        "/ recursa: turn over recursa's in the same table; best run: the lowest run's median (on a busy\n"
        "machine, the least disturbed); each run: every run's median; first: the gap after the first\n"
        "reply (which may also wait for the REPL to start); setup: run() called to first request; end:\n"
        "last reply to run() returning; quiet: run() returning to no threads or child processes left.\n"
    )
    head = [
        "context",
        "engine",
        "turn",
        "/ recursa",
        "CPU / turn",
        "best run",
        "each run",
        "first",
        "setup",
        "end",
        "quiet after return",
        "trace",
    ]
    rows: list[list[str]] = []
    with Server("instant") as srv:
        for mb in sizes:
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in bench.engines}
            for _ in range(bench.repeat):
                for engine in bench.engines:  # interleaved: a change in the machine's load hits every engine
                    question = f"Step. BENCH[turns:{turns}]"
                    runs[engine].append(
                        bench.side(srv, engine, question, context_mb=mb, no_trace=1, mark_cpu=1)
                    )
            stats: dict[str, list[dict[str, float]]] = {}
            for engine in bench.engines:
                got = [_turn_stats(r) if r.get("answer") == "done" else None for r in runs[engine]]
                failed = [r for r, st in zip(runs[engine], got, strict=True) if st is None]
                if failed:
                    rows.append([f"{mb:g} MB", engine, _failure(failed[0])])
                else:
                    stats[engine] = [st for st in got if st is not None]
            base = statistics.median(st["turn_ms"] for st in stats["recursa"]) if "recursa" in stats else None
            for engine, sts in stats.items():
                turn = statistics.median(st["turn_ms"] for st in sts)
                quiet = _fmt(statistics.median(st["quiet_ms"] for st in sts), "ms", 1)
                if any(r["left_threads"] for r in runs[engine]):
                    quiet += " (threads left)"
                if any(r["left_children"] for r in runs[engine]):
                    quiet += " (child processes left)"
                rows.append(
                    [
                        f"{mb:g} MB",
                        engine,
                        _fmt(turn, "ms", 2),
                        f"{turn / base:.2f}x" if base else "-",
                        _fmt(statistics.median(st["cpu_ms"] for st in sts), "ms", 2),
                        _fmt(min(st["turn_ms"] for st in sts), "ms", 2),
                        " / ".join(f"{st['turn_ms']:.2f}" for st in sts),
                        _fmt(statistics.median(st["first_ms"] for st in sts), "ms", 1),
                        _fmt(statistics.median(st["setup_s"] for st in sts), "s", 2),
                        _fmt(statistics.median(st["end_ms"] for st in sts), "ms", 1),
                        quiet,
                        TRACE_IN_OVERHEAD[engine],
                    ]
                )
    _table(head, rows)


def case_memory(bench: Bench) -> None:
    sizes = bench.sizes_mb or ([1] if bench.smoke else [10, 100, 1000])
    turns = 3
    print(f"## peak memory and trace size, {turns} root turns (trace on for every engine)\n")
    print(
        "host + / worker +: peak RSS above the same engine's run with a 1 KB context; buffer +: peak of\n"
        "the pages the run's memfds hold (the context buffer) above the start; peak at once: the peak,\n"
        "sampled every few ms, of host RSS + those pages + the largest child process's RSS, above the\n"
        "start, minus the same for the 1 KB run (the target's measure).\n"
    )
    head = [
        "context",
        "engine",
        "host +",
        "buffer +",
        "REPL worker +",
        "peak at once",
        "peak at once / context",
        "trace bytes",
    ]
    rows = []
    with Server("instant") as srv:
        # A run with a 1 KB context gives each engine's fixed cost (modules imported lazily, the
        # worker interpreter), which is subtracted so the columns show what the context adds.
        idle = {
            e: bench.side(srv, e, "Step. BENCH[turns:2]", context_mb=0.001, sample_memory=1)
            for e in bench.engines
        }
        for mb in sizes:
            for engine in bench.engines:
                if engine == "official" and mb >= 1000:
                    rows.append(
                        [
                            f"{mb:g} MB",
                            engine,
                            "not run: its trajectory log copies the context into every line (~2x per turn)",
                        ]
                    )
                    continue
                r = bench.side(srv, engine, f"Step. BENCH[turns:{turns}]", context_mb=mb, sample_memory=1)
                if r.get("answer") != "done":
                    rows.append([f"{mb:g} MB", engine, _failure(r)])
                    continue
                host = max(0.0, r["host_peak_above_mb"] - idle[engine].get("host_peak_above_mb", 0.0))
                # The official package and minrlm run code in-process (the official's children are short
                # helpers); recursa's and recursive-llm's REPLs are child processes with a copy of the context.
                worker = 0.0
                if engine in REPL_IN_CHILD:
                    worker = max(0.0, r["children_peak_mb"] - idle[engine].get("children_peak_mb", 0.0))
                peaks, idle_peaks = r.get("sampled_peaks_mb", {}), idle[engine].get("sampled_peaks_mb", {})
                at_once = max(0.0, peaks.get("at_once", 0.0) - idle_peaks.get("at_once", 0.0))
                rows.append(
                    [
                        f"{mb:g} MB",
                        engine,
                        _fmt(host, "MB", 0),
                        _fmt(peaks.get("shmem", 0.0), "MB", 0),
                        _fmt(worker, "MB", 0),
                        _fmt(at_once, "MB", 0),
                        f"{at_once / r['context_mb']:.2f}x",
                        f"{r['trace_bytes']:,}",
                    ]
                )
    _table(head, rows)


def case_cache(bench: Bench) -> None:
    turns = 4 if bench.smoke else 10
    print(f"## prefix cache: root prompts over a {turns}-turn run (vllm-small profile, 16-token blocks)\n")
    head = [
        "engine",
        "server",
        "root prompt tokens",
        "cached",
        "hit ratio (all turns)",
        "hit ratio (turns 2+)",
    ]
    rows = []
    for engine in bench.engines:
        for warm in (False, True):
            with Server("vllm-small") as srv:
                if warm:  # another run of the same engine and model before: what a serving deployment sees
                    bench.side(srv, engine, "Step. BENCH[turns:2]", context_mb=1)
                r = bench.side(srv, engine, f"Step. BENCH[turns:{turns}]", context_mb=1, warm=warm)
            rows.append([engine, "warm" if warm else "cold", *_cache_cells(r)])
    _table(head, rows)
    print(
        "cold: a fresh server, so turn 1 cannot hit; warm: one earlier run (another question) on the same "
        "server, whose system prompt is cached.\n"
    )


def _cache_cells(r: dict[str, Any]) -> list[str]:
    roots = sorted(
        (x for x in r.get("ledger", []) if x["model"] == "bench-root"), key=lambda x: x["received_at"]
    )
    if r.get("answer") != "done" or not roots:
        return [_failure(r)]
    prompt = sum(x["prompt_tokens"] for x in roots)
    cached = sum(x["cached_tokens"] for x in roots)
    later = roots[1:]
    ratio2 = sum(x["cached_tokens"] for x in later) / max(1, sum(x["prompt_tokens"] for x in later))
    return [f"{prompt:,}", f"{cached:,}", f"{cached / prompt:.1%}", f"{ratio2:.1%}"]


CASES: dict[str, Callable[[Bench], None]] = {
    "fanout": case_fanout,
    "depth": case_depth,
    "overhead": case_overhead,
    "memory": case_memory,
    "cache": case_cache,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", nargs="?", default="all", choices=["all", *CASES])
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes and latencies (a check, not a measurement)"
    )
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"a comma-separated subset of {ENGINES}")
    ap.add_argument("--turns", type=int, default=0, help="overhead: root turns per run (default 10)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="overhead, depth, fan-out batches: runs per engine and size, interleaved",
    )
    ap.add_argument(
        "--sizes-mb", default="", help="overhead, memory: context sizes instead of the case's own"
    )
    ap.add_argument(
        "--busy",
        action="store_true",
        help="run the cases beside one more process that keeps a CPU busy (the depth target's setting)",
    )
    ap.add_argument("--official-python", default=None, help="an interpreter that already has rlms==0.1.3")
    ap.add_argument("--minrlm-python", default=None, help="an interpreter that already has minrlm==0.1.5")
    ap.add_argument(
        "--recursive-llm-python", default=None, help="an interpreter that already has recursive-llm==0.5.0"
    )
    args = ap.parse_args()
    unknown = [e for e in args.engines.split(",") if e and e not in ENGINES]
    if unknown or not any(args.engines.split(",")):
        ap.error(f"--engines takes a comma-separated subset of {', '.join(ENGINES)}, not {args.engines!r}")
    try:
        [float(x) for x in args.sizes_mb.split(",") if x]
    except ValueError:
        ap.error(f"--sizes-mb takes comma-separated numbers of MB, e.g. 1,100, not {args.sizes_mb!r}")
    bench = Bench(args)
    # In a session of its own, as an unrelated program is: the kernel (autogroup) then shares the CPU
    # between it and this benchmark, rather than between it and the engine inside our session.
    hog = (
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        if args.busy
        else None
    )
    if hog is not None:
        print(f"(another process, pid {hog.pid}, keeps one CPU busy throughout)\n")
    try:
        for name, fn in CASES.items():
            if args.case in ("all", name):
                fn(bench)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


if __name__ == "__main__":
    main()
