"""The whole engine through the real `openai` SDK against the fake server on 127.0.0.1:
the loop, every answer protocol, concurrent sub-calls, children, budgets and usage totals."""

from __future__ import annotations

import itertools

import pytest

from recursa import RLM, Budget
from recursa.trace import load

from .helpers import request_overlap

ROOT, SUB = "openai/root-model", "openai/sub-model"


def make_rlm(server, tmp_path, **kw) -> RLM:
    kw.setdefault("sub_model", SUB)
    return RLM(ROOT, base_url=server.base_url, api_key="test-key-0123456789", trace_dir=tmp_path, **kw)


def code(src: str) -> str:
    return f"Let me run this.\n```repl\n{src}\n```"


def subs(server):
    return [r for r in server.requests if r.model == "sub-model"]


# -- answer protocols ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replies", "answer", "protocol"),
    [
        ([code("x = len(context)\nFINAL(x)")], "11", "FINAL"),
        ([code("result = context.upper()\nFINAL_VAR('result')")], "HELLO WORLD", "FINAL_VAR"),
        ([code("answer['content'] = context[:5]\nanswer['ready'] = True")], "hello", "answer"),
        ([code("n = context.count('o')\nprint(n)"), "The count is known.\nFINAL(2 o's)"], "2 o's", "FINAL"),
        ([code("words = context.split()"), "FINAL_VAR(words)"], "['hello', 'world']", "FINAL_VAR"),
    ],
)
def test_answer_protocols(server, script, tmp_path, replies, answer, protocol):
    script.root("root-model", *replies)
    result = make_rlm(server, tmp_path).run("What is it?", "hello world")
    assert result.stop_reason == "final"
    assert result.answer == answer
    assert result.answer_protocol == protocol


def test_final_var_keeps_the_object_and_non_string_answers_render(server, script, tmp_path):
    script.root("root-model", code("counts = {'a': 1, 'b': [1, 2]}\nFINAL_VAR('counts')"))
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.value == {"a": 1, "b": [1, 2]}
    assert result.answer == "{'a': 1, 'b': [1, 2]}"


def test_prose_final_next_to_code_is_not_accepted_that_turn(server, script, tmp_path):
    script.root(
        "root-model",
        code("total = 40 + 2\nprint(total)") + "\nFINAL(41)",  # guessed before seeing output
        "FINAL(42)",
    )
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.answer == "42" and result.iterations == 2
    feedback = server.requests[1].messages[-1]["content"]
    assert "42" in feedback and "not accepted" in feedback


def test_blocks_run_in_order_in_one_namespace_and_stop_at_an_answer(server, script, tmp_path):
    reply = code("a = 2") + "\n" + code("b = a * 21\nFINAL(b)") + "\n" + code("FINAL('never')")
    script.root("root-model", reply)
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.answer == "42"


def test_reserved_names_are_restored_and_the_model_is_told(server, script, tmp_path):
    script.root(
        "root-model",
        code("context = 'overwritten'\nllm_query = None\ndel FINAL"),
        code("FINAL(context)"),
    )
    result = make_rlm(server, tmp_path).run("q", "the real context")
    assert result.answer == "the real context"
    feedback = server.requests[1].messages[-1]["content"]
    assert "context" in feedback and "restored" in feedback


# -- what the root sees ----------------------------------------------------------------------


def test_root_sees_metadata_only_and_truncated_output(server, script, tmp_path):
    hidden = "SECRET-MIDDLE-" + "z" * 50_000
    context = "head " * 100 + hidden + " tail" * 100
    script.root("root-model", code("print(context)"), "FINAL(done)")
    result = make_rlm(server, tmp_path, max_output_chars=2_000).run("q", context)
    assert result.answer == "done"
    first = server.requests[0].messages
    assert all("SECRET-MIDDLE" not in m["content"] for m in first)
    assert f"{len(context):,} characters" in first[1]["content"]
    feedback = server.requests[1].messages[-1]["content"]
    assert len(feedback) < 2_500 and "characters omitted" in feedback
    output, reminder = feedback.split("\n\n(The question you are answering: ")
    assert output.rstrip().endswith("tail") and reminder == "q)"


def test_no_code_and_errors_become_messages_for_the_next_turn(server, script, tmp_path):
    script.root(
        "root-model",
        "I think the answer is obvious.",  # no code, no FINAL
        code("def broken(:\n  pass"),  # syntax error
        code("print(undefined_name)"),  # runtime error
        "FINAL_VAR(nothing_here)",  # undefined variable
        "FINAL(ok)",
    )
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.answer == "ok" and result.iterations == 5
    feedbacks = [r.messages[-1]["content"] for r in server.requests[1:5]]
    assert "no ```repl code block" in feedbacks[0]
    assert "SyntaxError" in feedbacks[1]
    assert "NameError" in feedbacks[2] and "undefined_name" in feedbacks[2]
    assert "FINAL_VAR(nothing_here) names no variable" in feedbacks[3]


def test_max_iterations_makes_one_last_call(server, script, tmp_path):
    script.root("root-model", code("x = 1"), code("x += 1"), "FINAL(forced answer)")
    result = make_rlm(server, tmp_path, max_iterations=2).run("q", "ctx")
    assert result.stop_reason == "max_iterations"
    assert result.answer == "forced answer" and result.iterations == 2
    assert "used all 2 turns" in server.requests[-1].messages[-1]["content"]


# -- sub-calls -------------------------------------------------------------------------------


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
def test_batch_runs_in_parallel_and_two_batches_in_one_run_work(server, script, tmp_path):
    server.latency_s = 0.2
    script.root(
        "root-model",
        code("a = llm_query_batched([f'p{i}' for i in range(32)])\nprint(len(a))"),
        code("b = llm_batch([f'q{i}' for i in range(32)])\nFINAL([a[0], b[31]])"),
    )
    script.sub("sub-model", lambda p: p.upper())
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.value == ["P0", "Q31"]
    sub_records = subs(server)
    assert len(sub_records) == 64
    assert request_overlap(sub_records[:32]) >= 16 and request_overlap(sub_records[32:]) >= 16


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
def test_user_threads_calling_llm_query_overlap(server, script, tmp_path):
    server.latency_s = 0.2
    script.root(
        "root-model",
        code(
            "from concurrent.futures import ThreadPoolExecutor\n"
            "with ThreadPoolExecutor(16) as pool:\n"
            "    out = list(pool.map(llm_query, [f'x{i}' for i in range(16)]))\n"
            "FINAL_VAR('out')"
        ),
    )
    script.sub("sub-model", lambda p: p + "!")
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.value == [f"x{i}!" for i in range(16)]
    assert request_overlap(subs(server)) >= 8


def test_sub_model_and_model_override_and_headers(server, script, tmp_path):
    script.root("root-model", code("FINAL(llm_query('hi') + llm_query('hi', model='other-model'))"))
    script.sub("sub-model", lambda p: "S")
    script.sub("other-model", lambda p: "O")
    result = make_rlm(server, tmp_path, allowed_models=["openai/other-model"]).run("q", "ctx")
    assert result.answer == "SO"
    assert not any(k.startswith("x-rlm-") for k in subs(server)[0].headers)  # attribution is opt-in
    server.reset()
    result = make_rlm(server, tmp_path, call_headers=True, allowed_models=["openai/other-model"]).run(
        "q", "ctx"
    )
    sub = subs(server)[0]
    assert sub.headers["x-rlm-depth"] == "1"
    assert sub.headers["x-rlm-parent-id"] == result.run_id


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
def test_depth_two_children_run_in_parallel(server, script, tmp_path):
    server.latency_s = 0.1
    script.root(
        "root-model",
        code(
            "parts = rlm_query_batched(['count'] * 6, contexts=['a' * (i + 1) for i in range(6)])\nFINAL_VAR('parts')"
        ),
    )
    # Children's roots are the sub-model: 3 turns each (peek, compute, answer).
    script.root(
        "sub-model",
        code("print(len(context))"),
        code("n = len(context)"),
        "FINAL_VAR(n)",
    )
    result = make_rlm(server, tmp_path, max_depth=2).run("q", "ctx")
    assert result.value == ["1", "2", "3", "4", "5", "6"]
    trace = load(result.trace_path)
    children = trace.root.children
    assert len(children) == 6 and all(c.depth == 1 and c.stop_reason == "final" for c in children)
    # The children ran side by side: their first turns were at the server at once.
    first_turns = [r for r in server.requests if r.model == "sub-model" and len(r.messages) == 2]
    assert request_overlap(first_turns) >= 3


def test_rlm_query_at_the_last_level_is_a_plain_call(server, script, tmp_path):
    script.root("root-model", code("FINAL(rlm_query('summarise', context='abc'))"))
    script.sub("sub-model", lambda p: f"plain:{p}")
    result = make_rlm(server, tmp_path, max_depth=1).run("q", "ctx")
    assert result.answer == "plain:summarise\n\nabc"
    assert load(result.trace_path).root.children == []


def test_max_depth_zero_has_no_sub_calls(server, script, tmp_path):
    script.root(
        "root-model",
        code("try:\n    llm_query('x')\nexcept Exception as e:\n    FINAL(type(e).__name__ + ': ' + str(e))"),
    )
    result = make_rlm(server, tmp_path, max_depth=0).run("q", "ctx")
    assert "max_depth=0" in result.answer
    assert subs(server) == []


# -- budgets and usage -----------------------------------------------------------------------


def test_usage_totals_equal_what_the_server_saw(server, script, tmp_path):
    script.root(
        "root-model",
        code("r = llm_query_batched(['a' * 400] * 10)"),
        code("FINAL(len(r))"),
    )
    script.sub("sub-model", lambda p: "short answer")
    result = make_rlm(server, tmp_path).run("q", "ctx")
    totals = server.totals()
    u = result.usage
    assert u.llm_calls == len(server.requests) == 12
    assert u.input_tokens == sum(t["prompt_tokens"] for t in totals.values())
    assert u.output_tokens == sum(t["completion_tokens"] for t in totals.values())
    assert u.by_model["openai/sub-model"].llm_calls == 10
    assert u.by_model["openai/sub-model"].input_tokens == totals["sub-model"]["prompt_tokens"]


def test_token_budget_refuses_inside_the_repl_and_the_model_can_still_answer(server, script, tmp_path):
    script.root(
        "root-model",
        code(
            "try:\n"
            "    r = llm_query_batched(['x' * 2000] * 100)\n"
            "    print('answers', sum(not a.startswith('[error') for a in r))\n"
            "except BudgetExceeded as e:\n"
            "    print('refused:', e)"
        ),
        "FINAL(partial)",
    )
    script.sub("sub-model", lambda p: "ok")
    budget = Budget(max_tokens=60_000)
    result = make_rlm(server, tmp_path, budget=budget, max_output_tokens=1000).run("q", "ctx")
    assert result.answer == "partial"
    used = result.usage.input_tokens + result.usage.output_tokens
    assert used <= 60_000
    assert len(subs(server)) < 100  # some were refused before being sent


def test_call_cap_stops_the_root(server, script, tmp_path):
    script.root("root-model", code("x = 1"), code("x = 2"), code("x = 3"))
    result = make_rlm(server, tmp_path, budget=Budget(max_llm_calls=2)).run("q", "ctx")
    assert result.stop_reason == "budget"
    assert len(server.requests) == 2 and "2 LM calls" in result.error


def test_dollar_budget_needs_prices(server, script, tmp_path):
    from recursa.errors import ConfigError

    with pytest.raises(ConfigError, match="no price is known"):
        make_rlm(server, tmp_path, budget=Budget(max_usd=1.0))
    rlm = make_rlm(
        server,
        tmp_path,
        budget=Budget(max_usd=1.0),
        prices={
            ROOT: {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
            SUB: {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
        },
    )
    script.root("root-model", code("FINAL(llm_query('hi'))"))
    script.sub("sub-model", lambda p: "priced")
    result = rlm.run("q", "ctx")
    assert result.answer == "priced" and 0 < result.usage.cost_usd <= 1.0


def test_dollar_budget_is_never_exceeded_by_a_fan_out(server, script, tmp_path):
    prices = {
        ROOT: {"input_per_mtok": 10.0, "output_per_mtok": 10.0},
        SUB: {"input_per_mtok": 10.0, "output_per_mtok": 10.0},
    }
    script.root(
        "root-model",
        code("r = llm_query_batched(['p' * 100] * 500)\nprint(sum(a == 'ok' for a in r))"),
        "FINAL(done)",
    )
    script.sub("sub-model", lambda p: "ok")
    # The budget binds on what the calls cost, not only on what they reserve: the items of a batch
    # start one by one, so with an instant server early calls settle before later ones reserve.
    result = make_rlm(server, tmp_path, budget=Budget(max_usd=0.1), prices=prices, max_output_tokens=50).run(
        "q", "ctx"
    )
    assert result.usage.cost_usd <= 0.1
    assert 0 < len(subs(server)) < 500


def test_root_history_is_append_only_so_prefix_caches_hit(server, script, tmp_path):
    script.root("root-model", *[code(f"x{i} = {i}\nprint(x{i})") for i in range(9)], "FINAL(done)")
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert result.iterations == 10
    roots = [r.messages for r in server.requests if r.model == "root-model"]
    for before, after in itertools.pairwise(roots):
        assert after[: len(before)] == before  # every request extends the previous one
    shared = sum(sum(len(m["content"]) for m in before) for before in roots[:-1])
    total = sum(sum(len(m["content"]) for m in after) for after in roots[1:])
    assert shared / total > 0.9


def test_parallel_children_are_capped_per_depth(server, script, tmp_path):
    script.root(
        "root-model",
        code(
            "parts = rlm_query_batched(['count'] * 6, contexts=['a' * (i + 1) for i in range(6)])\nFINAL_VAR('parts')"
        ),
    )
    script.root("sub-model", code("n = len(context)"), "FINAL_VAR(n)")
    result = make_rlm(server, tmp_path, max_depth=2, max_parallel_children=2).run("q", "ctx")
    assert result.value == ["1", "2", "3", "4", "5", "6"]
    children = load(result.trace_path).root.children
    spans = [(c.start["ts"], c.end["ts"]) for c in children]
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most == 2  # never more than two child runs (and their REPL processes) at once
