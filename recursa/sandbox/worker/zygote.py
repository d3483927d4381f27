"""The fork server inside the sandbox (the zygote): a warm worker that forks REPL workers on request.

Standard library only; server.py imports it for `start.py --zygote FD`, before the hardening.
A worker started from scratch pays tens of milliseconds of CPU (bwrap, an interpreter, imports),
and many child RLMs starting at once on two cores wait long for the last one. The zygote pays that
once: it imports everything a worker needs, works out the hardening rules, then forks one worker
per request, at about a third of a fresh start's machine CPU, hardening included (docs/sandbox.md,
"Child RLMs' REPLs are forked"; figures of benchmarks/worker_starts.py in docs/performance.md).

The zygote itself runs only this loop, never generated code, and keeps two capabilities of bwrap's
user namespace (CAP_SYS_ADMIN, CAP_SETPCAP; none outside it) for what each child does first:
  - a session of its own (its pid is its group: the host's killpg stops only this worker's tree);
  - a pid namespace of its own, whose pid 1 goes on as the worker (its keeper) while the process
    the zygote forked waits outside: siblings cannot name each other's processes at all;
  - its own mount and IPC namespaces, with a fresh /dev/shm, so siblings share no files, no POSIX
    semaphores and no System V IPC;
  - every capability dropped (bounding set included) and checked, before any other step;
  - then the ordinary worker start: keeper, Landlock (its own scratch directory only, signals and
    abstract sockets scoped to its own domain), seccomp. The host uses a zygote only where the
    kernel has Landlock's scoping (ABI 6), which is what keeps siblings from signalling each other
    as a second wall; ptrace and /proc are closed to them as to any worker.

Control socket (SOCK_SEQPACKET; one JSON object per message):
  zygote -> host, once: {"op": "hello", "pid": its pid in the namespace}
  host -> zygote: {"env": {...}, "cwd": scratch dir, "config": worker config, "fd_names": [...]}
                  + fds [channel, log, *named]: each name in fd_names (its control group's
                  descriptors, the keeper's notes pipe) gets the descriptor's number in the config
  zygote -> host: {"pid": the child's pid in the namespace} or {"error": text}
End of file on the control socket (the host closed it, or is gone) ends the zygote.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket

from .mounts import (
    CLONE_NEWIPC,
    CLONE_NEWNS,
    CLONE_NEWPID,
    check,
    libc,
    mount_tmpfs,
    private_namespace,
    read_only_except,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

_PR_SET_PDEATHSIG = 1
# Landlock lets a worker write its scratch directory and /dev/shm (multiprocessing's semaphores),
# so /dev/shm must be its own; bwrap's /tmp holds the scratch directories and stays as it is.
_PRIVATE_MOUNTS = ("/dev/shm",)


def serve(
    control_fd: int,
    start_worker: Callable[[int, dict[str, Any]], NoReturn],
    prepare: Callable[[dict[str, Any]], None],
    drop_capabilities: Callable[[], None],
) -> NoReturn:
    """Answer fork requests until the host closes the control socket. Never returns.

    `prepare(config)` runs here before each fork (work every worker with that config would repeat,
    kept in this process so that the children inherit it); in the child, `drop_capabilities()`
    (which raises if any is left) and then `start_worker(channel, config)`."""
    libc()  # loaded once, here, for every child's first steps
    control = socket.socket(fileno=control_fd)
    os.set_inheritable(control_fd, False)
    # Children are reaped by the kernel; the host watches them through pidfds, not through us.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are for workers, not for their parent
    control.send(json.dumps({"op": "hello", "pid": os.getpid()}).encode())
    # Everything imported so far lives on in every worker: out of the collector's reach, its pages
    # stay shared with the zygote instead of being copied when a collection touches them.
    gc.freeze()
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(control, 1 << 20, 8)
        except InterruptedError:
            continue
        if not data:
            os._exit(0)
        try:
            request = json.loads(data)
            if len(fds) != 2 + len(request.get("fd_names") or []):
                raise ValueError(f"expected a channel, a log and the named descriptors, got {len(fds)}")
            prepare(dict(request["config"]))
            pid = os.fork()
        except Exception as exc:  # a bad request or no memory for a fork: say so, keep serving
            for fd in fds:
                os.close(fd)
            control.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            continue
        if pid == 0:
            control.close()
            _child(request, fds, start_worker, drop_capabilities)
        for fd in fds:
            os.close(fd)
        control.send(json.dumps({"pid": pid}).encode())


def _child(
    request: dict[str, Any],
    fds: list[int],
    start_worker: Callable[[int, dict[str, Any]], NoReturn],
    drop_capabilities: Callable[[], None],
) -> NoReturn:
    channel, log = fds[0], fds[1]
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        zygote = os.getppid()
        _set_death_signal()
        if os.getppid() != zygote:
            os._exit(0)
        os.setsid()
        spec = dict(request["config"]).get("hardening") or {}
        _private_namespaces(str(request["cwd"]), spec.get("shm_bytes"), spec.get("scratch_bytes"))
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the keeper waits for its children
        _own_pid_namespace(drop_capabilities)
        drop_capabilities()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})
        config = dict(request["config"])
        # The descriptors past the channel and log, by the config name the worker looks them up by.
        config.update(zip(map(str, request.get("fd_names") or []), fds[2:], strict=True))
    except BaseException as exc:
        os.write(2, f"[recursa zygote] cannot prepare a worker: {type(exc).__name__}: {exc}\n".encode())
        os._exit(70)
    start_worker(channel, config)


def _own_pid_namespace(drop_capabilities: Callable[[], None]) -> None:
    """Go on as pid 1 of a pid namespace of this worker's own: siblings forked by the same zygote
    then have no pid here (no signal, no cgroup write, no /proc entry can name them), and the
    namespace ends, everything in it killed, when its first process (the keeper) does.

    This process (the zygote's child, the session leader the host watches) stays outside as a
    waiting parent that holds nothing: it exits when its child does, and its child dies with it."""
    check(libc().unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    child = os.fork()
    if child == 0:
        _set_death_signal()
        return
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the channel, the control group's descriptors
    drop_capabilities()
    while True:
        try:
            _pid, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _set_death_signal() -> None:
    check(libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0), "prctl(PDEATHSIG)")


def _private_namespaces(scratch: str, shm_bytes: int | None, scratch_bytes: int | None) -> None:
    """A mount and an IPC namespace of this worker's own, with an empty /dev/shm (of `shm_bytes`)
    and, with `scratch_bytes`, a tmpfs of that size as its scratch folder (tmpfs pages are memory
    no rlimit counts: each gets a size)."""
    private_namespace(CLONE_NEWNS | CLONE_NEWIPC)
    mounts = [(path, "mode=1777", shm_bytes) for path in _PRIVATE_MOUNTS]
    if scratch_bytes is not None:
        mounts.append((scratch, "mode=0700", scratch_bytes))
    made = []
    for path, mode, size in mounts:
        if os.path.isdir(path):
            mount_tmpfs(path, mode, size)
            made.append(path)
    # The zygote's folder (every sibling's scratch folder) and bwrap's own tmpfs stay writable
    # otherwise: only this worker's scratch and /dev/shm are, as to Landlock.
    read_only_except([*made, *([scratch] if scratch not in made else [])], mounted=tuple(made))
