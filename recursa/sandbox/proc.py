"""Reading processes from /proc (Linux): the one parser of `/proc/<pid>/stat` in recursa."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator


def read_small(path: str) -> bytes:
    """The whole of a small kernel file (/proc, a control group's), through the descriptor alone:
    `open()`'s buffered file object (its fstat, lseek and ioctl) cost 50-60 us more per read, and
    these are read a few times per cell (docs/performance.md, "RL step"). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
        if len(data) < 65536:
            return data
        chunks = [data]
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after "pid (comm) ": state, ppid, pgrp, session, ...

    None when the process is gone (or /proc is not there). The command name may hold spaces and
    parentheses, so the split is at the last ")".
    """
    try:
        data = read_small(f"/proc/{pid}/stat")
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields if len(fields) > 3 else None


def status_bytes(pid: int, field: str) -> int | None:
    """A size field of /proc/<pid>/status ("VmData", "VmRSS", ...) in bytes; None when the process
    is gone, 0 when it has no such field (a zombie has no memory)."""
    try:
        data = read_small(f"/proc/{pid}/status")
    except OSError:
        return None
    at = data.find(f"\n{field}:".encode())
    if at < 0:
        return 0
    try:
        return int(data[at + len(field) + 2 :].split(None, 1)[0]) * 1024
    except (ValueError, IndexError):
        return None


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


def started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, to the second), None once it is gone."""
    fields = stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, in clock ticks


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


_PF_EXITING = 0x4


def exiting(pid: int) -> bool:
    """Whether `pid` is gone, a zombie or on its way out (killed, its exit under way)."""
    fields = stat_fields(pid)
    return fields is None or fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


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


def belongs(pid: int, root: int | None, session: int | None) -> bool:
    """Whether `pid` is a live process of one sandbox: below `root` (the process the host started
    for it) or in its `session` (seccomp keeps every process of the sandbox in the worker's session,
    and nothing can join a session from outside, so an orphan reparented to init still counts).
    Never this process. What a sandbox reports or writes is never trusted: the kernel's own /proc is."""
    if pid <= 1 or pid == os.getpid():
        return False
    fields = stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return False
    if session is not None and int(fields[3]) == session:
        return True
    for _ in range(64):  # a process tree deeper than this is no sandbox's
        if root is not None and pid == root:
            return True
        if pid <= 1:
            return False
        fields = stat_fields(pid)
        if fields is None:
            return False
        pid = int(fields[1])
    return False


def kill_owned(pid: int, sig: int, root: int | None, session: int | None) -> bool:
    """Send `sig` to `pid` only if it `belongs` to the sandbox of `root` and `session`; whether it
    was sent. Through a pidfd opened before the check, so a pid reused in between is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not belongs(pid, root, session):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
