"""Helpers shared by several test modules."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from recursa.sandbox.proc import stat_fields

# Debian's Chromium for the viewer's browser tests (the `browser` fixture in conftest.py).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


# A cell that writes three files of 5 MiB: past an 8 MiB scratch cap the last two fail.
FILL_SCRATCH = (
    "import os\n"
    "done = []\n"
    "for i in range(3):\n"
    "    try:\n"
    "        with open(f'part{i}', 'wb') as f:\n"
    "            f.write(b'x' * (5 << 20))\n"
    "        done.append('ok')\n"
    "    except OSError as e:\n"
    "        done.append(e.strerror)\n"
    "print(done)\n"
)


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most [start, end) intervals open at one instant (an end sorts before a start at a tie)."""
    spans = list(intervals)
    points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    best = cur = 0
    for _, step in points:
        cur += step
        best = max(best, cur)
    return best


def request_overlap(records: Iterable[Any]) -> int:
    """How many fake-server requests were generating at once, from their recorded times."""
    return max_overlap((r.started_at, r.finished_at) for r in records)


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll until `check()` holds; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def serve_process(trace_dir: Path, *flags: str) -> Iterator[str]:
    """`recursa serve` with a scripted root as a process of its own on a free loopback port, with no
    provider keys in its environment; yields its base URL once /health answers, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    cmd = [sys.executable, "-m", "recursa.cli", "serve", "--model", "scripted/gpt5-like", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, *flags, "--trace-dir", str(trace_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/health").status_code == 200
        except httpx.TransportError:
            return proc.poll() is not None

    try:
        wait_until(up, timeout_s=60, what="recursa serve")
        assert proc.poll() is None, (
            f"recursa serve exited: {proc.stderr.read().decode() if proc.stderr else ''}"
        )
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def cli_in_process(capsys: Any, *args: str) -> tuple[int, str]:
    """`recursa ARGS` run by this process (the CLI's main, argparse's exit included): its exit code
    and what it printed to stderr. For bad input, which ends before any run starts."""
    from recursa.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@contextlib.contextmanager
def host_process(script: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], Any]]:
    """`python -c script ARGS` from the repository's root, whose first line on stdout is JSON naming
    what it started (the REPL processes a test then watches): the process and that JSON. The process
    is killed and reaped at the end, whatever the test did to it."""
    host = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        assert host.stdout is not None
        yield host, json.loads(host.stdout.readline())
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()


def spinning_in_c(pid: int) -> bool:
    """Whether `pid` is running and has spent more than 10 ticks of user time (a cell's C loop)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] == b"R" and int(fields[11]) > 10
