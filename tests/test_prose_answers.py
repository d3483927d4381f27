"""Answers written as prose inside code cells, and the other spellings of FINAL, in the REPL itself
(recursa/sandbox/worker/prose.py and repl.py). The corpus (tests/replies/markers.json) runs the same
classes end to end; these pin the edges of each rule."""

from __future__ import annotations

from typing import Any

import pytest

from recursa.sandbox.worker.prose import mend
from recursa.sandbox.worker.repl import Repl


@pytest.fixture
def repl() -> Repl:
    return Repl(lambda fn, args: None, own_print=True)


def run(repl: Repl, code: str) -> dict[str, Any]:
    return repl.execute(code, 4_000)


def answer(out: dict[str, Any]) -> str | None:
    return out["final"]["text"] if out["final"] else None


def always(name: str) -> bool:
    return True


@pytest.mark.parametrize(
    "code",
    [
        "FINAL('The answer is 42')",
        "x = 1\nFINAL(x)",
        "FINAL(f'{1 + 1} items')",
        "text = '''\nFINAL(The answer is 42)\n'''",
    ],
)
def test_valid_python_is_never_rewritten(code):
    assert mend(code, always) == (code, [])


def test_prose_in_a_final_line_becomes_text_and_the_rest_of_the_cell_runs(repl):
    out = run(repl, "n = 2\nFINAL(The answer is two)\nprint('after', n)")
    assert answer(out) == "The answer is two"
    assert out["error"] is None
    assert out["stdout"] == "after 2\n"
    assert any("not Python" in note for note in out["notes"])


def test_a_rewritten_final_keeps_the_cells_line_numbers(repl):
    out = run(repl, "FINAL(Two things:\n- one\n- two)\nraise ValueError('late')")
    assert answer(out) == "Two things:\n- one\n- two"
    assert "line 4" in out["error"]


def test_prose_final_after_a_failing_line_is_not_reached(repl):
    out = run(repl, "int('x')\nFINAL(The answer is 42)")
    assert out["final"] is None
    assert "ValueError" in out["error"]


def test_a_syntax_error_elsewhere_is_reported_as_written(repl):
    out = run(repl, "def f(:\n    pass\nFINAL(The answer is 42)")
    assert out["final"] is None
    assert "SyntaxError" in out["error"]
    assert "FINAL('The answer" not in out["error"]


def test_trailing_punctuation_after_final_is_dropped_and_the_argument_stays_code(repl):
    out = run(repl, "n = 6 * 7\nFINAL(n).")
    assert answer(out) == "42"
    assert out["final"]["value"] == 42


def test_final_var_of_prose_names_nothing_and_says_so(repl):
    out = run(repl, "FINAL_VAR(the answer)")
    assert out["final"] is None
    assert "no variable named 'the answer'" in out["error"]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("FINAL(x is one)", "x is one"),
        ("hits = []\nFINAL(not found)", "not found"),
        ("final(yes or no)", "yes or no"),
        ("if []:\n    FINAL(1)\nelse:\n    FINAL(it is not known)", "it is not known"),
    ],
)
def test_words_that_fail_on_a_name_are_text_when_nothing_follows(repl, code, expected):
    out = run(repl, code)
    assert answer(out) == expected
    assert out["error"] is None
    assert any("taken as the text" in note for note in out["notes"])


@pytest.mark.parametrize(
    "code",
    [
        "result = 1\nFINAL(reslt)",  # a misspelt variable: the answer must not be the word
        "total = 10\nFINAL(total / count)",  # arithmetic is code
        "FINAL(x is one)\nprint('more')",  # something after it would have been skipped
        "for i in range(2):\n    FINAL(not found)",  # a loop would have gone on
    ],
)
def test_a_name_error_in_final_stays_an_error_with_a_hint(repl, code):
    out = run(repl, code)
    assert out["final"] is None
    assert "NameError" in out["error"]
    assert any("if you meant text, quote it" in note for note in out["notes"])


def test_a_name_error_inside_a_function_is_the_functions(repl):
    out = run(repl, "def f():\n    FINAL(not found)\nf()")
    assert out["final"] is None
    assert "NameError" in out["error"]
    assert out["notes"] == []


def test_lower_case_spellings_answer(repl):
    assert answer(run(repl, "final(6 * 7)")) == "42"
    assert answer(run(repl, "Final('x')")) == "x"
    assert answer(run(repl, "final_answer(7)")) == "7"
    run(repl, "word = 'abc'")
    assert answer(run(repl, "final_var('word')")) == "abc"
    assert answer(run(repl, "Final_Var('word')")) == "abc"


def test_users_own_final_is_kept_and_not_an_answer(repl):
    out = run(repl, "final = [1, 2]\nprint(final)")
    assert out["final"] is None and out["restored_names"] == []
    assert run(repl, "final")["stdout"] == "[1, 2]\n"
    assert "final" in repl.user_variables()
    # Prose in a call to the user's own `final` is not rewritten into an answer either.
    out = run(repl, "final(The answer is 42)")
    assert out["final"] is None and "SyntaxError" in out["error"]


@pytest.mark.parametrize(
    "code",
    [
        "def final(x):\n    return x\nfinal(The answer is 42)",
        "final = print\nfinal(The answer is 42)",
        "from typing import final\nfinal(The answer is 42)",
    ],
)
def test_a_cell_that_binds_final_itself_is_not_rewritten(repl, code):
    out = run(repl, code)
    assert out["final"] is None and "SyntaxError" in out["error"]


def test_aliases_are_not_listed_and_come_back_once_freed(repl):
    assert repl.user_variables() == []
    assert "final" not in run(repl, "x = 1\nSHOW_VARS()")["stdout"]
    run(repl, "final = 3")
    run(repl, "del final")
    assert answer(run(repl, "final(5)")) == "5"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("x = 3\n**FINAL(x)**", "3"),
        ("`FINAL(The answer is 42)`", "The answer is 42"),
        ("FINAL: The answer is 42", "The answer is 42"),
        ("FINAL 345", "345"),
        ("FINAL: 42", "42"),  # valid Python (an annotation that does nothing) until read as the call
        ("y = [1, 2]\nFINAL: y", "[1, 2]"),
        ("res = 'abc'\nFINAL_VAR: res", "abc"),
        ("if True:\n    FINAL: indented text here", "indented text here"),
    ],
)
def test_answers_written_without_python_call_syntax_in_code(repl, code, expected):
    out = run(repl, code)
    assert answer(out) == expected, out
    assert out["error"] is None
    assert out["notes"]  # the model is told how to write it


def test_a_users_lower_case_annotation_is_left_alone(repl):
    out = run(repl, "final: int = 3\nscore: float\nprint(final)")
    assert out["final"] is None and out["error"] is None and out["stdout"] == "3\n"


def test_final_var_of_an_undefined_name_says_to_assign_it_first(repl):
    out = run(repl, "FINAL_VAR(missing)")
    assert out["final"] is None and "NameError" in out["error"]
    assert any('then FINAL_VAR("missing")' in note for note in out["notes"])


@pytest.mark.parametrize(
    "code",
    [
        "x = 1\nFINAL(x)\nz = max(x y)",  # the error is in the line after a complete FINAL(...)
        "x = 1\nFINAL(x)\nz = (\n",
    ],
)
def test_code_after_a_complete_final_is_never_read_into_the_answer(repl, code):
    out = run(repl, code)
    assert out["final"] is None and "SyntaxError" in out["error"]


@pytest.mark.parametrize(
    "code",
    ['total = 3\nFINAL(f"Total: {total")', "FINAL(\"It's done)", "FINAL([1, 2)", "FINAL({'a': 1)"],
)
def test_broken_literals_in_final_stay_syntax_errors(repl, code):
    out = run(repl, code)
    assert out["final"] is None and "SyntaxError" in out["error"]
