"""Answers written in prose: FINAL(...) and FINAL_VAR(name) at the start of a line, the looser ways
small models write them ("FINAL 345", "Final Answer: ..."), and where an answer's argument ends.

The argument of FINAL( ends at the parenthesis that closes it, read the way a person would: a string
literal or a JSON value is read whole (parentheses inside it do not count), and a close that leaves
an unmatched ")" at the end of the line ("Done :) all good)") was not the end.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

# An answer line may carry markdown around it: "**FINAL**(x)", "- FINAL(x)", "`FINAL(x)`", "> FINAL", a
# tag ("<answer>FINAL(x)</answer>") or a label that says what follows ("**Answer:** FINAL(x)").
_LINE_DECOR = (
    r"(?:[ \t>*_#`-]|\d{1,3}[.)][ \t]|<[A-Za-z][A-Za-z_]{0,19}>"
    r"|(?:[Ff]inal[ \t]+|FINAL[ \t]+)?(?:[Aa]nswer|ANSWER|[Rr]esult|RESULT)[ \t]*:)*"
)
# Small models also write the markers in lower or title case ("final(42)", "Final_Var(x)"). Those
# count only with the parenthesis right after the word: "Final (and most important) point" is English.
PROSE_FINAL_VAR = re.compile(rf"^{_LINE_DECOR}(?:FINAL_VAR[*_`]*[ \t]*|(?i:final_var)[*_`]*)\(", re.M)
PROSE_FINAL = re.compile(
    rf"^{_LINE_DECOR}(?:FINAL(?:_ANSWER)?[*_`]*[ \t]*|(?i:final(?:_answer)?)[*_`]*)\(", re.M
)
# The paper's protocol alone: FINAL( / FINAL_VAR( at the start of a line (after spaces).
_PAPER_FINAL_VAR = re.compile(r"^[ \t]*FINAL_VAR[ \t]*\(", re.M)
_PAPER_FINAL = re.compile(r"^[ \t]*FINAL[ \t]*\(", re.M)
_DECOR_ONLY_FINAL_VAR = re.compile(rf"^{_LINE_DECOR}FINAL_VAR[*_`]*[ \t]*\(", re.M)
_DECOR_ONLY_FINAL = re.compile(rf"^{_LINE_DECOR}FINAL(?:_ANSWER)?[*_`]*[ \t]*\(", re.M)
_CASE_ONLY_FINAL_VAR = re.compile(r"^[ \t]*(?:FINAL_VAR[ \t]*|(?i:final_var))\(", re.M)
_CASE_ONLY_FINAL = re.compile(r"^[ \t]*(?:FINAL(?:_ANSWER)?[ \t]*|(?i:final(?:_answer)?))\(", re.M)

# Whether a rule of recursa/loop/rules.py is in force, by its name.
Switch = Callable[[str], bool]


def all_on(name: str) -> bool:
    return True


def _markers(on: Switch) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The FINAL_VAR( and FINAL( patterns under the rules in force."""
    decor, any_case = on("final_decoration"), on("final_any_case")
    if decor and any_case:
        return PROSE_FINAL_VAR, PROSE_FINAL
    if decor:
        return _DECOR_ONLY_FINAL_VAR, _DECOR_ONLY_FINAL
    if any_case:
        return _CASE_ONLY_FINAL_VAR, _CASE_ONLY_FINAL
    return _PAPER_FINAL_VAR, _PAPER_FINAL
# Written without parentheses: "FINAL 345", "FINAL: x", "FINAL ANSWER: x", "**Final Answer:** x".
_LOOSE_FINAL_VAR = re.compile(
    rf"^{_LINE_DECOR}FINAL_VAR[*_`]*[ \t]*[:=]?[ \t]*[`'\"]?([A-Za-z_]\w*)[`'\"]?\W*$"
)
_LOOSE_FINAL = re.compile(
    rf"^(?P<decor>{_LINE_DECOR})(?:FINAL(?:[ _](?:ANSWER|RESULT|OUTPUT))?(?![\w(])"
    r"|[Ff]inal [Aa]nswer(?=[*_`]*[ \t]*(?::|=|is\b|$))|[Ff]inal(?=[*_`]*[ \t]*:))"
    r"[*_`]*[ \t]*(?P<sep>:|=|-|–|is\b)?[*_`]*[ \t]*(?P<rest>.*)$"
)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_FENCED_ANSWER_TAGS = frozenset({"", "text", "txt", "plaintext", "markdown", "md"})


@dataclass
class ProseFinal:
    protocol: Literal["FINAL", "FINAL_VAR"]
    text: str  # the answer text (FINAL) or the variable name (FINAL_VAR)
    loose: bool = False  # written without parentheses ("FINAL 345", "Final Answer: ...")
    # FINAL(name) where the reply's prose assigns `name` in code outside any fence (`x = ...`): that
    # code never ran, so the word is not the answer the model meant.
    unrun: bool = False
    line: int = -1  # the index of the prose line it starts on (-1: not on a line of its own)
    end_line: int = -1  # the index of the prose line it ends on (its argument may span lines)


class FenceLike(Protocol):
    """What answer finding needs of a fenced block (recursa.loop.parse.Fence)."""

    tag: str
    text: str
    at: int

    @property
    def runnable(self) -> bool: ...


def find_final(prose: list[str], fences: Sequence[FenceLike], on: Switch = all_on) -> ProseFinal | None:
    """The answer written in `prose` (a reply's lines outside fences), by the rules in force, in
    their order: FINAL_VAR( or FINAL( at the start of a line (the first of them), then the loose
    forms, then an <answer> tag, then the last \\boxed{}."""
    text = "\n".join(prose)
    if no_answer_marks(text):
        return None
    var_marker, final_marker = _markers(on)
    var = var_marker.search(text) if on("final_var_at_line_start") else None
    final = final_marker.search(text) if on("final_at_line_start") else None
    keywords = on("final_keyword_argument")
    if var and (not final or var.start() <= final.start()):
        name = _balanced_argument(text, var.end())
        name = _unquote((_without_keyword(name, _NAME_KEYWORDS) if keywords else name).strip("`"))
        return ProseFinal("FINAL_VAR", name.strip(), **_lines_of(text, var))
    if final:
        argument = _balanced_argument(text, final.end())
        argument = _without_keyword(argument, _VALUE_KEYWORDS) if keywords else argument
        return ProseFinal("FINAL", _unboxed(argument) if on("boxed_answer") else argument, **_lines_of(text, final))
    loose = _loose_final(prose, fences, on) if on("loose_final") else None
    return loose or _tagged_or_boxed(text, on)


def no_answer_marks(text: str) -> bool:
    """Whether `text` plainly holds no answer of any form `find_final` reads: each needs the word
    "final" (in some case), a tag's "<" or a \\boxed's backslash. Checked on ASCII text only, where
    lower() matches what the patterns' ignored case does (re also folds a dotless ı into i). Every
    step of an RL episode reads a reply, and most are code alone (docs/performance.md)."""
    return text.isascii() and "<" not in text and "\\" not in text and "final" not in text.lower()


def _lines_of(text: str, marker: re.Match[str]) -> dict[str, int]:
    """The prose lines a FINAL( ... ) spans: up to its closing parenthesis, else to the end."""
    end = argument_end(text, marker.end())
    return {"line": text.count("\n", 0, marker.start()), "end_line": text.count("\n", 0, end or len(text))}


def fenced_final(fences: Sequence[FenceLike], on: Switch = all_on) -> ProseFinal | None:
    """A reply without code whose answer sits in a plain fence (```\nFINAL(42)\n```)."""
    for fence in fences:
        if fence.tag in _FENCED_ANSWER_TAGS:
            found = find_final(fence.text.split("\n"), [], on)
            if found is not None and not found.loose:
                return found
    return None


_INLINE_FINAL = re.compile(r"\b(?:FINAL(?P<var>_VAR)?[ \t]*|[Ff]inal(?P<title_var>_[Vv][Aa][Rr])?)\(")
SPAN_TRIES, SPAN_LINES, SPAN_WINDOW = 20, 2_000, 50_000


def inline_final(prose: list[str]) -> ProseFinal | None:
    """The last FINAL(...) written inside a sentence, if any (among the last few written)."""
    text = "\n".join(prose)
    if "inal" not in text and "INAL" not in text:  # the pattern needs FINAL, Final or final
        return None
    found = None
    for m in list(_INLINE_FINAL.finditer(text))[-SPAN_TRIES:][::-1]:
        if argument_end(text, m.end(), SPAN_WINDOW) is not None:
            found = m
            break
    if found is None:
        return None
    end = argument_end(text, found.end(), SPAN_WINDOW)
    assert end is not None
    argument = _unquote(text[found.end() : end].strip())
    if found.group("var") or found.group("title_var"):
        return ProseFinal(
            "FINAL_VAR", _unquote(_without_keyword(argument, _NAME_KEYWORDS).strip("`")).strip()
        )
    return ProseFinal("FINAL", _unboxed(_without_keyword(argument, _VALUE_KEYWORDS)))


def final_as_text(code: str, on: Switch = all_on) -> ProseFinal | None:
    """A block that is nothing but FINAL(...) / FINAL_VAR(...) with an argument Python cannot read
    (unquoted text): the answer as prose would give it. Valid Python runs as written."""
    stripped = code.strip()
    m = PROSE_FINAL.match(stripped) or PROSE_FINAL_VAR.match(stripped)
    if m is None or stripped[:1] in "*_`>-#" or argument_end(stripped, m.end()) != len(stripped) - 1:
        return None
    try:
        compile(stripped, "<block>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        if _BROKEN_LITERAL.match(stripped[m.end() : -1].strip()):
            return None  # FINAL(f"Total: {total"): broken code, which runs to show its SyntaxError
        return find_final([stripped], [], on)
    return None


_BROKEN_LITERAL = re.compile(r"""(?:[rRbBuUfF]{0,2}["']|[\[{(])""")


def _loose_final(prose: list[str], fences: Sequence[FenceLike], on: Switch) -> ProseFinal | None:
    """The first answer line written without parentheses, if any."""
    for index, line in enumerate(prose):
        var = _LOOSE_FINAL_VAR.match(line)
        if var is not None:
            return ProseFinal("FINAL_VAR", var.group(1), loose=True, line=index, end_line=index)
        m = _LOOSE_FINAL.match(line)
        if m is None:
            continue
        if "#" in m.group("decor") and not m.group("sep") and "answer" not in line.lower():
            continue  # a heading such as "## FINAL REPORT" names a section, not an answer
        rest = _strip_decor(m.group("rest"))
        if not rest:
            rest = _following_text(prose, index + 1, fences)
        if rest:
            # "Final Answer: The final answer is $\boxed{42}$. I hope it is correct." (the Minerva
            # format math models are trained on): the boxed part is the answer.
            found = boxed(rest) if on("boxed_answer") else None
            return ProseFinal("FINAL", found or rest, loose=True, line=index, end_line=index)
    return None


# Math-trained models (Qwen, DeepSeek-R1) answer with \boxed{...}, in $...$ or \[ ... \]; others wrap
# the answer in <answer> (<final_answer>, <final>) tags. Both are answers written without FINAL:
# taken where `FINAL 345` is.
_BOXED = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
_ANSWER_TAG = re.compile(r"<(answer|final_answer|final)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_TAG_CLOSERS = ("</answer>", "</final_answer>", "</final>")
_MATH_DELIMITERS = re.compile(r"^(?:\$\$?|\\\[|\\\()\s*(?P<inner>.*?)\s*(?:\$\$?|\\\]|\\\))$", re.DOTALL)
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)[ \t]*\{")


def boxed(text: str) -> str | None:
    """What the last \\boxed{...} in `text` holds, read to its matching brace (so nested braces, as
    in \\boxed{\\frac{1}{2}}, stay inside); a \\text{...} around all of it is dropped. None if there
    is none, or it is empty or never closed."""
    found = _last_boxed(text)
    return found[0] if found else None


def _last_boxed(text: str) -> tuple[str, int] | None:
    for m in list(_BOXED.finditer(text))[-SPAN_TRIES:][::-1]:
        inner = _braced(text, m.end())
        if inner is not None and inner.strip():
            return _without_text_command(inner.strip()), m.start()
    return None


def _braced(text: str, start: int) -> str | None:
    """The text from `start` up to the `}` that balances the `{` before it (escaped braces skipped)."""
    depth = 1
    i = start
    stop = min(len(text), start + SPAN_WINDOW)
    while i < stop:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _without_text_command(text: str) -> str:
    m = _TEXT_COMMAND.match(text)
    if m is not None and _braced(text, m.end()) == text[m.end() : -1]:
        return text[m.end() : -1].strip()
    return text


def _unboxed(text: str) -> str:
    """FINAL($\\boxed{42}$) or FINAL(\\boxed{42}): the boxed text, when the box is all there is."""
    bare = text.strip()
    delimited = _MATH_DELIMITERS.match(bare)
    if delimited is not None:
        bare = delimited.group("inner")
    m = _BOXED.match(bare)
    if m is not None and _braced(bare, m.end()) == bare[m.end() : -1]:
        return boxed(bare) or text
    return text


def _tagged_or_boxed(text: str, on: Switch) -> ProseFinal | None:
    """An answer in <answer>...</answer> (or <final_answer>, <final>; the last such), else the last
    \\boxed{...}: loose answers."""
    # Searched only up to the last closing tag: an opener repeated with no close after it must not
    # make the lazy pattern quadratic.
    if "<" not in text and "\\" not in text:
        return None  # no tag and no \\boxed: most replies, read at once
    lowered = text.lower()
    cut = max((lowered.rfind(c) + len(c) for c in _TAG_CLOSERS if c in lowered), default=0)
    cut = cut if on("answer_tags") else 0
    tags = list(_ANSWER_TAG.finditer(text[:cut])) if cut else []
    for m in tags[::-1]:
        inner = _strip_decor(m.group(2))
        if inner:
            lines = {"line": text.count("\n", 0, m.start()), "end_line": text.count("\n", 0, m.end())}
            return ProseFinal("FINAL", (on("boxed_answer") and boxed(inner)) or inner, loose=True, **lines)
    found = _last_boxed(text) if on("boxed_answer") else None
    if found is None:
        return None
    line = text.count("\n", 0, found[1])
    return ProseFinal("FINAL", found[0], loose=True, line=line, end_line=line)


# Keywords a model may name FINAL's one argument with (FINAL(answer="Paris")): the answer is the
# value. Only these: "FINAL(x = 5)" is the text of a math answer. The REPL's FINAL takes the same.
_VALUE_KEYWORDS = ("value", "answer", "result", "text", "content", "final_answer")
_NAME_KEYWORDS = ("name", "var", "var_name", "variable", "variable_name")


def _without_keyword(argument: str, keywords: tuple[str, ...]) -> str:
    if "=" not in argument:  # no keyword to take off (what follows needs "name="): at once, unparsed
        return argument
    try:
        call = ast.parse(f"f({argument})", mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        call = None
    if isinstance(call, ast.Call) and (call.args or len(call.keywords) != 1):
        return argument  # FINAL(answer="a", note="b"): several arguments, kept as written
    m = re.match(rf"(?:{'|'.join(keywords)})[ \t]*=(?!=)[ \t]*(?P<rest>\S.*)\Z", argument.strip(), re.DOTALL)
    return _unquote(m.group("rest").strip()) if m is not None else argument


def _following_text(prose: list[str], start: int, fences: Sequence[FenceLike]) -> str:
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
    """The text inside FINAL( ... ): up to the parenthesis that closes it, else the rest of the reply."""
    end = argument_end(text, start)
    if end is not None:
        return _unquote(_unemphasized(text[start:end].strip()))
    body = text[start:].strip()
    return _unquote(_unemphasized(body[:-1].strip() if body.endswith(")") else body))


def _unemphasized(text: str) -> str:
    """FINAL(**42**) or FINAL(`42`): the answer without the markdown wrapped around all of it."""
    for mark in ("**", "__", "`"):
        inner = text[len(mark) : -len(mark)]
        if len(text) > 2 * len(mark) and text.startswith(mark) and text.endswith(mark) and mark not in inner:
            return inner.strip()
    return text


def argument_end(text: str, start: int, window: int | None = None) -> int | None:
    """The index of the ')' that closes FINAL( when its argument starts at `start`, or None.

    A string literal or a JSON/Python value is read whole, so parentheses inside it ("Option a) is
    right", {"x": ")"}) do not count. Otherwise parentheses are counted, and a close that leaves an
    unmatched ')' at the end of a later line of the same paragraph ("Done :) all good)", a list of
    "a) ... b) ...") was not the end: that last ')' is. `window` bounds how far to look."""
    stop = len(text) if window is None else min(len(text), start + window)
    text = text[:stop]
    lead = start
    while lead < len(text) and text[lead] in " \t\n":
        lead += 1
    literal = _literal_end(text, lead)
    if literal is not None:
        after = literal
        while after < len(text) and text[after] in " \t\n":
            after += 1
        if after < len(text) and text[after] == ")":
            return after
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return _unmatched_close_after(text, i)
    return None


def _unmatched_close_after(text: str, close: int) -> int:
    paragraph_end = text.find("\n\n", close)
    stop = len(text) if paragraph_end < 0 else paragraph_end
    depth, last = 0, None
    for i in range(close + 1, stop):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth < 0:
                last, depth = i, 0
    if last is not None:
        line_end = text.find("\n", last)
        tail = text[last + 1 : stop if line_end < 0 else min(line_end, stop)]
        if not tail.strip(" \t.,;:!?*_`"):
            return last
    return close


def _literal_end(text: str, i: int) -> int | None:
    """The end of a string literal or bracketed value starting at `i`, or None."""
    prefix = i
    while prefix < len(text) and prefix - i < 2 and text[prefix] in "rRbBuUfF":
        prefix += 1
    if prefix < len(text) and text[prefix] in "'\"":
        return _string_end(text, prefix)
    if i >= len(text) or text[i] not in "[{":
        return None
    closing = {"[": "]", "{": "}", "(": ")"}
    stack: list[str] = []
    j = i
    while j < len(text):
        ch = text[j]
        if ch in "'\"":
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if ch in closing:
            stack.append(closing[ch])
        elif ch in ")]}":
            if not stack or stack.pop() != ch:
                return None
            if not stack:
                return j + 1
        j += 1
    return None


def _string_end(text: str, i: int) -> int | None:
    quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else text[i]
    j = i + len(quote)
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text.startswith(quote, j):
            return j + len(quote)
        if len(quote) == 1 and text[j] == "\n":
            return None
        j += 1
    return None


def _unquote(text: str) -> str:
    if text[:1] in ("'", '"'):
        # A Python string literal ("He said \\"hi\\"", '\\n'-escaped lines) means what Python reads.
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = None
        if isinstance(value, str):
            return value
        if isinstance(value, tuple) and value and all(isinstance(v, (str, int, float)) for v in value):
            return joined_text(value)  # FINAL("Paris", "France"): several values, as text
        if _is_tuple(text) or text[-1:] != text[:1]:
            return text  # FINAL("Total:", total): Python over REPL names, evaluated as written
    for quote in ('"""', "'''", '"', "'"):
        if len(text) >= 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            return text[len(quote) : -len(quote)]
    # Typographic quotes, which editors and some tokenizers put in: “Paris”, ‘Paris’, «Paris», „Paris“.
    for left, right in (
        ("\u201c", "\u201d"),
        ("\u2018", "\u2019"),
        ("\u00ab", "\u00bb"),
        ("\u201e", "\u201c"),
    ):
        inner = text[1:-1]
        if (
            len(text) >= 2
            and text[0] == left
            and text[-1] == right
            and left not in inner
            and right not in inner
        ):
            return inner
    return text


def joined_text(values: tuple[str | int | float, ...]) -> str:
    """Several values written as one answer, as text: joined with ", ", or a space after a label
    ("Total:", 42 reads "Total: 42")."""
    out = str(values[0])
    for value in values[1:]:
        out += (" " if out.endswith(":") else ", ") + str(value)
    return out


def _is_tuple(text: str) -> bool:
    try:
        return isinstance(ast.parse(text, mode="eval").body, ast.Tuple)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def assigned_in(prose: list[str], name: str) -> bool:
    """Whether a prose line assigns `name` the way code does (`name = ...`, `name += ...`)."""
    binding = re.compile(rf"^[ \t]*{re.escape(name)}[ \t]*(?::[^=\n]*)?(?:[-+*/%|&]|//)?=(?!=)")
    return any(binding.match(line) for line in prose)


def is_identifier(name: str) -> bool:
    return _IDENTIFIER.fullmatch(name) is not None
