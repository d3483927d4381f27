"""The worker's place in its process tree: dying with its parent, and the keeper above it.

With config "keeper" (the local sandbox sets it when it uses snapshots) the process the host starts
stays behind as a keeper, a child subreaper that only reaps; its child is the worker; the worker
keeps a forked snapshot of itself waiting (snapshots.py). Each asks to die with its parent, so the
whole tree goes when the host does.
"""

from __future__ import annotations

import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Get `sig` (SIGKILL: even if stuck in C code) when the parent exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_PR_GET_PDEATHSIG = 2


def has_death_signal() -> bool:
    """Whether the kernel will kill this process (SIGKILL) when its parent exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        sig = ctypes.c_int(0)
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0) != 0:
            return False
        return sig.value == signal.SIGKILL
    except (OSError, AttributeError):
        return False


def _kill_own_group(*_args: object) -> None:
    """The keeper's end when the host is gone: SIGKILL its process group, itself included.

    The group holds the worker, its snapshots and whatever the cells forked; those last ask for no
    parent-death signal, and would otherwise outlive the host (seccomp keeps them in the group)."""
    if os.getpgrp() == os.getpid():
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)  # not a group leader: the others die with their parents
    # Pid 1 of a namespace of its own (a forked worker's keeper) ignores its own SIGKILL; its exit
    # ends the namespace and everything in it.
    os._exit(1)


_PR_SET_CHILD_SUBREAPER = 36


def split_off_keeper(channel_fd: int, notes_fd: int = -1, worker_only: tuple[int, ...] = ()) -> bool:
    """Fork; the parent stays behind as the keeper and never returns, the child is the worker
    (True; False where there can be no keeper: the caller goes on as a plain worker).

    A snapshot that takes over outlives the worker that forked it, so something other than the
    worker must stay put: its parent. The keeper is a child subreaper, so orphans (a snapshot whose
    worker was killed, whatever the cell forked) become its children and are reaped here, never
    left as zombies of an init that may not reap; and under bwrap, which ends the whole namespace
    when its first process exits, the keeper is that first process. It exits once the last
    process below it is gone, and dies with the host (PR_SET_PDEATHSIG), taking everything along:
    every worker and snapshot below it asks to die with its parent too.

    `notes_fd`: a pipe to the host that only the keeper keeps (the worker closes it at once), for
    the notes on how processes below it ended: the log would not do, the cells write there too.
    `worker_only`: descriptors the keeper closes at once (the worker's control-group places).
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return False  # no subreaper: run as a plain worker (a takeover then leaves an orphan to init)
    keeper = os.getpid()
    child = os.fork()
    if child == 0:
        if notes_fd >= 0:
            os.close(notes_fd)
        die_with_parent()
        if os.getppid() != keeper:
            os._exit(0)
        return True
    for fd in (channel_fd, *worker_only):  # only the worker speaks to the host
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a group-wide Ctrl-C is for the worker
    # The keeper only waits, so it can take the host's death as a signal it handles (SIGTERM, not
    # the SIGKILL it asked for in main()) and take the whole group along.
    host = os.getppid()
    signal.signal(signal.SIGTERM, _kill_own_group)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != host:
        _kill_own_group()  # the host died before the new request took effect
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if os.WIFSIGNALED(status):
            try:
                how = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
            except ValueError:
                how = f"killed by signal {os.WTERMSIG(status)}"
        else:
            how = f"exit code {os.waitstatus_to_exitcode(status)}"
        # For the host's crash report: it cannot wait for a process that is not its child.
        if notes_fd >= 0:
            try:
                os.write(notes_fd, f"process {pid} ended: {how}\n".encode())
            except OSError:  # full (the host reads it only after a crash) or gone: notes are extras
                pass
