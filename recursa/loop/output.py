"""What the root sees of its code's output: head and tail within a character budget."""

from __future__ import annotations

import re

from recursa.sandbox.base import ExecResult

# How the worker marks what it cut from a cell's output (sandbox/worker/capture.py).
_WORKER_CUT = re.compile(r"\n\[\.\.\. [\d,]+ characters omitted \.\.\.\]\n")


def truncate_middle(text: str, limit: int, already_omitted: int = 0) -> str:
    """Keep the head and tail of `text` within `limit` characters, saying how much was left out."""
    if len(text) <= limit and not already_omitted:
        return text
    if len(text) <= limit:
        return text + f"\n[{already_omitted:,} characters of output were omitted]"
    head = (limit * 3) // 5
    tail = limit - head
    omitted = len(text) - head - tail + already_omitted
    return f"{text[:head]}\n\n... [{omitted:,} characters omitted] ...\n\n{text[len(text) - tail :]}"


def render_exec(result: ExecResult) -> tuple[str, int]:
    """One execution as text for the root, and the characters the worker already cut out."""
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append(result.stderr.rstrip("\n"))
    if not parts:
        parts.append("(no output)")
    for note in result.notes:
        parts.append(f"[note] {note}")
    return "\n".join(parts), result.omitted_chars


def render_turn(results: list[ExecResult], limit: int) -> str:
    """All blocks of one reply, cut as a whole to `limit` characters."""
    texts: list[str] = []
    omitted = 0
    for i, result in enumerate(results, 1):
        body, cut = render_exec(result)
        omitted += cut
        label = f"[block {i} of {len(results)}]\n" if len(results) > 1 else ""
        texts.append(label + body)
    text = "\n\n".join(texts)
    if omitted and len(_WORKER_CUT.sub("", text)) <= limit:
        # The worker already cut this output to the limit and marked where and how much; cutting
        # again for the marker's few characters would show two markers with overlapping counts.
        return text
    return truncate_middle(text, limit, omitted)
