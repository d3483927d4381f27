"""Read a root model's reply: its code blocks and any answer written in prose.

Replies are read line by line, the way a person reads markdown, not by pairing fences with one regex
(which desyncs as soon as a block in another language comes first). The rules, in short:
- a fence with a language tag opens a block, the next bare fence closes it; a runnable block
  (```repl, ```python in any case, ...) is closed by a bare fence only outside a triple-quoted string,
  so a prompt template with its own fences stays inside the code;
- a tagged fence met inside a runnable block outside a string means the block was never closed:
  it ends there and the new one starts (the model is told);
- a doubled opener (``` then ```python, or ```python twice) counts once; fences indented inside a
  markdown list are dedented; a block left open at the end of the reply is kept;
- ```markdown blocks and blocks opened with four or more backticks may quote fences of their own;
- code is never dropped silently: every fence that does not run is counted for the hint, and code
  left out for another reason (inside a model's <think> reasoning) is reported in `notes`.
"""

from __future__ import annotations

import ast
import io
import json
import re
import textwrap
import tokenize
from dataclasses import dataclass, field

# ```repl is the paper's fence; models trained on notebooks write ```python (any case), Gemini's
# code-execution habit is ```tool_code. All of them run.
RUNNABLE_TAGS = frozenset({"repl", "python", "py", "python3", "py3", "ipython", "tool_code"})
_QUOTING_TAGS = frozenset({"markdown", "md"})  # blocks that may show fenced examples of their own

_FENCE_LINE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*?)[ \t]*$")
_TAG = re.compile(r"[A-Za-z0-9_+#-]*")

# Chat-template tokens that leak into replies when a server does not strip them (Qwen/ChatML
# <|im_end|>, Llama <|eot_id|>, gpt-oss <|channel|>, DeepSeek <｜end▁of▁sentence｜>, Gemma
# <end_of_turn>, raw Gemini <ctrl94>). A role name right after a start token goes with it.
_SPECIAL_TOKEN = re.compile(
    r"<\|(?:im_start|start)\|>(?:assistant|user|system)?|<\|[A-Za-z0-9_.:-]{1,40}\|>"
    r"|<｜[^｜<>\n]{1,40}｜>|<start_of_turn>(?:model|user)?|<end_of_turn>|<eos>|<ctrl\d{1,4}>"
)
_END_OF_SEQUENCE = re.compile(r"[ \t]*</s>[ \t]*$", re.M)
_HARMONY_FINAL = "<|channel|>final<|message|>"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_PYTHON_TAG = re.compile(r"<\|python_tag\|>(.*?)(?:<\|eom_id\|>|<\|eot_id\|>|\Z)", re.DOTALL)
_EXECUTE = re.compile(r"<(execute|execute_ipython)>(.*?)</\1>", re.DOTALL)  # CodeAct / OpenHands
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|\Z)", re.DOTALL)
_CODE_ARGS = ("code", "source", "python", "script", "input")
_THINK = re.compile(r"<(think|thinking|reasoning)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_THINK_CLOSE_ONLY = re.compile(r"^(.*?)</(?:think|thinking|reasoning)>", re.DOTALL | re.IGNORECASE)

# An answer line may carry markdown around it: "**FINAL**(x)", "- FINAL(x)", "`FINAL(x)`", "> FINAL".
_LINE_DECOR = r"[ \t>*_#`-]*"
_PROSE_FINAL_VAR = re.compile(rf"^{_LINE_DECOR}FINAL_VAR[*_`]*[ \t]*\(", re.M)
_PROSE_FINAL = re.compile(rf"^{_LINE_DECOR}FINAL(?:_ANSWER)?[*_`]*[ \t]*\(", re.M)
# Written without parentheses: "FINAL 345", "FINAL: x", "FINAL ANSWER: x", "**Final Answer:** x".
_LOOSE_FINAL_VAR = re.compile(
    rf"^{_LINE_DECOR}FINAL_VAR[*_`]*[ \t]*[:=]?[ \t]*[`'\"]?([A-Za-z_]\w*)[`'\"]?\W*$"
)
_LOOSE_FINAL = re.compile(
    rf"^(?P<decor>{_LINE_DECOR})(?:FINAL(?:[ _](?:ANSWER|RESULT|OUTPUT))?(?![\w(])"
    r"|[Ff]inal [Aa]nswer(?=[*_`]*[ \t]*(?::|=|is\b|$)))"
    r"[*_`]*[ \t]*(?P<sep>:|=|-|–|is\b)?[*_`]*[ \t]*(?P<rest>.*)$"
)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


@dataclass
class ProseFinal:
    protocol: str  # "FINAL" | "FINAL_VAR"
    text: str  # the answer text (FINAL) or the variable name (FINAL_VAR)
    loose: bool = False  # written without parentheses ("FINAL 345", "Final Answer: ...")


@dataclass
class Fence:
    tag: str  # the language tag, lower case ("" for a bare fence)
    text: str  # the block's content, dedented
    closed: bool = True
    at: int = -1  # the index of its place among the prose lines (an empty line stands for it)
    lines: tuple[int, int] = (0, 0)  # its lines in the text read, fences included: [start, end)

    @property
    def runnable(self) -> bool:
        return self.tag in RUNNABLE_TAGS


@dataclass
class ParsedReply:
    code_blocks: list[str]
    prose_final: ProseFinal | None
    unlabeled_blocks: int = 0  # fences with another or no language: not run, but worth a hint
    other_tags: list[str] = field(default_factory=list)  # their tags ("" for a bare fence)
    notes: list[str] = field(default_factory=list)  # what the reader left out or mended, for the model


def parse_reply(reply: str) -> ParsedReply:
    text, notes = _clean(reply or "")
    fences, prose = read_fences(text, notes)
    blocks = [f.text for f in fences if f.runnable and f.text.strip()]
    others = [f.tag for f in fences if not f.runnable]
    return ParsedReply(blocks, _find_final(prose, fences), len(others), others, notes)


def find_prose_final(prose: str) -> ProseFinal | None:
    """A FINAL(...) or FINAL_VAR(name) written at the start of a line, outside code fences; failing
    that, one written without parentheses (`FINAL 345`, `Final Answer: ...`), marked `loose`."""
    return _find_final(prose.split("\n"), [])


# -- cleaning ----------------------------------------------------------------------------------


def _clean(reply: str) -> tuple[str, list[str]]:
    """The reply without chat-template tokens and reasoning blocks; notes on code left out."""
    notes: list[str] = []
    reply = reply.replace("\r\n", "\n").replace("\r", "\n")
    reply = _CONTROL.sub("", reply)  # NULs and the like from a broken decoder
    if _HARMONY_FINAL in reply:  # gpt-oss unparsed: the final channel is the reply, the rest reasoning
        reply = reply.rsplit(_HARMONY_FINAL, 1)[1]
    skipped = 0

    def drop(match: re.Match[str]) -> str:
        nonlocal skipped
        skipped += _count_runnable(match.group(2) if match.lastindex and match.lastindex >= 2 else "")
        return ""

    reply = _THINK.sub(drop, reply)
    head = _THINK_CLOSE_ONLY.match(reply)
    if head is not None:  # the template opened <think> in the prompt: the reply starts inside it
        skipped += _count_runnable(head.group(1))
        reply = reply[head.end() :]
    if skipped:
        notes.append(
            f"{skipped} code block(s) inside your <think> reasoning did not run: only code in the reply "
            "itself runs."
        )
    reply = _tool_calls_as_code(reply, notes)
    reply = _SPECIAL_TOKEN.sub("", reply)
    reply = _END_OF_SEQUENCE.sub("", reply)
    return reply, notes


def _tool_calls_as_code(reply: str, notes: list[str]) -> str:
    """Code written in a tool-call format the model was trained on becomes a ```python block: Llama's
    code interpreter (<|python_tag|>code<|eom_id|>), CodeAct's <execute> (OpenHands: <execute_ipython>)
    and Hermes/Qwen <tool_call> JSON whose arguments hold code. Other tool calls do not run here, and
    the model is told."""

    def python_tag(match: re.Match[str]) -> str:
        return f"\n```python\n{match.group(1).strip()}\n```\n"

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
            (args[k] for k in _CODE_ARGS if isinstance(args, dict) and isinstance(args.get(k), str)), None
        )
        if code is None:
            notes.append(
                "Your reply made a tool call (<tool_call>), which does nothing here: there are no tools to "
                "call this way. Write Python in a ```repl block instead."
            )
            return ""
        return f"\n```python\n{code.strip()}\n```\n"

    reply = _PYTHON_TAG.sub(python_tag, reply)
    reply = _EXECUTE.sub(lambda m: f"\n```python\n{m.group(2).strip()}\n```\n", reply)
    return _TOOL_CALL.sub(tool_call, reply)


def _count_runnable(text: str) -> int:
    fences, _ = read_fences(text, [])
    return sum(1 for f in fences if f.runnable and f.text.strip())


# -- fences ------------------------------------------------------------------------------------


@dataclass
class _Open:
    tag: str
    indent: int
    char: str
    length: int
    body: list[str] = field(default_factory=list)
    depth: int = 0  # fences opened inside a quoting (markdown) block

    @property
    def runnable(self) -> bool:
        return self.tag in RUNNABLE_TAGS

    at: int = -1
    start: int = 0

    def fence(self, closed: bool, end: int) -> Fence:
        lines = [_strip_indent(line, self.indent) for line in self.body]
        text = textwrap.dedent("\n".join(lines)).strip("\n")
        return Fence(self.tag, text, closed, self.at, (self.start, end))


def read_fences(text: str, notes: list[str]) -> tuple[list[Fence], list[str]]:
    """The fenced blocks of `text` in order, and its lines outside them (one empty line per block)."""
    lines = text.split("\n")
    fences: list[Fence] = []
    prose: list[str] = []
    cur: _Open | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        m = _FENCE_LINE.match(line)
        if cur is None:
            if m is not None:
                cur = _opener(m, len(prose), i - 1)
                prose.append("")
            else:
                prose.append(line)
            continue
        if cur.runnable:
            if m is not None and _in_string(cur.body):
                cur.body.append(line)
                continue
            if m is not None and not _tag(m):
                if not "".join(cur.body).strip() and _more_code_follows(lines, i):
                    continue  # "```python" then "```": a doubled opener, the code comes next
                fences.append(cur.fence(True, i))
                cur = None
                continue
            if m is not None:
                if "".join(cur.body).strip():
                    fences.append(cur.fence(False, i - 1))
                    notes.append(
                        f"A ```{cur.tag} block was not closed before the next ```{_tag(m)} fence; it was "
                        "read as ending there. Close every block with ``` on a line of its own."
                    )
                    prose.append("")
                    cur = _opener(m, len(prose) - 1, i - 1)
                else:
                    cur = _opener(m, cur.at, cur.start)  # an empty block opened twice counts once
                continue
            code_line = line.rstrip()[:-3]
            if line.rstrip().endswith("```") and not _in_string([*cur.body, code_line]):
                # "x = 5```": the fence closes on the code's last line (unless a string holds it)
                cur.body.append(code_line)
                fences.append(cur.fence(True, i))
                cur = None
                continue
            cur.body.append(line)
            continue
        # A block that does not run (another language or none).
        if m is None:
            cur.body.append(line)
            continue
        fence_len = len(m.group("fence"))
        if fence_len < cur.length or m.group("fence")[0] != cur.char:
            cur.body.append(line)  # shorter fences are quoted inside a ```` block
            continue
        if not _tag(m):
            if cur.depth:
                cur.depth -= 1
                cur.body.append(line)
                continue
            fences.append(cur.fence(True, i))
            cur = None
            continue
        if cur.tag in _QUOTING_TAGS:
            cur.depth += 1
            cur.body.append(line)
            continue
        # "```" then "```python": a doubled opener; after text, the bare fence was a stray one.
        if "".join(cur.body).strip():
            fences.append(cur.fence(False, i - 1))
            prose.append("")
            cur = _opener(m, len(prose) - 1, i - 1)
        else:
            cur = _opener(m, cur.at, cur.start)
    if cur is not None:
        fences.append(cur.fence(False, len(lines)))
    return fences, prose


def _opener(m: re.Match[str], at: int, start: int) -> _Open:
    indent = len(m.group("indent").expandtabs(4))
    fence = m.group("fence")
    return _Open(_tag(m), indent, fence[0], len(fence), at=at, start=start)


def _tag(m: re.Match[str]) -> str:
    info = m.group("info").strip().lstrip("{").lstrip(".")
    found = _TAG.match(info)
    return found.group(0).lower() if found else ""


def _strip_indent(line: str, indent: int) -> str:
    expanded = line.expandtabs(4)
    lead = len(expanded) - len(expanded.lstrip(" "))
    return expanded[min(lead, indent) :]


def _in_string(body: list[str]) -> bool:
    """Whether code so far ends inside a triple-quoted string (a fence there is part of the string)."""
    try:
        for _ in tokenize.generate_tokens(io.StringIO("\n".join(body) + "\n").readline):
            pass
    except tokenize.TokenError as exc:
        message = str(exc.args[0] if exc.args else exc)
        return "multi-line string" in message or "triple-quoted" in message
    except (SyntaxError, ValueError):
        return False
    return False


def _more_code_follows(lines: list[str], start: int) -> bool:
    """After an empty block: is there a line of code and then a closing fence before any opener?"""
    seen_code = False
    for line in lines[start:]:
        m = _FENCE_LINE.match(line)
        if m is not None:
            return seen_code and not _tag(m)
        seen_code = seen_code or bool(line.strip())
    return False


# -- answers -----------------------------------------------------------------------------------


def _find_final(prose: list[str], fences: list[Fence]) -> ProseFinal | None:
    text = "\n".join(prose)
    var = _PROSE_FINAL_VAR.search(text)
    final = _PROSE_FINAL.search(text)
    if var and (not final or var.start() <= final.start()):
        name = _unquote(_balanced_argument(text, var.end()).strip("`"))
        return ProseFinal("FINAL_VAR", name)
    if final:
        return ProseFinal("FINAL", _balanced_argument(text, final.end()))
    return _loose_final(prose, fences)


def _loose_final(prose: list[str], fences: list[Fence]) -> ProseFinal | None:
    """The first answer line written without parentheses, if any."""
    for index, line in enumerate(prose):
        var = _LOOSE_FINAL_VAR.match(line)
        if var is not None:
            return ProseFinal("FINAL_VAR", var.group(1), loose=True)
        m = _LOOSE_FINAL.match(line)
        if m is None:
            continue
        if "#" in m.group("decor") and not m.group("sep") and "answer" not in line.lower():
            continue  # a heading such as "## FINAL REPORT" names a section, not an answer
        rest = _strip_decor(m.group("rest"))
        if not rest:
            rest = _following_text(prose, index + 1, fences)
        if rest:
            return ProseFinal("FINAL", rest, loose=True)
    return None


def _following_text(prose: list[str], start: int, fences: list[Fence]) -> str:
    """What follows an answer marker on a line of its own: the text up to the next block, or, when a
    block comes first ("FINAL:" then a ``` block), that block's text."""
    slots = {f.at: f for f in fences}
    lines: list[str] = []
    for index in range(start, len(prose)):
        fence = slots.get(index)
        if fence is not None:
            if "".join(lines).strip():
                break
            return "" if fence.runnable else fence.text.strip()
        lines.append(prose[index])
    return _strip_decor("\n".join(lines))


def _strip_decor(text: str) -> str:
    text = text.strip()
    for mark in ("**", "__", "`"):
        if text.startswith(mark) and text.endswith(mark) and len(text) > 2 * len(mark):
            text = text[len(mark) : -len(mark)].strip()
    if text.startswith("**"):
        text = text[2:].strip()
    if text.endswith("**"):
        text = text[:-2].strip()
    return _unquote(text)


def _balanced_argument(text: str, start: int) -> str:
    """The text inside FINAL( ... ): up to the matching parenthesis, else the rest of the reply."""
    depth = 1
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return _unquote(text[start:i].strip())
    body = text[start:].strip()
    return _unquote(body[:-1].strip() if body.endswith(")") else body)


def _unquote(text: str) -> str:
    if text[:1] in ("'", '"') and text[-1:] == text[:1]:
        # A Python string literal ("He said \\"hi\\"", '\\n'-escaped lines) means what Python reads.
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = None
        if isinstance(value, str):
            return value
    for quote in ('"""', "'''", '"', "'"):
        if len(text) >= 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            return text[len(quote) : -len(quote)]
    return text


def is_identifier(name: str) -> bool:
    return _IDENTIFIER.fullmatch(name) is not None
