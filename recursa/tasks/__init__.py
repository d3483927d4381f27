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
from recursa.tasks.base import Task, families, generate, get_family

__all__ = [
    "Task",
    "families",
    "generate",
    "get_family",
]
