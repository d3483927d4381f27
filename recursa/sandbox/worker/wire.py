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

Threads: a reader thread owns the incoming side. Replies wake the caller waiting on that call id
(so many user threads can call the host at once); everything else is queued to the main thread,
which runs it, so that SIGINT from the host interrupts running code with KeyboardInterrupt.
"""

from __future__ import annotations

import collections
import itertools
import json
import mmap
import os
import socket
import sys
import threading
from _queue import SimpleQueue  # queue.SimpleQueue itself; the queue module costs 1.4 ms to import
from collections.abc import Callable

from .errors import RemoteError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


MAX_FRAME_BYTES = 1 << 30  # refuse larger frames both ways: a bad length must not allocate the machine
_RECV_CHUNK = 256 * 1024
_JSON_DEPTH = 20

# Framing.


def encode_frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(data):,} bytes is over the {MAX_FRAME_BYTES:,}-byte channel limit")
    return len(data).to_bytes(4, "big") + data


def encode_line(obj: dict[str, Any]) -> bytes:
    """One frame as a line of ASCII JSON (--lines): survives transports that carry only text."""
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")
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

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


class StdioTransport:
    """Frames over a pair of pipes (containers, remote sandboxes). No fd passing."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd

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

    def __init__(self, transport: SocketTransport | StdioTransport, *, lines: bool = False) -> None:
        self.transport = transport
        self.lines = lines
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

    # -- sending ---------------------------------------------------------------------------------

    def send(self, obj: dict[str, Any]) -> None:
        frame = encode_line(obj) if self.lines else encode_frame(obj)
        on_main = threading.get_ident() == self._main
        if on_main:
            self.main_sending = True
        try:
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
            self.send({"op": "call", "id": call_id, "fn": fn, "args": args})
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

    def close_copy(self) -> None:
        """In a forked snapshot: drop this process's copy of the channel (only the worker reads it)."""
        try:
            self.transport.close()
        except OSError:
            pass

    def start_reader(self) -> None:
        threading.Thread(target=self._read_loop, name="recursa-reader", daemon=True).start()

    def _read_loop(self) -> None:
        try:
            if self.lines:
                self._read_lines()
            else:
                self._read_frames()
        except BaseException:  # a broken channel leaves nothing to serve: never linger as an orphan
            pass
        try:
            self.on_eof()
        finally:
            os._exit(0)

    def _read_lines(self) -> None:
        buf = bytearray()
        while True:
            end = buf.find(b"\n")
            while end < 0:
                if len(buf) > MAX_FRAME_BYTES:
                    raise ValueError("oversized line from host")
                data, fds = self.transport.recv()
                for fd in fds:
                    os.close(fd)
                if not data:
                    return
                start = len(buf)
                buf += data
                end = buf.find(b"\n", start)
            line = bytes(buf[:end]).strip()
            del buf[: end + 1]
            if line and self._route(decode_frame(line)):
                return

    def _route(self, msg: dict[str, Any]) -> bool:
        """Deliver one decoded frame; True when the host asked us to stop."""
        if msg.get("op") == "reply":
            self._deliver(msg)
            return False
        self.inbox.put(msg)
        return msg.get("op") == "shutdown"

    def _read_frames(self) -> None:
        buf = bytearray()
        fds: collections.deque[int] = collections.deque()
        while True:
            while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
                if len(buf) >= 4 and int.from_bytes(buf[:4], "big") > MAX_FRAME_BYTES:
                    raise ValueError("oversized frame from host")
                data, new_fds = self.transport.recv()
                if not data:
                    return  # host went away
                buf += data
                fds.extend(new_fds)
            size = int.from_bytes(buf[:4], "big")
            msg = decode_frame(memoryview(buf)[4 : 4 + size])
            del buf[: 4 + size]
            op = msg.get("op")
            if op == "load_context" and msg.get("transfer") == "inline":
                msg["_buffer"], buf = _read_inline(self.transport, buf, int(msg.get("size", 0)))
            elif (op == "load_context" and msg.get("transfer") == "fd") or op == "standby":
                msg["_fd"] = fds.popleft() if fds else -1
            if self._route(msg):
                return

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
