"""What an answer in a reply stands for: a prose FINAL naming a variable or computing over the REPL's
variables, a FINAL_VAR's value, answers that hold nothing (None, "") and so are not taken, and when an
answer written beside code cannot be a guess."""

from __future__ import annotations

import ast
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from recursa.loop.finals import ProseFinal, is_identifier, joined_text
from recursa.loop.output import render_turn
from recursa.loop.rules import BesideCode
from recursa.sandbox.base import ExecResult, FinalAnswer, Sandbox


async def resolve_prose_final(
    prose: ProseFinal,
    sandbox: Sandbox,
    evaluate: Callable[[str], Awaitable[ExecResult]],
    read: Callable[[str], Awaitable[FinalAnswer | None]],
    *,
    retry: bool,
    max_output_chars: int,
) -> FinalAnswer | str | None:
    """The answer a prose FINAL / FINAL_VAR stands for; None for a FINAL_VAR naming nothing, or a
    message (when `retry`: turns are left) when FINAL(expression) over REPL variables failed.
    `evaluate` runs an expression, `read` a variable's value as text (its __str__ is model code):
    both under the reply's clock."""
    if prose.protocol == "FINAL":
        # FINAL(result) / "FINAL result" naming a variable the code made means that variable
        # (returning the word "result" was the reference implementation's classic misread).
        if is_identifier(prose.text):
            if prose.unrun and retry:
                # Even if the REPL has an older `name`, the model meant the value its unrun code computes.
                return (
                    f"Your FINAL({prose.text}) names `{prose.text}`, which your reply assigns in code written "
                    f"outside a ```repl block: that code did not run, so `{prose.text}` does not hold what "
                    "it computes. Put the code in a ```repl block (it runs and you see its output), then "
                    "answer in your next reply."
                )
            if prose.text in await sandbox.variable_names():
                found = await read(prose.text)
                if found is not None:
                    found.protocol, found.var_name = "FINAL_VAR", prose.text
                    return found
        elif await _is_expression_over_variables(prose.text, sandbox):
            # FINAL(f"Total: {total}") or FINAL(len(rows)): the model meant the value, so it is
            # computed in the REPL (an exec in the trace) rather than returned as source text.
            several = not retry and _several_arguments(prose.text)
            if several:
                # FINAL(total, count) in the last call: no turn is left to be told FINAL takes one
                # value, so the answer is what prose FINAL means, text: the values, as text, joined.
                res = await evaluate(f"FINAL([str(_v) for _v in ({prose.text},)])")
            else:
                res = await evaluate(f"FINAL({prose.text})")
            if several and res.final is not None and isinstance(res.final.value, list):
                text = joined_text(tuple(str(v) for v in res.final.value))
                return FinalAnswer(text=text, value=text, protocol="FINAL")
            if res.final is not None:
                res.final.protocol = "FINAL"
                return res.final
            if retry:
                return (
                    f"Your FINAL({prose.text}) is Python over your REPL variables, so it was evaluated, "
                    f"and it failed:\n{render_turn([res], max_output_chars)}\nFix it in a ```repl block, "
                    "or write FINAL(literal text)."
                )
        return FinalAnswer(text=prose.text, value=prose.text, protocol="FINAL")
    if not is_identifier(prose.text):
        return None
    final = await read(prose.text)
    if final is not None:
        final.protocol, final.var_name = "FINAL_VAR", prose.text
    return final


async def _is_expression_over_variables(text: str, sandbox: Sandbox) -> bool:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    nodes = list(ast.walk(tree))
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    if not names:  # a literal (42, "text", [1, 2]) is the answer as written; an f-string is computed
        return any(isinstance(n, ast.JoinedStr) for n in nodes)
    return bool(names & {*await sandbox.variable_names(), "context"})


def _several_arguments(text: str) -> bool:
    """FINAL(a, b): written as two arguments (not one parenthesized tuple)."""
    try:
        call = ast.parse(f"FINAL({text})", mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return isinstance(call, ast.Call) and len(call.args) > 1 and not call.keywords


def empty_answer(final: FinalAnswer) -> str | None:
    """Why an answer that holds nothing is not taken (None, "", or answer["ready"] alone)."""
    if final.value is not None and final.text.strip():
        return None
    if final.protocol == "answer":
        where = 'answer["ready"] was set while answer["content"] is'
    elif final.var_name:
        where = f"FINAL_VAR({final.var_name}): `{final.var_name}` is"
    else:
        where = "the value given to FINAL was"
    if final.value is None:
        return (
            f"{where} None, so it was not taken as the answer (None usually comes from a function that "
            "returns nothing, such as list.sort() or print()). Put the real answer in it first; if None "
            "really is the answer, write FINAL(None) on a line of its own."
        )
    return f"{where} empty, so it was not taken as the answer. Put the real answer in it first."


async def missing_variable_message(sandbox: Sandbox, name: str) -> str:
    if not is_identifier(name):
        return (
            f"FINAL_VAR({name}) is not an answer: FINAL_VAR takes the name of a variable, not an "
            f"expression. Assign the value to a variable in a ```repl block first (answer_text = "
            f"{name}), then write FINAL_VAR(answer_text) in your next reply."
        )
    names = await sandbox.variable_names()
    if name in names:  # it exists, but the REPL could not read it as text
        return (
            f"FINAL_VAR({name}): `{name}` exists, but its value could not be turned into text (its __str__ "
            "and __repr__ raise, or ran past the reply's time for code). Build the answer as text from it "
            "in a ```repl block first."
        )
    listed = ", ".join(names[:30]) if names else "none yet"
    return (
        f"FINAL_VAR({name}) names no variable in the REPL (defined: {listed}). Assign the answer "
        f"to a variable in a ```repl block first, or write FINAL(your answer) for literal text."
    )


@dataclass
class CodeRun:
    """The code of one reply and what its blocks did."""

    blocks: list[str]
    results: list[ExecResult]
    all_ran: bool  # no block was left unrun

    @property
    def clean(self) -> bool:
        return self.all_ran and all(r.error is None and not r.timed_out for r in self.results)

    @property
    def output(self) -> str:
        return "\n".join(r.stdout for r in self.results)


async def answer_beside_code(
    written: ProseFinal,
    ran: CodeRun,
    taken: BesideCode,
    sandbox: Sandbox,
    resolve: Callable[[ProseFinal], Awaitable[FinalAnswer | str | None]],
) -> FinalAnswer | None:
    """The answer written beside the reply's code, once that code has run, when it is taken now.

    The model wrote it before seeing the output, so as a rule it waits for the next reply. Under
    "confirmed" it is taken when it cannot be a guess: it names a variable (FINAL_VAR(name), or
    FINAL(name)) that the reply's code bound and which ran cleanly, or it is literal text that the
    code's own output shows. "always" takes it once the code has run; "never" never."""
    if taken == "never":
        return None
    if taken == "confirmed":
        if not ran.clean:
            return None
        if is_identifier(written.text):
            if written.text not in assigned_names(ran.blocks):
                return None
        elif written.protocol != "FINAL" or await _is_expression_over_variables(written.text, sandbox):
            return None
        elif not shown_in(written.text, ran.output):
            return None
    final = await resolve(written)
    if not isinstance(final, FinalAnswer) or empty_answer(final) is not None:
        return None
    return final


def shown_in(value: str, output: str) -> bool:
    """Whether `output` shows `value` whole (not inside a longer word or number); spacing aside."""
    wanted = " ".join(value.split())
    if not wanted:
        return False
    pattern = r"(?<![\w.])" + re.escape(wanted).replace(r"\ ", r"\s+") + r"(?![\w])"
    return re.search(pattern, output) is not None


def assigned_names(codes: Iterable[str]) -> set[str]:
    """Names that code assigns (targets, defs, imports, loop and with variables)."""
    names: set[str] = set()
    for code in codes:
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):
            # Broken code may still have run up to the error; catch plain `name = ...` lines.
            names.update(re.findall(r"^[ \t]*([A-Za-z_]\w*)[ \t]*(?:[-+*/%|&]?=)(?!=)", code, re.MULTILINE))
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)
    return names


