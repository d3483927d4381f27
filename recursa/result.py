"""What a run hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.outcomes import ANSWER_PROTOCOLS, STOP_REASONS, AnswerProtocol, StopReason
from recursa.usage import Usage

__all__ = ["ANSWER_PROTOCOLS", "STOP_REASONS", "AnswerProtocol", "RLMResult", "StopReason"]



@dataclass
class RLMResult:
    answer: str  # the final answer as text ("" when the run stopped without one)
    value: Any  # the answer's value (a FINAL_VAR's list or dict survives as such), else `answer`
    usage: Usage  # the whole call tree below this run
    stop_reason: StopReason
    iterations: int  # root turns taken
    trace_path: Path | None
    run_id: str
    duration_s: float = 0.0
    error: str | None = None  # why the run stopped early, for "budget", "timeout" and "error"
    answer_protocol: AnswerProtocol | None = None  # None: no answer
    isolation: dict[str, Any] = field(default_factory=dict)  # what the sandbox enforced
    # Files of a folder context that were left out, each with the reason ("x.bin (not UTF-8 text)",
    # "key (a symbolic link leading outside the allowed folder)").
    skipped_files: list[str] = field(default_factory=list)
    # The root prompt used: "default", a family variant ("qwen", "small", "claude"), "answer-dict",
    # or the template file given as RLM(prompt=...).
    prompt_variant: str | None = None
    dialect: str = "recursa"  # the conversation the root had (recursa/loop/dialects/)

    def __str__(self) -> str:
        return self.answer

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "stop_reason": self.stop_reason,
            "iterations": self.iterations,
            "usage": self.usage.to_dict(),
            "trace_path": str(self.trace_path) if self.trace_path else None,
            "run_id": self.run_id,
            "duration_s": round(self.duration_s, 4),
            "error": self.error,
            "answer_protocol": self.answer_protocol,
            "isolation": self.isolation,
            "skipped_files": self.skipped_files,
            "prompt_variant": self.prompt_variant,
            "dialect": self.dialect,
        }
