"""Decoding what a worker sends, at a cost the host can bound.

Everything a worker writes is hostile input: code in the REPL can reach the channel's file
descriptor and write frames of its own. Parsing JSON holds the event loop (and the GIL, so a thread
does not help) for about a millisecond per megabyte of text but up to 0.3 microseconds per value,
and a value can cost 60 bytes of memory for each byte of JSON. So before a frame is parsed, its size
and an upper bound on its number of values are checked; a frame over either limit is not parsed:
it becomes a `RefusedFrame` that keeps only its `op` and `id` (read from its first bytes), so the
host can answer the REPL with an error instead of killing the worker. Frames are handed out one at
a time (`pop`), so a channel full of small frames is read no faster than the host serves them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from recursa.sandbox.worker.wire import MAX_FRAME_BYTES

# A frame is parsed on the event loop only below both limits, which bound how long one parse holds
# the loop (docs/performance.md, "Figures behind choices in the code"). Above them the REPL gets an error naming the limit.
MAX_HOST_FRAME_BYTES = 64 << 20
MAX_FRAME_VALUES = 50_000
_HEAD_BYTES = 256
# The worker writes `op` and `id` first (json.dumps keeps the dict's order, compact separators).
_HEAD = re.compile(rb'\{"op":"([A-Za-z_]{1,32})","id":(\d{1,18})[,}]')
_EMPTY_STRING = re.compile(rb'"[^"]*"')
# Only these bytes matter for counting values once the strings are known: drop the rest fast.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'",[{')


class ProtocolError(Exception):
    """The worker sent something that is not a valid frame; the channel cannot be trusted any more."""


@dataclass
class RefusedFrame:
    """A frame too large or too complex to parse: what is known of it, and why it was refused."""

    op: str | None
    id: int | None
    reason: str


def _check_frame(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise ProtocolError("frame is not a JSON object with an 'op'")
    return obj


def count_values(body: bytes) -> int:
    """An upper bound on the values in the JSON `body` that parsing would create (array items and
    object members), counting only structure outside strings. Every step is a C-speed pass."""
    quick = body.count(b",") + body.count(b"[") + body.count(b"{")
    if quick <= MAX_FRAME_VALUES:
        return quick
    # Commas inside strings (prose, CSV) do not count. With escaped backslashes and escaped quotes
    # removed, every remaining quote opens or closes a string (a backslash outside a string stops
    # the parser right there, so nothing after it costs anything).
    bare = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = bare.count(b'"') // 2
    if strings > 2 * MAX_FRAME_VALUES + 2:  # each value holds at most two strings (key and value)
        return strings // 2
    return len(_EMPTY_STRING.sub(b"", bare.translate(None, _NOT_STRUCTURE)))


def refusal(head: bytes, reason: str) -> RefusedFrame:
    match = _HEAD.match(head)
    if match is None:
        return RefusedFrame(None, None, reason)
    return RefusedFrame(match.group(1).decode(), int(match.group(2)), reason)


def parse_body(body: bytes) -> dict[str, Any] | RefusedFrame:
    """One frame's JSON, or a RefusedFrame when it has too many values or is nested too deep."""
    values = count_values(body)
    if values > MAX_FRAME_VALUES:
        return refusal(
            body[:_HEAD_BYTES], f"about {values:,} JSON values; the limit is {MAX_FRAME_VALUES:,} per message"
        )
    try:
        obj = _check_frame_text(str(body, "utf-8", "surrogatepass"))
    except RecursionError:
        return refusal(body[:_HEAD_BYTES], "nested too deeply")
    return obj


def _check_frame_text(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    return _check_frame(obj)


def _too_large(size: int | None = None) -> str:
    what = f"{size:,} bytes" if size is not None else f"over {MAX_HOST_FRAME_BYTES:,} bytes"
    return f"{what}; the limit is {MAX_HOST_FRAME_BYTES:,} per message"


def announced(buf: bytearray) -> int | None:
    """The length the next frame in `buf` announces (4 bytes, big-endian), None until they are in.
    A length past MAX_FRAME_BYTES is a ProtocolError: no end of any channel sends one."""
    if len(buf) < 4:
        return None
    size = int.from_bytes(buf[:4], "big")
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size:,} bytes announced; the limit is {MAX_FRAME_BYTES:,}")
    return size


class FrameDecoder:
    """Length-prefixed frames (4-byte big-endian length, UTF-8 JSON), one at a time."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skip = 0  # bytes still to drop of a refused oversized frame
        self._refused: RefusedFrame | None = None  # handed out once its bytes are dropped
        self.last_size = 0  # bytes of the frame `pop` returned last

    def push(self, data: bytes) -> None:
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = data[dropped:]
        self._buf += data

    def unread(self) -> int:
        """Bytes received and not yet handed out."""
        return len(self._buf)

    def pop(self) -> bytes | RefusedFrame | None:
        """The next whole frame's body (or refusal), None until one is complete."""
        if self._refused is not None:
            if self._skip:
                return None
            refused, self._refused = self._refused, None
            return refused
        buf = self._buf
        size = announced(buf)
        if size is None:
            return None
        if size > MAX_HOST_FRAME_BYTES:
            if len(buf) < 4 + _HEAD_BYTES:
                return None
            self._refused = refusal(bytes(buf[4 : 4 + _HEAD_BYTES]), _too_large(size))
            self.last_size = 0  # never held
            taken = min(len(buf) - 4, size)
            del buf[: 4 + taken]
            self._skip = size - taken
            return self.pop()
        if len(buf) < 4 + size:
            return None
        body = bytes(buf[4 : 4 + size])
        del buf[: 4 + size]
        self.last_size = size
        return body

    def next_frame(self) -> dict[str, Any] | RefusedFrame | None:
        item = self.pop()
        return parse_body(item) if isinstance(item, bytes) else item

    def feed(self, data: bytes) -> list[dict[str, Any] | RefusedFrame]:
        """Every frame completed by `data` (for tests and simple readers)."""
        self.push(data)
        frames = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames


class LineDecoder(FrameDecoder):
    """Line framing: one JSON object per line."""

    def __init__(self) -> None:
        super().__init__()
        self._scanned = 0  # where to look for the next newline
        self._dropping: bytes | None = None  # head of an overlong line being dropped

    def push(self, data: bytes) -> None:
        if self._dropping is not None:
            end = data.find(b"\n")
            if end < 0:
                return
            self._refused = refusal(self._dropping, _too_large())
            self._dropping = None
            data = data[end + 1 :]
        self._buf += data

    def pop(self) -> bytes | RefusedFrame | None:
        if self._refused is not None:
            refused, self._refused = self._refused, None
            return refused
        buf = self._buf
        while True:
            end = buf.find(b"\n", self._scanned)
            if end < 0:
                self._scanned = len(buf)
                if len(buf) > MAX_HOST_FRAME_BYTES:
                    self._dropping = bytes(buf[:_HEAD_BYTES])
                    buf.clear()
                    self._scanned = 0
                return None
            line = bytes(buf[:end]).strip()
            del buf[: end + 1]
            self._scanned = 0
            if len(line) > MAX_HOST_FRAME_BYTES:
                return refusal(line[:_HEAD_BYTES], _too_large(len(line)))
            if line:
                self.last_size = len(line)
                return line
