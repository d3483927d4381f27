"""How a run ends, as the closed sets of values results and traces carry (and users may match on)."""

from __future__ import annotations

from typing import Literal, get_args

# Why a run stopped; the same values in RLMResult.stop_reason and the trace's run_end events.
# "context_window": the root's next call could not fit its model's window, even after compaction.
StopReason = Literal["final", "max_iterations", "budget", "timeout", "error", "cancelled", "context_window"]
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)
# How the answer was given: FINAL(...), FINAL_VAR(name), the answer dict, the whole reply of the
# forced last call, or answer["content"] set by code that never marked it ready.
AnswerProtocol = Literal["FINAL", "FINAL_VAR", "answer", "forced", "partial"]
ANSWER_PROTOCOLS: tuple[AnswerProtocol, ...] = get_args(AnswerProtocol)
