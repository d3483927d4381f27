"""Host side of the worker channel: frame encoding and asyncio channels to one worker.

The wire format is defined in `worker/wire.py` (the worker is stdlib-only and cannot import this
module, so the few lines of framing exist on both sides). Frames are a 4-byte big-endian length and
a UTF-8 JSON object, or (`lines`, for remote sandboxes whose SDKs carry text) one line of ASCII
JSON each. The host only ever parses JSON from the worker: nothing is unpickled.

Channels: `FrameSocket` is a stream socket (the local worker's socketpair, which can also carry file
descriptors, or the stdin/stdout of a container engine's client process); `FeedChannel` is fed by
a remote SDK's output callback and writes through an async function.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from recursa.outcomes import AnswerProtocol
from recursa.sandbox.base import ExecResult, FinalAnswer
from recursa.sandbox.frames import (
    MAX_HOST_FRAME_BYTES,
    FrameDecoder,
    LineDecoder,
    ProtocolError,
    RefusedFrame,
)

# The wire format has one definition, in the worker (which must stay a standalone stdlib script);
# the host encodes with the same functions. What it accepts from a worker is bounded in frames.py.
from recursa.sandbox.worker.wire import encode_frame, encode_line

# The worker's folder (a package the worker process loads on its own: worker/start.py) and entry script.
WORKER_DIR = Path(__file__).with_name("worker")
WORKER_PATH = WORKER_DIR / "start.py"
_RECV_CHUNK = 256 * 1024
_PAYLOAD_CHUNK = 4 * 1024 * 1024
# A remote SDK pushes output as it comes: past this much not yet taken by the host, the worker is
# flooding its channel and is stopped.
_FEED_BACKLOG_BYTES = MAX_HOST_FRAME_BYTES + 8 * _RECV_CHUNK
# How long one channel may keep the event loop between yields (frames are handed out one at a time,
# so this is overrun by one frame's handling at most).
_SLICE_S = 0.001
# Notes (and restored names) read from one answer of a worker, and the characters kept of each.
_MAX_NOTES = 100
_NOTE_CHARS = 2_000
# How a worker's answer may say it was given (the other protocols are the engine's own).
_WORKER_PROTOCOLS: tuple[AnswerProtocol, ...] = ("FINAL", "FINAL_VAR", "answer")


Frame = tuple[dict[str, Any] | RefusedFrame, int]  # a frame as read, and its size in bytes
Quick = Callable[[dict[str, Any] | RefusedFrame, int], bool]  # see Channel.frames


class Channel:
    """A framed two-way connection to one worker, used from one event loop."""

    lines = False  # line framing instead of length-prefixed frames
    can_pass_fds = False

    def encode(self, obj: dict[str, Any]) -> bytes:
        return encode_line(obj) if self.lines else encode_frame(obj)

    def decoder(self) -> FrameDecoder | LineDecoder:
        return LineDecoder() if self.lines else FrameDecoder()

    async def send(self, obj: dict[str, Any]) -> None:
        await self.send_encoded(self.encode(obj))

    async def send_encoded(self, data: bytes) -> None:
        """Send bytes made by `encode` (or, before the first frame, raw bytes such as a bootstrap)."""
        raise NotImplementedError

    async def send_with_fd(self, obj: dict[str, Any], fd: int) -> None:
        raise ProtocolError("this channel cannot carry file descriptors")

    def try_send(self, data: bytes) -> bool:
        """Send a small frame made by `encode` at once, from outside a coroutine (a timer's
        callback), or not at all: False when another send holds the channel or it is full."""
        return False

    async def send_with_payload(self, obj: dict[str, Any], fd: int, size: int) -> None:
        """A frame followed by `size` raw bytes read from `fd` (the context, sent inline)."""
        raise ProtocolError("this channel cannot carry raw bytes")

    def frames(self, quick: Quick | None = None) -> AsyncIterator[Frame]:
        """(frame, its size in bytes) as they arrive, one per event-loop iteration (limits: frames.py).

        `quick`: a handler a channel may give each frame to as it is read, in the event loop's own
        callback, instead of yielding it (a task switch less per answer); it returns False for a
        frame it leaves to the iterator. Order holds: it only gets a frame while the iterator waits
        with nothing left to yield, and a frame it leaves is yielded before any read after it."""
        raise NotImplementedError

    @property
    def sending(self) -> bool:
        return False

    def close(self) -> None:
        raise NotImplementedError


class FrameSocket(Channel):
    """Frames over a non-blocking stream socket, from one event loop.

    Sends are serialised by an asyncio lock so concurrent replies never interleave. On a Unix
    socket a frame can carry a file descriptor (SCM_RIGHTS) on the same sendmsg, so it arrives
    with that frame.
    """

    def __init__(self, sock: socket.socket, *, lines: bool = False) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.lines = lines
        self.can_pass_fds = sock.family == socket.AF_UNIX
        self._lock = asyncio.Lock()
        self._decoder = self.decoder()
        self._reader: _SocketReader | None = None  # while frames() runs

    async def send_encoded(self, data: bytes) -> None:
        """Send a frame made by `encode_frame`."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            await loop.sock_sendall(self.sock, data)

    def try_send(self, data: bytes) -> bool:
        if self._lock.locked():
            return False
        try:
            sent = self.sock.send(data)
        except OSError:  # BlockingIOError included
            return False
        # A Unix stream socket takes a write this small whole or not at all; elsewhere, the rest
        # goes before any other frame can.
        if sent < len(data):
            self.sock.setblocking(True)
            try:
                self.sock.sendall(data[sent:])
            finally:
                self.sock.setblocking(False)
        return True

    async def send_with_fd(self, obj: dict[str, Any], fd: int) -> None:
        data = memoryview(encode_frame(obj))
        loop = asyncio.get_running_loop()
        async with self._lock:
            while True:
                try:
                    sent = socket.send_fds(self.sock, [data], [fd])
                    break
                except BlockingIOError:
                    await self._writable(loop)
            if sent < len(data):
                await loop.sock_sendall(self.sock, data[sent:])

    async def send_with_payload(self, obj: dict[str, Any], fd: int, size: int) -> None:
        loop = asyncio.get_running_loop()
        async with self._lock:  # nothing may slip in between the frame and its bytes
            await loop.sock_sendall(self.sock, self.encode(obj))
            pos = 0
            while pos < size:
                chunk = os.pread(fd, min(_PAYLOAD_CHUNK, size - pos), pos)
                if not chunk:
                    raise ProtocolError("the context buffer is shorter than announced")
                await loop.sock_sendall(self.sock, chunk)
                pos += len(chunk)

    async def _writable(self, loop: asyncio.AbstractEventLoop) -> None:
        ready = loop.create_future()
        fileno = self.sock.fileno()
        loop.add_writer(fileno, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(fileno)

    async def frames(self, quick: Quick | None = None) -> AsyncIterator[Frame]:
        """Frames until the worker closes its end (or dies).

        Frames are taken one at a time and the socket is read only when no whole frame is left: a
        flooding worker fills its own socket buffer and blocks instead of filling the host's memory.
        The loop is given back every _SLICE_S while frames are waiting.
        """
        loop = asyncio.get_running_loop()
        reader = self._reader = _SocketReader(self.sock, self._decoder, loop, quick)
        try:
            slice_end = loop.time() + _SLICE_S
            while True:
                item = reader.take()
                if item is None:
                    if reader.ended:
                        return
                    await reader.wait()
                    slice_end = loop.time() + _SLICE_S
                    continue
                yield item
                if loop.time() >= slice_end:
                    await asyncio.sleep(0)
                    slice_end = loop.time() + _SLICE_S
        finally:
            reader.stop()

    @property
    def sending(self) -> bool:
        return self._lock.locked()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.stop()  # before the descriptor goes: its number may be reused at once
        self.sock.close()


class _SocketReader:
    """Reads a FrameSocket in the event loop's readiness callback, registered once for as long as
    the iterator keeps up: a read costs no future, no task switch and no epoll registration, and
    `quick` takes an answer in that same callback (docs/performance.md, "RL step, third pass").
    While the iterator is busy with frames already read, the socket is not watched (nor read)."""

    def __init__(
        self, sock: socket.socket, decoder: FrameDecoder, loop: asyncio.AbstractEventLoop, quick: Quick | None
    ) -> None:
        self.sock, self.decoder, self.loop, self.quick = sock, decoder, loop, quick
        self.fd = sock.fileno()
        # One buffer for every read: sock_recv would allocate (and shrink) 256 KiB per read.
        self.buf = bytearray(_RECV_CHUNK)
        self.view = memoryview(self.buf)
        self.waiter: asyncio.Future[None] | None = None  # the iterator's, while it waits
        self.held: Frame | None = None  # a frame `quick` left, for the iterator
        self.ended = False
        self.error: BaseException | None = None  # raised by the iterator, before anything else
        self.watching = False

    def take(self) -> Frame | None:
        if self.error is not None:
            raise self.error
        if self.held is not None:
            item, self.held = self.held, None
            return item
        frame = self.decoder.next_frame()
        return None if frame is None else (frame, self.decoder.last_size)

    async def wait(self) -> None:
        """Until there is something for the iterator: a frame, the end, or an error."""
        self.waiter = self.loop.create_future()
        if not self.watching:
            self.loop.add_reader(self.fd, self._readable)
            self.watching = True
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _readable(self) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            self.stop()  # the iterator has frames to handle: it watches again once it waits
            return
        try:
            size = self.sock.recv_into(self.buf)
        except (BlockingIOError, InterruptedError):
            return
        except (ConnectionResetError, BrokenPipeError):
            size = 0
        except OSError as exc:
            self._end(exc)
            return
        if not size:
            self._end(None)
            return
        self.decoder.push(bytes(self.view[:size]))
        if self.quick is not None:
            quick, decoder = self.quick, self.decoder
            slice_end = self.loop.time() + _SLICE_S
            try:
                while (frame := decoder.next_frame()) is not None:
                    if not quick(frame, decoder.last_size):
                        self.held = (frame, decoder.last_size)
                        break
                    if self.loop.time() >= slice_end or self.ended:
                        break  # the rest goes to the iterator, which gives the loop back
                else:
                    return  # every frame taken: go on waiting
            except Exception as exc:  # an invalid frame, or the handler's own failure
                self._end(exc)
                return
        if not waiter.done():
            waiter.set_result(None)

    def _end(self, error: BaseException | None) -> None:
        self.ended = True
        self.error = error
        self.stop()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def stop(self) -> None:
        if self.watching:
            self.watching = False
            if not self.loop.is_closed():
                self.loop.remove_reader(self.fd)


class FeedChannel(Channel):
    """Frames over a remote SDK's process streams: output arrives through `feed`, input goes out
    through `write` (an async function taking bytes). Used with line framing."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]], *, lines: bool = True) -> None:
        self.lines = lines
        self._write = write
        self._lock = asyncio.Lock()
        self._decoder = self.decoder()
        self._arrived = asyncio.Event()  # bytes fed since the reader last looked
        self._unread = 0  # bytes fed and not yet decoded
        self._eof = False
        self.closed = False

    def feed(self, data: bytes | str) -> None:
        """Output from the worker (an SDK callback; str is encoded as UTF-8).

        The SDK pushes as fast as the worker writes, so nothing can be held back here: bytes are
        only buffered (frames are parsed as the reader takes them), up to a bound.
        """
        if self.closed or self._eof:
            return
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        self._unread += len(raw)
        self._decoder.push(raw)
        self._arrived.set()

    def feed_eof(self) -> None:
        self._eof = True
        self._arrived.set()

    async def send_encoded(self, data: bytes) -> None:
        if self.closed:
            raise OSError("the channel is closed")
        async with self._lock:
            await self._write(data)

    async def frames(self, quick: Quick | None = None) -> AsyncIterator[Frame]:
        loop = asyncio.get_running_loop()
        decoder = self._decoder
        slice_end = loop.time() + _SLICE_S
        while not self.closed:
            if self._unread > _FEED_BACKLOG_BYTES:
                raise ProtocolError(
                    f"the worker sent over {_FEED_BACKLOG_BYTES:,} bytes the host has not read yet"
                )
            frame = decoder.next_frame()
            if frame is None:
                if self._eof:
                    return
                self._unread = 0  # every whole frame is taken; what is left is part of the next one
                self._arrived.clear()
                await self._arrived.wait()
                continue
            yield frame, decoder.last_size
            if loop.time() >= slice_end:
                await asyncio.sleep(0)
                slice_end = loop.time() + _SLICE_S

    @property
    def sending(self) -> bool:
        return self._lock.locked()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._arrived.set()


def final_from_wire(data: Any) -> FinalAnswer | None:
    """A FinalAnswer from the worker's JSON (types checked: the worker is not trusted)."""
    if not isinstance(data, dict):
        return None
    text = _text(data.get("text"))
    value = text if data.get("value_is_text") else data.get("value", text)
    var = data.get("var_name")
    protocol = data.get("protocol")
    return FinalAnswer(
        text,
        value,
        protocol if protocol in _WORKER_PROTOCOLS else "FINAL",
        var if isinstance(var, str) else None,
    )


def exec_result_from_wire(frame: dict[str, Any]) -> ExecResult:
    """An ExecResult from the worker's answer. Code in the cell can write that answer itself, so
    every field is checked: one of the wrong kind is read as absent, never raised on the host."""

    def strs(key: str) -> list[str]:
        # The worker's notes are a few short sentences, its restored names a few names: a forged
        # answer's 50,000 long ones went into the trace whole, hundreds of MB per cell.
        items = frame.get(key)
        return [_text(x)[:_NOTE_CHARS] for x in items[:_MAX_NOTES]] if isinstance(items, list) else []

    error, partial = frame.get("error"), frame.get("partial")
    return ExecResult(
        stdout=_text(frame.get("stdout")),
        stderr=_text(frame.get("stderr")),
        omitted_chars=_number(frame.get("omitted_chars"), int),
        error=_text(error) if error is not None else None,
        final=final_from_wire(frame.get("final")),
        restored_names=strs("restored_names"),
        notes=strs("notes"),
        duration_s=_number(frame.get("duration_s"), float),
        partial=_text(partial) if partial is not None else None,
    )


def _text(value: Any) -> str:
    """A str field as sent; anything else (a forged answer's list or number) as its JSON text."""
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value)


def _number(value: Any, kind: type[int] | type[float]) -> Any:
    """A count or a duration: a finite, non-negative number of JSON, else 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return kind(0)
    return kind(value)
