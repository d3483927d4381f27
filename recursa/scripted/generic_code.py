"""Questions no strategy knows: map over chunks with sub-models, then reduce with one more call."""

from __future__ import annotations

from recursa.scripted.conversation import fill
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import AS_TEXT, CHUNKS, WINDOWS, Strategy, header

# rlm_query(prompt) without a context makes the prompt the child's context and asks this.
PROMPT_AS_CONTEXT = "The context holds a complete request from a user"

_PRELUDE = """
import re

QUESTION = __QUESTION__
ASK = "Question: {question}\\n\\nText:\\n{text}\\n\\nAnswer the question from this text alone, in one short sentence. Reply NONE if the text does not help."
pieces = chunks_of(context, __CHUNK__)
print(f"{len(pieces)} pieces of at most {__CHUNK__:,} characters")
"""

_COMBINE = """
useful = [str(a).strip() for a in partial if str(a).strip() and str(a).strip().upper() != "NONE"]
print(f"{len(useful)} of {len(pieces)} pieces had something to say")
if len(useful) > 1:
    listing = "\\n".join(f"{i + 1}. {a}" for i, a in enumerate(useful))
    result = llm_query(
        f"Question: {QUESTION}\\n\\nPartial answers:\\n{listing}\\n\\n"
        "Combine the partial answers into one final answer to the question. Reply with the answer only."
    )
else:
    result = useful[0] if useful else "NONE"
print("RESULT:", result)
"""

_BATCHED = """
partial = llm_query_batched([ASK.format(question=QUESTION, text=p) for p in pieces])
"""

_PER_ITEM = """
partial = []
for p in pieces:
    partial.append(llm_query(ASK.format(question=QUESTION, text=p)))
"""

_RECURSIVE = """
partial = rlm_query_batched([QUESTION] * len(pieces), pieces)
"""

_NONE = """
STOP = {"the", "and", "what", "which", "who", "for", "are", "was", "with", "that", "this", "from", "how"}
wanted = set(re.findall(r"[a-z0-9]{3,}", QUESTION.lower())) - STOP
result, best = "NONE", 0
for sentence in re.split(r"(?<=[.!?])\\s+|\\n+", as_text(context)):
    overlap = len(wanted & set(re.findall(r"[a-z0-9]{3,}", sentence.lower())))
    if overlap > best:
        result, best = sentence.strip(), overlap
print("RESULT:", result)
"""

_PASS_ON = """
# The context is itself the request: hand it to a sub-model as it is.
request = as_text(context)
print(f"the request has {len(request):,} characters")
result = llm_query(request)
print("RESULT:", result)
"""


def _code(question: str, style: str, settings: Settings) -> str:
    if question.startswith(PROMPT_AS_CONTEXT) and style != "none":
        return header("solve", AS_TEXT, _PASS_ON)
    if style == "none":
        code = header("solve", AS_TEXT, "import re\n\nQUESTION = __QUESTION__\n", _NONE)
    else:
        body = {"batched": _BATCHED, "per-item": _PER_ITEM, "recursive": _RECURSIVE}[style]
        code = header("solve", AS_TEXT, WINDOWS, CHUNKS, _PRELUDE, body, _COMBINE)
    return fill(code, question=question, chunk=settings.chunk)


GENERIC = Strategy("generic", lambda question: question, _code)
