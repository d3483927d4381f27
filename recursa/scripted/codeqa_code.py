"""Code QA: follow the imports from the entry module in code, then ask one sub-model about exactly
the files the call touches (the paper's RLMs navigate repositories the same way)."""

from __future__ import annotations

from typing import Any

from recursa.scripted.conversation import fill
from recursa.scripted.name_options import Settings
from recursa.scripted.strategy import Strategy, header
from recursa.tasks import codeqa

_PRELUDE = """
import re
from collections import Counter

QUESTION = __QUESTION__
ENTRY = __ENTRY__
repo = dict(context) if isinstance(context, dict) else {}
IMPORT = re.compile(r"^from ([\\w.]+) import (.+)$", re.M)


def path_of(module):
    return module.replace(".", "/") + ".py"


needed, todo = [], [path_of(ENTRY)]
while todo:
    path = todo.pop()
    if path in needed or path not in repo:
        continue
    needed.append(path)
    for module, _names in IMPORT.findall(repo[path]):
        todo.append(path_of(module))
print(f"{len(repo):,} files; the call touches {len(needed)}: {needed}")
"""

_MODEL = """
files = "\\n\\n".join(f"### {p}\\n{repo[p]}" for p in needed)
reply = llm_query(QUESTION + "\\n\\nThe files involved:\\n" + files)
m = re.search(r"The correct answer is \\(?([A-D])", str(reply))
result = f"The correct answer is ({m.group(1)})" if m else "The correct answer is (A)"
print("sub-model:", str(reply)[:200])
"""

_NONE = """
# No model to read the code: pick the option whose value appears most often in the files involved.
CHOICES = __CHOICES__
text = "\\n".join(repo[p] for p in needed)
counts = Counter({letter: len(re.findall(r"\\b" + re.escape(v) + r"\\b", text)) for letter, v in CHOICES.items()})
letter = max(sorted(CHOICES), key=lambda k: counts[k])
result = f"The correct answer is ({letter})"
"""

_RESULT = """
print("RESULT:", result)
"""


def _match(question: str) -> tuple[Any, ...] | None:
    parsed = codeqa.parse_question(question)
    return (question, *parsed) if parsed else None


def _code(spec: tuple[Any, ...], style: str, settings: Settings) -> str:
    question, module, _function, _arg, choices = spec
    body = _NONE if style == "none" else _MODEL
    return fill(header("solve", _PRELUDE, body, _RESULT), question=question, entry=module, choices=choices)


CODEQA = Strategy("codeqa", _match, _code, answer_in_prose=True)
