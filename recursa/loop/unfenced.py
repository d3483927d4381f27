"""Python written without a code fence: the runs of lines in a reply that are a program, not prose.

Small and mid-size models often reply with bare code, or a sentence and then code, and no ``` fence.
Such a run is looked for only in a reply with no runnable block, and it counts only when it is
plainly code, so prose is never run:
- it compiles as Python, from the first line of the run to its last (prose around it is left out:
  a run ends where Python stops reading it);
- its syntax tree does something only code does: an import, a loop, a `with`, a `try`, a definition,
  an `if`, a comprehension, a lambda, a call of a builtin, of a REPL name (`print`, `llm_query`,
  ...), of a name the run binds or of a method on one of those (or on a standard-library module or
  a literal), or an index or attribute of a REPL name or a name the run binds (`context[:500]`).
  A lone name ("Paris"), words joined by `is`/`not` ("not found"), a label ("Output: 42", an
  annotation to Python), arithmetic (`x = 5`, `b = a + 2` in a math derivation) or a call of an
  unknown name ("Paris (France)") are not;
- lines that are only such words at either end of a run (a trailing "Done") are left out of it;
- a FINAL(...) line does not make a run code: a lone answer line stays an answer written in prose;
- a line written whole as inline code (`x = 1` in backticks) is read as that code, and when nothing
  is found as written, indented stretches (a markdown code block, code under a list item) are read
  again moved to the left;
- a run followed by a line that reads like code but does not compile (a typo) ends the search: the
  caller tells the model which line stopped Python, rather than running what comes after it.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
import textwrap
from dataclasses import dataclass

from recursa.tools.spec import RESERVED_NAMES

# What the REPL defines: the names it restores after every cell (recursa.tools.spec.RESERVED_NAMES) and
# the other spellings of FINAL / FINAL_VAR it accepts (recursa/sandbox/worker/repl.py).
REPL_NAMES = RESERVED_NAMES | {"FINAL_ANSWER", "final", "Final", "final_answer", "Final_Answer"}
REPL_NAMES |= {"final_var", "Final_var", "Final_Var"}
_ANSWER_NAMES = REPL_NAMES & {n for n in REPL_NAMES if n.lower().startswith("final")}
_BUILTINS = frozenset(dir(builtins))
_STDLIB = frozenset(sys.stdlib_module_names)
_CODE_ONLY = (
    ast.Import,
    ast.ImportFrom,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.If,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.Lambda,
    *([ast.TryStar] if sys.version_info >= (3, 11) else []),
)
_DECORATOR = re.compile(r"@[A-Za-z_][\w.]*(?:\(.*\))?[ \t]*$")
# Bounds: a reply of thousands of lines (a model stuck in a loop) is not searched line by line.
_MAX_LINES = 2_000
_MAX_CHARS = 100_000
_COMPILE_BUDGET = 1_000_000  # characters handed to the compiler over all tries, for one reply
_SHRINKS = 12


# A line that reads like a statement (`x = ...`, `print(...)`, `for x in y:`): where one right after a
# run is what stopped Python, the run was cut short by a mistake in the code, not by prose.
_LOOKS_LIKE_CODE = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:\[[^\]]*\])?[ \t]*(?:[-+*/%|&]|//)?=(?!=)|[A-Za-z_][\w.]*\("
    r"|(?:for|while|if|elif|with|def|class|try|except)\b.*:[ \t]*$|(?:import|from)[ \t]+[\w.]+[ \t]*(?:import\b.*)?$)"
)
_TICKED = re.compile(r"^`([^`]+)`[ \t]*$")  # a whole line written as inline code: `x = len(context)`


@dataclass(frozen=True)
class Unfenced:
    code: str
    start: int  # index of its first line among the lines searched
    end: int  # index past its last line
    # The code-like line right after the run that Python could not read, with why: the run stops
    # there, and the model must hear that the rest did not run.
    broken: str | None = None


def find_unfenced(lines: list[str], barriers: set[int] | frozenset[int] = frozenset()) -> list[Unfenced]:
    """The runs of plainly-code lines in `lines`, in order; a run never spans a line in `barriers`
    (where a fenced block of another language stood)."""
    if len(lines) > _MAX_LINES or sum(map(len, lines)) > _MAX_CHARS:
        return []
    budget = [_COMPILE_BUDGET]
    lines = [_TICKED.sub(r"\1", line) for line in lines]
    found = _runs(lines, barriers, budget)
    if found:
        return found
    # Code indented as a markdown code block, or under a list item ("1. Split it:" then "   x = ..."):
    # read again with each stretch of indented lines moved to the left. Only when nothing was found
    # as written: inside code, an indented line after a blank one is the body of a loop.
    moved = _dedented(lines)
    return _runs(moved, barriers, budget) if moved != lines else []


def _dedented(lines: list[str]) -> list[str]:
    out = list(lines)
    i = 0
    while i < len(lines):
        if not lines[i][:1].isspace() or not lines[i].strip():
            i += 1
            continue
        j = i
        while j < len(lines) and (lines[j][:1].isspace() or not lines[j].strip()):
            j += 1
        out[i:j] = textwrap.dedent("\n".join(lines[i:j])).split("\n")
        i = j
    return out


def _runs(lines: list[str], barriers: set[int] | frozenset[int], budget: list[int]) -> list[Unfenced]:
    runs: list[Unfenced] = []
    segment_start = 0
    for stop in [*sorted(b for b in barriers if 0 <= b < len(lines)), len(lines)]:
        i = floor = segment_start
        while i < stop and budget[0] > 0:
            found, i = _run_from(lines, i, stop, floor, budget) if _may_start(lines[i]) else (None, i + 1)
            if found is not None:
                found = _with_breakage(lines, found, stop)
                runs.append(found)
                floor = found.end
                if found.broken:  # code after a mistake would run without what the mistake defines
                    break
        segment_start = stop + 1
    return runs


def _with_breakage(lines: list[str], run: Unfenced, stop: int) -> Unfenced:
    after = next((k for k in range(run.end, stop) if lines[k].strip()), None)
    if after is None or not _LOOKS_LIKE_CODE.match(lines[after]):
        return run
    try:
        compile(
            "\n".join(lines[run.start : after + 1]), "<reply>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True
        )
    except SyntaxError as exc:
        return Unfenced(run.code, run.start, run.end, f"`{lines[after].strip()[:80]}` ({exc.msg})")
    except (ValueError, MemoryError, RecursionError):
        pass
    return run


def _may_start(line: str) -> bool:
    """A line a run can begin with: not indented, not a comment or a markdown mark, and either
    Python on its own or the opening of a statement that goes on (a `:` header, an open bracket)."""
    if not line.strip() or line[0] in " \t#>*-+|`~!$%&=<\\" or line.lstrip()[:1].isdigit():
        return False
    if _tree(line) is not None or _DECORATOR.match(line):
        return True
    stripped = line.rstrip()
    if stripped.endswith(":"):  # a header only if a body under it makes it Python ("Here it is:" is not)
        return _tree(stripped + "\n    pass") is not None
    opened = sum(stripped.count(c) for c in "([{") > sum(stripped.count(c) for c in ")]}")
    return stripped.endswith(("\\", ",")) or opened or stripped.count('"""') % 2 == 1


def _run_from(
    lines: list[str], start: int, stop: int, floor: int, budget: list[int]
) -> tuple[Unfenced | None, int]:
    """The run that starts at `start`, if any, and the line to look on from."""
    end = _trim_blank(lines, start, stop)
    for _ in range(_SHRINKS):
        source = "\n".join(lines[start:end])
        if end <= start or budget[0] < len(source):
            break
        budget[0] -= len(source)
        try:
            tree = compile(source, "<reply>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as exc:
            bad = (exc.lineno or 1) - 1  # where Python stopped reading: the run ends before it
            if bad <= 0:
                break
            end = _trim_blank(lines, start, start + min(bad, end - start - 1))
            continue
        except (ValueError, MemoryError, RecursionError):
            break
        # Python read lines[start:end]; if that is not code, no part of it is: look on after it.
        return _as_run(lines, start, floor, tree), max(end, start + 1)
    return None, start + 1


def _as_run(lines: list[str], start: int, floor: int, tree: ast.Module) -> Unfenced | None:
    body = tree.body
    bound = _bound_names(tree)
    lo, hi = 0, len(body)
    while lo < hi and _is_words(body[lo], bound) and _alone(body, lo):
        lo += 1
    while hi > lo and _is_words(body[hi - 1], bound) and _alone(body, hi - 1):
        hi -= 1
    body = body[lo:hi]
    if not body:
        return None
    work = [s for s in body if not _is_answer(s) and not (isinstance(s, ast.AnnAssign) and s.value is None)]
    if not _plainly_code(work, bound):
        return None
    first = start + body[0].lineno - 1
    last = start + (body[-1].end_lineno or body[-1].lineno)
    # Decorators and comment lines just above the first statement belong to it.
    decorators = getattr(body[0], "decorator_list", [])
    if decorators:
        first = start + min(d.lineno for d in decorators) - 1
    while first > floor and lines[first - 1].startswith("#"):
        first -= 1
    return Unfenced("\n".join(lines[first:last]).strip("\n"), first, last)


def _alone(body: list[ast.stmt], index: int) -> bool:
    """Whether the statement has its lines to itself (no `a; b` sharing a line with a neighbour)."""
    stmt = body[index]
    before = body[index - 1] if index > 0 else None
    after = body[index + 1] if index + 1 < len(body) else None
    return (before is None or (before.end_lineno or before.lineno) < stmt.lineno) and (
        after is None or after.lineno > (stmt.end_lineno or stmt.lineno)
    )


def _trim_blank(lines: list[str], start: int, end: int) -> int:
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def _tree(source: str) -> ast.Module | None:
    try:
        return compile(source, "<reply>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def _bound_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _is_words(stmt: ast.stmt, bound: set[str]) -> bool:
    """A statement prose can be: a bare expression of constants and names nobody defined, with no
    call, index or attribute ("Done", "not found", "42", "x is one"), or a label and what follows it,
    which Python reads as an annotation ("Output: 42", "Result: FINAL_VAR(x)")."""
    if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
        return True
    if not isinstance(stmt, ast.Expr):
        return False
    for node in ast.walk(stmt.value):
        if isinstance(node, (ast.Call, ast.Subscript, ast.Attribute, ast.JoinedStr)):
            return False
        if isinstance(node, ast.Name) and (node.id in bound or node.id in REPL_NAMES):
            return False
    return True


def _is_answer(stmt: ast.stmt) -> bool:
    """FINAL(...) / FINAL_VAR(...) as a statement of its own, or `FINAL: x`."""
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id in _ANSWER_NAMES and stmt.value is None
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _ANSWER_NAMES


def _plainly_code(body: list[ast.stmt], bound: set[str]) -> bool:
    known = bound | REPL_NAMES | _BUILTINS
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, _CODE_ONLY):
                return True
            if isinstance(node, ast.Call):
                root, through = _root(node.func)
                if isinstance(root, ast.Name) and (root.id in known or (through and root.id in _STDLIB)):
                    return True
                if isinstance(root, ast.Constant) and through:  # "\n".join(parts), "{}".format(x)
                    return True
            elif isinstance(node, (ast.Subscript, ast.Attribute)):
                root, _ = _root(node)
                if isinstance(root, ast.Name) and (root.id in REPL_NAMES or root.id in bound):
                    return True
    return False


def _root(node: ast.expr) -> tuple[ast.expr, bool]:
    """The name (or constant) an expression such as `a.b(c)[0].d` starts from, and whether any
    attribute, index or call was on the way."""
    through = False
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
        through = True
    return node, through
