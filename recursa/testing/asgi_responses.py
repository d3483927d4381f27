"""Two ASGI responses the fake server needs beyond Starlette's: a stream that gives its concurrency
slot back however it ends, and a response that breaks its connection on purpose (injected faults)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send


class SlotStream(StreamingResponse):
    """A streaming response that gives its concurrency slot back however the stream ends.

    The slot is taken before the response exists (so a full queue can still answer 429), and a
    generator's own `finally` does not run if the client vanishes before the first chunk, so the
    release hangs on the ASGI call itself, which Starlette always makes.
    """

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _transport(receive: Receive) -> asyncio.BaseTransport | None:
    """The TCP transport under this request. ASGI has no message for "drop the connection", so the
    fake reaches under it: uvicorn's `receive` is a bound method of its per-request cycle object,
    which holds the transport."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    return transport if isinstance(transport, asyncio.BaseTransport) else None


async def _drop(receive: Receive, *, reset: bool) -> None:
    transport = _transport(receive)
    if transport is None:  # another ASGI server: the best it can do is an unfinished response
        raise ConnectionAbortedError("injected fault: the fake server cannot drop this connection")
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # A zero linger time makes the close send RST rather than FIN: a real connection reset.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    else:
        transport.close()
    # uvicorn logs an unfinished response as an error unless it has seen the connection go first.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            await receive()


class Dropped(Response):
    """A response that breaks the connection: `parts=None` resets it before any byte is sent;
    otherwise the status line, `headers` and the first `after_bytes` bytes of `parts` go out and
    then the connection closes (a body or an SSE stream that stops mid-way)."""

    def __init__(
        self,
        parts: AsyncIterator[bytes] | None,
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
        after_bytes: int = 0,
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._parts = parts
        self._head = headers or []
        self._after = after_bytes
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self._parts is None:
                await _drop(receive, reset=True)
                return
            await send({"type": "http.response.start", "status": 200, "headers": self._head})
            left = self._after
            try:
                async for chunk in self._parts:
                    piece = chunk[:left]
                    if piece:
                        await send({"type": "http.response.body", "body": piece, "more_body": True})
                        left -= len(piece)
                    if left <= 0:
                        break
            finally:
                aclose = getattr(self._parts, "aclose", None)
                if aclose is not None:
                    await aclose()
            await _drop(receive, reset=False)
        finally:
            if self._release is not None:
                self._release()


async def one_part(data: bytes) -> AsyncIterator[bytes]:
    yield data
