"""A request body's JSON read with a bound on what it may become, checked before objects are built.

A body's bytes can expand many times over once parsed: a body of millions of tiny messages
(`{"role":"user","content":"x"},` is 30 bytes, a dict and two strings of some 300) took twenty
times its size in memory and held the event loop for seconds, and at the body cap (2 GiB) would
take tens of GB. So a body may hold at most `MAX_VALUES` JSON values (every object, array and
member counts) nested at most `MAX_NESTING` deep, and the reader stops at the first value past
either bound, having built no more than that many.

Two paths, one rule: a body whose every `,`, `[` and `{` (those inside strings too, an upper
bound) stays within the bounds cannot pass them, and goes to the standard library's parser (C);
any other body (a large document full of commas, or a flood of values) is read by `_Reader`, which
counts as it goes, reads strings with the standard library's C string scanner and stops at the
bound. What the values mean (how many messages, how many parts) is checked after, per API.
"""

from __future__ import annotations

import asyncio
import json
import re
from json.decoder import scanstring
from typing import Any

from recursa.asgi.responses import send_json

# A body past MAX_VALUES costs the reader some 0.3 s of CPU before it stops (docs/serving.md).
MAX_VALUES = 100_000
MAX_NESTING = 64
MAX_MESSAGES = 20_000  # a request's messages (Chat Completions, Messages) or input items (Responses)
MAX_PARTS = 50_000  # content parts over all of a request's messages together
# Bodies above this size are parsed on a worker thread, so other requests keep being served.
PARSE_IN_THREAD_BYTES = 1_000_000

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_CONSTANTS: dict[str, Any] = {
    "null": None,
    "true": True,
    "false": False,
    "NaN": float("nan"),
    "Infinity": float("inf"),
    "-Infinity": float("-inf"),
}


class TooMuchJSON(ValueError):
    """The body holds more values than a request may."""


class TooDeepJSON(ValueError):
    """The body nests arrays and objects deeper than a request may."""


def loads_bounded(raw: bytes) -> Any:
    """`raw` parsed as JSON (json.loads's result), or TooMuchJSON past the bounds, or
    json.JSONDecodeError / UnicodeDecodeError for a body that is not JSON."""
    if raw.count(b"[") + raw.count(b"{") + raw.count(b",") < MAX_VALUES:
        value = json.loads(raw)
        _check_nesting(value)
        return value
    return _Reader(raw.decode("utf-8")).document()


def _check_nesting(value: Any) -> None:
    """TooMuchJSON when `value` nests deeper than MAX_NESTING (the same bound the reader keeps)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth >= MAX_NESTING:
            raise TooDeepJSON(f"JSON nested more than {MAX_NESTING} deep")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


_SPACE = frozenset(" \t\n\r")


class _Reader:
    """JSON as json.loads reads it (the same values, NaN and Infinity included, the last of a
    repeated key kept), counting every value and stopping at the bounds."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.left = MAX_VALUES

    def document(self) -> Any:
        value, end = self.value(self.skip(0), 0)
        if self.skip(end) != len(self.text):
            raise json.JSONDecodeError("Extra data", self.text, end)
        return value

    def skip(self, at: int) -> int:
        if self.text[at : at + 1] in _SPACE:
            return _WHITESPACE.match(self.text, at).end()  # type: ignore[union-attr]
        return at

    def value(self, at: int, depth: int) -> tuple[Any, int]:
        self.left -= 1
        if self.left < 0:
            raise TooMuchJSON(f"more than {MAX_VALUES:,} JSON values")
        text = self.text
        char = text[at : at + 1]
        if char == '"':
            return scanstring(text, at + 1)
        if char == "{" or char == "[":
            if depth >= MAX_NESTING:
                raise TooDeepJSON(f"JSON nested more than {MAX_NESTING} deep")
            return self.object(at + 1, depth + 1) if char == "{" else self.array(at + 1, depth + 1)
        number = _NUMBER.match(text, at)
        if number is not None:
            whole, fraction, exponent = number.groups()
            if fraction or exponent:
                return float(whole + (fraction or "") + (exponent or "")), number.end()
            return int(whole), number.end()
        for word, constant in _CONSTANTS.items():
            if text.startswith(word, at):
                return constant, at + len(word)
        raise json.JSONDecodeError("Expecting value", text, at)

    def array(self, at: int, depth: int) -> tuple[list[Any], int]:
        text, skip, value, items = self.text, self.skip, self.value, []
        at = skip(at)
        if text[at : at + 1] == "]":
            return items, at + 1
        while True:
            item, at = value(at, depth)
            items.append(item)
            at = skip(at)
            char = text[at : at + 1]
            if char == "]":
                return items, at + 1
            if char != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
            at = skip(at + 1)

    def object(self, at: int, depth: int) -> tuple[dict[str, Any], int]:
        text, skip, value, members = self.text, self.skip, self.value, {}
        at = skip(at)
        if text[at : at + 1] == "}":
            return members, at + 1
        while True:
            if text[at : at + 1] != '"':
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
            key, at = scanstring(text, at + 1)
            at = skip(at)
            if text[at : at + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
            members[key], at = value(skip(at + 1), depth)
            at = skip(at)
            char = text[at : at + 1]
            if char == "}":
                return members, at + 1
            if char != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
            at = skip(at + 1)


def shape_problem(body: Any) -> tuple[str, str] | None:
    """(field, what is too much) when a parsed request holds more messages or content parts than a
    request may; None when it is within the bounds. `messages` (Chat Completions, Messages) and
    `input` (Responses) are where each API keeps them."""
    if not isinstance(body, dict):
        return None
    for field in ("messages", "input"):
        items = body.get(field)
        if not isinstance(items, list):
            continue
        if len(items) > MAX_MESSAGES:
            return field, f"{len(items):,} messages, over the limit of {MAX_MESSAGES:,}"
        parts = sum(
            len(m["content"]) for m in items if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
        if parts > MAX_PARTS:
            return field, f"{parts:,} content parts in all, over the limit of {MAX_PARTS:,}"
    return None


class JSONBounds:
    """ASGI middleware for apps that parse JSON bodies themselves (the MCP SDK's HTTP transport,
    OpenEnv's server): a body past the bounds is a 413 before the app builds anything from it. The
    body is read whole (cap its size outside, with recursa.serve.admission.BodyLimit) and handed on
    unchanged. A WebSocket message past them closes its connection (1009, too big) instead of
    reaching the app (the server's `ws_max_size` caps its bytes)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await self.app(scope, _bounded_messages(receive, send), send)
            return
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            if len(raw) > PARSE_IN_THREAD_BYTES:  # the loop serves every other request meanwhile
                await asyncio.to_thread(loads_bounded, raw)
            else:
                loads_bounded(raw)
        except (TooMuchJSON, TooDeepJSON) as exc:
            error = f"the request body holds {exc}, past what a request may hold"
            await send_json(send, 413, {"error": error})
            return
        except (ValueError, RecursionError):
            pass  # not JSON: the app says so in its own words
        await self.app(
            scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send
        )


def _bounded_messages(receive: Any, send: Any) -> Any:
    """A WebSocket `receive` whose messages past the JSON bounds close the connection."""
    closed = False

    async def bounded() -> dict[str, Any]:
        nonlocal closed
        if closed:
            return {"type": "websocket.disconnect", "code": 1009}
        message = await receive()
        if message["type"] == "websocket.receive":
            data = message.get("text")
            raw = data.encode("utf-8", "surrogatepass") if data is not None else message.get("bytes") or b""
            try:
                loads_bounded(raw)
            except (TooMuchJSON, TooDeepJSON):
                closed = True
                await send(
                    {"type": "websocket.close", "code": 1009, "reason": "message past the JSON bounds"}
                )
                return {"type": "websocket.disconnect", "code": 1009}
            except (ValueError, RecursionError):
                pass  # not JSON: the app says so in its own words
        return message

    return bounded


def _replay(first: list[dict[str, Any]], receive: Any) -> Any:
    """A `receive` that gives `first` again, then whatever comes next."""
    queued = list(first)

    async def replayed() -> dict[str, Any]:
        return queued.pop(0) if queued else await receive()

    return replayed
