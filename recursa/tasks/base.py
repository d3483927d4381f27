"""Tasks and the registry of task families.

A family is a seeded generator plus a scorer. `generate("oolong", 1_000_000, seed=3)` always builds
the same task, with an exact gold answer computed from the data it generated. New families (pairs,
multi-hop documents, code QA, verbatim copy, evidence spans) register a `Family` the same way.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Context = str | list[str] | dict[str, str]


@dataclass
class Task:
    """One generated question over one context, with its exact answer.

    `meta` holds small, JSON-friendly facts for reports (sizes, counts, knobs). `hidden` holds the
    per-item ground truth a reference solver or grader needs (e.g. every line's label); it can be
    as large as the context, so it is kept out of `repr` and out of reports.
    """

    id: str
    family: str
    question: str
    context: Context
    gold: str
    meta: dict[str, Any] = field(default_factory=dict)
    hidden: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # REPL tools some families ship (evidence-spans: list_papers, search, ...): functions for
    # `RLM(tools=...)`, self-contained so they run in the sandbox over `context`. Their signatures
    # and docstrings reach the root's prompt.
    tools: tuple[Callable[..., Any], ...] = field(default=(), repr=False, compare=False)

    def score(self, answer: str) -> float:
        """The family's score for `answer`, in [0, 1]."""
        return get_family(self.family).scorer(self, answer)

    def metrics(self, answer: str) -> dict[str, float]:
        """Extra scores a family reports next to `score` (e.g. exact match and similarity)."""
        extra = get_family(self.family).metrics
        return extra(self, answer) if extra is not None else {}

    def reference_answer(self) -> str | None:
        """What the family's reference solver answers from the hidden truth (None: no solver)."""
        solver = get_family(self.family).solver
        return solver(self) if solver is not None else None

    @property
    def size_chars(self) -> int:
        return context_chars(self.context)


Generator = Callable[..., Task]  # (size_chars, seed, **knobs) -> Task
Scorer = Callable[[Task, str], float]
Solver = Callable[[Task], str]  # a reference solution from the task's hidden truth, scored 1.0
Metrics = Callable[[Task, str], dict[str, float]]


@dataclass(frozen=True)
class Family:
    name: str
    generator: Generator
    scorer: Scorer
    knobs: dict[str, Any]  # every knob the generator takes, with its default
    description: str = ""
    solver: Solver | None = None
    metrics: Metrics | None = None
    # Strategy text for this kind of task (short, in our own words), added to the root's system
    # prompt by the `rlm-tips` method or `rlm.run(..., tips=family.tips)`.
    tips: str = ""

    def score(self, task: Task, answer: str) -> float:
        """This family's score for `answer` to `task`, in [0, 1]: a reward for RL trainers."""
        return self.scorer(task, answer)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def families() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown task family {name!r}; known families: {', '.join(families())}") from None


def get(name: str) -> Family:
    """The family `name`, e.g. `get("oolong").score(task, answer)`; ValueError names the known ones."""
    return get_family(name)


def generate(family: str, size_chars: int, seed: int = 0, **knobs: Any) -> Task:
    """A seeded task of `family` whose context holds about `size_chars` characters (within 5%)."""
    fam = get_family(family)
    unknown = sorted(set(knobs) - set(fam.knobs))
    if unknown:
        known = ", ".join(f"{k}={v!r}" for k, v in fam.knobs.items()) or "none"
        raise ValueError(f"unknown knob(s) {', '.join(unknown)} for family {family!r}; knobs: {known}")
    if not isinstance(size_chars, int) or size_chars <= 0:
        raise ValueError(f"size_chars must be a positive int, got {size_chars!r}")
    return fam.generator(size_chars, seed, **{**fam.knobs, **knobs})


def seeded_rng(family: str, size_chars: int, seed: int) -> random.Random:
    """The generator's random source: a str seed is hashed with SHA-512, so it is stable everywhere."""
    return random.Random(f"recursa-task:{family}:{size_chars}:{seed}")


def task_id(family: str, size_chars: int, seed: int, knobs: dict[str, Any], defaults: dict[str, Any]) -> str:
    """A readable id; knobs that differ from their defaults add a short digest."""
    changed = {k: v for k, v in sorted(knobs.items()) if defaults.get(k) != v}
    base = f"{family}-{size_chars}-s{seed}"
    if not changed:
        return base
    digest = hashlib.sha1(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{base}-{digest}"


def context_chars(context: Context) -> int:
    if isinstance(context, str):
        return len(context)
    if isinstance(context, dict):
        return sum(len(v) for v in context.values())
    return sum(len(v) for v in context)


def split_pieces(text: str, pieces: int, separator: str = "\n\n") -> list[str]:
    """Cut `text` into about `pieces` parts of similar size at `separator` boundaries.

    The parts joined with `separator` give back `text`, so list and dict contexts hold exactly the
    characters a str context would (minus the separators between parts).
    """
    if pieces <= 1:
        return [text]
    target = len(text) / pieces
    parts: list[str] = []
    start = 0
    for k in range(1, pieces):
        cut = text.find(separator, max(start, int(k * target)))
        if cut < 0:
            break
        parts.append(text[start:cut])
        start = cut + len(separator)
    parts.append(text[start:])
    return [p for p in parts if p]
