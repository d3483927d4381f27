"""Evidence spans: narrow to the papers naming both entities with the search tool (or a regex),
ask sub-models for the exact result sentences paper group by paper group, and keep only sentences
found verbatim in their paper."""

from __future__ import annotations

from typing import Any

from recursa.scripted.conversation import fill
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import Strategy, header
from recursa.tasks import evidence_spans

_PRELUDE = """
import json
import re

QUESTION = __QUESTION__
METHOD, DATASET = __PAIR__
papers = dict(context) if isinstance(context, dict) else {f"P{i:05d}": str(t) for i, t in enumerate(context)}
if "search" in globals():
    hits = search(METHOD + " " + DATASET, k=100_000)
    candidates = sorted({pid for pid, _section, sentence in hits if METHOD in sentence and DATASET in sentence})
else:
    candidates = sorted(pid for pid, text in papers.items() if METHOD in text and DATASET in text)
print(f"{len(papers):,} papers; {len(candidates)} name both {METHOD} and {DATASET}")
"""

_MODEL = """
groups, current = [], []
for pid in candidates:
    current.append(pid)
    if sum(len(papers[p]) for p in current) > __CHUNK__:
        groups.append(current)
        current = []
if current:
    groups.append(current)
ASK = QUESTION + "\\n\\nPapers:\\n"
replies = llm_query_batched([ASK + "\\n\\n".join(f"### {p}\\n{papers[p]}" for p in g) for g in groups])
found = []
for reply in replies:
    try:
        items = json.loads(str(reply))
    except ValueError:
        items = []
    for item in items if isinstance(items, list) else []:
        pid, text = item.get("paper_id"), item.get("text", "")
        if pid in papers and text and text in papers[pid]:  # only sentences that really are in the paper
            found.append({"paper_id": pid, "text": text})
"""

_NONE = """
found = []
for pid in candidates:
    for sentence in re.split(r"(?<=[.!?])\\s+|\\n+", papers[pid]):
        if METHOD in sentence and DATASET in sentence:
            found.append({"paper_id": pid, "text": sentence.strip()})
"""

_RESULT = """
result = json.dumps(found)
print(f"{len(found)} evidence sentences")
print("RESULT:", f"{len(found)} sentences, listed in the variable result")
"""


def _match(question: str) -> tuple[Any, ...] | None:
    parsed = evidence_spans.parse_question(question)
    return (question, parsed) if parsed else None


def _code(spec: tuple[Any, ...], style: str, settings: Settings) -> str:
    question, pair = spec
    body = _NONE if style == "none" else _MODEL
    return fill(header("solve", _PRELUDE, body, _RESULT), question=question, pair=pair, chunk=settings.chunk)


EVIDENCE = Strategy("evidence-spans", _match, _code)
