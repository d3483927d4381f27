"""Reading processes from /proc (Linux): the one parser of `/proc/<pid>/stat` in recursa."""

from __future__ import annotations

import os
from collections.abc import Iterator


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after "pid (comm) ": state, ppid, pgrp, session, ...

    None when the process is gone (or /proc is not there). The command name may hold spaces and
    parentheses, so the split is at the last ")".
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields if len(fields) > 3 else None


def processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, stat fields) of every process now running, zombies included."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            fields = stat_fields(name)
            if fields is not None:
                yield int(name), fields


def running(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, waiting for its reaper) counts as gone."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != b"Z"


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, zombies included (a child nobody reaped is still a leak)."""
    children: dict[int, list[int]] = {}
    for child, fields in processes():
        children.setdefault(int(fields[1]), []).append(child)
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out
