"""Snapshots: timeouts that keep state.

While a cell runs, a forked copy of this process (a snapshot) waits, idle, holding the state from
before the cell; copy-on-write makes the fork cost page tables, not pages. If the cell cannot be
stopped with SIGINT (a C loop holding the GIL, code that swallows KeyboardInterrupt) or kills the
process, the host tells the snapshot to take over: it kills the stuck worker and carries on in its
place, on a fresh channel the host hands it, with every variable from before the cell.

The snapshot only ever reads the control socket (SOCK_SEQPACKET, so a snapshot killed mid-read
cannot leave half a message for the next one): the worker's channel may hold half a frame that the
dead worker's reader had started on, so it is never reused. Messages name the snapshot they are
for ("sid"), so one sent to a snapshot that was just discarded is ignored by its successor.

A snapshot does not use PR_SET_PDEATHSIG while it waits: its parent is the worker, and the worker
dying is exactly when it is needed. It dies with the host instead through the control socket,
whose other end only the host holds: end-of-file there means the host is gone (or replaced this
worker), and the snapshot then also kills the worker it belongs to, even one stuck in C code.

A snapshot stays in the worker's process group (seccomp denies setpgid, so that nothing in the
sandbox escapes the host's group kill): it kills the stuck worker by pid, and the host removes
whatever else the killed cell had started.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
import threading
import time
from _queue import SimpleQueue  # queue.SimpleQueue itself, without importing the queue module

from .keeper import die_with_parent
from .wire import SocketTransport, WorkerChannel, decode_frame

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class Snapshots:
    """The snapshot of this worker that is ready to take over, if any."""

    def __init__(self) -> None:
        self.control: socket.socket | None = None  # from the host's `standby` frame
        self.pid = 0  # the waiting snapshot, 0 if none
        self.dying: list[int] = []  # discarded snapshots not reaped yet
        self.forker: Forker | None = None  # the thread that forks them, where the host wants one
        self._sids = itertools.count(1)

    @property
    def armed(self) -> bool:
        return self.control is not None

    def arm(self, fd: int) -> None:
        if fd < 0:
            return
        os.set_inheritable(fd, False)
        if self.control is not None:
            self.control.close()
        self.control = socket.socket(fileno=fd)

    def alive(self) -> bool:
        """False once the waiting snapshot has died (the host's process guard may kill it)."""
        if not self.pid:
            return False
        try:
            done, _status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done = self.pid
        if done:
            self.pid = 0
        return not done

    def discard(self, wait: bool = True) -> None:
        """Kill the waiting snapshot. Without `wait` it is reaped later (`reap`): waiting for a
        process that shares this one's pages to exit took longer than forking the next snapshot
        (the kernel tears its mappings down first), on the path of the next cell."""
        pid, self.pid = self.pid, 0
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            self.dying.append(pid)
        if wait:
            self.reap(block=True)

    def reap(self, block: bool = False) -> None:
        """Collect discarded snapshots that have exited (all of them with `block`)."""
        left = []
        for pid in self.dying:
            try:
                done, _status = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                continue
            if not done:
                left.append(pid)
        self.dying = left

    def take(
        self,
        chan: WorkerChannel,
        resume: Callable[[SocketTransport, dict[str, Any]], None],
        first: Callable[[], bool] | None = None,
    ) -> bool:
        """Replace the waiting snapshot with a fresh one of the current state, once `first()` (if
        given: the wait for the host's word, run on the forking thread so that it is awake when the
        word comes) says so; whether it did (or tried: a failed fork is reported to the host).

        Returns in this process. In the snapshot, once it has been told to take over, calls
        `resume(transport, info)` (its new channel and the facts for the `restored` frame) to carry
        on as the worker, and exits when that returns. Call from the main thread between requests,
        when no frame is half sent by it.
        """
        self.discard(wait=False)
        self.reap()
        sid = next(self._sids)
        parent = os.getpid()
        # Besides this thread, the channel's reader and the forker.
        threads = max(0, threading.active_count() - 2 - (self.forker is not None))
        rand = sys.modules.get("random")  # random reseeds itself in a forked child; keep its state
        rand_state = rand.getstate() if rand is not None else None

        def fork() -> int:
            if first is not None and not first():
                return -1
            pid = _fork(self)
            if pid:
                return pid
            try:  # the snapshot: only this thread exists here; the channel's locks are left behind
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                chan.close_copy()
                fds = self._wait(parent, sid)
                transport, info = self._take_over(parent, fds)
                if rand is not None and rand_state is not None:
                    rand.setstate(rand_state)
                info.update(op="restored", sid=sid, threads_lost=threads)
            except BaseException:
                os._exit(1)
            self.forker = None  # it was the parent's: this process makes its own (see Forker)
            try:
                resume(transport, info)
            finally:
                os._exit(0)  # never back into the loop of the thread that forked it

        try:
            pid = self.forker.run(fork) if self.forker is not None else fork()
        except OSError as exc:
            chan.send({"op": "snapshot", "ok": False, "error": f"fork failed: {exc}"})
            return True
        if pid < 0:
            return False
        self.pid = pid
        chan.send({"op": "snapshot", "ok": True, "sid": sid, "pid": pid})
        return True

    def _wait(self, parent: int, sid: int) -> list[int]:
        """Block until the host says take over; act on interrupts meanwhile; exit when it is gone."""
        assert self.control is not None
        while True:
            data, fds, _flags, _addr = socket.recv_fds(self.control, 65536, 4)
            if not data:
                if os.getppid() == parent:
                    os.kill(parent, signal.SIGKILL)
                os._exit(0)
            try:
                msg = decode_frame(data)
            except ValueError:
                msg = {}
            op = msg.get("op")
            if msg.get("sid") == sid and op == "takeover" and len(fds) == 2:
                return fds
            for fd in fds:
                os.close(fd)
            if msg.get("sid") == sid and op == "interrupt" and os.getppid() == parent:
                try:
                    os.kill(parent, signal.SIGINT)  # in-band: for hosts that cannot see our pids
                except OSError:
                    pass  # refused (seccomp without Landlock signal scoping): the host falls back

    def _take_over(self, parent: int, fds: list[int]) -> tuple[SocketTransport, dict[str, Any]]:
        if os.getppid() == parent:  # else it already died on its own
            os.kill(parent, signal.SIGKILL)  # refused (PermissionError) is fatal: the host falls back
        deadline = time.monotonic() + 5.0
        while os.getppid() == parent and time.monotonic() < deadline:  # reparented once it is gone
            time.sleep(0.0005)
        gone = os.getppid() != parent
        die_with_parent()  # our new parent: the pid namespace's init under bwrap, else a reaper
        for fd in fds:
            os.set_inheritable(fd, False)
        assert self.control is not None
        self.control.close()
        self.control = socket.socket(fileno=fds[1])
        info = {"pid": os.getpid(), "pgid": os.getpgid(0), "old_worker_gone": gone}
        return SocketTransport(socket.socket(fileno=fds[0])), info


# How often, 1 ms apart, a fork the snapshot group has no room for is tried again (see _fork).
_FORK_TRIES = 20


def _fork(snapshots: Snapshots) -> int:
    """os.fork(); where the kernel refuses for want of tasks, again after reaping the discarded
    snapshots (the host's snapshot group counts one that was killed until it is reaped), and where
    none is ours to reap, a few times more: a snapshot that has just taken over may find the old
    worker's discarded one still counted until the keeper reaps it."""
    for _ in range(_FORK_TRIES - 1):
        try:
            return os.fork()
        except BlockingIOError:
            if snapshots.dying:
                snapshots.reap(block=True)
            else:
                time.sleep(0.001)
    return os.fork()


class Forker:
    """A thread of the worker that only forks its snapshots.

    Where the host runs cells in a control group of their own (cgroup v1, see
    recursa/sandbox/cgroups.py), the worker's main thread lives in the cell's group, so whatever it
    forks is killed at the end of a cell; this thread lives in the snapshot group instead, which the
    kernel caps. Each thread joins its group itself, by writing "0" to a `tasks` descriptor: the
    kernel moves the calling thread without the lock a move of another thread takes, whose writer
    waits for an RCU grace period (milliseconds after an idle spell, on every cell). A fork copies
    the whole process whichever thread calls it; in the child this thread is the only one, and the
    main thread (Python makes it so), and carries on as the snapshot.
    """

    def __init__(self, join: Callable[[], None] | None = None) -> None:
        self._jobs: SimpleQueue[Callable[[], int]] = SimpleQueue()
        self._done: SimpleQueue[Any] = SimpleQueue()
        threading.Thread(target=self._serve, args=(join,), name="recursa-snapshots", daemon=True).start()
        joined = self._done.get()
        if isinstance(joined, BaseException):
            raise joined

    def _serve(self, join: Callable[[], None] | None) -> None:
        try:
            if join is not None:
                join()
            self._done.put(None)
        except BaseException as exc:
            self._done.put(exc)
            return
        while True:
            job = self._jobs.get()
            try:
                self._done.put(job())
            except BaseException as exc:
                self._done.put(exc)

    def run(self, job: Callable[[], int]) -> int:
        """Run `job` (a fork) on this thread and return what it returned in this process."""
        self._jobs.put(job)
        out = self._done.get()
        if isinstance(out, BaseException):
            raise out
        return int(out)
