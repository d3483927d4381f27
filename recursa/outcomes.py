"""How a run ends and how its calls fail, as the closed sets of values results and traces carry
(and users may match on)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ANSWER_PROTOCOLS",
    "BUDGET_LIMITS",
    "ERROR_KINDS",
    "STOP_REASONS",
    "AnswerProtocol",
    "BudgetLimit",
    "ErrorKind",
    "Refusal",
    "StopReason",
]

# Why a run stopped; the same values in RLMResult.stop_reason and the trace's run_end events.
# "context_window": the root's next call could not fit its model's window, even after compaction.
StopReason = Literal["final", "max_iterations", "budget", "timeout", "error", "cancelled", "context_window"]
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)
# How the answer was given: FINAL(...), FINAL_VAR(name), the answer dict, the whole reply of the
# forced last call, or answer["content"] set by code that never marked it ready.
AnswerProtocol = Literal["FINAL", "FINAL_VAR", "answer", "forced", "partial"]
ANSWER_PROTOCOLS: tuple[AnswerProtocol, ...] = get_args(AnswerProtocol)
# The cap of a Budget that refused a call: BudgetExceeded.limit.
BudgetLimit = Literal["max_usd", "max_tokens", "max_seconds", "max_llm_calls"]
BUDGET_LIMITS: tuple[BudgetLimit, ...] = get_args(BudgetLimit)
# Why a model call was not sent: the trace's lm_call `refused`, a baseline's `failure`.
Refusal = Literal["context_window", "budget", BudgetLimit]
# What a failed call from the REPL to the host raises there, by class name: the kind of an error
# reply (CallbackError.kind), of a failed batch item's `__error__`, and of "[error] <kind>: ..." text
# under subcall_errors="return". The worker makes the class of that name (sandbox/worker/errors.py).
ErrorKind = Literal["SubcallError", "BudgetExceeded", "ToolError", "TypeError", "ValueError", "SandboxError"]
ERROR_KINDS: tuple[ErrorKind, ...] = get_args(ErrorKind)


def error_kind(name: str) -> ErrorKind:
    """`name` when it is an error kind, else "SubcallError" (a failure the REPL's code cannot fix
    by calling differently): what a kind read from a wire or an exception's class becomes."""
    return name if name in ERROR_KINDS else "SubcallError"  # type: ignore[return-value]
