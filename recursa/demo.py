"""`recursa demo`: a complete offline RLM run over a generated long-context task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recursa.rlm import RLM
from recursa.tasks import generate


@dataclass
class DemoReport:
    family: str
    question: str
    context_chars: int
    answer: str
    expected: str
    score: float
    iterations: int
    llm_calls: int
    stop_reason: str
    trace_path: str | None
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "expected": self.expected,
            "score": self.score,
            "iterations": self.iterations,
            "llm_calls": self.llm_calls,
            "trace_path": self.trace_path,
            "family": self.family,
            "context_chars": self.context_chars,
            "stop_reason": self.stop_reason,
            "duration_s": round(self.duration_s, 3),
        }


def run_demo(rlm: RLM, family: str, size_chars: int, seed: int) -> DemoReport:
    """`rlm` (the command's, its settings named as its flags) on a task generated now."""
    task = generate(family, size_chars, seed=seed)
    result = rlm.run(task.question, task.context)
    return DemoReport(
        family=family,
        question=task.question,
        context_chars=sum(_chars(task.context)),
        answer=result.answer,
        expected=task.gold,
        score=task.score(result.answer),
        iterations=result.iterations,
        llm_calls=result.usage.llm_calls,
        stop_reason=result.stop_reason,
        trace_path=str(result.trace_path) if result.trace_path else None,
        duration_s=result.duration_s,
    )


def _chars(context: Any) -> list[int]:
    if isinstance(context, str):
        return [len(context)]
    if isinstance(context, dict):
        return [len(v) for v in context.values()]
    return [len(v) for v in context]
