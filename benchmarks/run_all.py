"""Every benchmark script, one after another, with one report: what each printed and a summary table.

    python benchmarks/run_all.py [--full] [--only NAME,...] [--skip NAME,...] [--report FILE]

Quick sizes by default (a minute or two: a check that every script still runs, with figures that
are only indicative), `--full` for the sizes the docs quote (tens of minutes; the side-by-side
benchmark then installs the official `rlms` package and minrlm, each into its own virtual
environment). A script counts as run when it exits 0, prints something, and neither a traceback nor
a failed cell shows in its output. Exit status 1 if any script failed. `--report` also writes the report (machine, date,
command, every script's output) to a Markdown file, as docs/performance.md is made.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FAILURE_MARKS = ("Traceback (most recent call last)", "failed:")


@dataclass
class Script:
    name: str
    path: str  # relative to benchmarks/
    quick: list[str]
    full: list[str]
    needs: list[str] = field(default_factory=list)  # "bwrap", "chromium", "playwright"
    timeout_s: float = 3600


SCRIPTS = [
    Script("turn_overhead", "turn_overhead.py", ["--sizes-mb", "1", "--model-latency", "0"], []),
    Script("fanout", "fanout.py", ["--sizes", "16,256", "--loop-size", "8"], []),
    Script("memory", "memory.py", ["--sizes-mb", "10"], ["--sizes-mb", "10,100,1000", "--repeat", "3"]),
    Script(
        "memory_list",
        "memory.py",
        ["--sizes-mb", "10", "--kind", "list"],
        ["--sizes-mb", "100", "--kind", "list"],
    ),
    Script("sandbox_roundtrip", "sandbox_roundtrip.py", [], ["--big", "--inprocess"]),
    Script("sandbox_isolation", "sandbox_isolation.py", ["--quick"], []),
    Script("sandbox_snapshots", "sandbox_snapshots.py", ["--sizes-mb", "20", "--repeat", "10"], []),
    Script("machine_floor", "machine_floor.py", ["--repeat", "5"], []),
    Script("channel_flood", "channel_flood.py", ["--seconds", "1", "--delay", "0.1"], []),
    Script("worker_starts", "worker_starts.py", ["--workers", "4", "--rounds", "1"], [], needs=["bwrap"]),
    Script("load", "load.py", ["--runs", "10"], ["--runs", "200", "--batches", "2"]),
    Script("env_rollouts", "env_rollouts.py", ["--sizes-mb", "1", "--episodes", "16", "--alone", "4"], []),
    Script(
        "ray_client",
        "ray_client.py",
        ["--alone", "3", "--episodes", "4", "--concurrency", "2", "--rounds", "1"],
        ["--alone", "20", "--episodes", "32", "--concurrency", "16", "--rounds", "3"],
    ),
    Script("answer_turns", "answer_turns.py", ["--beside-only"], []),
    Script("serve_throughput", "serve_throughput.py", ["--requests", "16", "--concurrency", "4"], []),
    Script("acp_mcp", "acp_mcp.py", ["--prompts", "2"], ["--prompts", "10"]),
    Script("json_bounds", "json_bounds.py", ["--messages", "100000"], []),
    Script(
        "subcall_cache", "subcall_cache.py", ["--group", "4", "--chars", "20000", "--families", "oolong,niah"], []
    ),
    Script("prompt_cache", "prompt_cache.py", ["--turns", "6"], []),
    Script("dialect_tokens", "dialect_tokens.py", ["--turns", "10"], []),
    Script("families_10m", "families_10m.py", ["--tokens", "20k"], []),
    Script(
        "viewer_load",
        "viewer_load.py",
        ["--nodes", "200"],
        [],
        needs=["chromium", "playwright"],
        timeout_s=1800,
    ),
    Script("vs_official", "vs_official/run.py", ["all", "--smoke", "--engines", "recursa"], ["all"]),
]


def missing(script: Script) -> str | None:
    """Why the script cannot run on this machine, or None."""
    for need in script.needs:
        if need == "bwrap" and shutil.which("bwrap") is None:
            return "bubblewrap is not installed"
        if need == "chromium" and not Path("/usr/bin/chromium").exists():
            return "no /usr/bin/chromium"
        if need == "playwright":
            try:
                import playwright  # noqa: F401
            except ImportError:
                return "playwright is not installed"
    return None


@dataclass
class Outcome:
    script: Script
    command: str
    status: str  # "ok", "FAILED: ...", "skipped: ..."
    wall_s: float
    output: str


def run_one(script: Script, full: bool) -> Outcome:
    args = script.full if full else script.quick
    command = " ".join(["python", f"benchmarks/{script.path}", *args])
    why = missing(script)
    if why:
        return Outcome(script, command, f"skipped: {why}", 0.0, "")
    # The scripts import `recursa` (this checkout's) and their sibling modules.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / script.path), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=script.timeout_s,
        )
    except subprocess.TimeoutExpired:
        return Outcome(
            script, command, f"FAILED: no result in {script.timeout_s:.0f} s", script.timeout_s, ""
        )
    wall = time.perf_counter() - started
    out = done.stdout.rstrip()
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-2:])[:200]
        status = f"FAILED: exit {done.returncode}: {tail}"
    elif not out:
        status = "FAILED: printed nothing"
    elif any(mark in out or mark in done.stderr for mark in FAILURE_MARKS):
        status = "FAILED: a traceback or failed cell in its output"
    else:
        status = "ok"
    if status != "ok" and done.stderr.strip():
        out += "\n\nstderr (last lines):\n" + "\n".join(done.stderr.strip().splitlines()[-15:])
    return Outcome(script, command, status, wall, out)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GB RAM"
    except (OSError, ValueError, IndexError):
        pass
    load = ", load average at start {:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    return f"{os.cpu_count()} CPUs ({cpu}){mem}, Linux {platform.release()}, Python {platform.python_version()}{load}"


def summary(outcomes: list[Outcome]) -> str:
    lines = ["| script | status | wall | command |", "|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.script.name} | {o.status} | {o.wall_s:.1f} s | `{o.command}` |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the documented sizes (tens of minutes)")
    ap.add_argument("--only", default="", help="comma-separated script names")
    ap.add_argument("--skip", default="", help="comma-separated script names")
    ap.add_argument("--report", type=Path, default=None, help="also write the report to this Markdown file")
    args = ap.parse_args()
    names = {s.name for s in SCRIPTS}
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - names
    if unknown:
        ap.error(f"unknown script name(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}")
    chosen = [s for s in SCRIPTS if (not only or s.name in only) and s.name not in skip]
    argv = " ".join(["python benchmarks/run_all.py", *sys.argv[1:]])
    head = [
        f"Command: `{argv}`",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"Machine: {machine()}",
        f"Mode: {'full (documented sizes)' if args.full else 'quick (a check that each script runs)'}",
    ]
    print("\n\n".join(head) + "\n", flush=True)
    sections, outcomes = [], []
    for script in chosen:
        print(f"running {script.name} ...", file=sys.stderr, flush=True)
        o = run_one(script, args.full)
        outcomes.append(o)
        # Fenced: the scripts print aligned text as well as Markdown tables, and both read as printed.
        section = f"### {o.script.name}\n\n`{o.command}` ({o.status}, {o.wall_s:.1f} s)\n\n```text\n{o.output}\n```\n"
        sections.append(section)
        print(section, flush=True)
    table = summary(outcomes)
    print("### Summary\n\n" + table, flush=True)
    if args.report:
        args.report.write_text(
            "\n\n".join(head) + "\n\n" + "\n".join(sections) + "\n### Summary\n\n" + table + "\n"
        )
    if any(o.status.startswith("FAILED") for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
