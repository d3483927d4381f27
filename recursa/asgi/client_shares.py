"""What one client may hold of a server that has no keys: its WebSocket sessions and its requests in
progress, counted by client address, and how long a session may sit idle.

A keyless server tells its clients apart by address only. Each WebSocket session and each request
to `paths` in progress holds something of the server's (an OpenEnv session holds an environment
and its REPL), so one address may hold at most `per_client` of them together; past that a session
is closed at its handshake (code 1013, try again later) and a request answered 429. Loopback
addresses are this machine's own programs, which the server cannot tell apart: without an explicit
`per_client` they share the whole server (a smaller share would only leave the rest idle), and
every other address gets a quarter of `total`, at least 1.

A session whose client sends nothing for `idle_timeout_s` while the app waits for its next message
is closed (code 4408, with the reason): the app reads the client leaving, releases what the session
held, and only then is the close frame sent, so the client can reconnect at once. (OpenEnv's own idle
reaper freed the session's slot and environment but left the socket open and serving, on an
environment already closed.) The time a step takes on the server
never counts as idle.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.addresses import is_loopback_name
from recursa.asgi.responses import send_json

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

IDLE_CLOSE_CODE = 4408  # private range: 4000 + HTTP's 408 Request Timeout
BUSY_CLOSE_CODE = 1013  # "try again later"


def default_share(total: int, address: str) -> int:
    """A client address's share of `total` when the operator gave none (module doc)."""
    return total if is_loopback_name(address) else max(1, total // 4)


class ClientShares:
    """ASGI middleware: each client address holds at most its share of WebSocket sessions and
    requests to `paths` in progress together, and an idle session is closed (module doc). `flag`
    and `idle_flag` name the operator's settings of the share and the idle time, in refusals."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        total: int,
        per_client: int | None,
        idle_timeout_s: float,
        paths: frozenset[str] = frozenset(),
        flag: str,
        idle_flag: str,
    ) -> None:
        self.app = app
        self.total = total
        self.per_client = per_client
        self.idle_timeout_s = idle_timeout_s
        self.paths = paths
        self.flag = flag
        self.idle_flag = idle_flag
        self.held: Counter[str] = Counter()

    def share(self, address: str) -> int:
        return self.per_client if self.per_client is not None else default_share(self.total, address)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        counted = kind == "websocket" or (
            kind == "http" and scope.get("path") in self.paths and scope.get("method") == "POST"
        )
        if not counted:
            await self.app(scope, receive, send)
            return
        address = str((scope.get("client") or ("unknown", 0))[0])
        share = self.share(address)
        if self.held[address] >= share:
            await self._refuse(kind, share, receive, send)
            return
        self.held[address] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held[address] -= 1
                if not self.held[address]:
                    del self.held[address]

        try:
            if kind == "websocket":
                await self._session(scope, receive, send, release)
            else:
                await self.app(scope, receive, send)
        finally:
            release()

    async def _session(self, scope: Scope, receive: Receive, send: Send, release: Callable[[], None]) -> None:
        """Runs the app's session. The share comes back as soon as the app reads that its client
        left (what is left is the server's own clean-up, which OpenEnv's session count does not
        hold either), so a client that reconnects right after closing is served. An idle session's
        close frame is sent only once the app has returned, its episode released, for the same
        reason."""
        idle_close: dict[str, Any] | None = None

        async def idle_receive() -> dict[str, Any]:
            nonlocal idle_close
            if idle_close is not None:
                return {"type": "websocket.disconnect", "code": IDLE_CLOSE_CODE}
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    message = await receive()
            except TimeoutError:
                reason = f"idle for {self.idle_timeout_s:g} s: closed ({self.idle_flag}); reconnect"
                idle_close = {"type": "websocket.close", "code": IDLE_CLOSE_CODE, "reason": reason}
                return {"type": "websocket.disconnect", "code": IDLE_CLOSE_CODE}
            if message.get("type") == "websocket.disconnect":
                release()
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if idle_close is None:  # after the idle close, the app's own close frame is replaced by ours
                await send(message)

        await self.app(scope, idle_receive, guarded_send)
        if idle_close is not None:
            release()
            try:
                await send(idle_close)
            except Exception:  # the client left meanwhile: nothing is owed to it
                pass

    async def _refuse(self, kind: str, share: int, receive: Receive, send: Send) -> None:
        if kind == "http":
            message = (
                f"this address already holds {share} sessions or requests, its share of this server "
                f"({self.flag}); retry when one ends"
            )
            error = {"error": {"message": message, "type": "rate_limit_error", "code": "client_busy"}}
            await send_json(send, 429, error, [(b"retry-after", b"1")])
            return
        if (await receive()).get("type") != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        reason = f"this address holds {share} sessions, its share ({self.flag}); close one"
        await send({"type": "websocket.close", "code": BUSY_CLOSE_CODE, "reason": reason[:120]})
