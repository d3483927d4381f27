"""The fake model server's request-level state: the ledger of records, fault plans, concurrency slots.

Written on the server's event loop, read by tests from their own thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def key_digest(key: str) -> str:
    """How a request record names the API key it came with: a digest, never the key itself."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class UnknownModelError(KeyError):
    """Raised by a responder for a model it does not serve; the server answers 404."""


@dataclass
class RequestRecord:
    """What the server saw and did for one model request (chat completions or messages).

    Times are `time.perf_counter()` values: `received_at` on arrival, `started_at` when the request
    got a concurrency slot and began "generating" (equal to `finished_at` for rejected requests),
    `finished_at` when the last byte of the reply was ready. `messages` are flattened to
    {"role", "content"} strings (text blocks joined; an Anthropic `system` becomes a leading
    system message), exactly what the responder saw and the prompt tokens were counted from.
    `headers` are lower-cased, with API key values replaced by "<redacted>"; `key_digest` says
    which key came (`key_digest(key)` of the bearer or x-api-key value; None: no key).
    """

    index: int
    endpoint: str
    model: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    stream: bool = False
    tools: list[str] = field(default_factory=list)  # the names of the tools the request offered
    tool_choice: Any = None  # as the request gave it (OpenAI's or Anthropic's shape)
    max_tokens: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    received_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    reply: str | None = None
    error: str | None = None
    key_digest: str | None = None
    # Latency-model and cache accounting. `first_token_at` is a perf_counter() value (real time);
    # `virtual_arrival` is the VirtualClock reading on arrival (virtual-clock servers only).
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # Anthropic API only: the marked prefix written to the cache
    images: list[str] = field(default_factory=list)  # "sha256:<hex>" of each image's bytes, or its URL
    first_token_at: float = 0.0
    virtual_arrival: float | None = None
    cost_usd: float = 0.0
    fault: str | None = None  # the kind of the injected `Fault`, if one was

    @property
    def queue_wait_s(self) -> float:
        """Real seconds spent waiting for a concurrency slot."""
        return max(0.0, self.started_at - self.received_at)

    @property
    def ttft_s(self) -> float:
        """Real seconds from arrival to the first token (0 if none was produced)."""
        return max(0.0, self.first_token_at - self.received_at) if self.first_token_at else 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def rlm_headers(self) -> dict[str, str]:
        """The X-RLM-* attribution headers (lower-cased names)."""
        return {k: v for k, v in self.headers.items() if k.startswith("x-rlm-")}


# How long a fault plan's bare "hang" stalls: longer than any timeout a test would set.
_DEFAULT_HANG_S = 5.0
FAULT_KINDS = ("http", "reset", "cut", "hang", "malformed", "no_choices", "no_usage", "context_length")


@dataclass(frozen=True)
class Fault:
    """A failure the server injects into one request, for reliability tests.

    `kind` says what goes wrong (`delay_s` is waited first, whatever the kind):

    - "http": an error answer with `status` (and `Retry-After: retry_after_s` when that is set).
    - "reset": the TCP connection is reset before any byte of the response (nothing generated).
    - "cut": the reply is generated (and billed), its status line, headers and first `after_bytes`
      bytes are sent, then the connection closes: a body, or an SSE stream, that stops mid-way.
    - "hang": the server stalls `delay_s` seconds, then answers normally (a read timeout for a
      client whose timeout is shorter).
    - "malformed": 200 with a JSON content type and a body that is not valid JSON.
    - "no_choices": 200 with a well-formed body and usage but `choices: []` (Anthropic: `content: []`).
    - "no_usage": a normal 200 answer without its `usage` object.
    - "context_length": 400, the context-length error each API sends for a prompt that is too long.

    malformed, no_choices and no_usage shape JSON replies; a streamed request gets a normal stream
    (for no_usage, one without OpenAI's usage chunk). The classmethods spell each kind; `Fault(503)`
    is an "http" fault, as before.
    """

    status: int = 500
    retry_after_s: float | None = None  # None: no Retry-After header at all
    message: str | None = None
    delay_s: float = 0.0
    kind: str = "http"
    after_bytes: int = 64  # "cut" only

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; kinds: {', '.join(FAULT_KINDS)}")
        if self.delay_s < 0 or self.after_bytes < 0:
            raise ValueError("Fault delay_s and after_bytes must be >= 0")

    @classmethod
    def reset(cls, *, delay_s: float = 0.0) -> Fault:
        return cls(kind="reset", delay_s=delay_s)

    @classmethod
    def cut(cls, after_bytes: int = 64, *, delay_s: float = 0.0) -> Fault:
        return cls(kind="cut", after_bytes=after_bytes, delay_s=delay_s)

    @classmethod
    def hang(cls, seconds: float) -> Fault:
        return cls(kind="hang", delay_s=seconds)

    @classmethod
    def malformed(cls) -> Fault:
        return cls(kind="malformed")

    @classmethod
    def no_choices(cls) -> Fault:
        return cls(kind="no_choices")

    @classmethod
    def no_usage(cls) -> Fault:
        return cls(kind="no_usage")

    @classmethod
    def context_length(cls, message: str | None = None) -> Fault:
        return cls(status=400, kind="context_length", message=message)


FaultEntry = Fault | int | str | None
# A list indexed by request index, a {request index: entry} mapping, or a function of the record
# (which already carries index, model, messages and headers), such as a `FaultSchedule`. An int
# means Fault(status); a str is a kind with its defaults ("reset", "cut", "malformed", "hang" for 5 s...).
FaultPlan = Sequence[FaultEntry] | Mapping[int, FaultEntry] | Callable[[RequestRecord], FaultEntry]


@dataclass(frozen=True)
class FaultRule:
    """Inject `fault` into requests that match `model` (the name sent, e.g. "sub-model") and `api`
    ("openai" or "anthropic"; None: both): let the first `skip` of them through, then fault the next
    `times` (None: every one after that)."""

    fault: Fault | int | str
    model: str | None = None
    api: str | None = None
    skip: int = 0
    times: int | None = 1

    def matches(self, record: RequestRecord) -> bool:
        if self.model is not None and record.model != self.model:
            return False
        if self.api is not None and _api_of(record) != self.api:
            return False
        return True


class FaultSchedule:
    """A fault plan of `FaultRule`s, for "the 2nd and 3rd call to sub-model get 503" and the like.

    Rules are tried in order; each counts the requests it matches among those no earlier rule has
    faulted. Counts start again on `reset()` (`FakeServer.reset()` calls it).

        FaultSchedule(FaultRule(Fault(503), model="sub-model", skip=1, times=2), FaultRule("reset"))
    """

    def __init__(self, *rules: FaultRule) -> None:
        self.rules = list(rules)
        self._lock = threading.Lock()
        self._seen = [0] * len(self.rules)

    def __call__(self, record: RequestRecord) -> FaultEntry:
        with self._lock:
            for i, rule in enumerate(self.rules):
                if not rule.matches(record):
                    continue
                seen = self._seen[i]
                self._seen[i] += 1
                if seen >= rule.skip and (rule.times is None or seen < rule.skip + rule.times):
                    return rule.fault
            return None

    def reset(self) -> None:
        with self._lock:
            self._seen = [0] * len(self.rules)


def _api_of(record: RequestRecord) -> str:
    return "anthropic" if record.endpoint.endswith("/messages") else "openai"


def as_fault(entry: FaultEntry) -> Fault | None:
    if entry is None or isinstance(entry, Fault):
        return entry
    if isinstance(entry, str):
        if entry == "hang":
            return Fault.hang(_DEFAULT_HANG_S)
        return Fault(status=400, kind=entry) if entry == "context_length" else Fault(kind=entry)
    return Fault(status=int(entry))


def resolve_fault(plan: FaultPlan | None, record: RequestRecord) -> Fault | None:
    if plan is None:
        return None
    entry: FaultEntry
    if isinstance(plan, Mapping):
        entry = plan.get(record.index)
    elif callable(plan):
        entry = plan(record)
    else:
        entry = plan[record.index] if record.index < len(plan) else None
    return as_fault(entry)


class SlotGate:
    """A FIFO counting semaphore that also says how many requests are waiting (for the 429 rule).

    A released slot is handed straight to the oldest waiter, so a newcomer can never overtake the
    queue. Lives on the server's event loop only.
    """

    def __init__(self, slots: int) -> None:
        self.free = slots
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def can_enter_now(self) -> bool:
        return self.free > 0 and not self._waiters

    async def acquire(self) -> None:
        if self.can_enter_now():
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us just as we were cancelled: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class Ledger:
    """Request records and in-flight counters, written on the server loop and read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[RequestRecord] = []
        self._next_index = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def open(self, endpoint: str, headers: dict[str, str]) -> RequestRecord:
        with self._lock:
            rec = RequestRecord(self._next_index, endpoint, headers=headers, received_at=time.perf_counter())
            self._next_index += 1
            self._records.append(rec)
            return rec

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def models_seen(self) -> list[str]:
        with self._lock:
            return sorted({r.model for r in self._records if r.model})

    def reset(self) -> None:
        with self._lock:
            self._records.clear()
            self._next_index = 0
            self.max_in_flight = self.in_flight  # requests still generating keep counting
