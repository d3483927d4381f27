"""`recursa ARGS` as a process of its own, forked from a launcher that has imported the CLI once.

Each command still runs in its own process, with its own cwd, environment, stdin, stdout, stderr
and exit status, and an exception escaping main() prints its traceback exactly as the interpreter
would; only the interpreter's start and the import of recursa (about 1 s of CPU each) are paid once
per launcher instead of once per command. A test that is about the interpreter's start itself (the
`python -m recursa.cli` entry point, a missing extra) runs a fresh `subprocess.run` instead.

The launcher reads one job per line (JSON) on its stdin, forks a child for it at once, and writes
`{"id": ..., "code": ...}` on its stdout when that child ends, so several commands may run at once.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent

_LAUNCHER = r"""
import json, os, select, signal, sys, traceback
import recursa.cli
for name in ("recursa.bench", "recursa.train.cli", "recursa.serve.commands", "recursa.trace.viewer"):
    try:
        __import__(name)  # loaded once here rather than in every child
    except ImportError:
        pass

def child(job, inherited):
    for fd in inherited:
        os.close(fd)
    signal.alarm(job["timeout"])  # a child that hangs (say, reading /dev/zero) dies instead of stalling the suite
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    for fd, path, flags in ((0, job["stdin"], os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        new = os.open(path, flags, 0o600)
        os.dup2(new, fd)
        os.close(new)
    try:
        code = recursa.cli.main(job["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)

results = os.fdopen(1, "w", encoding="utf-8", closefd=False)
running = {}  # pidfd: (pid, job id)
pending = b""
while True:
    ready, _, _ = select.select([0, *running], [], [])
    for fd in ready:
        if fd == 0:
            chunk = os.read(0, 65536)
            if not chunk:
                for pidfd, (pid, _) in running.items():
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                sys.exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(job, list(running))  # fds 0-2 are replaced in the child
                running[os.pidfd_open(pid)] = (pid, job["id"])
        else:
            pid, job_id = running.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            results.write(json.dumps({"id": job_id, "code": os.waitstatus_to_exitcode(status)}) + "\n")
            results.flush()
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without provider keys or RECURSA_ settings, recursa importable
    from this checkout, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY") and not k.startswith("RECURSA_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


@dataclass
class Job:
    """One command: its arguments, folder, full environment and what it reads on stdin."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]
    stdin: str = ""
    timeout: int = 120
    files: dict[str, str] = field(default_factory=dict)  # stdin, stdout, stderr: where the child's go


class CliLauncher:
    """The launcher process; `run` and `run_all` hand it commands and wait for their ends."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="recursa-cli-")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=clean_env(),
        )
        self._next = 0
        self._buffer = b""

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # the launcher kills what still runs and exits
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._dir.cleanup()

    def run(
        self, argv: list[str], *, cwd: Path, env: dict[str, str], stdin: str = "", timeout: int = 120
    ) -> subprocess.CompletedProcess[str]:
        """What `subprocess.run([python, -m, recursa.cli, *argv], capture_output=True, text=True)` gives."""
        return self.run_all([Job(argv, cwd, env, stdin, timeout)])[0]

    def run_all(self, jobs: list[Job], at_once: int = 2) -> list[subprocess.CompletedProcess[str]]:
        """Every job, `at_once` of them running at a time; results in the jobs' order."""
        codes: dict[int, int] = {}
        todo = list(range(len(jobs)))
        running: set[int] = set()
        for job in jobs:
            job.files = self._files(job)
        while todo or running:
            while todo and len(running) < at_once:
                index = todo.pop(0)
                self._send(index, jobs[index])
                running.add(index)
            done, code = self._receive(max(j.timeout for j in jobs) + 30)
            running.discard(done)
            codes[done] = code
        return [self._outcome(job, codes[i]) for i, job in enumerate(jobs)]

    def _files(self, job: Job) -> dict[str, str]:
        self._next += 1
        names = {
            name: os.path.join(self._dir.name, f"{self._next}.{name}")
            for name in ("stdin", "stdout", "stderr")
        }
        Path(names["stdin"]).write_text(job.stdin, encoding="utf-8")
        return names

    def _send(self, index: int, job: Job) -> None:
        assert self._proc.stdin is not None
        line = {"id": index, "argv": job.argv, "cwd": str(job.cwd), "env": job.env, "timeout": job.timeout}
        self._proc.stdin.write(json.dumps({**line, **job.files}).encode() + b"\n")
        self._proc.stdin.flush()

    def _receive(self, timeout: float) -> tuple[int, int]:
        out: IO[bytes] | None = self._proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"the CLI launcher gave no result in {timeout:.0f} s")
                chunk = os.read(out.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"the CLI launcher exited ({self._proc.wait()})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result["id"], result["code"]

    @staticmethod
    def _outcome(job: Job, code: int) -> subprocess.CompletedProcess[str]:
        out, err = (
            Path(job.files[k]).read_text(encoding="utf-8", errors="replace") for k in ("stdout", "stderr")
        )
        return subprocess.CompletedProcess(["recursa", *job.argv], code, out, err)
