"""The host side of the hardened worker: its command-line prefix and config, what it enforced, guards.

One `HostHardening` per `SubprocessSandbox`. Per worker process it
  - gives the command prefix (bwrap, when used) and the worker's `hardening` spec;
  - after the worker's `ready` frame, finds the worker's own host pid (under bwrap the process the
    host started is bwrap), builds the `isolation` dict from the worker's report, warns when the
    REPL is only partly confined, and starts the process-count guard;
  - after a context load, sets the data-size limit from outside (see guard.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import select
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from recursa.errors import SandboxError
from recursa.sandbox.bwrap import bwrap_command, find_bwrap, inner_pid, interpreter_prefixes, namespace_ids
from recursa.sandbox.bytecode import worker_files
from recursa.sandbox.cgroups import Place, TaskGroup
from recursa.sandbox.guard import ProcessGuard, data_usage, set_data_limit
from recursa.sandbox.identity import identity_spec, refuse_root_exposure, unprivileged_ids
from recursa.sandbox.own_threads import OwnThreads
from recursa.sandbox.policy import Hardening, describe, unconfined
from recursa.sandbox.pools import MemoryPool
from recursa.sandbox.proc import belongs, stat_fields
from recursa.sandbox.reported_limits import memory_entry, scratch_entry
from recursa.sandbox.worker.landlock import landlock_abi

_SCOPED_ABI = 6  # Landlock's first ABI with signal and abstract-socket scoping
# On top of the data limit and the tmpfs sizes, what a sandbox's memory cgroup allows for the rest
# of what its processes hold: stacks, page tables, socket buffers, the files they read or write.
MEMORY_MARGIN_BYTES = 256 << 20


def memory_budget(options: Hardening, data_limit: int) -> int:
    """What all of a sandbox's processes may hold together (its memory cgroup's limit): the data
    limit, the sizes of its /dev/shm and scratch tmpfs (files there are memory) and a margin."""
    return data_limit + (options.max_shm_bytes or 0) + (options.max_scratch_bytes or 0) + MEMORY_MARGIN_BYTES


_kernel_landlock_abi = functools.lru_cache(maxsize=1)(landlock_abi)


class HostHardening:
    # A bwrap that cannot start here (no user namespaces, say) fails the same way every time: after
    # the first failure, `bwrap=None` ("if available") stops trying for the rest of the process.
    bwrap_broken: ClassVar[str | None] = None

    def __init__(
        self, options: Hardening | None, bwrap: bool | None, python: str, pool: MemoryPool | None = None
    ) -> None:
        self.options = options
        self.pool = pool  # a memory bound shared with other sandboxes (pools.py), if any
        self.want_bwrap = bwrap
        self.python = python
        self.using_bwrap = False
        self.worker_pid: int | None = None  # the worker's host pid (the one running cells)
        self.spare: set[int] = set()  # group members the process guard leaves alone (bwrap's init)
        self.guard: ProcessGuard | None = None
        self.last_report: dict[str, Any] = {}
        self._alive: Callable[[], bool] = lambda: False
        self._outer_pid: int | None = None  # the process the host started (bwrap, when used)
        self._warned = False
        self.group: TaskGroup | None = None  # this sandbox's control group, once made
        self._group_tried = False
        # The worker joined the group: the host kills what each cell leaves in the cell group, and
        # with snapshots the worker waits for its "cell_closed" after answering (worker/server.py).
        self.cells_grouped = False
        # The worker put its threads in the cell and snapshot groups itself (v1, cgroups.py): the
        # host moves nothing per cell.
        self.cells_placed = False
        self.owner: tuple[int | None, int | None] = (None, None)  # (root, session): see ready()
        self._spared: int | None = None  # the snapshot leave_cell spared last (never twice)
        # The worker's threads in the cell and snapshot groups (v1, placed), which make their counts
        # tell when nothing else is there (own_threads.py).
        self._own = {"cell": OwnThreads(), "snap": OwnThreads()}
        self._checked_pid: int | None = None  # the worker pid last found to be ours (_checked)
        self._checked_fd = -1  # a pidfd of it
        self._checked_close: weakref.finalize[Any, Any] | None = None
        if bwrap and find_bwrap() is None:
            raise SandboxError(
                "bwrap=True but bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
            )

    # -- starting a worker ---------------------------------------------------------------------

    def _bwrap_path(self) -> str | None:
        if self.want_bwrap is True or (self.want_bwrap is None and HostHardening.bwrap_broken is None):
            return find_bwrap()
        return None

    def prefix(self, scratch: str, keep_caps: Sequence[str] = ()) -> list[str]:
        """The wrapper in front of the worker's command line: bwrap's arguments, or nothing."""
        path = self._bwrap_path()
        self.using_bwrap = path is not None
        if path is None:
            return []
        # Folders the user allowed must exist inside the namespace too, not only pass Landlock.
        opts = self.options
        allowed = [os.path.abspath(p) for p in opts.allow_read] if opts is not None else []
        return bwrap_command(
            path,
            self.python,
            worker_files(),
            scratch,
            allowed,
            keep_caps,
            shm_bytes=opts.max_shm_bytes if opts is not None else None,
            # A zygote's folder holds its workers' scratch folders: each child mounts its own tmpfs.
            scratch_bytes=opts.max_scratch_bytes if opts is not None and not keep_caps else None,
        )

    def why_not_forked(self) -> str | None:
        """None if workers may come from a zygote (forkserver.py), else why not: forked workers
        share bwrap's pid namespace, so only Landlock's signal scoping (ABI 6) and seccomp keep
        them apart, and both must be on and supported."""
        opts = self.options
        if opts is None:
            return "hardening is off"
        if self._bwrap_path() is None:
            return "bwrap is not used"
        if not (opts.landlock and opts.seccomp):
            return "Landlock or seccomp is turned off"
        abi = _kernel_landlock_abi()
        if opts.landlock_max_abi is not None:
            abi = min(abi, opts.landlock_max_abi)
        return (
            None if abi >= _SCOPED_ABI else f"Landlock ABI {abi} has no signal scoping (needs {_SCOPED_ABI})"
        )

    def python_flags(self) -> list[str]:
        """-S unless packages are allowed: site-packages' .pth files (code run at every start, often
        tens of milliseconds) are skipped, and third-party modules are not even on sys.path."""
        return ["-S"] if self.options is not None and not self.options.allow_site_packages else []

    def group_fds(self) -> dict[str, int]:
        """Descriptors through which the next worker joins this sandbox's control group, by their
        names in its config; {} where there is none. The caller closes them."""
        opts = self.options
        if opts is None or not opts.cgroups:
            return {}
        if not self._group_tried:
            self._group_tried = True
            data = opts.memory_limit_bytes  # None: known once the context is loaded (after_context)
            budget = None if data is None else memory_budget(opts, data)
            pool = self.pool.folder() if self.pool is not None else None
            self.group = TaskGroup.create(opts.max_processes, budget, pool)
        elif self.group is not None:
            self.group.renew_places()  # places of its own for a new worker (without, join_fds fails)
        if self.group is None:
            return {}
        try:
            return self.group.join_fds()
        except OSError:
            return {}

    def config(self, scratch: str, grouped: bool = False) -> dict[str, Any]:
        """The worker's hardening spec; `grouped`: it gets a control group (group_fds)."""
        if self.options is None:
            return {}
        spec = self.options.worker_spec(scratch, namespace_ids())
        if not grouped and self._bwrap_path() is not None and os.geteuid() != 0:
            # No group: inside bwrap's own user namespace the kernel counts RLIMIT_NPROC for this
            # sandbox alone (root ignores it, hence not for root).
            spec["max_tasks"] = self.options.max_processes
        if self._bwrap_path() is not None:
            # A private /dev/shm (a tmpfs of its own inside bwrap) for multiprocessing's semaphores;
            # the host's, shared with every other program, stays out of reach.
            spec["read_write"].append("/dev/shm")
        elif os.geteuid() == 0:
            # Root without bwrap: the worker takes an unprivileged uid (its scratch folder is given
            # to it, see own_scratch), so the host's files are someone else's to it.
            paths = (*interpreter_prefixes(self.python), *worker_files(), *spec["read_only"])
            spec["identity"] = identity_spec((*paths, os.path.dirname(scratch)), unprivileged_ids())
        if self._bwrap_path() is None:
            # No bwrap: the worker makes a mount namespace of its own where it may, every mount in it
            # read-only but scratch (the host's files keep their metadata), and scratch a sized tmpfs.
            spec["scratch_tmpfs"] = {"path": scratch, "bytes": self.options.max_scratch_bytes}
            if not grouped:
                # Where that takes a user namespace of its own, RLIMIT_NPROC counts in it alone, as
                # in bwrap's: the worker sets it there (never in the host's, where it would count
                # all the user's tasks), and not as root, whom it does not bind.
                spec["scratch_tmpfs"]["max_tasks"] = self.options.max_processes
        return {"hardening": spec}

    def own_scratch(self, scratch: str) -> None:
        """Give the scratch folder to the uid the worker takes (a root host without bwrap)."""
        if self.options is not None and self._bwrap_path() is None and os.geteuid() == 0:
            uid, gid = unprivileged_ids()
            os.chown(scratch, uid, gid)

    def start_failed(self, log_tail: str) -> bool:
        """The worker did not start. True if it is worth trying again without bwrap."""
        if not self.using_bwrap or self.want_bwrap is True:
            return False
        HostHardening.bwrap_broken = log_tail or "no output"
        warnings.warn(
            f"bwrap is installed but could not start the REPL worker ({log_tail[-300:] or 'no output'}); "
            "running it without namespaces",
            stacklevel=4,
        )
        return True

    def ready(
        self,
        proc_pid: int,
        ready: dict[str, Any],
        alive: Callable[[], bool],
        tell_model: Callable[[str], None],
    ) -> tuple[int, dict[str, Any]]:
        """(the worker's host pid, the isolation dict) once the worker said it is ready."""
        self.stop()
        report = ready.get("hardening")
        report = report if isinstance(report, dict) else {}
        self.last_report = report  # the worker's own account, kept for diagnostics and benchmarks
        pid = proc_pid
        self._outer_pid = proc_pid
        self.spare = set()
        if self.using_bwrap:
            found = inner_pid(proc_pid, int(ready.get("pid", -1)))
            if found is not None:
                pid = found
                with contextlib.suppress(OSError):
                    self.spare.add(os.getpgid(found))  # bwrap's init leads the worker's group
        self.worker_pid = pid
        # Found by the host (the process it started, or below it under bwrap) before any cell ran:
        # the process tree and session whose members the host may signal (proc.belongs).
        fields = stat_fields(pid)
        self.owner = (proc_pid, int(fields[3]) if fields is not None else None)
        if self.group is not None:
            self.group.own(*self.owner)
            self.group.open_cell(False)  # no cell runs yet (a restarted worker may follow a killed cell)
            self.group.cap_snapshots()
        self.cells_grouped = self.group is not None and report.get("cgroup") is True
        self.cells_placed = self.cells_grouped and report.get("cgroup_places") is True
        if isinstance(report.get("cgroup_places"), str):
            self.cells_grouped = False  # its threads may be anywhere: the group caps tasks, no more
        if self.pool is not None:
            self.pool.register(pid)
        limit = self.options.max_processes if self.options is not None else None
        isolation = describe(report, bwrap=self.using_bwrap, process_limit=limit)
        if self.options is not None:
            refuse_root_exposure(isolation["identity"])  # never a silent mode open to chmod of root's files
        bounds = (self.options, self.group, self.pool, self.using_bwrap)
        isolation["memory"] = memory_entry(*bounds, isolation, report)
        isolation["scratch"] = scratch_entry(self.options, self.using_bwrap, isolation, report)
        isolation["tasks"] = self._tasks(report, isolation)
        if isinstance(report.get("cgroup_places"), str):
            isolation["warnings"].append(f"{report['cgroup_places']}: what a cell starts outlives it")
        if self.using_bwrap and pid == proc_pid:
            isolation["warnings"].append("the worker's pid inside bwrap was not found: timeouts kill it")
        if limit is not None:
            if not isolation["seccomp"]:
                isolation["warnings"].append(
                    "without seccomp, code can leave the process group (setsid) and escape the process limit"
                )
            try:
                pgid = os.getpgid(pid)
            except OSError:
                pgid = None
            if pgid is not None:
                self._alive = alive
                self.guard = ProcessGuard(
                    pgid,
                    main_pid=lambda: self.worker_pid or pid,
                    spare=lambda: self.spare,
                    limit=limit,
                    alive=lambda: self._alive(),
                    on_trip=tell_model,
                    owner=self.owner,
                )
                self.guard.start()
        if self.options is not None and isolation["level"] != "hardened+namespaces" and not self._warned:
            gaps = isolation["warnings"]
            if isolation["level"] == "partial" or gaps:
                self._warned = True
                warnings.warn(
                    f"the REPL sandbox is only {isolation['level']}: " + "; ".join(gaps or ["see isolation"]),
                    stacklevel=4,
                )
        return pid, isolation

    def _tasks(self, report: dict[str, Any], isolation: dict[str, Any]) -> str:
        """What caps the number of tasks: "pids cgroup" (exact), "RLIMIT_NPROC" (exact, bwrap's
        user namespace) or "poller" (processes only, checked every 50 ms), "none"."""
        joined = report.get("cgroup")
        if joined is True and self.group is not None and self.group.capped:
            return "pids cgroup"
        if isinstance(joined, str):
            isolation["warnings"].append(joined)
        if (report.get("rlimits") or {}).get("nproc") is not None:
            return "RLIMIT_NPROC"
        return "poller" if self.options is not None else "none"

    def enter_cell(self, pid: int | None) -> None:
        """Before a cell: open the cell's group to new tasks (closed between cells: `close_cell`);
        where the host moves the worker (cgroup v2), move it, the process that runs cells, into that
        group, so that what the cell forks or starts from there stays behind in it. Only a pid the
        kernel shows as this sandbox's own is ever written (never one the worker reported unchecked)."""
        group = self.group
        if group is None or not self.cells_grouped:
            return
        group.open_cell(True)
        if not self.cells_placed and self._checked(pid):
            group.move(pid, "cell")  # type: ignore[arg-type]

    def leave_cell(self, pid: int | None, snapshots: bool, reported: int | None = None) -> bool:
        """After the cell's answer (its code may have written it and still run): kill what the
        snapshot group holds but, with `snapshots`, the snapshot the worker reported last
        (`reported`, its pid in the worker's namespace: outdated now, the worker discards it itself
        as it forks the next), spared once only, so that whatever code put there (by running on the
        thread placed there, snapshots or not) is gone one cell later; and where the host moves the
        worker, move it there to fork its snapshot. Whether the worker waits for word of it (then
        the caller sends "cell_closed")."""
        group = self.group
        if group is None or not self.cells_grouped:
            return False
        pid = self.worker_pid if pid is None else pid  # found by the host where the frame's was not believed
        if not snapshots and self.cells_placed and self._checked(pid) and not self._alone("snap", pid):
            group.kill("snap", keep={pid, *self.spare})  # type: ignore[arg-type]
        if not snapshots:
            return False
        if self._checked(pid):
            keep = {pid, *self.spare}
            if self._alone("snap", pid):
                self._spared = None  # its forking thread alone: no snapshot to spare or kill
            else:
                self._spared = group.empty_snapshots(keep, reported, self.using_bwrap, self._spared)  # type: ignore[arg-type]
            if not self.cells_placed:
                # The whole worker goes there (v2): room for its threads (as many as the closed cell
                # group left it) besides the snapshots, set before the move, which no cap stops.
                with contextlib.suppress(OSError):
                    group.cap_snapshots(extra=len(os.listdir(f"/proc/{pid}/task")) - 1)
                group.move(pid, "snap")  # type: ignore[arg-type]
        return True

    def audit_snapshots(self, reported: int | None) -> None:
        """The worker has reported the snapshot it forked after the host's word (None: none): from
        now on the snapshot group holds nothing else that lives, whatever code ran on the thread
        that forks it (cgroups.SNAP_TASKS)."""
        group = self.group
        if group is not None and self.cells_grouped:
            group.audit_snapshots({self.worker_pid, *self.spare}, reported, self.using_bwrap)  # type: ignore[arg-type]

    def _checked(self, pid: int | None) -> bool:
        """Whether `pid` is a live process of this sandbox (proc.belongs), checked once per worker:
        a pidfd kept open on it then tells, in a poll, that it is still that process, where the
        /proc reads of a check would be paid twice per cell."""
        group = self.group
        if pid is None or group is None:
            return False
        if pid == self._checked_pid and self._checked_fd >= 0:
            poller = select.poll()
            poller.register(self._checked_fd, select.POLLIN)
            if not poller.poll(0):  # readable once the process has exited
                return True
        self._forget_checked()
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        if not belongs(pid, group.root, group.session):
            os.close(fd)
            return False
        self._checked_pid, self._checked_fd = pid, fd
        self._checked_close = weakref.finalize(self, os.close, fd)  # a dropped sandbox's too
        return True

    def _forget_checked(self) -> None:
        if self._checked_close is not None:
            self._checked_close()  # closes the pidfd, once
        self._checked_pid, self._checked_fd, self._checked_close = None, -1, None

    def close_cell(self) -> None:
        """The cell has ended (its answer came, or it was killed): close the cell's group to new
        tasks until the next cell. Whatever code of the cell still runs (a thread it started, code
        that wrote its own answer and went on) gets no task from the kernel from then on, so what
        it forked before is all `end_cell` has to kill."""
        if self.group is not None and self.cells_grouped:
            self.group.open_cell(False)

    async def end_cell(self) -> int:
        """Kill what the cell that just ended left in the cell's group (closed: `close_cell`); how
        many. The group is listed again until a listing holds none of it: a fork the kernel had let
        through just before the group closed joins it a moment later. Waits (briefly) until they
        have exited, so the next cell has their task slots back once the worker reaps them (it does
        before every cell)."""
        group = self.group
        if group is None:
            return 0
        if self._alone("cell", self.worker_pid):
            return 0  # the worker's own threads, and not even a fork in flight (own_threads.py)
        keep = {self.worker_pid, *self.spare}
        signalled: set[int] = set()
        for attempt in range(250):
            left = set(group.members("cell")) - keep
            for pid in left - signalled:
                if group.kill_one(pid):
                    signalled.add(pid)
            if not left and attempt:
                break
            if left:
                await asyncio.sleep(0.002)
        return len(signalled)

    def _alone(self, place: Place, pid: int | None) -> bool:
        """Whether the group `place` (v1, placed) holds the threads of the worker `pid` alone,
        learning them the first time (own_threads.py): then nothing else is to be killed there."""
        group, own = self.group, self._own[place]
        if group is None or pid is None or not self.cells_placed:
            return False
        if own.pid != pid:
            own.learn(pid, group.threads(place))
        return own.alone(pid, group.count(place))

    async def release(self) -> None:
        """The sandbox is closing: kill what is left in its control group and remove the group once
        the killed processes are gone (waiting up to 2 s; a group still busy then is removed later,
        see `TaskGroup.discard`)."""
        self._forget_checked()
        for own in self._own.values():
            own.forget()  # the pidfds of its threads
        group, self.group = self.group, None
        self._group_tried = False
        if self.pool is not None:
            self.pool.unregister(self.worker_pid)
        if group is None:
            return
        for _ in range(400):
            group.kill()
            if group.remove():
                return
            await asyncio.sleep(0.005)
        group.discard()

    def cell_notes(self) -> list[str]:
        """Tell the model when the kernel killed processes of the sandbox for its memory limit."""
        group, pool = self.group, self.pool
        killed = group.oom_kills() if group is not None else 0
        if not killed or group is None:
            return []
        if pool is not None and not group.reached_own_limit():
            # The bound over every REPL of the environment was reached, not this REPL's own.
            return [
                f"the REPLs of this environment together reached their memory bound ({pool.limit_bytes >> 20} "
                f"MiB): the kernel killed {killed} of this REPL's processes (the largest of them all)"
            ]
        cap = f" ({group.memory_bytes >> 20} MiB)" if group is not None and group.memory_bytes else ""
        return [
            f"the REPL's processes together reached their memory cap{cap}: the kernel killed {killed} of "
            "them (the largest) to stay under it"
        ]

    def takeover(self, pid: int | None, restored: dict[str, Any] | None, alive: Callable[[], bool]) -> bool:
        """A fork snapshot replaced the worker: same process group, new pid and connection. Whether
        it waits for the host's word (`cell_closed`) before it forks a snapshot of its own.

        `pid` is the host's pid for it where the host can see it; under bwrap the `restored`
        frame's pid is one inside the namespace, so the host pid is looked up from bwrap down.
        """
        if (
            self.using_bwrap
            and self._outer_pid is not None
            and restored
            and isinstance(restored.get("pid"), int)
        ):
            pid = inner_pid(self._outer_pid, restored["pid"]) or pid
        if pid is not None:
            self.worker_pid = pid  # the data-size limit and the process guard follow it
        self._alive = alive
        if self.group is None or not self.cells_placed:
            return False
        # Its first thread was the old worker's forker, in the snapshot group (where it has just made
        # a forker of its own): that one runs the cells from now on. A pid its frame gave that the
        # host cannot check is not believed: the kernel's word is, the process there that its keeper
        # took in when the old worker died.
        if pid is None or not self._checked(pid):
            adopted = [p for p in self.group.members("snap") if _parent(p) in self.spare]
            pid = adopted[0] if len(adopted) == 1 and self._checked(adopted[0]) else None
        self.group.cap_snapshots()  # back to its usual room (see before_takeover)
        if pid is not None:
            self.worker_pid = pid
            self.group.move(pid, "cell")
            self.group.kill("snap", keep={pid, *self.spare})  # whatever else it forked there
        return True

    def before_takeover(self) -> None:
        """A snapshot is about to take over: room for its forking thread in the snapshot group,
        where the old worker's forker and its discarded snapshot may still be counted."""
        if self.group is not None and self.cells_placed:
            self.group.cap_snapshots(extra=1)

    # -- after a context load ------------------------------------------------------------------

    def after_context(self, isolation: dict[str, Any]) -> None:
        """Set RLIMIT_DATA to what the worker uses now plus the headroom (when not given explicitly),
        and the memory cgroup's limit to the budget that follows from it."""
        opts = self.options
        if opts is None or opts.memory_limit_bytes is not None or self.worker_pid is None:
            return
        used = data_usage(self.worker_pid)
        if used is None:
            isolation["warnings"].append("could not read the worker's memory use: no data-size limit")
            return
        ids = unprivileged_ids() if os.geteuid() == 0 and not self.using_bwrap else None
        got = set_data_limit(self.worker_pid, used + opts.memory_headroom_bytes, ids)
        isolation.setdefault("rlimits", {})["data"] = got
        if got is None:
            isolation["warnings"].append("could not set the worker's data-size limit (prlimit refused)")
        group, memory = self.group, isolation.get("memory")
        if (
            group is not None
            and isinstance(memory, dict)
            and any(m.startswith("memory cgroup") for m in memory.get("mechanisms", ()))
        ):
            if group.limit_memory(memory_budget(opts, used + opts.memory_headroom_bytes)):
                memory["cgroup_limit_bytes"] = group.memory_bytes
            else:
                memory["mechanisms"] = [m for m in memory["mechanisms"] if not m.startswith("memory cgroup")]
                memory["not_covered"].append(
                    "RLIMIT_DATA is per process: each process the code forks has its own"
                )
                isolation["warnings"].append("could not set the memory cgroup's limit")

    def stop(self) -> None:
        if self.guard is not None:
            self.guard.stop()
            self.guard = None


def _parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def not_started() -> dict[str, Any]:
    out = unconfined(False, "the sandbox has not started")
    out["level"] = "none"
    return out
