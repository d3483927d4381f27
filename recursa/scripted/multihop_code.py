"""Multi-hop documents: find the anchor with sub-calls over document groups, then follow each hop
to the documents about the entity found so far (located by title and alias lines, in code). When
sub-models have a search tool of their own, ask them the anchor and each hop without any text."""

from __future__ import annotations

from recursa.scripted.conversation import fill
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import CHUNKS, WINDOWS, Strategy, header
from recursa.tasks.multihop_facts import NAME, SUB_QUESTIONS, Chain, parse_question

_PRELUDE = """
import re
from collections import Counter

ANCHOR_Q = __ANCHOR_Q__
HOPS = __HOPS__
ANSWER_LINE = " Reply with the name only, or NONE if these documents do not say.\\n\\nDocuments:\\n"
docs = [str(d) for d in context] if isinstance(context, list) else [f"{k}\\n{v}" for k, v in context.items()] if isinstance(context, dict) else context.split("\\n\\n\\n")


def names_of(doc):
    head = doc[:400]
    found = re.findall(r"^Title: (.+)$", head, re.M)
    for line in re.findall(r"^Also known as: (.+)$", head, re.M):
        found += [a.strip() for a in line.split(";")]
    return found


def docs_about(name):
    own = [d for d in docs if name in names_of(d)]
    return own or [d for d in docs if name in d][:20]


def clean(reply):
    text = str(reply).strip().splitlines()[0].strip() if str(reply).strip() else ""
    return "" if not text or text.upper().startswith("NONE") else text.strip(" .")


print(f"{len(docs):,} documents")
"""

_ANCHOR_BATCHED = """
groups = chunks_of(docs, __CHUNK__)
replies = llm_query_batched([ANCHOR_Q + "\\n\\nDocuments:\\n" + g for g in groups])
votes = Counter(clean(r) for r in replies if clean(r))
current = votes.most_common(1)[0][0] if votes else None
print(f"anchor from {len(groups)} batched sub-calls: {current} (votes {dict(votes)})")
"""

_ANCHOR_PER_ITEM = """
current = None
for g in chunks_of(docs, 20_000):
    name = clean(llm_query(ANCHOR_Q + "\\n\\nDocuments:\\n" + g))
    if name:
        current = name
        break
print("anchor:", current)
"""

_HOPS_MODEL = """
for relation, ask in HOPS:
    if current is None:
        break
    about = docs_about(current)
    reply = llm_query(ask.format(X=current) + ANSWER_LINE + "\\n\\n".join(about))
    print(f"{relation}: {current} -> {clean(reply) or None} (from {len(about)} documents)")
    current = clean(reply) or None
"""

_NONE = """
KEYWORDS = __KEYWORDS__
NAME = __NAME__
year, city, kind = __ANCHOR__
current = None
for d in docs:
    if str(year) in d and city in d and names_of(d) and names_of(d)[0] != city:
        current = names_of(d)[0]
        break
print("anchor by keywords:", current)
for relation, ask in HOPS:
    if current is None:
        break
    about = docs_about(current)
    nxt = None
    for sentence in re.split(r"(?<=\\.)\\s+", " ".join(about)):
        if current in sentence and any(k in sentence for k in KEYWORDS[relation]):
            names = [n for n in re.findall(NAME, sentence) if n != current and n not in names_of(about[0] if about else "")]
            names = [n for n in names if n.split()[0] not in ("The", "It", "Since", "On")]
            if names:
                nxt = names[0]
                break
    print(f"{relation}: {current} -> {nxt}")
    current = nxt
"""

# Sub-models search for themselves: the root hands them questions, never documents, so its own
# window and the sub-calls' prompts stay small however many documents there are.
_DELEGATE = """
ANCHOR_Q = __ANCHOR_Q__
HOPS = __HOPS__
LOOK_UP = " Look it up in the document collection; reply with the name only, or NONE if you cannot find it."


def clean(reply):
    text = str(reply).strip().splitlines()[0].strip() if str(reply).strip() else ""
    return "" if not text or text.upper().startswith("NONE") else text.strip(" .")


current = clean(llm_query(ANCHOR_Q)) or None
print("anchor from a sub-model that searched:", current)
for relation, ask in HOPS:
    if current is None:
        break
    reply = llm_query(ask.format(X=current) + LOOK_UP)
    print(f"{relation}: {current} -> {clean(reply) or None}")
    current = clean(reply) or None
"""

_RESULT = """
result = f"Exact Answer: {current}" if current else "Exact Answer: unknown"
print("RESULT:", result)
"""

_KEYWORDS = {
    "founded_by": ["founded", "founder", "starting", "set up"],
    "acquired_by": ["acquired", "bought", "owned"],
    "headquartered_in": ["headquarters", "head office"],
    "born_in": ["born", "birthplace", "native"],
    "studied_at": ["studied", "graduate", "degree"],
    "works_at": ["works", "employed", "position"],
    "located_in": ["located", "campus", "sits"],
}


def _code(chain: Chain, style: str, settings: Settings) -> str:
    hops = [(r, SUB_QUESTIONS[r]) for r in chain.relations]
    if style == "none":
        code = header("solve", _PRELUDE, _NONE, _RESULT)
    elif style == "delegate":
        code = header("solve", _DELEGATE, _RESULT)
    else:
        anchor = _ANCHOR_PER_ITEM if style == "per-item" else _ANCHOR_BATCHED
        code = header("solve", WINDOWS, CHUNKS, _PRELUDE, anchor, _HOPS_MODEL, _RESULT)
    return fill(
        code,
        anchor_q=chain.anchor_sub_question(),
        hops=hops,
        chunk=settings.chunk,
        keywords=_KEYWORDS,
        name=NAME,
        anchor=(chain.year, chain.city, chain.anchor_type),
    )


MULTIHOP = Strategy("multihop-docs", parse_question, _code, answer_in_prose=True, delegates=True)
