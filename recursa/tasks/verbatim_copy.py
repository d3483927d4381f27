"""Verbatim copy (Prime Intellect's knobs) with long outputs of 10K to 10M characters.

The context is a run of marked blocks, `<<<BEGIN id>>>` ... `<<<END id>>>`; the question asks for
one block back, character for character. Each block is made of fragments whose mean length is
`fragment_length`, of one content type (`words`, `json`, `csv`, `codes`) or all of them
(`mixed`). `target_length` sets the block to copy (default: a quarter of the context, at least
1,000 and at most 10M characters), so outputs go far past any model's output limit: an RLM
returns them with FINAL_VAR, a plain model has to write them out.

Scores: `score` is a similarity in [0, 1] that is 1.0 only for an exact copy; `metrics` adds
`exact` (0 or 1) and `similarity`. The similarity aligns the gold text's blocks (8 to 256
characters, by length) in order against the answer within a drift window and returns
2·matched / (len(answer) + len(gold)): linear time, about a second at 10M characters.
"""

from __future__ import annotations

from typing import Any

from recursa.tasks.base import Family, Task, register_family, seeded_rng, task_id

FAMILY = "verbatim-copy"
CONTENT_TYPES = ("words", "json", "csv", "codes", "mixed")
_WORDS = (
    "river stone lantern quiet amber meadow harbor violet copper window garden thread morning "
    "silver orchard candle market ladder winter shadow marble falcon ribbon canvas compass "
    "velvet meadowlark granite willow saffron ember crystal pebble thistle juniper cobalt "
    "hollow summit tidal beacon cinder lattice quarry bramble mosaic"
).split()
_CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
QUESTION_FORM = (
    "Copy the text between the markers <<<BEGIN {id}>>> and <<<END {id}>>> in the context exactly, "
    "character for character, without the markers themselves. Your answer must be exactly that "
    "text ({length:,} characters) and nothing else."
)


def _fragment(rng: Any, kind: str, length: int) -> str:
    # Values are drawn in bulk (random.choices), so a 10M-token context takes seconds, not minutes.
    if kind == "words":
        text = " ".join(rng.choices(_WORDS, k=max(1, length // 7)))
        return text[:1].upper() + text[1:] + "."
    if kind == "codes":
        n = max(1, length // 15)
        chars = "".join(rng.choices(_CODE_CHARS, k=12 * n))
        return " ".join(
            f"{chars[i : i + 4]}-{chars[i + 4 : i + 8]}-{chars[i + 8 : i + 12]}" for i in range(0, 12 * n, 12)
        )
    if kind == "csv":
        n = max(1, length // 26)
        ids = rng.choices(range(1000, 100000), k=n)
        names = rng.choices(_WORDS, k=n)
        qty = rng.choices(range(1, 501), k=n)
        cents = rng.choices(range(1, 10000), k=n)
        rows = [
            f"{i},{w},{q},{c // 100}.{c % 100:02d}" for i, w, q, c in zip(ids, names, qty, cents, strict=True)
        ]
        return "id,name,qty,price\n" + "\n".join(rows)
    n = max(1, length // 22)
    keys = rng.choices(_WORDS, k=n)
    numbers = rng.choices(range(-999, 10000), k=n)
    kinds = rng.choices(range(4), k=n)
    words = rng.choices(_WORDS, k=n)
    items = []
    for key, number, which, word in zip(keys, numbers, kinds, words, strict=True):
        value = (
            str(number)
            if which == 0
            else f'"{word}"'
            if which == 1
            else f"[{number % 10}, {number % 7}, {number % 3}]"
            if which == 2
            else ("true" if number % 2 else "false")
        )
        items.append(f'"{key}{number % 100}": {value}')
    return "{" + ", ".join(items) + "}"


def make_text(rng: Any, length: int, content_type: str, fragment_length: int) -> str:
    """About `length` characters of fragments of the given content type, joined by newlines."""
    kinds = ("words", "json", "csv", "codes") if content_type == "mixed" else (content_type,)
    parts: list[str] = []
    total = 0
    while total < length:
        size = max(8, int(rng.expovariate(1.0 / fragment_length)))
        piece = _fragment(rng, rng.choice(kinds), min(size, length - total + 8))
        parts.append(piece)
        total += len(piece) + 1
    text = "\n".join(parts)
    return text[:length].strip() or "x"


def _block_id(rng: Any) -> str:
    return "".join(rng.choices("abcdefghijkmnpqrstuvwxyz23456789", k=6))


DEFAULT_KNOBS: dict[str, Any] = {"content_type": "mixed", "target_length": None, "fragment_length": 200}


def generate_copy(
    size_chars: int, seed: int, *, content_type: str, target_length: int | None, fragment_length: int
) -> Task:
    if content_type not in CONTENT_TYPES:
        raise ValueError(
            f"verbatim-copy content_type must be one of {', '.join(CONTENT_TYPES)}, got {content_type!r}"
        )
    if int(fragment_length) < 8:
        raise ValueError(f"verbatim-copy fragment_length must be >= 8, got {fragment_length!r}")
    target = int(target_length) if target_length else min(max(1_000, size_chars // 4), 10_000_000)
    if target > size_chars:
        raise ValueError(
            f"verbatim-copy target_length ({target:,}) cannot exceed the context size ({size_chars:,})"
        )
    rng = seeded_rng(FAMILY, size_chars, seed)
    gold_id = _block_id(rng)
    gold = make_text(rng, target, content_type, int(fragment_length))
    # Other blocks around it, of the same kind, so the markers matter.
    blocks: list[tuple[str, str]] = []
    used = {gold_id}
    rest = size_chars - len(gold) - 40
    while rest > 60:
        block_id = _block_id(rng)
        if block_id in used:
            continue
        used.add(block_id)
        length = min(rest - 40, max(50, int(rng.uniform(0.2, 1.0) * min(target, 200_000))))
        blocks.append((block_id, make_text(rng, length, content_type, int(fragment_length))))
        rest -= length + 40
    blocks.insert(rng.randint(0, len(blocks)), (gold_id, gold))
    context = "\n".join(f"<<<BEGIN {b}>>>\n{text}\n<<<END {b}>>>" for b, text in blocks)
    knobs = {"content_type": content_type, "target_length": target_length, "fragment_length": fragment_length}
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=QUESTION_FORM.format(id=gold_id, length=len(gold)),
        context=context,
        gold=gold,
        meta={
            "target_chars": size_chars,
            "size_chars": len(context),
            "block_id": gold_id,
            "copy_chars": len(gold),
            "n_blocks": len(blocks),
            "knobs": knobs,
        },
    )


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix by bisection on slice equality (C-speed compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def similarity(answer: str, gold: str) -> float:
    """2·matched / (len(answer) + len(gold)); 1.0 exactly when answer == gold. Linear time."""
    if answer == gold:
        return 1.0
    if not answer or not gold:
        return 0.0
    head = _common_prefix(answer, gold)
    block = min(256, max(8, len(gold) // 2_000))
    window = 32 * block
    matched, cursor = head, head
    for start in range(head, len(gold), block):
        piece = gold[start : start + block]
        at = answer.find(piece, cursor, cursor + window + len(piece))
        if at >= 0:
            matched += len(piece)
            cursor = at + len(piece)
        else:
            cursor = min(len(answer), cursor + len(piece) // 2)  # follow a drift, but slower than the gold
    # Not identical, so never a perfect score, however close the alignment came.
    return min(2 * matched / (len(answer) + len(gold)), 0.999999)


def _clean(answer: str) -> str:
    # A model's answer may carry the newline its protocol added; the copy itself never starts or ends with one.
    return answer.strip("\n")


def score_copy(task: Task, answer: str) -> float:
    return similarity(_clean(answer), task.gold)


def copy_metrics(task: Task, answer: str) -> dict[str, float]:
    cleaned = _clean(answer)
    return {"exact": 1.0 if cleaned == task.gold else 0.0, "similarity": similarity(cleaned, task.gold)}


def solve_copy(task: Task) -> str:
    block_id = task.meta["block_id"]
    assert isinstance(task.context, str)
    start = task.context.index(f"<<<BEGIN {block_id}>>>\n") + len(f"<<<BEGIN {block_id}>>>\n")
    return task.context[start : task.context.index(f"\n<<<END {block_id}>>>", start)]


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "The answer must match the marked block character for character and may be far longer than any "
    "model's output. Locate the markers with code, slice the block into a variable, check its length, "
    "and answer with FINAL_VAR on that variable; never retype it or pass it through a model."
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_copy,
        scorer=score_copy,
        knobs=DEFAULT_KNOBS,
        description="copy one marked block exactly (content type, target and fragment length knobs); long outputs",
        solver=solve_copy,
        metrics=copy_metrics,
        tips=TIPS,
    )
)
