"""The worker's main loop and entry point: harden, say ready, then serve requests until shutdown.

The host starts the worker through start.py (see there for how this package is loaded):

    python -I -u -X utf8 start.py --fd N [--config JSON]    (N: our end of a socketpair)
    python -I -u -X utf8 start.py --stdio [--lines] [--config JSON]   (frames over stdin/stdout)
    python -I -u -X utf8 start.py --zygote N [--config JSON]   (a fork server: zygote.py)

Startup is paid by every child RLM, so the worker imports only what the first request needs:
typing is for annotations alone, and ast (with contextlib) waits for the first cell.
Everything in this package that a worker runs after hardening is imported here, before it: Landlock
leaves the package's folder unreadable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from .context import ContextSource
from .keeper import die_with_parent, has_death_signal, split_off_keeper
from .rehearsal import rehearse
from .repl import Repl
from .snapshots import Forker, Snapshots
from .taskgroup import TaskGroup
from .wire import SocketTransport, StdioTransport, WorkerChannel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

# The lockdown lives in hardening.py (with landlock.py, seccomp.py): imported only when asked for.
HARDENING_MODULE = "hardening"


def harden(config: dict[str, Any]) -> dict[str, Any]:
    """Lock the process down before any generated code runs; returns what was applied.

    With `config["hardening"]` (a spec dict from the host) the worker applies rlimits,
    capabilities, Landlock and seccomp through hardening.py and reports what the kernel accepted.
    Without it only core dumps are turned off (a crash must not write the context to disk).
    Called while the process has one thread: Landlock (before ABI 8) binds only the calling thread.
    """
    if sys.flags.no_site:
        _site_builtins()
    spec = config.get("hardening")
    if isinstance(spec, dict):
        try:
            return dict(_hardening_module().apply(spec))
        except Exception as exc:  # never claim a lockdown that did not happen; say why instead
            applied = _no_core_dumps()
            applied.update(requested=True, error=f"{type(exc).__name__}: {exc}")
            applied["warnings"] = [
                f"hardening failed ({type(exc).__name__}: {exc}); the REPL is not confined"
            ]
            return applied
    return _no_core_dumps()


def _hardening_module() -> Any:
    """hardening.py, imported on first use (a zygote imports it before it forks workers)."""
    return _sibling(HARDENING_MODULE)


def _sibling(name: str) -> Any:
    """A module of this package, imported now (by name: importlib itself would cost a start more)."""
    return __import__(f"{__package__}.{name}", fromlist=["_"])


def _site_builtins() -> None:
    """Started with -S (no site-packages, no .pth code at start): keep exit(), quit() and help()."""
    try:
        import site

        site.setquit()
        site.setcopyright()
        site.sethelper()
    except Exception:
        pass


def _no_core_dumps() -> dict[str, Any]:
    applied: dict[str, Any] = {"requested": False, "rlimits": {}}
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        applied["rlimits"]["core"] = 0
    except (ImportError, ValueError, OSError):
        pass
    return applied


# Main loop.

# How long the worker waits after an answer before it forks the next snapshot, unless the next
# request comes first: the host's own work after a cell (reading the answer, the trace, the next
# model request) is short, and a snapshot forked into it (the fork, the snapshot's start-up, its dry
# run: three busy processes on two CPUs) would lengthen it (docs/performance.md, "Figures behind
# choices in the code"). Back to back (an instant model) the next request ends the wait at once.
_SETTLE_S = 0.001


class Server:
    """Runs requests on the main thread (so SIGINT interrupts user code) and keeps snapshots ready."""

    def __init__(
        self,
        transport: SocketTransport | StdioTransport,
        group: TaskGroup,
        *,
        lines: bool = False,
        kept: bool = False,
    ) -> None:
        self.group = group
        self._kept = kept  # a keeper is this process's parent (keeper.py), and a snapshot's after a takeover
        self.repl = Repl(self._call)
        self.snapshots = Snapshots()
        # No cell has run in this process yet: the host restores this state by starting a worker
        # again (context and definitions are replayed), so it needs no snapshot; forking one at
        # standby and one after the context would cost a short-lived child REPL a fifth of its CPU.
        self._pristine = True
        self._early: dict[str, Any] | None = None  # a request read while settling (see _settle)
        # The host's "idle" snapshot mode (recursa/sandbox/base.py, SnapshotMode): after a cell,
        # fork only on the host's word, which it sends once it has sent nothing else for a while;
        # and whether a request came before that word, so that the next exec runs without a snapshot.
        self._idle = False
        self._unprotected = False
        self.chan = self._connect(WorkerChannel(transport, lines=lines))

    def _call(self, fn: str, args: dict[str, Any]) -> Any:
        return self.chan.call(fn, args)  # through the current channel, which a takeover replaces

    def _connect(self, chan: WorkerChannel) -> WorkerChannel:
        chan.may_interrupt = lambda: self.repl.interruptible
        chan.on_eof = self._on_eof
        return chan

    def _on_eof(self) -> None:
        pid = self.snapshots.pid
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self.repl.interruptible:
            return  # a late SIGINT (the cell already finished) must not break the worker
        if self.chan.main_sending:
            self.chan.interrupt_pending = True
            return
        raise KeyboardInterrupt

    def run(self, config: dict[str, Any]) -> None:
        hardening = harden(config)  # while this process has one thread (Landlock binds only it)
        self.chan.watch = _watches(self.chan.transport, True)  # after a change of uid, if any
        # Before `ready`: a host may interrupt the first cell at once (a reply's last sliver of time),
        # and Python's own handler would end this process with a KeyboardInterrupt outside any cell.
        signal.signal(signal.SIGINT, self._on_sigint)
        # A mask is inherited: a worker started from a thread that blocks SIGINT (a Ray actor's, on a
        # cluster node) would never see the host's interrupt, and every timeout would cost the REPL.
        # Before the forker's thread starts: a snapshot is a copy of that thread, and the worker it
        # becomes must see the interrupt too (one waiting on a call-back sees it on no other thread).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self.snapshots.forker = self.group.place(Forker)
        if self.group.grouped:
            hardening["cgroup"] = self.group.joined
        if self.group.placed is not False:
            hardening["cgroup_places"] = self.group.placed
        if self.group.memory_joined is not False:
            hardening["memory_cgroup"] = self.group.memory_joined
        ready = {
            "op": "ready",
            "pid": os.getpid(),
            "ppid": os.getppid(),  # the keeper, when there is one
            "python": sys.version.split()[0],
            "hardening": hardening,
        }
        self.chan.send(ready)
        self._serve()

    def _serve(self) -> None:
        """Serve requests until shutdown, then exit."""
        while True:
            if signal.getsignal(signal.SIGINT) != self._on_sigint:  # code may have replaced it
                signal.signal(signal.SIGINT, self._on_sigint)
            msg = self._next_message()
            op = msg.get("op")
            if op == "shutdown":
                break
            if op == "standby":
                self.snapshots.arm(int(msg.get("_fd", -1)))
                self._idle = msg.get("idle") is True
                if self.snapshots.armed and not self._pristine:
                    self._snapshot()
                continue
            if op == "exec" and self._pristine:
                self._pristine = False
            elif op == "exec" and self.snapshots.armed and not self._unprotected and not self.snapshots.alive():
                self._snapshot()
            elif op == "load_context":
                self.snapshots.discard()  # its state is about to be out of date
            if op == "exec":
                self._unprotected = False
            if op == "exec" and self.group.joined is True:
                _reap()  # what the host killed after the last cell: zombies hold task slots
            if op == "exec":
                self.chan.lend_reader()  # replies to the cell's calls arrive while this thread runs it
            try:
                reply = _handle(self.repl, msg)
            except Exception as exc:  # a worker bug must answer, not leave the host waiting
                reply = _internal_error(msg, exc)
            if reply is not None:
                self.chan.send(reply)
            closed = op == "exec" and (self.group.joined is True or self._idle) and self.snapshots.armed
            if op in ("exec", "load_context") and self.snapshots.armed and not self._pristine:
                # Snapshot the state after this cell now, while the host reads the result and asks
                # its model: the next cell then starts without paying for the fork. After a cell
                # in a control group, not before the host's word that it emptied the snapshots'
                # group (which comes once it has read the answer: no need to wait more).
                if closed and self._idle:
                    if not self._word():
                        continue  # a request came first: it goes without a snapshot
                    closed = False  # the word has come
                elif not closed:
                    self._settle()
                if not self._snapshot(self._cell_closed if closed else None):
                    continue  # another request came first: kept for the loop
                if self._early is None and not self.chan.has_pending():
                    # The next cell's copy-on-write faults, taken while nobody waits; after the
                    # context, also what the first cell would pay once (`import ast`).
                    self._rehearse()
            elif op == "load_context" and not self.chan.has_pending():
                self._rehearse()  # no snapshots: only the first cell's one-time work, as above
        self.snapshots.discard()
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: user threads must not keep the process alive

    def _cell_closed(self) -> bool:
        """Wait for the host's word that it emptied the snapshots' group (and, where the host moves
        the worker, moved it there out of the cell's, whose leftovers it kills); False if another
        request came first (kept for the loop). Run on the thread that forks the snapshot."""
        msg = self.chan.next_request()
        if msg is not None and msg.get("op") == "cell_closed":
            return True
        self._early = msg
        return False

    def _word(self) -> bool:
        """The "idle" mode: whether the host's word that the cell is over (`cell_closed`, sent once
        it had emptied the snapshots' group and then sent nothing else for a while) came before any
        request. Read on this thread: nobody waits for the fork that follows. Else the request waits
        in `_early` and the outdated snapshot is discarded: the next exec, come so soon (an instant
        policy's next step), runs without one rather than wait for the fork and pay the copy-on-write
        faults after it; the cell after it is snapshotted as usual."""
        msg = self.chan.next_request()
        assert msg is not None  # without a timeout it waits for one
        if msg.get("op") == "cell_closed":
            return True
        self.snapshots.discard(wait=False)
        self._early = msg
        self._unprotected = True  # until the next exec has run: no snapshot but on the host's word
        return False

    def _settle(self) -> None:
        """Let the host take the answer just sent, and do its work after a cell, before forking
        (see _SETTLE_S). A request that arrives meanwhile waits in `_early`."""
        self._early = self.chan.next_request(timeout=_SETTLE_S)

    def _next_message(self) -> dict[str, Any]:
        """The next request. A snapshot discarded when the last one was taken is reaped here, once
        no request came within a millisecond (the host is waiting for its model), not before the
        next cell."""
        if self._early is not None:
            msg, self._early = self._early, None
            return msg
        if self.snapshots.dying:
            msg = self.chan.next_request(timeout=0.001)
            if msg is not None:
                return msg
            self.snapshots.reap(block=True)
        msg = self.chan.next_request()
        assert msg is not None  # without a timeout it waits for one
        return msg

    def _rehearse(self) -> None:
        try:
            rehearse()
            # As a cell starts, and back: the faults of that hand-over too (with `watch`; else of
            # the flag a call of the cell would lend on, the hand-over left to cells that call).
            self.chan.lend_reader(start=False)
            self.chan.has_pending()
        except Exception:  # only ever a speed-up: never a reason for the worker to stop
            pass

    def _snapshot(self, first: Callable[[], bool] | None = None) -> bool:
        """Take a fresh snapshot of this process once `first()` says so (see Snapshots.take, and
        `_resume` for what the snapshot does if it takes over); whether it did."""
        return self.snapshots.take(self.chan, self._resume, first)

    def _resume(self, transport: SocketTransport, info: dict[str, Any]) -> None:
        """In a snapshot that takes over: carry on as the worker, on the channel the host handed it."""
        self.chan = self._connect(WorkerChannel(transport, watch=_watches(transport, self._kept)))
        self._early = None  # what the old worker had read is not ours
        if self.group.placed is True:
            # This process's one thread is in the snapshots' group: a forker made now is there too,
            # before the host hears of this process and moves this thread into the cell's.
            try:
                self.snapshots.forker = Forker()
            except RuntimeError:  # no task left in the group: snapshots from the cell's, lost at its end
                self.snapshots.forker = None
        self.chan.send(info)  # its reader thread starts with its first cell, as a new worker's
        # This process is the worker now, and it needs a snapshot of its own: where the host keeps
        # the snapshots' group, once it has put this process's threads in place and emptied it.
        self._snapshot(self._cell_closed if self.group.placed is True else None)
        self._serve()


def _watches(transport: SocketTransport | StdioTransport, parent_goes_with_host: bool) -> bool:
    """Whether the reader thread must read the channel for the whole of every cell (wire.py,
    WorkerChannel.watch): end-of-file there is how this process learns that its host is gone,
    unless the kernel kills it with its parent (PR_SET_PDEATHSIG) and that parent goes with the
    host. A local worker's parent does (the worker alone is on a socket): the host itself, bwrap
    (--die-with-parent), a keeper or a zygote's waiting child, each dying with the host in turn
    (keeper.py, zygote.py); a snapshot's after a takeover is the keeper, if there is one. A
    container's or a remote worker (stdio) has only the channel."""
    return not (isinstance(transport, SocketTransport) and parent_goes_with_host and has_death_signal())


def _reap() -> None:
    """Collect children that have exited. A cell's processes do not outlive it (the host kills
    them), so nobody waits for them later; a snapshot that died is noticed by Snapshots.alive."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(
    transport: SocketTransport | StdioTransport,
    config: dict[str, Any],
    *,
    lines: bool = False,
    group: TaskGroup | None = None,
    kept: bool = False,
) -> None:
    import faulthandler

    faulthandler.enable()  # a segfault leaves a Python traceback in the worker log
    Server(transport, group or TaskGroup(None), lines=lines, kept=kept).run(config)


def _handle(repl: Repl, msg: dict[str, Any]) -> dict[str, Any] | None:
    op, mid = msg.get("op"), msg.get("id")
    if op == "exec":
        res = repl.execute(str(msg.get("code", "")), int(msg.get("max_output_chars", 20_000)))
        return {"op": "exec_done", "id": mid, **res}
    if op == "get_var":
        return {"op": "var", "id": mid, **repl.get_var(str(msg.get("name", "")))}
    if op == "list_vars":
        return {"op": "vars", "id": mid, "names": repl.user_variables()}
    if op == "define":
        return {"op": "defined", "id": mid, **repl.define(list(msg.get("entries", [])))}
    if op == "load_context":
        transfer = msg.get("transfer")
        if transfer == "inline":
            source = ContextSource(buffer=msg.get("_buffer"))
        elif transfer == "path":
            source = ContextSource(fd=os.open(str(msg.get("path")), os.O_RDONLY | os.O_CLOEXEC))
        else:
            source = ContextSource(fd=int(msg["_fd"]), release=bool(msg.get("release")))
        try:
            info = repl.load_context(
                str(msg.get("kind")),
                source,
                list(msg.get("byte_lengths", [])),
                list(msg.get("char_lengths", [])),
                list(msg.get("keys", [])),
            )
        finally:
            source.close()
        return {"op": "context_loaded", "id": mid, **info}
    return None


def _internal_error(msg: dict[str, Any], exc: Exception) -> dict[str, Any] | None:
    text = f"internal worker error: {type(exc).__name__}: {exc}"
    op, mid = msg.get("op"), msg.get("id")
    if op == "exec":
        return {
            "op": "exec_done",
            "id": mid,
            "stdout": "",
            "stderr": text,
            "omitted_chars": 0,
            "error": text,
            "final": None,
            "restored_names": [],
            "notes": [],
            "duration_s": 0.0,
        }
    if op == "get_var":
        return {"op": "var", "id": mid, "found": False, "final": None, "error": text}
    if op == "list_vars":
        return {"op": "vars", "id": mid, "names": [], "error": text}
    if op == "define":
        return {"op": "defined", "id": mid, "errors": [text]}
    if op == "load_context":
        return {"op": "context_loaded", "id": mid, "error": text}
    return None


_USAGE = "usage: start.py (--fd N | --stdio [--lines] | --zygote N) [--config JSON]"


def parse_args(argv: list[str]) -> tuple[int | None, dict[str, Any]]:
    """(--fd value or None for --stdio, config). Hand-rolled: argparse costs milliseconds at startup.

    --lines (with --stdio) is reported in the config as "_lines": True; --zygote N (N: a control
    socket, see zygote.py) as the fd N and "_zygote": True.
    """
    fd: int | None = None
    stdio = lines = zygote = False
    config: Any = {}
    args = iter(argv)
    for arg in args:
        if arg in ("--fd", "--zygote"):
            if fd is not None:
                raise SystemExit(f"give one of --fd and --zygote; {_USAGE}")
            fd = int(next(args, "-1"))
            zygote = arg == "--zygote"
        elif arg == "--stdio":
            stdio = True
        elif arg == "--lines":
            lines = True
        elif arg == "--config":
            config = json.loads(next(args, "{}"))
        else:
            raise SystemExit(f"unknown argument {arg!r}; {_USAGE}")
    if stdio == (fd is not None) or (fd is not None and fd < 0):
        raise SystemExit(f"give exactly one of --fd N, --zygote N and --stdio; {_USAGE}")
    if not isinstance(config, dict):
        raise SystemExit("--config must be a JSON object")
    if lines:
        if not stdio:
            raise SystemExit(f"--lines goes with --stdio; {_USAGE}")
        config["_lines"] = True
    if zygote:
        config["_zygote"] = True
    return fd, config


def main(argv: list[str] | None = None) -> None:
    fd, config = parse_args(sys.argv[1:] if argv is None else argv)
    lines = bool(config.pop("_lines", False))
    parent = os.getppid()
    die_with_parent()  # a worker stuck in C code would otherwise outlive a host that was killed
    if os.getppid() != parent:
        os._exit(0)  # the parent died before the request took effect
    if config.pop("_zygote", False) and fd is not None:
        _preload()
        _sibling("zygote").serve(fd, _start, _prepare, _hardening_module().drop_all_capabilities)
    if fd is None:
        # Keep private copies of the pipes, then point fds 0/1 away from them so stray writes to
        # fd 1 (a C extension, a child process) cannot corrupt the frame stream.
        rfd, wfd = os.dup(0), os.dup(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        serve(StdioTransport(rfd, wfd), config, lines=lines)
    else:
        _start(fd, config)


def _start(fd: int, config: dict[str, Any]) -> NoReturn:
    """Serve the host on the socket `fd`: a worker started afresh, or one a zygote just forked."""
    group = TaskGroup(config)
    group.join()  # first: every task from here on (the keeper's too) counts against the group's cap
    notes = config.pop("keeper_fd", -1)
    notes = notes if isinstance(notes, int) else -1
    kept = False
    if config.pop("keeper", False):
        kept = split_off_keeper(fd, notes, tuple(group.place_fds()))
    elif notes >= 0:
        os.close(notes)
    os.set_inheritable(fd, False)  # children of generated code must not hold the channel
    serve(SocketTransport(socket.socket(fileno=fd)), config, group=group, kept=kept)
    os._exit(0)


def _prepare(config: dict[str, Any]) -> None:
    """In a zygote, before it forks a worker with `config`: the hardening work every such worker
    would repeat (the Landlock rule walk, the seccomp program), done once for all of them."""
    spec = config.get("hardening")
    if isinstance(spec, dict):
        _hardening_module().prepare(spec)


def _preload() -> None:
    """What a worker otherwise imports on its first cell or while hardening: a zygote does it once
    for all the workers it forks."""
    import ast  # noqa: F401
    import faulthandler  # noqa: F401
    import resource  # noqa: F401
    import site  # noqa: F401
    import traceback  # noqa: F401

    _hardening_module()
