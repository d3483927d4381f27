"""How many model calls may be in flight at once, overall and per model, and how fast they may start.

One `Limiter` is shared by a whole RLM call tree, so a fan-out of 1,000 sub-calls at any depth waits
in one FIFO queue instead of flooding the provider.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _LoopState:
    """The asyncio primitives of one event loop (they cannot be shared between loops)."""

    global_sem: asyncio.Semaphore
    model_sems: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    next_start: dict[str, float] = field(default_factory=dict)  # RPM pacing: earliest next start


class Limiter:
    """Caps concurrent model calls: ``async with limiter.slot("openai/gpt-5-mini"): ...``.

    ``per_model`` and ``requests_per_minute`` are keyed by "provider/model" or by the bare model
    name. Waiters are served first come, first served (asyncio.Semaphore is FIFO). Limits hold per
    event loop: a Limiter built outside any loop works in whichever loop uses it, and can be
    reused by successive ``asyncio.run`` calls (each gets its own primitives).
    """

    def __init__(
        self,
        max_concurrency: int = 64,
        per_model: dict[str, int] | None = None,
        requests_per_minute: dict[str, int] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        for name, table in (("per_model", per_model), ("requests_per_minute", requests_per_minute)):
            for key, value in (table or {}).items():
                if value < 1:
                    raise ValueError(f"{name}[{key!r}] must be at least 1, got {value}")
        self.max_concurrency = max_concurrency
        self.per_model = dict(per_model or {})
        self.requests_per_minute = dict(requests_per_minute or {})
        self._clock = clock
        self._sleep = sleep
        # Why per loop: asyncio primitives bind to the first loop they wait in (Python 3.10+), and
        # a limiter reused by a second asyncio.run() would then raise "bound to a different loop".
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self.in_flight = 0
        self.max_in_flight = 0
        self._model_in_flight: dict[str, int] = {}
        self._model_max: dict[str, int] = {}

    @staticmethod
    def _lookup(table: dict[str, int], key: str) -> tuple[str, int] | None:
        """(the configured key that applies, its value): "provider/model" first, then the bare name."""
        if key in table:
            return key, table[key]
        bare = key.split("/", 1)[1] if "/" in key else None
        if bare is not None and bare in table:
            return bare, table[bare]
        return None

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = _LoopState(asyncio.Semaphore(self.max_concurrency))
            self._states[loop] = state
        return state

    async def _pace(self, state: _LoopState, key: str) -> None:
        found = self._lookup(self.requests_per_minute, key)
        if found is None:
            return
        key, rpm = found
        # Even spacing: each caller books the next free start time, then sleeps until it. Booking
        # happens before any await, so starts are spaced 60/rpm apart in arrival order.
        now = self._clock()
        start = max(now, state.next_start.get(key, now))
        state.next_start[key] = start + 60.0 / rpm
        if start > now:
            await self._sleep(start - now)

    def slot(self, model_key: str) -> _Slot:
        """Hold one global slot and, if ``model_key`` has a limit, one slot of that model."""
        return _Slot(self, model_key)

    def _enter(self, key: str) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        n = self._model_in_flight.get(key, 0) + 1
        self._model_in_flight[key] = n
        self._model_max[key] = max(self._model_max.get(key, 0), n)

    def _exit(self, key: str) -> None:
        self.in_flight -= 1
        self._model_in_flight[key] -= 1

    def in_flight_for(self, model_key: str) -> int:
        return self._model_in_flight.get(model_key, 0)

    def max_in_flight_for(self, model_key: str) -> int:
        """The most calls to ``model_key`` that were ever in flight at once."""
        return self._model_max.get(model_key, 0)


class _Slot:
    """One hold on a limiter, for `async with`. A plain class rather than an @asynccontextmanager:
    every model call takes one, and the generator-based form costs each call a generator, a wrapper
    object and two more frames, on the fan-out's critical path."""

    __slots__ = ("_held", "_key", "_limiter")

    def __init__(self, limiter: Limiter, model_key: str) -> None:
        self._limiter = limiter
        self._key = model_key
        self._held: tuple[asyncio.Semaphore, asyncio.Semaphore | None] | None = None

    async def __aenter__(self) -> None:
        limiter, model_key = self._limiter, self._key
        state = limiter._state()
        if limiter.requests_per_minute:
            await limiter._pace(state, model_key)
        model_sem = None
        found = limiter._lookup(limiter.per_model, model_key) if limiter.per_model else None
        if found is not None:
            # Keyed by the configured name, so "gpt-5-mini" caps "openai/gpt-5-mini" as one pool.
            cap_key, cap = found
            model_sem = state.model_sems.get(cap_key)
            if model_sem is None:
                model_sem = state.model_sems[cap_key] = asyncio.Semaphore(cap)
        # Model slot first, then the global one: a call queued behind its own model's cap must not
        # sit on a global slot that calls to other models could use. Everyone acquires in this
        # order, so there is no deadlock.
        if model_sem is not None:
            await model_sem.acquire()
        try:
            await state.global_sem.acquire()
        except BaseException:
            if model_sem is not None:
                model_sem.release()
            raise
        limiter._enter(model_key)
        self._held = (state.global_sem, model_sem)

    async def __aexit__(self, *exc_info: object) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        self._limiter._exit(self._key)
        global_sem, model_sem = held
        global_sem.release()
        if model_sem is not None:
            model_sem.release()
