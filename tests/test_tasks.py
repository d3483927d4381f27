"""Task generators and scorers: determinism, sizes, exact gold answers, OOLONG scoring rules."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from recursa.tasks import Task, families, generate, get_family
from recursa.tasks.niah import needle_sentence
from recursa.tasks.oolong import (
    _GIVEAWAY_T,
    _MIXED_T,
    LABELS,
    QUESTION_KINDS,
    oracle_label,
    parse_question,
)
from recursa.tasks.scoring import contains_token, oolong_parse, oolong_score

LINE = re.compile(r"^Date: ([A-Z][a-z]{2}) (\d{2}), (\d{4}) \|\| User: (\d+) \|\| Instance: ([^\n|]+)$")
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]


def _lines(task: Task) -> list[re.Match[str]]:
    matches = [LINE.match(line) for line in task.context.split("\n")]
    assert all(matches), "every context line has the OOLONG form"
    return [m for m in matches if m]


def _text(task: Task) -> str:
    ctx = task.context
    if isinstance(ctx, str):
        return ctx
    return "\n\n".join(ctx.values() if isinstance(ctx, dict) else ctx)


# -- registry ------------------------------------------------------------------------------------


def test_registry_lists_families_and_rejects_unknown_names() -> None:
    assert {"niah", "oolong"} <= set(families())
    with pytest.raises(ValueError, match=r"niah.*oolong"):
        generate("no-such-family", 10_000)
    with pytest.raises(ValueError, match=r"unknown knob.*colour"):
        generate("niah", 10_000, colour="red")
    with pytest.raises(ValueError, match="positive"):
        generate("niah", 0)
    with pytest.raises(ValueError, match="question kind"):
        generate("oolong", 10_000, question="median")


@pytest.mark.parametrize("family", ["niah", "oolong"])
def test_generation_is_deterministic_per_seed(family: str) -> None:
    a, b = generate(family, 60_000, seed=4), generate(family, 60_000, seed=4)
    assert (a.id, a.question, a.context, a.gold, a.meta) == (b.id, b.question, b.context, b.gold, b.meta)
    c = generate(family, 60_000, seed=5)
    assert c.context != a.context
    assert generate(family, 60_000, seed=4, **_a_knob(family)).id != a.id  # knobs show in the id


def _a_knob(family: str) -> dict[str, object]:
    return {"distractors": 1} if family == "niah" else {"giveaway": 0.5}


@pytest.mark.parametrize("family", ["niah", "oolong"])
@pytest.mark.parametrize("size", [2_000, 37_000, 250_000, 1_000_000])
def test_sizes_are_honoured_within_five_percent(family: str, size: int) -> None:
    for seed in range(3):
        task = generate(family, size, seed=seed)
        assert abs(task.size_chars - size) <= 0.05 * size, (seed, task.size_chars)
        assert task.meta["size_chars"] == task.size_chars


def test_ten_million_characters_are_generated_to_size() -> None:
    # How fast is benchmarks/families_10m.py's to say (the suite times nothing).
    for family in ("niah", "oolong"):
        big = generate(family, 10_000_000, seed=1)
        assert abs(big.size_chars - 10_000_000) < 100_000


# -- niah ----------------------------------------------------------------------------------------


def test_niah_has_one_needle_for_the_key_and_distractors_for_others() -> None:
    for seed in range(5):
        task = generate("niah", 80_000, seed=seed)
        text = _text(task)
        key = task.meta["key"]
        assert key in task.question and re.fullmatch(r"\d{7}", task.gold)
        assert text.count(needle_sentence(key, task.gold)) == 1
        assert text.count(f"magic number for {key} ") == 1
        others = re.findall(r"special magic number for ([\w-]+) is (\d{7})", text)
        assert len(others) == 4 and len({k for k, _ in others}) == 4
        assert set(re.findall(r"\d{7}", text)) == {v for _, v in others}  # no other 7-digit numbers
        assert task.score(f"The number is {task.gold}.") == 1.0


def test_niah_haystack_is_varied_prose() -> None:
    task = generate("niah", 200_000, seed=2)
    sentences = [s for s in re.split(r"(?<=\.)\s+", _text(task)) if s]
    counts = Counter(sentences)
    assert len(counts) > 0.8 * len(sentences)  # almost every sentence is different
    assert counts.most_common(1)[0][1] < 0.01 * len(sentences)


def test_niah_depth_knob_places_the_needle() -> None:
    for depth in (0.0, 0.25, 0.5, 0.9, 1.0):
        task = generate("niah", 100_000, seed=3, depth=depth, distractors=0)
        where = task.context.index(needle_sentence(task.meta["key"], task.gold)) / len(task.context)
        assert abs(where - depth) < 0.02, (depth, where)
        assert task.hidden["needle_offset"] == task.context.index("The special magic number")


@pytest.mark.parametrize("shape", ["list", "dict"])
def test_niah_list_and_dict_contexts(shape: str) -> None:
    task = generate("niah", 120_000, seed=1, shape=shape, pieces=6)
    assert isinstance(task.context, list if shape == "list" else dict)
    assert 4 <= len(task.context) <= 6
    pieces = task.context.values() if isinstance(task.context, dict) else task.context
    assert sum(p.count(f"magic number for {task.meta['key']} is {task.gold}") for p in pieces) == 1


def test_niah_score_needs_the_whole_token() -> None:
    task = generate("niah", 5_000, seed=0)
    gold = task.gold
    assert task.score(gold) == 1.0
    assert task.score(f"Answer: {gold}") == 1.0
    assert task.score(f"1{gold}") == 0.0
    assert task.score(f"{gold}5") == 0.0
    assert task.score(f"x{gold}") == 0.0
    assert task.score(gold[:-1]) == 0.0
    assert contains_token("value (1234567).", "1234567") == 1.0


# -- oolong --------------------------------------------------------------------------------------


def _reference_answer(task: Task) -> str:
    """Brute force from the context text and the hidden labels alone."""
    rows = []
    for match, label in zip(_lines(task), task.hidden["labels"], strict=True):
        month, day, year, user, _instance = match.groups()
        rows.append((int(year), int(user), label, MONTHS.index(month), int(day)))
    q = task.meta["query"]
    kind = task.meta["question_kind"]
    scoped = [
        r
        for r in rows
        if (q["user"] is None or r[1] == q["user"]) and (q["year"] is None or r[0] == q["year"])
    ]
    counts = {lab: sum(1 for r in scoped if r[2] == lab) for lab in LABELS}
    if kind in ("count", "user_count", "year_count"):
        return str(counts[q["label"]])
    if kind == "most_common":
        ranked = sorted(LABELS, key=lambda lab: -counts[lab])
        assert counts[ranked[0]] > counts[ranked[1]]  # a unique answer
        return ranked[0]
    if kind == "least_common":
        ranked = sorted(LABELS, key=lambda lab: counts[lab])
        assert counts[ranked[0]] < counts[ranked[1]]
        return ranked[0]
    a, b = counts[q["label"]], counts[q["other"]]
    return {True: "more common than", False: "less common than"}[a > b] if a != b else "same frequency as"


@pytest.mark.parametrize("kind", QUESTION_KINDS)
def test_oolong_gold_equals_a_brute_force_solver(kind: str) -> None:
    for seed in range(4):
        task = generate("oolong", 40_000, seed=seed, question=kind)
        assert task.meta["question_kind"] == kind
        assert task.gold == _reference_answer(task)
        assert parse_question(task.question) is not None
        assert task.question.rstrip().endswith(
            ("'Answer: number'.", "one of the labels.", "'same frequency as'.")
        )


def test_oolong_default_questions_are_mixed_and_unambiguous() -> None:
    kinds = Counter()
    for seed in range(30):
        task = generate("oolong", 20_000, seed=seed)
        kinds[task.meta["question_kind"]] += 1
        assert task.gold == _reference_answer(task)
    assert len(kinds) >= 5


def test_oolong_lines_users_dates_and_labels() -> None:
    task = generate("oolong", 400_000, seed=8)
    parsed = _lines(task)
    users = Counter(m.group(4) for m in parsed)
    top = sorted(users.values(), reverse=True)[: round(len(users) * 0.2)]
    assert 0.75 < sum(top) / len(parsed) < 0.9  # 80% of lines from 20% of users
    assert len({m.group(3) for m in parsed}) >= 5  # several years
    assert set(task.hidden["labels"]) == set(LABELS)
    assert len(task.hidden["labels"]) == len(parsed) == task.meta["n_lines"]
    instances = [m.group(5) for m in parsed]
    assert len(set(instances)) > 0.3 * len(instances)
    assert task.meta["label_counts"] == dict(Counter(task.hidden["labels"]))


def test_oracle_label_recovers_every_template_fill() -> None:
    checked = 0
    for templates in (*_GIVEAWAY_T.values(), *_MIXED_T.values()):
        for template in templates:
            for fill in itertools.product(*template.slots):
                text = "".join(
                    itertools.chain.from_iterable(zip(template.literals, (*fill, ""), strict=True))
                )
                assert oracle_label(text) == template.label, text
                checked += 1
    assert checked > 2_000
    assert oracle_label("Date: Jan 01, 2020 || User: 1 || Instance: Who painted Guernica?") == "human being"
    assert oracle_label("What is the airspeed of an unladen swallow?") is None


def _first_words_label(text: str) -> str:
    """What a regex on the first words gets: the heuristic code in a REPL could write."""
    low = text.lower()
    for prefix, label in (
        ("who ", "human being"),
        ("where ", "location"),
        ("when ", "numeric value"),
        ("how many ", "numeric value"),
        ("how much ", "numeric value"),
        ("how far ", "numeric value"),
        ("how tall ", "numeric value"),
        ("why ", "description and abstract concept"),
        ("define ", "description and abstract concept"),
        ("describe ", "description and abstract concept"),
        ("expand ", "abbreviation"),
        ("abbreviate ", "abbreviation"),
        ("what kind of", "entity"),
        ("what type of", "entity"),
    ):
        if low.startswith(prefix):
            return label
    return "entity"


@pytest.mark.parametrize(
    ("giveaway", "heuristic_range"), [(0.0, (0.1, 0.3)), (0.1, (0.15, 0.4)), (1.0, (0.99, 1.0))]
)
def test_oracle_is_exact_where_first_word_rules_are_not(
    giveaway: float, heuristic_range: tuple[float, float]
) -> None:
    task = generate("oolong", 300_000, seed=11, giveaway=giveaway)
    instances = [line.split("Instance: ", 1)[1] for line in task.context.split("\n")]
    truth = task.hidden["labels"]
    oracle = sum(oracle_label(i) == t for i, t in zip(instances, truth, strict=True)) / len(truth)
    first_words = sum(_first_words_label(i) == t for i, t in zip(instances, truth, strict=True)) / len(truth)
    assert oracle == 1.0
    low, high = heuristic_range
    assert low <= first_words <= high, first_words


# -- scoring -------------------------------------------------------------------------------------


def test_oolong_parse_follows_the_official_rules() -> None:
    assert oolong_parse("Answer: 12") == "12"
    assert oolong_parse("Label: x. Final Answer: 7") == "7"  # text after the LAST colon
    assert oolong_parse("**Answer: 12**") == "12"  # bold dropped
    assert oolong_parse("Answer: [entity]") == "entity"  # brackets dropped
    assert oolong_parse("12") == "12"  # no colon, short: the whole answer
    assert oolong_parse("I counted them all and got 12") == "12"  # no colon, long: the last word
    assert oolong_parse("Answer: entity is more common than location") == "more common"
    assert oolong_parse("Answer: less common") == "less common"


@pytest.mark.parametrize(
    ("answer", "gold", "kind", "expected"),
    [
        ("Answer: 12", "12", "numeric", 1.0),
        ("Answer: 10", "12", "numeric", 0.75**2),
        ("Answer: 15", "12", "numeric", 0.75**3),
        ("The count. Answer: 11", "12", "numeric", 0.75),
        ("Answer: twelve", "12", "numeric", 0.0),
        ("Answer: 12.", "12", "numeric", 1.0),  # lenient: the official int() would give 0
        ("Answer: 1,204", "1204", "numeric", 1.0),
        ("Label: human being", "human being", "exact", 1.0),
        ("Label: Human Being", "human being", "exact", 1.0),
        ("Label: 'location'", "location", "exact", 1.0),
        ("Label: location", "human being", "exact", 0.0),
        ("Label: human", "human being", "exact", 0.0),
        ("Answer: entity is more common than location", "more common than", "comparison", 1.0),
        ("Answer: entity is less common than location", "more common than", "comparison", 0.0),
        ("Answer: more common", "more common than", "comparison", 1.0),
        ("Answer: same frequency", "same frequency as", "comparison", 1.0),
        ("Answer: Jan 06, 2023", "2023-01-06", "date", 1.0),
        ("Answer: January 6, 2023", "2023-01-06", "date", 1.0),
        ("Answer: Jan 07, 2023", "2023-01-06", "date", 0.0),
    ],
)
def test_oolong_score_cases(answer: str, gold: str, kind: str, expected: float) -> None:
    assert oolong_score(answer, gold, kind) == pytest.approx(expected)
    if kind != "exact":
        assert oolong_score(answer, gold) == pytest.approx(expected)  # the type inferred from the gold


def test_task_score_dispatches_to_the_family_scorer() -> None:
    task = generate("oolong", 30_000, seed=2, question="count")
    gold = int(task.gold)
    assert task.score(f"Answer: {gold}") == 1.0
    assert task.score(f"Answer: {gold + 2}") == pytest.approx(0.75**2)
    label_task = generate("oolong", 30_000, seed=2, question="most_common")
    assert label_task.score(f"Label: {label_task.gold}") == 1.0
    assert get_family("niah").scorer is not get_family("oolong").scorer
