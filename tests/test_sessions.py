"""Sessions (several questions over one REPL and one loaded context) and root-window compaction,
through the real loop and the real openai client against the fake server."""

from __future__ import annotations

import re

import pytest

from recursa.errors import ConfigError
from recursa.sandbox.proc import running as _alive
from recursa.trace import load

from .helpers import wait_until
from .test_rlm_openai import code, make_rlm


def question_of(messages):
    return re.search(r"<question>\n(.*?)\n</question>", messages[1]["content"], re.S).group(1)


def by_question(server, plan):
    """The root answers per question: plan[question] = replies in turn order."""
    server.reset()

    def respond(model, messages):
        replies = plan[question_of(messages)]
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    server.holder["responder"] = respond


PLAN = {
    "q1": [code("import os\nwords = context.split()\npid = os.getpid()\nFINAL(len(words))")],
    "q2": [code("FINAL(f'{words[0]}|{pid == os.getpid()}|{history[0][\"answer\"]}')")],
    "q3": [code("FINAL(f'{len(history)}|{history[1][\"question\"]}|{SHOW_VARS is not None}')")],
}


def test_three_questions_share_the_repl_its_variables_and_the_context(server, tmp_path):
    by_question(server, PLAN)
    rlm = make_rlm(server, tmp_path)
    with rlm.session("alpha beta gamma") as s:
        answers = [s.ask(q).answer for q in ("q1", "q2", "q3")]
        trace_path = s.trace_path
    assert answers == ["3", "alpha|True|3", "2|q2|True"]
    firsts = [r.messages[1]["content"] for r in server.requests]
    assert "question 2 of a session" in firsts[1] and "`history`" in firsts[1]
    assert "alpha|True|3" not in firsts[2]  # earlier answers are variables, not pasted into the window
    trace = load(trace_path)
    assert [e["stop_reason"] for e in trace.events if e["type"] == "run_end"] == ["final"] * 3
    assert len({e["run_id"] for e in trace.events if e["type"] == "run_start"}) == 3


async def test_an_async_session_and_per_question_budgets(server, tmp_path):
    from recursa import Budget

    by_question(server, {"a": [code("x = 1"), "FINAL(one)"], "b": [code("FINAL(x + 1)")]})
    rlm = make_rlm(server, tmp_path, budget=Budget(max_llm_calls=2))
    async with rlm.session("ctx") as s:
        first = await s.aask("a")
        second = await s.aask("b")
    assert (first.answer, second.answer) == ("one", "2")  # each question got its own 2-call budget
    with pytest.raises(ConfigError, match="session is closed"):
        await s.aask("c")


def test_a_session_reaps_its_repl_on_close(server, tmp_path):
    by_question(server, {"p": [code("FINAL(1)")]})
    with make_rlm(server, tmp_path).session("ctx") as s:
        s.ask("p")
        pid = s._sandbox.pid  # the host's view (inside bwrap the worker has its own pid namespace)
        assert pid is not None and _alive(pid)
    wait_until(lambda: not _alive(pid), 5.0, "the session's REPL to be reaped")


def test_a_failed_question_does_not_end_the_session(server, tmp_path):
    from recursa import Budget

    by_question(server, {"big": [code("x = 5")], "small": [code("FINAL(x)")]})
    rlm = make_rlm(server, tmp_path, budget=Budget(max_llm_calls=1))
    with rlm.session("ctx") as s:
        assert s.ask("big").stop_reason == "budget"
        assert s.ask("small").answer == "5"
        assert [h["stop_reason"] for h in s.history] == ["budget", "final"]


# -- compaction ------------------------------------------------------------------------------


def test_a_small_window_compacts_older_turns_and_keeps_them_in_root_history(server, tmp_path):
    server.reset()
    calls: list[list[dict]] = []

    def respond(model, messages):
        calls.append(messages)
        if "outgrow your context window" in messages[-1]["content"]:
            return "SUMMARY: counted the words so far in variable n."
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if "compacted to stay within" in messages[1]["content"]:
            return code("FINAL(f'{n}|{len(root_history)}|{root_history[2][\"role\"]}')")
        return code(f"n = {turn}\nprint('x' * 1500)")

    server.holder["responder"] = respond
    rlm = make_rlm(server, tmp_path, root_window_tokens=2_000, max_iterations=12)
    result = rlm.run("count", "ctx")
    assert result.stop_reason == "final", result
    n, history_len, role = result.answer.split("|")
    assert role == "assistant" and int(history_len) > int(n) * 2
    summary_calls = [c for c in calls if "outgrow your context window" in c[-1]["content"]]
    assert len(summary_calls) >= 1
    after = next(c for c in calls if "compacted to stay within" in c[1]["content"])
    assert "SUMMARY: counted the words" in after[1]["content"]
    i = next(i for i, c in enumerate(calls) if c is summary_calls[0])
    assert len(calls[i + 1]) < len(calls[i - 1]) + 2  # without compaction it would have grown by two
    events = load(result.trace_path).events
    compacts = [e for e in events if e["type"] == "compact"]
    assert compacts and compacts[0]["compacted_messages"] >= 1
    from recursa.trace.viewer import build_view

    view = build_view(result.trace_path)
    assert any(n["k"] == "compact" for n in view["nodes"])
    assert not any("unknown types" in w for w in view["warnings"])
