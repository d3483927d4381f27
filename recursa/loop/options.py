"""Per-run choices that are not part of the RLM's configuration: tips, a typed answer, a session's REPL."""

from __future__ import annotations

from dataclasses import dataclass

from recursa.loop.answer_schema import AnswerCheck
from recursa.sandbox.base import Sandbox


@dataclass(frozen=True)
class RunOptions:
    tips: str | None = None  # task strategy added to the root's system prompt
    answer_check: AnswerCheck | None = None  # run(..., answer_schema=...)
    sandbox: Sandbox | None = None  # a session's REPL: already loaded, and left running afterwards
    intro: tuple[str, ...] = ()  # extra paragraphs for the first message (a session's notes)
    system_prompt: str | None = None  # the root's whole system message instead of the template's

    def for_child(self) -> RunOptions:
        """Children answer sub-questions of their own: none of the root's per-run choices apply."""
        return RunOptions()
