"""Host-side limits on a running worker: how many processes it may have, and its data-size limit.

Process count. RLIMIT_NPROC counts every process of the user (a tight value would break the user's
other programs and the other REPLs of a batch) and does nothing for root, so the host watches
instead. seccomp denies setsid() and setpgid(), so everything the REPL starts stays in the worker's
process group. Every 50 ms (POLL_S) one watcher per event loop reads the system's thread total from
/proc/loadavg (one small read); only when that grew by a fair share of a limit does it count the
groups' members, all groups in one pass over /proc. Over the limit it stops the whole group (SIGSTOP reaches all members at once, and a fork in
progress is restarted), kills every member except the worker itself, resumes it and interrupts the
running cell. Zombies (children the REPL never reaped) hold pids too: past a larger limit the whole
group is killed and the worker restarts.

Memory. `set_data_limit` lowers the worker's RLIMIT_DATA from the outside with prlimit(2), to what
it uses after loading the context plus a headroom. The worker has no CAP_SYS_RESOURCE, so it cannot
raise the limit again, and seccomp keeps it from calling prlimit on any other process. A worker that
took an unprivileged uid gets it from a `prlimit` run as that uid where the host lacks
CAP_SYS_RESOURCE.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import ClassVar

from recursa.sandbox.proc import kill_owned, processes, status_bytes

ZOMBIE_FACTOR = 8  # zombies allowed per allowed process before the whole group is killed
POLL_S = 0.05  # how often the system's thread count is read


def threads_total() -> int:
    """Kernel scheduling entities on the system (/proc/loadavg, fourth field), or -1 if unknown."""
    try:
        with open("/proc/loadavg", "rb") as fh:
            return int(fh.read().split()[3].split(b"/")[1])
    except (OSError, ValueError, IndexError):
        return -1


def group_members(pgid: int, stop_after: int | None = None) -> list[tuple[int, str]]:
    """(pid, state) of the processes in process group `pgid`; stops early past `stop_after`."""
    members: list[tuple[int, str]] = []
    for pid, group, state in _processes():
        if group == pgid:
            members.append((pid, state))
            if stop_after is not None and len(members) > stop_after:
                break
    return members


def count_groups(pgids: Collection[int]) -> dict[int, tuple[int, int]]:
    """{pgid: (live processes, zombies)} for each of `pgids`, in one pass over /proc."""
    counts = {g: [0, 0] for g in pgids}
    for _pid, group, state in _processes():
        entry = counts.get(group)
        if entry is not None:
            entry[1 if state == "Z" else 0] += 1
    return {g: (c[0], c[1]) for g, c in counts.items()}


def _processes() -> Iterator[tuple[int, int, str]]:
    """(pid, process group, state) of every process in /proc."""
    for pid, fields in processes():
        yield pid, int(fields[2]), fields[0].decode()


class ProcessGuard:
    """Keeps one worker's process group at or under `limit` live processes (see the module doc)."""

    def __init__(
        self,
        pgid: int,
        main_pid: Callable[[], int],
        spare: Callable[[], Collection[int]],
        limit: int,
        alive: Callable[[], bool],
        on_trip: Callable[[str], None],
        owner: tuple[int | None, int | None] = (None, None),
    ) -> None:
        """`main_pid()`: the worker running cells now (it changes when a snapshot takes over);
        `spare()`: other members to leave alone (bwrap's init, a waiting snapshot); `alive()`:
        False once the worker is gone for good (the guard then drops out); `owner`: the process
        the host started and the worker's session, which a member must belong to (proc.belongs)
        before it is killed one by one."""
        self.pgid = pgid
        self.main_pid = main_pid
        self.spare = spare
        self.limit = max(1, limit)
        self.alive = alive
        self.on_trip = on_trip
        self.owner = owner
        self._watcher: _Watcher | None = None

    @property
    def step(self) -> int:
        """Growth of the system's thread count that makes the group worth counting."""
        return max(4, self.limit // 2)

    def start(self) -> None:
        self._watcher = _Watcher.of(asyncio.get_running_loop())
        self._watcher.add(self)

    def stop(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.guards.discard(self)
            if not watcher.guards:
                watcher.cancel()

    def judge(self, live: int, zombies: int) -> bool:
        if zombies > self.limit * ZOMBIE_FACTOR:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            self.on_trip(
                f"Your code left more than {self.limit * ZOMBIE_FACTOR} finished child processes unreaped; "
                "the REPL process and everything it started were killed."
            )
            return True
        if live <= self.limit:
            return False
        killed = self._contain()
        self.on_trip(
            f"Your code ran more than {self.limit} processes at once (the limit); {killed} of them were "
            "killed and the running cell was interrupted. Start fewer processes."
        )
        return True

    def _contain(self) -> int:
        main = self.main_pid()
        spare = {main, *self.spare()}
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGSTOP)  # nobody forks while we look
        killed = 0
        try:
            for pid, state in group_members(self.pgid):
                if pid in spare or state == "Z":
                    continue
                killed += kill_owned(pid, signal.SIGKILL, *self.owner)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGCONT)
            interrupt_main_thread(main)
        return killed


class _Watcher:
    """One per event loop: a single poll and a single /proc pass serve every guard on that loop,
    so a tree of 64 child REPLs costs no more than one."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watcher]] = (
        weakref.WeakKeyDictionary()
    )

    # Nothing here refers to the loop once its task has ended: the loop is this watcher's key in a
    # WeakKeyDictionary, and a value that held it (so did the finished task, through its _loop) kept
    # every closed loop of the process alive, one per asyncio.run (each sync RLM.run), for good.
    def __init__(self) -> None:
        self.guards: set[ProcessGuard] = set()
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Watcher:
        watcher = cls._by_loop.get(loop)
        if watcher is None:
            watcher = cls._by_loop[loop] = cls()
        return watcher

    def add(self, guard: ProcessGuard) -> None:
        """Called on the watcher's own loop."""
        self.guards.add(guard)
        # A task cancelled for want of guards may not have ended yet: it would end without this one.
        if self.task is None or self.task.done() or self.task.cancelling():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="recursa-process-guard")

    def cancel(self) -> None:
        """End the watching task now that no guard is left. It would end by itself at its next poll,
        but a private loop stopped before then (a sync wrapper's shutdown) would leave it pending,
        to be destroyed at interpreter exit with a warning."""
        task = self.task
        if task is None or task.done():
            return
        loop = task.get_loop()
        try:
            same = asyncio.get_running_loop() is loop
        except RuntimeError:
            same = False
        if same:
            self._cancel_if_idle(task)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_if_idle, task)

    def _cancel_if_idle(self, task: asyncio.Task[None]) -> None:
        if not self.guards and self.task is task:  # a guard added since keeps it watching
            task.cancel()

    async def _run(self) -> None:
        try:
            await self._watch()
        finally:
            if self.task is asyncio.current_task():
                self.task = None

    async def _watch(self) -> None:
        baseline = threads_total()
        while True:
            await asyncio.sleep(POLL_S)
            self.guards = {g for g in self.guards if g.alive()}
            if not self.guards:
                return  # the next guard starts a new task
            total = threads_total()
            if total < 0:  # no /proc/loadavg: count every time, but less often
                await asyncio.sleep(POLL_S * 9)
            elif total < baseline:
                baseline = total
                continue
            elif total - baseline < min(g.step for g in self.guards):
                continue
            guards = list(self.guards)
            try:
                await asyncio.to_thread(self._scan, guards)
            except Exception:  # a failed pass (e.g. /proc unreadable) must not end the watching
                pass
            baseline = threads_total()

    def _scan(self, guards: list[ProcessGuard]) -> None:
        counts = count_groups({g.pgid for g in guards})
        for guard in guards:
            if guard.alive():
                guard.judge(*counts[guard.pgid])


def interrupt_main_thread(pid: int) -> None:
    """SIGINT to the main thread of process `pid` (tgkill), not to the process as a whole.

    Right after a SIGCONT the main thread may not yet count as running, and the kernel then hands a
    process-wide signal to another thread (the worker's channel reader). CPython 3.11 only wakes
    the main thread's eval loop for a signal caught on the main thread, so the cell would go on as
    if nothing had happened. Aimed at the main thread (its tid is the pid) it always lands.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.tgkill(ctypes.c_int(pid), ctypes.c_int(pid), ctypes.c_int(signal.SIGINT)) == 0:
            return
    except (OSError, AttributeError):
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGINT)


def data_usage(pid: int) -> int | None:
    """VmData of `pid` in bytes (what RLIMIT_DATA counts), or None."""
    return status_bytes(pid, "VmData") or None


def set_data_limit(pid: int, limit: int, as_ids: tuple[int, int] | None = None) -> int | None:
    """Set RLIMIT_DATA (soft = hard) of `pid`; returns the hard limit read back, None on failure.

    `as_ids`: the uid and gid the worker took (a root host without bwrap). A host without
    CAP_SYS_RESOURCE (root in many containers) may change the limits of its own uid's processes
    only, so then a short-lived `prlimit` (util-linux) runs as the worker's ids to do it."""
    try:
        resource.prlimit(pid, resource.RLIMIT_DATA, (limit, limit))
    except PermissionError:
        if as_ids is None or not _prlimit_as(pid, limit, as_ids):
            return None
    except (OSError, ValueError):
        return None
    hard = _data_limit(pid)
    return None if hard is None or hard == resource.RLIM_INFINITY else hard


def _prlimit_as(pid: int, limit: int, ids: tuple[int, int]) -> bool:
    tool = shutil.which("prlimit")
    if tool is None:
        return False
    try:
        done = subprocess.run(
            [tool, "--pid", str(pid), f"--data={limit}:{limit}"],
            user=ids[0],
            group=ids[1],
            extra_groups=[],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _data_limit(pid: int) -> int | None:
    """The hard RLIMIT_DATA of `pid` from /proc (readable whoever it runs as), or None."""
    try:
        with open(f"/proc/{pid}/limits") as fh:
            for line in fh:
                if line.startswith("Max data size"):
                    hard = line[len("Max data size") :].split()[1]
                    return resource.RLIM_INFINITY if hard == "unlimited" else int(hard)
    except (OSError, ValueError, IndexError):
        pass
    return None
