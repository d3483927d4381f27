from recursa.loop.output import render_turn, truncate_middle
from recursa.loop.parse import parse_reply
from recursa.sandbox.base import ExecResult
from recursa.sandbox.worker.capture import Capture


def test_blocks_run_in_order_and_python_fences_count():
    reply = "Plan.\n```repl\na = 1\n```\ntext\n```python\nb = a + 1\n```\n```\nnot run\n```"
    parsed = parse_reply(reply)
    assert parsed.code_blocks == ["a = 1", "b = a + 1"]
    assert parsed.unlabeled_blocks == 1
    assert parsed.prose_final is None


def test_prose_final_with_nested_parentheses_and_quotes():
    parsed = parse_reply('I checked it.\nFINAL("The answer is (b): 42")')
    assert parsed.prose_final.protocol == "FINAL"
    assert parsed.prose_final.text == "The answer is (b): 42"


def test_prose_final_var_with_and_without_quotes():
    assert parse_reply("FINAL_VAR(result)").prose_final.text == "result"
    assert parse_reply("Done.\n  FINAL_VAR('my_list')").prose_final.text == "my_list"


def test_final_inside_code_is_not_prose():
    parsed = parse_reply("```repl\nFINAL(x)\n```")
    assert parsed.prose_final is None
    assert parsed.code_blocks == ["FINAL(x)"]


def test_final_mid_sentence_is_not_an_answer():
    assert parse_reply("Later I will call FINAL(answer) when ready.").prose_final is None


def test_code_and_prose_final_together_are_both_seen():
    parsed = parse_reply("```repl\nprint(1)\n```\nFINAL(1)")
    assert parsed.code_blocks and parsed.prose_final is not None


def test_unclosed_fence_still_runs():
    assert parse_reply("```repl\nprint('hi')").code_blocks == ["print('hi')"]


def test_truncate_middle_keeps_head_and_tail_and_counts():
    text = "A" * 1000 + "B" * 1000
    out = truncate_middle(text, 200)
    assert out.startswith("A" * 100) and out.endswith("B" * 80)
    assert "1,800 characters omitted" in out
    assert truncate_middle("short", 200) == "short"


def test_output_the_worker_cut_to_the_limit_is_shown_with_one_count():
    # 60,006 characters printed under max_output_chars=1000: the worker keeps 500 + 500 and marks
    # the rest; the host used to cut that again for the marker's length, showing a second marker
    # whose count overlapped the first.
    capture = Capture(1000)
    capture.out.write("A" * 30_000 + "MIDDLE" + "Z" * 30_000)
    stdout, stderr, omitted = capture.finish()
    shown = render_turn([ExecResult(stdout=stdout, stderr=stderr, omitted_chars=omitted)], 1000)
    assert shown.count("characters omitted") == 1 and "59,006 characters omitted" in shown
    assert shown.startswith("A" * 500 + "\n[") and shown.endswith("]\n" + "Z" * 500)
    # Several blocks that together pass the limit are still cut, and say how much in all.
    two = [ExecResult(stdout=stdout, stderr="", omitted_chars=omitted)] * 2
    assert len(render_turn(two, 1000)) < 1_100 and "characters omitted" in render_turn(two, 1000)
