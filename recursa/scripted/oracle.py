"""The scripted sub-model: answers the prompts roots write, with the tasks' hidden knowledge.

- Classification prompts (the six labels and numbered instances): one `<n>: <label>` line per
  instance from `oolong.oracle_label`; a single instance gets the bare label. The `noise` knob
  flips a seeded fraction of labels, decided by a hash of the instance text, so the same instance
  is always answered the same way.
- Needle prompts: the value stated for the key asked about, found by regex, or NONE.
- Prompts of the newer families (pairs, multi-hop, code, evidence, copy): `readers.oracle_answer`.
- A whole task question with its lines (what `rlm_query` becomes at the last depth): the answer.
- "Partial answers:" prompts: the partial answer that best matches the question.
- Anything else: the sentence of the prompt that shares the most words with its question.
"""

from __future__ import annotations

import hashlib
import re

from recursa.scripted.heuristics import guess_label
from recursa.scripted.name_options import Settings
from recursa.scripted.readers import oracle_answer
from recursa.tasks import niah, oolong
from recursa.tasks.oolong import LABELS

_NUMBERED = re.compile(r"^[ \t*]*(\d+)[ \t*]*[:.)\]][ \t]*(.+?)[ \t]*$", re.MULTILINE)
_SINGLE = re.compile(r"^[ \t]*(?:Question|Instance|Text)[ \t]*:[ \t]*(.+?)[ \t]*$", re.MULTILINE)
_LOOSE_KEY = re.compile(r"magic number for ([A-Za-z0-9_-]++)(?! is \d)")
_WORD = re.compile(r"[a-z0-9]{3,}")
_STOP = frozenset(
    "the and what which who for are was with that this from how does did has have its into "
    "about your you reply answer question text only none one short sentence".split()
)


def answer_prompt(prompt: str, settings: Settings) -> str:
    key = niah.parse_question(prompt)
    if key is None and "magic number for" in prompt:
        loose = _LOOSE_KEY.search(prompt)
        key = loose.group(1) if loose else None
    if key is not None:
        return niah.find_needle(prompt, key) or _stated_number(prompt, key) or "NONE"
    newer = oracle_answer(prompt, lambda instance: label_for(instance, settings))
    if newer is not None:
        return newer
    query = oolong.parse_question(prompt)
    if query is not None:
        rows = oolong.label_rows(prompt, lambda instance: label_for(instance, settings))
        if rows:
            return oolong.answer_for(query, oolong.scoped_counts(query, rows))
    if "Partial answers:" in prompt:  # before labels: a combine prompt may quote a label question
        return _combine(prompt)
    if sum(label in prompt.lower() for label in LABELS) >= 3:
        return _classify(prompt, settings)
    return extract_answer(prompt)


def _stated_number(prompt: str, key: str) -> str | None:
    """A reader, unlike a strict regex, also gets "the number for <key> is, as noted, 1234567"."""
    match = re.search(re.escape(key) + r"(?! mentioned)\D{0,60}?(\d{5,})", prompt)
    return match.group(1) if match else None


def label_for(text: str, settings: Settings) -> str:
    """What the sub-model says the label of one instance is (knowledge, then noise)."""
    instance = text.split("Instance:", 1)[1].strip() if "Instance:" in text else text.strip()
    label = oolong.oracle_label(instance) or guess_label(instance)
    if settings.noise <= 0.0:
        return label
    digest = hashlib.blake2b(f"{settings.seed}\x00{instance}".encode(), digest_size=8).digest()
    if int.from_bytes(digest[:4], "big") / 2**32 >= settings.noise:
        return label
    shift = 1 + digest[4] % (len(LABELS) - 1)  # any other label, never the right one
    return LABELS[(LABELS.index(label) + shift) % len(LABELS)]


def _classify(prompt: str, settings: Settings) -> str:
    numbered = [
        (m.group(1), m.group(2))
        for m in _NUMBERED.finditer(prompt)
        if m.group(2).strip(" .").lower() not in LABELS  # a root listing the labels as "1. entity"
    ]
    if numbered:
        return "\n".join(f"{n}: {label_for(text, settings)}" for n, text in numbered)
    singles = _SINGLE.findall(prompt)
    if singles:
        return label_for(singles[-1], settings)
    known = [line for line in prompt.splitlines() if oolong.oracle_label(line)]
    lines = known or [line for line in prompt.splitlines() if line.strip()]
    return label_for(lines[-1], settings) if lines else "entity"


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower())) - _STOP


def _question_of(prompt: str) -> str:
    match = re.search(r"Question:[ \t]*(.+)", prompt)
    if match:
        return match.group(1).strip()
    asks = [line.strip() for line in prompt.splitlines() if line.strip().endswith("?")]
    if asks:
        return asks[-1]
    return next((line.strip() for line in prompt.splitlines() if line.strip()), "")


def _combine(prompt: str) -> str:
    question = _words(_question_of(prompt))
    tail = prompt.split("Partial answers:", 1)[1]
    partials = [m.group(2).strip() for m in _NUMBERED.finditer(tail)]
    partials = [p for p in partials if p.upper() != "NONE"]
    if not partials:
        return "NONE"
    return max(partials, key=lambda p: len(question & _words(p)))


def extract_answer(prompt: str) -> str:
    """The sentence that shares the most words with the prompt's question (NONE if none does)."""
    question_text = _question_of(prompt)
    question = _words(question_text)
    text = prompt.split("Text:", 1)[1] if "Text:" in prompt else prompt
    best, best_overlap = "NONE", 0
    for sentence in re.split(r"(?<=[.!?])\s+|\n+", text):
        sentence = sentence.strip()
        if not sentence or sentence == question_text:
            continue
        overlap = len(question & _words(sentence))
        if overlap > best_overlap:
            best, best_overlap = sentence, overlap
    return best
