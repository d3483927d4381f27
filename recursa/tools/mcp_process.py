"""The process of a stdio MCP server, found and killed without an event loop.

The `mcp` package starts a stdio server in a session of its own (its pid is its process group, so
what it starts, e.g. under `npx`, goes with it) and stops it in order when its client closes. A run that is abandoned (an episode or a session dropped
without close, interpreter exit) has no loop left to close it on, so the server's process group is
killed here by pid. The pid is found once, after connecting, by a mark in the server's environment
among this process's children (Linux's /proc; elsewhere nothing is found and only the orderly close
applies).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
from pathlib import Path

MARK = "RECURSA_MCP_SERVER"


def new_mark() -> dict[str, str]:
    """The environment entry that tells this server's process apart from every other child."""
    return {MARK: secrets.token_hex(8)}


def find_server(mark: dict[str, str]) -> int | None:
    """The pid of the child of this process that was started with `mark` in its environment."""
    if not sys.platform.startswith("linux"):
        return None
    wanted = "".join(f"{k}={v}" for k, v in mark.items()).encode()
    for pid in _children():
        with contextlib.suppress(OSError):
            if wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    return None


def kill_group(pid: int) -> None:
    """Kill the server's process group (the server and what it started, e.g. under `npx`), if the
    pid is still a child of this process: a reaped pid may belong to someone else by now."""
    if _parent(pid) != os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:  # the group it leads (the mcp package starts it in a session of its own)
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def _children() -> list[int]:
    """This process's children: from each thread's `children` file, or, on a kernel without them
    (CONFIG_PROC_CHILDREN), by the parent of every process."""
    found: list[int] = []
    try:
        for task in Path("/proc/self/task").iterdir():
            found.extend(int(p) for p in (task / "children").read_text().split())
        return found
    except (OSError, ValueError):
        pass
    me = os.getpid()
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _parent(int(e.name)) == me]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat.rsplit(b")", 1)[1].split()[1])  # the name in parentheses may hold spaces
    except (OSError, ValueError, IndexError):
        return None
