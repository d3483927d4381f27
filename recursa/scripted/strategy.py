"""A strategy: how a scripted root recognises one task family's questions and writes the code.

A strategy recognises its questions and writes the REPL code of the solving step in one of four
styles, which are the personas' habits:

- "batched": a few large `llm_query_batched` calls (the paper's GPT-5 behaviour);
- "per-item": one `llm_query` per line or chunk in a plain loop (the over-calling Qwen3-Coder);
- "none": code alone, regexes and keyword rules, no model calls;
- "recursive": chunks handed to child RLMs with `rlm_query_batched`;
- "delegate": when the system prompt says sub-models have tools of their own (a search over the
  documents), questions go to sub-models without the text; only strategies with `delegates` do it.

The code must print a last line `RESULT: <answer>` and leave the answer in the variable `result`.
A new task family adds a module with a `Strategy` and lists it in `recursa.scripted.strategies`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recursa.scripted.name_options import Settings

STYLES = ("batched", "per-item", "none", "recursive", "delegate")


@dataclass(frozen=True)
class Strategy:
    name: str
    match: Callable[[str], Any | None]  # question -> a spec, or None if not this family's question
    code: Callable[[Any, str, Settings], str]  # (spec, style, settings) -> code of the solving step
    answer_in_prose: bool = False  # short answers (a number) go back as a prose FINAL(value)
    delegates: bool = False  # has a "delegate" style for sub-models that search for themselves


# Helpers pasted into the code the roots write; plain Python, since the sandbox has only the stdlib.
AS_TEXT = """
def as_text(ctx):
    if isinstance(ctx, str):
        return ctx
    if isinstance(ctx, dict):
        return "\\n\\n".join(f"{key}\\n{value}" for key, value in ctx.items())
    return "\\n\\n".join(str(item) for item in ctx)
"""

WINDOWS = '''
def windows(text, size, overlap=400):
    """Pieces of about `size` characters, cut at line ends, overlapping so nothing is split apart."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind("\\n", start + size // 2, end)
            end = cut if cut > start else end
        pieces.append(text[start:end])
        if end >= len(text):
            break
        start = max(end - overlap, start + 1)
    return pieces
'''

CHUNKS = '''
def chunks_of(ctx, size):
    """Documents grouped up to `size` characters (long ones cut), or windows over one text."""
    if isinstance(ctx, str):
        return windows(ctx, size)
    items = [f"{k}\\n{v}" for k, v in ctx.items()] if isinstance(ctx, dict) else [str(x) for x in ctx]
    groups, current = [], ""
    for item in items:
        if current and len(current) + len(item) > size:
            groups.append(current)
            current = ""
        if len(item) > size:
            groups.extend(windows(item, size))
            continue
        current = f"{current}\\n\\n{item}" if current else item
    if current:
        groups.append(current)
    return groups
'''


def header(step: str, *parts: str) -> str:
    """A code cell: the step tag (how the stateless root finds its place), then the helpers."""
    return "\n".join([f"# step: {step}", *(p.strip("\n") + "\n" for p in parts)])
