"""The strategies a scripted root tries, in order: one per task family, generic map-reduce last."""

from __future__ import annotations

from typing import Any

from recursa.scripted.codeqa_code import CODEQA
from recursa.scripted.copy_code import COPY
from recursa.scripted.evidence_code import EVIDENCE
from recursa.scripted.generic_code import GENERIC
from recursa.scripted.multihop_code import MULTIHOP
from recursa.scripted.niah_code import NIAH
from recursa.scripted.oolong_code import OOLONG
from recursa.scripted.pairs_code import PAIRS
from recursa.scripted.strategy import Strategy

# Tried in this order; the first whose `match` accepts the question solves it.
STRATEGIES: tuple[Strategy, ...] = (PAIRS, OOLONG, NIAH, MULTIHOP, EVIDENCE, COPY, CODEQA)


def choose(question: str) -> tuple[Strategy, Any]:
    """The first strategy that recognises `question`, else the generic map-reduce."""
    for strategy in STRATEGIES:
        spec = strategy.match(question)
        if spec is not None:
            return strategy, spec
    return GENERIC, GENERIC.match(question)
