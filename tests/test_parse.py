import random

import pytest

from recursa.loop.finals import ProseFinal
from recursa.loop.output import render_turn, truncate_middle
from recursa.loop.parse import _plain, read_by_rules, read_reply
from recursa.loop.rules import DEFAULT_RULES, RULES, ReplyRules, Rule
from recursa.sandbox.base import ExecResult
from recursa.sandbox.worker.capture import Capture


def test_blocks_run_in_order_and_python_fences_count():
    reply = "Plan.\n```repl\na = 1\n```\ntext\n```python\nb = a + 1\n```\n```\nnot run\n```"
    parsed = read_reply(reply)
    assert parsed.code == ["a = 1", "b = a + 1"]
    assert parsed.skipped_tags == [""]
    assert parsed.turn_answer is None


def test_prose_final_with_nested_parentheses_and_quotes():
    parsed = read_reply('I checked it.\nFINAL("The answer is (b): 42")')
    assert parsed.turn_answer.protocol == "FINAL"
    assert parsed.turn_answer.text == "The answer is (b): 42"


def test_prose_final_var_with_and_without_quotes():
    assert read_reply("FINAL_VAR(result)").turn_answer.text == "result"
    assert read_reply("Done.\n  FINAL_VAR('my_list')").turn_answer.text == "my_list"


def test_answers_read_past_the_quick_checks_for_their_marks():
    # find_final returns at once for ASCII text without "final", "<" or a backslash: each form
    # here has one of those, and a dotless i (matched by the patterns' ignored case) is not ASCII.
    assert read_reply("f\u0131nal(42)").turn_answer.text == "42"
    assert read_reply("Result:\n<answer>7</answer>").turn_answer.text == "7"
    assert read_reply("So it is $\\boxed{9}$.").turn_answer.text == "9"
    parsed = read_reply("```repl\n  x = 1\n  print(x)\n```\n```repl\n>>> y = 2\n```")
    assert parsed.code == ["x = 1\nprint(x)", "y = 2"]


def test_final_inside_code_is_not_prose():
    parsed = read_reply("```repl\nFINAL(x)\n```")
    assert parsed.turn_answer is None
    assert parsed.code == ["FINAL(x)"]


def test_final_mid_sentence_is_not_an_answer():
    assert read_reply("Later I will call FINAL(answer) when ready.").turn_answer is None


def test_code_and_prose_final_together_are_both_seen():
    parsed = read_reply("```repl\nprint(1)\n```\nFINAL(1)")
    assert parsed.code and parsed.turn_answer is not None


def test_unclosed_fence_still_runs():
    assert read_reply("```repl\nprint('hi')").code == ["print('hi')"]


def test_truncate_middle_keeps_head_and_tail_and_counts():
    text = "A" * 1000 + "B" * 1000
    out = truncate_middle(text, 200)
    assert out.startswith("A" * 100) and out.endswith("B" * 80)
    assert "1,800 characters omitted" in out
    assert truncate_middle("short", 200) == "short"


def test_output_the_worker_cut_to_the_limit_is_shown_with_one_count():
    # 60,006 characters printed under max_output_chars=1000: the worker keeps 500 + 500 and marks
    # the rest; the host must not cut that again for the marker's length (a second marker whose
    # count overlaps the first).
    capture = Capture(1000)
    capture.out.write("A" * 30_000 + "MIDDLE" + "Z" * 30_000)
    stdout, stderr, omitted = capture.finish()
    shown = render_turn([ExecResult(stdout=stdout, stderr=stderr, omitted_chars=omitted)], 1000)
    assert shown.count("characters omitted") == 1 and "59,006 characters omitted" in shown
    assert shown.startswith("A" * 500 + "\n[") and shown.endswith("]\n" + "Z" * 500)
    # Several blocks that together pass the limit are still cut, and say how much in all.
    two = [ExecResult(stdout=stdout, stderr="", omitted_chars=omitted)] * 2
    assert len(render_turn(two, 1000)) < 1_100 and "characters omitted" in render_turn(two, 1000)


def test_strict_rules_read_only_the_paper_s_protocol():
    strict = ReplyRules.strict()
    assert read_reply("```repl\nprint(1)\n```", strict).code == ["print(1)"]
    assert read_reply("```python\nprint(1)\n```", strict).code == []
    assert read_reply("FINAL 345", strict).answer is None
    assert read_reply("**FINAL(42)**", strict).answer is None
    assert read_reply("FINAL(42)", strict).turn_answer.text == "42"
    assert strict.beside_code_taken() == "never"


def test_rules_are_chosen_by_name_and_a_misspelt_name_fails():
    rules = DEFAULT_RULES.without("boxed_answer")
    assert not rules.on("boxed_answer") and rules.on("answer_tags")
    assert read_reply("So it is $\\boxed{42}$.", rules).answer is None
    assert DEFAULT_RULES.only("repl_fence").names == ("repl_fence",)
    with pytest.raises(KeyError, match="boxed_anwser"):
        DEFAULT_RULES.without("boxed_anwser")
    with pytest.raises(KeyError):
        DEFAULT_RULES.on("no_such_rule")


def test_a_dialect_adds_rules_of_its_own_in_their_place():
    def calls_as_blocks(text: str, notes: list[str]) -> str:
        return text.replace("<run>", "```repl\n").replace("</run>", "\n```")

    def said(prose: list[str], fences: object) -> ProseFinal | None:
        return next((ProseFinal("FINAL", line[5:]) for line in prose if line.startswith("SAID ")), None)

    rules = DEFAULT_RULES.adding(
        Rule("run_tags", "text", "a dialect's call syntax", ("<run>print(1)</run>",), apply=calls_as_blocks),
        after="special_tokens",
    ).adding(Rule("said", "answer", "a dialect's answer", ("SAID 42",), find=said))
    assert rules.names.index("run_tags") == rules.names.index("special_tokens") + 1
    assert read_reply("<run>print(1)</run>", rules).code == ["print(1)"]
    assert read_reply("SAID 42", rules).turn_answer.text == "42"
    assert read_reply("SAID 42").answer is None
    assert not rules.without("said").on("said")
    with pytest.raises(ValueError, match="apply"):
        DEFAULT_RULES.adding(Rule("x", "text", "no function", ()))


# Replies are made of prose, openers, code and closers, with one of the edge lines (what some rule
# reads) in about one line of eight: most replies made are plain, and the rest differ by a line.
_PROSE = ("Let me look.", "", "Count the lines (all of them).", "- a list item", "Then print it.", "2")
_OPENERS = ("```repl", "```python", "```py3")
_CODE = ("print(1)", "x = 5", "\tprint(2)", "    y = 3", "  z = 4", "", "import re", "for i in range(3):", "    print(i)")
_EDGES = (
    "```Repl", "```repl ", "```", "````", "~~~", "  ```repl", "\t```py", "```repl print(1)```", "```python import re",
    "```markdown", "```text", "x = 5```", "FINAL(42)", "final answer: 3", "FINAL_VAR(x)", "The Final step",
    "s = '''```'''", 's = """', "```{.python}", ">>> 1 + 1", "See `x`.", "<think>plan</think>", "\\boxed{1}",
    "caf\u00e9", "a\rb", "a\x00b", "Answer: 5", " ",
)


def _made_reply(rnd: random.Random) -> str:
    lines: list[str] = []
    for _ in range(rnd.randint(1, 3)):
        lines += rnd.sample(_PROSE, rnd.randint(0, 2))
        lines += [rnd.choice(_OPENERS), *rnd.sample(_CODE, rnd.randint(0, 3)), "```"]
    lines += rnd.sample(_PROSE, rnd.randint(0, 2))
    return "\n".join(rnd.choice(_EDGES) if rnd.random() < 0.12 else line for line in lines)


def test_plain_replies_read_as_every_rule_reads_them():
    """The quick reading of a reply of prose and fenced code gives what the rules give, or leaves
    the reply to them: on every rule's own examples and on made replies, under three rule sets."""
    rnd = random.Random(32)
    texts = [example for rule in RULES for example in rule.examples]
    texts += [_made_reply(rnd) for _ in range(3000)]
    rule_sets = [DEFAULT_RULES, ReplyRules.strict(), DEFAULT_RULES.without("python_fences", "console_prompts")]
    taken = 0
    for text in texts:
        for rules in rule_sets:
            quick = _plain(text, rules)
            if quick is not None:
                taken += 1
                assert quick == read_by_rules(text, rules), (text, rules.names)
    assert taken > 500  # the quick reading is not a path nothing takes


def test_plain_replies_read_quickly_and_others_by_the_rules():
    for reply in ("```repl\nprint(len(context))\n```", "Count them.\n```python\nn = len(context)\nprint(n)\n```\nThen."):
        assert _plain(reply, DEFAULT_RULES) is not None
        assert read_reply(reply) == read_by_rules(reply)
    # Each holds something a rule reads: an answer, a tag, a tilde fence, a console session, an
    # indented fence, inline code; and a rule set with a text rule of its own.
    for reply in ("```repl\nx = 1\n```\nFINAL(x)", "<think>a</think>\n```repl\n1\n```", "~~~python\n1\n~~~",
                  "```repl\n>>> 1\n```", "  ```repl\n1\n  ```", "Use `x`:\n```repl\nx\n```"):
        assert _plain(reply, DEFAULT_RULES) is None
    own = DEFAULT_RULES.adding(Rule("shout", "text", "why", (), apply=lambda text, notes: text.upper()))
    assert _plain("```repl\nx = 1\n```", own) is None
    assert read_reply("```repl\nx = 1\n```", own).code == ["X = 1"]
