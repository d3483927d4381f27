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

import io
import json
import re
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field

from recursa.loop.finals import (
    PROSE_FINAL,
    PROSE_FINAL_VAR,
    SPAN_LINES,
    SPAN_TRIES,
    SPAN_WINDOW,
    ProseFinal,
    argument_end,
    assigned_in,
    fenced_final,
    final_as_text,
    find_final,
    inline_final,
    is_identifier,
)
from recursa.loop.unfenced import Unfenced, find_unfenced

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
    r"<\|start_header_id\|>[a-z_]{1,20}<\|end_header_id\|>"
    r"|<\|(?:im_start|start)\|>(?:assistant|user|system)?|<\|[A-Za-z0-9_.:-]{1,40}\|>"
    r"|<｜[^｜<>\n]{1,40}｜>|<start_of_turn>(?:model|user)?|<end_of_turn>|<eos>|<ctrl\d{1,4}>"
)
_END_OF_SEQUENCE = re.compile(r"[ \t]*</s>[ \t]*$", re.M)
_HARMONY_FINAL = "<|channel|>final<|message|>"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Invisible characters copied from web text or emitted by some tokenizers (zero-width space, BOM, word
# joiner): a fence or FINAL after one is no longer at the start of its line.
_INVISIBLE = re.compile("[\u200b\ufeff\u2060]")
# Indentation in no-break or ideographic spaces: Python rejects it, and fences behind it go unseen.
_ODD_INDENT = re.compile(
    "^[ \t\u00a0\u2007\u202f\u3000]*[\u00a0\u2007\u202f\u3000][ \t\u00a0\u2007\u202f\u3000]*", re.M
)
# FINAL written with fullwidth punctuation (Chinese-language replies): FINAL（42）, FINAL：42.
_FULLWIDTH_FINAL = re.compile(
    "^([^\\S\\n]*[>*_#`-]*(?i:FINAL(?:_VAR|_ANSWER)?)[*_`]*)[ \t\u00a0]*（(.*)）", re.M
)
_FULLWIDTH_COLON = re.compile("^([^\\S\\n]*[>*_#`-]*FINAL(?:_VAR|_ANSWER)?[*_`]*)[ \t\u00a0]*：", re.M)
_NBSP_BEFORE_PAREN = re.compile("(FINAL(?:_VAR)?)[\u00a0\u202f]+(?=\\()")
_PYTHON_TAG = re.compile(r"<\|python_tag\|>(.*?)(?:<\|eom_id\|>|<\|eot_id\|>|\Z)", re.DOTALL)
_EXECUTE = re.compile(r"<(execute|execute_ipython)>(.*?)</\1>", re.DOTALL)  # CodeAct / OpenHands
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|\Z)", re.DOTALL)
_CODE_ARGS = ("code", "source", "python", "script", "input")
_THINK = re.compile(r"<(think|thinking|reasoning)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_THINK_CLOSE_ONLY = re.compile(r"^(.*?)</(?:think|thinking|reasoning)>", re.DOTALL | re.IGNORECASE)

# "```repl print(len(context))```": a whole block on one line.
_ONE_LINE_FENCE = re.compile(
    r"^[ \t]*```[ \t]*(?P<tag>[A-Za-z0-9_+-]+)[ \t]+(?P<code>[^`\s].*?)[ \t]*```[ \t]*$"
)
_ATTRIBUTE = re.compile(r"[\w-]+=\S*|\{.*\}|[\w./-]+")  # "```python title=x.py", "```python {.x}"
_UNCLOSED_THINK = re.compile(r"^\s*<(think|thinking|reasoning)>", re.IGNORECASE)
_PROMPTED = re.compile(r"^(?:>>>|\.\.\.)(?: |$)")


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
    # FINAL(...) inside a sentence ("So the answer is FINAL(42).") or alone in a plain fence: not an
    # answer while turns are left (as often a plan or an expected output), but what the forced last
    # call takes rather than the whole reply.
    last_call_final: ProseFinal | None = None
    # The code blocks are Python the reply wrote outside any fence (recursa/loop/unfenced.py): they
    # run, but an answer they give is not taken, since the model has not seen their output.
    unfenced: bool = False


def parse_reply(reply: str, *, unfenced_code: bool = True) -> ParsedReply:
    """The reply's code blocks and answer. `unfenced_code`: a reply with no runnable block whose
    lines hold plain Python (recursa/loop/unfenced.py) runs those lines; False only tells the model."""
    text, notes = _clean(reply or "")
    fences, prose = read_fences(text, notes)
    blocks = [_without_prompts(f.text, notes) for f in fences if f.runnable and f.text.strip()]
    others = [f.tag for f in fences if not f.runnable]
    final = find_final(prose, fences)
    for block in list(blocks):
        written = final_as_text(block)
        if written is not None:  # ```repl\nFINAL(The answer is 42)\n```: prose in a fence, not code
            blocks.remove(block)
            final = final or written
    if final is not None and final.protocol == "FINAL" and is_identifier(final.text):
        final.unrun = assigned_in(prose, final.text)
    # An answer's own lines are never code to run, even where its argument quotes code; an indented
    # FINAL (`if n > 2:` then `    FINAL("long")`) is a line of the code around it.
    answer_lines: set[int] = set()
    if final is not None and 0 <= final.line < len(prose) and not prose[final.line][:1].isspace():
        answer_lines = set(range(final.line, final.end_line + 1))
    no_block = not blocks and not any(f.runnable for f in fences)
    runs = find_unfenced(prose, {f.at for f in fences} | answer_lines) if no_block else []
    # A fence with no language tag holding plain Python is read by the same rule as Python with no
    # fence at all: more plainly code, not less. Output or a plan shown in one (`42`, `FINAL(3)`) is not.
    bare = [
        (f, found) for f in fences if no_block and not f.tag and (found := find_unfenced(f.text.split("\n")))
    ]
    if bare and unfenced_code:
        others = [f.tag for f in fences if not f.runnable and all(f is not g for g, _ in bare)]
        placed = [(r.start, r.code) for r in runs] + [
            (f.at, "\n\n".join(r.code for r in found)) for f, found in bare
        ]
        blocks = [code for _at, code in sorted(placed, key=lambda p: p[0])]
        notes.append(_bare_fence_note(len(bare)))
        if runs:
            notes.append(_unfenced_note(runs, ran=True))
    elif runs and unfenced_code:
        blocks = [r.code for r in runs]
        notes.append(_unfenced_note(runs, ran=True))
    elif runs and final is None:
        notes.append(_unfenced_note(runs, ran=False))
    ran_unfenced = bool((runs or bare) and unfenced_code)
    parsed = ParsedReply(blocks, final, len(others), others, notes, unfenced=ran_unfenced)
    if parsed.unfenced and final is not None and any(r.start <= final.line < r.end for r in runs):
        # An indented FINAL inside the code that runs: the cell calls it (and is told it waits for the
        # output); what the forced last call would take.
        parsed.prose_final, parsed.last_call_final = None, final
        return parsed
    if final is None:
        inline = inline_final(prose)
        if inline is not None and not blocks:  # beside code it is usually a plan: the output comes first
            notes.append(
                f"Your reply wrote {inline.protocol}(...) inside a sentence; an answer counts only at the "
                f"start of a line of its own: {inline.protocol}(...) with nothing before it."
            )
        parsed.last_call_final = inline or (None if blocks else fenced_final(fences))
    return parsed


def _unfenced_note(runs: list[Unfenced], *, ran: bool) -> str:
    first, last = runs[0].code.split("\n"), runs[-1].code.split("\n")
    lines = sum(r.code.count("\n") + 1 for r in runs)
    span = f"`{_shown(first[0])}`" + (f" to `{_shown(last[-1])}`" if lines > 1 else "")
    what = f"Python outside a code block ({lines} line{'s' if lines > 1 else ''}, {span})"
    how = "Write code in a block: a line ```repl before it and a line ``` after it."
    broken = "".join(
        f" Python could not read the line after it, {r.broken}, so that line and the code after it did not run."
        for r in runs
        if r.broken
    )
    if ran:
        return f"Your reply had {what}; it ran as a cell, and its output is above.{broken} {how}"
    return f"Your reply had {what}; it did not run.{broken} {how}"


def _bare_fence_note(n: int) -> str:
    what = "a code block" if n == 1 else f"{n} code blocks"
    return (
        f"Your reply had Python in {what} with no language after the ```; it ran as a cell, and its "
        "output is above. Name the language so that it is certain to run: a line ```repl before it."
    )


def _shown(line: str) -> str:
    line = line.strip()
    return line if len(line) <= 60 else line[:57] + "..."


def find_prose_final(prose: str) -> ProseFinal | None:
    """A FINAL(...) or FINAL_VAR(name) written at the start of a line, outside code fences; failing
    that, one written without parentheses (`FINAL 345`, `Final Answer: ...`), marked `loose`."""
    return find_final(prose.split("\n"), [])


# -- cleaning ----------------------------------------------------------------------------------


def _clean(reply: str) -> tuple[str, list[str]]:
    """The reply without chat-template tokens and reasoning blocks; notes on code left out."""
    notes: list[str] = []
    reply = reply.replace("\r\n", "\n").replace("\r", "\n")
    reply = _CONTROL.sub("", reply)  # NULs and the like from a broken decoder
    reply = _INVISIBLE.sub("", reply)
    reply = _ODD_INDENT.sub(lambda m: " " * len(m.group(0).expandtabs(4)), reply)
    reply = _FULLWIDTH_FINAL.sub(r"\1(\2)", reply)
    reply = _FULLWIDTH_COLON.sub(r"\1:", reply)
    reply = _NBSP_BEFORE_PAREN.sub(r"\1", reply)
    if _HARMONY_FINAL in reply:  # gpt-oss unparsed: the final channel is the reply, the rest reasoning
        reply = reply.rsplit(_HARMONY_FINAL, 1)[1]
    skipped = 0

    def drop(match: re.Match[str]) -> str:
        nonlocal skipped
        skipped += _count_runnable(match.group(2) if match.lastindex and match.lastindex >= 2 else "")
        return ""

    reply = _before_last(reply, ("</think>", "</thinking>", "</reasoning>"), lambda t: _THINK.sub(drop, t))
    head = _THINK_CLOSE_ONLY.match(reply)
    if head is not None:  # the template opened <think> in the prompt: the reply starts inside it
        skipped += _count_runnable(head.group(1))
        reply = reply[head.end() :]
    unclosed = _UNCLOSED_THINK.match(reply)
    if unclosed is not None:  # cut off while reasoning (the output limit): none of it is the reply
        skipped += _count_runnable(reply[unclosed.end() :])
        reply = ""
        notes.append(
            f"Your reply ended inside <{unclosed.group(1)}> reasoning that was never closed, so none of it "
            "counted. Keep the reasoning short and write the code or answer after it."
        )
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
    reply = _before_last(
        reply,
        ("</execute>", "</execute_ipython>"),
        lambda t: _EXECUTE.sub(lambda m: f"\n```python\n{m.group(2).strip()}\n```\n", t),
    )
    # Openers after the last "}" cannot match: left out of the search, they cannot make it quadratic.
    cut = reply.find("<tool_call>", reply.rfind("}") + 1)
    if cut < 0:
        return _TOOL_CALL.sub(tool_call, reply)
    return _TOOL_CALL.sub(tool_call, reply[:cut]) + reply[cut:]


def _before_last(text: str, closers: tuple[str, ...], sub: Callable[[str], str]) -> str:
    """`sub` applied up to the last closing tag only: an opening tag with no close after it (a model
    repeating "<think>" until its output limit) would make a lazy pair pattern quadratic."""
    lowered = text.lower()
    end = max((lowered.rfind(c) + len(c) for c in closers if c in lowered), default=0)
    return sub(text[:end]) + text[end:] if end else text


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
    span_tries = [0]
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        m = _FENCE_LINE.match(line)
        if cur is None:
            if m is not None:
                cur = _opener(m, len(prose), i - 1)
                prose.append("")
                continue
            span = _final_span(lines, i - 1, span_tries)
            if span > 1:  # FINAL( ... ) whose argument quotes fences of its own: all of it is prose
                prose.extend(lines[i - 1 : i - 1 + span])
                i += span - 1
                continue
            one = _ONE_LINE_FENCE.match(line)
            if one is not None and one.group("tag").lower() in RUNNABLE_TAGS:
                fences.append(
                    Fence(one.group("tag").lower(), one.group("code"), True, len(prose), (i - 1, i))
                )
                prose.append("")
                continue
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
    opened = _Open(_tag(m), indent, fence[0], len(fence), at=at, start=start)
    if opened.runnable:
        rest = m.group("info").strip().lstrip("{.")[len(opened.tag) :].strip()
        if rest and _is_code(rest):  # "```python import re": the first line of code on the opener
            opened.body.append(" " * indent + rest)
    return opened


def _is_code(text: str) -> bool:
    if _ATTRIBUTE.fullmatch(text):
        return False
    try:
        compile(text, "<fence>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


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


def _final_span(lines: list[str], index: int, tries: list[int]) -> int:
    """How many lines a FINAL( starting `lines[index]` spans, when its argument holds fence lines.

    Bounded (a few FINAL lines, a window of text each): a model stuck repeating "FINAL(42" for
    thousands of lines must not make reading its reply quadratic."""
    m = PROSE_FINAL.match(lines[index]) or PROSE_FINAL_VAR.match(lines[index])
    if m is None or argument_end(lines[index], m.end()) is not None or tries[0] >= SPAN_TRIES:
        return 1
    tries[0] += 1
    text = "\n".join(lines[index : index + SPAN_LINES])
    end = argument_end(text, m.end(), SPAN_WINDOW)
    if end is None:
        return 1
    span = text.count("\n", 0, end) + 1
    if not any(_FENCE_LINE.match(line) for line in lines[index + 1 : index + span]):
        return 1
    return span


def _without_prompts(code: str, notes: list[str]) -> str:
    """A block written as a console session (>>> lines, output between): its input lines only."""
    lines = code.split("\n")
    first = next((line for line in lines if line.strip()), "")
    if not first.startswith(">>>"):
        return code
    kept = [line[4:] if len(line) > 3 else "" for line in lines if _PROMPTED.match(line)]
    dropped = sum(1 for line in lines if line.strip() and not _PROMPTED.match(line))
    if dropped:
        notes.append(
            f"A block was written as a console session: its >>> lines ran and {dropped} line(s) of "
            "output written under them were left out. Write plain code in ```repl blocks."
        )
    return "\n".join(kept)
