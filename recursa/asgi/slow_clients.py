"""A time limit on a request's head, and caps on connections, so slow clients cannot hold a server's
connections for good.

uvicorn times out an idle keep-alive connection, but not one whose request head arrives a byte at
a time: any byte stops the keep-alive timer, and nothing else ever closes the connection. A client
that opens thousands of such connections (no key needed: the key is in the head it never finishes)
uses up the server's file descriptors. `head_timeout_protocol(s)` is uvicorn's h11 protocol with
one more timer, started when a connection opens and after each response: if no complete request
head has arrived when it fires, the connection is closed.

The timer alone does not keep the descriptors free: reopened as fast as it closes them, half-sent
heads held the server at its descriptor limit, and most legitimate requests failed. So connections
are also capped, below the descriptor limit (`Connections`): at most `per_address` from one client
address (a new one past it is closed at once), and at most `total` in all; at the total, a new
connection takes the place of the oldest one that is waiting for a request head (a half-sent head,
an idle keep-alive), and is closed at once only when every connection is busy with a request. A
flood of heads, from one address or many, thus never keeps out a client whose request comes whole.

A client that stops reading holds the rest: a streamed answer it never takes waited in uvicorn's
write (which has no time limit) with its run slot, its share of the requests and its connection,
and a whole answer it never took stayed in the connection's buffer, for as long as the client kept
the connection open. So when the transport's buffer passes its high-water mark (the client took
too little) and has not drained below the low-water mark within `write_timeout_s`, the connection
is aborted: its buffer is dropped and the app sees the client leave (a run is cancelled, as for any
client that leaves).
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 30.0
# A reader that takes none of what the server has for it for this long is cut off (module doc).
WRITE_TIMEOUT_S = 60.0


class Connections:
    """The open connections of one server, by client address, oldest first."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total = total
        self.per_address = per_address
        # asyncio accepts up to the listen backlog's count of connections in one go, before any of
        # them reaches `admit`: a burst past the descriptors left over fails (EMFILE) and stops
        # accepting for a second. So the backlog is kept within half of what the cap leaves free.
        self.backlog = max(16, min(2048, (_descriptor_limit() - total) // 2))
        self.open: dict[_HeadTimeoutH11, str] = {}  # insertion order: oldest first
        self.by_address: Counter[str] = Counter()

    def admit(self, connection: _HeadTimeoutH11, address: str) -> bool:
        if self.by_address[address] >= self.per_address:
            return False
        if len(self.open) >= self.total:
            waiting = next((c for c in self.open if c.waiting_for_head()), None)
            if waiting is None:
                return False
            self.leave(waiting)
            waiting.transport.abort()
        self.open[connection] = address
        self.by_address[address] += 1
        return True

    def leave(self, connection: _HeadTimeoutH11) -> None:
        address = self.open.pop(connection, None)
        if address is not None:
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]


def connection_caps(total: int | None = None, per_address: int | None = None) -> tuple[int, int]:
    """(total, per address): as given, else half the process's descriptor limit (the rest is for
    REPL processes' pipes, traces, model connections) and a quarter of the total."""
    if total is None:
        total = max(16, _descriptor_limit() // 2)
    return total, per_address if per_address is not None else max(1, total // 4)


def raise_descriptor_limit(wanted: int = 65_536) -> None:
    """Lift the soft descriptor limit of a server process the CLI owns toward its hard limit (at
    most `wanted`). Many systems start processes at 1,024, which would cap a server at 512
    connections (`connection_caps`); only the hard limit is the operator's choice. A library
    caller's process is never changed: the CLI alone calls this."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a container may forbid it: the caps follow what holds
            pass


def _descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 65536


class _HeadTimeoutH11(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    write_timeout_s = WRITE_TIMEOUT_S
    caps: Connections | None = None
    _head_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        self.transport.abort()  # close() would wait for the buffer to drain, which never happens

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if self.caps is not None and not self.caps.admit(self, address):
            transport.abort()  # its descriptor is free at once; nothing was read from it
            return
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()  # the next request's head gets its own time

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        if self.caps is not None:
            self.caps.leave(self)
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # uvicorn hands the transport to a WebSocket protocol, and this one's connection_lost is
        # never called again: the connection would stay counted against its address and the total
        # after it closed (a handful of upgrade requests, no key needed, then shut that address,
        # or the whole server, out for good). It stays counted while the WebSocket is open, and
        # leaves the caps when that protocol's connection is lost.
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().handle_websocket_upgrade(event)
        websocket = self.transport.get_protocol()
        if websocket is self or self.caps is None:
            return
        caps, lost = self.caps, websocket.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            caps.leave(self)
            lost(exc)

        websocket.connection_lost = connection_lost  # type: ignore[method-assign]

    def waiting_for_head(self) -> bool:
        """No request in progress: a head still arriving, or an idle keep-alive."""
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # IDLE: h11 has not parsed a whole request head since the timer was armed.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(
    seconds: float = HEAD_TIMEOUT_S,
    *,
    max_connections: int | None = None,
    per_address: int | None = None,
    write_timeout_s: float = WRITE_TIMEOUT_S,
) -> type[_HeadTimeoutH11]:
    """uvicorn's `http=` protocol class for one server: connections whose request head takes longer
    than `seconds` to arrive are closed, connections are capped (`connection_caps`), and a client
    that takes nothing of its answer for `write_timeout_s` is cut off."""
    caps = Connections(*connection_caps(max_connections, per_address))
    fields = {"head_timeout_s": seconds, "caps": caps, "write_timeout_s": write_timeout_s}
    return type("HeadTimeoutH11Protocol", (_HeadTimeoutH11,), fields)
