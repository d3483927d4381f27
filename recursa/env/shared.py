"""What the episodes of one environment share: a REPL quota, per-event-loop clients and fork server,
and a private event loop for the blocking API.

A trainer runs hundreds of episodes in one process. Each has its own budget, sandbox and trace, but
they share one HTTP connection pool per model and one warm zygote to fork REPLs from; both are bound
to the event loop that first used them, so they are kept per loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

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


class ReplsFull(EnvError):
    """`max_live_repls` REPLs are alive (and a waiting start's `wait_for_repl` ran out)."""


class ReplQuota:
    """A bound on the REPL processes alive at once across every episode of an environment.

    `take` refuses at once (a child RLM, whose parent holds a slot, must never wait for one: that
    could deadlock). `take_waiting` queues a starting episode: a slot given back goes to the
    longest-waiting start (first come, first served, on whatever event loop it waits), so a
    trainer's burst of starts beyond the bound is served in order instead of refused.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live = 0
        self._lock = threading.Lock()  # episodes on the blocking API run on another thread
        self._waiters: collections.deque[_Waiter] = collections.deque()

    def take(self) -> None:
        with self._lock:
            if self.live >= self.limit:
                raise ReplsFull(self._full())
            self.live += 1

    async def take_waiting(self, seconds: float) -> None:
        """Take a slot, waiting up to `seconds` for one in line behind earlier waiters."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.live < self.limit and not self._waiters:
                self.live += 1
                return
            waiter = _Waiter(loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter.future
        except BaseException as exc:
            with self._lock:
                granted = waiter.granted
                if not granted:
                    self._waiters.remove(waiter)
            if granted and isinstance(exc, TimeoutError):
                return  # the slot came as the time ran out: keep it
            if granted:
                self.give()  # cancelled after a slot was handed over: pass it on
            if isinstance(exc, TimeoutError):
                raise ReplsFull(f"waited {seconds:g} s for a REPL: {self._full()}") from None
            raise

    def give(self) -> None:
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                try:
                    waiter.loop.call_soon_threadsafe(_wake, waiter.future)
                except RuntimeError:  # its loop is closed: nobody is waiting there any more
                    continue
                waiter.granted = True  # the slot moves to the waiter: `live` is unchanged
                return
            self.live = max(0, self.live - 1)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _full(self) -> str:
        return (
            f"{self.live} REPLs are alive, the most RLMEnv(max_live_repls={self.limit}) allows: "
            "close finished episodes (await episode.close()), run fewer at once, raise max_live_repls, "
            "or let starts wait for a slot with RLMEnv(wait_for_repl=seconds)"
        )


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    granted: bool = False


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Prepaid:
    """One episode's share of the quota: the root's REPL slot is taken when the episode starts (its
    REPL starts in the background), so a burst of starts cannot overshoot the bound."""

    def __init__(self, quota: ReplQuota, *, taken: bool = False) -> None:
        if not taken:
            quota.take()
        self.quota = quota
        self._prepaid = True
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self._prepaid:
                self._prepaid = False
                return
        self.quota.take()

    def give(self) -> None:
        self.quota.give()

    def refund(self) -> None:
        """The episode ended before its REPL started: hand back the slot taken for it."""
        with self._lock:
            prepaid, self._prepaid = self._prepaid, False
        if prepaid:
            self.quota.give()


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


class PrivateLoop:
    """An event loop on a daemon thread, for `start_sync` / `step_sync` (works inside notebooks too)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="recursa-env", daemon=True).start()
            return self._loop

    @property
    def started(self) -> bool:
        return self._loop is not None and not self._loop.is_closed()

    def owns(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        return loop is not None and loop is self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.loop
        try:
            if asyncio.get_running_loop() is loop:
                coro.close()
                raise EnvError("a blocking call (…_sync) was made from the environment's own loop; await it")
        except RuntimeError:
            pass
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def stop(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
