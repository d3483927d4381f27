"""How the scripted models read text for the newer task families.

Two readers, both honest (they see only the prompt text):

- `oracle_answer`: the sub-model's knowledge. It understands every generated sentence form (the
  world facts of multihop-docs, the code subset of codeqa, the result sentences of evidence-spans,
  the OOLONG labels), so for any text it is handed it answers what a capable reader of that text
  would: exactly, or NONE when the text does not say.
- `direct_answer`: a model reading a whole raw context in its own window (base model, CodeAct,
  summary agent). Literal look-ups are exact (needles, marked blocks, up to its output limit),
  semantic judgements fall back to keyword rules (OOLONG labels), code is read carelessly (the
  first definition of a name wins, imports ignored), evidence is every sentence naming both
  entities, and world facts are noticed with probability min(1, (attention / prompt tokens) ** 0.5)
  per fact, seeded by the sentence: long inputs lose facts ("context rot").
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable

from recursa.lm.tokens import count_tokens
from recursa.scripted.heuristics import guess_label
from recursa.scripted.name_options import Settings
from recursa.tasks import codeqa, evidence_spans, multihop_facts, oolong, oolong_pairs
from recursa.tasks.code_eval import evaluate, files_in
from recursa.tasks.multihop_facts import ANCHOR_RELATION, YEAR_OF, Chain, read_facts
from recursa.tasks.pairs_logic import format_pairs, pairs_for

_TASK_RE = re.compile(r"<task>\s*\n(.*?)\n\s*</task>", re.DOTALL)
_COPY_RE = re.compile(r"between the markers <<<BEGIN (\w+)>>> and <<<END \1>>>")
_PAPER_HEADER = re.compile(r"^(?:### |Paper: )(P\d{3,})\s*$", re.MULTILINE)


def split_task(text: str) -> tuple[str, str]:
    """(question, rest) of a baseline prompt: the last <task> block, and everything else."""
    found = list(_TASK_RE.finditer(text))
    if not found:
        return text, text
    m = found[-1]
    return m.group(1).strip(), text[: m.start()] + text[m.end() :]


# -- facts and chains ------------------------------------------------------------------------------


def _kb(facts: list[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    kb: dict[str, dict[str, str]] = {}
    for subject, kind, obj in facts:
        kb.setdefault(subject, {}).setdefault(kind, obj)
    return kb


def find_anchor(kb: dict[str, dict[str, str]], chain: Chain) -> str | None:
    year_key, city_key = YEAR_OF[chain.anchor_type], ANCHOR_RELATION[chain.anchor_type]
    found = sorted(
        s for s, f in kb.items() if f.get(year_key) == str(chain.year) and f.get(city_key) == chain.city
    )
    return found[0] if found else None


def resolve_chain(kb: dict[str, dict[str, str]], chain: Chain) -> str | None:
    current = find_anchor(kb, chain)
    for relation in chain.relations:
        if current is None:
            return None
        current = kb.get(current, {}).get(relation)
    return current


def _noticed(sentence: str, p: float) -> bool:
    if p >= 1.0:
        return True
    digest = hashlib.blake2b(sentence.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") / 2**32 < p


# -- the oracle ------------------------------------------------------------------------------------


def oracle_answer(prompt: str, label: Callable[[str], str]) -> str | None:
    """The answer to a sub-prompt of one of the newer families, or None if it is not one."""
    copy = _COPY_RE.search(prompt)
    if copy:
        return _copy_block(prompt, copy.group(1)) or "NONE"
    pairs_spec = oolong_pairs.parse_query(prompt)
    if pairs_spec is not None:
        rows = [(d.isoformat(), u, lab) for d, u, lab in oolong.label_rows_dated(prompt, label)]
        return format_pairs(pairs_for(pairs_spec, rows)) if rows else "NONE"
    query = oolong.parse_question(prompt)
    if query is not None and query.kind in oolong.EXTRA_KINDS:
        rows_dated = oolong.label_rows_dated(prompt, label)
        return oolong.answer_rows(query, rows_dated) if rows_dated else "NONE"
    # Hop questions ("Who founded X?") are also ordinary trivia: only a prompt that hands over
    # documents is a multi-hop sub-question.
    sub = multihop_facts.parse_sub_question(prompt) if "Documents:\n" in prompt else None
    if sub is not None:
        kb = _kb(read_facts(prompt))
        if sub[0] == "anchor":
            chain = sub[1]
            assert isinstance(chain, Chain)
            return find_anchor(kb, chain) or "NONE"
        relation = sub[0].split(":", 1)[1]
        entity = str(sub[1])
        aliases = multihop_facts.read_aliases(prompt)
        return kb.get(aliases.get(entity, entity), {}).get(relation) or "NONE"
    chain = multihop_facts.parse_question(prompt)
    if chain is not None:
        found = resolve_chain(_kb(read_facts(prompt)), chain)
        return f"Exact Answer: {found}" if found else "NONE"
    code_q = codeqa.parse_question(prompt)
    if code_q is not None:
        module, function, arg, choices = code_q
        value = evaluate(files_in(prompt), module, function, arg)
        letter = next((k for k, v in choices.items() if v == str(value)), None)
        return f"The correct answer is ({letter})" if letter else "NONE"
    asked = evidence_spans.parse_question(prompt)
    if asked is not None:
        return json.dumps(_evidence(prompt, asked, semantic=True), ensure_ascii=False)
    return None


def _copy_block(text: str, block_id: str) -> str | None:
    begin, end = f"<<<BEGIN {block_id}>>>\n", f"\n<<<END {block_id}>>>"
    start = text.find(begin)
    if start < 0:
        return None
    start += len(begin)
    stop = text.find(end, start)
    return text[start:stop] if stop >= 0 else None


def _papers(text: str) -> list[tuple[str | None, str]]:
    marks = list(_PAPER_HEADER.finditer(text))
    if not marks:
        return [(None, text)]
    out = []
    for i, m in enumerate(marks):
        stop = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out.append((m.group(1), text[m.end() : stop]))
    return out


def _evidence(text: str, asked: tuple[str, str], *, semantic: bool) -> list[dict[str, str]]:
    method, dataset = asked
    found: list[dict[str, str]] = []
    for pid, body in _papers(text):
        if semantic:
            sentences = [
                s for s, m, d in evidence_spans.result_sentences(body) if (m, d) == (method, dataset)
            ]
        else:
            # A reader matching names, not meaning: every sentence naming both counts.
            sentences = [
                s.strip()
                for s in re.split(r"(?<=[.!?])\s+|\n+", body)
                if method in s and dataset in s and "Find every sentence" not in s
            ]
        for sentence in sentences:
            item = {"text": sentence}
            if pid is not None:
                item = {"paper_id": pid, "text": sentence}
            found.append(item)
    return found


# -- the careless long-context reader --------------------------------------------------------------


def direct_answer(text: str, settings: Settings) -> str | None:
    """What a model answers after reading `text` (question included) in its window; None: unknown family."""
    question, rest = split_task(text)
    copy = _COPY_RE.search(question)
    if copy:
        return _copy_block(rest, copy.group(1)) or "I could not find that block."
    pairs_spec = oolong_pairs.parse_query(question)
    if pairs_spec is not None:
        rows = [(d.isoformat(), u, lab) for d, u, lab in oolong.label_rows_dated(rest, guess_label)]
        return format_pairs(pairs_for(pairs_spec, rows))
    query = oolong.parse_question(question)
    if query is not None and query.kind in oolong.EXTRA_KINDS:
        return oolong.answer_rows(query, oolong.label_rows_dated(rest, guess_label))
    chain = multihop_facts.parse_question(question)
    if chain is not None:
        p = min(1.0, (settings.attention / max(1, count_tokens(rest))) ** 0.5)
        facts = [f for f in read_facts(rest) if _noticed(f"{f[0]}|{f[1]}|{f[2]}", p)]
        found = resolve_chain(_kb(facts), chain)
        return f"Exact Answer: {found or 'unknown'}"
    code_q = codeqa.parse_question(question)
    if code_q is not None:
        module, function, arg, choices = code_q
        value = evaluate(files_in(rest), module, function, arg, naive=True)
        letter = next((k for k, v in choices.items() if v == str(value)), "A")
        return f"The correct answer is ({letter})"
    asked = evidence_spans.parse_question(question)
    if asked is not None:
        return json.dumps(_evidence(rest, asked, semantic=False), ensure_ascii=False)
    return None
