"""Build the root's system prompt (from a template file per model family) and its first message."""

from __future__ import annotations

import functools
import re
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

# Built-in prompts: "default" and its per-family variants (the default text plus a few lines of
# advice from prompts/families/), and "answer-dict" (answers only through the `answer` dict).
FAMILY_VARIANTS = ("qwen", "small", "claude")
# Piece lengths of a list or dict context are listed one by one within this many characters of the
# first message; beyond, the root gets the first ones and a summary.
_LENGTHS_CHARS = 400
# A parameter count in a model name: "qwen3-8b", "llama3.2:1b", "qwen2.5-0.5b", Gemma 3n's effective
# "e2b"; not the "a3b" of a MoE's active part, nor the "8x7b" of a mixture (56B in all).
_BILLIONS = re.compile(r"(?<![\w.])e?(\d+(?:\.\d+)?)b(?![a-z0-9])", re.IGNORECASE)
# Millions ("smollm2-135m", "gemma3:270m"); two digits at least, so a "-1m" context length is not one.
_MILLIONS = re.compile(r"(?<![\w.])\d{2,4}m(?![a-z0-9])", re.IGNORECASE)
_SMALL_MAX_BILLIONS = 14.0
# Size words of open-weight series ("phi-4-mini", "Phi-3.5-mini-instruct", "phi3:mini"). Hosted API
# models use the same words for capable models (gpt-4o-mini, o4-mini, gpt-5-nano, mistral-tiny):
# their names keep the default.
_SIZE_WORDS = frozenset({"mini", "tiny", "nano", "micro", "small"})
_HOSTED = re.compile(r"^(?:gpt|chatgpt|gemini|grok|claude|mistral|codestral|command|o\d+$)")


@dataclass(frozen=True)
class PromptSettings:
    max_depth: int
    max_output_chars: int
    sub_model_chars: int
    tools_text: str = ""
    modules: str = ""  # what code can import (loop/importable.py); empty: not stated
    # Named to the model only when the RLM lists extra models (RLM(allowed_models=...)).
    models: tuple[str, ...] = ()


def prompt_variant(model: str, override: str | Path | None = None) -> str:
    """The prompt a run uses: `override` (a built-in name, or a file path as given), else the built-in
    variant for the model's family."""
    if override is not None:
        return str(override)
    return family_for(model)


def family_for(model: str) -> str:
    """The built-in variant for a model name. Families differ in known ways: Qwen roots over-call
    sub-models unless told to batch (the paper's Qwen3-Coder finding), small models (up to about 14B
    parameters, see `is_small_model`) need batching spelt out and short steps, and Claude models tend to write a code
    block's output themselves and answer from it in the same reply."""
    name = model.lower()
    if "claude" in name or name.startswith("anthropic/"):
        return "claude"
    if is_small_model(name):
        return "small"
    if "qwen" in name or "coder-like" in name:
        return "qwen"
    return "default"


def is_small_model(model: str) -> bool:
    """Whether the name says the model is small: a parameter count of at most 14B ("1.5b", "3B",
    "e2b", "135m"), or, with no count, a size word of an open-weight series ("phi-4-mini")."""
    name = model.lower()
    size = _BILLIONS.search(name)
    if size is not None:
        return float(size.group(1)) <= _SMALL_MAX_BILLIONS
    if _MILLIONS.search(name):
        return True
    tokens = [t for t in re.split(r"[^a-z0-9]+", name) if t]
    return any(t in _SIZE_WORDS for t in tokens) and not any(_HOSTED.match(t) for t in tokens)


def template_for(model: str, override: str | Path | None = None) -> str:
    """The template text: `override` (a built-in name or a file path), else chosen by model family."""
    name = prompt_variant(model, override)
    if name in BUILTIN_TEMPLATES:
        return _builtin(name)
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"prompt {name!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor a readable file; pass one of those names or a path to a template file."
        )
    return path.read_text(encoding="utf-8")


class _Blank(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return ""


def fixed_text(template: str) -> str:
    """The text of a template that every system prompt made from it holds: its placeholders filled
    with nothing. Budget checks use it as a floor of the root's first call."""
    return Template(template).safe_substitute(_Blank())


@functools.cache
def _builtin(name: str) -> str:
    """A built-in template (package data, read once: every episode of an environment starts from it)."""
    if name in FAMILY_VARIANTS:
        return Template(_read("default.md")).safe_substitute(family_notes=_read(f"families/{name}.md"))
    return _read(f"{name}.md")


def _read(name: str) -> str:
    return resources.files("recursa.loop").joinpath("prompts", *name.split("/")).read_text(encoding="utf-8")


def system_prompt(template: str, info: ContextInfo, settings: PromptSettings) -> str:
    # Family notes (already in the template) name the batch size in terms of the sub-model's reach:
    # the paper's Qwen prompt says 200K characters for a 500K-character sub-model.
    return Template(template).safe_substitute(
        max_output_chars=f"{settings.max_output_chars:,}",
        context_type=_type_phrase(info),
        subcall_tools=_subcall_tools(settings),
        subcall_strategy=_subcall_strategy(settings),
        user_tools=settings.tools_text,
        modules=settings.modules or "Imports: the standard library.",
        family_notes="",
        example=_example(settings),
        batch_chars=f"{max(settings.sub_model_chars * 2 // 5, 1_000):,}",
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
        f"- `llm_query(prompt, model=None, images=None) -> str`: asks a language model (`images=`: image "
        "bytes, names of the context's image files or https URLs); it can read about "
        f"{s.sub_model_chars:,} characters of prompt, so hand it large pieces of the context.",
        "- `llm_query_batched(prompts, model=None, images=None) -> list[str]` (also `llm_batch`): many "
        "prompts at once, answered in parallel and returned in order (`images[i]`: the image or list of "
        "images for prompts[i]). Much faster than a loop of llm_query.",
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
    text = (
        "- Use sub-calls freely for anything that needs understanding rather than matching "
        "(classifying, extracting, judging, summarising): code finds and counts, models read. Split "
        f"the context into pieces of up to about {per_call:,} characters (or groups of about ten "
        "documents), ask a sub-model about each with `llm_query_batched`, collect the answers in a "
        "list, and combine them in code or with one more call.\n"
        "- Tell each sub-model exactly what to return and in which format, so its answers are easy "
        "to parse."
    )
    if s.max_depth >= 2:
        text += (
            "\n- `llm_query` answers a question about the text you give it in one reply: use it for "
            "extraction, labels and summaries. `rlm_query` gives a sub-problem to a child with its own "
            "REPL: use it when the piece is itself too large for one call or the sub-task needs "
            "several steps of code."
        )
    return text


def _example(s: PromptSettings) -> str:
    """One short worked example: chunk, batched sub-calls, aggregate in a variable, FINAL_VAR."""
    if s.max_depth <= 0:
        return ""
    return "\n" + _read("example.md")


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
        "You have not seen the context yet. Your first reply should be code that looks at it (its "
        "size, structure and a sample); do not answer before you have seen what it prints.",
    ]
    return "\n".join(lines)


def _chunk_summary(info: ContextInfo) -> str:
    """The length of each piece, as many as fit in the budget; beyond, the first ones and a summary."""
    lengths = info.chunk_lengths
    n = len(lengths)
    noun = "elements" if info.type_name == "list" else "entries"
    if info.type_name == "dict":
        items = [f"{_short_key(k)}: {v:,}" for k, v in zip(info.keys, lengths, strict=True)]
    else:
        items = [f"{v:,}" for v in lengths]
    shown: list[str] = []
    used = 0
    for item in items:
        used += len(item) + 2
        if used > _LENGTHS_CHARS:
            break
        shown.append(item)
    if len(shown) == n:
        return f"It has {n} {noun}; their lengths in characters: {', '.join(shown)}."
    return (
        f"It has {n:,} {noun}; lengths in characters: min {min(lengths):,}, median "
        f"{int(statistics.median(lengths)):,}, max {max(lengths):,}; the first {len(shown)}: "
        f"{', '.join(shown)}, ..."
    )


def _short_key(key: str) -> str:
    return repr(key if len(key) <= 40 else key[:37] + "...")
