"""Programmatic fixes of answer-protocol mistakes in root replies, for SFT data.

Models distilled from raw traces copy their teacher's slips, so (as the RLM paper did for its
Qwen3-8B data) the SFT exporter repairs the ones that can be repaired from the text alone and
drops the one that cannot:

- FINAL(name) where `name` is a variable the REPL holds: FINAL_VAR(name) was meant. In code,
  FINAL("name") the same way.
- FINAL_VAR(...) of something that is not a variable name (literal text, a number): FINAL(...)
  was meant. In code, FINAL_VAR(var) with the variable itself rather than its name becomes
  FINAL_VAR("var").
- A final answer written inside a code block that cannot run it (a fence without the repl tag,
  or `FINAL(some prose)`, which is not Python): moved out of the block onto a line of its own.
- A plan written as a final answer ("FINAL(I will first chunk the context ...)"): detected, and
  the turn dropped, since no edit turns a plan into the answer.

Only the reply changes; RL exports never apply fixes (their rows must be what the policy sampled).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from recursa.loop.answers import assigned_names
from recursa.loop.fences import read_fences
from recursa.loop.finals import find_final

FIX_FINAL_FOR_VAR = "FINAL(name) of a REPL variable rewritten as FINAL_VAR(name)"
FIX_FINAL_VAR_OF_VALUE = "FINAL_VAR of a value instead of a variable name rewritten"
FIX_ANSWER_IN_CODE = "final answer written inside a code block moved out of it"
DROP_PLAN = "turns whose final answer is a plan (dropped)"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FINAL_OPEN = re.compile(r"\**FINAL(?:_VAR)?\(")

# Prose answers, at the start of a line as the engine reads them.
_PROSE_FINAL_NAME = re.compile(r"^([ \t]*\**)FINAL\(\s*([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2\s*\)", re.MULTILINE)
_PROSE_FINAL_VAR = re.compile(r"^([ \t]*\**)FINAL_VAR\((.*)\)([ \t*]*)$", re.MULTILINE)

# Calls in code.
_CODE_FINAL_STR = re.compile(r"(?<![\w.])FINAL\(\s*([\"'])([A-Za-z_][A-Za-z0-9_]*)\1\s*\)")
_CODE_FINAL_VAR_STR = re.compile(r"(?<![\w.])FINAL_VAR\(\s*([\"'])((?:(?!\1).)*)\1\s*\)")
_CODE_FINAL_VAR_NUM = re.compile(r"(?<![\w.])FINAL_VAR\(\s*(-?\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*\)")
_CODE_FINAL_VAR_BARE = re.compile(r"(?<![\w.])FINAL_VAR\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")
_CODE_FINAL_TEXT = re.compile(r"(?<![\w.])FINAL\(\s*(\"\"\"|'''|\"|')(.*?)\1\s*\)", re.DOTALL)

_PLAN_START = re.compile(
    r"^\W*(?:i\s+will|i'll|i\s+am\s+going\s+to|i'm\s+going\s+to|i\s+need\s+to|i\s+should|i\s+plan|"
    r"let\s+me|let's|let\s+us|we\s+will|we'll|we\s+need\s+to|we\s+should|first(?:ly)?\s*,|"
    r"first\s+(?:i|we)\b|step\s*1\b|plan\s*:|my\s+plan|the\s+plan|my\s+approach|"
    r"to\s+(?:answer|solve|find|determine)\s+this|"
    r"next,?\s+i\b)",
    re.IGNORECASE,
)
_SEQUENCE = re.compile(r"\b(?:first(?:ly)?|then|next|after\s+that|finally|step\s*\d)\b", re.IGNORECASE)
_INTENT = re.compile(r"\b(?:will|going\s+to|need\s+to|plan\s+to|i'll|we'll)\b", re.IGNORECASE)
_TOOLING = re.compile(r"\b(?:llm_query\w*|rlm_query\w*|the\s+repl|chunks?\b|sub-?calls?)", re.IGNORECASE)


@dataclass
class FixResult:
    text: str
    fixes: list[str] = field(default_factory=list)  # one entry per kind of fix applied
    drop: str | None = None  # why the turn must be dropped

    @property
    def changed(self) -> bool:
        return bool(self.fixes)


def fix_reply(reply: str, variables: Iterable[str] = ()) -> FixResult:
    """Repair `reply` given the names the REPL held when it was written (plus those it assigns)."""
    known = set(variables)
    applied: list[str] = []
    lines = reply.split("\n")
    out: list[str] = []  # lines of the repaired reply
    pos = 0
    # Fences as the engine reads them (loop/fences.py), so a ```json block before the code cannot
    # shift which text counts as code.
    for fence in read_fences(reply, [])[0]:
        start, end = fence.lines
        if start > pos:
            out += _fix_prose("\n".join(lines[pos:start]), known, applied).split("\n")
        raw = "\n".join(lines[start:end])
        stripped = fence.text.strip()
        if _only_final(stripped) and (not fence.runnable or not _parses(stripped)):
            _note(applied, FIX_ANSWER_IN_CODE)
            out += _fix_prose(stripped.strip("*"), known, applied).split("\n")
        elif fence.runnable:
            known |= assigned_names([fence.text])
            fixed = _fix_code(fence.text, known, applied)
            out += (raw.replace(fence.text, fixed, 1) if fixed != fence.text else raw).split("\n")
        else:
            out += raw.split("\n")
        pos = max(end, pos)
    if pos < len(lines):
        out += _fix_prose("\n".join(lines[pos:]), known, applied).split("\n")
    text = "\n".join(out)
    result = FixResult(text, applied)
    if any(looks_like_plan(answer) for answer in final_texts(text)):
        result.drop = DROP_PLAN
    return result


def _note(applied: list[str], fix: str) -> None:
    if fix not in applied:
        applied.append(fix)


def _fix_prose(text: str, known: set[str], applied: list[str]) -> str:
    def final_name(m: re.Match[str]) -> str:
        if m.group(3) in known:
            _note(applied, FIX_FINAL_FOR_VAR)
            return f"{m.group(1)}FINAL_VAR({m.group(3)})"
        return m.group(0)

    def final_var(m: re.Match[str]) -> str:
        inner = _unquote(m.group(2).strip())
        if _IDENT.fullmatch(inner) or not inner:
            return m.group(0)
        _note(applied, FIX_FINAL_VAR_OF_VALUE)
        return f"{m.group(1)}FINAL({inner}){m.group(3)}"

    return _PROSE_FINAL_VAR.sub(final_var, _PROSE_FINAL_NAME.sub(final_name, text))


def _fix_code(code: str, known: set[str], applied: list[str]) -> str:
    def final_str(m: re.Match[str]) -> str:
        if m.group(2) in known:
            _note(applied, FIX_FINAL_FOR_VAR)
            return f'FINAL_VAR("{m.group(2)}")'
        return m.group(0)

    def final_var_str(m: re.Match[str]) -> str:
        if _IDENT.fullmatch(m.group(2).strip()):
            return m.group(0)
        _note(applied, FIX_FINAL_VAR_OF_VALUE)
        return f"FINAL({m.group(1)}{m.group(2)}{m.group(1)})"

    def final_var_num(m: re.Match[str]) -> str:
        _note(applied, FIX_FINAL_VAR_OF_VALUE)
        return f"FINAL({m.group(1)})"

    def final_var_bare(m: re.Match[str]) -> str:
        if m.group(1) in known:
            _note(applied, FIX_FINAL_VAR_OF_VALUE)
            return f'FINAL_VAR("{m.group(1)}")'
        return m.group(0)

    code = _CODE_FINAL_STR.sub(final_str, code)
    code = _CODE_FINAL_VAR_STR.sub(final_var_str, code)
    code = _CODE_FINAL_VAR_NUM.sub(final_var_num, code)
    return _CODE_FINAL_VAR_BARE.sub(final_var_bare, code)


def final_texts(reply: str) -> list[str]:
    """The literal answers a reply gives: a prose FINAL(...) and FINAL("...") string literals in code."""
    texts: list[str] = []
    fences, prose = read_fences(reply, [])
    found = find_final(prose, [])
    if found is not None and found.protocol == "FINAL":
        texts.append(found.text)
    for fence in fences:
        if fence.runnable:
            texts += [m.group(2) for m in _CODE_FINAL_TEXT.finditer(fence.text)]
    return texts


def looks_like_plan(answer: str) -> bool:
    """A heuristic: the text announces work to do rather than giving a result."""
    text = answer.strip().strip("\"'`*").strip()
    if len(text) < 12:
        return False
    if _PLAN_START.match(text):
        return True
    steps = len(_SEQUENCE.findall(text))
    intent = bool(_INTENT.search(text))
    return intent and (steps >= 2 or (steps >= 1 and bool(_TOOLING.search(text))))


def _only_final(text: str) -> bool:
    """True when `text` is one FINAL(...) / FINAL_VAR(...) call and nothing else."""
    opening = _FINAL_OPEN.match(text)
    if opening is None:
        return False
    depth = 1
    for i in range(opening.end(), len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return not text[i + 1 :].strip(" \t*")
    return False


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _unquote(text: str) -> str:
    for quote in ('"""', "'''", '"', "'"):
        if len(text) >= 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            return text[len(quote) : -len(quote)]
    return text
