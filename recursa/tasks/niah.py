"""Single needle in a haystack (RULER's S-NIAH): constant work however long the context is.

The haystack is prose made from a small grammar (many sentence shapes and vocabularies, so no
line repeats often enough to be filtered away), with one needle "The special magic number for
<key> is <7-digit value>." at a seeded depth and distractor needles for other keys.
"""

from __future__ import annotations

import re
from typing import Any

from recursa.tasks.base import (
    Family,
    Task,
    context_chars,
    register_family,
    seeded_rng,
    split_pieces,
    task_id,
)
from recursa.tasks.scoring import contains_token

FAMILY = "niah"


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split("|"))


_SUBJECTS = _words(
    "The old lighthouse keeper | A quiet engineer | Most of the gardeners | The committee | Every "
    "sailor in the harbour | Our neighbour | The museum curator | A travelling musician | The "
    "village baker | Two students | The night nurse | A retired pilot | The shepherd | Her "
    "younger brother | The orchestra | A careful historian | The ferry captain | Several farmers "
    "| The librarian | A young cartographer | The town council | My grandmother | The clockmaker "
    "| A group of hikers | The school principal | The fisherman | A visiting poet | The "
    "stationmaster | An elderly beekeeper | The carpenter's apprentice"
)
_VERBS = _words(
    "repaired | described | painted | ignored | measured | collected | studied | rearranged | "
    "photographed | carried | forgot | remembered | inspected | borrowed | sketched | discussed | "
    "polished | counted | admired | returned | wrapped | questioned | mapped | catalogued | "
    "replaced"
)
_OBJECTS = _words(
    "the broken fence | a list of rivers | three copper kettles | the morning tide tables | an "
    "old wooden chest | the faded wallpaper | a box of letters | the stone bridge | the garden "
    "wall | a basket of pears | the church bells | a pair of brass compasses | the harbour charts "
    "| an unfinished quilt | the bakery accounts | the orchard gate | a jar of buttons | the "
    "weather vane | a stack of postcards | the village records | the lantern frames | a torn "
    "umbrella | the chess set | the sheep pens | the attic windows"
)
_TAILS = _words(
    "before the storm arrived | in the spring of that year | with surprising patience | while the "
    "town slept | after a long argument | for the third time that week | without telling anyone | "
    "under a grey sky | as the bells rang | despite the cold | on a quiet Sunday | just before "
    "dawn | in complete silence | with borrowed tools | late in the autumn | near the old mill | "
    "by the light of a candle | during the festival | for reasons nobody recalled | with great "
    "care"
)
_ADJECTIVES = _words(
    "quiet | crowded | damp | bright | narrow | windy | peaceful | muddy | golden | chilly | busy "
    "| forgotten | tidy | restless | sunny | foggy"
)
_PLACES = _words(
    "the market square | the valley | the northern road | the harbour | the old quarter | the "
    "hills | the riverbank | the station | the orchard | the library | the coast | the village "
    "green | the workshop | the lower meadow"
)
_THINGS = _words(
    "the rain | the river | the wind | the clock tower | the ferry | the chimney smoke | the "
    "evening train | the tide | the frost | the church choir | the seagulls | the bakery"
)
_PATTERNS = (
    "{S} {V} {O} {T}.",
    "{S} {V} {O}.",
    "It was {A} in {P}, and {s} {V} {O}.",
    "Nobody expected {O} to be so {A}.",
    "In {P}, {s} {V} {O} {T}.",
    "{S} said that {O} had been {V} {T}.",
    "By the time {x} reached {P}, {s} had {V} {O}.",
    "Some people claim {x} is never {A} in {P}.",
    "{S} walked to {P} and {V} {O}.",
    "Later, {s} {V} {O} and then {V2} {O2}.",
)
_KEY_LEFT = _words(
    "adorable | silent | brave | crimson | gentle | hollow | jagged | lucky | mellow | nimble | "
    "odd | proud | rapid | shiny | tender | vivid | wary | zesty | amber | bitter | calm | dusty "
    "| eager | frozen | grumpy | humble | icy | jolly | keen | lofty"
)
_KEY_RIGHT = _words(
    "advice | harbor | pencil | meadow | lantern | oyster | saddle | thimble | violin | walnut | "
    "anchor | blossom | cactus | dolphin | ember | falcon | glacier | hammock | island | jacket | "
    "kettle | ladder | mitten | nectar | orchid | parrot | quarry | ribbon | spindle | tunnel"
)
_QUESTION = (
    "Some special magic numbers are hidden in the context. What is the special magic number for "
    "{key} mentioned in the context? Answer with the 7-digit number only."
)
_QUESTION_RE = re.compile(r"special magic number for ([A-Za-z0-9_-]+) mentioned in")
DEFAULT_KNOBS: dict[str, Any] = {
    "depth": None,
    "distractors": 3,
    "shape": "str",
    "pieces": 8,
    "haystack": "prose",
}
# RULER's "noise" haystack: the same five sentences over and over.
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


def needle_sentence(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def parse_question(question: str) -> str | None:
    """The key a NIAH question asks about, or None if `question` is not one."""
    found = _QUESTION_RE.findall(question)
    return found[-1] if found else None


def find_needle(text: str, key: str) -> str | None:
    """The value stated for `key` in `text` (what a careful reader or a regex finds)."""
    match = re.search(r"special magic number for " + re.escape(key) + r" is (\d+)", text)
    return match.group(1) if match else None


def _sentence(rng: Any) -> str:
    pick = rng.choice
    subject = pick(_SUBJECTS)
    return pick(_PATTERNS).format(
        S=subject,
        s=subject[0].lower() + subject[1:],
        V=pick(_VERBS),
        V2=pick(_VERBS),
        O=pick(_OBJECTS),
        O2=pick(_OBJECTS),
        T=pick(_TAILS),
        A=pick(_ADJECTIVES),
        P=pick(_PLACES),
        x=pick(_THINGS),
    )


def generate_niah(
    size_chars: int,
    seed: int,
    *,
    depth: float | None,
    distractors: int,
    shape: str,
    pieces: int,
    haystack: str = "prose",
) -> Task:
    if haystack not in ("prose", "noise"):
        raise ValueError(f"niah haystack must be 'prose' or 'noise', got {haystack!r}")
    if shape not in ("str", "list", "dict"):
        raise ValueError(f"niah shape must be 'str', 'list' or 'dict', got {shape!r}")
    if depth is not None and not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"niah depth must be between 0 and 1, got {depth!r}")
    rng = seeded_rng(FAMILY, size_chars, seed)
    keys = rng.sample([f"{a}-{b}" for a in _KEY_LEFT for b in _KEY_RIGHT], int(distractors) + 1)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), len(keys))]
    needles = [needle_sentence(k, v) for k, v in zip(keys, values, strict=True)]
    budget = size_chars - sum(len(n) + 1 for n in needles)

    # Sentences with their separators; a blank line every few sentences makes paragraphs.
    sentences: list[str] = []
    total = 0
    until_break = rng.randint(4, 9)
    while total < budget:
        until_break -= 1
        sep = "\n\n" if until_break == 0 else " "
        if until_break == 0:
            until_break = rng.randint(4, 9)
        body = (
            NOISE_SENTENCES[len(sentences) % len(NOISE_SENTENCES)] if haystack == "noise" else _sentence(rng)
        )
        sentence = body + sep
        if sentences and total + len(sentence) / 2 >= budget:
            break  # the sentence would overshoot by more than it fills: stop closer to the target
        sentences.append(sentence)
        total += len(sentence)
    n = len(sentences)
    needle_depth = rng.random() if depth is None else float(depth)
    slots = {min(round(needle_depth * n), n): 0}
    for i in range(1, len(needles)):
        spot = rng.randint(0, n)
        while spot in slots:
            spot = rng.randint(0, n)
        slots[spot] = i

    parts: list[str] = []
    offset = 0
    needle_offset = 0
    for i in range(n + 1):
        if i in slots:
            if slots[i] == 0:
                needle_offset = offset
            parts.append(needles[slots[i]] + " ")
            offset += len(parts[-1])
        if i < n:
            parts.append(sentences[i])
            offset += len(sentences[i])
    text = "".join(parts).rstrip()

    context: str | list[str] | dict[str, str] = text
    if shape != "str":
        docs = split_pieces(text, int(pieces))
        context = docs if shape == "list" else {f"doc_{i:03d}.txt": d for i, d in enumerate(docs)}
    knobs = {
        "depth": depth,
        "distractors": distractors,
        "shape": shape,
        "pieces": pieces,
        "haystack": haystack,
    }
    return Task(
        id=task_id(FAMILY, size_chars, seed, knobs, DEFAULT_KNOBS),
        family=FAMILY,
        question=_QUESTION.format(key=keys[0]),
        context=context,
        gold=values[0],
        meta={
            "target_chars": size_chars,
            "size_chars": context_chars(context),
            "key": keys[0],
            "depth": round(needle_depth, 4),
            "distractors": len(needles) - 1,
            "shape": shape,
            "knobs": knobs,
        },
        hidden={"needle_offset": needle_offset, "distractor_keys": keys[1:], "distractor_values": values[1:]},
    )


def score_niah(task: Task, answer: str) -> float:
    return contains_token(answer, task.gold)


def solve_niah(task: Task) -> str:
    """The reference solver: the value the needle sentence states for the key asked about."""
    key = parse_question(task.question) or ""
    ctx = task.context
    text = ctx if isinstance(ctx, str) else "\n\n".join(ctx.values() if isinstance(ctx, dict) else ctx)
    return find_needle(text, key) or "NONE"


# Strategy for the root (rlm-tips): what works on this family, in our words.
TIPS = (
    "The answer is one short fact stated once, in a fixed sentence, somewhere in the context; "
    "other keys have similar sentences. Find it with code first (a regex or substring search for the "
    "key named in the question), print the text around each hit, and check that the key matches "
    "exactly. Read pieces with sub-models only if code finds nothing."
)


register_family(
    Family(
        name=FAMILY,
        generator=generate_niah,
        scorer=score_niah,
        knobs=DEFAULT_KNOBS,
        description="one needle (a 7-digit magic number for a key) in generated prose; O(1)",
        solver=solve_niah,
        tips=TIPS,
    )
)
