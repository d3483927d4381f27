"""The wire format and the worker's end of the channel to the host.

Both directions: a 4-byte big-endian length, then a UTF-8 JSON object with an "op". With --lines
(remote sandboxes whose SDKs carry text, not bytes) each frame is one line of ASCII JSON.
  host -> worker: exec {id, code, max_output_chars}; load_context {kind, size, byte_lengths, keys,
                  transfer: "fd" | "inline" | "path"} (with "fd" the context fd rides on the same
                  sendmsg as the frame, via SCM_RIGHTS; with "inline" `size` raw bytes follow the
                  frame; with "path" the bytes are in the file `path`);
                  reply {id, ok, value | error: {kind, message}}; get_var {id, name}; list_vars {id};
                  standby (+ fd: the snapshots' control socket, see snapshots.py); shutdown
  worker -> host: ready {pid, ppid, python, hardening}; exec_done {id, stdout, stderr, omitted_chars,
                  error, final, restored_names, notes, duration_s}; call {id, fn, args};
                  cancel {id} (the code stopped waiting for that call); var {id, found, final};
                  vars {id, names}; context_loaded {kind, pieces, chars, duration_s};
                  snapshot {ok, sid, pid | error}; restored {pid, pgid, sid, old_worker_gone,
                  threads_lost} (the first frame of a snapshot that took over, on its new channel)
Nothing crossing the channel is ever pickled: the host only parses JSON. The host encodes with the
same functions (recursa/sandbox/protocol.py imports them) and refuses frames over the same limit.

Threads: the main thread reads the next request itself and runs it, so that SIGINT from the host
interrupts running code with KeyboardInterrupt. While a cell runs, a reader thread reads instead
(from the cell's start, or from its first call to the host: see "receiving" below): replies wake
the caller waiting on that call id (so many user threads can call the host at once).
"""

from __future__ import annotations

import collections
import itertools
import json
import mmap
import os
import select
import socket
import sys
import threading
import time
from _queue import Empty as _Empty
from _queue import SimpleQueue  # queue.SimpleQueue itself, without importing the queue module
from collections.abc import Callable

from .errors import RemoteError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


MAX_FRAME_BYTES = 1 << 30  # refuse larger frames both ways: a bad length must not allocate the machine
_RECV_CHUNK = 256 * 1024
_JSON_DEPTH = 20

# Framing. The encoders are made once: json.dumps with any option builds a new one per call, about
# half of a small frame's encoding time (docs/performance.md, "Figures behind choices in the code").
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_COMPACT_ASCII = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


def encode_frame(obj: dict[str, Any]) -> bytes:
    data = _COMPACT.encode(obj).encode("utf-8", "surrogatepass")
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(data):,} bytes is over the {MAX_FRAME_BYTES:,}-byte channel limit")
    return len(data).to_bytes(4, "big") + data


def encode_line(obj: dict[str, Any]) -> bytes:
    """One frame as a line of ASCII JSON (--lines): survives transports that carry only text."""
    data = _COMPACT_ASCII.encode(obj).encode("ascii")
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(data):,} bytes is over the {MAX_FRAME_BYTES:,}-byte channel limit")
    return data + b"\n"


def decode_frame(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    obj = json.loads(str(data, "utf-8", "surrogatepass"))
    if not isinstance(obj, dict):
        raise ValueError("frame is not a JSON object")
    return obj


# Room for the SCM_RIGHTS of one message: the host passes at most a few fds at once.
_FDS_SPACE = socket.CMSG_SPACE(4 * 4)


class SocketTransport:
    """A connected stream socket that may carry file descriptors (SCM_RIGHTS)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # One buffer for every read (socket.recv_fds would allocate and shrink 256 KiB per frame).
        self._buf = bytearray(_RECV_CHUNK)

    def recv(self) -> tuple[bytes, list[int]]:
        size, ancillary, _flags, _addr = self.sock.recvmsg_into([self._buf], _FDS_SPACE)
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % 4
                fds.extend(
                    int.from_bytes(data[i : i + 4], sys.byteorder, signed=True) for i in range(0, usable, 4)
                )
        return bytes(memoryview(self._buf)[:size]), fds

    def fileno(self) -> int:
        return self.sock.fileno()

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


class StdioTransport:
    """Frames over a pair of pipes (containers, remote sandboxes). No fd passing."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd

    def fileno(self) -> int:
        return self.rfd

    def recv(self) -> tuple[bytes, list[int]]:
        return os.read(self.rfd, _RECV_CHUNK), []

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view) :]

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            os.close(fd)


class _Reply:
    __slots__ = ("error", "event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: RemoteError | None = None


class WorkerChannel:
    """The worker's end of the channel: thread-safe calls to the host, and the main-thread inbox."""

    def __init__(
        self, transport: SocketTransport | StdioTransport, *, lines: bool = False, watch: bool = True
    ) -> None:
        self.transport = transport
        self.lines = lines
        # Whether the reader thread reads for the whole of every cell; else only from the cell's
        # first call to the host (see "receiving"). Only a process that dies with its host without
        # reading the channel may go without (the server decides: server.py, `_watches`).
        self.watch = watch
        self.on_eof: Callable[[], None] = lambda: None  # last words before the process exits
        self.inbox: SimpleQueue[dict[str, Any]] = SimpleQueue()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._main = threading.main_thread().ident
        # SIGINT must not land in the middle of a frame the main thread is writing: the handler
        # defers it while this is set and `send` raises it once the frame is out.
        self.main_sending = False
        self.interrupt_pending = False
        self.may_interrupt: Callable[[], bool] = lambda: False
        # Reading: see "receiving" below. The main thread holds the role from the start.
        self._role = threading.Lock()
        self._role.acquire()
        self._reader_on = threading.Event()
        self._reader_started = False
        # A cell is running, and the reader thread may be lent (on demand, when not `watch`). Both
        # this and the lending itself change only under `_lending`, so that a call from a thread of
        # the cell can never lend the role while the main thread takes it back: two threads reading
        # the transport at once would tear frames apart.
        self._lendable = False
        self._lending = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # not inherited; os.pipe2 is missing on macOS
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._buf = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self._main_poll = select.poll()
        self._main_poll.register(transport.fileno(), select.POLLIN)

    # -- sending ---------------------------------------------------------------------------------

    def send(self, obj: dict[str, Any], *, lend: bool = False) -> None:
        """Send one frame; with `lend`, first lend the reader thread the reading if a cell runs
        (the frame asks for a reply that the cell's main thread, busy with it, cannot read)."""
        frame = encode_line(obj) if self.lines else encode_frame(obj)
        on_main = threading.get_ident() == self._main
        if on_main:
            self.main_sending = True
        try:
            if lend and not self._reader_on.is_set():
                # Here, where SIGINT is deferred: an interrupt between releasing the role and
                # setting the flag would leave the channel with no reader and the role unheld.
                with self._lending:
                    if self._lendable:
                        self._lend()
            with self._send_lock:
                self.transport.sendall(frame)
        finally:
            if on_main:
                self.main_sending = False
                if self.interrupt_pending:
                    self.interrupt_pending = False
                    if self.may_interrupt():
                        raise KeyboardInterrupt

    def call(self, fn: str, args: dict[str, Any]) -> Any:
        """Ask the host to run `fn(args)` and wait for its reply. Safe from any thread."""
        call_id = next(self._ids)
        slot = _Reply()
        self._pending[call_id] = slot
        done = False
        try:
            self.send({"op": "call", "id": call_id, "fn": fn, "args": args}, lend=True)
            slot.event.wait()
            done = True
        finally:
            self._pending.pop(call_id, None)
            if not done:  # interrupted: let the host stop work nobody will read
                try:
                    self.send({"op": "cancel", "id": call_id})
                except (OSError, KeyboardInterrupt):
                    pass
        if slot.error is not None:
            raise slot.error
        return slot.value

    # -- receiving -------------------------------------------------------------------------------
    #
    # One thread at a time reads the transport: the one holding `_role`. Between requests that is
    # the main thread itself (`next_request`), so a request wakes the thread that runs it and no
    # other: a hand-off from a reader thread would cost each request a thread wake-up and, after a
    # snapshot fork, the reader's own copy-on-write faults (docs/performance.md, "Figures behind choices in the code").
    # While a cell runs the main thread is busy with user code, so the reader thread takes the role,
    # delivers the replies to calls the cell makes and takes the process down if the host goes
    # away; the next `next_request` parks the reader again. With `watch` the role is lent for the
    # whole cell (`lend_reader`). Without it, it is lent only when a thread of the cell calls the
    # host (`send(..., lend=True)`): a cell that calls nothing (most cells of an RL step) then
    # wakes no thread at all, where lending and parking would wake the reader twice. Nothing else
    # the host sends needs reading before the cell ends: it sends no request while one is out
    # (host.py serializes them; one sent after a cell it gave up on waits its turn in the inbox
    # anyway), and it asks a busy worker to stop (`shutdown`) only where it cannot signal it: never
    # a local one (host.py, `close`). And a worker that does not watch dies with its host anyway.

    def close_copy(self) -> None:
        """In a forked snapshot: drop this process's copy of the channel (only the worker reads it)."""
        for close in (self.transport.close, lambda: os.close(self._wake_r), lambda: os.close(self._wake_w)):
            try:
                close()
            except OSError:
                pass

    def start_reader(self) -> None:
        self._reader_started = True
        threading.Thread(target=self._read_loop, name="recursa-reader", daemon=True).start()

    def lend_reader(self, start: bool = True) -> None:
        """Main thread, before running a cell: let the reader thread read until `next_request`
        (with `watch`; else from the cell's first call to the host on).
        The thread is started by the first such call with `start` (the first cell's): then, where
        the host runs cells in a control group of their own, it is in that group from its first
        instruction, and so is whatever code running on it forks (see recursa/sandbox/cgroups.py)."""
        if not self._reader_started:
            if not start:
                return
            self.start_reader()
        with self._lending:
            self._lendable = True
            if self.watch:
                self._lend()

    def _lend(self) -> None:
        """Hand the reading to the reader thread. Only under `_lending`, while a cell runs."""
        if not self._reader_on.is_set():
            self._role.release()
            self._reader_on.set()

    def next_request(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Main thread: the next request from the host, read here; None if none came in `timeout`
        seconds. Replies to calls of other threads that arrive meanwhile are delivered on the way."""
        self._park_reader()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.inbox.get_nowait()
            except _Empty:
                pass
            if deadline is not None:
                left = deadline - time.monotonic()
                # poll() waits whole milliseconds (rounded up): fine for the waits asked of it here.
                if left <= 0 or not self._main_poll.poll(left * 1000):
                    return None
            else:
                # Wait in poll(), not in the read: a read asleep on a Unix socket is woken each time
                # the host takes what this process sent (the kernel tells every sleeper on the socket
                # that it may write again), one wake-up per request for nothing (a context switch
                # each way, and the host's CPU disturbed if the kernel puts it there); poll() wakes
                # for data, the end of the channel or an error alone.
                self._main_poll.poll()
            self._pump_or_exit()

    def has_pending(self) -> bool:
        """Main thread: whether a request is waiting, read or not."""
        self._park_reader()
        return not self.inbox.empty() or bool(self._main_poll.poll(0))

    def _park_reader(self) -> None:
        # The reader thread never takes `_lending`, so waiting for the role under it cannot deadlock.
        with self._lending:
            self._lendable = False
            if self._reader_on.is_set():
                self._reader_on.clear()
                try:
                    os.write(self._wake_w, b"\0")  # out of its wait for data: it must not read now
                except BlockingIOError:
                    pass  # the pipe is full of such bytes: the reader wakes anyway
                self._role.acquire()

    def _read_loop(self) -> None:
        # The reader waits for data without the role, so that parking it costs the main thread a
        # byte written, not a wait for this thread to wake up; it takes the role only to read.
        try:
            waiting = select.poll()
            waiting.register(self.transport.fileno(), select.POLLIN)
            waiting.register(self._wake_r, select.POLLIN)
            readable = select.poll()
            readable.register(self.transport.fileno(), select.POLLIN)
            while True:
                self._reader_on.wait()
                events = dict(waiting.poll())
                if self._wake_r in events:
                    _drain(self._wake_r)
                    continue  # parked, or lent again since: the flag says which
                if not self._role.acquire(blocking=False):
                    continue  # the main thread reads now (it clears the flag first)
                try:
                    # Still lent, and the data still there (the main thread may have read it).
                    if self._reader_on.is_set() and readable.poll(0):
                        self._pump()
                finally:
                    self._role.release()
        except BaseException:  # a broken channel leaves nothing to serve: never linger as an orphan
            pass
        self._exit()

    def _pump_or_exit(self) -> None:
        try:
            self._pump()
        except BaseException:
            self._exit()

    def _exit(self) -> None:
        try:
            self.on_eof()
        finally:
            os._exit(0)

    def _pump(self) -> None:
        """Read what the transport has (waiting for at least a byte) and route every whole frame.
        Only the holder of `_role` calls this; a frame split across reads waits in `_buf`."""
        data, fds = self.transport.recv()
        if not data:
            raise EOFError("the host closed the channel")
        self._buf += data
        if self.lines:
            for fd in fds:  # no frame of the line format carries one
                os.close(fd)
            self._route_lines()
        else:
            self._fds.extend(fds)
            self._route_frames()

    def _route_lines(self) -> None:
        buf = self._buf
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > MAX_FRAME_BYTES:
                    raise ValueError("oversized line from host")
                return
            line = bytes(buf[:end]).strip()
            del buf[: end + 1]
            if line:
                self._route(decode_frame(line))

    def _route_frames(self) -> None:
        while len(self._buf) >= 4:
            size = int.from_bytes(self._buf[:4], "big")
            if size > MAX_FRAME_BYTES:
                raise ValueError("oversized frame from host")
            if len(self._buf) < 4 + size:
                return
            msg = decode_frame(memoryview(self._buf)[4 : 4 + size])
            del self._buf[: 4 + size]
            op = msg.get("op")
            if op == "load_context" and msg.get("transfer") == "inline":
                msg["_buffer"], self._buf = _read_inline(self.transport, self._buf, int(msg.get("size", 0)))
            elif (op == "load_context" and msg.get("transfer") == "fd") or op == "standby":
                msg["_fd"] = self._fds.popleft() if self._fds else -1
            self._route(msg)

    def _route(self, msg: dict[str, Any]) -> None:
        """Deliver one decoded frame: a reply to the thread waiting for it, the rest to the main
        thread. A shutdown read by the reader (the main thread is in a cell) ends the process now."""
        if msg.get("op") == "reply":
            self._deliver(msg)
            return
        self.inbox.put(msg)
        if msg.get("op") == "shutdown" and self._reader_on.is_set():
            raise EOFError("the host asked the worker to stop")

    def _deliver(self, msg: dict[str, Any]) -> None:
        slot = self._pending.get(msg.get("id"))  # type: ignore[arg-type]
        if slot is None:
            return  # the caller gave up (interrupted); drop the late reply
        if msg.get("ok"):
            slot.value = msg.get("value")
        else:
            err = msg.get("error") or {}
            slot.error = RemoteError(str(err.get("kind", "SubcallError")), str(err.get("message", "")))
        slot.event.set()


def _read_inline(
    transport: SocketTransport | StdioTransport, buf: bytearray, size: int
) -> tuple[Any, bytearray]:
    """Read `size` raw context bytes that follow a load_context frame into an anonymous map."""
    if size <= 0:
        return None, buf
    mm = mmap.mmap(-1, size)
    take = min(size, len(buf))
    mm[:take] = buf[:take]
    del buf[:take]
    pos = take
    while pos < size:
        data, _ = transport.recv()
        if not data:
            raise EOFError("host closed the channel during a context transfer")
        part = data[: size - pos]
        mm[pos : pos + len(part)] = part
        pos += len(part)
        buf += data[len(part) :]
    return mm, buf


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass
