"""Build the root's system prompt (from a template file per model family) and its first message."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from recursa.config import BUILTIN_TEMPLATES
from recursa.context import ContextInfo
from recursa.errors import ConfigError
from recursa.tools.spec import Tool

# Chunk lengths are listed one by one up to this many; beyond, the root gets a summary instead.
_LISTED_CHUNKS = 40


@dataclass(frozen=True)
class PromptSettings:
    max_depth: int
    max_output_chars: int
    sub_model_chars: int
    tools_text: str = ""
    # Named to the model only when the RLM lists extra models (RLM(allowed_models=...)).
    models: tuple[str, ...] = ()


def template_for(model: str, override: str | Path | None = None) -> str:
    """The template text: `override` (a built-in name or a file path), else chosen by model family."""
    if override is not None:
        name = str(override)
        if name in BUILTIN_TEMPLATES:
            return _builtin(name)
        path = Path(name)
        if not path.is_file():
            raise ConfigError(
                f"prompt {name!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                "nor a readable file; pass one of those names or a path to a template file."
            )
        return path.read_text(encoding="utf-8")
    # Qwen-family roots over-call sub-models unless told to batch (the paper's Qwen3-Coder finding).
    if "qwen" in model.lower() or "coder-like" in model.lower():
        return _builtin("qwen")
    return _builtin("default")


def _builtin(name: str) -> str:
    return resources.files("recursa.loop").joinpath("prompts", f"{name}.md").read_text(encoding="utf-8")


def system_prompt(template: str, info: ContextInfo, settings: PromptSettings) -> str:
    return Template(template).safe_substitute(
        max_output_chars=f"{settings.max_output_chars:,}",
        context_type=_type_phrase(info),
        subcall_tools=_subcall_tools(settings),
        subcall_strategy=_subcall_strategy(settings),
        user_tools=settings.tools_text,
    )


def tools_text(tools: Sequence[Tool], sub_tools: Sequence[Tool]) -> str:
    """The user tools' bullets for the system prompt (empty when there are none)."""
    lines = [t.describe() for t in tools]
    if sub_tools:
        names = ", ".join(f"`{t.name}{t.signature}`" for t in sub_tools)
        lines.append(
            f"- Sub-models you call with llm_query (and child RLMs) can use these tools themselves: {names}. "
            "You cannot call them and you do not see their output, only the sub-model's reply: ask "
            "sub-models questions those tools help with."
        )
    if not lines:
        return ""
    return "\nYour own tools for this task:\n" + "\n".join(lines) + "\n"


def _type_phrase(info: ContextInfo) -> str:
    if info.type_name == "str":
        return "one str"
    if info.type_name == "list":
        return "a list of str"
    return "a dict mapping str keys to str values"


def _subcall_tools(s: PromptSettings) -> str:
    if s.max_depth <= 0:
        return "- No model calls are available from code in this run: work with code alone."
    lines = [
        f"- `llm_query(prompt, model=None) -> str`: asks a language model; it can read about "
        f"{s.sub_model_chars:,} characters of prompt, so hand it large pieces of the context.",
        "- `llm_query_batched(prompts, model=None) -> list[str]` (also `llm_batch`): many prompts at "
        "once, answered in parallel and returned in order. Much faster than a loop of llm_query.",
    ]
    if len(s.models) > 1:
        lines.append(
            f"- `model=` may name one of: {', '.join(s.models)}; the default (None) is {s.models[0]}."
        )
    if s.max_depth >= 2:
        lines += [
            "- `rlm_query(prompt, context=None) -> str`: hands a sub-question to a child that works "
            "like you, with its own REPL in which `context` is the object you pass (a str, list or "
            "dict); use it for sub-problems that are themselves too large for one call.",
            "- `rlm_query_batched(prompts, contexts=None) -> list[str]`: several children at once.",
        ]
    else:
        lines.append(
            "- `rlm_query(prompt, context=None)` and `rlm_query_batched(prompts, contexts=None)`: in "
            "this run they are plain model calls (the prompt followed by the context, if given)."
        )
    lines.append(
        "- A call refused by the budget raises `BudgetExceeded`; a failed call raises `SubcallError`."
    )
    return "\n".join(lines)


def _subcall_strategy(s: PromptSettings) -> str:
    if s.max_depth <= 0:
        return ""
    per_call = max(s.sub_model_chars // 5, 1_000)
    return (
        "- For anything that needs understanding rather than matching, split the context into "
        f"pieces of up to about {per_call:,} characters (or groups of about ten documents), ask a "
        "sub-model about each with `llm_query_batched`, collect the answers in a list, and combine "
        "them in code or with one more call.\n"
        "- Tell each sub-model exactly what to return and in which format, so its answers are easy "
        "to parse."
    )


def first_message(question: str, info: ContextInfo) -> str:
    """The question and constant-size facts about the context: never the context itself."""
    lines = [
        "<question>",
        question,
        "</question>",
        "",
        f"The context is in the REPL variable `context`: {_type_phrase(info)}, "
        f"{info.total_chars:,} characters in total.",
    ]
    if info.type_name in ("list", "dict"):
        lines.append(_chunk_summary(info))
    if info.skipped_files:
        lines.append(
            f"{len(info.skipped_files)} file(s) of the folder were left out (not UTF-8 text, links "
            "leading outside the folder, or unreadable) and are not in it."
        )
    lines += [
        f"Its first {len(info.prefix):,} characters, as a preview only:",
        "<preview>",
        info.prefix,
        "</preview>",
        "",
        "You have not seen the context yet: start by exploring it with code.",
    ]
    return "\n".join(lines)


def _chunk_summary(info: ContextInfo) -> str:
    n = len(info.chunk_lengths)
    noun = "elements" if info.type_name == "list" else "entries"
    if n <= _LISTED_CHUNKS:
        if info.type_name == "dict":
            listed = ", ".join(f"{k!r}: {v:,}" for k, v in zip(info.keys, info.chunk_lengths, strict=True))
        else:
            listed = ", ".join(f"{v:,}" for v in info.chunk_lengths)
        return f"It has {n} {noun}; their lengths in characters: {listed}."
    lengths = info.chunk_lengths
    first = ", ".join(f"{v:,}" for v in lengths[:10])
    text = (
        f"It has {n:,} {noun}; lengths in characters: min {min(lengths):,}, median "
        f"{int(statistics.median(lengths)):,}, max {max(lengths):,}; the first ten: {first}."
    )
    if info.type_name == "dict":
        text += " First keys: " + ", ".join(repr(k) for k in info.keys[:10]) + "."
    return text
