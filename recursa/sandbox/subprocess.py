"""The local subprocess sandbox: one persistent worker process per RLM run.

The worker (`worker/`) runs in its own session and process group, in a private scratch directory,
with a scrubbed environment (no API keys). Host and worker speak length-prefixed JSON over a
socketpair; the context travels once as a file descriptor and is mapped by the worker.

Everything that is not about starting this kind of worker (requests, call-backs, timeouts, fork
snapshots that keep state when a cell has to be killed, restarts) lives in `host.WorkerHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from recursa.errors import SandboxError
from recursa.sandbox.base import SNAPSHOT_IDLE_S, SnapshotMode
from recursa.sandbox.bwrap import inner_pid
from recursa.sandbox.bytecode import worker_entry
from recursa.sandbox.connection import Connection, WorkerGone
from recursa.sandbox.forkserver import ZYGOTE_CAPS, ForkServer, WorkerVanished, ZygoteGone, ZygoteRecipe
from recursa.sandbox.hardened import HostHardening, not_started
from recursa.sandbox.host import ContextSpec, WorkerHost
from recursa.sandbox.policy import Hardening
from recursa.sandbox.pools import MemoryPool
from recursa.sandbox.processes import ForkedProcess, LocalProcess
from recursa.sandbox.protocol import FrameSocket


class SubprocessSandbox(WorkerHost):
    """A persistent REPL in a separate worker process (the default sandbox)."""

    name = "subprocess"
    # With snapshots="idle": how long the host sends a worker nothing after a cell before its word
    # to fork a snapshot (base.SnapshotMode).
    snapshot_idle_s = SNAPSHOT_IDLE_S

    def __init__(
        self,
        *,
        scratch_root: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
        env_allow: Sequence[str] = (),
        start_timeout: float = 10.0,
        grace_s: float = 2.0,
        max_output_chars: int = 20_000,
        query_timeout: float = 30.0,
        config: dict[str, Any] | None = None,
        hardening: Hardening | bool = True,
        bwrap: bool | None = False,
        snapshots: SnapshotMode = True,
        restore_timeout: float = 2.0,
        fork_server: ForkServer | None = None,
        memory_pool: MemoryPool | None = None,
    ) -> None:
        """`hardening`: True (defaults), a `Hardening` with other limits, or False (a plain process
        with a scrubbed environment). `bwrap`: True to require bubblewrap namespaces, None to use
        them when bwrap is installed and works, False not to (see bwrap.py). `snapshots`: fork a
        snapshot before each cell so that a cell that must be killed costs only its own changes;
        "idle": not before a cell sent at once after the one before (base.SnapshotMode).
        `fork_server`: fork the worker from that server's warm zygote where it is as safe as a
        separate start (bwrap, Landlock ABI 6+, seccomp; see forkserver.py), else start it anew.
        `memory_pool`: a memory bound this REPL shares with others (pools.py; RLMEnv's)."""
        super().__init__(
            start_timeout=start_timeout,
            grace_s=grace_s,
            max_output_chars=max_output_chars,
            query_timeout=query_timeout,
            snapshots=snapshots,
            restore_timeout=restore_timeout,
        )
        self.scratch_root = os.fspath(scratch_root) if scratch_root is not None else None
        self.python = python
        self.env_allow = tuple(env_allow)
        self.config: dict[str, Any] = dict(config or {})  # passed to the worker's harden()
        if snapshots:
            self.config["keeper"] = True  # a parent for snapshots that outlive the worker (worker/keeper.py)
        options = Hardening() if hardening is True else (hardening or None)
        self._hardening = HostHardening(options, bwrap, python, memory_pool)
        # What is enforced, from the worker's own report (see policy.describe); set at each start.
        self.isolation: dict[str, Any] = not_started()
        self.scratch_dir: str | None = None
        self.fork_server = fork_server
        self._zygote_root: str | None = None  # set while this sandbox's workers come from a zygote

    # -- lifecycle -------------------------------------------------------------------------------

    async def _new_worker(self) -> Connection:
        if self.scratch_dir is None:
            self._zygote_root = await self._zygote()
            parent = self._zygote_root or self.scratch_root
            self.scratch_dir = tempfile.mkdtemp(prefix="recursa-repl-", dir=parent)
            self._cleanup.scratch = self.scratch_dir
        async with _start_slots():
            return await super()._new_worker()

    async def _zygote(self) -> str | None:
        """The folder of the fork server's zygote, if this sandbox's workers may come from it."""
        if self.fork_server is None or self._hardening.why_not_forked() is not None:
            return None
        recipe = ZygoteRecipe(
            key=(
                self.python,
                self._hardening.options,
                self._hardening.want_bwrap,
                self.env_allow,
                self.scratch_root,
            ),
            scratch_root=self.scratch_root,
            command=lambda fd, root: self._command(fd, zygote_root=root),
            env=self._env,
            start_timeout=self.start_timeout,
        )
        return await self.fork_server.zygote_for(recipe)

    def _command(
        self, fd: int, *, zygote_root: str | None = None, handed: dict[str, int] | None = None
    ) -> list[str]:
        """The worker's command line (or a zygote's, in `zygote_root`): the one place a wrapper
        (bwrap, a container) slots in. `handed`: descriptors the worker inherits, by the config name
        it finds them under (`_handed_fds`)."""
        assert self.scratch_dir is not None or zygote_root is not None
        if zygote_root is not None:
            prefix, role = self._hardening.prefix(zygote_root, ZYGOTE_CAPS), ["--zygote", str(fd)]
        else:
            assert self.scratch_dir is not None
            handed = handed or {}
            config = {
                **self.config,
                **self._hardening.config(self.scratch_dir, grouped="cgroup_fd" in handed),
                **handed,
            }
            prefix, role = (
                self._hardening.prefix(self.scratch_dir),
                ["--fd", str(fd), "--config", json.dumps(config)],
            )
        return [
            *prefix,
            self.python,
            "-I",  # isolated: no user site, no PYTHON* variables, no cwd on sys.path
            *self._hardening.python_flags(),
            "-u",
            "-X",
            "utf8",
            worker_entry(),
            *role,
        ]

    def _env(self, home: str | None = None) -> dict[str, str]:
        home = home or self.scratch_dir
        assert home is not None
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": home,
            "TMPDIR": home,
            "PYTHONIOENCODING": "utf-8",
        }
        for name in self.env_allow:
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    async def _spawn(self) -> Connection:
        if self._zygote_root is not None and self.fork_server is not None:
            forked = await self._spawn_forked(self.fork_server)
            if forked is not None:
                return forked
            self._zygote_root = None  # the zygote is gone: this sandbox starts its workers anew
            os.makedirs(self.scratch_dir or "", exist_ok=True)  # a retired zygote takes its folder along
        return await self._spawn_started()

    async def _spawn_forked(self, server: ForkServer) -> Connection | None:
        """A worker forked by the zygote, or None if the zygote cannot (then start one anew)."""
        assert self._handler is not None and self.scratch_dir is not None
        handed, notes = self._handed_fds()
        config = {**self.config, **self._hardening.config(self.scratch_dir, grouped="cgroup_fd" in handed)}
        request = {"env": self._env(), "cwd": self.scratch_dir, "config": config, "fd_names": list(handed)}
        ours, theirs = socket.socketpair()
        log = self._new_log()
        try:
            pid = await server.fork(
                theirs.fileno(), log.write_fd, request, self.start_timeout, list(handed.values())
            )
            process = ForkedProcess(pid)
        except BaseException as exc:  # also a cancelled start: a worker forked anyway sees EOF, exits
            ours.close()
            log.spawned()
            if notes >= 0:
                self._cleanup.close_fd(notes)
            if isinstance(exc, (WorkerVanished, ProcessLookupError)):
                # It exited before the host could watch it (one that cannot even prepare dies at
                # once, and a loaded host looks late): a failed forked worker, as below.
                error, _tail = await self._gone_error(
                    log, "the forked REPL worker", "exited before it was seen"
                )
                server.retire(str(error))
                return None
            if isinstance(exc, ZygoteGone):
                return None
            raise
        finally:
            theirs.close()
            log.spawned()
            for fd in handed.values():
                os.close(fd)
        self._hardening.using_bwrap = True  # a zygote runs only under bwrap (why_not_forked)
        worker = Connection(FrameSocket(ours), self._handler, process, log=log, notes_fd=notes)
        self._cleanup.process = worker.process
        failure: BaseException | None = None
        try:
            async with asyncio.timeout(self.start_timeout):
                ready = await asyncio.shield(worker.ready)
        except (TimeoutError, WorkerGone) as exc:
            failure = exc
        else:
            self._worker_ready(worker, pid, ready, same_pidns=False)
            # Its own report, not our assumption, decides: no forked worker without these layers.
            gap = _sibling_gap(self.isolation)
            failure = SandboxError(gap) if gap is not None else None
        if failure is not None:
            # What fails one forked worker (the kernel refusing a step, say) would fail them all:
            # no more forks, and this worker is started anew.
            error, _tail = await self._failed_start(worker, failure, "the forked REPL worker")
            server.retire(str(error))
            return None
        self.isolation["forked"] = True
        return worker

    async def _spawn_started(self) -> Connection:
        assert self._handler is not None and self.scratch_dir is not None
        self._hardening.own_scratch(self.scratch_dir)
        ours, theirs = socket.socketpair()
        log = self._new_log()
        handed, notes = self._handed_fds()
        # vfork holds the caller until the child execs, which on a busy machine is long (many
        # children starting at once; docs/performance.md, "Figures behind choices in the code"):
        # in a thread it does not stall the event loop. asyncio's subprocess API would add a child
        # watcher and pipe transports we do not want.
        launch = _Launch(
            functools.partial(
                subprocess.Popen,
                self._command(theirs.fileno(), handed=handed),
                pass_fds=(theirs.fileno(), *handed.values()),
                cwd=self.scratch_dir,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log.write_fd,
                stderr=log.write_fd,
                start_new_session=True,  # its own process group: one killpg stops everything it started
            ),
            (theirs, ours),
            (log.write_fd, *handed.values()),
        )
        try:
            proc = await asyncio.to_thread(launch.run)
        except asyncio.CancelledError:
            if notes >= 0:  # our end of the notes pipe, held by _cleanup: its finalizer may have closed it
                self._cleanup.close_fd(notes)
            launch.abandon()
            raise
        except OSError as exc:
            ours.close()
            log.spawned()
            if notes >= 0:
                self._cleanup.close_fd(notes)
            raise SandboxError(f"cannot start the REPL worker with {self.python!r}: {exc}") from None
        finally:
            if not launch.abandoned:
                theirs.close()
                log.spawned()
                for fd in handed.values():
                    os.close(fd)
        worker = Connection(FrameSocket(ours), self._handler, LocalProcess(proc), log=log, notes_fd=notes)
        self._cleanup.process = worker.process
        try:
            async with asyncio.timeout(self.start_timeout):
                ready = await asyncio.shield(worker.ready)
        except (TimeoutError, WorkerGone) as exc:
            error, tail = await self._failed_start(worker, exc, "the REPL worker")
            if isinstance(exc, WorkerGone) and self._hardening.start_failed(tail):
                return await self._spawn_started()  # bwrap cannot run here: the same worker without it
            raise error from None
        try:
            self._worker_ready(worker, proc.pid, ready)
        except SandboxError:  # it runs, but not as safely as this host demands: stop it
            await worker.kill()
            self._release_log(worker)
            raise
        return worker

    def _worker_ready(
        self, worker: Connection, root: int, ready: dict[str, Any], same_pidns: bool | None = None
    ) -> None:
        assert isinstance(worker.process, LocalProcess)
        worker.process.signal_pid, self.isolation = self._hardening.ready(
            root, ready, lambda: worker.alive, self._note_sink()
        )
        self._locate_worker(worker.process, ready, same_pidns)

    def _locate_worker(self, process: LocalProcess, ready: dict[str, Any], same_pidns: bool | None) -> None:
        """With snapshots a keeper sits between the process we started and the worker (worker/keeper.py,
        `split_off_keeper`): find the worker's host pid, and keep the process guard off the keeper.
        `same_pidns`: whether the worker's pids are ours, if known (else guessed from its report)."""
        pid, ppid, root = ready.get("pid"), ready.get("ppid"), process.root_pid
        # Unless told, its pids come from a namespace (bwrap) when neither is the process we started.
        process.same_pidns = root in (pid, ppid) if same_pidns is None else same_pidns
        if process.same_pidns:
            if isinstance(pid, int):
                process.signal_pid = self._hardening.worker_pid = pid
            keeper = root if pid != root else None
        else:
            if self._hardening.using_bwrap:
                process.resolve_pid = lambda ns_pid: inner_pid(root, ns_pid)
            # (Pid 1 is bwrap's init, or a forked worker's keeper at the top of its own namespace.)
            keeper = inner_pid(root, ppid) if isinstance(ppid, int) and ppid > 0 else None
        if keeper is not None:
            self._hardening.spare.add(keeper)
        process.found_worker()

    def _before_takeover(self) -> None:
        self._hardening.before_takeover()

    async def _on_takeover(self, conn: Connection) -> None:
        # The data-size limit and the process guard follow the snapshot that took over.
        if self._hardening.takeover(conn.pid, conn.restored, lambda: conn.alive):
            conn.on_snapshot = self._hardening.audit_snapshots
            with contextlib.suppress(OSError, ValueError):
                await conn.chan.send({"op": "cell_closed"})  # it waits for it to fork its snapshot

    def _handed_fds(self) -> tuple[dict[str, int], int]:
        """Descriptors a new worker inherits, by the name its config gives their numbers under (the
        caller closes them once the worker has them), and our end of the keeper's notes (-1 if
        none): its control group's (hardened.py), and with snapshots the write end of a pipe only
        the keeper keeps, for notes on how the processes below it ended. The worker's log will not
        do for those: cell output goes there too, and could write a note of its own."""
        handed: dict[str, int] = {}
        group = self._hardening.group_fds()
        self._cleanup.group = self._hardening.group  # a dropped sandbox's finalizer removes it too
        handed.update(group)
        notes = -1
        if self.config.get("keeper"):
            notes, handed["keeper_fd"] = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(notes, False)
            os.set_blocking(handed["keeper_fd"], False)  # a full pipe loses a note, never stalls the keeper
            self._cleanup.fds.add(notes)
        return handed, notes

    async def _enter_cell(self, worker: Connection, fresh: bool) -> None:
        if not self._hardening.cells_grouped:
            return
        # (Where the worker's threads are in place for good, cgroups.py, nothing moves.)
        if (
            not self._hardening.cells_placed
            and not fresh
            and worker.control is not None
            and not worker.snapshot_reported.is_set()
            and (self.snapshots != "idle" or worker.word_sent)  # else it forks none (base.SnapshotMode)
        ):
            # The worker forks its snapshot of the last state after its answer: moved into the cell
            # group before that, the snapshot would be among what the host kills at the cell's end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.restore_timeout):
                    await worker.snapshot_reported.wait()
        self._hardening.enter_cell(worker.pid)

    async def _end_cell(self, answered: Connection | None) -> int:
        self._hardening.close_cell()  # first: from its answer on, the cell starts nothing
        snapshots = answered is not None and answered.control is not None
        if answered is not None and self._hardening.leave_cell(answered.pid, snapshots, answered.reported_pid):
            answered.on_snapshot = self._hardening.audit_snapshots
            if self.snapshots != "idle":
                with contextlib.suppress(OSError, ValueError):
                    await answered.chan.send({"op": "cell_closed"})  # the worker waits for it to snapshot
        if answered is not None and snapshots and self.snapshots == "idle":
            answered.cell_closed_when_idle(self.snapshot_idle_s)  # the worker forks on this word only
        return await self._hardening.end_cell()

    def idle_now(self) -> None:
        """With snapshots="idle": nothing follows the last cell for now (the policy is thinking), as
        someone else's clock says, so the word to fork its snapshot goes now rather than after
        snapshot_idle_s (a REPL on a Ray node: its driver's loop says it, cluster/node.py)."""
        if self._worker is not None:
            self._worker.word_now()

    def _cell_notes(self) -> list[str]:
        return self._hardening.cell_notes()

    async def close(self) -> None:
        self._hardening.stop()
        await super().close()
        self._cleanup.group = None
        await self._hardening.release()

    async def _send_context(self, worker: Connection, spec: ContextSpec) -> None:
        await super()._send_context(worker, spec)
        self._hardening.after_context(self.isolation)  # the data-size limit: context + headroom


def _sibling_gap(isolation: dict[str, Any]) -> str | None:
    """What a forked worker's report lacks of what keeps it apart from its siblings, if anything."""
    if not isolation.get("seccomp"):
        return "no seccomp filter"
    if "signal" not in isolation.get("landlock_scopes", []):
        return "no Landlock signal scoping"
    if not isolation.get("capabilities_dropped"):
        return "capabilities left"
    return None


_SLOTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _start_slots() -> asyncio.Semaphore:
    """At most two worker starts per CPU at a time, per event loop.

    A start is CPU-bound (bwrap, an interpreter, imports, hardening), so starting many more at once
    than there are CPUs finishes none sooner; it only takes the CPU from everything else in this
    process. And badly so: each worker runs in a session of its own, so the kernel's autogroup
    scheduling shares the CPU equally between the host and every starting worker, and the event
    loop's thread waits for a CPU while they start (docs/performance.md, "Figures behind choices in
    the code").
    """
    loop = asyncio.get_running_loop()
    slots = _SLOTS.get(loop)
    if slots is None:
        slots = _SLOTS[loop] = asyncio.Semaphore(2 * len(os.sched_getaffinity(0)))
    return slots


class _Launch:
    """One Popen in a worker thread that a cancelled start can abandon at any moment.

    Whoever comes second (the thread finishing Popen, or the caller giving up) stops the process
    and closes the channel and log, so a run cancelled mid-start leaves nothing behind, whether or
    not its event loop keeps running.
    """

    def __init__(
        self,
        popen: Callable[[], subprocess.Popen[bytes]],
        sockets: tuple[socket.socket, ...],
        fds: tuple[int, ...],
    ):
        self._popen = popen
        self._sockets = sockets
        self._fds = fds  # the log and the other descriptors of this start, closed if it is abandoned
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.abandoned = False

    def run(self) -> subprocess.Popen[bytes]:
        try:
            proc = self._popen()
        except BaseException:
            with self._lock:
                if self.abandoned:
                    self._discard(None)
            raise
        with self._lock:
            if not self.abandoned:
                self._proc = proc
                return proc
        self._discard(proc)
        return proc

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            proc = self._proc
        if proc is not None:  # Popen had returned: the thread left the clean-up to us
            threading.Thread(target=self._discard, args=(proc,), name="recursa-reap", daemon=True).start()

    def _discard(self, proc: subprocess.Popen[bytes] | None) -> None:
        for sock in self._sockets:
            sock.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
