"""Shared by the serving tests: a scripted root that runs the code its question names, and a way
to see the process tree (to check that sandboxes are reaped)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from recursa.budget import Budget
from recursa.lm.base import Message
from recursa.sandbox.proc import descendants  # noqa: F401  (re-exported for the serve tests)
from recursa.scripted import policy_names, register
from recursa.scripted.conversation import is_rlm_conversation
from recursa.serve.settings import ServeSettings

from .helpers import max_overlap, wait_until  # noqa: F401  (re-exported for the serve tests)

TEST_ROOT = "serve-test"
_QUESTION = re.compile(r"<question>[ \t]*\n(.*?)\n[ \t]*</question>", re.DOTALL)

# Reports what the run was given: the question and the context's type, size, first and last chars.
_DESCRIBE = """
import json
_c = context
_first = _c if isinstance(_c, str) else (_c[0] if isinstance(_c, list) else next(iter(_c.values())))
_last = _c if isinstance(_c, str) else (_c[-1] if isinstance(_c, list) else list(_c.values())[-1])
FINAL(json.dumps({"question": QUESTION, "type": type(_c).__name__, "len": len(_c),
                  "head": _first[:60], "tail": _last[-60:],
                  "keys": sorted(_c) if isinstance(_c, dict) else None}))
"""


def _policy(messages: list[Message]) -> str:
    """`RUN: code ||| code ...` runs one block per turn; any other question gets a description of
    the context as the answer."""
    if not is_rlm_conversation(messages):
        return "sub-answer"
    found = _QUESTION.search(messages[1]["content"])
    question = found.group(1) if found else ""
    turn = sum(1 for m in messages if m["role"] == "assistant")
    if question.startswith("RUN:"):
        steps = question.removeprefix("RUN:").split("|||")
        if turn >= len(steps):
            return "FINAL(no more steps)"
        return f"Running step {turn + 1}.\n```repl\n{steps[turn].strip()}\n```"
    if turn:
        return "FINAL(described)"
    return "Describing the context.\n```repl\n" + f"QUESTION = {question!r}\n" + _DESCRIBE + "\n```"


def install_test_root() -> str:
    if TEST_ROOT not in policy_names():
        register(TEST_ROOT)(lambda: _policy)
    return f"scripted/{TEST_ROOT}"


# Questions for the test root (see _policy): an answer at once, a dict answer, a cell that never ends.
HELLO = "RUN: FINAL('hello from the rlm')"
PERSON = 'RUN: person = {"name": "Ada", "age": 36}\nFINAL_VAR("person")'
FOREVER = "RUN: import time\nwhile True: time.sleep(0.01)"
CONTEXT = "the context: a short note"


def serve_settings(trace_root: Path, api_key: str, **overrides: Any) -> ServeSettings:
    """A server running the test root over the oracle sub-model, at most 30 model calls a run, with
    its traces under `trace_root`; `overrides` replace any of these."""
    options: dict[str, Any] = {
        "model": install_test_root(),
        "sub_model": "scripted/oracle",
        "trace_dir": trace_root / "traces",
        "api_key": api_key,
        "budget": Budget(max_llm_calls=30),
        **overrides,
    }
    return ServeSettings(**options)
