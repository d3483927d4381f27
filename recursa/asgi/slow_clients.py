"""A time limit on a request's head, so slow clients cannot hold a server's connections for good.

uvicorn times out an idle keep-alive connection, but not one whose request head arrives a byte at
a time: any byte stops the keep-alive timer, and nothing else ever closes the connection. A client
that opens thousands of such connections (no key needed: the key is in the head it never finishes)
uses up the server's file descriptors. `head_timeout_protocol(s)` is uvicorn's h11 protocol with
one more timer, started when a connection opens and after each response: if no complete request
head has arrived when it fires, the connection is closed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 30.0


class _HeadTimeoutH11(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()  # the next request's head gets its own time

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # IDLE: h11 has not parsed a whole request head since the timer was armed.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(seconds: float = HEAD_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's `http=` protocol class closing connections whose request head takes longer than
    `seconds` to arrive."""
    return type("HeadTimeoutH11Protocol", (_HeadTimeoutH11,), {"head_timeout_s": seconds})
