"""Verbatim copy: slice the marked block out of the context in code and hand it back by name."""

from __future__ import annotations

import re

from recursa.scripted.conversation import fill
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import AS_TEXT, Strategy, header

_MARKERS = re.compile(r"between the markers <<<BEGIN (\w+)>>> and <<<END \1>>>")

_SLICE = """
BLOCK = __BLOCK__
text = as_text(context)
begin, end = f"<<<BEGIN {BLOCK}>>>\\n", f"\\n<<<END {BLOCK}>>>"
start = text.index(begin) + len(begin)
result = text[start : text.index(end, start)]
print(f"the block has {len(result):,} characters; it starts {result[:60]!r} and ends {result[-60:]!r}")
"""

_CHECK = """
# A cheap sub-call on the first characters, to confirm the slice is the block the question means.
check = llm_query("Copy the text between the markers <<<BEGIN " + BLOCK + ">>> and <<<END " + BLOCK + ">>> exactly.\\n\\n" + begin + result[:2000] + end)
print("sub-model agrees on the opening:", str(check)[:200] == result[:200])
"""

_DONE = """
print("RESULT:", f"{len(result):,} characters, in the variable result")
"""


def _code(block: str, style: str, settings: Settings) -> str:
    parts = [AS_TEXT, _SLICE] + ([_CHECK] if style in ("batched", "recursive") else []) + [_DONE]
    return fill(header("solve", *parts), block=block)


def _match(question: str) -> str | None:
    m = _MARKERS.search(question)
    return m.group(1) if m else None


COPY = Strategy("verbatim-copy", _match, _code)
