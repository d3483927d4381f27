"""The worker's side of its control group (the host's recursa/sandbox/cgroups.py).

The host may hand over two open descriptors: the sandbox group's `tasks` (v1; `cgroup.procs` on v2)
and, on v1, the `tasks` of its group in the memory hierarchy. The worker joins them first thing,
while it has one thread (before its keeper is forked), so the kernel counts every task it will ever
have against the group's cap, and every page any of them faults against its memory limit; then it
closes them before anything else. The kernel checks a write to such a file against the credentials
of whoever opened it (the host), so a descriptor kept would let the code move any process it can
name into a group the host kills, or its own children out of one: no code of the cells ever holds
one.

On cgroup v1 the host also hands over the `tasks` files of the group's `cell` and `snap` children:
once hardened, still before anything else runs, the worker puts its main thread in `cell` and the
thread that forks its snapshots in `snap` (snapshots.Forker), each writing "0" for itself, and
closes them; its keeper, forked after it joined the group, closes its copies at once. Elsewhere
(cgroup v2 moves whole processes only) the host moves the worker between them for every cell.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class TaskGroup:
    """The descriptors from the worker's config, or none (then `join` does nothing)."""

    def __init__(self, spec: Any) -> None:
        spec = spec if isinstance(spec, dict) else {}
        self.home = _fd(spec.pop("cgroup_fd", None))
        self.memory = _fd(spec.pop("memory_cgroup_fd", None))
        self.cell = _fd(spec.pop("cell_cgroup_fd", None))
        self.snap = _fd(spec.pop("snap_cgroup_fd", None))
        self.grouped = self.home >= 0
        self.placed: bool | str = False  # for the ready report: True once `place` put both threads
        self.joined: bool | str = False  # for the ready report: True, or why not
        self.memory_joined: bool | str = False

    def join(self) -> None:
        """Join the groups and close every descriptor of them (see the module doc)."""
        if self.memory >= 0:
            # Never moved again: pages are charged to the group of the process's main thread.
            self.memory_joined = _move(self.memory)
            os.close(self.memory)
            self.memory = -1
        if self.home >= 0:
            self.joined = _move(self.home)
            os.close(self.home)
            self.home = -1


    def place_fds(self) -> list[int]:
        """The descriptors `place` uses (its keeper closes its copies of them)."""
        return [fd for fd in (self.cell, self.snap) if fd >= 0]

    def place(self, make_forker: Callable[[Callable[[], None]], Any]) -> Any:
        """Put this (the main) thread in the cell's group and a new forker thread, made by
        `make_forker(join)`, in the snapshots' group; close both descriptors. Returns the forker,
        None where this host moves the worker itself (no such descriptors) or a step failed."""
        if self.cell < 0 or self.snap < 0 or self.joined is not True:
            self._close_places()
            return None
        forker = None
        try:
            forker = make_forker(lambda: _write_self(self.snap))
            _write_self(self.cell)
            self.placed = True
        except OSError as exc:
            self.placed = f"placing the worker's threads in the cell's groups failed: {exc}"
        finally:
            self._close_places()
        return forker if self.placed is True else None

    def _close_places(self) -> None:
        for fd in self.place_fds():
            os.close(fd)
        self.cell = self.snap = -1


def _write_self(fd: int) -> None:
    os.write(fd, b"0")  # the calling thread, on v1 (a `tasks` file)


def _fd(value: Any) -> int:
    if not isinstance(value, int) or value < 0:
        return -1
    try:
        os.set_inheritable(value, False)
    except OSError:
        return -1
    return value


def _move(fd: int) -> bool | str:
    """Write "0" (this process, all its threads) into a cgroup.procs descriptor."""
    try:
        os.write(fd, b"0")
    except OSError as exc:
        return f"joining the control group failed: {exc}"
    return True
