"""The edges of three reply-reading rules (the corpus in tests/replies/ runs them end to end): Python
written without a fence (loop/unfenced.py), \\boxed{...} answers (loop/finals.py) and FINAL with
several arguments or a keyword, in prose and in the REPL (sandbox/worker/values.py)."""

from __future__ import annotations

import pytest

from recursa import RLM
from recursa.errors import ConfigError
from recursa.loop.finals import boxed
from recursa.loop.parse import read_reply
from recursa.loop.rules import DEFAULT_RULES
from recursa.loop.unfenced import find_unfenced
from recursa.sandbox.worker.repl import Repl


def runs(text: str) -> list[str]:
    return [r.code for r in find_unfenced(text.split("\n"))]


@pytest.mark.parametrize(
    "prose",
    [
        "Paris",
        "context",
        "answer",
        "not found",
        "x is one",
        "x = 5",
        "a = 3\nb = a * 2 + 1",
        "Paris (France)",
        "f(x) = 2x",
        "(1, 2, 3)",
        "'quoted text'",
        "Output: 42",
        "Result: final_var(summary)",
        "FINAL(42)",
        "FINAL(len(context))",
        "FINAL_VAR(result)",
        "# A heading\n\nSome text.",
        "Yes\nNo\nMaybe",
    ],
)
def test_prose_that_python_can_read_never_runs(prose):
    assert runs(prose) == []
    parsed = read_reply(prose)
    assert not parsed.code_outside_fences
    assert parsed.code == []


def test_a_run_ends_where_python_stops_reading_and_stray_words_at_its_ends_are_left_out():
    text = "I'll count them.\nwords = context.split()\nprint(len(words))\nDone\nThat is all."
    assert runs(text) == ["words = context.split()\nprint(len(words))"]


def test_a_run_keeps_a_bare_name_it_bound_as_the_displayed_value():
    assert runs("n = len(context)\nn") == ["n = len(context)\nn"]


def test_decorators_and_comments_above_a_run_belong_to_it():
    text = "Here:\n# the helper\n@staticmethod\ndef f(x):\n    return x\nprint(f(1))"
    assert runs(text) == ["# the helper\n@staticmethod\ndef f(x):\n    return x\nprint(f(1))"]


def test_a_method_on_a_standard_library_module_is_code_but_on_an_unknown_name_is_not():
    assert runs("re.findall('a', 'aa')") == ["re.findall('a', 'aa')"]
    assert runs("Mr.Smith(aged)") == []


def test_runs_separated_by_a_fence_of_another_language_stay_apart():
    parsed = read_reply("print(1)\n```text\nnote\n```\nprint(2)")
    assert parsed.code == ["print(1)", "print(2)"]
    assert parsed.code_outside_fences and parsed.skipped_tags == ["text"]


def test_a_reply_with_a_runnable_block_never_runs_its_bare_lines():
    parsed = read_reply("print(len(context))\n```repl\nprint(2)\n```")
    assert parsed.code == ["print(2)"]
    assert not parsed.code_outside_fences


def test_switched_off_the_code_does_not_run_and_the_model_is_told():
    parsed = read_reply("print(len(context))", DEFAULT_RULES.without("unfenced_code", "bare_fence_code"))
    assert parsed.code == [] and not parsed.code_outside_fences
    assert len(parsed.notes) == 1 and "did not run" in parsed.notes[0]


def test_an_unindented_final_after_code_stays_an_answer_that_waits():
    parsed = read_reply("total = sum(range(4))\nFINAL(total)")
    assert parsed.code == ["total = sum(range(4))"]
    assert parsed.turn_answer is not None and parsed.turn_answer.text == "total"


def test_a_huge_reply_is_not_searched():
    assert runs("print(1)\n" * 3_000) == []


def test_unfenced_code_must_be_a_bool():
    with pytest.raises(ConfigError, match="unfenced_code"):
        RLM("openai/m", api_key="k" * 20, unfenced_code="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{42}", "42"),
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("\\boxed{\\text{Paris}}", "Paris"),
        ("\\boxed{\\text{a} + \\text{b}}", "\\text{a} + \\text{b}"),
        ("\\boxed{ {a}{b} }", "{a}{b}"),
        ("\\boxed{\\}}", "\\}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{1} then \\boxed{2", "1"),
        ("\\fbox{7}", "7"),
        ("\\boxed{", None),
        ("\\boxed{  }", None),
        ("boxed{3}", None),
    ],
)
def test_a_box_is_read_to_its_matching_brace(text, expected):
    assert boxed(text) == expected


@pytest.fixture
def repl() -> Repl:
    return Repl(lambda fn, args: None, own_print=True)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("FINAL(1, 2)", "FINAL takes one value"),
        ("FINAL()", "got no argument"),
        ("FINAL(x=5)", "without a keyword"),
        ("final(1, 2)", "FINAL takes one value"),
        ("FINAL_VAR('a', 'b')", "FINAL_VAR takes the name of one variable"),
        ("FINAL_VAR(nom='a')", "without a keyword"),
    ],
)
def test_final_with_several_arguments_raises_a_message_that_says_how(repl, code, message):
    out = repl.execute(code, 4_000)
    assert out["final"] is None
    assert "TypeError" in out["error"] and message in out["error"]
    assert "values.py" not in out["error"]  # the worker's own frames stay out of the model's traceback


@pytest.mark.parametrize(
    ("code", "text"),
    [
        ("FINAL(answer=42)", "42"),
        ("FINAL(value='x')", "x"),
        ("a = [1]\nFINAL_VAR(name='a')", "[1]"),
        ("b = 2\nFINAL_VAR(var='b')", "2"),
    ],
)
def test_one_value_named_with_a_keyword_is_the_answer(repl, code, text):
    out = repl.execute(code, 4_000)
    assert out["final"] is not None and out["final"]["text"] == text
