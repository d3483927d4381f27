"""dialect="verifiers": Prime Intellect's RLM environment's conventions over the real openai SDK path,
with replies shaped like those published from runs of that environment (a tool call that sets the
answer, a prose answer in \\boxed{}), each ending where the model meant."""

from __future__ import annotations

from recursa import RLM
from recursa.testing.tool_replies import ToolCallReply

KEY = "test-key-0123456789"


def call(code: str) -> ToolCallReply:
    return ToolCallReply([("call_python_repl", {"code": code})])


def responder(*replies):
    def respond(model: str, messages: list[dict]):
        if model == "sub":
            return "SUB:" + messages[-1]["content"][:5]
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return respond


def run(server, tmp_path, *replies, **kw):
    server.holder["responder"] = responder(*replies)
    server.reset()
    rlm = RLM(
        "openai/root",
        sub_model="openai/sub",
        base_url=server.base_url,
        api_key=KEY,
        trace_dir=tmp_path,
        dialect="verifiers",
        **kw,
    )
    return rlm.run("Which fruit is named?", "the fruit is a mango")


def test_a_call_that_sets_the_answer_ends_the_rollout(server, tmp_path):
    result = run(
        server,
        tmp_path,
        call("print(type(extra_data).__name__, len(extra_data))\nanswer['content'] = 'draft'"),
        call("print(llm_batch(['apple', 'mango'])); import sys; print('hm', file=sys.stderr)"),
        call("answer['content'] = extra_data.split()[-1]\nanswer['ready'] = True"),
        "never asked",
        dialect_options={"packages": "numpy regex"},
    )
    assert (result.answer, result.stop_reason, result.answer_protocol) == ("mango", "final", "answer")
    roots = [r for r in server.requests if r.model == "root"]
    assert len(roots) == 3 and all(r.tools == ["call_python_repl"] for r in roots)
    first = roots[0].messages
    assert [m["role"] for m in first] == ["user"]  # the instructions open the first user message
    assert first[0]["content"].startswith("<SCAFFOLDING>\n") and "extra_data" in first[0]["content"]
    assert "- `numpy`" in first[0]["content"] and "llm_batch" in first[0]["content"]
    assert first[0]["content"].endswith("</SCAFFOLDING>\n\nWhich fruit is named?")
    outputs = [m["content"] for m in roots[2].messages if m["role"] == "tool"]
    assert outputs == ["str 20", "['SUB:apple', 'SUB:mango']\nstderr:\nhm"]


def test_a_prose_answer_in_boxed_ends_the_rollout(server, tmp_path):
    result = run(server, tmp_path, call("print(extra_data)"), "The data names it.\n\nFinal: \\boxed{mango}")
    assert (result.answer, result.stop_reason) == ("mango", "final")


def test_out_of_turns_the_answer_so_far_is_kept(server, tmp_path):
    result = run(server, tmp_path, call("answer['content'] = 'mango?'"), max_iterations=2)
    assert (result.answer, result.stop_reason, result.answer_protocol) == ("mango?", "max_iterations", "partial")
    assert len([r for r in server.requests if r.model == "root"]) == 2  # no extra call for the answer
