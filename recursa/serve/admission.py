"""How much a server takes in at once: requests that start runs (`AdmissionLimit`) and request
bodies (`BodyLimit`).

`max_runs` bounds the runs going at once, but a request waiting for a slot already holds its body
(up to `max_context_bytes`) and any context it fetched, and nothing bounded how many could wait: a
client opening thousands of requests could fill the server's memory before one of them ran. So a
request that would start a run, past `max_runs + max_waiting` in progress, is answered 429 at once,
before its body is read; and so is one past its caller's share (`runs_per_caller +
waiting_per_caller`, the caller told from the request's key alone, recursa.serve.callers), so one
caller's flood leaves the rest of the server to everyone else. A request counts from its first
byte to its last (a streamed answer included), so the counts cannot leak whatever way it ends.

`BodyLimit` caps a request body for apps that read bodies whole themselves (the MCP SDK's HTTP
transport does): a declared length over the cap is a 413 before anything is read, and a body sent
without one is cut off where it passes the cap (the app sees the client leave; the client gets 413).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from recursa.asgi.responses import send_json
from recursa.serve.api_error import MESSAGES_PATH, ApiError
from recursa.serve.observe import REQUEST_ID_KEY

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CHAT_PATH = "/v1/chat/completions"
# The endpoints that start runs, counted together.
RUN_PATHS = frozenset((CHAT_PATH, "/v1/responses", MESSAGES_PATH))


class AdmissionLimit:
    """ASGI middleware: at most `limit` requests that start runs in progress, and at most
    `per_caller` of one caller's (`caller_of(headers)`: its share's name, None for a request that
    does not authenticate, which the app refuses itself); more get 429 with Retry-After.
    `paths`: the requests that start runs (POST to them only, when `post_only`); `told`: the
    operator's flags that set `limit` and `per_caller`, as the 429 names them."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        told: tuple[str, str],
        per_caller: int | None = None,
        caller_of: Callable[[dict[bytes, bytes]], str | None] | None = None,
        paths: frozenset[str] = RUN_PATHS,
        post_only: bool = False,
        retry_after_s: int = 1,
    ) -> None:
        self.app = app
        self.limit = limit
        self.per_caller = per_caller
        self.caller_of = caller_of
        self.paths = paths
        self.post_only = post_only
        self.retry_after_s = retry_after_s
        self.told = told
        self.in_progress = 0
        self.by_caller: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("path") not in self.paths
            or (self.post_only and scope.get("method") != "POST")
        ):
            await self.app(scope, receive, send)
            return
        request_id = (scope.get("state") or {}).get(REQUEST_ID_KEY)
        if self.in_progress >= self.limit:
            await self._busy(send, scope["path"], request_id, None)
            return
        caller = None
        if self.caller_of is not None and self.per_caller is not None:
            caller = self.caller_of(dict(scope.get("headers") or []))
            if caller is not None and self.by_caller.get(caller, 0) >= self.per_caller:
                await self._busy(send, scope["path"], request_id, caller)
                return
        self.in_progress += 1
        if caller is not None:
            self.by_caller[caller] = self.by_caller.get(caller, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
            if caller is not None:
                left = self.by_caller[caller] - 1
                if left:
                    self.by_caller[caller] = left
                else:
                    del self.by_caller[caller]

    async def _busy(self, send: Send, path: str, request_id: str | None, caller: str | None) -> None:
        if caller is None:
            busy = ApiError(
                429,
                f"this server is busy: {self.limit} requests are running or waiting for a run slot, its "
                f"limit ({self.told[0]}); retry later",
                type="rate_limit_error",
                code="server_busy",
            )
        else:
            busy = ApiError(
                429,
                f"you already have {self.per_caller} requests running or waiting for a run slot, your share "
                f"of this server ({self.told[1]}); retry when one ends",
                type="rate_limit_error",
                code="caller_busy",
            )
        retry = [(b"retry-after", str(self.retry_after_s).encode())]
        await send_json(send, 429, busy.body_for(path, request_id), retry)


class BodyLimit:
    """ASGI middleware: no HTTP request body over `max_bytes` reaches the app."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        seen = 0
        refused = False
        started = False

        async def capped_receive() -> dict[str, Any]:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    if not started:
                        await self._too_large(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, capped_receive, guarded_send)

    async def _too_large(self, send: Send) -> None:
        error = f"the request body is larger than this server's limit of {self.max_bytes:,} bytes"
        await send_json(send, 413, {"error": error})
