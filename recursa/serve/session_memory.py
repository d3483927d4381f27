"""How much memory idle server sessions hold together, and which to close when it is too much.

Each open session keeps a REPL process with whatever its questions put in it, and a caller could
keep sessions open (one cheap question each before the TTL) that sit on gigabytes between them.
The sessions' count is capped (`max_sessions`); this caps what idle ones hold together
(`idle_sessions_memory_bytes`): the proportional set size (shared pages split between the
processes that share them) of each idle session's REPL process and the processes below it (its
snapshot, what its code started). Past the bound the least recently used idle sessions are closed,
the most recent one always kept. A session whose sandbox has no process on this host (in-process,
remote) counts as 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from recursa.sandbox.proc import processes


class IdleSession(Protocol):
    last_used: float

    @property
    def repl_pid(self) -> int | None: ...


def over_bound(idle: Iterable[IdleSession], bound: int) -> list[IdleSession]:
    """The idle sessions to close so that the rest hold at most `bound` bytes, least recently used
    first; the most recently used one is never among them."""
    ordered = sorted(idle, key=lambda s: s.last_used)
    if len(ordered) < 2:
        return []
    children: dict[int, list[int]] = {}
    for pid, fields in processes():
        children.setdefault(int(fields[1]), []).append(pid)
    sizes = [tree_memory(s.repl_pid, children) for s in ordered]
    total = sum(sizes)
    closing: list[IdleSession] = []
    for session, size in zip(ordered[:-1], sizes[:-1], strict=True):
        if total <= bound:
            break
        closing.append(session)
        total -= size
    return closing


def tree_memory(pid: int | None, children: dict[int, list[int]]) -> int:
    """Bytes `pid` and the processes below it hold (their PSS), 0 when nothing can be read."""
    if pid is None:
        return 0
    total, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        total += _pss(current)
        stack.extend(children.get(current, ()))
    return total


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
