"""Running the worker inside bubblewrap: new user, mount, pid, net, ipc, uts and cgroup namespaces.

Inside, the filesystem holds only what the interpreter needs, read-only (its prefix, the system's
shared libraries, the two worker files), a private /tmp, a fresh /proc and a minimal /dev, plus the
scratch directory read-write at its host path (so cwd, HOME and TMPDIR keep their values): a tmpfs
of a fixed size there, or the host's folder itself. The
worker's socketpair end is inherited: bwrap keeps file descriptors it is not told to close.

bwrap itself stays in between as the parent of a small init (pid 1 of the namespace), which is the
parent of the worker. Killing bwrap kills everything (--die-with-parent, then the namespace ends
with its init); signals meant for the worker (SIGINT at a timeout) must go to the worker's own
host pid, which `inner_pid` finds.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterable, Sequence

from recursa.sandbox.proc import read_small

# Top-level links of a merged-/usr system (/lib -> usr/lib): recreated as links inside.
_ROOT_LINKS = ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
# Read-only extras Python uses after start; bound only where they exist.
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo", "/sys/devices/system/cpu")


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


def interpreter_prefixes(python: str) -> list[str]:
    """Folders the interpreter at `python` needs: its install prefix and, for a venv, the venv."""
    found: list[str] = []
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        found += [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix]
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        found.append(venv)
    found.append(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    out: list[str] = []
    for p in found:
        rp = os.path.realpath(p)
        if rp not in out and rp != "/":
            out.append(rp)
    return out


def _library_dirs() -> list[str]:
    dirs = ["/usr/lib", "/usr/lib64"]
    multiarch = getattr(sys.implementation, "_multiarch", None)
    if multiarch:
        dirs.append(f"/usr/lib/{multiarch}")
    return [d for d in dirs if os.path.isdir(d)]


def _covered(path: str, binds: Iterable[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds)


def bwrap_command(
    bwrap: str,
    python: str,
    worker_files: Sequence[str],
    scratch: str,
    extra_read: Sequence[str] = (),
    keep_caps: Sequence[str] = (),
    *,
    shm_bytes: int | None = None,
    scratch_bytes: int | None = None,
) -> list[str]:
    """The bwrap argument list that runs `python` with the worker files and `scratch` visible.

    `keep_caps`: capabilities (of the new user namespace only) to keep instead of dropping all;
    a zygote keeps what its children need to make namespaces of their own (worker/zygote.py).
    `shm_bytes`: the size of the private /dev/shm and /tmp (tmpfs pages are memory no rlimit
    counts). `scratch_bytes`: make `scratch` a tmpfs of that size instead of the host's folder, so
    what the code writes there is bounded (and gone with the namespace)."""
    fixed, bound = _system_arguments(bwrap, python, tuple(worker_files))
    cmd, binds = list(fixed), list(bound)
    if shm_bytes is not None:
        cmd = _sized_tmpfs(cmd, shm_bytes)
    if keep_caps:
        at = cmd.index("--cap-drop")
        cmd[at : at + 2] = [arg for cap in keep_caps for arg in ("--cap-add", cap)]
    for path in extra_read:  # the user's folders are looked at every time: they may appear later
        if os.path.exists(path) and not _covered(path, binds):
            binds.append(path)
            cmd.extend(["--ro-bind", path, path])
    if scratch_bytes is not None:
        return [*cmd, "--size", str(scratch_bytes), "--tmpfs", scratch, "--chdir", scratch, "--"]
    return [*cmd, "--bind", scratch, scratch, "--chdir", scratch, "--"]


def _sized_tmpfs(cmd: list[str], size: int) -> list[str]:
    out: list[str] = []
    for arg in cmd:
        if arg == "--tmpfs":
            out += ["--size", str(size)]
        out.append(arg)
    return out


@functools.lru_cache(maxsize=32)
def _system_arguments(
    bwrap: str, python: str, worker_files: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(arguments, bound paths) for the interpreter, system files and worker files, probed once:
    the probes are some 30 system calls, made on the event loop for every worker, and on a busy
    host each one waits for the GIL again."""
    cmd = [
        bwrap,
        "--unshare-all",  # user (if possible), ipc, pid, net, uts, cgroup (if possible)
        "--unshare-user",  # a user namespace even when started by root
        "--die-with-parent",
        "--new-session",  # no controlling terminal to push keystrokes into (TIOCSTI)
        "--cap-drop",
        "ALL",
        "--hostname",
        "recursa",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/dev/shm",  # private: multiprocessing's semaphores live here
        "--tmpfs",
        "/tmp",
    ]
    binds: list[str] = []

    def ro(path: str) -> None:
        if os.path.exists(path) and not _covered(path, binds):
            binds.append(path)
            cmd.extend(["--ro-bind", path, path])

    for link in _ROOT_LINKS:
        if os.path.islink(link):
            cmd.extend(["--symlink", os.readlink(link), link])
    for prefix in interpreter_prefixes(python):
        ro(prefix)
    for d in _library_dirs():
        ro(d)
    for link in _ROOT_LINKS:
        if not os.path.islink(link) and os.path.isdir(link):
            ro(link)
    for path in _SYSTEM_FILES:
        ro(os.path.realpath(path) if path.startswith("/etc/localtime") else path)
    for path in worker_files:
        ro(os.path.abspath(path))
    return tuple(cmd), tuple(binds)


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in read_small(f"/proc/{pid}/task/{pid}/children").split()]
    except (OSError, ValueError):
        return []


def namespace_pid(pid: int) -> int | None:
    """The pid of `pid` in its innermost pid namespace (last field of NSpid)."""
    try:
        data = read_small(f"/proc/{pid}/status")
        at = data.find(b"\nNSpid:")
        return int(data[at + 7 : data.find(b"\n", at + 7)].split()[-1]) if at >= 0 else None
    except (OSError, ValueError, IndexError):
        return None


def inner_pid(outer_pid: int, ns_pid: int) -> int | None:
    """The host pid of the descendant of `outer_pid` whose pid inside its namespace is `ns_pid`."""
    queue, seen = [outer_pid], 0
    while queue and seen < 64:
        pid = queue.pop(0)
        seen += 1
        for child in _children(pid):
            if namespace_pid(child) == ns_pid and child != outer_pid:
                return child
            queue.append(child)
    return None


def namespace_ids() -> dict[str, str]:
    """This process's namespace identities, for the worker to compare its own against."""
    out = {}
    for name in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
        try:
            out[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            pass
    return out
