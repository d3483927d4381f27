"""How many chat requests a server holds at once: the runs it has slots for, plus a bounded queue.

`max_runs` bounds the runs going at once, but a request waiting for a slot already holds its body
(up to `max_context_bytes`) and any context it fetched, and nothing bounded how many could wait: a
client opening thousands of requests could fill the server's memory before one of them ran. So a
chat request past `max_runs + max_waiting` in progress is answered 429 at once, before its body is
read. A request counts from its first byte to its last (a streamed answer included), so the count
cannot leak whatever way a request ends.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CHAT_PATH = "/v1/chat/completions"


class AdmissionLimit:
    """ASGI middleware: at most `limit` chat requests in progress; more get 429 with Retry-After."""

    def __init__(self, app: ASGIApp, *, limit: int, retry_after_s: int = 1) -> None:
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.limit:
            await self._busy(send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1

    async def _busy(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": (
                        f"this server is busy: {self.limit} chat requests are running or waiting for a run "
                        "slot, its limit (--max-runs plus --max-waiting); retry later"
                    ),
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "server_busy",
                }
            }
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.retry_after_s).encode()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
