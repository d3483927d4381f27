"""`base`: the whole context and the question in one prompt, one answer."""

from __future__ import annotations

from dataclasses import dataclass

from recursa.context import context_text
from recursa.errors import BudgetExceeded, LMError
from recursa.lm.tokens import count_tokens
from recursa.methods.base import MethodResult, MethodSettings
from recursa.methods.prompts import BASE_SYSTEM, TRUNCATION_NOTE, context_block, task_block
from recursa.methods.session import BaselineRun
from recursa.tasks.base import Task

# Room left in the window for the system prompt, the question and the answer.
_RESERVE_TOKENS = 20_000


def fit_to_window(text: str, window: int | None, reserve: int = _RESERVE_TOKENS) -> tuple[str, bool]:
    """`text` cut to what fits a window of `window` tokens (about 4 characters a token), and whether it was cut."""
    if window is None:
        return text, False
    room = max(1_000, (window - reserve) * 4)
    if count_tokens(text) <= window - reserve or len(text) <= room:
        return text, False
    return text[:room] + "\n" + TRUNCATION_NOTE.format(kept=room, total=len(text)), True


@dataclass
class BaseModel:
    name: str = "base"

    async def run(self, task: Task, settings: MethodSettings) -> MethodResult:
        text = context_text(task.context)
        truncated = False
        if settings.options.base_overflow == "truncate":
            text, truncated = fit_to_window(text, settings.window())
        messages = [
            {"role": "system", "content": BASE_SYSTEM},
            {"role": "user", "content": context_block(text) + "\n\n" + task_block(task.question)},
        ]
        async with BaselineRun(settings, self.name, task.question) as run:
            if truncated:
                run.emit("note", text=f"context cut to {len(text):,} characters to fit the window")
            try:
                answer = await run.call(messages)
            except (BudgetExceeded, LMError) as exc:
                # The paper's base model cannot read contexts past its window: over it is a clean,
                # expected failure (failure="context_window"), not a harness error.
                return run.call_failed(exc, "context")
            return run.result(answer)
