"""Handles on worker processes: how the host interrupts, kills, watches and reaps one worker.

The shared host (`host.py`) never touches a process directly: an adapter gives it a
`WorkerProcess` for every worker it starts, and the handle says how that kind of process is stopped.

- `LocalProcess`: started by this host in a new session, so its pid is also its process group and
  session id. The worker is that process, or below it: with fork snapshots a keeper sits in between
  (worker/keeper.py, `split_off_keeper`), and bwrap may wrap both. SIGINT goes to the worker, SIGKILL to
  the whole group; the process this host started is reaped here.
- `ForkedProcess`: the same for a worker forked by a zygote (worker/zygote.py), which is not our child:
  watched through a pidfd, reaped by the kernel for the zygote.
- `AdoptedProcess`: a snapshot that took over. It is not our child, so it is watched and signalled
  through a pidfd; it stays in the original process group, so killing the group still stops all.
- `ShadowProcess`: a snapshot that took over where the host cannot find its pid: interrupts go
  in-band through the worker's own snapshot, kills go to the root process.

Pids the worker reports are in its own pid namespace; `resolve_pid` turns them into host pids (the
identity without a namespace; a /proc walk under bwrap, set by the adapter). A pid in a `restored`
frame is not trusted: code in earlier cells may have rewritten the worker's own functions, which
the snapshot inherits. So it is only accepted for a process of the sandbox's own session (without a
namespace) or below the process the host started (bwrap): a forged pid cannot point the host's
signals at anything outside the sandbox.

Killing a process group by number is safe while one member of it, or of the session it names, is
alive: the kernel does not hand out a pid that is still in use as a group or session id.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from typing import Any

from recursa.sandbox.proc import kill_owned, processes, stat_fields


class WorkerProcess:
    """How to stop one worker process. The base class knows nothing (a remote process)."""

    pid: int | None = None  # the worker's pid in the host's pid namespace, when known
    can_signal = False  # True when interrupt() reaches the worker itself

    def watch(self, on_exit: Callable[[], None]) -> None:
        """Call `on_exit` once when the worker has exited (if this handle can tell)."""

    def exited(self) -> bool:
        """True once the worker is known to have exited (without reaping it)."""
        return False

    async def wait_exit(self, timeout: float) -> bool:
        return await _poll(self.exited, timeout)

    def interrupt(self) -> None:
        """Send SIGINT to the worker (best effort)."""

    async def kill(self) -> None:
        """Stop the worker and everything it started; reap what is ours to reap. Idempotent."""

    def kill_now(self) -> None:
        """`kill` without an event loop, for a finalizer: best effort, may block briefly."""

    def describe_exit(self) -> str:
        return "it stopped answering"

    def adopt(self, restored: dict[str, Any]) -> WorkerProcess:
        """The handle for the snapshot that took over from this worker (its `restored` frame)."""
        return ShadowProcess(self)

    def kill_strays(self, keep: int) -> int:
        """Kill what a killed cell left behind in the worker's group, except `keep` and its children."""
        return 0


# ioctl(pidfd, PIDFD_GET_INFO): _IOWR(0xFF, 11, struct pidfd_info), 64 bytes; exit_code at offset 60.
_PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {_signal_name(os.WTERMSIG(status))}"
    return f"exit code {os.WEXITSTATUS(status)}"


def group_members(pgid: int) -> list[tuple[int, int, str]]:
    """(pid, ppid, state) of the processes in group `pgid`, read from /proc (Linux)."""
    return [(pid, int(f[1]), f[0].decode()) for pid, f in processes() if int(f[2]) == pgid]


class _Pid:
    """One process by pidfd, whether or not it is our child: exit watch, exit status, signals."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd = os.pidfd_open(pid)  # raises ProcessLookupError if it is already gone
        except (AttributeError, OSError) as exc:
            if isinstance(exc, ProcessLookupError):
                raise
            self.fd = -1
        self._watching = False

    def watch(self, on_exit: Callable[[], None]) -> None:
        if self.fd >= 0 and not self._watching:
            asyncio.get_running_loop().add_reader(self.fd, self._fire, on_exit)
            self._watching = True

    def _fire(self, on_exit: Callable[[], None]) -> None:
        self.unwatch()
        on_exit()

    def unwatch(self) -> None:
        if self._watching:
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                asyncio.get_running_loop().remove_reader(self.fd)
            self._watching = False

    def exited(self) -> bool:
        if self.fd >= 0:
            # poll, not select: select() refuses an fd above 1023 (FD_SETSIZE), and a host running
            # a few hundred sandboxes holds more open files than that (benchmarks/load.py).
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            return bool(poller.poll(0))
        return not os.path.exists(f"/proc/{self.pid}")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            if self.fd >= 0:
                signal.pidfd_send_signal(self.fd, sig)
            else:
                os.kill(self.pid, sig)

    def status(self) -> int | None:
        """The wait status, where the kernel still tells it to a process that is not the parent.

        While it is a zombie /proc shows it; once reaped, Linux 6.15+ keeps it on the pidfd
        (PIDFD_GET_INFO). Else None (the keeper's log line says it then; see host.py).
        """
        fields = stat_fields(self.pid)
        if fields is not None and fields[0] == b"Z" and len(fields) >= 50:
            return int(fields[49])  # field 52 of stat: exit_code, as waitpid reports it
        if self.fd < 0:
            return None
        info = bytearray(64)
        struct.pack_into("Q", info, 0, _PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(self.fd, _PIDFD_GET_INFO, info)
        except OSError:
            return None
        if not struct.unpack_from("Q", info, 0)[0] & _PIDFD_INFO_EXIT:
            return None
        return int(struct.unpack_from("i", info, 60)[0])

    def describe_exit(self) -> str:
        if not self.exited():
            return "it stopped answering"
        status = self.status()
        return _describe_status(status) if status is not None else "it exited"

    def close(self) -> None:
        self.unwatch()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalProcess(WorkerProcess):
    """The process this host started with `start_new_session=True`, and the worker at or below it."""

    can_signal = True

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self._set_root(proc.pid)

    def _set_root(self, pid: int) -> None:
        self.root_pid = self.group = pid  # the process this host started leads the group
        # The worker's own host pid: the same, unless a keeper or a wrapper (bwrap) sits in between
        # (the adapter sets it from the worker's `ready` frame, then calls found_worker()).
        self.signal_pid = pid
        self.same_pidns = True  # False when the worker reported pids from another namespace
        # Set by an adapter that can map a pid from the worker's namespace to ours (bwrap.inner_pid).
        self.resolve_pid: Callable[[int], int | None] | None = None
        self._root = _Pid(pid)
        self._worker: _Pid | None = None
        self._on_exit: Callable[[], None] | None = None
        self._killed = False

    @property
    def pid(self) -> int:  # type: ignore[override]
        return self.signal_pid

    def watch(self, on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._root.watch(on_exit)

    def found_worker(self) -> None:
        """The worker is `signal_pid`, below the process we started: watch it too."""
        if self.signal_pid != self.root_pid and self._worker is None:
            with contextlib.suppress(ProcessLookupError):
                self._worker = _Pid(self.signal_pid)
                if self._on_exit is not None:
                    self._worker.watch(self._on_exit)

    def _root_exited(self) -> bool:
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def exited(self) -> bool:
        return self._root_exited() or (self._worker is not None and self._worker.exited())

    async def wait_exit(self, timeout: float) -> bool:
        return await _poll(self.exited, timeout, [self._root, *([self._worker] if self._worker else [])])

    def interrupt(self) -> None:
        if self._worker is not None:
            self._worker.signal(signal.SIGINT)
        elif not self._root_exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.signal_pid, signal.SIGINT)

    async def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        self._kill_group()
        await _poll(self._root_exited, 5.0, [self._root])
        if self._worker is not None:
            # Below a keeper or bwrap the worker dies a moment after the process we started (by its
            # parent-death signal, or with its pid namespace): the close returns once it is gone.
            await _poll(self._worker.exited, 1.0, [self._worker])
        self._reap()

    def kill_now(self) -> None:
        if not self._killed:
            self._kill_group()
        self._killed = True
        self._reap()

    def _kill_group(self) -> None:
        # Only before reaping: while the leader is unreaped its pid (= the group id) cannot be
        # reused, so killpg can never hit an unrelated process.
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)

    def _reap(self) -> None:
        self._root.close()
        if self._worker is not None:
            self._worker.close()
        self._wait_root()

    def _wait_root(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2.0)

    def describe_exit(self) -> str:
        if self._worker is not None:
            return self._worker.describe_exit()
        code = self.proc.returncode
        if code is None:  # not reaped yet: peek at the status
            try:
                info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is None:
                return "it stopped answering"
            code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
        return f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"

    def _in_session(self, pid: int) -> int | None:
        """`pid` if it is a process of the session we started (seccomp keeps sandboxed code from
        leaving it, and nothing can join it from outside), else None."""
        fields = stat_fields(pid)
        return pid if fields is not None and int(fields[3]) == self.group and pid != self.root_pid else None

    def adopt(self, restored: dict[str, Any]) -> WorkerProcess:
        pid = restored.get("pid")
        resolve = self.resolve_pid or (self._in_session if self.same_pidns else _no_pid)
        host_pid = resolve(pid) if isinstance(pid, int) else None
        if host_pid is None:
            return ShadowProcess(self)
        # Raises ProcessLookupError if it is already gone (the caller then starts afresh).
        adopted = AdoptedProcess(host_pid, self.group, root=self, resolve_pid=resolve)
        adopted.sweep = self.same_pidns  # under bwrap the group also holds bwrap's own processes
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        elif self.same_pidns:
            # No keeper: the process we started was the worker, now dead (the snapshot waited for
            # it). Reap it, but leave the group alone: the snapshot, a member, keeps it valid.
            self._killed = True
            self._reap()
        return adopted


class ForkedProcess(LocalProcess):
    """A worker a zygote forked (worker/zygote.py): the leader of a session of its own, like a process this
    host started, but not our child. The zygote's kernel-side reaping takes its exit status, so it
    is watched through a pidfd, and its group is killed with `_kill_group_number`."""

    def __init__(self, pid: int) -> None:
        self._set_root(pid)  # raises ProcessLookupError if it is already gone

    def _root_exited(self) -> bool:
        return self._root.exited()

    def _kill_group(self) -> None:
        _kill_group_number(self.group)

    def _wait_root(self) -> None:
        pass  # the zygote's kernel-side reaping does it

    def describe_exit(self) -> str:
        return (self._worker or self._root).describe_exit()


class AdoptedProcess(WorkerProcess):
    """A snapshot that took over: not our child, so watched and signalled through a pidfd."""

    can_signal = True

    def __init__(
        self,
        pid: int,
        group: int,
        *,
        root: LocalProcess,
        resolve_pid: Callable[[int], int | None],
    ) -> None:
        self.pid = pid
        self.group = group
        self.root = root  # the process this host started (a keeper, bwrap, or the first worker)
        self.resolve_pid = resolve_pid
        self.sweep = True  # may kill_strays() kill other members of the group?
        self._proc = _Pid(pid)
        self._killed = False

    def watch(self, on_exit: Callable[[], None]) -> None:
        self._proc.watch(on_exit)

    def exited(self) -> bool:
        return self._proc.exited()

    async def wait_exit(self, timeout: float) -> bool:
        return await _poll(self.exited, timeout, [self._proc])

    def interrupt(self) -> None:
        self._proc.signal(signal.SIGINT)

    def _kill_signal(self) -> None:
        _kill_group_number(self.group)
        self._proc.signal(signal.SIGKILL)

    async def kill(self) -> None:
        if self._killed:  # after close() the pid may belong to someone else: never signal it twice
            return
        self._killed = True
        self._kill_signal()
        await self.wait_exit(5.0)
        self._proc.close()
        await self.root.kill()  # reaps it (the keeper, bwrap, or the long-dead first worker)

    def kill_now(self) -> None:
        if self._killed:
            return
        self._killed = True
        self._kill_signal()
        self._proc.close()
        self.root.kill_now()

    def describe_exit(self) -> str:
        return self._proc.describe_exit()

    def adopt(self, restored: dict[str, Any]) -> WorkerProcess:
        pid = restored.get("pid")
        host_pid = self.resolve_pid(pid) if isinstance(pid, int) else None
        if host_pid is None:
            return ShadowProcess(self.root)
        adopted = AdoptedProcess(host_pid, self.group, root=self.root, resolve_pid=self.resolve_pid)
        adopted.sweep = self.sweep
        self._proc.close()  # not our child: its parent (the keeper, or init) reaps it
        return adopted

    def kill_strays(self, keep: int) -> int:
        if not self.sweep:
            return 0
        return _kill_group_except(self.group, keep, root=self.root.root_pid)


class ShadowProcess(WorkerProcess):
    """A worker whose pid the host cannot see: interrupts go in-band, kills go to the root process."""

    def __init__(self, root: WorkerProcess) -> None:
        self.root = root

    async def kill(self) -> None:
        await self.root.kill()

    def kill_now(self) -> None:
        self.root.kill_now()

    def adopt(self, restored: dict[str, Any]) -> WorkerProcess:
        return ShadowProcess(self.root)


async def _poll(done: Callable[[], bool], timeout: float, pids: list[_Pid] | None = None) -> bool:
    """Until `done()` (a process state no event tells us about everywhere), or the timeout. Where
    every one of `pids` (the processes `done` looks at) has a pidfd, their exits wake the wait
    instead of a check every 2 ms: a close waits 0.1-0.5 s for the kernel to tear a REPL's
    processes down, and on a host with a few dozen closing at once those checks and their timers
    were a fifth of its CPU."""
    if pids and all(p.fd >= 0 for p in pids) and not done():
        await _until_exited(done, timeout, pids)
        return done()
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def _until_exited(done: Callable[[], bool], timeout: float, pids: list[_Pid]) -> None:
    """Wait until `done()`, woken as each of `pids` exits, at most `timeout` seconds. A pidfd is
    read on a copy of its own: the loop takes one reader per descriptor, and the original may be
    watched already (`_Pid.watch`)."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    copies = [os.dup(p.fd) for p in pids]
    watched = set(copies)

    def fired(fd: int) -> None:  # the process exited: its pidfd stays readable, so stop reading it
        loop.remove_reader(fd)
        watched.discard(fd)
        woken.set()

    try:
        for fd in copies:
            loop.add_reader(fd, fired, fd)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not done():
                    if not watched:  # all gone, and still not done (cannot happen): check each turn
                        await asyncio.sleep(0.002)
                        continue
                    await woken.wait()
                    woken.clear()
    finally:
        for fd in copies:
            if fd in watched:
                loop.remove_reader(fd)
            os.close(fd)


def _no_pid(pid: int) -> int | None:
    return None


def _kill_group_number(group: int) -> None:
    """SIGKILL process group `group`, whose leader is not our child (so not kept from reuse by us).

    A group number stays taken while any process is in the group, so while one of ours is, the
    number is ours. Once the group is empty, killpg finds nobody and fails with ESRCH; checking for
    members first (a scan of every process in /proc on every worker's close) tells nothing more: it would see a group that reused the number just as killpg
    does. Where the sandbox has a control group, that group's kill (hardened.py) is the exact one.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def _kill_group_except(group: int, keep: int, root: int) -> int:
    """SIGKILL the members of `group` other than `keep`, its children and `root`, each only if it
    belongs to the sandbox of `root` (its session is `group`: proc.belongs); how many."""
    killed = 0
    for pid, ppid, state in group_members(group):
        if pid in (keep, root) or ppid == keep or state == "Z":
            continue
        killed += kill_owned(pid, signal.SIGKILL, root, group)
    return killed
