"""One live worker as the host sees it: its channel, requests by id, call-backs, death, snapshot.

The same class serves every adapter: the channel (a socketpair, a container engine's stdin/stdout,
a remote SDK's streams) and the process handle (how to interrupt and kill it) are given to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import weakref
from collections.abc import Callable
from typing import Any

from recursa.sandbox.base import HOST_FUNCTIONS, CallbackError, CallHandler
from recursa.sandbox.frames import ProtocolError, RefusedFrame
from recursa.sandbox.processes import WorkerProcess
from recursa.sandbox.protocol import Channel
from recursa.sandbox.worker_log import WorkerLog
from recursa.trace.hostpaths import scrub_paths

LOG_TAIL_CHARS = 2000
# After the process is seen to exit, frames it sent just before may still be in the channel: let the
# reader drain them, but do not wait for an end-of-file a forked grandchild could hold back forever.
_EXIT_DRAIN_S = 0.2
# Call-backs one worker may have in flight, and the bytes their frames took. At either bound the
# channel is not read until a call finishes, so a worker writing calls faster than they are served
# blocks on its own full socket instead of filling the host with tasks. (A batch is one call, and
# every LM call also waits for the tree's limiter, so a legitimate REPL never comes near.)
MAX_CALLS_IN_FLIGHT = 256
MAX_CALL_BYTES_IN_FLIGHT = 256 << 20
# Answers for what the worker asked about but the host refused to parse (frames.py).
_REFUSED_CALL = (
    "the call's arguments are too large to send to the host ({reason}); send less per call: split the "
    "batch, or join many short strings into one"
)
_REFUSED_RESULT = (
    "ValueError: the result was too large to send to the host ({reason}); keep it in a variable and "
    "answer with something smaller"
)


Answer = asyncio.Future[dict[str, Any]]  # what a request's answer arrives in


class WorkerGone(Exception):
    """The worker process exited or its channel broke before answering."""


class Connection:
    """Requests to one worker and its call-backs to the host, from one event loop."""

    def __init__(
        self,
        chan: Channel,
        handler: CallHandler,
        process: WorkerProcess | None = None,
        *,
        log: WorkerLog | None = None,
        notes_fd: int = -1,
    ) -> None:
        self.chan = chan
        self.handler = handler
        self.process: WorkerProcess = process or WorkerProcess()
        self.log = log  # the tail of the worker's stdout+stderr, for crash reports
        # How processes below the keeper ended, from a pipe only the keeper writes (worker/keeper.py).
        self.notes: KeeperNotes | None = KeeperNotes(notes_fd) if notes_fd >= 0 else None
        self.loop = asyncio.get_running_loop()
        # The first frame: `ready` from a new worker, `restored` from a snapshot that took over.
        self.ready: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.calls: dict[int, asyncio.Task[None]] = {}
        self._call_bytes = 0  # frame bytes of the calls in `calls`
        self._call_done = asyncio.Event()
        self.refused = 0  # frames answered or dropped without reaching the handler
        self.dead_reason: str | None = None
        # The snapshot the worker keeps ready (see worker/snapshots.py), as it last reported it.
        self.control: socket.socket | None = None  # our end of its control socket
        self.snapshot_sid: int | None = None
        self.snapshot_pid: int | None = None  # in the worker's pid namespace
        self.reported_pid: int | None = None  # the last snapshot the worker reported, kept after a cell
        self.snapshot_error: str | None = None
        self.snapshot_reported = asyncio.Event()  # set by every `snapshot` frame
        # Told of every `snapshot` frame first (its pid, None for none), e.g. to empty its group.
        self.on_snapshot: Callable[[int | None], None] = lambda pid: None
        self.restored: dict[str, Any] | None = None  # the `restored` frame, for a snapshot that took over
        # The host's word that a cell is over, waiting until the host has sent nothing else for a
        # while (`cell_closed_when_idle`), and whether it went since the last cell.
        self._word: asyncio.TimerHandle | None = None
        self.word_sent = False
        self.worker_ns_pid: int | None = None  # the worker's pid as it sees it (its namespace's)
        self._ids = itertools.count(1)
        # A request's first future -> the future its answer goes to now (see `answer`). Weak: an
        # entry goes with the caller's future, so a later future can never find a stale one.
        self._renewed: weakref.WeakKeyDictionary[Answer, Answer] = weakref.WeakKeyDictionary()
        self._released = False
        self.process.watch(self._on_process_exit)
        self.reader = self.loop.create_task(self._read(), name="recursa-sandbox-reader")

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def attach(self, process: WorkerProcess) -> None:
        """Give a connection made before its process was known (a takeover) its process handle."""
        self.process = process
        process.watch(self._on_process_exit)

    # -- incoming --------------------------------------------------------------------------------

    async def _read(self) -> None:
        reason = "the REPL process closed its channel"
        try:
            async for frame, size in self.chan.frames(self._quick):
                if isinstance(frame, RefusedFrame):
                    await self._answer_refused(frame)
                elif frame["op"] == "call":
                    await self._take_call(frame, size)
                else:
                    self._dispatch(frame)
        except ProtocolError as exc:
            reason = f"the REPL process sent an invalid message ({exc})"
            self.process.kill_now()
        except OSError as exc:
            reason = f"the REPL channel failed ({exc})"
        finally:
            self._mark_dead(reason)
            if not self.chan.sending:
                self.chan.close()  # nothing more can arrive; a dropped sandbox leaves no open socket

    def _quick(self, frame: dict[str, Any] | RefusedFrame, size: int) -> bool:
        """Dispatch a frame as the channel reads it (Channel.frames), but a call or a refused
        frame, which may wait for room or for a send: those the reader task takes, in order."""
        if isinstance(frame, RefusedFrame) or frame["op"] == "call":
            return False
        self._dispatch(frame)
        return True

    async def _take_call(self, frame: dict[str, Any], size: int) -> None:
        """Serve a call as a task once there is room for it; answer a bad one at once, without one."""
        fid, fn, args = frame.get("id"), frame.get("fn"), frame.get("args")
        if not isinstance(fid, int) or isinstance(fid, bool) or fid in self.calls:
            # No id to answer to, or that of a call still running (its caller would get our answer).
            self.refused += 1
            return
        if fn not in HOST_FUNCTIONS or not isinstance(args, dict):
            self.refused += 1
            what = f"unknown host function {fn!r}" if fn not in HOST_FUNCTIONS else "malformed call"
            await self._send_quietly(_error_reply(fid, "SubcallError", f"{what} from the REPL"))
            return
        while self.calls and (
            len(self.calls) >= MAX_CALLS_IN_FLIGHT or self._call_bytes + size > MAX_CALL_BYTES_IN_FLIGHT
        ):
            self._call_done.clear()
            await self._call_done.wait()
        if not self.alive:
            return  # its tasks were cancelled; nobody is left to answer
        task = self.loop.create_task(self._serve_call(fid, fn, args))
        self.calls[fid] = task
        self._call_bytes += size
        task.add_done_callback(lambda _t, i=fid, n=size: self._call_finished(i, n))

    def _call_finished(self, call_id: int, size: int) -> None:
        self.calls.pop(call_id, None)
        self._call_bytes -= size
        self._call_done.set()

    async def _answer_refused(self, frame: RefusedFrame) -> None:
        """A frame too large to parse: its caller (or the request it answers) gets an error."""
        self.refused += 1
        if frame.id is None:
            return
        if frame.op == "call":
            message = _REFUSED_CALL.format(reason=frame.reason)
            await self._send_quietly(_error_reply(frame.id, "SubcallError", message))
        elif frame.op in ("exec_done", "var", "vars", "defined", "context_loaded"):
            self._dispatch(
                {"op": frame.op, "id": frame.id, "error": _REFUSED_RESULT.format(reason=frame.reason)}
            )

    async def _send_quietly(self, reply: dict[str, Any]) -> None:
        with contextlib.suppress(OSError, ValueError):
            await self.chan.send(reply)

    def _dispatch(self, frame: dict[str, Any]) -> None:
        op = frame["op"]
        fid = frame.get("id")
        if op == "cancel":
            task = self.calls.get(fid) if isinstance(fid, int) else None
            if task is not None:
                task.cancel()
        elif op == "snapshot":
            ok = frame.get("ok") is True and isinstance(frame.get("sid"), int)
            self.snapshot_sid = frame["sid"] if ok else None
            pid = frame.get("pid")
            self.snapshot_pid = self.reported_pid = pid if ok and isinstance(pid, int) else None
            self.snapshot_error = None if ok else str(frame.get("error") or "no snapshot")
            self.on_snapshot(self.reported_pid)
            self.snapshot_reported.set()
        elif op in ("exec_done", "context_loaded") and self.control is not None:
            # The worker now replaces its snapshot with one of the state after this request.
            self.snapshot_sid = self.snapshot_pid = None
            self.snapshot_reported.clear()
            self._resolve(fid, frame)
        elif op in ("ready", "restored"):
            if isinstance(frame.get("pid"), int):
                self.worker_ns_pid = frame["pid"]
            if not self.ready.done():
                self.ready.set_result(frame)
        else:
            self._resolve(fid, frame)

    def _resolve(self, fid: Any, frame: dict[str, Any]) -> None:
        if isinstance(fid, int):
            fut = self.pending.pop(fid, None)
            if fut is not None and not fut.done():
                fut.set_result(frame)

    async def _serve_call(self, call_id: int, fn: str, args: dict[str, Any]) -> None:
        try:
            value = await self.handler(fn, args)
            # Encoding here turns a non-JSON (or oversized) result into an error reply, not a crash.
            data = self.chan.encode({"op": "reply", "id": call_id, "ok": True, "value": value})
        # Every host message into the sandbox passes here: whatever the handler (an RLM's scrubs with
        # its Redactor, which knows the run's keys; others may not), no host path gets through.
        except Exception as exc:
            error = CallbackError.of(exc)
            data = self.chan.encode(_error_reply(call_id, error.kind, scrub_paths(str(error))))
        with contextlib.suppress(OSError, ValueError):
            await self.chan.send_encoded(data)

    def _on_process_exit(self) -> None:
        self.loop.call_later(_EXIT_DRAIN_S, self._mark_dead, "the REPL process exited")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._hold_word()
        for fut in (self.ready, *self.pending.values()):
            if not fut.done():
                fut.set_exception(WorkerGone(reason))
                fut.exception()  # mark it retrieved: nobody may be waiting any more (no log noise)
        self.pending.clear()
        for task in list(self.calls.values()):
            task.cancel()

    def check_exited(self) -> None:
        """Notice a process that exited between requests, before sending it the next one."""
        if self.alive and self.process.exited():
            self._mark_dead("the REPL process exited")

    # -- outgoing --------------------------------------------------------------------------------

    async def request(
        self, frame: dict[str, Any], *, fd: int | None = None, payload: tuple[int, int] | None = None
    ) -> asyncio.Future[dict[str, Any]]:
        """Send a frame that expects an answer with the same id; returns the answer's future.

        `fd` rides along by SCM_RIGHTS; `payload` = (fd, size): that many raw bytes follow the frame.
        """
        self._hold_word()
        fid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        if not self.alive:
            fut.set_exception(WorkerGone(self.dead_reason or "gone"))
            return fut
        self.pending[fid] = fut
        frame = {**frame, "id": fid}
        try:
            if fd is not None:
                await self.chan.send_with_fd(frame, fd)
            elif payload is not None:
                await self.chan.send_with_payload(frame, *payload)
            else:
                await self.chan.send(frame)
        except (OSError, ValueError) as exc:  # ValueError: the socket was already closed
            self._mark_dead(f"the REPL channel failed ({exc})")
        return fut

    async def answer(self, fut: Answer, timeout: float) -> dict[str, Any]:
        """The answer to a request (`fut`, from `request`) within `timeout` seconds, else
        TimeoutError, the request staying out: a later call with the same `fut` waits on for it.
        (asyncio.shield would keep it out too, at one more turn of the event loop per answer: about
        0.1 ms of every cell here, docs/performance.md, "RL step, second pass".)"""
        current = self._renewed.pop(fut, fut)
        fid = next((i for i, f in self.pending.items() if f is current), None)
        timer = self.loop.call_later(timeout, self._expire, fid, fut, current) if fid is not None else None
        try:
            return await current
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self, fid: int, first: Answer, current: Answer) -> None:
        """`answer`'s time is up: from now on the answer goes to a new future (in the same turn of
        the loop, so none can be lost in between), and the waiter gets TimeoutError."""
        if current.done():
            return
        fresh: Answer = self.loop.create_future()
        self.pending[fid] = fresh
        self._renewed[first] = fresh
        current.set_exception(TimeoutError())

    def cell_closed_when_idle(self, delay: float) -> None:
        """Send the worker `cell_closed` (its word to fork the snapshot of the state after a cell)
        once nothing else has been sent to it for `delay` seconds; never if a request goes first, so
        the word never arrives after one (the worker then takes no snapshot of that cell)."""
        self._hold_word()
        self.word_sent = False
        self._word = self.loop.call_later(delay, self._send_word)

    def _send_word(self) -> None:
        self._word = None
        if self.alive:
            self.word_sent = self.chan.try_send(self.chan.encode({"op": "cell_closed"}))

    def word_now(self) -> None:
        """Send the word a `cell_closed_when_idle` is waiting to send, now (if it still waits)."""
        if self._word is not None:
            self._word.cancel()
            self._send_word()

    def _hold_word(self) -> None:
        if self._word is not None:
            self._word.cancel()
            self._word = None

    def interrupt(self) -> None:
        """SIGINT the running code: directly where the host can signal the worker, else in-band."""
        if self.process.can_signal or not self.control_send({"op": "interrupt"}):
            self.process.interrupt()

    def control_send(self, msg: dict[str, Any], fds: list[int] | None = None) -> bool:
        """A message for the waiting snapshot; False if there is none (or it cannot be reached)."""
        if self.control is None or self.snapshot_sid is None:
            return False
        data = json.dumps({**msg, "sid": self.snapshot_sid}).encode()
        try:
            socket.send_fds(self.control, [data], fds or [])
        except OSError:  # BlockingIOError included: a full buffer means nobody reads it
            return False
        return True

    # -- ending ----------------------------------------------------------------------------------

    async def kill(self) -> None:
        """Kill the process (group) and release the connection. Idempotent."""
        await self.process.kill()
        await self.release()

    async def release(self) -> None:
        """Close the channels and stop the tasks, leaving the process alone (after a takeover)."""
        if self._released:
            return
        self._released = True
        self._mark_dead(self.dead_reason or "the REPL process was stopped")
        tasks = [self.reader, *self.calls.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.chan.close()
        if self.control is not None:
            self.control.close()  # a snapshot still waiting on it sees end-of-file and leaves
            self.control = None

    def take_log(self) -> WorkerLog | None:
        """Hand the log over (to the connection of the snapshot that shares it)."""
        log, self.log = self.log, None
        return log

    def describe_exit(self) -> str:
        """How the worker ended: from its process handle, else from its keeper's note. Never from
        the log: the code in the cell writes there too, and could fake a note."""
        how = self.process.describe_exit()
        if how not in ("it exited", "it stopped answering") or self.worker_ns_pid is None:
            return how
        mark = f"process {self.worker_ns_pid} ended: "
        for line in reversed(self.notes.read().splitlines() if self.notes is not None else []):
            if line.startswith(mark):
                return line[len(mark) :].strip()
        return how

    def log_tail(self) -> str:
        return self.log.tail(LOG_TAIL_CHARS) if self.log is not None else ""


class KeeperNotes:
    """The read end of the keeper's notes pipe, and the last notes read from it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    def read(self) -> str:
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # BlockingIOError: nothing new
                break
            if not chunk:
                break
            self.text = (self.text + chunk.decode("utf-8", "replace"))[-LOG_TAIL_CHARS:]
        return self.text

    def close(self) -> int:
        """Stop reading; returns the descriptor for the caller to close (-1 if none)."""
        fd, self.fd = self.fd, -1
        return fd


def _error_reply(call_id: int, kind: str, message: str) -> dict[str, Any]:
    return {"op": "reply", "id": call_id, "ok": False, "error": {"kind": kind, "message": message}}
