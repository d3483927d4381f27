"""A whole JSON answer sent straight through ASGI, for middleware that refuses a request before the
app sees it (caps, deadlines, shares, origins)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_json(
    send: Send, status: int, payload: Any, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer with `status` and `payload` as JSON (its length given), then `headers`."""
    body = json.dumps(payload).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})
