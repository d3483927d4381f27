"""What the episodes of one environment share: per-event-loop clients and fork server, and a private
event loop for the blocking API (the REPL quota is quota.py).

A trainer runs hundreds of episodes in one process. Each has its own budget, sandbox and trace, but
they share one HTTP connection pool per model and one warm zygote to fork REPLs from; both are bound
to the event loop that first used them, so they are kept per loop.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from recursa import sync
from recursa.errors import RecursaError
from recursa.lm.base import LMClient
from recursa.sandbox.forkserver import ForkServer

T = TypeVar("T")


class EnvError(RecursaError, ValueError):
    """An environment or episode was used in a way that cannot work; the message says the fix."""


class ReplyRefused(EnvError):
    """The trainer's reply was refused before anything ran (not text, or over `max_reply_chars`):
    the episode is unchanged. `too_long` holds the reply's length when that was the reason."""

    def __init__(self, message: str, too_long: int | None = None) -> None:
        super().__init__(message)
        self.too_long = too_long


@dataclass
class LoopResources:
    clients: dict[str, LMClient] = field(default_factory=dict)
    fork_server: ForkServer | None = None


class PerLoop:
    """Clients and a fork server for each event loop the environment's episodes run on."""

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopResources] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def here(self) -> LoopResources:
        loop = asyncio.get_running_loop()
        with self._lock:
            found = self._by_loop.get(loop)
            if found is None:
                found = self._by_loop[loop] = LoopResources()
            return found

    async def aclose_here(self) -> None:
        """Close what this loop's episodes shared (after they are closed: forked REPLs end with it)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            found = self._by_loop.pop(loop, None)
        if found is None:
            return
        for client in found.clients.values():
            await client.aclose()
        if found.fork_server is not None:
            await found.fork_server.close()


@dataclass
class EpisodeHost:
    """What an episode needs of its environment (so episode.py does not import env.py)."""

    private: PrivateLoop
    max_reply_chars: int
    forget: Callable[[Any], None]  # an episode that ended leaves the environment's open set


class PrivateLoop(sync.PrivateLoop):
    """The environment's loop for `start_sync` / `step_sync` (recursa/sync.py), its errors EnvErrors."""

    def __init__(self) -> None:
        super().__init__("recursa-env")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return super().run(coro)
        except sync.BlockingCallOnLoop:
            raise EnvError("a blocking call (…_sync) was made from the environment's own loop; await it") from None
        except sync.LoopStopped:
            raise EnvError(
                "the environment was closed (env.close()) while this blocking call ran, e.g. a "
                "start_sync waiting for a REPL slot; close the environment after its last episode"
            ) from None
