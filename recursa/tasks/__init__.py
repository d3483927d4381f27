"""Offline task families with exact answers: generators, scorers and the registry.

from recursa.tasks import generate, families
task = generate("oolong", 1_000_000, seed=3)
task.question, task.context, task.gold, task.score("Answer: 42")
"""

from __future__ import annotations

from recursa.tasks import (  # noqa: F401  (each module registers its family)
    codeqa,
    evidence_spans,
    multihop_docs,
    niah,
    oolong,
    oolong_pairs,
    verbatim_copy,
)
from recursa.tasks.base import Family, Task, families, generate, get, get_family, register_family
from recursa.tasks.scoring import contains_token, oolong_parse, oolong_score

__all__ = [
    "Family",
    "Task",
    "contains_token",
    "families",
    "generate",
    "get",
    "get_family",
    "oolong_parse",
    "oolong_score",
    "register_family",
]
