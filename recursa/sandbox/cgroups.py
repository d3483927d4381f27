"""A control group per sandbox where this host may make one: an exact cap on the REPL's tasks and,
where the memory controller is delegated, on all the memory its processes hold together.

rlimits are per process (RLIMIT_DATA) or per user (RLIMIT_NPROC, which root ignores), and a poller
always races a fork loop; the kernel counts a cgroup's tasks and pages at the moment they are made.
The host makes a child of its own cgroup (cgroup v2 where `pids`/`memory` are enabled for its
children, the v1 `pids` hierarchy otherwise), sets `pids.max` (and `memory.max`), and hands the
worker an open descriptor of the group's `cgroup.procs`: the worker writes "0" to it (joins) before
it runs anything else, so every task it ever starts is counted, and closes it at once. The kernel
checks that write against the credentials of whoever opened the file (the host), so it works from
inside bwrap's namespaces; and for the same reason no sandboxed code may ever hold such a
descriptor: it would move any process it can name, the host's included, into a group the host
kills. From then on only the host moves processes, and it signals a member only after checking,
through a pidfd, that the kernel lists it as the sandbox's own (`proc.kill_owned`).

What the worker's threads fork never outlives a cell, whatever the code of a cell writes to the
host (a forged answer included): once it runs cells, every thread of the worker is in one of two
children of the group. `cell` holds the ones that run code of the cells and whatever they fork: the
host closes it to new tasks as a cell ends (`open_cell`) and kills what it holds but the worker
(where its count shows the worker's own threads alone, nothing else is there: own_threads.py).
`snap` holds the thread that forks the worker's snapshots (worker/snapshots.py) after the host's
word that a cell is over, capped at SNAP_TASKS; `empty_snapshots` leaves there only the snapshot
the worker reported last, once. The keeper alone stays in the group itself. On v1 the worker's
threads take their places themselves (`join_fds`); on v2 the host moves the whole worker into
`cell` for each cell and into `snap` after it.

On cgroup v1 the memory controller is a hierarchy of its own. Where it is mounted and this
process's own memory group is writable, the sandbox also gets a child there (`memory.limit_in_bytes`,
and `memory.memsw.limit_in_bytes` where swap is accounted, so swap cannot stretch it), joined the
same way through its `tasks` file. Only the child is ever written: the parent's settings (someone
else's: a container's, a session manager's) are left alone.

Removal: a group goes once the last of its processes has exited (a large one just killed frees its
memory first). One whose removal fails is tried again (its processes killed again first) at every
group this process makes and at exit; one whose host died (SIGKILL, a crash), by the next host that
makes groups in the same parent folders.

Nothing here is required: where no group can be made, `TaskGroup.create` returns None and the
host's poller (guard.py) stays the only process cap; `isolation["tasks"]` says which holds.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import itertools
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from recursa.sandbox.bwrap import namespace_pid
from recursa.sandbox.proc import exiting, kill_owned, read_small, started_at

_PREFIX = "recursa-"
_counter = itertools.count(1)
_EXIT_WAIT_S = 5.0  # how long interpreter exit waits for the left groups' killed processes to go
# The snapshot group's cap: the worker's thread that forks snapshots, the snapshot it forks, and the
# outdated one it discards (killed, counted until it is reaped: waiting for that before each fork
# took ~4 ms a cell under load). Code on that thread thus gets room for two processes at most, which
# the host kills as soon as the worker reports its snapshot (`audit_snapshots`).
SNAP_TASKS = 3
Place = Literal["cell", "snap"]
PLACES: tuple[Place, ...] = ("cell", "snap")

# Groups of this process whose removal failed (their processes were still exiting), tried again at
# the next create() and at exit. A deque: a finalizer on any thread appends while create() pops.
_left: collections.deque[TaskGroup] = collections.deque()
_left_pid = 0  # the process _left belongs to: a forked child must not touch its parent's groups
_exiting = False  # set by the exit hook: a sandbox finalized after it waits for its group itself
_exit_deadline = 0.0  # when exit stops waiting, for all groups together


# Tests only: the mount point of a cgroup2 hierarchy whose groups to use even where its `pids`
# controller is not there (it is bound to a v1 hierarchy on a v1 host): the v2 paths (joins, moves,
# cleanup) then run on such a host, without the kernel's task caps.
TEST_V2_ROOT = "RECURSA_TEST_CGROUP2_ROOT"


@dataclass(frozen=True)
class _Parent:
    path: str  # this process's own cgroup folder in that hierarchy
    version: int
    memory: bool  # the memory controller can be limited in a child (v2 only)
    memory_v1: str | None = None  # this process's own folder in a writable v1 memory hierarchy
    pids: bool = True  # the pids controller can cap a child (only TEST_V2_ROOT's may lack it)


@functools.lru_cache(maxsize=1)
def _parent() -> _Parent | None:
    """Where this process may make child groups with a pids controller, or None."""
    mounts = _cgroup_mounts()
    try:
        with open("/proc/self/cgroup") as fh:
            lines = [line.rstrip("\n").split(":", 2) for line in fh]
    except OSError:
        return None
    v2 = next((path for hid, ctrl, path in lines if hid == "0" and ctrl == ""), None)
    test_root = os.environ.get(TEST_V2_ROOT)
    if test_root:
        mounts["cgroup2"] = test_root
    if v2 is not None and "cgroup2" in mounts:
        folder = os.path.join(mounts["cgroup2"], v2.lstrip("/"))
        enabled = _read(os.path.join(folder, "cgroup.subtree_control")).split()
        if ("pids" in enabled or test_root) and os.access(folder, os.W_OK):
            return _Parent(folder, 2, "memory" in enabled, pids="pids" in enabled)
    memory = _v1_folder(lines, mounts, "memory", "memory.limit_in_bytes")
    pids = _v1_folder(lines, mounts, "pids", "cgroup.procs")
    return None if pids is None else _Parent(pids, 1, False, memory)


def _v1_folder(lines: list[list[str]], mounts: dict[str, str], name: str, probe: str) -> str | None:
    """This process's own folder in the v1 hierarchy of controller `name`, if we may make children."""
    for _hid, ctrl, path in lines:
        if name in ctrl.split(",") and name in mounts:
            folder = os.path.join(mounts[name], path.lstrip("/"))
            if os.path.isfile(os.path.join(folder, probe)) and os.access(folder, os.W_OK):
                return folder
    return None


def _cgroup_mounts() -> dict[str, str]:
    """{"cgroup2": its mount point, "pids"/"memory": those v1 hierarchies'} from /proc/self/mountinfo."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) < 5 or len(tail) < 3:
                    continue
                if tail[0] == "cgroup2":
                    found.setdefault("cgroup2", fields[4])
                elif tail[0] == "cgroup":
                    for name in ("pids", "memory"):
                        if name in tail[2].split(","):
                            found.setdefault(name, fields[4])
    except OSError:
        pass
    return found


def _read(path: str) -> str:
    try:
        return read_small(path).decode()
    except (OSError, UnicodeDecodeError):
        return ""


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as fh:
            fh.write(value)
        return True
    except OSError:
        return False


def available() -> bool:
    """Whether this process may make control groups with a task cap (see `TaskGroup.create`)."""
    return _parent() is not None


def memory_available() -> str | None:
    """Which memory cgroup `TaskGroup.create` gives a sandbox here ("v2", "v1"), or None."""
    parent = _parent()
    if parent is None:
        return None
    return "v2" if parent.memory else "v1" if parent.memory_v1 is not None else None


class TaskGroup:
    """One sandbox's control group (see the module doc)."""

    def __init__(self, path: str, version: int, max_tasks: int, memory_bytes: int | None) -> None:
        self.path = path
        self.version = version
        self.max_tasks = max_tasks
        self.memory_bytes = memory_bytes  # None where memory is not limited by this group
        # Its group in the v1 memory hierarchy, if it has one (on v2 the group itself holds memory)
        self.memory_path: str | None = None
        self.memory_kind: str | None = None  # "v2" or "v1" where a memory limit can be set
        self._oom_seen = 0  # the memory group's OOM kills already reported (oom_kills)
        self._oom_events = -1  # its memory.oom_control (v1) or memory.events (v2), kept open as above
        self._oom_text = b""
        # The cell and snapshot groups' pids.current, kept open: a pread per cell (`count`) instead of
        # an open (a cgroup.procs descriptor would not do: v1 keeps the list it read at open time).
        self._counts: dict[str, int] = {}
        # The descriptors through which the host moves the worker into those groups (v2's
        # `cgroup.procs`; on v1 only a snapshot that took over, by its `tasks`): the host's alone.
        self._movers: dict[str, int] = {}
        # Their pids.max, kept open: written twice per cell (`open_cell`, see the module doc).
        self._limits: dict[str, int] = {}
        self._generation = 0  # of the cell and snapshot groups (`renew_places`)
        self.capped = True  # its pids controller caps its tasks (see _Parent.pids)
        # Whose processes may be signalled (proc.belongs): the process the host started for the
        # sandbox and the worker's session, set once the worker is known (`own`).
        self.root: int | None = None
        self.session: int | None = None

    @classmethod
    def create(
        cls, max_tasks: int, memory_bytes: int | None = None, pool: tuple[str, str] | None = None
    ) -> TaskGroup | None:
        """A new group capped at `max_tasks` tasks and, where a memory controller is ours to use,
        at `memory_bytes` (None: no memory limit yet, see `limit_memory`); or None. `pool`: the
        folder and hierarchy ("v1"/"v2") of a memory pool (pools.py) to make its memory group in."""
        parent = _parent()
        if parent is None:
            return None
        retry_left()
        folder = pool[0] if pool is not None and pool[1] == "v2" else parent.path
        _sweep(folder)
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        path = os.path.join(folder, name)
        try:
            os.mkdir(path)
        except OSError:
            return None
        group = cls(path, parent.version, max_tasks, None)
        group.capped = parent.pids
        if group.capped and not _write(os.path.join(path, "pids.max"), str(max(1, max_tasks))):
            group.remove()
            return None
        try:
            if group.version == 2:
                # v2 lets a group hold processes or limit its children, not both: the worker joins
                # a leaf of its own, and the group's children get a pids controller of their own.
                if group.capped and not _write(os.path.join(path, "cgroup.subtree_control"), "+pids"):
                    raise OSError("the pids controller cannot be enabled for the sandbox's children")
                os.mkdir(group.join_path)
            group._make_places()
        except OSError:
            group.remove()
            return None
        if parent.memory:
            group.memory_kind = "v2"
        elif parent.memory_v1 is not None:
            memory = pool[0] if pool is not None and pool[1] == "v1" else parent.memory_v1
            _sweep(memory)
            with contextlib.suppress(OSError):
                os.mkdir(os.path.join(memory, name))
                group.memory_path = os.path.join(memory, name)
                group.memory_kind = "v1"
        if group.memory_kind is not None:
            events = "memory.events" if group.memory_kind == "v2" else "memory.oom_control"
            with contextlib.suppress(OSError):
                folder = group.memory_path or group.path
                group._oom_events = os.open(os.path.join(folder, events), os.O_RDONLY | os.O_CLOEXEC)
        if memory_bytes is not None:
            group.limit_memory(memory_bytes)
        return group

    def _make_places(self) -> None:
        """Make the cell and snapshot groups (module doc), closed and capped, and open their files."""
        tasks = "tasks" if self.version == 1 else "cgroup.procs"
        for place in PLACES:
            folder = self.place_path(place)
            os.mkdir(folder)
            self._movers[place] = os.open(os.path.join(folder, tasks), os.O_WRONLY | os.O_CLOEXEC)
            if not self.capped:
                continue
            self._counts[place] = os.open(os.path.join(folder, "pids.current"), os.O_RDONLY | os.O_CLOEXEC)
            self._limits[place] = os.open(os.path.join(folder, "pids.max"), os.O_WRONLY | os.O_CLOEXEC)
        if self.capped and not (self.open_cell(False) and self.cap_snapshots()):
            raise OSError("the cell and snapshot groups cannot be capped")

    def renew_places(self) -> bool:
        """New cell and snapshot groups for the next worker: a process counts against its group's
        cap until reaped, and one whose parents died with the last worker is left to init, which
        may never reap (some containers' do not). Whether it worked (else join_fds fails)."""
        self._close_places()
        for place in PLACES:
            with contextlib.suppress(OSError):  # else a process of it is still exiting: later
                os.rmdir(self.place_path(place))
        self._generation += 1
        try:
            self._make_places()
        except OSError:
            self._close_places()
        return bool(self._movers)

    def _close_places(self) -> None:
        for fd in (*self._counts.values(), *self._movers.values(), *self._limits.values()):
            os.close(fd)
        self._counts, self._movers, self._limits = {}, {}, {}

    def place_path(self, place: Place, generation: int | None = None) -> str:
        generation = self._generation if generation is None else generation
        return os.path.join(self.path, f"{place}-{generation}" if generation else place)

    @property
    def join_path(self) -> str:
        """Where the worker joins (its keeper stays there): on v2 a leaf, see `create`."""
        return os.path.join(self.path, "home") if self.version == 2 else self.path

    def limit_memory(self, limit: int) -> bool:
        """Cap the memory (RAM, and swap with it) all the group's processes hold together; False
        where it cannot (no memory controller here, or it holds more than `limit` already)."""
        if self.memory_kind == "v2":
            ok = _write(os.path.join(self.path, "memory.max"), str(limit))
            _write(os.path.join(self.path, "memory.swap.max"), "0")  # swap would only slow the host
        elif self.memory_path is not None:
            ram = os.path.join(self.memory_path, "memory.limit_in_bytes")
            both = os.path.join(self.memory_path, "memory.memsw.limit_in_bytes")
            # RAM + swap must stay >= RAM: lowering writes RAM first, raising needs swap's first.
            ok = _write(ram, str(limit))
            if os.path.exists(both):
                _write(both, str(limit))
                ok = ok or _write(ram, str(limit))
        else:
            return False
        self.memory_bytes = limit if ok else None
        return ok

    def open_cell(self, running: bool) -> bool:
        """Let the cell's group start tasks while a cell runs, and none between cells: code that runs
        on past its cell (a thread it started, a forged answer) starts nothing; whether it took."""
        return self._set_limit("cell", "max" if running else "0")

    def cap_snapshots(self, extra: int = 0) -> bool:
        """Cap the snapshot group at SNAP_TASKS tasks, plus `extra`: for a snapshot that takes over
        (its forking thread, while the old worker's may still count), or for the worker's threads (v2)."""
        return self._set_limit("snap", str(SNAP_TASKS + extra))

    def _set_limit(self, place: Place, value: str) -> bool:
        fd = self._limits.get(place, -1)
        if fd < 0:
            return False
        try:
            os.write(fd, value.encode())
        except OSError:
            return False
        return True

    def oom_kills(self) -> int:
        """Processes the kernel killed in this group for its memory limit since the last call."""
        if self._oom_events < 0:
            return 0
        try:  # after every cell: one pread, and a parse only when the file changed
            data = os.pread(self._oom_events, 512, 0)
        except OSError:
            return 0
        if data == self._oom_text:
            return 0
        self._oom_text = data
        at = data.find(b"\noom_kill ")
        value = data[at + 10 :].split(None, 1)[0] if at >= 0 else b"0"
        total = int(value) if value.isdigit() else 0
        new, self._oom_seen = max(0, total - self._oom_seen), total
        return new

    def reached_own_limit(self) -> bool:
        """Whether the group's memory ever came near its own limit (else a kill there was made
        for an ancestor's: a pool's, pools.py). Unknown counts as yes."""
        folder = self.memory_path or self.path
        name = "memory.max_usage_in_bytes" if self.memory_kind == "v1" else "memory.peak"
        text = _read(os.path.join(folder, name)).strip()
        if self.memory_bytes is None or not text.isdigit():
            return True
        return int(text) + (32 << 20) >= self.memory_bytes

    def join_fds(self) -> dict[str, int]:
        """Descriptors for a worker to move itself into the group as the first thing it does (it
        writes "0", then closes them before anything else), by the names the worker's config gives
        them: "cgroup_fd" and, on v1, "memory_cgroup_fd", "cell_cgroup_fd" and "snap_cgroup_fd"; the
        caller closes its copies once the worker has them. On v1 the worker puts its main thread
        in the cell group and its snapshots' forker in the snapshot group itself, once hardened
        and before anything else runs (a thread that moves itself takes none of the lock that
        moving another takes); on v2 the host moves the worker between them (`move`).

        v1: the `tasks` files, which move the calling thread only: moving a whole process
        (cgroup.procs), or another thread, takes a lock whose writer waits for an RCU grace period
        after any idle spell, where a thread that moves itself does not (docs/performance.md,
        "Figures behind choices in the code"). The worker joins while it has one thread. v2 has only
        cgroup.procs. (A v1 memory group charges a process's pages to its main thread's group, which
        never moves.)"""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        fds: dict[str, int] = {}
        paths = {"cgroup_fd": self.join_path}
        if self.memory_path is not None:
            paths["memory_cgroup_fd"] = self.memory_path
        if self.version == 1:
            # Its threads' places (worker/taskgroup.py, `place`): only v1 moves threads apart.
            paths.update(cell_cgroup_fd=self.place_path("cell"), snap_cgroup_fd=self.place_path("snap"))
        try:
            for key, folder in paths.items():
                fds[key] = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    def own(self, root: int | None, session: int | None) -> None:
        """The sandbox whose processes this group holds: `root`, the process the host started
        for it, and `session`, its worker's session (see proc.belongs)."""
        self.root, self.session = root, session

    def move(self, pid: int, place: Place) -> bool:
        """Move thread `pid` (v1; the whole process on v2) into the cell or the snapshot group;
        False if the kernel refused (it is gone, or not in this group's tree). Callers pass only a
        pid they checked to be the sandbox's worker."""
        fd = self._movers.get(place, -1)
        if fd < 0:
            return False
        try:
            os.write(fd, str(pid).encode())
        except OSError:
            return False
        return True

    def members(self, place: Place | None = None) -> list[int]:
        """The processes (host pids) in the group and all its children (its memory group's too), or
        in one child `place` only; [] once it is gone. A process shows in every group with a thread of it."""
        if place is not None:
            if self.count(place) == 0:
                return []  # v2's usual case: the cell left nothing behind
            return [int(p) for p in _read(os.path.join(self.place_path(place), "cgroup.procs")).split()]
        found = {int(p) for p in _read(os.path.join(self.join_path, "cgroup.procs")).split()}
        if self.memory_path is not None:
            found.update(int(p) for p in _read(os.path.join(self.memory_path, "cgroup.procs")).split())
        for where in PLACES:
            found.update(self.members(where))
            for generation in range(self._generation):  # a last worker's, not removed yet
                old = _read(os.path.join(self.place_path(where, generation), "cgroup.procs"))
                found.update(int(p) for p in old.split())
        return sorted(found)

    def count(self, place: Place) -> int | None:
        """Tasks charged to child `place` now (forks in flight and zombies too); None if unknown."""
        with contextlib.suppress(KeyError, OSError, ValueError):
            return int(os.pread(self._counts[place], 32, 0))
        return None

    def threads(self, place: Place) -> list[int]:
        """The threads (host ids) in child `place`; [] once it is gone."""
        name = "tasks" if self.version == 1 else "cgroup.threads"
        return [int(t) for t in _read(os.path.join(self.place_path(place), name)).split()]

    def kill(self, place: Place | None = None, keep: Collection[int] = ()) -> int:
        """SIGKILL every process in the group (or in its child `place` only) but `keep`; how many
        were signalled (see `kill_one`)."""
        return sum(self.kill_one(pid) for pid in self.members(place) if pid not in keep)

    def empty_snapshots(
        self, keep: Collection[int], reported: int | None, namespaced: bool, spared: int | None
    ) -> int | None:
        """Kill what the snapshot group holds but `keep` and the snapshot the worker reported last
        (`reported`: its pid in the worker's namespace, `namespaced` when that is not the host's),
        unless that is `spared`, the one spared last time: whatever code puts there thus lives past
        the next cell's end at most. Returns the process spared now (host pid), if any."""
        spare = None
        for pid in self.members("snap"):
            if pid in keep or exiting(pid):  # (an outdated snapshot the worker has just killed)
                continue
            if spare is None and reported is not None and pid != spared:
                if (namespace_pid(pid) if namespaced else pid) == reported:
                    spare = pid
                    continue
            self.kill_one(pid)
        return spare

    def audit_snapshots(self, keep: Collection[int], reported: int | None, namespaced: bool) -> None:
        """The worker has just reported the snapshot it keeps (`reported`; None: none): empty the
        snapshot group of all else, unless it counts the forking thread and one snapshot at most."""
        count = self.count("snap")
        if count is None or count > 2:
            self.empty_snapshots(keep, reported, namespaced, None)

    def kill_one(self, pid: int) -> bool:
        """SIGKILL `pid` once the kernel shows it as a live process of this group's sandbox
        (`own`); whether it was signalled."""
        return kill_owned(pid, signal.SIGKILL, self.root, self.session)

    def remove(self) -> bool:
        """Remove the group; False while processes are still in it (they are being killed)."""
        if not self.members("cell") and not self.members("snap"):
            self._close_places()
        if self._oom_events >= 0:
            os.close(self._oom_events)
            self._oom_events = -1
        for fd in (*self._movers.values(), *self._limits.values()):
            os.close(fd)
        self._movers, self._limits = {}, {}
        # Its children (every generation of the places, v2's `home`), whatever this object knows of
        # them: a group swept after its host died is known by its path alone. (Only those: a
        # memory pool's folder, removed the same way, holds other sandboxes' groups.)
        children: list[str] = []
        with contextlib.suppress(OSError):
            children = [
                e.path
                for e in os.scandir(self.path)
                if e.name == "home" or (e.name.partition("-")[0] in PLACES and e.is_dir(follow_symlinks=False))
            ]
        for path in (*children, self.path, self.memory_path):
            if path is None:
                continue
            try:
                os.rmdir(path)
            except FileNotFoundError:
                continue
            except OSError:
                return False
        return True

    def discard(self) -> bool:
        """Kill what is left in the group and remove it; where its processes are still exiting,
        keep it on this process's list of groups to remove later (`retry_left`, and at exit).
        Whether it is gone now."""
        self.kill()
        if self.remove():
            return True
        if _exiting:  # the exit hook has run (weakref.finalize's, run after it, calls this)
            return _remove_soon([self])
        global _left_pid
        if _left_pid != os.getpid():
            _left.clear()  # a forked child's copy of its parent's list: not its groups
            _left_pid = os.getpid()
        if self not in _left:
            _left.append(self)
        return False


def retry_left() -> int:
    """Kill the processes of this process's groups whose removal failed and try to remove them
    again; how many are still left."""
    if _left_pid != os.getpid():
        return 0
    for _ in range(len(_left)):
        try:
            group = _left.popleft()
        except IndexError:
            break
        group.kill()
        if not group.remove():
            _left.append(group)
    return len(_left)


@atexit.register
def _remove_left_at_exit() -> None:
    global _exiting, _exit_deadline
    _exiting = True
    _exit_deadline = time.monotonic() + _EXIT_WAIT_S
    if _left_pid == os.getpid() and _left:
        _remove_soon(list(_left))
        _left.clear()


def _remove_soon(groups: list[TaskGroup]) -> bool:
    """At exit: kill and remove `groups`, waiting until the exit deadline (_EXIT_WAIT_S after the
    exit hook ran) for their processes to go; whether all went."""
    deadline = _exit_deadline  # one wait for the whole exit, however many sandboxes end in it
    while True:
        busy = []
        for group in groups:
            group.kill()
            if not group.remove():
                busy.append(group)
        if not busy or time.monotonic() > deadline:
            return not busy
        groups = busy
        time.sleep(0.01)


def _sweep(parent: str, started: dict[int, float | None] | None = None) -> None:
    """Remove empty groups a host that died (killed, crashed) left behind. The host is the pid in
    the group's name, unless the process with that pid now started after the group was made (the
    pid was reused, by an unrelated process or by this host restarted in a fresh container).
    `started`: each owner's start time, read from /proc once per sweep (a host with many REPLs has
    a group per REPL, and every REPL start sweeps)."""
    started = {} if started is None else started
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith(_PREFIX):
                continue
            owner = name[len(_PREFIX) :].split("-", 1)[0]
            path = os.path.join(parent, name)
            if not owner.isdigit():
                continue
            pid = int(owner)
            if pid not in started:
                started[pid] = started_at(pid)
            if not _made_by_live(started[pid], path):
                _sweep(path, started)  # a memory pool (pools.py) holds its REPLs' groups
                TaskGroup(path, 0, 0, None).remove()


def _made_by_live(started: float | None, path: str) -> bool:
    """Whether a process that started at `started` (None: not alive) could have made the group at `path`."""
    try:
        made = os.stat(path).st_mtime
    except OSError:
        return True  # unknown: leave it
    return started is not None and started <= made + 1.0  # boot time is whole seconds
