"""The text rules of reading a reply: each takes the reply's text (and the notes for the model) and
returns it mended, before any fence is read. recursa/loop/rules.py names them, gives each its reason
and examples, and runs them in its order; each function here does one thing. A rule whose patterns
all need a character the text lacks (a non-ASCII one, "<") returns it at once: every step of an RL
episode reads a reply, and the patterns cost more than the step's own host work otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from recursa.loop.fences import count_runnable

CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Zero-width space, BOM, word joiner: a fence or FINAL after one is no longer at the start of its line.
_INVISIBLE = re.compile("[\u200b\ufeff\u2060]")
# Indentation in no-break or ideographic spaces: Python rejects it, and fences behind it go unseen.
_ODD_INDENT = re.compile(
    "^[ \t\u00a0\u2007\u202f\u3000]*[\u00a0\u2007\u202f\u3000][ \t\u00a0\u2007\u202f\u3000]*", re.M
)
_FULLWIDTH_FINAL = re.compile(
    "^([^\\S\\n]*[>*_#`-]*(?i:FINAL(?:_VAR|_ANSWER)?)[*_`]*)[ \t\u00a0]*（(.*)）", re.M
)
_FULLWIDTH_COLON = re.compile("^([^\\S\\n]*[>*_#`-]*FINAL(?:_VAR|_ANSWER)?[*_`]*)[ \t\u00a0]*：", re.M)
_NBSP_BEFORE_PAREN = re.compile("(FINAL(?:_VAR)?)[\u00a0\u202f]+(?=\\()")
_HARMONY_FINAL = "<|channel|>final<|message|>"
_THINK = re.compile(r"<(think|thinking|reasoning)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_THINK_CLOSE_ONLY = re.compile(r"^(.*?)</(?:think|thinking|reasoning)>", re.DOTALL | re.IGNORECASE)
_UNCLOSED_THINK = re.compile(r"^\s*<(think|thinking|reasoning)>", re.IGNORECASE)
_PYTHON_TAG = re.compile(r"<\|python_tag\|>(.*?)(?:<\|eom_id\|>|<\|eot_id\|>|\Z)", re.DOTALL)
_EXECUTE = re.compile(r"<(execute|execute_ipython)>(.*?)</\1>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|\Z)", re.DOTALL)
# Argument names under which roots trained on other harnesses pass code to a tool.
CODE_ARGUMENTS = ("code", "source", "python", "script", "input")
# A role name right after a start token goes with it.
_SPECIAL_TOKEN = re.compile(
    r"<\|start_header_id\|>[a-z_]{1,20}<\|end_header_id\|>"
    r"|<\|(?:im_start|start)\|>(?:assistant|user|system)?|<\|[A-Za-z0-9_.:-]{1,40}\|>"
    r"|<｜[^｜<>\n]{1,40}｜>|<start_of_turn>(?:model|user)?|<end_of_turn>|<eos>|<ctrl\d{1,4}>"
)
_END_OF_SEQUENCE = re.compile(r"[ \t]*</s>[ \t]*$", re.M)


def line_endings(text: str, notes: list[str]) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def control_characters(text: str, notes: list[str]) -> str:
    return CONTROL.sub("", text)


def invisible_characters(text: str, notes: list[str]) -> str:
    return text if text.isascii() else _INVISIBLE.sub("", text)


def odd_indentation(text: str, notes: list[str]) -> str:
    if text.isascii():
        return text
    return _ODD_INDENT.sub(lambda m: " " * len(m.group(0).expandtabs(4)), text)


def fullwidth_final(text: str, notes: list[str]) -> str:
    if text.isascii():
        return text
    text = _FULLWIDTH_FINAL.sub(r"\1(\2)", text)
    text = _FULLWIDTH_COLON.sub(r"\1:", text)
    return _NBSP_BEFORE_PAREN.sub(r"\1", text)


def harmony_final_channel(text: str, notes: list[str]) -> str:
    if _HARMONY_FINAL in text:  # the final channel is the reply, the rest reasoning
        return text.rsplit(_HARMONY_FINAL, 1)[1]
    return text


def thinking_blocks(text: str, notes: list[str]) -> str:
    if "<" not in text:
        return text
    skipped = 0

    def drop(match: re.Match[str]) -> str:
        nonlocal skipped
        skipped += count_runnable(match.group(2))
        return ""

    text = before_last(text, ("</think>", "</thinking>", "</reasoning>"), lambda t: _THINK.sub(drop, t))
    head = _THINK_CLOSE_ONLY.match(text)
    if head is not None:  # the template opened <think> in the prompt: the reply starts inside it
        skipped += count_runnable(head.group(1))
        text = text[head.end() :]
    unclosed = _UNCLOSED_THINK.match(text)
    if unclosed is not None:  # cut off while reasoning (the output limit): none of it is the reply
        skipped += count_runnable(text[unclosed.end() :])
        text = ""
        notes.append(
            f"Your reply ended inside <{unclosed.group(1)}> reasoning that was never closed, so none of it "
            "counted. Keep the reasoning short and write the code or answer after it."
        )
    if skipped:
        notes.append(
            f"{skipped} code block(s) inside your <think> reasoning did not run: only code in the reply "
            "itself runs."
        )
    return text


def python_tag(text: str, notes: list[str]) -> str:
    if "<|python_tag|>" not in text:
        return text
    return _PYTHON_TAG.sub(lambda m: _as_block(m.group(1)), text)


def execute_tags(text: str, notes: list[str]) -> str:
    if "<" not in text:
        return text
    return before_last(
        text, ("</execute>", "</execute_ipython>"), lambda t: _EXECUTE.sub(lambda m: _as_block(m.group(2)), t)
    )


def hermes_tool_call(text: str, notes: list[str]) -> str:
    if "<tool_call>" not in text:
        return text

    def tool_call(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
        except ValueError:
            call = None
        args = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"code": args}
        code = next(
            (args[k] for k in CODE_ARGUMENTS if isinstance(args, dict) and isinstance(args.get(k), str)), None
        )
        if code is None:
            notes.append(
                "Your reply made a tool call (<tool_call>), which does nothing here: there are no tools to "
                "call this way. Write Python in a ```repl block instead."
            )
            return ""
        return _as_block(code)

    # Openers after the last "}" cannot match: left out of the search, they cannot make it quadratic.
    cut = text.find("<tool_call>", text.rfind("}") + 1)
    if cut < 0:
        return _TOOL_CALL.sub(tool_call, text)
    return _TOOL_CALL.sub(tool_call, text[:cut]) + text[cut:]


def special_tokens(text: str, notes: list[str]) -> str:
    return _SPECIAL_TOKEN.sub("", text) if "<" in text else text


def end_of_sequence(text: str, notes: list[str]) -> str:
    return _END_OF_SEQUENCE.sub("", text) if "</s>" in text else text


def _as_block(code: str) -> str:
    return f"\n```python\n{code.strip()}\n```\n"


def before_last(text: str, closers: tuple[str, ...], sub: Callable[[str], str]) -> str:
    """`sub` applied up to the last closing tag only: an opening tag with no close after it (a model
    repeating "<think>" until its output limit) would make a lazy pair pattern quadratic."""
    lowered = text.lower()
    end = max((lowered.rfind(c) + len(c) for c in closers if c in lowered), default=0)
    return sub(text[:end]) + text[end:] if end else text
