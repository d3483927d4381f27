"""Remote sandboxes (Modal, E2B): the same worker, started inside a provider's sandbox.

One remote sandbox per RLM run; inside it, the worker runs as a process started through the
provider's SDK. The SDKs carry text, so frames are lines of ASCII JSON (`--lines`); the worker
program goes in over stdin first (stdio.BOOTSTRAP), and the context is uploaded once as a file
with the SDK's file API and loaded from that path (it stays there for reloads after a restart).
Interrupts are a `kill -INT` run in the sandbox; a worker that ignores them is killed and started
again in the same remote sandbox (no fork snapshots there: the variables are lost, and the model is
told). Closing the sandbox terminates the remote sandbox.

The SDKs are optional extras (`pip install "recursa[modal]"`, `"recursa[e2b]"`), imported only
when such a sandbox is created; tests pass a stand-in for the SDK module.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import os
import shlex
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.sandbox.connection import Connection
from recursa.sandbox.host import ContextSpec, WorkerHost
from recursa.sandbox.processes import WorkerProcess
from recursa.sandbox.protocol import FeedChannel
from recursa.sandbox.stdio import boot_worker, worker_argv
from recursa.sandbox.worker_log import WorkerLog

_UPLOAD_CHUNK = 8 * 1024 * 1024


def import_sdk(module: str, extra: str) -> Any:
    """The provider's SDK module, or a ConfigError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f'sandbox="{extra}" needs the {module!r} package, which is not installed: {install_hint(extra)}'
        ) from None


class ContextReader(io.RawIOBase):
    """The context memfd as a file object with its own position (pread: our fd's offset stays put)."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__()
        self.fd, self.size, self.pos = fd, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view:
            want = min(len(view), self.size - self.pos)
            if want <= 0:
                return 0
            got = os.preadv(self.fd, [view[:want]], self.pos)
        self.pos += got
        return got


class RemoteProcess(WorkerProcess):
    """A worker process inside a remote sandbox, written to and signalled through the provider's SDK."""

    can_signal = True

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[None]],
        signal: Callable[[str], Awaitable[None]],
        kill: Callable[[], Awaitable[None]],
    ) -> None:
        self.write = write
        self._send_signal = signal
        self._kill = kill
        self.worker_pid: int | None = None  # inside the remote sandbox, from the ready frame
        self.ended = False  # set when the SDK reports the process gone
        self._tasks: set[asyncio.Task[None]] = set()

    def exited(self) -> bool:
        return self.ended

    def interrupt(self) -> None:
        task = asyncio.get_running_loop().create_task(self._quietly(self._send_signal("INT")))
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _quietly(call: Awaitable[None]) -> None:
        with contextlib.suppress(Exception):  # a failed remote call must not end the run
            await call

    async def kill(self) -> None:
        if not self.ended:
            await self._quietly(self._kill())
            self.ended = True

    def kill_now(self) -> None:
        # No event loop to await an SDK call from a finalizer: the remote sandbox's own lifetime
        # limit (timeout_s) is what stops it then.
        self.ended = True

    def describe_exit(self) -> str:
        return "it exited" if self.ended else "it stopped answering"


class RemoteSandbox(WorkerHost):
    """Shared by the remote adapters: subclasses create the sandbox and run commands in it."""

    name = "remote"
    context_transfer = "path"
    provider = "remote"

    def __init__(
        self,
        *,
        python: str = "python3",
        timeout_s: int = 3600,
        start_timeout: float = 300.0,
        grace_s: float = 2.0,
        max_output_chars: int = 20_000,
        query_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            start_timeout=start_timeout,
            grace_s=grace_s,
            max_output_chars=max_output_chars,
            query_timeout=query_timeout,
            snapshots=False,
        )
        self.python = python
        self.timeout_s = timeout_s  # the remote sandbox's own lifetime limit: it ends even if we vanish
        self._created = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.isolation = {"level": "remote", "provider": self.provider, "process": True, "snapshots": False}

    # -- what each provider provides -------------------------------------------------------------

    async def _create(self) -> None:
        """Create the remote sandbox."""
        raise NotImplementedError

    async def _start_worker(self, chan: FeedChannel, log: Callable[[bytes | str], None]) -> RemoteProcess:
        """Start the worker command; feed its stdout into `chan` (then `feed_eof`), stderr to `log`."""
        raise NotImplementedError

    async def _write_file(self, path: str, source: ContextReader) -> None:
        """Upload `source` (a binary file object) to `path` in the remote sandbox."""
        raise NotImplementedError

    async def _destroy(self) -> None:
        raise NotImplementedError

    # -- the shared part -------------------------------------------------------------------------

    def _no_snapshot_reason(self) -> str:
        return f"a worker in a {self.provider} sandbox cannot keep fork snapshots"

    def _background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self) -> Connection:
        assert self._handler is not None
        if not self._created:
            await self._create()
            self._created = True
        worker_log = WorkerLog()  # fed here: the SDK hands us the sandbox's output

        def log(data: bytes | str) -> None:
            worker_log.write(data.encode("utf-8", "replace") if isinstance(data, str) else data)

        holder: dict[str, Callable[[bytes], Awaitable[None]]] = {}

        async def write(data: bytes) -> None:
            await holder["write"](data)

        chan = FeedChannel(write)
        process = await self._start_worker(chan, log)
        holder["write"] = process.write
        worker = Connection(chan, self._handler, process, log=worker_log)
        ready = await boot_worker(self, worker, f"the REPL worker in {self.provider}")
        pid = ready.get("pid")
        process.worker_pid = pid if isinstance(pid, int) else None
        self.isolation = {**self.isolation, "python": ready.get("python")}
        return worker

    async def _upload_context(self, spec: ContextSpec) -> str:
        path = f"/tmp/recursa-context-{uuid.uuid4().hex[:12]}"
        await self._write_file(path, ContextReader(spec.fd, spec.size))
        return path

    async def _teardown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._created:
            self._created = False
            with contextlib.suppress(Exception):
                await self._destroy()


class ModalSandbox(RemoteSandbox):
    """The worker in a Modal Sandbox (`pip install "recursa[modal]"`; Modal credentials as usual).

    `image`: a `modal.Image`, a registry tag (e.g. "python:3.12-slim"), or None for Modal's
    Debian slim image with `python_version`. The sandbox has no network unless `block_network=False`.
    """

    name = "modal"
    provider = "modal"

    def __init__(
        self,
        *,
        app_name: str = "recursa",
        image: Any = None,
        python_version: str = "3.11",
        cpu: float = 1.0,
        memory_mb: int = 4096,
        block_network: bool = True,
        sdk: Any = None,
        **options: Any,
    ) -> None:
        self.sdk = sdk if sdk is not None else import_sdk("modal", "modal")
        super().__init__(**options)
        self.app_name = app_name
        self.image = image
        self.python_version = python_version
        self.cpu = cpu
        self.memory_mb = memory_mb
        self.block_network = block_network
        self.isolation.update(network="none" if block_network else "open", cpu=cpu, memory_mb=memory_mb)
        self._sb: Any = None

    def create_options(self) -> dict[str, Any]:
        """The keyword arguments of `modal.Sandbox.create` (besides the app and the image)."""
        return {
            "timeout": self.timeout_s,
            "cpu": self.cpu,
            "memory": self.memory_mb,
            "block_network": self.block_network,
        }

    async def _create(self) -> None:
        modal = self.sdk
        app = await modal.App.lookup.aio(self.app_name, create_if_missing=True)
        if self.image is None:
            image = modal.Image.debian_slim(python_version=self.python_version)
        elif isinstance(self.image, str):
            image = modal.Image.from_registry(self.image)
        else:
            image = self.image
        self._sb = await modal.Sandbox.create.aio(app=app, image=image, **self.create_options())

    async def _start_worker(self, chan: FeedChannel, log: Callable[[bytes | str], None]) -> RemoteProcess:
        proc = await self._sb.exec.aio(*worker_argv([self.python], lines=True))
        process: RemoteProcess

        async def pump_out() -> None:
            try:
                async for chunk in proc.stdout:
                    chan.feed(chunk)
            finally:
                process.ended = True
                chan.feed_eof()

        async def pump_err() -> None:
            async for chunk in proc.stderr:
                log(chunk)

        async def write(data: bytes) -> None:
            proc.stdin.write(data)
            await proc.stdin.drain.aio()

        async def signal(name: str) -> None:
            if process.worker_pid is not None:
                await self._sb.exec.aio("kill", f"-{name}", str(process.worker_pid))

        async def kill() -> None:
            await signal("KILL")

        process = RemoteProcess(write, signal, kill)
        self._background(pump_out())
        self._background(pump_err())
        return process

    async def _write_file(self, path: str, source: ContextReader) -> None:
        handle = await self._sb.open.aio(path, "wb")
        try:
            while chunk := source.read(_UPLOAD_CHUNK):
                await handle.write.aio(chunk)
        finally:
            await handle.close.aio()

    async def _destroy(self) -> None:
        await self._sb.terminate.aio()


class E2BSandbox(RemoteSandbox):
    """The worker in an E2B sandbox (`pip install "recursa[e2b]"`; E2B_API_KEY in the environment).

    `template`: an E2B template with Python 3 (None: E2B's default). Internet access is off unless
    `allow_internet_access=True`.
    """

    name = "e2b"
    provider = "e2b"

    def __init__(
        self,
        *,
        template: str | None = None,
        allow_internet_access: bool = False,
        sdk: Any = None,
        **options: Any,
    ) -> None:
        self.sdk = sdk if sdk is not None else import_sdk("e2b", "e2b")
        super().__init__(**options)
        self.template = template
        self.allow_internet_access = allow_internet_access
        self.isolation.update(network="open" if allow_internet_access else "none")
        self._sbx: Any = None

    def create_options(self) -> dict[str, Any]:
        """The keyword arguments of `e2b.AsyncSandbox.create`."""
        options: dict[str, Any] = {
            "timeout": self.timeout_s,
            "allow_internet_access": self.allow_internet_access,
        }
        if self.template is not None:
            options["template"] = self.template
        return options

    def worker_command(self) -> str:
        """The shell command (E2B runs commands through bash): `exec` so the worker keeps its pid."""
        return "exec " + shlex.join(worker_argv([self.python], lines=True))

    async def _create(self) -> None:
        self._sbx = await self.sdk.AsyncSandbox.create(**self.create_options())

    async def _start_worker(self, chan: FeedChannel, log: Callable[[bytes | str], None]) -> RemoteProcess:
        commands = self._sbx.commands
        handle = await commands.run(
            self.worker_command(), background=True, stdin=True, on_stdout=chan.feed, on_stderr=log, timeout=0
        )
        process: RemoteProcess

        async def wait() -> None:
            try:
                with contextlib.suppress(Exception):  # a non-zero exit raises in the SDK
                    await handle.wait()
            finally:
                process.ended = True
                chan.feed_eof()

        async def write(data: bytes) -> None:
            await commands.send_stdin(handle.pid, data.decode("ascii"))

        async def signal(name: str) -> None:
            await commands.run(f"kill -{name} {handle.pid}")

        async def kill() -> None:
            await commands.kill(handle.pid)

        process = RemoteProcess(write, signal, kill)
        self._background(wait())
        return process

    async def _write_file(self, path: str, source: ContextReader) -> None:
        await self._sbx.files.write(path, io.BufferedReader(source, _UPLOAD_CHUNK))

    async def _destroy(self) -> None:
        await self._sbx.kill()
