"""One memory bound over many sandboxes: a parent memory group above their own (cgroups.py).

Each sandbox's memory group bounds that REPL; nothing bounded what all the REPLs of one
environment held together (three 1 GiB episodes took 3.1 GiB, and RLMEnv allows 256 REPLs). A
`MemoryPool` is a control group made beside the sandboxes' own groups, with the total as its limit;
every sandbox given the pool makes its memory group inside it, so the kernel counts every page
all of them fault against the one limit. At the limit the kernel's OOM killer picks the largest
process below the pool, which is never a process outside it: that REPL's cell reports it (and the
REPL comes back from its snapshot, as after any kill at a memory cap), the others go on.

Where no memory group can be made (no writable memory hierarchy, `cgroups=False`), the pool is
only an admission rule: `full()` compares the resident memory of the workers that registered with
it to the limit, and a new episode is refused while no room is left for one more (and so too,
where the kernel enforces the limit, before a start would only push another REPL out).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref

from recursa.sandbox import cgroups
from recursa.sandbox.proc import status_bytes

_counter = itertools.count(1)
_START_BYTES = 32 << 20  # about what a REPL holds once started, its context aside


class MemoryPool:
    """A memory bound of `limit_bytes` over every sandbox made with it (see the module doc)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = int(limit_bytes)
        self._made = False
        self.path: str | None = None  # the pool's group, once made where the kernel allows
        self.kind: str | None = None  # "v1" or "v2": which memory hierarchy it is in
        self._pid = 0  # the process that made it: a forked child makes none of its own
        self._fallback: set[int] = set()  # worker pids, where no group holds the pool

    def folder(self) -> tuple[str, str] | None:
        """(the folder sandboxes make their memory group in, "v1"/"v2"), made on first use; None
        where the kernel cannot bound the pool."""
        if self._pid != os.getpid():
            self._made, self.path, self.kind, self._pid = False, None, None, os.getpid()
        if not self._made:
            self._made = True
            self._make()
        return (self.path, self.kind) if self.path is not None and self.kind is not None else None

    def _make(self) -> None:
        kind = cgroups.memory_available()
        parent = cgroups._parent()
        if kind is None or parent is None:
            return
        folder = parent.memory_v1 if kind == "v1" else parent.path
        if folder is None:
            return
        cgroups._sweep(folder)
        path = os.path.join(folder, f"{cgroups._PREFIX}{os.getpid()}-pool{next(_counter)}")
        try:
            os.mkdir(path)
        except OSError:
            return
        if kind == "v2":
            ok = cgroups._write(os.path.join(path, "cgroup.subtree_control"), "+pids +memory")
            ok = ok and cgroups._write(os.path.join(path, "memory.max"), str(self.limit_bytes))
            cgroups._write(os.path.join(path, "memory.swap.max"), "0")
        else:
            # A v1 child counts against its parent only with use_hierarchy (always 1 on recent kernels).
            hierarchical = cgroups._read(os.path.join(path, "memory.use_hierarchy")).strip() == "1"
            ok = hierarchical and cgroups._write(
                os.path.join(path, "memory.limit_in_bytes"), str(self.limit_bytes)
            )
            both = os.path.join(path, "memory.memsw.limit_in_bytes")
            if ok and os.path.exists(both):
                cgroups._write(both, str(self.limit_bytes))
        if not ok:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return
        self.path, self.kind = path, kind
        # A pool dropped without close(), or alive at interpreter exit, is removed like a sandbox's
        # group: at once where it is empty, else with the groups this process removes later.
        self._finalizer = weakref.finalize(self, _discard, path, os.getpid())

    @property
    def enforced(self) -> str | None:
        """ "memory cgroup (v1)" / "(v2)" where the kernel bounds the pool, else None."""
        return f"memory cgroup ({self.kind})" if self.path is not None else None

    def register(self, pid: int) -> None:
        """A worker of the pool (counted by `used` where no group holds it)."""
        self._fallback.add(pid)

    def unregister(self, pid: int | None) -> None:
        self._fallback.discard(pid or -1)

    def used(self) -> int:
        """Bytes the pool's REPLs hold now: the group's count, else their workers' resident sets."""
        if self.path is not None:
            name = "memory.current" if self.kind == "v2" else "memory.usage_in_bytes"
            text = cgroups._read(os.path.join(self.path, name)).strip()
            return int(text) if text.isdigit() else 0
        total = 0
        for pid in list(self._fallback):
            rss = status_bytes(pid, "VmRSS")
            if rss is None:
                self._fallback.discard(pid)
            else:
                total += rss
        return total

    def full(self) -> bool:
        """No room left for one more REPL to start (what a fresh worker holds, ~32 MiB)."""
        return self.used() + _START_BYTES > self.limit_bytes

    def close(self) -> bool:
        """Remove the pool's group; whether it is gone now. (While its sandboxes' groups are still
        exiting it is left to cgroups' list of groups to remove later, like theirs.)"""
        if self.path is None or self._pid != os.getpid():
            return True
        gone = self._finalizer()
        self.path, self._made = None, False
        return bool(gone)


def _discard(path: str, maker: int) -> bool:
    # Its REPLs' groups, still exiting, come before it in cgroups' list of groups to remove later.
    # A forked child's copy of the pool is its parent's to remove.
    return maker != os.getpid() or cgroups.TaskGroup(path, 0, 0, None).discard()
