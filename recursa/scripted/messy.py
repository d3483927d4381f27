"""The `style=messy` knob: a scripted root that writes the way real models do.

The scripted roots write tidy ```repl blocks and FINAL(...) lines. Real models do not: they tag
fences ```python or ```Python, show a JSON shape first, nest code in numbered lists, double an
opener, write the output they expect after the code, think aloud in <think> with draft code, leak
chat-template tokens, write code with no fence at all, and answer with `FINAL 345`, `**FINAL**(x)`, `Final Answer: x`, `final(x)` or
`<answer>FINAL(x)</answer>`. With
`style=messy` each reply is rewritten into one of those forms (chosen by turn and seed, so a run is
reproducible), keeping what it means: the same code runs and the same answer comes back, so
benchmarks and the demo also exercise the tolerant reader (loop/parse.py).
"""

from __future__ import annotations

import re

_BLOCK = re.compile(r"^```repl\n(.*?)\n```$", re.MULTILINE | re.DOTALL)
_PROSE_FINAL = re.compile(r"^FINAL\((.*)\)$", re.MULTILINE)
_PROSE_FINAL_VAR = re.compile(r"^FINAL_VAR\((\w+)\)$", re.MULTILINE)

_FENCE_FORMS = (
    "python",
    "Python",
    "json-first",
    "listed",
    "doubled",
    "output-after",
    "think",
    "token",
    "unfenced",
)
# Code that answers (FINAL(...) in the cell) is never written unfenced: an answer in unfenced code
# waits a turn for its output, which would change what the run does.
_ANSWERS = re.compile(r"\b(?:FINAL|FINAL_VAR|final|final_var)\s*\(|\banswer\s*\[")
_FINAL_FORMS = (
    "FINAL {}",
    "**FINAL**({})",
    "Final Answer: {}",
    "FINAL: {}",
    "`FINAL({})`",
    "final({})",
    "<answer>FINAL({})</answer>",
    "**Answer:** FINAL({})",
)
_FINAL_VAR_FORMS = (
    "FINAL_VAR: {}",
    "FINAL_VAR(`{}`)",
    "**FINAL_VAR**({})",
    "- FINAL_VAR({})",
    "final_var({})",
    "Final_Var({})",
)


def messy_reply(reply: str, turn: int, seed: int = 0) -> str:
    """`reply` rewritten in one of the forms real models use, picked by `turn` and `seed`."""
    pick = turn + seed
    reply = _BLOCK.sub(lambda m: _fence(m.group(1), _FENCE_FORMS[pick % len(_FENCE_FORMS)]), reply)
    reply = _PROSE_FINAL.sub(lambda m: _FINAL_FORMS[pick % len(_FINAL_FORMS)].format(m.group(1)), reply)
    return _PROSE_FINAL_VAR.sub(
        lambda m: _FINAL_VAR_FORMS[pick % len(_FINAL_VAR_FORMS)].format(m.group(1)), reply
    )


def _fence(code: str, form: str) -> str:
    if form == "unfenced" and not _ANSWERS.search(code):
        # Small models: a sentence, then the code with no fence at all (loop/unfenced.py runs it).
        return f"Next I run this code.\n\n{code}\n"
    if form in ("python", "Python", "unfenced"):
        return f"```{'python' if form == 'unfenced' else form}\n{code}\n```"
    if form == "json-first":
        return (
            'What I expect back has this shape:\n```json\n{"result": "..."}\n```\n'
            f"The code:\n```python\n{code}\n```"
        )
    if form == "listed":
        body = "\n".join(f"   {line}" if line else "" for line in code.split("\n"))
        return f"1. Run this:\n   ```python\n{body}\n   ```\n2. Read what it prints."
    if form == "doubled":
        return f"```\n```python\n{code}\n```"
    if form == "output-after":
        # Claude-style: the output the model expects, written after the code (never an answer).
        return f"```repl\n{code}\n```\n\nOutput:\n```\n(the output should appear here)\n```"
    if form == "think":
        return f"<think>\nA first draft:\n```python\npass\n```\nBetter to run the full step.\n</think>\n```repl\n{code}\n```"
    return f"```repl\n{code}\n```<|im_end|>"
