"""The worker's side of its control group (the host's recursa/sandbox/cgroups.py).

The host may hand over two open descriptors: the sandbox group's `tasks` (v1; `cgroup.procs` on v2)
and, on v1, the `tasks` of its group in the memory hierarchy. The worker joins them first thing,
while it has one thread (before its keeper is forked), so the kernel counts every task it will ever
have against the group's cap, and every page any of them faults against its memory limit; then it
closes them before anything else. The kernel checks a write to such a file against the credentials
of whoever opened it (the host), so a descriptor kept would let the code move any process it can
name into a group the host kills, or its own children out of one: no code of the cells ever holds
one. Moving the worker into the group's `cell` child for the length of a cell is the host's job.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class TaskGroup:
    """The descriptors from the worker's config, or none (then `join` does nothing)."""

    def __init__(self, spec: Any) -> None:
        spec = spec if isinstance(spec, dict) else {}
        self.home = _fd(spec.pop("cgroup_fd", None))
        self.memory = _fd(spec.pop("memory_cgroup_fd", None))
        self.grouped = self.home >= 0
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
