"""A server without keys answers only the programs of its own machine, never a web page.

A server with no API key on 127.0.0.1 trusts whoever can connect, and a browser on that machine
can: any page it shows may send a "simple" cross-site POST (`Content-Type: text/plain`, no
preflight) or open a WebSocket to 127.0.0.1, which started runs on the operator's model key; and
a page whose own name is made to resolve to 127.0.0.1 (DNS rebinding) reads the answers too, and
whatever a run read from the operator's files. Browsers say where a request comes from, so
`LocalOnly` refuses, with 403:

- a request whose `Origin` is not a page on this machine (`http://127.0.0.1:...`, `localhost`,
  `[::1]`; `null` is refused too), HTTP and WebSocket alike;
- a request that came in on a loopback address under another name in its `Host` header (a
  rebound name), since programs on this machine name the server by a loopback name or address.

Clients that are not browsers (SDKs, curl) send no `Origin`, so nothing changes for them. A server
with keys needs none of this: a page can neither attach a key it does not know nor, without the
preflight this server never grants, a key header at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from recursa.addresses import is_loopback_name
from recursa.asgi.responses import send_json

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _hostname(authority: str) -> str | None:
    try:
        return urlsplit("//" + authority).hostname
    except ValueError:
        return None


def refusal(scope: Scope) -> str | None:
    """Why `LocalOnly` refuses the request of `scope`, or None when it may go ahead."""
    headers = dict(scope.get("headers") or [])
    origin = headers.get(b"origin")
    if origin is not None:
        text = origin.decode("latin-1").strip()
        try:
            parts = urlsplit(text)
            local = parts.scheme in ("http", "https") and is_loopback_name(parts.hostname)
        except ValueError:
            local = False
        if not local:
            return f"a web page ({text[:100]!r}) may not use this server"
    server = scope.get("server")
    if server and is_loopback_name(str(server[0])):
        host = headers.get(b"host", b"").decode("latin-1")
        if not is_loopback_name(_hostname(host)):
            return (
                "on this machine's loopback this server answers only as 127.0.0.1 or localhost, "
                f"not as {host[:100]!r}"
            )
    return None


class LocalOnly:
    """ASGI middleware: refuse browsers' requests from other origins and rebound names (module doc).
    `hint`: how the operator serves others (e.g. "start the server with --api-key")."""

    def __init__(self, app: ASGIApp, *, hint: str) -> None:
        self.app = app
        self.hint = hint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        why = refusal(scope)
        if why is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect; closed before it is accepted: a 403 to the upgrade
            await send({"type": "websocket.close", "code": 1008})
            return
        message = (
            f"{why}: a server without an API key serves no web page, nor any name its loopback "
            f"address is reached by but 127.0.0.1 and localhost; {self.hint}"
        )
        error = {"message": message, "type": "permission_error", "param": None, "code": "origin_not_allowed"}
        await send_json(send, 403, {"error": error})
