"""The fenced blocks of a reply, read line by line the way a person reads markdown.

Pairing fences with one regex desyncs as soon as a block in another language comes first, so the
reader keeps one open block at a time. What it does beyond CommonMark is a list of named rules
(recursa/loop/rules.py), each consulted through `on(name)`:
- a fence with a language tag opens a block and the next bare fence closes it; a runnable block is
  closed by a bare fence only outside a triple-quoted string (`fences_in_strings`);
- a tagged fence met inside a runnable block means the block was never closed (`unclosed_block`);
- a doubled opener counts once (`doubled_opener`), "x = 5```" closes on the code's line
  (`fence_on_last_code_line`), a whole block may sit on one line (`one_line_fence`), the first line
  of code may follow the tag (`code_on_opener`);
- ```markdown blocks may quote fences of their own (`quoting_blocks`); a block opened with more
  backticks always may (CommonMark);
- a FINAL( whose argument quotes fences is prose, all of it (`final_spans_fences`).
Fences indented inside a markdown list are dedented; a block left open at the end of the reply is kept.
"""

from __future__ import annotations

import io
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
    argument_end,
)

# ```repl is the paper's fence; models trained on notebooks write ```python (any case), Gemini's
# code-execution habit is ```tool_code. With the `python_fences` rule all of them run.
PAPER_TAGS = frozenset({"repl"})
RUNNABLE_TAGS = PAPER_TAGS | {"python", "py", "python3", "py3", "ipython", "tool_code"}
_QUOTING_TAGS = frozenset({"markdown", "md"})  # blocks that may show fenced examples of their own

FENCE_LINE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*?)[ \t]*$")
_TAG = re.compile(r"[A-Za-z0-9_+#-]*")
# "```repl print(len(context))```": a whole block on one line.
_ONE_LINE_FENCE = re.compile(
    r"^[ \t]*```[ \t]*(?P<tag>[A-Za-z0-9_+-]+)[ \t]+(?P<code>[^`\s].*?)[ \t]*```[ \t]*$"
)
_ATTRIBUTE = re.compile(r"[\w-]+=\S*|\{.*\}|[\w./-]+")  # "```python title=x.py", "```python {.x}"

Switch = Callable[[str], bool]


def _all_on(name: str) -> bool:
    return True


@dataclass
class Fence:
    tag: str  # the language tag, lower case ("" for a bare fence)
    text: str  # the block's content, dedented
    closed: bool = True
    at: int = -1  # the index of its place among the prose lines (an empty line stands for it)
    lines: tuple[int, int] = (0, 0)  # its lines in the text read, fences included: [start, end)
    runnable: bool = False  # its tag is one that runs under the rules in force


@dataclass
class _Open:
    tag: str
    indent: int
    char: str
    length: int
    runnable: bool
    body: list[str] = field(default_factory=list)
    depth: int = 0  # fences opened inside a quoting (markdown) block
    at: int = -1
    start: int = 0

    def fence(self, closed: bool, end: int) -> Fence:
        return Fence(self.tag, fence_text(self.body, self.indent), closed, self.at, (self.start, end), self.runnable)


def fence_text(body: list[str], indent: int = 0) -> str:
    """A block's code from its lines: the fence's own indentation stripped, tabs expanded, dedented."""
    if indent:
        lines = [_strip_indent(line, indent) for line in body]
    else:  # nothing to strip: only tabs to expand, as _strip_indent does
        lines = [line.expandtabs(4) if "\t" in line else line for line in body]
    text = "\n".join(lines)
    if any(line[:1] in (" ", "\t") for line in lines):  # else dedent would return it as it is
        text = textwrap.dedent(text)
    return text.strip("\n")


def runnable_tags(on: Switch) -> frozenset[str]:
    """The tags of the fences that run under the rules `on` says are in force."""
    return (RUNNABLE_TAGS - PAPER_TAGS if on("python_fences") else frozenset()) | (
        PAPER_TAGS if on("repl_fence") else frozenset()
    )


class _Reader:
    def __init__(self, on: Switch) -> None:
        self.on = on
        self.tags = runnable_tags(on)
        self.code_on_opener = on("code_on_opener")

    def opener(self, m: re.Match[str], at: int, start: int) -> _Open:
        indent = len(m.group("indent").expandtabs(4))
        fence = m.group("fence")
        tag = _tag(m)
        opened = _Open(tag, indent, fence[0], len(fence), tag in self.tags, at=at, start=start)
        if opened.runnable and self.code_on_opener:
            rest = m.group("info").strip().lstrip("{.")[len(opened.tag) :].strip()
            if rest and _is_code(rest):  # "```python import re": the first line of code on the opener
                opened.body.append(" " * indent + rest)
        return opened


def read_fences(text: str, notes: list[str], on: Switch = _all_on) -> tuple[list[Fence], list[str]]:
    """The fenced blocks of `text` in order, and its lines outside them (one empty line per block).
    `on(rule)` says whether a rule of recursa/loop/rules.py is in force (all are by default)."""
    reader = _Reader(on)
    # The rules in force, asked once: the loop below runs once per line of every reply.
    spans, one_line, in_strings = on("final_spans_fences"), on("one_line_fence"), on("fences_in_strings")
    doubled_opener, unclosed, on_last_line = on("doubled_opener"), on("unclosed_block"), on("fence_on_last_code_line")
    lines = text.split("\n")
    fences: list[Fence] = []
    prose: list[str] = []
    cur: _Open | None = None
    span_tries = [0]
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        # Every fence pattern needs a backtick or a tilde, and every FINAL( a parenthesis: most lines
        # of a reply (its prose, its code) have none, and are read without a regex.
        plain = "`" not in line and "~" not in line
        m = None if plain else FENCE_LINE.match(line)
        if cur is None:
            if m is not None:
                cur = reader.opener(m, len(prose), i - 1)
                prose.append("")
                continue
            span = _final_span(lines, i - 1, span_tries) if spans and "(" in line else 1
            if span > 1:  # FINAL( ... ) whose argument quotes fences of its own: all of it is prose
                prose.extend(lines[i - 1 : i - 1 + span])
                i += span - 1
                continue
            one = _ONE_LINE_FENCE.match(line) if one_line and not plain else None
            if one is not None and one.group("tag").lower() in reader.tags:
                tag = one.group("tag").lower()
                fences.append(Fence(tag, one.group("code"), True, len(prose), (i - 1, i), True))
                prose.append("")
                continue
            prose.append(line)
            continue
        if plain:  # no fence, nor one closing on this line: a line of the open block
            cur.body.append(line)
            continue
        if cur.runnable:
            if m is not None and in_strings and _in_string(cur.body):
                cur.body.append(line)
                continue
            if m is not None and not _tag(m):
                doubled = doubled_opener and not "".join(cur.body).strip()
                if doubled and _more_code_follows(lines, i):
                    continue  # "```python" then "```": a doubled opener, the code comes next
                fences.append(cur.fence(True, i))
                cur = None
                continue
            if m is not None and unclosed:
                if "".join(cur.body).strip():
                    fences.append(cur.fence(False, i - 1))
                    notes.append(
                        f"A ```{cur.tag} block was not closed before the next ```{_tag(m)} fence; it was "
                        "read as ending there. Close every block with ``` on a line of its own."
                    )
                    prose.append("")
                    cur = reader.opener(m, len(prose) - 1, i - 1)
                else:
                    cur = reader.opener(m, cur.at, cur.start)  # an empty block opened twice counts once
                continue
            if (
                m is None
                and on_last_line
                and line.rstrip().endswith("```")
                and not _in_string([*cur.body, line.rstrip()[:-3]])
            ):
                # "x = 5```": the fence closes on the code's last line (unless a string holds it)
                cur.body.append(line.rstrip()[:-3])
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
        if cur.tag in _QUOTING_TAGS and on("quoting_blocks"):
            cur.depth += 1
            cur.body.append(line)
            continue
        # "```" then "```python": a doubled opener; after text, the bare fence was a stray one.
        if "".join(cur.body).strip() or not doubled_opener:
            fences.append(cur.fence(False, i - 1))
            prose.append("")
            cur = reader.opener(m, len(prose) - 1, i - 1)
        else:
            cur = reader.opener(m, cur.at, cur.start)
    if cur is not None:
        fences.append(cur.fence(False, len(lines)))
    return fences, prose


def count_runnable(text: str) -> int:
    """How many runnable blocks with code `text` holds."""
    fences, _ = read_fences(text, [])
    return sum(1 for f in fences if f.runnable and f.text.strip())


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
    code = "\n".join(body)
    if '"""' not in code and "'''" not in code:
        return False  # no triple quote, no such string: most blocks need no tokenizer run
    try:
        for _ in tokenize.generate_tokens(io.StringIO(code + "\n").readline):
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
        m = FENCE_LINE.match(line)
        if m is not None:
            return seen_code and not _tag(m)
        seen_code = seen_code or bool(line.strip())
    return False


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
    if not any(FENCE_LINE.match(line) for line in lines[index + 1 : index + span]):
        return 1
    return span
