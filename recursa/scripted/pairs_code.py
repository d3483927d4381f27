"""OOLONG-Pairs: label every line with sub-models, build per-user profiles, then pair users in code."""

from __future__ import annotations

from typing import Any

from recursa.scripted.conversation import fill
from recursa.scripted.heuristics import HEURISTIC_SOURCE
from recursa.scripted.name_options import Settings
from recursa.scripted.oolong_code import _BATCHED, _NONE, _PER_ITEM, _PRELUDE
from recursa.scripted.strategy import AS_TEXT, Strategy, header
from recursa.tasks.oolong import LABELS
from recursa.tasks.oolong_pairs import parse_query
from recursa.tasks.pairs_logic import PAIRS_SOURCE

_ALL_LINES = """
rows = [parse_row(line) for line in lines]
instances = [row.get("instance", "") for row in rows]
"""

_PAIRS = """
SPEC = __SPEC__
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]


def iso(text):
    month, day, year = text.replace(",", "").split()
    return f"{int(year):04d}-{MONTHS.index(month) + 1:02d}-{int(day):02d}"


data = [(iso(row["date"]), int(row["user"]), lab) for row, lab in zip(rows, labels)]
pairs = pairs_for(SPEC, data)
result = format_pairs(pairs)
print(f"{len(set(u for _, u, _ in data))} users; {len(pairs)} pairs match the query")
print("RESULT:", f"{len(pairs)} pairs, listed in the variable result")
"""


def _code(spec: dict[str, Any], style: str, settings: Settings) -> str:
    labelling = {
        "batched": _BATCHED,
        "recursive": _BATCHED,
        "per-item": _PER_ITEM,
        "none": HEURISTIC_SOURCE + _NONE,
    }[style]
    code = header("solve", AS_TEXT, _PRELUDE, _ALL_LINES, labelling, PAIRS_SOURCE, _PAIRS)
    return fill(code, labels=list(LABELS), batch=settings.batch, spec=spec)


PAIRS = Strategy("oolong-pairs", parse_query, _code)
