"""The fake server's latency model: profiles, a virtual clock, and an exact event simulation.

One model, two ways to run it:
- real time (benchmarks): each request takes a concurrency slot (FIFO), waits its time to first
  token, then decodes in steps whose duration grows with the number of requests holding a slot;
- virtual time (tests): requests are stamped with a `VirtualClock` reading on arrival and nothing
  sleeps; `simulate()` replays the same rules as a discrete-event simulation and returns exact times.

Rules (both modes):
    time to first token = queue wait + base_s + uncached prompt tokens / prefill_tokens_per_s
    seconds per output token = per_token_s * (1 + contention * (slot holders - 1))
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["PROFILES", "LatencyProfile", "SimRequest", "SimResult", "VirtualClock", "get_profile", "simulate"]


CACHE_WRITE_FACTOR = 1.25  # Anthropic's 5-minute cache writes, relative to the input rate


@dataclass(frozen=True)
class LatencyProfile:
    """How slow the fake model is. Prices are USD per million tokens (cached input at its own rate)."""

    base_s: float = 0.0
    prefill_tokens_per_s: float | None = None  # None: prefill is free
    per_token_s: float = 0.0
    contention: float = 0.0
    slots: int = 64
    max_queue: int | None = None
    max_context_tokens: int | None = None
    cache_blocks: int = 0  # prefix-cache capacity in 16-token blocks; 0: no cache
    input_per_mtok: float = 0.0
    cached_input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0

    def ttft(self, uncached_tokens: int) -> float:
        """Time to first token once the request holds a slot."""
        prefill = uncached_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        return self.base_s + prefill

    def token_s(self, holders: int) -> float:
        """Seconds per output token with `holders` requests holding a slot (at least this one)."""
        return self.per_token_s * (1.0 + self.contention * (max(holders, 1) - 1))

    def cost(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, written_tokens: int = 0
    ) -> float:
        """USD for one request; cache writes (Anthropic's) cost 1.25x input, as Anthropic's do."""
        uncached = prompt_tokens - cached_tokens - written_tokens
        return (
            uncached * self.input_per_mtok
            + cached_tokens * self.cached_input_per_mtok
            + written_tokens * self.input_per_mtok * CACHE_WRITE_FACTOR
            + completion_tokens * self.output_per_mtok
        ) / 1e6


PROFILES: dict[str, LatencyProfile] = {
    # No latency at all: unit tests of the engine.
    "instant": LatencyProfile(cache_blocks=65_536),
    # The fan-out benchmark's server (benchmarks/fanout.py): 0.2 s per request, 64 slots, nothing else.
    "fanout": LatencyProfile(base_s=0.2, slots=64, cache_blocks=65_536),
    # A small self-hosted model on one GPU, vLLM-like (prefix cache of 1M tokens).
    "vllm-small": LatencyProfile(
        base_s=0.03,
        prefill_tokens_per_s=20_000,
        per_token_s=0.01,
        contention=0.02,
        slots=64,
        max_context_tokens=131_072,
        cache_blocks=65_536,
        input_per_mtok=0.1,
        cached_input_per_mtok=0.01,
        output_per_mtok=0.4,
    ),
    # A hosted API: slower first token, many slots, priced like a mid-size model.
    "api": LatencyProfile(
        base_s=0.4,
        prefill_tokens_per_s=50_000,
        per_token_s=0.005,
        slots=512,
        max_queue=4096,
        max_context_tokens=400_000,
        cache_blocks=262_144,
        input_per_mtok=0.25,
        cached_input_per_mtok=0.025,
        output_per_mtok=2.0,
    ),
}


def get_profile(name: str, **overrides: object) -> LatencyProfile:
    try:
        profile = PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown latency profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(profile, **given) if given else profile  # type: ignore[arg-type]


class VirtualClock:
    """A clock that moves only when told to (tests stamp arrivals with it; nothing ever sleeps)."""

    def __init__(self, start: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._now = start

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a virtual clock does not go backwards")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, when: float) -> None:
        with self._lock:
            if when < self._now:
                raise ValueError("a virtual clock does not go backwards")
            self._now = when


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    uncached_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class SimResult:
    arrival: float
    started: float  # got a slot
    first_token: float
    finished: float

    @property
    def queue_wait(self) -> float:
        return self.started - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


_EPS = 1e-12


def simulate(profile: LatencyProfile, requests: Sequence[SimRequest]) -> list[SimResult]:
    """Exact times for `requests` (served FIFO by arrival, ties by position) under `profile`.

    Decode is processor sharing: between two events every decoding request advances at the same
    rate, 1 / token_s(slot holders), so the result is piecewise linear and exact up to float error.
    """
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    arrivals = deque(order)
    queue: deque[int] = deque()
    prefill_end: dict[int, float] = {}
    decoding: dict[int, float] = {}  # index -> output tokens still to produce
    started: dict[int, float] = {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    now = 0.0 if not order else requests[order[0]].arrival

    def holders() -> int:
        return len(prefill_end) + len(decoding)

    def admit() -> None:
        while queue and holders() < profile.slots:
            i = queue.popleft()
            started[i] = now
            prefill_end[i] = now + profile.ttft(requests[i].uncached_tokens)

    while arrivals or queue or prefill_end or decoding:
        step = profile.token_s(holders())
        candidates = [math.inf]
        if arrivals:
            candidates.append(requests[arrivals[0]].arrival)
        if prefill_end:
            candidates.append(min(prefill_end.values()))
        if decoding:
            candidates.append(now + min(decoding.values()) * step)
        nxt = max(min(candidates), now)
        if decoding and step > 0:
            progressed = (nxt - now) / step
            for i in decoding:
                decoding[i] -= progressed
        now = nxt
        for i in [i for i, left in decoding.items() if left <= _EPS * max(1.0, now)]:
            del decoding[i]
            done[i] = now
        for i in [i for i, end in prefill_end.items() if end <= now]:
            del prefill_end[i]
            first[i] = now
            if requests[i].output_tokens > 0 and profile.per_token_s > 0:
                decoding[i] = float(requests[i].output_tokens)
            else:
                done[i] = now
        while arrivals and requests[arrivals[0]].arrival <= now:
            queue.append(arrivals.popleft())
        admit()
    return [SimResult(requests[i].arrival, started[i], first[i], done[i]) for i in range(len(requests))]
