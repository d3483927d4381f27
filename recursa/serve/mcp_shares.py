"""Each caller's share of the MCP SDK's transport sessions, for `recursa mcp --http`.

Every `initialize` request opens a transport session in the SDK (one per connected client, some
40 KB), kept until the client ends it or it has been idle for the SDK's idle timeout. The SDK caps
them for the whole server only (`max_sessions`): one key opening sessions as fast as it could took
them all, and every other client's `initialize` was refused for half an hour. So a caller
(recursa.serve.callers.quota_of: its key, whatever X-Recursa-Client it sends) may hold at most its
share of them (`ServeSettings.mcp_sessions_per_caller`); past it, its next `initialize` is a 429.

The count follows the SDK's rules: a session is the caller's from the response that gave its id,
and leaves the count when the client deletes it or when no request of it has been in progress for
the idle timeout (then the SDK has closed it too).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recursa.asgi.responses import send_json
from recursa.serve.admission import ASGIApp, Receive, Scope, Send

SESSION_HEADER = b"mcp-session-id"


@dataclass
class _Session:
    quota: str
    last_seen: float
    in_progress: int = 0


class TransportSessionShares:
    """ASGI middleware (see the module doc): `caller_of(headers)` names a request's share (None for
    one that does not authenticate); `idle_s` is the SDK's session idle timeout."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        per_caller: int,
        caller_of: Callable[[dict[bytes, bytes]], str | None],
        idle_s: float,
    ) -> None:
        self.app = app
        self.per_caller = per_caller
        self.caller_of = caller_of
        self.idle_s = idle_s
        self.sessions: dict[str, _Session] = {}
        self.held: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        known = self.sessions.get(headers.get(SESSION_HEADER, b"").decode("latin-1"))
        if known is not None:
            await self._in_session(known, headers, scope, receive, send)
            return
        quota = self.caller_of(headers) if SESSION_HEADER not in headers else None
        if quota is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        self._expire(time.monotonic())  # only an opening adds to the table: it is swept then
        if self.held[quota] >= self.per_caller:
            await self._refuse(send)
            return

        # The opening holds a place from now, so that openings sent at once cannot pass the share
        # together; it becomes the session's place, or is given back if no session came of it.
        self.held[quota] += 1
        opened = False

        async def opening_send(message: dict[str, Any]) -> None:
            nonlocal opened
            if message["type"] == "http.response.start" and message.get("status", 500) < 400:
                given = dict(message.get("headers") or []).get(SESSION_HEADER)
                if given and not opened:
                    self.sessions[given.decode("latin-1")] = _Session(quota, time.monotonic())
                    opened = True
            await send(message)

        try:
            await self.app(scope, receive, opening_send)
        finally:
            if not opened:
                self._release(quota)

    async def _in_session(
        self, session: _Session, headers: dict[bytes, bytes], scope: Scope, receive: Receive, send: Send
    ) -> None:
        status = 500

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message.get("status", 500)
            await send(message)

        session.in_progress += 1
        try:
            await self.app(scope, receive, watched_send)
        finally:
            session.in_progress -= 1
            session.last_seen = time.monotonic()
            if scope.get("method") == "DELETE" and status < 400:
                self._forget(headers[SESSION_HEADER].decode("latin-1"))

    def _expire(self, now: float) -> None:
        idle = [
            sid for sid, s in self.sessions.items() if not s.in_progress and now - s.last_seen > self.idle_s
        ]
        for sid in idle:
            self._forget(sid)

    def _forget(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self._release(session.quota)

    def _release(self, quota: str) -> None:
        self.held[quota] -= 1
        if not self.held[quota]:
            del self.held[quota]

    async def _refuse(self, send: Send) -> None:
        message = (
            f"you already have {self.per_caller} MCP sessions open, your share of this server; close one "
            "(DELETE with its Mcp-Session-Id) or reuse it, or wait until an idle one times out"
        )
        refusal = {"jsonrpc": "2.0", "id": None, "error": {"code": -32000, "message": message}}
        await send_json(send, 429, refusal, [(b"retry-after", b"60")])
