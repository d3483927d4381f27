"""The stream between a driver and a node's REPL host (`sandbox="ray"`): handshake, frames, values.

Ray places the host, ships contexts through its object store and watches the node; the per-step
traffic (cells out, results and the REPL's call-backs back) goes over one TCP connection per driver
event loop and node, to the address Ray advertises for the node (Ray's documented pattern for
out-of-band communication: a server inside the actor). A step is then one frame each way instead
of an actor call each way, a tenth of a millisecond on loopback where an actor call takes 2.5 ms.

Handshake: the driver hands the host a fresh random token through an actor call (Ray's channel),
connects, and sends the token's TOKEN_BYTES raw bytes before anything else. The host reads exactly
that many bytes within AUTH_S, compares them in constant time with the tokens it expects, and
serves nothing (no frame is even parsed) before they match; a token admits one connection.

Frames, both ways: the worker channel's framing (a 4-byte length and UTF-8 JSON, protocol.py).
The driver reads a node's frames with the bounds it reads a worker's with (frames.py): a frame
over MAX_HOST_FRAME_BYTES is not parsed, and the request or call-back it carried fails naming the
limit; a length past MAX_FRAME_BYTES ends the stream. Nothing is unpickled: the driver trusts a
node no more than a local REPL worker, and reads every value with the checks it applies to a
worker's answers. The host reads its authenticated driver's frames as a worker reads its host's
(up to MAX_FRAME_BYTES).

    driver -> host   {"op": METHOD, "id": n, ...its fields}   {"op": "cancel", "id": n}
                     {"op": "answer", "id": call, "ok": true, "value": v}
                     {"op": "answer", "id": call, "ok": false, "kind": k, "message": m}
                     {"op": "idle", "repl": r}   (nothing followed r's last cell: its snapshot may go)
    host -> driver   {"op": "done", "id": n, "value": v}   {"op": "failed", "id": n, "kind": k, "message": m}
                     {"op": "call", "id": call, "repl": r, "fn": f, "args": {...}}   {"op": "cancel", "id": call}
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, Protocol

from recursa.errors import ConfigError, ContextError, RecursaError, SandboxError, SandboxLost, template_of
from recursa.sandbox.base import ExecResult, FinalAnswer
from recursa.sandbox.frames import ProtocolError, RefusedFrame, announced
from recursa.sandbox.protocol import exec_result_from_wire, final_from_wire
from recursa.sandbox.worker.wire import decode_frame, encode_frame

TOKEN_BYTES: Final = 32
AUTH_S: Final = 5.0  # a connection that has not sent its token by then is dropped
# What the driver may ask of a host over the stream, each with the fields it takes.
METHODS: Final = {
    "open": ("repl", "options", "memory", "context"),
    "load_cached": ("repl", "key"),
    "define": ("repl", "entries"),
    "execute": ("repl", "code", "timeout"),
    "get_variable": ("repl", "name", "timeout"),
    "variable_names": ("repl",),
    "close": ("repl",),
}
_ERRORS: Final[dict[str, type[RecursaError]]] = {
    cls.__name__: cls for cls in (SandboxError, SandboxLost, ConfigError, ContextError)
}
_MAX_MESSAGE = 10_000  # characters of an error's message read from a node
_MAX_FACTS = 100  # entries read from a node's isolation report
_MAX_NAMES = 100_000  # names read from one answer (a REPL's variables, a define's messages)
_SLICE_S = 0.001  # a reader gives the loop back this often while frames keep coming
# Unread bytes a reader may hold while it has given the loop back; past them the socket is not read
# until its next slice (below them, pausing and resuming the socket cost two epoll calls a slice).
_MAX_UNREAD = 1 << 20


def encode(frame: dict[str, Any]) -> bytes:
    """One frame on the wire (`op` and `id` first: a refused frame is known by them, frames.py)."""
    return encode_frame(frame)


class DriverDecoder:
    """The frames of an authenticated driver, as the host reads them: up to the channel's limit
    (MAX_FRAME_BYTES), as a worker reads its host's. The driver owns the host; a node's frames are
    the ones read with a worker's bounds (frames.FrameDecoder)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def push(self, data: bytes) -> None:
        self._buf += data

    def unread(self) -> int:
        return len(self._buf)

    def next_frame(self) -> dict[str, Any] | None:
        buf = self._buf
        size = announced(buf)
        if size is None or len(buf) < 4 + size:
            return None
        body = bytes(buf[4 : 4 + size])
        del buf[: 4 + size]
        try:
            frame = decode_frame(body)
        except ValueError as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from None
        if not isinstance(frame.get("op"), str):
            raise ProtocolError("frame is not a JSON object with an 'op'")
        return frame


class Decoder(Protocol):
    def push(self, data: bytes) -> None: ...
    def next_frame(self) -> dict[str, Any] | RefusedFrame | None: ...
    def unread(self) -> int: ...


class Channel(asyncio.Protocol):
    """One end of a stream, as the event loop's protocol: the frames in a read are decoded and handed
    to `on_frame` in the same turn of the loop (no reader task to wake between the socket and the
    frame), and frames out are written at once when first in a turn, the others of that turn together
    at its end (so the results of many REPLs that come ready in one turn cost two sends and wake the
    peer at most twice, and a lone frame waits for nothing).

    `on_end(why)` is called once when the stream ends: None when the peer closed it, a ProtocolError
    for bytes that are not a frame (the transport is closed), an OSError when the connection failed.
    A reader that must not take more frames for now `hold()`s the channel: the socket is not read
    and no frame is handed out until `release()`. While frames keep coming, the loop is given back
    every _SLICE_S (the socket is read meanwhile while less than _MAX_UNREAD bytes wait), so a flood
    is read no faster than it is served."""

    def __init__(self, decoder: Decoder, on_frame: Callable[[Any], None],
                 on_end: Callable[[Exception | None], None] | None = None) -> None:  # fmt: skip
        self.transport: asyncio.Transport | None = None
        self._decoder = decoder
        self._on_frame = on_frame
        self._on_end = on_end
        self._ended = False
        self._held = False
        self._resuming = False
        self._buffer = bytearray()
        self._due = False
        self._paused = False  # the peer is not reading: writers wait in drain()
        self._drained: asyncio.Future[None] | None = None

    # -- in --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (or a relay's stand-in, relay.py)

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        self._decoder.push(data)
        if self._resuming:  # the loop was given back: this waits for the next slice
            if self._decoder.unread() > _MAX_UNREAD:
                self._pause_reading()
            return
        self._pump()

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        slice_end = loop.time() + _SLICE_S
        while not self._held and not self._ended:
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as exc:
                self._end(exc)
                if self.transport is not None:
                    self.transport.close()
                return
            if frame is None:
                return
            self._on_frame(frame)
            if loop.time() >= slice_end and not self._resuming:
                self._resuming = True
                loop.call_soon(self._resume)
                if self._decoder.unread() > _MAX_UNREAD:
                    self._pause_reading()
                return

    def _resume(self) -> None:
        self._resuming = False
        if not self._held:
            self._resume_reading()
            self._pump()

    def hold(self) -> None:
        """Take no more frames until `release()` (the socket is not read meanwhile)."""
        self._held = True
        self._pause_reading()

    def release(self) -> None:
        if self._held:
            self._held = False
            if not self._resuming:
                self._resume_reading()
                self._pump()

    def _pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and not self.transport.is_reading():
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost(None) follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._wake_writers()
        self._end(exc)

    def _end(self, why: Exception | None) -> None:
        if not self._ended:
            self._ended = True
            if self._on_end is not None:
                self._on_end(why)

    # -- out -------------------------------------------------------------------------------------

    def send(self, frame: dict[str, Any]) -> None:
        """Send `frame`: at once when it is the first of this turn, else at the turn's end with the
        others. ValueError or TypeError here when it cannot be a frame."""
        if self.transport is None or self.transport.is_closing():
            return
        data = encode(frame)
        if self._due:
            self._buffer += data
            return
        self._due = True
        asyncio.get_running_loop().call_soon(self._flush)
        self.transport.write(data)

    def _flush(self) -> None:
        self._due = False
        if self._buffer and self.transport is not None and not self.transport.is_closing():
            self.transport.write(bytes(self._buffer))
        self._buffer.clear()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writers()

    def _wake_writers(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def drain(self) -> None:
        """Wait while the peer is not reading (the socket's buffer is full)."""
        if self._paused and self.transport is not None and not self.transport.is_closing():
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)

    def close(self) -> None:
        """What is queued goes out; then the stream closes."""
        if self.transport is not None:
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        """The stream closes at once; what is queued is dropped."""
        self._buffer.clear()
        if self.transport is not None:
            self.transport.abort()


def frame_id(frame: dict[str, Any]) -> int | None:
    value = frame.get("id")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- values, host side -----------------------------------------------------------------------------


def value_to_wire(value: Any) -> Any:
    """A method's value as JSON: an ExecResult or a FinalAnswer as its fields (by hand: asdict's
    deep copy was most of a result's encoding time)."""
    if isinstance(value, ExecResult):
        fields = dict(vars(value))
        if value.final is not None:
            fields["final"] = _final_to_wire(value.final)
        return fields
    if isinstance(value, FinalAnswer):
        return _final_to_wire(value)
    return value


def _final_to_wire(final: FinalAnswer) -> dict[str, Any]:
    """An answer's fields; its value left out where it is its text, as a worker sends it (a long
    answer would cross twice, and one a local REPL hands back would pass the driver's frame bound)."""
    fields = dict(vars(final))
    if final.value is final.text or (isinstance(final.value, str) and final.value == final.text):
        del fields["value"]
        fields["value_is_text"] = True
    return fields


def error_to_wire(exc: BaseException) -> dict[str, str]:
    return {"kind": type(exc).__name__, "message": template_of(exc)}


# -- values, driver side (every field checked: the node is not trusted) ----------------------------


def error_from_wire(frame: dict[str, Any]) -> Exception:
    """The host's error as this side raises it: recursa's own kinds by name, anything else as a
    SandboxError naming its kind."""
    kind, message = frame.get("kind"), frame.get("message")
    kind = kind[:64] if isinstance(kind, str) else "Error"
    message = message[:_MAX_MESSAGE] if isinstance(message, str) else ""
    cls = _ERRORS.get(kind)
    return cls(message) if cls is not None else SandboxError(f"{kind}: {message}")


def value_from_wire(method: str, value: Any) -> Any:
    """What `method` answered, as the Sandbox protocol returns it; ProtocolError when it cannot be."""
    if method == "execute":
        if not isinstance(value, dict):
            raise ProtocolError("an execute result that is not an object")
        result: ExecResult = exec_result_from_wire(value)
        result.timed_out, result.restarted, result.restored = (
            value.get(flag) is True for flag in ("timed_out", "restarted", "restored")
        )
        return result
    if method == "get_variable":
        answer: FinalAnswer | None = final_from_wire(value)
        return answer
    if method in ("define", "variable_names"):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ProtocolError(f"a {method} answer that is not a list of strings")
        return value[:_MAX_NAMES]
    if method == "open":
        if not isinstance(value, dict):
            raise ProtocolError("an open answer that is not an object with an isolation report")
        pid, failed = value.get("pid"), value.get("load_error")
        return {"full": value.get("full") is True, "isolation": isolation_from_wire(value.get("isolation", {})),
                "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                "loaded": value.get("loaded") is True,
                "load_error": error_from_wire(failed) if isinstance(failed, dict) else None}  # fmt: skip
    if method == "load_cached":  # the REPL's isolation report after the load; None: not on the node
        return None if value is None else isolation_from_wire(value)
    return None


def isolation_from_wire(value: Any) -> dict[str, Any]:
    """A node's isolation report of one REPL, as far as it is read (ProtocolError if not a report)."""
    if not isinstance(value, dict):
        raise ProtocolError("an isolation report that is not an object")
    return dict(list(value.items())[:_MAX_FACTS])
