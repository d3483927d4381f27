"""How many connections the trace viewer holds at once, and how long a request head may take.

The viewer gives each connection a thread, and its socket timeout closes one that goes silent;
but one that sent a byte of its head now and then kept its thread for good, and nothing bounded
how many there were: thousands of them took the process's threads and descriptors, and the user's
own browser got no page. So at most `total` connections are open at once, and at most a quarter of
them from one address other than loopback (loopback is this machine's programs, the user's browser
among them, which the viewer cannot tell apart). At either bound a new connection takes the place
of the oldest one still waiting for its request head, and is refused only when every one is busy
answering (each answer is bounded by the socket timeout). A head still incomplete `head_timeout_s`
after its connection opened is dropped at the next connection's arrival, whatever the bounds.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from recursa.addresses import is_loopback_name


@dataclass
class _Open:
    address: str
    opened: float
    head_done: bool = False


class ConnectionGate:
    """The viewer's open connections, oldest first (see the module doc)."""

    def __init__(self, total: int, head_timeout_s: float) -> None:
        self.total = total
        self.per_address = max(1, total // 4)
        self.head_timeout_s = head_timeout_s
        self._open: dict[socket.socket, _Open] = {}  # insertion order: oldest first
        self._lock = threading.Lock()

    def admit(self, sock: socket.socket, address: str) -> bool:
        with self._lock:
            late = time.monotonic() - self.head_timeout_s
            for old in [s for s, o in self._open.items() if not o.head_done and o.opened < late]:
                self._drop(old)
            if not is_loopback_name(address):
                mine = [s for s, o in self._open.items() if o.address == address]
                if len(mine) >= self.per_address and not self._make_room(mine):
                    return False
            if len(self._open) >= self.total and not self._make_room(list(self._open)):
                return False
            self._open[sock] = _Open(address, time.monotonic())
            return True

    def head_done(self, sock: socket.socket) -> None:
        with self._lock:
            held = self._open.get(sock)
            if held is not None:
                held.head_done = True

    def leave(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.pop(sock, None)

    def _make_room(self, among: list[socket.socket]) -> bool:
        waiting = next((s for s in among if not self._open[s].head_done), None)
        if waiting is None:
            return False
        self._drop(waiting)
        return True

    def _drop(self, sock: socket.socket) -> None:
        """Close a connection that is waiting for its head: its thread's read ends at once."""
        del self._open[sock]
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # it closed meanwhile
            pass
