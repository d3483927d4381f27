"""The host side of every worker-based sandbox: one implementation, many ways to start a worker.

`WorkerHost` implements the Sandbox protocol on top of the worker protocol (worker/): loading the
context, running cells under a deadline, call-backs, answers, variables, restarts. An adapter only
says how to start a worker (`_spawn`: a local process, a container, a remote sandbox), how its
process is stopped (a `WorkerProcess`), and how the context reaches it (`context_transfer`).

Timeouts keep state. At the deadline the worker gets SIGINT: the cell stops with KeyboardInterrupt
and every variable is kept. If it has not answered `grace_s` later (a C loop holding the GIL, code
that swallows the interrupt), or if the worker dies during a cell, the snapshot the worker forked
before the cell takes over (worker/snapshots.py): the REPL is back in its state from before the
cell in a few milliseconds. Only where no snapshot exists (snapshots off, a container or remote
adapter, fork failed) is the worker replaced by a fresh one with the context loaded again, and then
the variables are lost. The model is told which of these happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recursa.context import ContextPayload
from recursa.errors import ContextError, SandboxError
from recursa.sandbox.base import CallHandler, ExecResult, FinalAnswer, SnapshotMode, snapshot_mode
from recursa.sandbox.cgroups import TaskGroup
from recursa.sandbox.connection import LOG_TAIL_CHARS, Connection, WorkerGone
from recursa.sandbox.processes import WorkerProcess
from recursa.sandbox.protocol import FrameSocket, ProtocolError, exec_result_from_wire, final_from_wire
from recursa.sandbox.recovery import Recovery
from recursa.sandbox.worker_log import WorkerLog

_DRAIN_S = 0.2
_LOG_DRAIN_S = 2.0  # a bound only: the log's reader ends as soon as the dead worker's pipe is read
_SHUTDOWN_S = 0.5  # how long an idle worker may take to exit when asked, before it is killed


@dataclass
class ContextSpec:
    fd: int  # our own dup of the payload's memfd, so a restarted worker can load it again
    kind: str
    size: int
    byte_lengths: list[int]
    char_lengths: list[int]  # equal to byte_lengths for ASCII pieces, which load without a copy
    keys: list[str]
    path: str | None = None  # where an adapter put the bytes for a "path" transfer
    # Set when the worker frees the memfd's pages as it reads them (fd transfer of an in-memory
    # context): the host then keeps no copy (fd is -1 after the load) and encodes the context again
    # for a restarted worker. The context is then in memory once, not twice, for the whole run.
    rebuild: Callable[[], ContextPayload] | None = None


class Cleanup:
    """What the finalizer needs to stop a worker whose sandbox was dropped without close()."""

    def __init__(self) -> None:
        self.process: WorkerProcess | None = None  # the current worker's
        self.scratch: str | None = None
        self.fds: set[int] = set()  # the keeper's notes pipe and our copy of the context memfd
        self.group: TaskGroup | None = None  # its control group (cgroups.py), if it has one
        self._fds_lock = threading.Lock()  # the finalizer may run on any thread (garbage collection)

    def close_fd(self, fd: int) -> None:
        """Close one of `fds`, unless the finalizer closed it already: a number closed twice may by
        then be a file someone else opened (another run's context, on another thread)."""
        with self._fds_lock:
            if fd not in self.fds:
                return
            self.fds.discard(fd)
        with contextlib.suppress(OSError):  # called from error paths: never hide the error they handle
            os.close(fd)

    def __call__(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.kill_now()
        group, self.group = self.group, None
        if group is not None:
            group.discard()  # while the killed are still exiting it stays listed, removed later
        with self._fds_lock:
            fds, self.fds = self.fds, set()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


class WorkerHost:
    """A persistent REPL in a worker process; subclasses say how the worker is started."""

    name = "worker"
    context_transfer = "fd"  # "fd" (SCM_RIGHTS), "inline" (bytes after the frame) or "path"

    def __init__(
        self,
        *,
        start_timeout: float = 10.0,
        grace_s: float = 2.0,
        max_output_chars: int = 20_000,
        query_timeout: float = 30.0,
        snapshots: SnapshotMode = True,
        restore_timeout: float = 2.0,
    ) -> None:
        self.start_timeout, self.grace_s = start_timeout, grace_s
        self.max_output_chars = max_output_chars
        self.query_timeout = query_timeout  # get_variable / variable_names
        self.snapshots = snapshot_mode(snapshots)  # fork snapshots so timeouts and crashes keep state
        self.restore_timeout = restore_timeout
        self.isolation: dict[str, Any] = {}
        self._handler: CallHandler | None = None
        self._worker: Connection | None = None
        self._context: ContextSpec | None = None
        self._definitions: dict[str, dict[str, Any]] = {}  # define() entries, replayed on a restart
        # Cells sent since the current worker's state was new (a start or restart; a snapshot that
        # takes over carries its state on). At 0 a restart restores that state exactly, so the
        # worker keeps no snapshot of it (worker/server.py).
        self._cells_run = 0
        self._lock = asyncio.Lock()
        self._carry_notes: list[str] = []  # for the next ExecResult (e.g. a restart between cells)
        self._closed = False
        self._cleanup = Cleanup()
        self._finalizer = weakref.finalize(self, self._cleanup)

    # -- what adapters provide -------------------------------------------------------------------

    async def _spawn(self) -> Connection:
        """Start a worker and return its connection once its `ready` frame has arrived."""
        raise NotImplementedError

    async def _upload_context(self, spec: ContextSpec) -> str:
        """For context_transfer "path": put the context bytes where the worker can open them."""
        raise NotImplementedError

    async def _teardown(self) -> None:
        """After the last worker is gone (e.g. stop a container or a remote sandbox)."""

    def _no_snapshot_reason(self) -> str:
        return "snapshots are off for this sandbox" if not self.snapshots else "the worker could not get one"

    def _before_takeover(self) -> None:
        """A snapshot is about to be told to replace the worker."""

    async def _on_takeover(self, conn: Connection) -> None:
        """A snapshot has just replaced the worker (`conn.pid` is its host pid where visible)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def kill_now(self) -> None:
        """Kill the worker at once, without an event loop (an abandoned run's finalizer)."""
        self._closed = True
        self._finalizer()

    @property
    def pid(self) -> int | None:
        """The current worker's process id where the host can see it (it changes on restarts)."""
        return self._worker.pid if self._worker is not None else None

    @property
    def snapshot_pid(self) -> int | None:
        """The waiting snapshot's pid as the worker sees it (None without one)."""
        return self._worker.snapshot_pid if self._worker is not None else None

    async def wait_snapshot(self, timeout: float = 5.0) -> int | None:
        """Wait until the worker has announced its snapshot of the state after the last cell; its
        pid, None without one (before the first cell there is none: a restart restores that state)."""
        worker = self._worker
        if worker is None or worker.control is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await worker.snapshot_reported.wait()
        return worker.snapshot_pid

    async def start(self, handler: CallHandler) -> None:
        if self._closed:
            raise SandboxError("this sandbox was closed; create a new one")
        if self._worker is not None or self._handler is not None:
            raise SandboxError("the sandbox is already started")
        self._handler = handler
        try:
            self._worker = await self._new_worker()
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                raise
            raise SandboxError(
                "cannot start a REPL process: this process has too many open files (each running RLM "
                "holds a few sockets and pipes). Raise the limit, e.g. `ulimit -n 65536` in the shell "
                "or resource.setrlimit(resource.RLIMIT_NOFILE, ...), or run fewer RLMs at once."
            ) from None

    async def _new_worker(self) -> Connection:
        conn = await self._spawn()
        self._cleanup.process = conn.process
        self._cells_run = 0
        if self.snapshots:
            await self._arm_snapshots(conn)
        return conn

    async def _arm_snapshots(self, conn: Connection) -> None:
        """Give the worker the control socket its snapshots wait on (needs fd passing)."""
        if not conn.chan.can_pass_fds:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        standby = {"op": "standby", "idle": self.snapshots == "idle"}
        try:
            await conn.chan.send_with_fd(standby, theirs.fileno())
        except (OSError, ValueError, ProtocolError):
            ours.close()
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        conn.control = ours

    async def _replace_worker(self) -> None:
        """Kill the current worker and start a fresh one with the context loaded again."""
        if self._closed:
            raise SandboxError("the sandbox was closed while a cell was running")
        old, self._worker = self._worker, None
        if old is not None:
            await old.kill()
            self._release_log(old)
        self._worker = await self._new_worker()
        if self._context is not None:
            await self._send_context(self._worker, self._context)
        if self._definitions:
            await self._send_definitions(self._worker, list(self._definitions.values()))

    def _new_log(self) -> WorkerLog:
        """The tail of a new worker's output (worker_log.py): give it `write_fd`, then `spawned()`."""
        return WorkerLog.pipe()

    async def _failed_start(self, worker: Connection, exc: BaseException, who: str) -> tuple[SandboxError, str]:
        """Kill a worker that did not come up and release its log: the error to raise, and its log tail."""
        await worker.kill()
        why = "did not start in time" if isinstance(exc, TimeoutError) else f"failed to start ({exc})"
        failed = await self._gone_error(worker.log, who, why)
        self._release_log(worker)
        return failed

    async def _gone_error(self, log: WorkerLog | None, who: str, why: str) -> tuple[SandboxError, str]:
        """The error for a worker that is gone, with the tail of its log, and that tail."""
        if log is not None:
            # The worker is gone but what it wrote may still sit in the pipe, unread by the log's
            # thread on a busy host: the tail names why it failed (and whether bwrap could not start).
            await asyncio.to_thread(log.wait_drained, _LOG_DRAIN_S)
        tail = log.tail(LOG_TAIL_CHARS) if log is not None else ""
        return SandboxError(f"{who} {why}" + (f":\n{tail}" if tail else "")), tail

    def _release_log(self, conn: Connection) -> None:
        notes, conn.notes = conn.notes, None
        log = conn.take_log()
        if log is not None:
            log.spawned()  # nothing more is read from it: the reader ends with the worker
        fd = notes.close() if notes is not None else -1
        if fd >= 0:
            self._cleanup.close_fd(fd)

    async def _take_over(self, old: Connection) -> tuple[Connection | None, str]:
        """Let `old`'s waiting snapshot replace it: (new connection, "") or (None, why not)."""
        assert self._handler is not None
        if old.control is None:
            return None, self._no_snapshot_reason()
        if old.snapshot_sid is None and not old.reader.done():
            # A worker that died may have announced its snapshot in frames not read yet.
            await asyncio.wait({old.reader}, timeout=_DRAIN_S)
        if old.snapshot_sid is None:
            skipped = "the cell came right after the one before, with no time to take one (snapshots='idle')"
            return None, old.snapshot_error or (skipped if self.snapshots == "idle" else "none was ready")
        main_ours, main_theirs = socket.socketpair()
        ctl_ours, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._before_takeover()
        try:
            sent = old.control_send({"op": "takeover"}, [main_theirs.fileno(), ctl_theirs.fileno()])
        finally:
            main_theirs.close()
            ctl_theirs.close()
        if not sent:
            main_ours.close()
            ctl_ours.close()
            return None, "the snapshot could not be reached"
        conn = Connection(FrameSocket(main_ours), self._handler)
        try:
            async with asyncio.timeout(self.restore_timeout):
                restored = await asyncio.shield(conn.ready)
            process = old.process.adopt(restored)
        except (TimeoutError, WorkerGone, OSError) as exc:
            await conn.release()
            ctl_ours.close()
            return None, "the snapshot did not take over" + (f" ({exc})" if str(exc) else "")
        conn.attach(process)
        ctl_ours.setblocking(False)
        conn.control = ctl_ours
        conn.log = old.take_log()  # the snapshot writes to the same log
        conn.notes, old.notes = old.notes, None  # and has the same keeper
        conn.restored = restored
        await old.release()
        if process.pid is not None:
            # Processes are not part of a snapshot: stop what the old worker's cells had started.
            restored["strays_killed"] = process.kill_strays(keep=process.pid)
        self._cleanup.process = process
        await self._on_takeover(conn)
        return conn, ""

    def _note_sink(self) -> Callable[[str], None]:
        """A callable that adds a note for the model's next result, without keeping this sandbox
        alive (a background task holding it would stop a dropped sandbox from being finalized)."""
        ref = weakref.ref(self)

        def add(note: str) -> None:
            host = ref()
            if host is not None:
                host._carry_notes.append(note)

        return add

    async def _live_worker(self) -> Connection:
        if self._closed:
            raise SandboxError("this sandbox was closed; create a new one")
        if self._worker is None:
            raise SandboxError("the sandbox is not started; await start(handler) first")
        worker = self._worker
        worker.check_exited()
        if not worker.alive:
            await worker.process.wait_exit(1.0)
            why = worker.describe_exit()
            recovery = await self._restore_or_restart(worker, fresh=self._fresh())
            self._carry_notes.append(recovery.note(f"The REPL process had stopped ({why})", "between"))
        assert self._worker is not None
        return self._worker

    def _fresh(self) -> bool:
        """Whether the worker's state is still as a start made it (no cell sent since): then a
        restart restores it exactly, and there is no snapshot of it to take over."""
        return self.snapshots and self._cells_run == 0

    async def _restore_or_restart(self, worker: Connection, *, fresh: bool) -> Recovery:
        """Replace a stuck or dead current worker: by its snapshot when one is ready, else by a
        fresh worker with the context loaded again (which restores a `fresh` state exactly)."""
        why_not = ""
        if not fresh:
            new, why_not = await self._take_over(worker)
            if new is not None:
                self._worker = new
                return Recovery("snapshot", False, restored=new.restored or {})
        await self._replace_worker()  # kills `worker`, the current one
        return Recovery("fresh" if fresh else "restart", self._context is not None, why_not)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            # A worker still busy with a request (a cell its run gave up on: a timeout, a
            # cancellation) is killed straight away where we can: asking it to exit would only
            # delay the end of the run. An idle one is asked first, within _SHUTDOWN_S in all.
            busy = bool(worker.pending) and worker.process.can_signal
            if worker.alive and not busy:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_SHUTDOWN_S):
                        await self._ask_to_exit(worker)
            await worker.kill()
            self._release_log(worker)
        self._context = None  # its fd is closed by the cleanup below
        # Removing the scratch tree waits on the file system: off the loop other REPLs are served on
        scratch, self._cleanup.scratch = self._cleanup.scratch, None
        try:
            await self._teardown()
        finally:
            self._finalizer()  # closes what is left
            if scratch:
                await asyncio.to_thread(shutil.rmtree, scratch, True)

    @staticmethod
    async def _ask_to_exit(worker: Connection) -> None:
        with contextlib.suppress(OSError, ValueError):
            await worker.chan.send({"op": "shutdown"})  # may wait on a full channel: bounded by the caller
        await worker.process.wait_exit(_SHUTDOWN_S)

    # -- context ---------------------------------------------------------------------------------

    async def load_context(self, payload: ContextPayload) -> None:
        if payload.fd < 0 or payload.released:
            raise SandboxError("the context payload is closed or was released into a REPL; build it again")
        async with self._lock:
            worker = await self._live_worker()
            release = self.context_transfer == "fd" and payload.rebuild is not None
            spec = ContextSpec(
                os.dup(payload.fd),
                payload.kind,
                payload.size_bytes,
                list(payload.byte_lengths),
                list(payload.info.chunk_lengths),
                list(payload.keys),
                rebuild=payload.rebuild if release else None,
            )
            self._cleanup.fds.add(spec.fd)
            if self._context is not None:
                self._drop_context_fd(self._context)
            self._context = spec
            if release:
                payload.released = True  # the worker frees the bytes it has read, for every holder
            try:
                await self._send_context(worker, spec)
            finally:
                if release:
                    # No holder left either, where the kernel cannot punch holes: the buffer goes
                    # once the worker closes its descriptor.
                    payload.close()

    def _drop_context_fd(self, spec: ContextSpec) -> None:
        if spec.fd >= 0:
            self._cleanup.close_fd(spec.fd)
            spec.fd = -1

    async def _send_context(self, worker: Connection, spec: ContextSpec) -> None:
        frame: dict[str, Any] = {
            "op": "load_context",
            "kind": spec.kind,
            "size": spec.size,
            "byte_lengths": spec.byte_lengths,
            "char_lengths": spec.char_lengths,
            "keys": spec.keys,
            "transfer": self.context_transfer,
            "release": spec.rebuild is not None,
        }
        fresh: ContextPayload | None = None
        if spec.fd < 0 and spec.rebuild is not None:  # released at an earlier load: encode it again
            try:
                fresh = await asyncio.to_thread(spec.rebuild)
            except ContextError as exc:
                raise SandboxError(f"cannot reload the context into the restarted REPL: {exc}") from None
        worker.snapshot_sid = None  # the worker drops its snapshot before loading; a new one follows
        try:
            if self.context_transfer == "fd":
                fut = await worker.request(frame, fd=fresh.fd if fresh is not None else spec.fd)
            elif self.context_transfer == "inline":
                fut = await worker.request(frame, payload=(spec.fd, spec.size))
            else:
                if spec.path is None:
                    spec.path = await self._upload_context(spec)
                fut = await worker.request({**frame, "path": spec.path})
            reply = await fut
        except WorkerGone as exc:
            raise SandboxError(f"the REPL process died while loading the context ({exc}).") from None
        finally:
            if fresh is not None:
                fresh.close()
            if spec.rebuild is not None:
                self._drop_context_fd(spec)  # its pages are freed (or being freed) by the worker
        if reply.get("error"):
            raise SandboxError(f"the REPL could not load the context: {reply['error']}")

    # -- tools and engine-kept values --------------------------------------------------------------

    async def define(self, entries: list[dict[str, Any]]) -> list[str]:
        async with self._lock:
            worker = await self._live_worker()
            for entry in entries:
                self._definitions[str(entry["name"])] = entry
            return await self._send_definitions(worker, entries)

    async def _send_definitions(self, worker: Connection, entries: list[dict[str, Any]]) -> list[str]:
        try:
            reply = await (await worker.request({"op": "define", "entries": entries}))
        except WorkerGone as exc:
            raise SandboxError(f"the REPL process died while defining tools ({exc}).") from None
        errors = reply.get("errors")
        return [str(e) for e in errors] if isinstance(errors, list) else []

    # -- running code ----------------------------------------------------------------------------

    async def execute(self, code: str, timeout: float, *, max_output_chars: int | None = None) -> ExecResult:
        limit = self.max_output_chars if max_output_chars is None else max_output_chars
        async with self._lock:
            worker = await self._live_worker()
            notes, self._carry_notes = self._carry_notes, []
            started = time.perf_counter()
            fresh = self._fresh()  # this is the first cell on a start's state
            self._cells_run += 1
            await self._enter_cell(worker, fresh)
            fut = await worker.request({"op": "exec", "code": code, "max_output_chars": limit})
            timed_out, answered = False, None
            try:
                try:
                    frame = await worker.answer(fut, timeout)
                except TimeoutError:
                    timed_out = True
                    worker.interrupt()
                    frame = await worker.answer(fut, self.grace_s)
            except TimeoutError:
                result = await self._recover(worker, started, timeout, killed=True, fresh=fresh)
            except WorkerGone:
                result = await self._recover(worker, started, timeout if timed_out else None, fresh=fresh)
            except asyncio.CancelledError:
                worker.interrupt()  # the caller gave up: do not leave the cell running
                raise
            else:
                answered, result = worker, exec_result_from_wire(frame)
                if timed_out:
                    result.timed_out = True
                    result.notes.append(f"interrupted after {timeout:g}s; variables kept")
            stopped = await self._end_cell(answered)
            if stopped and not result.restarted:  # else the restore or restart said what it stopped
                result.notes.append(
                    f"{stopped} process(es) this cell started were still running when it ended and were killed"
                )
            result.notes.extend(self._cell_notes())
            result.notes[:0] = notes
            return result

    async def _enter_cell(self, worker: Connection, fresh: bool) -> None:
        """Before a cell: put the worker where what the cell starts can be told apart."""

    async def _end_cell(self, answered: Connection | None) -> int:
        """Kill what the cell left running, where this host can tell; how many. `answered`: the
        worker, if it answered (first taken back out of the cell's place)."""
        return 0

    def _cell_notes(self) -> list[str]:
        """What the model should know about how the cell that just ended was limited."""
        return []

    async def _recover(
        self,
        worker: Connection,
        started: float,
        timeout: float | None,
        *,
        killed: bool = False,
        fresh: bool = False,
    ) -> ExecResult:
        """After a cell that had to be killed (or killed its process): restore, else restart.
        `fresh`: the cell was the first on a start's state, which a restart restores exactly."""
        if not killed:
            await worker.process.wait_exit(1.0)  # the channel closes before the exit is complete
        how = worker.describe_exit()
        if killed:
            assert timeout is not None
            error = (
                f"TimeoutError: the cell ran past {timeout:g}s and ignored the interrupt for "
                f"{self.grace_s:g}s, so its process was killed"
            )
            what = f"killed after {timeout + self.grace_s:g}s (the code did not stop when interrupted at {timeout:g}s)"
        else:
            error = f"the REPL process died while running this cell ({how})"
            what = f"the REPL process died ({how})"
        tail = worker.log_tail()
        recovery = await self._restore_or_restart(worker, fresh=fresh)
        return ExecResult(
            stdout="",
            stderr=f"[REPL process output before it stopped]\n{tail}" if tail else "",
            error=error,
            timed_out=timeout is not None,
            restarted=True,
            restored=recovery.kept,
            notes=[recovery.note(what, "cell")],
            duration_s=time.perf_counter() - started,
        )

    async def _ask(self, frame: dict[str, Any], timeout: float | None = None) -> dict[str, Any] | None:
        """A get_var / list_vars request under a cell's deadline policy (`timeout`: query_timeout)."""
        async with self._lock:
            worker = await self._live_worker()
            fut = await worker.request(frame)
            try:
                try:
                    return await worker.answer(fut, self.query_timeout if timeout is None else timeout)
                except TimeoutError:
                    worker.interrupt()
                    return await worker.answer(fut, self.grace_s)
            except (TimeoutError, WorkerGone):
                recovery = await self._restore_or_restart(worker, fresh=self._fresh())
                note = "Reading a REPL variable hung or crashed the REPL"
                self._carry_notes.append(recovery.note(note, "read"))
                return None

    async def get_variable(self, name: str, timeout: float | None = None) -> FinalAnswer | None:
        reply = await self._ask({"op": "get_var", "name": name}, timeout)
        if not reply or not reply.get("found"):
            return None
        final = final_from_wire(reply.get("final"))
        if final is not None:
            final.protocol = "FINAL_VAR"
        return final

    async def variable_names(self) -> list[str]:
        reply = await self._ask({"op": "list_vars"})
        names = reply.get("names") if reply else None
        return [str(n) for n in names] if isinstance(names, list) else []
