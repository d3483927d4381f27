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
    host -> driver   {"op": "done", "id": n, "value": v}   {"op": "failed", "id": n, "kind": k, "message": m}
                     {"op": "call", "id": call, "repl": r, "fn": f, "args": {...}}   {"op": "cancel", "id": call}
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Final

from recursa.errors import ConfigError, ContextError, RecursaError, SandboxError, SandboxLost, template_of
from recursa.sandbox.base import ExecResult, FinalAnswer
from recursa.sandbox.frames import FrameDecoder, ProtocolError, RefusedFrame
from recursa.sandbox.protocol import exec_result_from_wire, final_from_wire
from recursa.sandbox.worker.wire import MAX_FRAME_BYTES, decode_frame, encode_frame

TOKEN_BYTES: Final = 32
AUTH_S: Final = 5.0  # a connection that has not sent its token by then is dropped
# What the driver may ask of a host over the stream, each with the fields it takes.
METHODS: Final = {
    "open": ("repl", "options", "memory"),
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
_READ_CHUNK = 256 * 1024
_SLICE_S = 0.001  # a reader gives the loop back this often while frames keep coming


def encode(frame: dict[str, Any]) -> bytes:
    """One frame on the wire (`op` and `id` first: a refused frame is known by them, frames.py)."""
    return encode_frame(frame)


async def frames(reader: asyncio.StreamReader) -> AsyncIterator[dict[str, Any] | RefusedFrame]:
    """Frames until the peer closes; ProtocolError on one that cannot be a frame. One at a time,
    and the socket is read only when no whole frame is left, so a flood is read no faster than it
    is served."""
    decoder = FrameDecoder()
    loop = asyncio.get_running_loop()
    slice_end = loop.time() + _SLICE_S
    while True:
        frame = decoder.next_frame()
        if frame is None:
            data = await reader.read(_READ_CHUNK)
            if not data:
                return
            decoder.push(data)
            continue
        yield frame
        if loop.time() >= slice_end:
            await asyncio.sleep(0)
            slice_end = loop.time() + _SLICE_S


class Outbox:
    """Frames for one stream: the first of a turn of the event loop goes at once, the others of
    that turn together at its end, so frames that come ready on one turn (the results of many
    REPLs) cost two sends and wake the peer at most twice, and a lone frame waits for nothing."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._buffer = bytearray()
        self._due = False

    def send(self, frame: dict[str, Any]) -> None:
        """Send `frame`: at once when it is the first of this turn, else at the turn's end with the
        others. ValueError or TypeError here when it cannot be a frame."""
        if self.writer.is_closing():
            return
        data = encode(frame)
        if self._due:
            self._buffer += data
            return
        self._due = True
        asyncio.get_running_loop().call_soon(self._flush)
        self.writer.write(data)

    def _flush(self) -> None:
        self._due = False
        data = bytes(self._buffer)
        self._buffer.clear()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        """Wait while the peer is not reading (the socket's buffer is full)."""
        with contextlib.suppress(OSError):
            await self.writer.drain()

    def close(self) -> None:
        self._flush()
        self.writer.close()


async def driver_frames(reader: asyncio.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The frames of an authenticated driver, as the host reads them: up to the channel's limit
    (MAX_FRAME_BYTES), as a worker reads its host's. The driver owns the host; a node's frames
    are the ones read with a worker's bounds (`frames`)."""
    while True:
        try:
            size = int.from_bytes(await reader.readexactly(4), "big")
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {size:,} bytes announced; the limit is {MAX_FRAME_BYTES:,}")
            frame = decode_frame(await reader.readexactly(size))
        except asyncio.IncompleteReadError:
            return
        except ValueError as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from None
        if not isinstance(frame.get("op"), str):
            raise ProtocolError("frame is not a JSON object with an 'op'")
        yield frame


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
            fields["final"] = dict(vars(value.final))
        return fields
    if isinstance(value, FinalAnswer):
        return dict(vars(value))
    return value


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
        if not isinstance(value, dict) or not isinstance(value.get("isolation", {}), dict):
            raise ProtocolError("an open answer that is not an object with an isolation report")
        pid = value.get("pid")
        isolation = dict(list(value.get("isolation", {}).items())[:_MAX_FACTS])
        return {"full": value.get("full") is True, "isolation": isolation,
                "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None}  # fmt: skip
    if method == "load_cached":
        return value is True
    return None
