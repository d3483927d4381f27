"""The worker over a byte stream: any command whose stdin and stdout reach a Python interpreter.

The worker program itself travels over the same stream, so nothing has to be installed or mounted
where it runs: the command starts `python -I -u -c BOOTSTRAP N --stdio`, the bootstrap reads exactly
N bytes (the worker program: its package's modules in one script, `worker_source()`) from stdin
and runs them, and the rest of the stream carries frames. This is
how containers (containers.py) and remote sandboxes (remote.py) run the same worker as the local
sandbox. Over a stream there is no fd passing, so the context is sent inline and there are no fork
snapshots: a cell that has to be killed costs the variables (the model is told).

`StdioSandbox(python=[...])` runs a local command this way (for example `ssh host python3`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from collections.abc import Sequence
from functools import cache
from typing import Any

from recursa.errors import SandboxError
from recursa.sandbox.connection import Connection, WorkerGone
from recursa.sandbox.host import WorkerHost
from recursa.sandbox.processes import LocalProcess
from recursa.sandbox.protocol import WORKER_DIR, FrameSocket
from recursa.sandbox.worker.start import PACKAGE

# Reads exactly N bytes (never more: the frames follow) and runs them as the main module.
BOOTSTRAP = (
    "import os,sys\n"
    "n=int(sys.argv[1]);del sys.argv[1]\n"
    "b=bytearray()\n"
    "while len(b)<n:\n"
    " c=os.read(0,n-len(b))\n"
    " if not c:raise SystemExit('recursa: the worker program was cut short')\n"
    " b+=c\n"
    "g={'__name__':'__main__','__file__':'recursa-worker.py','__builtins__':__builtins__}\n"
    "exec(compile(bytes(b),'recursa-worker.py','exec'),g)\n"
)


# What container engines' clients need to find their daemon (the container itself sees none of it).
_LAUNCHER_ENV = ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "CONTAINER_HOST", "XDG_RUNTIME_DIR")


# After PACKAGE and SOURCES (module name -> source): serve those modules as the package start.py
# loads from its folder, imported on first use like files, then run the worker's main loop.
_BUNDLE_LOADER = """
import sys
from importlib.machinery import ModuleSpec


class _Bundled:
    def find_spec(self, name, path=None, target=None):
        package, _, module = name.partition(".")
        if package != PACKAGE or (module and module not in SOURCES):
            return None
        origin = "<recursa-worker/" + (module or "__init__") + ".py>"
        return ModuleSpec(name, self, origin=origin, is_package=not module)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__name__.partition(".")[2]
        if name:
            exec(compile(SOURCES[name], module.__spec__.origin, "exec"), module.__dict__)


sys.meta_path.insert(0, _Bundled())
__import__(PACKAGE + ".server", fromlist=["_"]).main()
"""


@cache
def worker_source() -> bytes:
    """The worker as one ASCII program: every module of its package, and the loader above."""
    sources = {
        path.stem: path.read_text(encoding="utf-8")
        for path in sorted(WORKER_DIR.glob("*.py"))
        if path.name not in ("start.py", "__init__.py")
    }
    return f"PACKAGE = {PACKAGE!r}\nSOURCES = {sources!a}\n{_BUNDLE_LOADER}".encode("ascii")


def worker_argv(
    python: Sequence[str], *, lines: bool = False, config: dict[str, Any] | None = None
) -> list[str]:
    """The interpreter command plus the arguments that make it read and run the worker from stdin."""
    argv = [*python, "-I", "-u", "-c", BOOTSTRAP, str(len(worker_source())), "--stdio"]
    if lines:
        argv.append("--lines")
    return [*argv, "--config", json.dumps(config or {})]


async def boot_worker(host: WorkerHost, worker: Connection, who: str = "the REPL worker") -> dict[str, Any]:
    """Send the worker program down `worker`'s stream and return its ready frame.

    Shared by every host that boots the worker through BOOTSTRAP (this module, remote.py), so a
    worker that fails to start is cleaned up and reported the same way: killed, its log fd
    released, and a SandboxError naming `who` with the end of what it wrote to stderr.
    """
    try:
        await worker.chan.send_encoded(worker_source())
        async with asyncio.timeout(host.start_timeout):
            ready = await asyncio.shield(worker.ready)
    except (TimeoutError, WorkerGone, OSError) as exc:
        error, _ = await host._failed_start(worker, exc, who)
        raise error from None
    return ready


class StdioSandbox(WorkerHost):
    """A persistent REPL whose worker runs behind a local command's stdin and stdout."""

    name = "stdio"
    context_transfer = "inline"

    def __init__(
        self,
        python: Sequence[str] = ("python3",),
        *,
        env_allow: Sequence[str] = (),
        start_timeout: float = 30.0,
        grace_s: float = 2.0,
        max_output_chars: int = 20_000,
        query_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            start_timeout=start_timeout,
            grace_s=grace_s,
            max_output_chars=max_output_chars,
            query_timeout=query_timeout,
            snapshots=False,  # fork snapshots need fd passing
        )
        self.python = list(python)
        self.env_allow = tuple(env_allow)
        self.isolation = {
            "level": "none",
            "process": True,
            "warnings": ["a plain command: no isolation is claimed"],
        }

    def _no_snapshot_reason(self) -> str:
        return "a worker reached over a stream cannot keep fork snapshots"

    def command(self) -> list[str]:
        """The full command line (subclasses wrap the interpreter, e.g. in `docker run`)."""
        return worker_argv(self.python)

    def _process(self, proc: subprocess.Popen[bytes]) -> LocalProcess:
        return LocalProcess(proc)

    def _env(self) -> dict[str, str] | None:
        """The command's environment: only what a launcher needs, never the host's secrets."""
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", *_LAUNCHER_ENV, *self.env_allow)
        return {k: os.environ[k] for k in keep if k in os.environ}

    async def _spawn(self) -> Connection:
        assert self._handler is not None
        ours, theirs = socket.socketpair()  # one socket is both the command's stdin and its stdout
        log = self._new_log()
        argv = self.command()
        try:
            proc = subprocess.Popen(  # noqa: ASYNC220  (returns at once; see subprocess.py)
                argv,
                stdin=theirs.fileno(),
                stdout=theirs.fileno(),
                stderr=log.write_fd,
                env=self._env(),
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            raise SandboxError(f"cannot start the REPL worker with {argv[0]!r}: {exc}") from None
        finally:
            theirs.close()
            log.spawned()
        chan = FrameSocket(ours)
        chan.can_pass_fds = False  # the far end reads a plain stream: passed fds would be dropped
        worker = Connection(chan, self._handler, self._process(proc), log=log)
        self._cleanup.process = worker.process
        ready = await boot_worker(self, worker)
        self._on_ready(worker, ready)
        return worker

    def _on_ready(self, worker: Connection, ready: dict[str, Any]) -> None:
        """The worker answered; `ready` holds its pid (as it sees it) and its hardening report."""
