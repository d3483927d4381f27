"""The one entry point for reading a root model's reply: `read_reply(text, rules)`.

What it recognises, and why, is the ordered list of named rules in recursa/loop/rules.py: the text
rules mend the reply (recursa/loop/cleaning.py), the fence reader finds its blocks
(recursa/loop/fences.py), the answer rules find an answer written in prose (recursa/loop/finals.py),
the code rules find Python written without a ```repl fence (recursa/loop/unfenced.py). The reading is
one `Reply` whose `outcome` every caller consults the same way: code to run, an answer to take, or
nothing. Code is never dropped silently: every fence that does not run is counted for the hint, and
code left out for another reason is reported in `notes`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from recursa.loop.cleaning import CONTROL as _CONTROL
from recursa.loop.fences import Fence, fence_text, read_fences
from recursa.loop.finals import (
    ProseFinal,
    assigned_in,
    fenced_final,
    final_as_text,
    find_final,
    inline_final,
    is_identifier,
    no_answer_marks,
)
from recursa.loop.rules import DEFAULT_RULES, ReplyRules
from recursa.loop.unfenced import Unfenced, find_unfenced

_PROMPTED = re.compile(r"^(?:>>>|\.\.\.)(?: |$)")

# Where an answer written in prose stands:
# alone        no code beside it: the turn takes it;
# beside_code  next to code that runs: the turn takes it after the code only if the rules say so
#              (rules.py, `answer_beside_code`), else it waits for the model to see the output;
# aside        only the forced last call takes it (inside a sentence, alone in a plain fence, inside
#              unfenced code that runs and calls it).
AnswerPlace = Literal["alone", "beside_code", "aside"]
ReplyOutcome = Literal["code", "answer", "nothing"]


@dataclass
class Answer:
    written: ProseFinal
    place: AnswerPlace


@dataclass
class Reply:
    """How a reply was read. `outcome` is what a turn does with it; `answer` is what the last call takes."""

    code: list[str]  # the blocks that run, in order
    answer: Answer | None = None
    code_outside_fences: bool = False  # the code is Python the reply wrote outside any ```repl fence
    skipped_tags: list[str] = field(default_factory=list)  # tags of fences that do not run ("": bare)
    notes: list[str] = field(default_factory=list)  # what the reader left out or mended, for the model

    @property
    def outcome(self) -> ReplyOutcome:
        if self.code:
            return "code"
        if self.answer is not None and self.answer.place == "alone":
            return "answer"
        return "nothing"

    @property
    def turn_answer(self) -> ProseFinal | None:
        """The answer a turn may take: alone, or beside the code (then only as the rules allow)."""
        if self.answer is None or self.answer.place == "aside":
            return None
        return self.answer.written


def read_reply(reply: str, rules: ReplyRules = DEFAULT_RULES) -> Reply:
    """The reply's code blocks and answer, read by `rules` (every rule by default)."""
    plain = _plain(reply, rules)
    return plain if plain is not None else read_by_rules(reply, rules)


# Beyond what an answer needs (`no_answer_marks`: "final" in some case, "<" or a backslash, and
# only ASCII text, which no text rule mends but for "\r" and control characters): what a rule of the
# fence reader or the console-prompt rule needs, a tilde, a triple-quoted string (a fence inside one
# is part of it) or ">>>". Backticks are looked at line by line below.
_NOT_PLAIN = ("\r", "~", ">>>", '"""', "'''")


def _plain(text: str, rules: ReplyRules) -> Reply | None:
    """A reply of prose and fenced blocks that run, and nothing any rule mends, answers or reads
    more into: its blocks, as `read_by_rules` reads them, without running every rule (each step of an
    RL episode reads a reply, and the rules' code, run once a step, costs about 0.1 ms there: see
    docs/performance.md, "RL step, fifth pass"). None for any other reply."""
    tags = rules.plain_tags
    if tags is None or not text or not no_answer_marks(text) or any(s in text for s in _NOT_PLAIN):
        return None
    if _CONTROL.search(text) is not None:
        return None
    blocks: list[str] = []
    body: list[str] | None = None
    for line in text.split("\n"):
        if "`" not in line:
            if body is not None:
                body.append(line)
        elif body is None:
            if line[:3] != "```" or line[3:] not in tags:
                return None
            body = []
        elif line == "```":
            code = fence_text(body)
            if not code.strip():
                return None
            blocks.append(code)
            body = None
        else:
            return None
    return Reply(blocks) if blocks and body is None else None


def read_by_rules(reply: str, rules: ReplyRules = DEFAULT_RULES) -> Reply:
    """`read_reply` by every rule in `rules`, whatever the reply holds."""
    on = rules.on
    notes: list[str] = []
    text = reply or ""
    for rule in rules.of_stage("text"):
        assert rule.apply is not None
        text = rule.apply(text, notes)
    fences, prose = read_fences(text, notes, on)
    blocks = [f.text for f in fences if f.runnable and f.text.strip()]
    if on("console_prompts"):
        blocks = [_without_prompts(b, notes) for b in blocks]
    others = [f.tag for f in fences if not f.runnable]
    final = find_final(prose, fences, on) or _own_answer(rules, prose, fences)
    for block in list(blocks):
        written = final_as_text(block, on) if on("fenced_final_text") else None
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
        (f, found)
        for f in fences
        if no_block and not f.tag and on("bare_fence_code") and (found := find_unfenced(f.text.split("\n")))
    ]
    unfenced = on("unfenced_code")
    if bare:
        others = [f.tag for f in fences if not f.runnable and all(f is not g for g, _ in bare)]
        placed = [(r.start, r.code) for r in runs if unfenced] + [
            (f.at, "\n\n".join(r.code for r in found)) for f, found in bare
        ]
        blocks = [code for _at, code in sorted(placed, key=lambda p: p[0])]
        notes.append(_bare_fence_note(len(bare)))
        if runs and unfenced:
            notes.append(_unfenced_note(runs, ran=True))
    elif runs and unfenced:
        blocks = [r.code for r in runs]
        notes.append(_unfenced_note(runs, ran=True))
    elif runs and final is None:
        notes.append(_unfenced_note(runs, ran=False))
    outside = bool((runs and unfenced) or bare)
    read = Reply(blocks, None, outside, others, notes)
    if final is not None:
        inside = outside and any(r.start <= final.line < r.end for r in runs)
        # An indented FINAL inside the code that runs: the cell calls it (and is told it waits for the
        # output); what the forced last call would take.
        read.answer = Answer(final, "aside" if inside else "beside_code" if blocks else "alone")
        return read
    inline = inline_final(prose) if on("inline_final") else None
    if inline is not None and not blocks:  # beside code it is usually a plan: the output comes first
        notes.append(
            f"Your reply wrote {inline.protocol}(...) inside a sentence; an answer counts only at the "
            f"start of a line of its own: {inline.protocol}(...) with nothing before it."
        )
    aside = inline or (None if blocks or not on("fenced_final") else fenced_final(fences, on))
    if aside is not None:
        read.answer = Answer(aside, "aside")
    return read


def _own_answer(rules: ReplyRules, prose: list[str], fences: list[Fence]) -> ProseFinal | None:
    """The first answer found by an answer rule a dialect added (rules.py, `adding`)."""
    for rule in rules.of_stage("answer"):
        if rule.find is not None and (found := rule.find(prose, fences)) is not None:
            return found
    return None


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


def _without_prompts(code: str, notes: list[str]) -> str:
    """A block written as a console session (>>> lines, output between): its input lines only."""
    if ">>>" not in code:
        return code
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
