"""Needle questions: a regex finds the needle; sub-models verify it or search where regexes fail."""

from __future__ import annotations

from recursa.scripted.conversation import fill
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import AS_TEXT, WINDOWS, Strategy, header
from recursa.tasks import niah

_PRELUDE = """
import re

KEY = __KEY__
ASK = (
    f"What is the special magic number for {KEY} mentioned in the text below? "
    "Reply with the number only, or NONE if the text does not state it.\\n\\n"
)
text = as_text(context)
needle = re.compile(r"special magic number for " + re.escape(KEY) + r" is (\\d+)")
hits = needle.findall(text)
print(f"{len(text):,} characters; regex hits for {KEY}: {hits}")
"""

_BATCHED = """
if hits:
    # One cheap sub-call on the surrounding text to confirm the regex read the right sentence.
    at = needle.search(text)
    check = llm_query(ASK + text[max(0, at.start() - 2000) : at.end() + 2000])
    print("sub-model check:", check)
    result = hits[0]
else:
    pieces = windows(text, __CHUNK__)
    replies = llm_query_batched([ASK + piece for piece in pieces])
    found = [m.group(0) for m in (re.search(r"\\d{7}", str(r)) for r in replies) if m]
    print(f"{len(found)} of {len(pieces)} pieces named a number: {found}")
    result = found[0] if found else "NONE"
print("RESULT:", result)
"""

_PER_ITEM = """
# Read every piece with the sub-model, one call at a time.
found = []
for piece in windows(text, 20_000):
    reply = llm_query(ASK + piece)
    m = re.search(r"\\d{7}", reply)
    if m:
        found.append(m.group(0))
print(f"pieces that named a number: {found}")
result = found[0] if found else (hits[0] if hits else "NONE")
print("RESULT:", result)
"""

_NONE = """
if not hits:
    # Looser: the key followed closely by a seven-digit number.
    loose = re.search(re.escape(KEY) + r"\\D{0,40}(\\d{7})", text)
    hits = [loose.group(1)] if loose else []
result = hits[0] if hits else "NONE"
print("RESULT:", result)
"""

_RECURSIVE = """
pieces = windows(text, __CHUNK__)
answers = rlm_query_batched([QUESTION] * len(pieces), pieces)
found = [m.group(0) for m in (re.search(r"\\d{7}", str(a)) for a in answers) if m]
print(f"{len(found)} of {len(pieces)} children found a number: {found}")
result = found[0] if found else (hits[0] if hits else "NONE")
print("RESULT:", result)
"""


def _code(spec: tuple[str, str], style: str, settings: Settings) -> str:
    key, question = spec
    body = {"batched": _BATCHED, "per-item": _PER_ITEM, "none": _NONE, "recursive": _RECURSIVE}[style]
    code = header("solve", AS_TEXT, WINDOWS, _PRELUDE, body)
    if style == "recursive":
        code = code.replace("KEY = __KEY__", f"KEY = __KEY__\nQUESTION = {question!r}")
    return fill(code, key=key, chunk=settings.chunk)


def _match(question: str) -> tuple[str, str] | None:
    key = niah.parse_question(question)
    return (key, question) if key else None


NIAH = Strategy("niah", _match, _code, answer_in_prose=True)
