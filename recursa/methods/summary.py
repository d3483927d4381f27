"""`summary`: an iterative compaction agent. The context is read in window-sized parts; after each
part the model rewrites its notes, and the final answer comes from the notes alone."""

from __future__ import annotations

from dataclasses import dataclass

from recursa.context import context_text
from recursa.errors import BudgetExceeded, LMError
from recursa.methods.base import MethodResult, MethodSettings
from recursa.methods.prompts import SUMMARY_FINAL, SUMMARY_SYSTEM, task_block
from recursa.methods.session import BaselineRun
from recursa.tasks.base import Task

_RESERVE_TOKENS = 24_000  # system prompt, question, notes and the reply
_UNKNOWN_WINDOW = 128_000


def parts_of(text: str, size: int) -> list[str]:
    """Pieces of about `size` characters, cut at line ends where one is near."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind("\n", start + size // 2, end)
            end = cut if cut > start else end
        out.append(text[start:end])
        start = end
    return out or [""]


@dataclass
class SummaryAgent:
    name: str = "summary"

    async def run(self, task: Task, settings: MethodSettings) -> MethodResult:
        window = settings.window() or _UNKNOWN_WINDOW
        part_chars = max(4_000, (window - _RESERVE_TOKENS - settings.options.notes_chars // 4) * 4)
        parts = parts_of(context_text(task.context), part_chars)
        system = SUMMARY_SYSTEM.format(notes_chars=settings.options.notes_chars)
        notes = ""
        async with BaselineRun(settings, self.name, task.question) as run:
            try:
                for i, part in enumerate(parts, 1):
                    user = (
                        f"{task_block(task.question)}\n\n<notes>\n{notes}\n</notes>\n\n"
                        f'<part index="{i}" of="{len(parts)}">\n{part}\n</part>\n\nReply with the updated notes only.'
                    )
                    notes = await run.call(
                        [{"role": "system", "content": system}, {"role": "user", "content": user}]
                    )
                final = f"{task_block(task.question)}\n\n<notes>\n{notes}\n</notes>\n\n{SUMMARY_FINAL}"
                answer = await run.call(
                    [{"role": "system", "content": system}, {"role": "user", "content": final}]
                )
            except (BudgetExceeded, LMError) as exc:
                return run.call_failed(exc, "a part")
            return run.result(answer)
