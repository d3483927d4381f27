"""Trace events as readable progress text: streamed as reasoning deltas, and as MCP progress messages.

Only the root run's turns are shown in full (the root's reply, then the REPL output); child runs
appear as one line when they start and one when they answer, and sub-calls as a count per
execution, so a fan-out of 1,000 prompts is one line, not 1,000.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _clip(text: str | None, limit: int) -> str:
    text = text or ""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit:,} more characters]"


def _one_line(text: str | None, limit: int = 160) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class CellTally:
    """What the root's current cell set off (sub-calls, their tokens, refusals, child runs), summed
    until its exec event, then summarised in a few words: shared by the SSE steps and MCP progress."""

    def __init__(self) -> None:
        self.sub_calls = self.sub_tokens = self.refused = self.children = 0

    def sub_call(self, event: dict[str, Any]) -> None:
        if event.get("refused") or event.get("error"):
            self.refused += 1
        else:
            self.sub_calls += 1
            usage = event.get("usage") or {}
            self.sub_tokens += int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))

    def close(self, exec_event: dict[str, Any], *, error_chars: int = 200) -> list[str]:
        """The notes for one finished cell (duration first); the tally starts again."""
        notes: list[str] = [f"{float(exec_event.get('duration_s') or 0):.2f} s"]
        if self.sub_calls:
            plural = "s" if self.sub_calls != 1 else ""
            notes.append(f"{self.sub_calls} sub-call{plural}, {self.sub_tokens:,} tokens")
        if self.refused:
            notes.append(f"{self.refused} sub-calls refused or failed")
        if self.children:
            notes.append(f"{self.children} child run{'s' if self.children != 1 else ''}")
        if exec_event.get("timed_out"):
            notes.append("timed out")
        if exec_event.get("error"):
            notes.append(f"error: {_one_line(exec_event.get('error'), error_chars)}")
        self.sub_calls = self.sub_tokens = self.refused = self.children = 0
        return notes


class StepRenderer:
    def __init__(self, *, reply_chars: int = 6_000, output_chars: int = 2_000) -> None:
        self.reply_chars = reply_chars
        self.output_chars = output_chars
        self.root_run: str | None = None
        self.tally = CellTally()

    def render(self, event: dict[str, Any]) -> str:
        kind = event.get("type")
        run_id = event.get("run_id")
        if kind == "run_start":
            if self.root_run is None and not event.get("parent_run_id"):
                self.root_run = run_id
                info = event.get("context") or {}
                total = info.get("total_chars") if isinstance(info, dict) else None
                size = f" over {total:,} characters of context" if isinstance(total, int) else ""
                return f"Starting a recursive run with {event.get('model')}{size}.\n"
            self.tally.children += 1
            depth = int(event.get("depth") or 1)
            return f"{'  ' * depth}↳ child run (depth {depth}): {_one_line(event.get('question'))}\n"
        if kind == "run_end" and run_id != self.root_run:
            depth = int(event.get("depth") or 1)
            return (
                f"{'  ' * depth}↳ child answered [{event.get('stop_reason')}]: "
                f"{_one_line(event.get('answer'))}\n"
            )
        if run_id != self.root_run:
            return ""
        if kind == "turn":
            return f"\n── turn {event.get('turn')} ──\n"
        if kind == "lm_call":
            return self._lm_call(event)
        if kind == "exec":
            return self._exec(event)
        return ""

    def _lm_call(self, event: dict[str, Any]) -> str:
        if event.get("purpose") in ("root", "final"):
            if event.get("error"):
                return f"[model call failed: {_one_line(event.get('error'), 300)}]\n"
            return _clip(event.get("response"), self.reply_chars).rstrip() + "\n"
        self.tally.sub_call(event)
        return ""

    def _exec(self, event: dict[str, Any]) -> str:
        output = (event.get("stdout") or "") + (event.get("stderr") or "")
        notes = self.tally.close(event)
        body = _clip(output, self.output_chars).rstrip()
        shown = f"```output\n{body}\n```\n" if body else ""
        return f"REPL ({', '.join(notes)}):\n{shown}"


def all_steps(events: Iterable[dict[str, Any]]) -> str:
    """Every step of a run that ended, as one text (a non-streaming answer's steps or thinking)."""
    renderer = StepRenderer()
    return "".join(renderer.render(e) for e in events)
