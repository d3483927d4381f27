"""Answers written as prose inside code: `FINAL(The answer is 42)` is not Python, and
`FINAL(not found)` is Python that fails on a name nobody defined. Models mean text by both.

Two rules, each applied only where the code cannot be a working program as written:
- `mend`: a cell that does not compile because of a FINAL(...) line (any of the answer names, at
  any indentation, with or without markdown around it, its argument up to the line whose `)` closes
  it) gets that line rewritten: markdown and a trailing `.` or `;` are dropped, and an argument that
  is not a Python expression becomes a string literal of its text (unless it starts like a literal:
  a broken string, f-string, list or dict is code to fix). `FINAL: text` and `FINAL 345`
  (upper case) become calls the same way, and so does `FINAL: 42`, which Python reads as an
  annotation (`answer_annotations`). The rest of the cell is left as written and runs as usual, so
  the answer counts only if the code before it runs. Line numbers stay those of the cell.
- `prose_answer`: a FINAL(...) whose argument is a few bare words joined by `is`, `not`, `in`,
  `and`, `or` (`x is one`, `not found`) and fails with a NameError is that text, when the FINAL is
  the cell's last statement (nothing after it was skipped). A single name (`FINAL(reslt)`) or
  arithmetic (`FINAL(total / count)`) stays an error: a misspelt variable must not become the answer.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ast
    from collections.abc import Callable
    from types import CodeType, TracebackType

# Spellings of the answer functions a cell may use (the lower-case ones are provided only while the
# cell's own code has not bound the name to something else).
FINAL_NAMES = frozenset({"FINAL", "FINAL_ANSWER", "final", "Final", "final_answer", "Final_Answer"})
FINAL_VAR_NAMES = frozenset({"FINAL_VAR", "final_var", "Final_var", "Final_Var"})
# Written without parentheses (`FINAL: 42`, `FINAL 345`): only the upper-case names, since `final: int`
# is an ordinary annotation of a variable.
_LOOSE_NAMES = frozenset({"FINAL", "FINAL_ANSWER", "FINAL_VAR"})

# Plain patterns, compiled on first use (re caches them): these rules run only after an error, and
# the worker's start-up imports nothing it does not need (ast is imported by the first cell anyway).
# A call line, also with markdown around it (`**FINAL(42)**`, `` `FINAL(42)` ``).
_CALL = r"^(?P<indent>[ \t]*)[*_`]*(?P<name>[A-Za-z]+(?:_[A-Za-z]+)*)[*_`]*[ \t]*\((?P<rest>.*)$"
_CLOSE = r"\)[*_` \t.;]*$"
_LOOSE = (
    r"^(?P<indent>[ \t]*)[*_`]*(?P<name>FINAL(?:_ANSWER|_VAR)?)[*_`]*(?:[ \t]*:[ \t]*|[ \t]+)(?P<rest>\S.*)$"
)
_TRAILING = "*_` \t.;"  # markdown and punctuation after an answer written without parentheses
# An argument that starts like a Python literal ("..., f"..., [..., {...) is code, even when broken.
_CODE_START = r"""^(?:[rRbBuUfF]{0,2}["']|[\[{(])"""
_LOOK_BACK = 50  # lines above an error searched for the FINAL( that starts it
_LOOK_AHEAD = 200  # lines a FINAL(...) argument may span
_MAX_MENDS = 20


def mend(code: str, is_answer_call: Callable[[str], bool]) -> tuple[str, list[str]]:
    """`code` with the FINAL(...) lines Python rejects rewritten (see the module's docstring), and
    a note for each; `code` unchanged and no notes when that does not make the cell compile."""
    lines = code.split("\n")
    notes: list[str] = []
    for _ in range(_MAX_MENDS):
        error = _syntax_error("\n".join(lines))
        if error is None:
            return ("\n".join(lines), notes) if notes else (code, [])
        fixed = _mend_at(lines, error, is_answer_call)
        if fixed is None:
            return code, []
        lines, note = fixed
        notes.append(note)
    return code, []


def _syntax_error(code: str) -> int | None:
    """The line (0-based) of the first syntax error in `code`, or None when it compiles."""
    import ast

    try:
        compile(code, "<repl>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        return max((exc.lineno or 1) - 1, 0)
    except (ValueError, MemoryError, RecursionError):
        return -1
    return None


def _mend_at(
    lines: list[str], error: int, is_answer_call: Callable[[str], bool]
) -> tuple[list[str], str] | None:
    if error < 0 or error >= len(lines):
        return None
    loose = _mend_loose(lines, error, is_answer_call)
    if loose is not None:
        return loose
    for start in range(error, max(error - _LOOK_BACK, -1), -1):
        m = re.match(_CALL, lines[start])
        if m is None or not _is_answer_name(m.group("name")) or not is_answer_call(m.group("name")):
            continue
        if _binds(lines, m.group("name")):
            return None  # the cell defines its own `final`: the call is the user's, not an answer
        end = _argument_end(lines, start, error)
        if end is None:
            return None
        name, indent = m.group("name"), m.group("indent")
        first = m.group("rest")
        body = [first, *lines[start + 1 : end + 1]] if end > start else [first]
        close = re.search(_CLOSE, body[-1])
        assert close is not None
        body[-1] = body[-1][: close.start()]
        argument = "\n".join(body)
        written = f"{name}({argument})"
        if _is_expression(argument):
            call = written
            note = f"{_shown(written)} had markdown or punctuation around it that Python cannot read; it ran without."
        else:
            text = argument.strip()
            if re.match(_CODE_START, text):
                return None  # a broken string, f-string or list is code to fix, not text to hand back
            call = f"{name}({text!r})"
            what = "a variable name" if name in FINAL_VAR_NAMES else "text"
            note = (
                f"{_shown(written)} is not Python, so its argument was taken as {what}: {_shown(text)!r}. "
                f'In code, quote it: {name}("...").'
            )
        mended = [*lines[:start], indent + call, *([""] * (end - start)), *lines[end + 1 :]]
        after = _syntax_error("\n".join(mended))
        if after is not None and start <= after <= end:
            return None  # the rewrite did not help: the error is not the answer's
        return mended, note
    return None


def _mend_loose(
    lines: list[str], error: int, is_answer_call: Callable[[str], bool]
) -> tuple[list[str], str] | None:
    """`FINAL: The answer is 42` or `FINAL 345` on the failing line: the call it means."""
    m = re.match(_LOOSE, lines[error])
    if m is None or "(" in lines[error][: m.start("rest")] or not is_answer_call(m.group("name")):
        return None
    name, rest = m.group("name"), m.group("rest").rstrip(_TRAILING)
    if not rest:
        return None
    if name == "FINAL_VAR" or not _is_expression(rest):
        call = f"{name}({rest!r})"
    else:
        call = f"{name}({rest})"
    mended = [*lines[:error], m.group("indent") + call, *lines[error + 1 :]]
    if _syntax_error("\n".join(mended)) == error:
        return None
    note = f"{_shown(lines[error].strip())} is not Python; it was run as {_shown(call)}. Write {name}(...)."
    return mended, note


def answer_annotations(tree: ast.Module, is_answer_call: Callable[[str], bool]) -> list[str]:
    """`FINAL: 42` or `FINAL_VAR: result` alone on a line is valid Python, an annotation that does
    nothing: each such top-level statement of `tree` becomes the call it means. Notes for the model."""
    import ast

    notes: list[str] = []
    for index, stmt in enumerate(tree.body):
        if not (
            type(stmt) is ast.AnnAssign
            and stmt.value is None
            and isinstance(stmt.target, ast.Name)
            and stmt.target.id in _LOOSE_NAMES
            and is_answer_call(stmt.target.id)
        ):
            continue
        name, argument = stmt.target.id, stmt.annotation
        if name == "FINAL_VAR" and isinstance(argument, ast.Name):
            argument = ast.Constant(argument.id)
        call = ast.Expr(ast.Call(ast.Name(name, ast.Load()), [argument], []))
        tree.body[index] = ast.fix_missing_locations(ast.copy_location(call, stmt))
        notes.append(
            f"`{name}: ...` is an annotation to Python, which does nothing; it was run as {name}(...). "
            f"Write {name}(...) with parentheses."
        )
    return notes


def _argument_end(lines: list[str], start: int, error: int) -> int | None:
    """The line whose `)` closes FINAL( opened on `lines[start]`: the first at or after the error
    where the parentheses balance, else the first there that ends with `)`. None when the call was
    closed before the error's line: the error is then in later code, which must not be read as part
    of the answer."""
    depth = 0
    first_close = None
    m = re.match(_CALL, lines[start])
    assert m is not None
    for index in range(start, min(len(lines), start + _LOOK_AHEAD)):
        segment = m.group("rest") if index == start else lines[index]
        depth += segment.count("(") - segment.count(")")
        if index < error:
            if depth < 0:
                return None
            continue
        if re.search(_CLOSE, segment) is None:
            continue
        if depth == -1:
            return index
        if first_close is None:
            first_close = index
    return first_close


def _binds(lines: list[str], name: str) -> bool:
    binding = re.compile(
        rf"^[ \t]*(?:(?:async[ \t]+)?def[ \t]+{name}\b|class[ \t]+{name}\b|{name}[ \t]*(?::[^=]*)?=(?!=)"
        rf"|(?:from[ \t].*)?import[ \t].*\b{name}\b)"
    )
    return any(binding.match(line) for line in lines)


def _is_expression(text: str) -> bool:
    import ast

    try:
        compile(text.strip() or "()", "<final>", "eval", ast.PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return bool(text.strip())


def _is_answer_name(name: str) -> bool:
    return name in FINAL_NAMES or name in FINAL_VAR_NAMES


def _shown(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# -- a FINAL of words that failed on a name ---------------------------------------------------


def prose_answer(
    exc: NameError,
    tree: ast.Module,
    code: str,
    cell_codes: tuple[CodeType, ...],
    is_answer_call: Callable[[str], bool],
) -> tuple[str, str] | None:
    """The text answer and a note, when `exc` came from a FINAL(words) that is the cell's last
    statement (see the module's docstring); else None."""
    import ast

    lineno = _failing_line(exc.__traceback__, cell_codes)
    if lineno is None:
        return None
    stmt = _last_statement_at(tree.body, lineno)
    if stmt is None:
        return None
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in FINAL_NAMES
        and is_answer_call(call.func.id)
        and len(call.args) == 1
        and not call.keywords
    ):
        return None
    argument = call.args[0]
    if not _is_prose(argument):
        return None
    text = ast.get_source_segment(code, argument)
    if not text:
        return None
    name = getattr(exc, "name", None) or "a name"
    note = (
        f"{call.func.id}({_shown(text)}) ran as Python and failed (name {name!r} is not defined), so "
        f"it was taken as the text {_shown(text)!r}. In code, quote a text answer: "
        f'{call.func.id}("...").'
    )
    return text, note


def final_hint(exc: NameError, tree: ast.Module, cell_codes: tuple[CodeType, ...]) -> str | None:
    """For a NameError raised by a FINAL(...) argument: the two things the model may have meant."""
    import ast

    lineno = _failing_line(exc.__traceback__, cell_codes)
    name = getattr(exc, "name", None)
    if lineno is None or not isinstance(name, str) or _is_answer_name(name):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and _is_answer_name(node.func.id)
            and node.lineno <= lineno <= (node.end_lineno or node.lineno)
        ):
            if node.func.id in FINAL_VAR_NAMES:
                return (
                    f"{node.func.id}(...) failed: {name!r} is not defined. Assign the answer to a variable "
                    f'in a cell first, then {node.func.id}("{name}"); SHOW_VARS() lists the variables.'
                )
            return (
                f"{node.func.id}(...) failed: {name!r} is not defined. If it is a variable, check its name "
                f'(SHOW_VARS() lists them); if you meant text, quote it: {node.func.id}("...").'
            )
    return None


def _failing_line(tb: TracebackType | None, cell_codes: tuple[CodeType, ...]) -> int | None:
    """The cell line that raised, when the error was raised by the cell's own top-level code (not
    inside a function it called)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<repl>":
            line = tb.tb_lineno if tb.tb_frame.f_code in cell_codes else None
        tb = tb.tb_next
    return line


def _last_statement_at(body: list[ast.stmt], lineno: int) -> ast.stmt | None:
    """The innermost statement holding `lineno`, if it and every statement around it is the last of
    its block and none of them is a loop or a definition (so nothing after it was skipped)."""
    import ast

    if not body:
        return None
    stmt = body[-1]
    if not (stmt.lineno <= lineno <= (stmt.end_lineno or stmt.lineno)):
        return None
    blocks: list[list[ast.stmt]] = []
    if isinstance(stmt, ast.If):
        blocks = [stmt.body, stmt.orelse]
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        blocks = [stmt.body]
    elif isinstance(stmt, ast.Try):
        blocks = [stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)]
    elif isinstance(stmt, ast.Expr):
        return stmt
    else:
        return None
    for block in blocks:
        found = _last_statement_at(block, lineno)
        if found is not None:
            return found
    return None


def _is_prose(node: ast.AST) -> bool:
    """Bare words joined by is / not / in / and / or: at least two of them, nothing else."""
    import ast

    nodes = (ast.Name, ast.Load, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Not, ast.And, ast.Or)
    operators = (ast.Is, ast.IsNot, ast.In, ast.NotIn)
    words = 0
    for child in ast.walk(node):
        if isinstance(child, ast.cmpop):
            if not isinstance(child, operators):
                return False
            continue
        if not isinstance(child, nodes):
            return False
        if isinstance(child, ast.Constant) and not isinstance(child.value, (int, float)):
            return False
        if isinstance(child, ast.UnaryOp) and not isinstance(child.op, ast.Not):
            return False
        words += isinstance(child, (ast.Name, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp))
    return words >= 2
