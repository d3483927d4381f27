"""OOLONG-Pairs: the paper's 20 pairwise queries over OOLONG-style lines (quadratic work).

The 20 query texts ship verbatim in `data/oolong_pairs_tasks.json` (Zhang et al., Appendix D.1),
followed by the answer instructions the paper's harness added. `parse_query` turns a query text
into the spec `pairs_logic` evaluates; the seeded query generator writes new queries in the same
grammar, so everything that reads the verbatim queries reads the generated ones too.

Scoring: set F1 over (low, high) pairs found with the pattern `\\(\\s*(\\d+)\\s*,\\s*(\\d+)\\s*\\)`;
both sides empty scores 1.0, and an empty gold with a non-empty prediction scores 0.
"""

from __future__ import annotations

import json
import re
from datetime import date, datetime
from functools import cache
from importlib import resources
from typing import Any

from recursa.tasks import oolong
from recursa.tasks.base import Family, Task, register_family, seeded_rng, task_id
from recursa.tasks.oolong_templates import LABELS
from recursa.tasks.pairs_logic import format_pairs, pairs_for

FAMILY = "oolong-pairs"
DESC, ENTY, HUM, NUM, LOC, ABBR = LABELS
_PAIR_RE = re.compile(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)")
_MONTHS = ("January February March April May June July August September October November December").split()


@cache
def official() -> dict[str, Any]:
    """The shipped JSON: the 20 query texts, the labels, the answer suffix and the semantics notes."""
    text = resources.files("recursa.tasks").joinpath("data", "oolong_pairs_tasks.json").read_text("utf-8")
    return json.loads(text)


def query_texts() -> dict[int, str]:
    return {int(t["id"]): t["text"] for t in official()["tasks"]}


# -- reading a query -------------------------------------------------------------------------------

# "description and abstract concept" holds an "and": shield it before splitting on "and".
_SHIELD = "DESC_LABEL"
_LABEL_WORDS = {DESC: _SHIELD, **{lab: lab for lab in LABELS[1:]}}
_NUMBER_WORDS = {"one": 1, "two": 2, "three": 3}
_COND_RE = re.compile(r"^(at least|exactly) (one|two|three) (?:instances? )?with (?:an? )?(.+)$")
_ELLIPTIC_RE = re.compile(r"^(one|two) with (?:an? )?(.+)$")  # "... and one with abbreviation"
_DATE_CLAUSE_RE = re.compile(
    r"all instances that are an? (.+?) for both users must be (after|before) ([A-Z][a-z]+ \d{1,2}, \d{4})"
)


def _label(text: str) -> str:
    text = text.strip().strip(".").replace(_SHIELD, DESC)
    text = re.sub(r"^(?:an?|the) ", "", text)
    if text not in LABELS:
        raise ValueError(f"not a label: {text!r}")
    return text


def _conditions(text: str) -> list[list[Any]]:
    text = text.replace(DESC, _SHIELD)
    parts = [p.strip() for p in re.split(r",\s*(?:and\s+)?|\s+and\s+", text) if p.strip()]
    conds: list[list[Any]] = []
    for part in parts:
        m = _COND_RE.match(part)
        if m:
            op = "at_least" if m.group(1) == "at least" else "exactly"
            conds.append([op, _NUMBER_WORDS[m.group(2)], _label(m.group(3))])
            continue
        m = _ELLIPTIC_RE.match(part)
        if m:
            conds.append(["at_least", _NUMBER_WORDS[m.group(1)], _label(m.group(2))])
            continue
        raise ValueError(f"cannot read the condition {part!r}")
    return conds


def parse_query(text: str) -> dict[str, Any] | None:
    """The spec of a pairs query (verbatim or generated), found anywhere in `text`; None otherwise."""
    sym = re.search(
        r"where both users have at least one instance with (?:an? )?(.+?)(?:, and (all instances .+?))?\. "
        r"Each of the questions",
        text,
    )
    if sym:
        any_of = [_label(x) for x in sym.group(1).replace(DESC, _SHIELD).split(" or ")]
        clause = None
        if sym.group(2):
            m = _DATE_CLAUSE_RE.search(sym.group(2))
            if m is None:
                return None
            day = datetime.strptime(m.group(3), "%B %d, %Y").date()
            clause = {"label": _label(m.group(1)), "op": m.group(2), "day": day.isoformat()}
        return {"kind": "sym", "any_of": any_of, "date": clause}
    asym = re.search(
        r"such that one user has (.+?), and the other user has (.+?)\. Each of the questions", text
    )
    if asym:
        try:
            return {"kind": "asym", "a": _conditions(asym.group(1)), "b": _conditions(asym.group(2))}
        except ValueError:
            return None
    return None


# -- writing queries -------------------------------------------------------------------------------

_HEAD = "In the above data, list all pairs of user IDs (no duplicate pairs, list lower ID first) "
_TAIL = (
    " Each of the questions can be labelled as one of the labels (the data does not provide the "
    "labels, you need to figure out the label from the semantics of the question): "
    + ", ".join(LABELS)
    + ". In your answer, list all pairs in the format (user_id_1, user_id_2), separated by newlines."
)


def _article(label: str) -> str:
    return ("an " if label[0] in "aeiou" else "a ") + label


def _cond_text(cond: list[Any]) -> str:
    op, k, label = cond
    word = {1: "one", 2: "two", 3: "three"}[k]
    noun = "instance" if k == 1 else "instances"
    return f"{'at least' if op == 'at_least' else 'exactly'} {word} {noun} with {label}"


def _join(items: list[str]) -> str:
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


def generate_query(rng: Any) -> str:
    """A new query in the paper's grammar (symmetric with an optional date clause, or asymmetric)."""
    if rng.random() < 0.5:
        first, second = rng.sample(LABELS, 2)
        body = f"where both users have at least one instance with {_article(first)} or {second}"
        if rng.random() < 0.5:
            which = rng.choice((first, second))
            day = date(2023, rng.randint(1, 12), rng.randint(1, 28))
            op = rng.choice(("after", "before"))
            body += (
                f", and all instances that are {_article(which)} for both users must be {op} "
                f"{_MONTHS[day.month - 1]} {day.day}, {day.year}"
            )
        return _HEAD + body + "." + _TAIL

    def side() -> list[list[Any]]:
        labels = rng.sample(LABELS, rng.randint(1, 3))
        conds = []
        for label in labels:
            op = rng.choice(("at_least", "at_least", "exactly"))
            conds.append([op, rng.choice((1, 1, 2)), label])
        return conds

    one, other = side(), side()
    body = (
        f"such that one user has {_join([_cond_text(c) for c in one])}, and the other user has "
        f"{_join([_cond_text(c) for c in other])}"
    )
    return _HEAD + body + "." + _TAIL


def question_text(query_text: str) -> str:
    return f"{query_text} {official()['answer_suffix_used_by_paper_harness']}"


# -- scoring ---------------------------------------------------------------------------------------


def parse_pairs(answer: str) -> set[tuple[int, int]]:
    """Every (a, b) in the answer, normalised to (low, high); self-pairs dropped."""
    out = set()
    for a, b in _PAIR_RE.findall(answer):
        x, y = int(a), int(b)
        if x != y:
            out.add((min(x, y), max(x, y)))
    return out


def pairs_f1(answer: str, gold: str) -> float:
    predicted, wanted = parse_pairs(answer), parse_pairs(gold)
    if not wanted:
        return 1.0 if not predicted else 0.0
    if not predicted:
        return 0.0
    hit = len(predicted & wanted)
    if hit == 0:
        return 0.0
    precision, recall = hit / len(predicted), hit / len(wanted)
    return 2 * precision * recall / (precision + recall)


# -- the family ------------------------------------------------------------------------------------

DEFAULT_KNOBS: dict[str, Any] = {"query": None, "giveaway": 0.1, "n_users": None}


def default_users(size_chars: int) -> int:
    """About twelve lines per user (OOLONG's density) up to 1,000 users, so gold sets stay bounded."""
    return min(max(8, size_chars // 90 // 12), 1_000)


def generate_pairs(
    size_chars: int, seed: int, *, query: int | str | None, giveaway: float, n_users: int | None
) -> Task:
    rng = seeded_rng(FAMILY, size_chars, seed)
    texts = query_texts()
    if query is None:
        number: int | None = rng.randint(1, 20)
    elif query == "generated":
        number = None
    else:
        try:
            number = int(query)
        except (TypeError, ValueError):
            number = -1
        if number not in texts:
            raise ValueError(f"oolong-pairs query must be 1-20 or 'generated', got {query!r}")
    text = texts[number] if number is not None else generate_query(rng)
    spec = parse_query(text)
    if spec is None:  # a bug in the grammar, not a user error: fail loudly
        raise RuntimeError(f"oolong-pairs could not read its own query: {text!r}")
    users = int(n_users) if n_users else default_users(size_chars)
    lines = oolong.generate_lines(rng, size_chars, giveaway=float(giveaway), n_users=users)
    rows = [(d.isoformat(), u, lab) for d, u, lab in zip(lines.days, lines.users, lines.labels, strict=True)]
    pairs = pairs_for(spec, rows)
    knobs = {"query": query, "giveaway": giveaway, "n_users": n_users}
    context = "\n".join(lines.lines)
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=question_text(text),
        context=context,
        gold=format_pairs(pairs),
        meta={
            "target_chars": size_chars,
            "size_chars": len(context),
            "n_lines": len(lines.lines),
            "n_users": len(set(lines.users)),
            "query_id": number if number is not None else "generated",
            "spec": spec,
            "n_pairs": len(pairs),
            "knobs": knobs,
        },
        hidden={"labels": lines.labels, "users": lines.users, "days": lines.days},
    )


def score_pairs(task: Task, answer: str) -> float:
    return pairs_f1(answer, task.gold)


def solve_pairs(task: Task) -> str:
    spec = parse_query(task.question)
    if spec is None:
        raise ValueError(f"task {task.id} has no pairs query")
    days, users, labels = task.hidden["days"], task.hidden["users"], task.hidden["labels"]
    rows = [(d.isoformat(), u, lab) for d, u, lab in zip(days, users, labels, strict=True)]
    return format_pairs(pairs_for(spec, rows))


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "Label every record with batched sub-calls first and keep (user, date, label) rows in a variable; "
    "then decide each user's eligibility and build the pairs in code, exactly as the query's "
    "conditions say (strict before/after, conditions that hold vacuously). Never ask a sub-model to "
    "list pairs. The pair list can be long: return it with FINAL_VAR."
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_pairs,
        scorer=score_pairs,
        knobs=DEFAULT_KNOBS,
        description="the paper's 20 OOLONG-Pairs queries (and generated ones) over OOLONG lines; O(n^2)",
        solver=solve_pairs,
        tips=TIPS,
    )
)
