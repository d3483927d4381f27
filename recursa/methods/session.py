"""One baseline run on the engine's own machinery: the same gateway (budget, limiter, prices,
retries), trace writer and sandboxes as an RLM run, so usage and traces compare row for row."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from recursa.config import Spelling
from recursa.configure import build_config
from recursa.errors import BudgetExceeded, ContextLengthError, LMError
from recursa.lm.base import CallMeta, Message
from recursa.loop.tree import CallTree, new_id
from recursa.methods.base import MethodResult, MethodSettings
from recursa.outcomes import Refusal, StopReason
from recursa.trace.writer import fold
from recursa.usage import Usage


class BaselineRun:
    """Async context manager: `async with BaselineRun(settings, "base", question) as run: ...`."""

    def __init__(
        self, settings: MethodSettings, method: str, question: str, tools: Sequence[Callable[..., Any]] = ()
    ) -> None:
        self.settings = settings
        self.method = method
        self.question = question
        # Host tools run on the tree's ToolRunner, as in an RLM.
        given = {**settings.run, "tools": tools}
        self.config, self.prices = build_config(
            given | {"model": settings.model, "sub_model": settings.sub_model, "max_depth": 1},
            Spelling("python", type(settings).__name__),
        )
        self.run_id = new_id("run")
        self.usage = Usage()
        self.turns = 0
        self.sub_calls = 0
        self._calls = 0
        self._started = 0.0
        self.tree: CallTree | None = None

    async def __aenter__(self) -> BaselineRun:
        self._started = time.perf_counter()
        self.tree = CallTree.create(self.config, self.prices, self.run_id)
        self.tree.trace.emit(
            "run_start",
            run_id=self.run_id,
            parent_run_id=None,
            depth=0,
            question=fold(self.question),
            model=self.config.model,
            sub_model=self.config.sub_model,
            method=self.method,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.tree is not None
        await asyncio.shield(self.tree.aclose())

    def result(
        self,
        answer: str,
        *,
        stop_reason: StopReason = "final",
        error: str | None = None,
        failure: Refusal | None = None,
    ) -> MethodResult:
        assert self.tree is not None
        latency = time.perf_counter() - self._started
        self.tree.trace.emit(
            "run_end",
            run_id=self.run_id,
            depth=0,
            stop_reason=stop_reason,
            answer=fold(answer, 20_000),
            iterations=self.turns,
            usage=self.usage.to_dict(),
            duration_s=round(latency, 6),
            error=error,
            method=self.method,
        )
        path = self.tree.trace.path
        return MethodResult(
            answer=answer,
            usage=self.usage,
            iterations=self.turns,
            sub_calls=self.sub_calls,
            stop_reason=stop_reason,
            latency_s=latency,
            trace_path=str(path) if path else None,
            error=error,
            failure=failure,
        )

    def call_failed(self, exc: BudgetExceeded | LMError, what: str) -> MethodResult:
        """The result when a model call raised, the same for every baseline so rows compare: out of
        budget, over the window (`what` names what was too long, e.g. "a part"), or another error."""
        if isinstance(exc, ContextLengthError):
            return self.result(
                "",
                stop_reason="error",
                error=f"{what} exceeds the model's window: {exc}",
                failure="context_window",
            )
        if isinstance(exc, BudgetExceeded):
            return self.result("", stop_reason="budget", error=str(exc), failure="budget")
        return self.result("", stop_reason="error", error=f"the model call failed: {exc}")

    async def call(
        self, messages: list[Message], *, sub: bool = False, new: list[Message] | None = None
    ) -> str:
        """One model call: the root's own (a turn) or a sub-call on the sub-model."""
        assert self.tree is not None
        self._calls += 1
        spec = self.config.sub_model if sub else self.config.model
        if sub:
            self.sub_calls += 1
        else:
            self.turns += 1
        meta = CallMeta(
            call_id=f"{self.run_id}.c{self._calls}",
            parent_id=self.run_id if sub else None,
            depth=1 if sub else 0,
            purpose="sub" if sub else "root",
        )
        response = await self.tree.gateway.call(
            spec,
            messages,
            meta=meta,
            run_id=self.run_id,
            max_output_tokens=self.config.max_output_tokens,
            usage_scopes=[self.usage],
            trace_messages=None if sub else (new if new is not None else messages),
        )
        return response.text

    def emit(self, kind: str, **fields: Any) -> None:
        assert self.tree is not None
        self.tree.trace.emit(kind, run_id=self.run_id, **fields)
