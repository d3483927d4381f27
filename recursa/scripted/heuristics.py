"""The keyword rules a model without sub-calls (or without the knowledge) falls back on.

One source text serves twice: the no-subcalls root pastes it into the REPL code it writes, and the
base-llm baseline runs the same rules on the host, so both personas make exactly the same mistakes.
The rules are what a quick coder would write (wh-words first, then a few telling nouns); they are
not tuned to the generator's templates, so they are right for giveaway phrasings and often wrong
for the mixed ones ("Tell me the population of Peru" mentions no number word they know before
"country" sends it to location).
"""

from __future__ import annotations

from collections.abc import Callable

HEURISTIC_SOURCE = r"""
import re as _re

_LABEL_RULES = (
    ("abbreviation", _re.compile(r"\bstands? for\b|\babbreviat|\bacronym\b|\bfull form\b|^expand\b")),
    ("human being", _re.compile(r"^who\b|\b(inventor|author|composer|architect|founder|scientist|person)\b")),
    ("location", _re.compile(r"^where\b|\b(capital|city|country|continent|birthplace|river|mountain)\b")),
    ("numeric value", _re.compile(r"^(how many|how much|how far|how tall|when)\b|\b(population|year|height|distance)\b")),
    ("description and abstract concept", _re.compile(r"^(why|define|describe)\b|\b(meaning|mean|explain|definition)\b")),
)


def guess_label(text):
    low = text.strip().lower()
    for label, pattern in _LABEL_RULES:
        if pattern.search(low):
            return label
    return "entity"
"""

_namespace: dict[str, object] = {}
exec(compile(HEURISTIC_SOURCE, "<recursa scripted heuristics>", "exec"), _namespace)
guess_label: Callable[[str], str] = _namespace["guess_label"]  # type: ignore[assignment]
