"""The protocol every benchmark method implements, its settings and its result.

A method takes one `Task` and the model settings shared by every method of a benchmark run (so
rows compare), and returns the answer with usage, turns, sub-calls, latency and trace. Methods:

- `base`: the whole context in one prompt; past the model's window it fails cleanly (or, with
  `base_overflow="truncate"`, keeps what fits and says so in the prompt);
- `codeact`: a ReAct loop that runs Python, with the context in its prompt (cut to the window);
- `codeact-bm25`: the same with `search(query, k)` over the whole context (BM25, `bm25s`);
- `codeact-subcalls`: the same with `llm_query` / `llm_query_batched` from its code;
- `summary`: reads the context part by part, keeping compacted notes, then answers from the notes;
- `rlm`: a recursive language model (sub-calls to `sub_model`);
- `rlm-nosub`: the same REPL without sub-calls (`max_depth=0`);
- `rlm-tips`: `rlm` with the task family's strategy tips in the root's system prompt;
- `rlm-subtools`: `rlm` whose sub-models can call a BM25 search over the task's documents.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import Any, Protocol

from recursa.config import METHOD_OWNED, METHOD_SETTINGS, MethodConfig, Spelling
from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.outcomes import Refusal, StopReason
from recursa.tasks.base import Task
from recursa.usage import Usage

METHODS = (
    "base",
    "codeact",
    "codeact-bm25",
    "codeact-subcalls",
    "summary",
    "rlm",
    "rlm-nosub",
    "rlm-tips",
    "rlm-subtools",
)
_IMPLEMENTATIONS = {
    "base": ("recursa.methods.base_model", "BaseModel", {}),
    "codeact": ("recursa.methods.codeact", "CodeAct", {"search": False, "subcalls": False}),
    "codeact-bm25": ("recursa.methods.codeact", "CodeAct", {"search": True, "subcalls": False}),
    "codeact-subcalls": ("recursa.methods.codeact", "CodeAct", {"search": False, "subcalls": True}),
    "summary": ("recursa.methods.summary", "SummaryAgent", {}),
    "rlm": ("recursa.methods.rlm_method", "RLMMethod", {"subcalls": True}),
    "rlm-nosub": ("recursa.methods.rlm_method", "RLMMethod", {"subcalls": False}),
    "rlm-tips": ("recursa.methods.rlm_method", "RLMMethod", {"subcalls": True, "tips": True}),
    "rlm-subtools": ("recursa.methods.rlm_method", "RLMMethod", {"subcalls": True, "sub_tools": True}),
}
# What a method needs beyond the core: (a module, the extra that installs it).
_NEEDS = {"codeact-bm25": ("bm25s", "bench"), "rlm-subtools": ("bm25s", "bench")}
# Input windows (tokens) of model families, for cutting a context to fit; exact names first.
_WINDOWS = (
    (r"gpt-5", 272_000),
    (r"gpt-4\.1", 1_000_000),
    (r"gpt-4o|o[134]", 128_000),
    (r"claude", 200_000),
    (r"qwen3-coder", 262_144),
    (r"qwen3", 32_768),
)


class MethodSettings:
    """What a method runs with, shared by every method of a benchmark run so rows compare: its
    models, its run settings (`RLMConfig`'s, by name, given to the engine as they are and checked by
    the schema when a method makes its run) and the methods' own (`MethodConfig`: window_tokens,
    base_overflow, notes_chars). `spelling`: how a bad setting is named (`recursa bench`'s flags)."""

    def __init__(
        self, model: str, sub_model: str | None = None, *, spelling: Spelling | None = None, **settings: Any
    ) -> None:
        spelling = spelling or Spelling("python", type(self).__name__)
        own = {name: settings.pop(name) for name in METHOD_SETTINGS if name in settings}
        self.options = MethodConfig.checked(spelling, **own)
        for name in METHOD_OWNED:
            if name in settings:
                raise ConfigError(
                    f"{spelling.given(name, settings[name])}: each method sets {name} itself "
                    "(rlm-nosub: max_depth=0, rlm-tips: its family's tips); leave it out",
                    setting=name,
                )
        self.model, self.sub_model = model, sub_model
        self.run = settings  # RLMConfig's settings by name

    def window(self) -> int | None:
        return self.options.window_tokens or model_window(self.model)


def model_window(spec: str) -> int | None:
    """The input window of a model in tokens, when its family is known."""
    name = spec.split("/", 1)[-1].lower()
    if spec.startswith("scripted/"):
        m = re.search(r"window=([\d.]+[km]?)", name)
        if m:
            text = m.group(1)
            scale = 1_000 if text.endswith("k") else 1_000_000 if text.endswith("m") else 1
            return int(float(text.rstrip("km")) * scale)
        name = "gpt-5"  # a scripted model takes GPT-5's window unless window= says otherwise
    for pattern, tokens in _WINDOWS:
        if re.search(pattern, name):
            return tokens
    return None


@dataclass
class MethodResult:
    answer: str
    usage: Usage
    iterations: int = 0  # root turns (model calls of the root)
    sub_calls: int = 0  # model calls below the root
    stop_reason: StopReason = "final"
    latency_s: float = 0.0
    trace_path: str | None = None
    error: str | None = None
    failure: Refusal | None = None  # a clean, expected failure ("context_window"), not a harness error


class Method(Protocol):
    name: str

    async def run(self, task: Task, settings: MethodSettings) -> MethodResult: ...


def missing_requirement(name: str) -> str | None:
    """Why method `name` cannot run here (a package of its extra is not installed), or None."""
    need = _NEEDS.get(name)
    if need is None or importlib.util.find_spec(need[0]) is not None:
        return None
    module, extra = need
    return f"method {name} needs the {module} package of the {extra} extra: {install_hint(extra)}"


def get_method(name: str) -> Method:
    """A method by name. Raises ValueError naming the known methods."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown method {name!r}; methods: {', '.join(METHODS)}")
    module_name, class_name, options = _IMPLEMENTATIONS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    method: Method = cls(name=name, **options)
    return method
