"""A request body's JSON read with a bound on what it may become, checked before objects are built.

A body's bytes can expand many times over once parsed: a body of millions of tiny messages
(`{"role":"user","content":"x"},` is 30 bytes, a dict and two strings of some 300) took twenty
times its size in memory and held the event loop for seconds, and at the body cap (2 GiB) would
take tens of GB. So a body may hold at most `MAX_VALUES` JSON values (every object, array and
member counts) nested at most `MAX_NESTING` deep.

The bounds are told from the text before it is parsed, by `recursa.json_bounds` (a count of the
values and the nesting outside strings, in the C loops of bytes' methods); only a body within them
is parsed, by the standard library's parser, once. NaN and Infinity, which json.loads would take,
are refused: they are not JSON. What the values mean (how many messages, how many parts) is checked
after, per API.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from recursa.asgi.responses import send_json
from recursa.json_bounds import TooDeepJSON, TooMuchJSON, check_bounds

# A body past MAX_VALUES costs the reader some 0.1 s of CPU before it stops (docs/serving.md).
MAX_VALUES = 100_000
MAX_NESTING = 64
MAX_MESSAGES = 20_000  # a request's messages (Chat Completions, Messages) or input items (Responses)
MAX_PARTS = 50_000  # content parts over all of a request's messages together
# Bodies above this size are parsed on a worker thread, so other requests keep being served.
PARSE_IN_THREAD_BYTES = 1_000_000


def loads_bounded(raw: bytes) -> Any:
    """`raw` parsed as JSON (json.loads's result), or TooMuchJSON / TooDeepJSON past the bounds, or
    json.JSONDecodeError / UnicodeDecodeError for a body that is not JSON."""
    check_within(raw)
    return json.loads(raw, parse_constant=_not_json)


def check_within(raw: bytes) -> None:
    """TooMuchJSON / TooDeepJSON for a body past the bounds; nothing is built from it."""
    check_bounds(raw, MAX_VALUES, MAX_NESTING)


def _not_json(word: str) -> Any:
    raise json.JSONDecodeError(f"{word} is not a JSON value", word, 0)


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
                await asyncio.to_thread(check_within, raw)
            else:
                check_within(raw)
        except (TooMuchJSON, TooDeepJSON) as exc:
            error = f"the request body holds {exc}, past what a request may hold"
            await send_json(send, 413, {"error": error})
            return
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
                check_within(raw)
            except (TooMuchJSON, TooDeepJSON):
                closed = True
                await send(
                    {"type": "websocket.close", "code": 1009, "reason": "message past the JSON bounds"}
                )
                return {"type": "websocket.disconnect", "code": 1009}
        return message

    return bounded


def _replay(first: list[dict[str, Any]], receive: Any) -> Any:
    """A `receive` that gives `first` again, then whatever comes next."""
    queued = list(first)

    async def replayed() -> dict[str, Any]:
        return queued.pop(0) if queued else await receive()

    return replayed
