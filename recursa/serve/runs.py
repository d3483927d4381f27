"""One RLM run started on behalf of a client: its events on a queue, its result, and a way to stop it.

Both servers (OpenAI-compatible HTTP and MCP) use this, so cancelling a run always goes through
the same path: the task is cancelled, the engine records `stop_reason="cancelled"`, and
`RLM.arun` reaps every REPL process of the tree before `LiveRun.cancel()` returns. A run that is
one question of a server session asks that session instead; a cancelled question leaves the
session's REPL running for the next one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from recursa.config import Spelling
from recursa.result import RLMResult
from recursa.rlm import RLM
from recursa.serve.request import REQUEST_SPELLING
from recursa.serve.settings import EventCallback, ServeSettings

_DONE: dict[str, Any] = {"type": "__done__"}


@dataclass
class RunSpec:
    question: str
    context: Any
    # From the request's standard fields (recursa.serve.fields): the answer's JSON Schema, what the
    # root is told about the answer, and sampling options for the root model's own calls.
    answer_schema: dict[str, Any] | None = None
    tips: str | None = None
    root_sampling: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # a client's run settings, checked
    # How the client wrote the run's settings (a request's `recursa` field, a tool's arguments), for
    # the messages of a setting it may fix.
    spelling: Spelling = REQUEST_SPELLING


def build_rlm(settings: ServeSettings, spec: RunSpec, on_event: Callable[[dict[str, Any]], None]) -> RLM:
    """The RLM for one request (or one session): the operator's settings, the request's limits."""
    # A client's `sampling` (spec.settings) is already merged over the operator's (overrides.py).
    options = settings.run_settings() | spec.settings
    if spec.root_sampling:
        sampling = {role: dict(opts) for role, opts in (options.get("sampling") or {}).items()}
        sampling["root"] = {**sampling.get("root", {}), **spec.root_sampling}
        options["sampling"] = sampling
    given = options | {"on_event": on_event}  # which calls the operator's too (LiveRun._on_event)
    # What fails here is a client's setting (the operator's were checked at start-up): named as the
    # client wrote it, with the operator's flag for what only the operator sets.
    return RLM.configured(given, spec.spelling)


class AskingSession(Protocol):
    """A server session a run can be one question of (`ServedSession` is the one there is); a
    protocol, so `recursa.serve.sessions` imports this module and not the other way round."""

    rlm: RLM

    async def ask(
        self, question: str, listener: EventCallback, *, tips: str | None = None, answer_schema: Any = None
    ) -> RLMResult: ...


class LiveRun:
    """Build with `LiveRun(settings, spec)` inside the event loop; `start()`; read `events()`.

    With `session`, the run is the next question of that session (`spec.context` is unused).
    """

    def __init__(self, settings: ServeSettings, spec: RunSpec, session: AskingSession | None = None) -> None:
        self.settings = settings
        self.spec = spec
        self.session = session
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.run_id: str | None = None
        self.quota = "local"  # whose share of the run slots it takes (recursa.serve.shares)
        self.task: asyncio.Task[RLMResult] | None = None
        self._finished = False
        # Built now so a bad setting (unknown model, missing price for max_usd) fails the request
        # before any answer bytes are sent.
        self.rlm = session.rlm if session is not None else build_rlm(settings, spec, self._on_event)

    def _on_event(self, event: dict[str, Any]) -> None:
        if self.run_id is None and event.get("type") == "run_start" and not event.get("parent_run_id"):
            self.run_id = event.get("run_id")
        if (operators := self.settings.run.get("on_event")) is not None:
            operators(event)
        # Events are emitted on the loop thread; a thread-safe hand-off keeps this correct should a
        # sandbox host emit from a worker thread.
        if threading.get_ident() == self._loop_thread:
            self.queue.put_nowait(event)
        else:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="recursa-serve-run")

    async def _run(self) -> RLMResult:
        try:
            spec = self.spec
            tips = _joined(self.rlm.config.tips, spec.tips)  # the operator's, or the client's own
            if self.session is not None:
                return await self.session.ask(
                    spec.question, self._on_event, tips=tips, answer_schema=spec.answer_schema
                )
            return await self.rlm.arun(
                spec.question, spec.context, tips=tips, answer_schema=spec.answer_schema
            )
        finally:
            self.queue.put_nowait(_DONE)

    async def next_batch(self) -> list[dict[str, Any]] | None:
        """The events that arrived since the last call (waiting for at least one), or None once the
        run is over and every event was handed out. Safe to cancel: nothing is lost."""
        if self._finished:
            return None
        batch = [await self.queue.get()]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        if any(e is _DONE for e in batch):
            self._finished = True
            batch = [e for e in batch if e is not _DONE]
            return batch or None
        return batch

    def events_so_far(self) -> list[dict[str, Any]]:
        """The events not handed out yet, without waiting (a non-streaming answer reads them once
        the run is over)."""
        out: list[dict[str, Any]] = []
        while not self.queue.empty():
            event = self.queue.get_nowait()
            if event is not _DONE:
                out.append(event)
        return out

    async def cancel(self) -> None:
        """Stop the run and wait until its sandboxes are reaped."""
        if self.task is None or self.task.done():
            return
        self.task.cancel()
        # wait() rather than `await task`: the run's CancelledError is its own, while a
        # cancellation of the caller must still propagate.
        await asyncio.wait({self.task})


def _joined(*tips: str | None) -> str | None:
    """The operator's tips and a request's (an answer-length limit), both kept."""
    kept = [t.strip() for t in tips if t and t.strip()]
    return "\n\n".join(kept) if kept else None
