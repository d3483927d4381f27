"""The worker's own threads in one child of its control group, held by pidfds, so that the group's
task count alone can tell that it holds nothing else.

A listing of a cgroup v1 group (`cgroup.procs`, `tasks`) costs ~30 µs here, more after an idle
spell (the kernel builds a list of pids per open), and the host listed the cell's and snapshots'
groups three times per cell; their `pids.current` costs one `pread` (~1.5 µs). The count alone does
not say whose tasks those are, but with these it does:
  - the kernel charges a task to the group when it is forked, before any listing shows it, and
    uncharges it only when it is reaped, so the count includes a fork in flight and a zombie;
  - the worker's threads never leave the group they were placed in while they live: only the host
    moves tasks (no sandboxed process holds a control-group descriptor), and on v1 it moves none
    per cell;
  - a pidfd of a thread (`PIDFD_THREAD`, Linux 6.9) becomes readable when that thread exits,
    whatever later reuses its id.
So when every thread held is alive and the count equals their number, the group holds nothing
else, not even a fork the kernel let through just before the group closed: stronger than a second
listing, which a fork still in flight passes. Any other count, a thread gone, or a kernel without
`PIDFD_THREAD`: the caller lists the group as before.
"""

from __future__ import annotations

import os
import select
import weakref
from collections.abc import Iterable

# pidfd_open's flag for a pidfd of one thread (Linux 6.9): the kernel defines it as O_EXCL's bit.
PIDFD_THREAD = os.O_EXCL


class OwnThreads:
    """Pidfds of the threads of one worker process found in one group (see the module doc)."""

    def __init__(self) -> None:
        self.pid: int | None = None  # the process whose threads were looked for last
        self._fds: list[int] = []
        self._poller = select.poll()
        self._closer = weakref.finalize(self, _close_all, self._fds)  # a dropped sandbox's too

    def alone(self, pid: int | None, count: int | None) -> bool:
        """Whether a group counting `count` tasks holds the threads of `pid` held here and nothing
        else: each of them alive (none of their pidfds readable) and no other task counted."""
        fds = self._fds
        if not fds or pid != self.pid or count != len(fds):
            return False
        if self._poller.poll(0):
            self.pid = None  # one of them has exited: learn them again
            return False
        return True

    def learn(self, pid: int, tids: Iterable[int]) -> None:
        """Hold the threads among `tids` (a listing of the group) that are threads of process `pid`."""
        self.forget()
        for tid in tids:
            try:
                fd = os.pidfd_open(tid, PIDFD_THREAD)
            except OSError:  # gone already, or a kernel without PIDFD_THREAD
                continue
            # Opened first, checked second: were the id reused in between, this pidfd would be of
            # the thread that exited, and readable at the first poll.
            if os.path.exists(f"/proc/{pid}/task/{tid}"):
                self._fds.append(fd)
                self._poller.register(fd, select.POLLIN)
            else:
                os.close(fd)
        self.pid = pid  # also with none held (no PIDFD_THREAD here): not looked for again

    def forget(self) -> None:
        for fd in self._fds:
            self._poller.unregister(fd)
        _close_all(self._fds)
        self.pid = None


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())
