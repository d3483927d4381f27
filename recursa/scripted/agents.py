"""The scripted roots as baseline agents: base model, CodeAct (+BM25, +sub-calls), summary agent.

A baseline puts raw context into the model's own window, so the scripted models read it the way
`readers.direct_answer` describes (exact look-ups, keyword judgement, careless code reading,
context rot over long inputs), and fail with a context-length error past their window. What the
agents add is their own moves: CodeAct searches with BM25 and follows the hits (for multi-hop
questions hop by hop), hands text it copied from its window to sub-models, and the summary agent
keeps the units of each part that share the most words with the task.
"""

from __future__ import annotations

import ast
import re

from recursa.lm.base import Message
from recursa.methods.prompts import BASE_SYSTEM as _BASE
from recursa.methods.prompts import CODEACT_HEAD, SUMMARY_FINAL, SUMMARY_HEAD
from recursa.scripted.base_llm import base_answer, check_window
from recursa.scripted.conversation import repl
from recursa.scripted.name_options import Settings
from recursa.scripted.readers import _kb, find_anchor, resolve_chain, split_task
from recursa.tasks import evidence_spans, multihop_facts, niah
from recursa.tasks.multihop_facts import ANCHOR_RELATION, SUB_QUESTIONS, YEAR_OF, read_facts

_WORD = re.compile(r"[A-Za-z0-9][\w-]{2,}")
_STOP = frozenset(
    "the and that this with from what which who for are was have has its into your you reply answer "
    "question text only none give form final context task line lines each any all".split()
)
_CONTEXT_RE = re.compile(r"<context>\n(.*?)\n</context>", re.DOTALL)
# How much text CodeAct copies from its window into sub-call prompts: its code is its output, so
# the copy must fit the output limit (16K tokens by default) with room to spare.
_COPY_BUDGET = 40_000


def agent_reply(messages: list[Message], settings: Settings) -> str | None:
    """The reply of a scripted root inside a baseline's chat, or None if this is no baseline chat."""
    system = messages[0].get("content", "") if messages and messages[0].get("role") == "system" else ""
    if not system:
        return None
    if system.startswith(_BASE[:60]):
        check_window(messages, settings)
        return base_answer(_user_text(messages), settings)
    if system.startswith(SUMMARY_HEAD):
        check_window(messages, settings)
        return _summary(system, messages, settings)
    if system.startswith(CODEACT_HEAD):
        check_window(messages, settings)
        return _codeact(system, messages, settings)
    return None


def _user_text(messages: list[Message]) -> str:
    return "\n\n".join(m.get("content", "") for m in messages if m.get("role") == "user")


def _terms(text: str) -> list[str]:
    seen: list[str] = []
    for w in _WORD.findall(text):
        if w.lower() not in _STOP and w not in seen:
            seen.append(w)
    return seen


# -- summary agent ---------------------------------------------------------------------------------


def _block(text: str, tag: str) -> str:
    m = re.search(rf"<{tag}[^>]*>\n?(.*?)\n?</{tag}>", text, re.DOTALL)
    return m.group(1) if m else ""


def _summary(system: str, messages: list[Message], settings: Settings) -> str:
    last = messages[-1].get("content", "")
    task = _block(last, "task")
    notes = _block(last, "notes")
    if SUMMARY_FINAL in last:
        return base_answer(f"<context>\n{notes}\n</context>\n\n<task>\n{task}\n</task>", settings)
    budget_m = re.search(r"at most about ([\d,]+) characters", system)
    budget = int(budget_m.group(1).replace(",", "")) if budget_m else 8_000
    part = _block(last, "part")
    wanted = {t.lower() for t in _terms(task)}
    units = [u for u in notes.splitlines() if u.strip()]
    lines = part.splitlines()
    pieces = lines if len(lines) > 20 else re.split(r"(?<=[.!?])\s+|\n+", part)
    units += [p.strip() for p in pieces if p.strip()]
    ranked = sorted(
        range(len(units)), key=lambda i: (-len(wanted & {w.lower() for w in _WORD.findall(units[i])}), i)
    )
    kept: list[int] = []
    size = 0
    for i in ranked:
        if size + len(units[i]) + 1 > budget:
            continue
        kept.append(i)
        size += len(units[i]) + 1
    return "\n".join(units[i] for i in sorted(kept))


# -- CodeAct ---------------------------------------------------------------------------------------


def _final(answer: str) -> str:
    return f"I have what I need.\n\nFINAL({answer})"


def _codeact(system: str, messages: list[Message], settings: Settings) -> str:
    first = next((m.get("content", "") for m in messages if m.get("role") == "user"), "")
    question, _rest = split_task(first)
    context_m = _CONTEXT_RE.search(first)
    context = context_m.group(1) if context_m else ""
    turns = sum(1 for m in messages if m.get("role") == "assistant")
    observations = [m.get("content", "") for m in messages[2:] if m.get("role") == "user"]
    has_search = "`search(query" in system
    has_subcalls = "`llm_query(prompt)" in system
    seen = "\n".join(observations)
    if has_search:
        asked = re.findall(
            r"for hit in search\((.+?), k=8\)",
            "\n".join(m.get("content", "") for m in messages if m.get("role") == "assistant"),
        )
        asked = [ast.literal_eval(a) for a in asked]
        return _codeact_search(question, context, seen, turns, settings, asked)
    if has_subcalls:
        if turns == 0:
            return _codeact_subcalls(question, context)
        answers = re.findall(r"^ANSWER \d+: (.*)$", seen, re.MULTILINE)
        useful = [a for a in answers if a.strip() and a.strip().upper() != "NONE"]
        return _final(useful[0] if useful else "unknown")
    if turns == 0:
        return "I'll read the text in my prompt and check its size first.\n\n" + repl(
            f"# step: look\nprint({len(context)!r}, 'characters of text in the prompt')"
        )
    return _final(base_answer(f"{context}\n\n<task>\n{question}\n</task>", settings))


def _codeact_subcalls(question: str, context: str) -> str:
    copied = context[:_COPY_BUDGET]
    pieces = [copied[i : i + 10_000] for i in range(0, len(copied), 10_000)] or [""]
    code = (
        "# step: ask\n"
        f"QUESTION = {question!r}\n"
        f"PIECES = {pieces!r}\n"
        'answers = llm_query_batched([f"Question: {QUESTION}\\n\\nText:\\n{p}\\n\\nAnswer from this text alone, or NONE." for p in PIECES])\n'
        "for i, a in enumerate(answers):\n"
        '    print(f"ANSWER {i}: " + str(a).replace("\\n", " ")[:2000])\n'
    )
    return "I'll copy the text from my prompt into sub-model calls, piece by piece.\n\n" + repl(code)


def _search_query(question: str, seen: str, asked: list[str]) -> str | None:
    """The next query, or None when the answer can be given (multi-hop questions go hop by hop)."""
    chain = multihop_facts.parse_question(question)
    if chain is None:
        if seen:
            return None
        key = niah.parse_question(question)
        if key:
            return f"special magic number for {key}"
        asked = evidence_spans.parse_question(question)
        if asked:
            return f"{asked[0]} {asked[1]}"
        return " ".join(_terms(question)[:12])
    kb = _kb(read_facts(seen))
    current = find_anchor(kb, chain)
    if current is None:
        # The anchor's two facts may sit in different passages: check each half-match in turn.
        year_key, city_key = YEAR_OF[chain.anchor_type], ANCHOR_RELATION[chain.anchor_type]
        options = [f"{chain.anchor_type} {chain.year} {chain.city}"]
        options += [f"{s} {chain.year}" for s, f in kb.items() if f.get(city_key) == chain.city]
        options += [f"{s} {chain.city}" for s, f in kb.items() if f.get(year_key) == str(chain.year)]
        options += [chain.city, f"{chain.year} {chain.anchor_type}"]
        fresh = [q for q in options if q not in asked]
        return fresh[0] if fresh else None
    for relation in chain.relations:
        nxt = kb.get(current, {}).get(relation)
        if nxt is None:
            options = [
                SUB_QUESTIONS[relation].format(X=current),
                f"{current} {_HOP_WORDS[relation]}",
                current,
            ]
            fresh = [q for q in options if q not in asked]
            return fresh[0] if fresh else None
        current = nxt
    return None


# Words the fact sentences of each relation use, for a second try at a hop's search.
_HOP_WORDS = {
    "founded_by": "founded founder starting set up",
    "acquired_by": "acquired bought owned",
    "headquartered_in": "headquarters head office",
    "born_in": "born birthplace native",
    "studied_at": "studied graduate degree",
    "works_at": "works employed position",
    "located_in": "located campus sits",
}


def _codeact_search(
    question: str, context: str, seen: str, turns: int, settings: Settings, asked: list[str]
) -> str:
    query = _search_query(question, seen, asked) if turns < 12 else None
    if query is not None:
        code = f"# step: search\nfor hit in search({query!r}, k=8):\n    print(hit)\n    print('---')"
        return f"I'll search the text for: {query}\n\n" + repl(code)
    chain = multihop_facts.parse_question(question)
    if chain is not None:  # the hops it followed through short search results, read in full
        found = resolve_chain(_kb(read_facts(seen)), chain)
        if found:
            return _final(f"Exact Answer: {found}")
    return _final(base_answer(f"{context}\n\n{seen}\n\n<task>\n{question}\n</task>", settings))
