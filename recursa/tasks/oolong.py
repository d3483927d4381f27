"""OOLONG-style aggregation over labelled lines (trec_coarse): linear work in the context length.

Each line reads `Date: <Mon DD, YYYY> || User: <id> || Instance: <question>`. Every instance has a
hidden label among the six trec_coarse labels. Instances come from many templates and
vocabularies per label, and most templates share their first words with other labels ("Name
the inventor of X" is a human being, "Name the year in which X happened" a numeric value), so the
label takes semantic judgement; the `giveaway` knob sets how often an instance opens with a word
that gives its label away ("Who ...", "Where ...").

`oracle_label` is the world knowledge a capable sub-model brings: it recovers any generated
instance's label from its text. Only the scripted oracle model uses it; code in the REPL does not
have it.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from functools import cache, lru_cache
from string import Formatter
from typing import Any

from recursa.tasks.base import Family, Task, register_family, seeded_rng, task_id
from recursa.tasks.oolong_templates import GIVEAWAYS, LABELS, MIXED, VOCAB
from recursa.tasks.scoring import oolong_score

FAMILY = "oolong"


@dataclass(frozen=True)
class _Template:
    label: str
    text: str
    literals: tuple[str, ...]  # one more than slots
    slots: tuple[tuple[str, ...], ...]  # the vocabulary of each slot

    def fill(self, rand: Any) -> str:
        out = [self.literals[0]]
        for vocab, literal in zip(self.slots, self.literals[1:], strict=True):
            out.append(vocab[int(rand() * len(vocab))])
            out.append(literal)
        return "".join(out)

    def pattern(self) -> str:
        parts = [re.escape(self.literals[0])]
        for vocab, literal in zip(self.slots, self.literals[1:], strict=True):
            parts.append("(?:" + "|".join(re.escape(v) for v in sorted(vocab, key=len, reverse=True)) + ")")
            parts.append(re.escape(literal))
        return "".join(parts)


def _compile(label: str, text: str) -> _Template:
    literals: list[str] = []
    slots: list[tuple[str, ...]] = []
    pending = ""
    for literal, name, _spec, _conv in Formatter().parse(text):
        pending += literal
        if name is not None:
            literals.append(pending)
            pending = ""
            slots.append(VOCAB[name.rstrip("0123456789")])  # {city2} draws from "city"
    literals.append(pending)
    return _Template(label, text, tuple(literals), tuple(slots))


_GIVEAWAY_T = {lab: tuple(_compile(lab, t) for t in ts) for lab, ts in GIVEAWAYS.items()}
_MIXED_T = {lab: tuple(_compile(lab, t) for t in ts) for lab, ts in MIXED.items()}


@cache
def _oracle_regex() -> re.Pattern[str]:
    groups = []
    for i, label in enumerate(LABELS):
        alternatives = "|".join(t.pattern() for t in (*_GIVEAWAY_T[label], *_MIXED_T[label]))
        groups.append(f"(?P<l{i}>{alternatives})")
    return re.compile("|".join(groups))


@lru_cache(maxsize=1 << 16)
def oracle_label(instance_text: str) -> str | None:
    """The label of a generated instance, from its text alone (a whole line works too).

    This is the world knowledge a good sub-model has; None for text no template produced.
    """
    text = instance_text.strip()
    if "Instance:" in text:
        text = text.split("Instance:", 1)[1].strip()
    match = _oracle_regex().fullmatch(text)
    if match is None or match.lastgroup is None:
        return None
    return LABELS[int(match.lastgroup[1:])]


# -- the lines -------------------------------------------------------------------------------------

_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
FIRST_DAY = date(2019, 1, 1)
LAST_DAY = date(2024, 12, 31)
YEARS = tuple(range(FIRST_DAY.year, LAST_DAY.year + 1))
# Label shares: each task gives them to the labels in a seeded order, so every label is sometimes
# the most and sometimes the least common, and the extremes are rarely tied.
_SHARES = (0.27, 0.21, 0.17, 0.14, 0.12, 0.09)


def format_date(day: date) -> str:
    """ "Mar 04, 2021": written out by hand because strftime's %b follows the host locale."""
    return f"{_MONTHS[day.month - 1]} {day.day:02d}, {day.year}"


def parse_line(line: str) -> tuple[date, int, str] | None:
    """(date, user, instance) of one context line, or None for any other line."""
    match = _LINE_RE.match(line)
    if match is None:
        return None
    month, day, year, user, instance = match.groups()
    return date(int(year), _MONTHS.index(month) + 1, int(day)), int(user), instance


_LINE_RE = re.compile(r"Date: ([A-Z][a-z]{2}) (\d{2}), (\d{4}) \|\| User: (\d+) \|\| Instance: (.*)")


@dataclass
class Lines:
    """Generated lines with their hidden truth, aligned index by index."""

    lines: list[str]
    days: list[date]
    users: list[int]
    labels: list[str]
    heavy_users: list[int]


def generate_lines(rng: Any, size_chars: int, *, giveaway: float, n_users: int | None) -> Lines:
    """Lines until `size_chars` characters (newlines included) are filled.

    80% of lines come from 20% of the users; dates spread uniformly over six years. Shared by
    every family built on OOLONG-style lines (e.g. pairs).
    """
    estimated_lines = max(size_chars // 90, 1)
    users_total = n_users if n_users else min(max(5, estimated_lines // 12), 5000)
    user_ids = rng.sample(range(10_000, 100_000), users_total)
    n_heavy = max(1, round(users_total * 0.2))
    heavy, light = user_ids[:n_heavy], user_ids[n_heavy:] or user_ids[:n_heavy]
    order = list(range(len(LABELS)))
    rng.shuffle(order)
    weights = [0.0] * len(LABELS)
    for share, index in zip(_SHARES, order, strict=True):
        weights[index] = share
    cumulative: list[float] = []
    running = 0.0
    for w in weights:
        running += w
        cumulative.append(running)
    first = FIRST_DAY.toordinal()
    all_days = [date.fromordinal(first + i) for i in range(LAST_DAY.toordinal() - first + 1)]
    day_text = [format_date(d) for d in all_days]

    rand = rng.random
    out = Lines([], [], [], [], heavy)
    total = 0
    while total < size_chars:
        label_index = min(bisect.bisect_right(cumulative, rand() * running), len(LABELS) - 1)
        label = LABELS[label_index]
        pool = _GIVEAWAY_T[label] if rand() < giveaway else _MIXED_T[label]
        instance = pool[int(rand() * len(pool))].fill(rand)
        group = heavy if rand() < 0.8 else light
        user = group[int(rand() * len(group))]
        day_index = int(rand() * len(all_days))
        line = f"Date: {day_text[day_index]} || User: {user} || Instance: {instance}"
        if out.lines and total + len(line) + 1 > size_chars and total + (len(line) + 1) / 2 > size_chars:
            break  # the next line would overshoot by more than it fills: stop closer to the target
        out.lines.append(line)
        out.days.append(all_days[day_index])
        out.users.append(user)
        out.labels.append(label)
        total += len(line) + 1
    return out


# -- questions -------------------------------------------------------------------------------------

QUESTION_KINDS = ("count", "most_common", "least_common", "compare", "user_count", "year_count")
# Questions about users and dates (OOLONG's user and timeline questions). Drawn at random only with
# pool="all", so the classic pool keeps generating exactly the tasks it always did.
EXTRA_KINDS = ("user_most", "user_compare", "first_date", "last_date")
ALL_KINDS = QUESTION_KINDS + EXTRA_KINDS

PREAMBLE = (
    "The context lists general-knowledge questions, one per line, in the form "
    "'Date: <date> || User: <user id> || Instance: <question>'. Each of the questions can be labelled "
    "as one of the labels (the data does not provide the labels, you need to figure out the label "
    "from the semantics of the question): " + ", ".join(LABELS) + "."
)
_NUMBER_FORM = "Give your final answer in the form 'Answer: number'."
_COMPARISON_FORM = "where X is 'more common than', 'less common than' or 'same frequency as'."


@dataclass(frozen=True)
class OolongQuery:
    kind: str
    label: str | None = None
    other: str | None = None  # the second label of a comparison
    user: int | None = None
    year: int | None = None
    other_user: int | None = None  # the second user of a user comparison

    @property
    def answer_type(self) -> str:
        if self.kind in ("most_common", "least_common", "user_most"):
            return "exact"
        if self.kind in ("first_date", "last_date"):
            return "date"
        return "comparison" if self.kind in ("compare", "user_compare") else "numeric"

    def text(self) -> str:
        if self.kind == "count":
            ask = f"How many instances should be classified as label '{self.label}'? {_NUMBER_FORM}"
        elif self.kind == "user_count":
            ask = (
                f"How many instances from user {self.user} should be classified as label "
                f"'{self.label}'? {_NUMBER_FORM}"
            )
        elif self.kind == "year_count":
            ask = (
                f"How many instances dated in {self.year} should be classified as label "
                f"'{self.label}'? {_NUMBER_FORM}"
            )
        elif self.kind in ("most_common", "least_common"):
            which = "most" if self.kind == "most_common" else "least"
            ask = (
                f"Which of the labels is the {which} common? Give your final answer in the form "
                "'Label: answer', where answer is one of the labels."
            )
        elif self.kind == "user_most":
            ask = (
                f"Which user has the most instances that should be classified as label '{self.label}'? "
                "Give your final answer in the form 'User: <user id>'."
            )
        elif self.kind == "user_compare":
            ask = (
                f"Are instances classified as label '{self.label}' more common, less common, or the same "
                f"frequency for user {self.user} as for user {self.other_user}? Give your final answer in "
                f"the form 'Answer: user {self.user} is [X] user {self.other_user}', {_COMPARISON_FORM}"
            )
        elif self.kind in ("first_date", "last_date"):
            which = "earliest" if self.kind == "first_date" else "latest"
            ask = (
                f"What is the date of the {which} instance from user {self.user} that should be "
                f"classified as label '{self.label}'? Give your final answer in the form "
                "'Date: Mon DD, YYYY'."
            )
        else:
            ask = (
                f"Is label '{self.label}' more common, less common, or the same frequency as label "
                f"'{self.other}'? Give your final answer in the form 'Answer: {self.label} is [X] "
                f"{self.other}', {_COMPARISON_FORM}"
            )
        return f"{PREAMBLE} {ask}"

    def in_scope(self, year: int, user: int) -> bool:
        """Whether a line counts for this question (user and year filters)."""
        if self.kind == "user_compare":
            return user in (self.user, self.other_user)
        if self.user is not None and user != self.user:
            return False
        return self.year is None or year == self.year


_LABEL_ALT = "|".join(re.escape(label) for label in LABELS)
_QUERY_PATTERNS = (
    (
        "user_count",
        re.compile(rf"How many instances from user (\d+) should be classified as label '({_LABEL_ALT})'"),
    ),
    (
        "year_count",
        re.compile(rf"How many instances dated in (\d{{4}}) should be classified as label '({_LABEL_ALT})'"),
    ),
    ("count", re.compile(rf"How many instances should be classified as label '({_LABEL_ALT})'")),
    ("extreme", re.compile(r"Which of the labels is the (most|least) common\?")),
    (
        "compare",
        re.compile(
            rf"Is label '({_LABEL_ALT})' more common, less common, or the same frequency as label '({_LABEL_ALT})'"
        ),
    ),
    (
        "user_most",
        re.compile(rf"Which user has the most instances that should be classified as label '({_LABEL_ALT})'"),
    ),
    (
        "user_compare",
        re.compile(
            rf"Are instances classified as label '({_LABEL_ALT})' more common, less common, or the same "
            r"frequency for user (\d+) as for user (\d+)\?"
        ),
    ),
    (
        "date",
        re.compile(
            rf"What is the date of the (earliest|latest) instance from user (\d+) that should be classified "
            rf"as label '({_LABEL_ALT})'"
        ),
    ),
)


def parse_question(question: str) -> OolongQuery | None:
    """The structured form of a question this family asks, found anywhere in `question`."""
    for kind, pattern in _QUERY_PATTERNS:
        match = pattern.search(question)
        if match is None:
            continue
        g = match.groups()
        if kind == "user_count":
            return OolongQuery(kind, label=g[1], user=int(g[0]))
        if kind == "year_count":
            return OolongQuery(kind, label=g[1], year=int(g[0]))
        if kind in ("count", "user_most"):
            return OolongQuery(kind, label=g[0])
        if kind == "extreme":
            return OolongQuery(f"{g[0]}_common")
        if kind == "user_compare":
            return OolongQuery(kind, label=g[0], user=int(g[1]), other_user=int(g[2]))
        if kind == "date":
            which = "first_date" if g[0] == "earliest" else "last_date"
            return OolongQuery(which, label=g[2], user=int(g[1]))
        return OolongQuery(kind, label=g[0], other=g[1])
    return None


def label_rows(text: str, labeller: Callable[[str], str | None]) -> list[tuple[int, int, str | None]]:
    """(year, user, label) for every data line in `text`, labelled by `labeller(instance)`."""
    rows = []
    for line in text.splitlines():
        parsed = parse_line(line.strip())
        if parsed is not None:
            day, user, instance = parsed
            rows.append((day.year, user, labeller(instance)))
    return rows


def scoped_counts(query: OolongQuery, rows: Any) -> dict[str, int]:
    """Label counts over the lines a question is about; `rows` yields (year, user, label)."""
    counts = dict.fromkeys(LABELS, 0)
    for year, user, label in rows:
        if label in counts and query.in_scope(year, user):
            counts[label] += 1
    return counts


def answer_for(query: OolongQuery, counts: dict[str, int]) -> str:
    """The answer text in the form the question asks for, from the scoped label counts."""
    if query.kind in ("count", "user_count", "year_count"):
        return f"Answer: {counts[query.label or '']}"
    if query.kind == "most_common":
        return "Label: " + max(LABELS, key=lambda lab: counts[lab])
    if query.kind == "least_common":
        return "Label: " + min(LABELS, key=lambda lab: counts[lab])
    a, b = counts[query.label or ""], counts[query.other or ""]
    relation = "more common than" if a > b else "less common than" if a < b else "same frequency as"
    return f"Answer: {query.label} is {relation} {query.other}"


def gold_for(query: OolongQuery, counts: dict[str, int]) -> str:
    """The gold string the scorer compares against (OOLONG stores the bare value)."""
    text = answer_for(query, counts)
    if query.kind == "compare":
        a, b = counts[query.label or ""], counts[query.other or ""]
        return "more common than" if a > b else "less common than" if a < b else "same frequency as"
    return text.split(": ", 1)[1]


def label_rows_dated(text: str, labeller: Callable[[str], str | None]) -> list[tuple[date, int, str | None]]:
    """(date, user, label) for every data line in `text`: what the user and date questions need."""
    rows = []
    for line in text.splitlines():
        parsed = parse_line(line.strip())
        if parsed is not None:
            day, user, instance = parsed
            rows.append((day, user, labeller(instance)))
    return rows


def answer_rows(query: OolongQuery, rows: Any) -> str:
    """The answer text (in the form the question asks for) from (date, user, label) rows, any kind."""
    rows = list(rows)
    if query.kind in QUESTION_KINDS:
        return answer_for(query, scoped_counts(query, ((d.year, u, lab) for d, u, lab in rows)))
    if query.kind == "user_most":
        per_user: dict[int, int] = {}
        for _day, user, label in rows:
            if label == query.label:
                per_user[user] = per_user.get(user, 0) + 1
        best = max(sorted(per_user), key=lambda u: per_user[u]) if per_user else 0
        return f"User: {best}"
    if query.kind == "user_compare":
        a = sum(1 for _d, u, lab in rows if u == query.user and lab == query.label)
        b = sum(1 for _d, u, lab in rows if u == query.other_user and lab == query.label)
        relation = "more common than" if a > b else "less common than" if a < b else "same frequency as"
        return f"Answer: user {query.user} is {relation} user {query.other_user}"
    days = [d for d, u, lab in rows if u == query.user and lab == query.label]
    if not days:
        return "Date: none"
    return "Date: " + format_date(min(days) if query.kind == "first_date" else max(days))


def gold_rows(query: OolongQuery, rows: Any) -> str:
    """The bare gold value for any kind (what the scorer compares against)."""
    text = answer_rows(query, rows)
    if query.kind in ("compare", "user_compare"):
        for phrase in ("more common than", "less common than", "same frequency as"):
            if phrase in text:
                return phrase
    return text.split(": ", 1)[1]


def _well_posed(query: OolongQuery, rows: list[tuple[date, int, str]]) -> bool:
    """User and date questions need a unique best user and at least one matching line."""
    if query.kind == "user_most":
        per_user: dict[int, int] = {}
        for _d, user, label in rows:
            if label == query.label:
                per_user[user] = per_user.get(user, 0) + 1
        ranked = sorted(per_user.values(), reverse=True)
        return bool(ranked) and (len(ranked) == 1 or ranked[0] > ranked[1])
    if query.kind in ("first_date", "last_date"):
        return any(u == query.user and lab == query.label for _d, u, lab in rows)
    return True


def _pick_query(rng: Any, kind: str, lines: Lines) -> OolongQuery:
    label = LABELS[rng.randrange(len(LABELS))]
    if kind == "user_count":
        return OolongQuery(kind, label=label, user=lines.heavy_users[rng.randrange(len(lines.heavy_users))])
    if kind == "year_count":
        return OolongQuery(kind, label=label, year=YEARS[rng.randrange(len(YEARS))])
    if kind == "compare":
        first, second = rng.sample(LABELS, 2)
        return OolongQuery(kind, label=first, other=second)
    if kind in ("most_common", "least_common"):
        return OolongQuery(kind)
    if kind == "user_most":
        return OolongQuery(kind, label=label)
    if kind == "user_compare":
        pool = lines.heavy_users if len(lines.heavy_users) >= 2 else sorted(set(lines.users))
        if len(pool) < 2:
            return OolongQuery("count", label=label)
        a, b = rng.sample(pool, 2)
        return OolongQuery(kind, label=label, user=a, other_user=b)
    if kind in ("first_date", "last_date"):
        return OolongQuery(kind, label=label, user=lines.heavy_users[rng.randrange(len(lines.heavy_users))])
    return OolongQuery("count", label=label)


DEFAULT_KNOBS: dict[str, Any] = {"giveaway": 0.1, "question": None, "n_users": None, "pool": "classic"}


def generate_oolong(
    size_chars: int,
    seed: int,
    *,
    giveaway: float,
    question: str | None,
    n_users: int | None,
    pool: str = "classic",
) -> Task:
    if not 0.0 <= float(giveaway) <= 1.0:
        raise ValueError(f"oolong giveaway must be between 0 and 1, got {giveaway!r}")
    if question is not None and question not in ALL_KINDS:
        raise ValueError(f"unknown oolong question kind {question!r}; kinds: {', '.join(ALL_KINDS)}")
    if pool not in ("classic", "all"):
        raise ValueError(f"oolong pool must be 'classic' or 'all', got {pool!r}")
    rng = seeded_rng(FAMILY, size_chars, seed)
    lines = generate_lines(rng, size_chars, giveaway=float(giveaway), n_users=n_users)
    kinds = QUESTION_KINDS if pool == "classic" else ALL_KINDS
    kind = question or kinds[rng.randrange(len(kinds))]
    query = _pick_query(rng, kind, lines)
    dated = list(zip(lines.days, lines.users, lines.labels, strict=True))
    for _ in range(20):
        if _well_posed(query, dated):
            break
        query = _pick_query(rng, kind, lines)  # another label or user, seeded: still deterministic
    else:
        query = OolongQuery("count", label=LABELS[rng.randrange(len(LABELS))])
    rows = list(zip([d.year for d in lines.days], lines.users, lines.labels, strict=True))
    counts = scoped_counts(query, rows)
    if query.kind in ("most_common", "least_common") and question is None:
        extreme = max(counts.values()) if query.kind == "most_common" else min(counts.values())
        if list(counts.values()).count(extreme) > 1:
            # A tie has no single right label: ask for a count instead (seeded, so still deterministic).
            query = OolongQuery("count", label=LABELS[rng.randrange(len(LABELS))])
            counts = scoped_counts(query, rows)
    context = "\n".join(lines.lines)
    knobs = {"giveaway": giveaway, "question": question, "n_users": n_users, "pool": pool}
    totals = dict.fromkeys(LABELS, 0)
    for label in lines.labels:
        totals[label] += 1
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=query.text(),
        context=context,
        gold=gold_for(query, counts) if query.kind in QUESTION_KINDS else gold_rows(query, dated),
        meta={
            "target_chars": size_chars,
            "size_chars": len(context),
            "n_lines": len(lines.lines),
            "n_users": len(set(lines.users)),
            "question_kind": query.kind,
            "answer_type": query.answer_type,
            "query": {
                "label": query.label,
                "other": query.other,
                "user": query.user,
                "year": query.year,
                "other_user": query.other_user,
            },
            "label_counts": totals,
            "scoped_counts": counts,
            "knobs": knobs,
        },
        hidden={"labels": lines.labels, "users": lines.users, "days": lines.days},
    )


def score_oolong(task: Task, answer: str) -> float:
    return oolong_score(answer, task.gold, task.meta.get("answer_type"))


def solve_oolong(task: Task) -> str:
    """The reference solver: the question answered from the hidden labels of the context's lines."""
    query = parse_question(task.question)
    if query is None or not isinstance(task.context, str):
        raise ValueError(f"task {task.id} is not a generated oolong task")
    labels = iter(task.hidden["labels"])
    rows = label_rows_dated(task.context, lambda _instance: next(labels))
    return answer_rows(query, rows)


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "Every record needs a semantic judgement that keywords get wrong, so classify every record with "
    "batched sub-calls (a few hundred records per prompt, one label per numbered line back), keep the "
    "labels in a list next to each record's user and date, and do all counting and comparing in code. "
    "Never estimate from a sample or ask a sub-model for the counts."
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_oolong,
        scorer=score_oolong,
        knobs=DEFAULT_KNOBS,
        description="OOLONG-style counting over semantically labelled lines (trec_coarse labels); O(n)",
        solver=solve_oolong,
        tips=TIPS,
    )
)
