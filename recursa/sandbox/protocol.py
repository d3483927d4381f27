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
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from recursa.sandbox.base import ExecResult, FinalAnswer

# The wire format has one definition, in the worker (which must stay a standalone stdlib script);
# the host encodes with the same functions and refuses frames over the same limit.
from recursa.sandbox.worker.wire import MAX_FRAME_BYTES, encode_frame, encode_line

# The worker's folder (a package the worker process loads on its own: worker/start.py) and entry script.
WORKER_DIR = Path(__file__).with_name("worker")
WORKER_PATH = WORKER_DIR / "start.py"
_RECV_CHUNK = 256 * 1024
_PAYLOAD_CHUNK = 4 * 1024 * 1024


class ProtocolError(Exception):
    """The worker sent something that is not a valid frame; the channel cannot be trusted any more."""


def _check_frame(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise ProtocolError("frame is not a JSON object with an 'op'")
    return obj


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole frames back."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        frames: list[dict[str, Any]] = []
        buf = self._buf
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big")
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {size:,} bytes announced; the limit is {MAX_FRAME_BYTES:,}")
            if len(buf) < 4 + size:
                break
            try:
                # Decoded straight from the buffer: a multi-MB answer is not copied twice first.
                with memoryview(buf) as view, view[4 : 4 + size] as body:
                    text = str(body, "utf-8", "surrogatepass")
                obj = json.loads(text)
            except ValueError as exc:
                raise ProtocolError(f"undecodable frame: {exc}") from None
            del buf[: 4 + size]
            frames.append(_check_frame(obj))
        return frames


class LineDecoder:
    """Incremental decoder for line framing: one JSON object per line."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        frames: list[dict[str, Any]] = []
        start = len(self._buf)
        self._buf += data
        while True:
            end = self._buf.find(b"\n", start)
            if end < 0:
                break
            line = bytes(self._buf[:end]).strip()
            del self._buf[: end + 1]
            start = 0
            if not line:
                continue
            try:
                frames.append(_check_frame(json.loads(line.decode("utf-8", "surrogatepass"))))
            except ValueError as exc:
                raise ProtocolError(f"undecodable line: {exc}") from None
        if len(self._buf) > MAX_FRAME_BYTES:
            raise ProtocolError(f"a line longer than {MAX_FRAME_BYTES:,} bytes")
        return frames


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

    async def send_with_payload(self, obj: dict[str, Any], fd: int, size: int) -> None:
        """A frame followed by `size` raw bytes read from `fd` (the context, sent inline)."""
        raise ProtocolError("this channel cannot carry raw bytes")

    def frames(self) -> AsyncIterator[dict[str, Any]]:
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

    async def send_encoded(self, data: bytes) -> None:
        """Send a frame made by `encode_frame`."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            await loop.sock_sendall(self.sock, data)

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

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        """Frames until the worker closes its end (or dies)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await loop.sock_recv(self.sock, _RECV_CHUNK)
            except (ConnectionResetError, BrokenPipeError):
                return
            if not data:
                return
            for frame in self._decoder.feed(data):
                yield frame

    @property
    def sending(self) -> bool:
        return self._lock.locked()

    def close(self) -> None:
        self.sock.close()


class FeedChannel(Channel):
    """Frames over a remote SDK's process streams: output arrives through `feed`, input goes out
    through `write` (an async function taking bytes). Used with line framing."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]], *, lines: bool = True) -> None:
        self.lines = lines
        self._write = write
        self._lock = asyncio.Lock()
        self._decoder = self.decoder()
        self._queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()
        self.closed = False

    def feed(self, data: bytes | str) -> None:
        """Output from the worker (an SDK callback; str is encoded as UTF-8)."""
        if self.closed:
            return
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        try:
            for frame in self._decoder.feed(raw):
                self._queue.put_nowait(frame)
        except ProtocolError as exc:
            self._queue.put_nowait(exc)

    def feed_eof(self) -> None:
        self._queue.put_nowait(None)

    async def send_encoded(self, data: bytes) -> None:
        if self.closed:
            raise OSError("the channel is closed")
        async with self._lock:
            await self._write(data)

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    @property
    def sending(self) -> bool:
        return self._lock.locked()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)


def final_from_wire(data: Any) -> FinalAnswer | None:
    """A FinalAnswer from the worker's JSON (types checked: the worker is not trusted)."""
    if not isinstance(data, dict):
        return None
    text = str(data.get("text", ""))
    value = text if data.get("value_is_text") else data.get("value", text)
    var = data.get("var_name")
    return FinalAnswer(text, value, str(data.get("protocol", "FINAL")), var if isinstance(var, str) else None)


def exec_result_from_wire(frame: dict[str, Any]) -> ExecResult:
    def strs(key: str) -> list[str]:
        items = frame.get(key)
        return [str(x) for x in items] if isinstance(items, list) else []

    error = frame.get("error")
    return ExecResult(
        stdout=str(frame.get("stdout", "")),
        stderr=str(frame.get("stderr", "")),
        omitted_chars=int(frame.get("omitted_chars", 0) or 0),
        error=str(error) if error is not None else None,
        final=final_from_wire(frame.get("final")),
        restored_names=strs("restored_names"),
        notes=strs("notes"),
        duration_s=float(frame.get("duration_s", 0.0) or 0.0),
        partial=str(frame["partial"]) if frame.get("partial") is not None else None,
    )
