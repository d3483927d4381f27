"""The worker's side of its control group (the host's recursa/sandbox/cgroups.py).

The host may hand over two open descriptors: the sandbox group's `tasks` (v1; `cgroup.procs` on v2)
and that of its `cell` child, and on v1 a third, the `tasks` of its group in the memory hierarchy.
The worker joins them before it starts anything, while it has one thread (its keeper included),
so the kernel counts every task it will ever have against the group's cap, and every page any of
them faults against its memory limit. While a cell runs the worker moves its main thread (which runs the cell) into the cell
group, and back before it answers: what the cell forked or started from there stays behind, and
the host kills those processes once the cell is over. The snapshot is forked after the move back,
so it is never among them. A move costs ~20 us (hardened.py, cgroups.py say why per thread).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class TaskGroup:
    """The two descriptors from the worker's config, or none (then every method does nothing)."""

    def __init__(self, spec: Any) -> None:
        spec = spec if isinstance(spec, dict) else {}
        self.home = _fd(spec.pop("cgroup_fd", None))
        self.cell = _fd(spec.pop("cell_cgroup_fd", None))
        self.memory = _fd(spec.pop("memory_cgroup_fd", None))
        self.joined: bool | str = False  # for the ready report: True, or why not
        self.memory_joined: bool | str = False

    def join(self) -> None:
        if self.memory >= 0:
            # Never moved again: pages are charged to the group of the process's main thread.
            self.memory_joined = _move(self.memory)
            os.close(self.memory)
            self.memory = -1
        if self.home < 0:
            return
        self.joined = _move(self.home)
        if self.joined is not True:
            self.cell = -1  # no cell moves without the group itself

    def enter_cell(self) -> None:
        if self.cell >= 0:
            _move(self.cell)

    def leave_cell(self) -> None:
        if self.cell >= 0:
            _move(self.home)


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
