"""A deadline on a request's body, so a client trickling its body cannot hold the server's slots.

A request that starts a run counts against the server's limits (and its caller's share) from its
first byte, and a body sent one byte every few seconds kept those counts taken for as long as its
sender liked. `BodyDeadline` gives each body `timeout_s` from the request's start plus a second for
every `BYTES_PER_SECOND` that arrived, measured on every read: a body still incomplete at its
deadline is answered 408 with `Connection: close` (or cut off, when an answer has started), and the
app reads a disconnect, as when the client leaves. Reads after the body (an app waiting for the
client to disconnect, while its run goes on) have no deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.asgi.responses import send_json

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BYTES_PER_SECOND = 1024 * 1024  # a body's deadline grows a second for every MiB that came


class BodyDeadline:
    """ASGI middleware: an HTTP request's body must arrive by its deadline (see the module doc)."""

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        received = 0
        complete = False
        expired = False
        answered = False

        async def timed_receive() -> dict[str, Any]:
            nonlocal received, complete, expired
            if expired:
                return {"type": "http.disconnect"}
            if complete:
                return await receive()
            left = started + self.timeout_s + received / BYTES_PER_SECOND - time.monotonic()
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    message = await receive()
            except TimeoutError:
                expired = True
                if not answered:
                    await self._too_slow(send)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal answered
            if expired:
                return  # the 408 was the answer
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, timed_receive, guarded_send)

    async def _too_slow(self, send: Send) -> None:
        error = {
            "message": f"the request body did not arrive in time ({self.timeout_s:g} s, plus a second "
            "per MiB received); send it at once",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
        await send_json(send, 408, {"error": error}, [(b"connection", b"close")])
