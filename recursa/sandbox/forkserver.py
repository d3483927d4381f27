"""The host's side of a zygote: one warm worker in a bwrap namespace that forks REPL workers.

Starting a hardened worker from nothing costs tens of milliseconds of CPU (bwrap, an interpreter,
imports). A call tree with many child RLMs pays that many times at once, and on two cores the last
child waits long for its REPL (docs/performance.md, "Figures behind choices in the code"). A `ForkServer` starts one zygote (worker/start.py --zygote, see
worker/zygote.py for what each forked worker does to shut itself off from its siblings) and then
hands out workers forked from it in a few ms each.

A `ForkServer` has no settings of its own: the first `SubprocessSandbox` that asks for a worker
starts the zygote with its own (interpreter, hardening, bwrap, environment, scratch root), and a
later sandbox whose settings differ starts its workers the usual way. It is used only where forked
workers are isolated from each other as well as separate starts are: bwrap, Landlock with signal
scoping (ABI 6+), seccomp. Anything else, or a zygote that fails, falls back to a separate start.

Closing it ends the zygote and every worker it forked (they die with their parent): a call tree
closes its sandboxes first (recursa/loop/tree.py). A fork server serves one event loop, the first
that uses it; sandboxes on another loop start their workers anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from recursa.sandbox.bwrap import inner_pid

# What the zygote keeps of bwrap's user namespace for its children's first steps (worker/zygote.py).
ZYGOTE_CAPS = ("CAP_SYS_ADMIN", "CAP_SETPCAP")


class ZygoteGone(OSError):
    """The zygote cannot fork a worker: it exited or stopped answering."""


class ForkRefused(ZygoteGone):
    """The zygote is alive but could not fork this worker (it said why)."""


class WorkerVanished(ZygoteGone):
    """The worker was forked but is not among the zygote's children: it already exited."""


@dataclass(frozen=True)
class ZygoteRecipe:
    """How to start a zygote: what a sandbox knows, handed to the fork server."""

    key: Hashable  # the settings that must match for a sandbox to use this zygote
    scratch_root: str | None
    command: Callable[[int, str], list[str]]  # (control fd, zygote root) -> argv
    env: Callable[[str], dict[str, str]]  # zygote root -> environment
    start_timeout: float


class ForkServer:
    """Forks REPL workers from one warm zygote; share one among the sandboxes of a call tree."""

    def __init__(self) -> None:
        self._slot = _Slot()
        self._key: Hashable = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop it serves (the first)
        self._turn: asyncio.Lock | None = None  # one request at a time on the control socket
        self.unavailable: str | None = None  # why this fork server gives no workers, once it is known
        self.forks = 0  # workers forked so far (for tests and benchmarks)
        weakref.finalize(self, self._slot.stop)  # a fork server dropped without close()

    @property
    def root(self) -> str | None:
        """The folder of the zygote's scratch directories, while it runs."""
        zygote = self._slot.zygote
        return zygote.root if zygote is not None else None

    async def zygote_for(self, recipe: ZygoteRecipe) -> str | None:
        """Start the zygote if needed: its folder (for the sandbox's scratch directory) if it serves
        sandboxes with this recipe's settings, else None (start the worker the usual way). A fork
        server serves the event loop that first asked; sandboxes on other loops start anew."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._turn = loop, asyncio.Lock()
        if self._slot.closed or self.unavailable is not None or loop is not self._loop:
            return None
        zygote = self._slot.zygote
        if zygote is None:
            return await asyncio.to_thread(self._start, recipe)
        if not zygote.alive():
            await asyncio.to_thread(self._retire, zygote, "the zygote exited")
            return None
        return zygote.root if self._key == recipe.key else None

    def retire(self, why: str) -> None:
        """Fork no more workers (a forked one failed to start), and say why. The zygote keeps
        running until close(): the workers it forked die with it, and they are fine."""
        if self.unavailable is None:
            self.unavailable = why

    def _retire(self, zygote: _Zygote, why: str) -> None:
        """A zygote that failed gives no more workers: stop it; later sandboxes start theirs anew."""
        with self._slot.lock:
            if self._slot.zygote is zygote:
                self._slot.zygote = None
                self.unavailable = why
        zygote.stop()

    def _start(self, recipe: ZygoteRecipe) -> str | None:
        with self._slot.lock:
            if self._slot.zygote is None and self.unavailable is None and not self._slot.closed:
                try:
                    self._slot.zygote = _Zygote.start(recipe)
                    self._key = recipe.key
                except ZygoteGone as exc:
                    self.unavailable = str(exc)
            zygote = self._slot.zygote
        return zygote.root if zygote is not None and self._key == recipe.key else None

    async def fork(
        self, channel: int, log: int, request: dict[str, Any], timeout: float, extra: Sequence[int] = ()
    ) -> int:
        """Fork a worker that serves the socket `channel` and writes to `log`: its host pid.
        `extra`: the worker's control-group descriptors (joined before it does anything else).

        Raises ZygoteGone (and gives no more workers) if the zygote cannot. The exchange with the
        zygote runs to its end even if the caller is cancelled, on copies of the descriptors, so
        the next request never reads this one's reply; a worker forked for a caller that gave up
        finds its channel closed and exits. WorkerVanished: the worker exited before it was seen
        (the zygote keeps running)."""
        fds = [os.dup(channel), os.dup(log), *map(os.dup, extra)]
        exchange = asyncio.ensure_future(self._exchange(fds, request, timeout))
        exchange.add_done_callback(_retrieved)  # its caller may be gone: nobody else reads it
        return await asyncio.shield(exchange)

    async def _exchange(self, fds: list[int], request: dict[str, Any], timeout: float) -> int:
        assert self._turn is not None
        try:
            async with self._turn:
                zygote = self._slot.zygote
                if zygote is None or self._slot.closed or self.unavailable is not None:
                    raise ZygoteGone(self.unavailable or "the fork server is not running")
                try:
                    pid = await zygote.fork(fds, request, timeout)
                except ForkRefused as exc:
                    self.retire(str(exc))  # its workers so far are fine: they keep running
                    raise
                except WorkerVanished:
                    # The worker exited before its pid was looked up: its caller closed the channel
                    # (normal), or it died at once, e.g. unable to prepare. That is no reason to stop
                    # the zygote and kill the healthy workers it forked: the sandbox reads why from
                    # the worker's log and retires this fork server, as for any failed forked worker.
                    raise
                except ZygoteGone as exc:
                    await asyncio.to_thread(self._retire, zygote, str(exc))
                    raise
                self.forks += 1
                return pid
        finally:
            for fd in fds:
                os.close(fd)

    async def close(self) -> None:
        """End the zygote (and every worker it forked) and remove its folder. Idempotent."""
        await asyncio.to_thread(self._slot.stop)


class _Slot:
    """The running zygote, if any, and the lock around it (what the finalizer needs, without the
    fork server itself)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.zygote: _Zygote | None = None
        self.closed = False

    def stop(self) -> None:
        with self.lock:
            self.closed = True
            zygote, self.zygote = self.zygote, None
        if zygote is not None:
            zygote.stop()


class _Zygote:
    """A running zygote: its process (bwrap, when used), control socket, host pid and folder."""

    def __init__(self, proc: subprocess.Popen[bytes], control: socket.socket, pid: int, root: str) -> None:
        self.proc = proc
        self.control = control
        self.pid = pid  # the zygote's own host pid (under bwrap, below bwrap and its init)
        self.root = root

    @classmethod
    def start(cls, recipe: ZygoteRecipe) -> _Zygote:
        root = tempfile.mkdtemp(prefix="recursa-zygote-", dir=recipe.scratch_root)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with tempfile.TemporaryFile(prefix="recursa-zygote-log-") as log:
            try:
                proc = subprocess.Popen(
                    recipe.command(theirs.fileno(), root),
                    pass_fds=(theirs.fileno(),),
                    cwd=root,
                    env=recipe.env(root),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            except OSError as exc:
                ours.close()
                shutil.rmtree(root, ignore_errors=True)
                raise ZygoteGone(f"cannot start the zygote: {exc}") from None
            finally:
                theirs.close()
            ours.settimeout(recipe.start_timeout)
            try:
                hello = json.loads(ours.recv(4096) or b"{}")
                ns_pid = int(hello["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                log.seek(0)
                tail = log.read()[-500:].decode("utf-8", "replace").strip()
                cls(proc, ours, proc.pid, root).stop()
                raise ZygoteGone(f"the zygote did not start ({tail or 'no output'})") from None
        pid = proc.pid if ns_pid == proc.pid else inner_pid(proc.pid, ns_pid)
        ours.setblocking(False)  # from now on it is read on the event loop
        zygote = cls(proc, ours, pid or proc.pid, root)
        if pid is None:
            zygote.stop()
            raise ZygoteGone("the zygote's pid inside bwrap was not found")
        return zygote

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def fork(self, fds: list[int], request: dict[str, Any], timeout: float) -> int:
        """One request and its reply, on the event loop. (In a thread, every fork handed the GIL
        back and forth with the loop, which slowed a burst of twenty children, as
        benchmarks/worker_starts.py showed when this was written.)"""
        loop = asyncio.get_running_loop()
        try:
            # A non-blocking send that cannot block: one small message is ever in flight.
            socket.send_fds(self.control, [json.dumps(request).encode()], fds)
            async with asyncio.timeout(timeout):
                data = await loop.sock_recv(self.control, 4096)
            reply = json.loads(data or b'{"error": "the zygote exited"}')
        except (OSError, ValueError, TimeoutError) as exc:
            raise ZygoteGone(f"the zygote stopped answering: {exc or type(exc).__name__}") from None
        if "error" in reply:
            raise ForkRefused(f"the zygote could not fork a worker: {reply['error']}")
        ns_pid = int(reply["pid"])
        pid = ns_pid if self.pid == self.proc.pid else inner_pid(self.pid, ns_pid)
        if pid is None:
            raise WorkerVanished(f"the forked worker {ns_pid} is not among the zygote's children")
        return pid

    def stop(self) -> None:
        try:
            watch = os.pidfd_open(self.pid)  # the zygote, not bwrap: it is not our child
        except OSError:
            watch = -1
        self.control.close()  # end of file: the zygote exits, its workers with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap; the namespace ends with it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        if watch >= 0:  # returns once the zygote is gone, not merely bwrap
            poller = select.poll()
            poller.register(watch, select.POLLIN)
            poller.poll(5000)
            os.close(watch)
        shutil.rmtree(self.root, ignore_errors=True)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read a finished exchange's outcome, so a caller that gave up leaves no "never retrieved" noise."""
    if not future.cancelled():
        future.exception()
