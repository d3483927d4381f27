"""dialect="tools": the root runs code through native tool calls, over the real SDK paths (the fake
server returns and streams tool calls as vLLM and Anthropic do), in traces, exports and RLMEnv."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from recursa import RLM
from recursa.env import RLMEnv
from recursa.errors import ConfigError
from recursa.testing.tool_replies import ToolCallReply
from recursa.trace import load
from recursa.train.rl import rl_rows
from recursa.train.sft import sft_rows

KEY = "test-key-0123456789"


class Replies:
    """Root replies in order (by the assistant turns already in the request); sub-calls echo."""

    def __init__(self, *replies: str | ToolCallReply) -> None:
        self.replies = list(replies)

    def __call__(self, model: str, messages: list[dict]) -> str | ToolCallReply:
        if messages[0]["role"] != "system":
            return "sub"
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return self.replies[min(turn, len(self.replies) - 1)]


def calls(*codes: str, name: str = "call_python_repl", arg: str = "code") -> ToolCallReply:
    return ToolCallReply([(name, {arg: c}) for c in codes])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_each_call_runs_in_order_and_is_answered_by_its_id(server, tmp_path, provider):
    first = calls("x = 20", "print(x + 1)")
    server.holder["responder"] = Replies(first, "The output says 21.\nFINAL(21)")
    server.reset()
    url = server.base_url if provider == "openai" else server.root_url
    rlm = RLM(f"{provider}/root", base_url=url, api_key=KEY, trace_dir=tmp_path, dialect="tools")
    result = rlm.run("What is x + 1?", "some context")
    assert (result.answer, result.stop_reason, result.dialect) == ("21", "final", "tools")
    roots = [r for r in server.requests if r.model == "root"]
    assert all(r.tools == ["call_python_repl"] for r in roots)
    # The second request answers both calls, in order, each with its own id.
    results = [m for m in roots[1].messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == first.ids
    assert results[0]["content"].startswith("REPL output:\n(no output)")
    assert results[1]["content"].startswith("REPL output:\n21")
    trace = load(result.trace_path)
    start = next(e for e in trace.events if e["type"] == "run_start")
    assert start["dialect"] == "tools"
    first_call = next(e for e in trace.events if e["type"] == "lm_call" and e.get("purpose") == "root")
    assert [c["id"] for c in first_call["tool_calls"]] == first.ids
    execs = [e for e in trace.events if e["type"] == "exec"]
    assert [e.get("call_id") for e in execs] == first.ids


def test_tool_name_and_argument_are_settable_and_a_wrong_call_is_told(server, tmp_path):
    server.holder["responder"] = Replies(
        ToolCallReply([("call_python_repl", {"code": "print(1)"}), ("python", {"source": "print(7)"})]),
        "FINAL(7)",
    )
    server.reset()
    rlm = RLM(
        "openai/root",
        base_url=server.base_url,
        api_key=KEY,
        trace_dir=tmp_path,
        dialect="tools",
        dialect_options={"tool_name": "python", "tool_argument": "source"},
    )
    assert rlm.run("q", "ctx").answer == "7"
    second = [r for r in server.requests if r.model == "root"][1]
    assert second.tools == ["python"]
    told = [m["content"] for m in second.messages if m["role"] == "tool"]
    assert "no tool named 'call_python_repl'" in told[0] and told[1].startswith("REPL output:\n7")
    with pytest.raises(ConfigError, match=r"RLM\(dialect='tools'\).*tool_name"):
        RLM("scripted/gpt5-like", dialect="tools", dialect_options={"tool_name": "bad name!"})
    with pytest.raises(ConfigError, match="unknown dialect 'klingon'"):
        RLM("scripted/gpt5-like", dialect="klingon")


@pytest.mark.parametrize(("provider", "sent"), [("openai", "required"), ("anthropic", {"type": "any"})])
def test_tool_choice_goes_out_in_each_api_shape(server, tmp_path, provider, sent):
    server.holder["responder"] = Replies(calls("answer['content'] = 'ok'\nanswer['ready'] = True"))
    server.reset()
    rlm = RLM(
        f"{provider}/root",
        base_url=server.base_url if provider == "openai" else server.root_url,
        api_key=KEY,
        trace_dir=tmp_path,
        dialect="tools",
        sampling={"root": {"tool_choice": "required"}},
    )
    assert rlm.run("q", "ctx").answer == "ok"
    assert server.requests[0].tool_choice == sent


def test_the_fake_server_streams_tool_call_deltas_to_both_sdks(server):
    reply = ToolCallReply([("call_python_repl", {"code": "print(len(context)) # " + "x" * 60})], text="Looking.")
    server.holder["responder"] = lambda model, messages: reply
    server.reset()
    tool = {"name": "call_python_repl", "description": "run code", "parameters": {"type": "object"}}
    oai = openai.OpenAI(base_url=server.base_url, api_key=KEY)
    chunks = list(
        oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": tool}],
            stream=True,
        )
    )
    pieces = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 2  # the arguments arrive in several deltas
    assert pieces[0][0].id == reply.ids[0] and pieces[0][0].function.name == "call_python_repl"
    arguments = "".join(p[0].function.arguments or "" for p in pieces)
    assert json.loads(arguments) == reply.calls[0][1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    ant = anthropic.Anthropic(base_url=server.root_url, api_key=KEY)
    with ant.messages.stream(
        model="m",
        max_tokens=500,
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "call_python_repl", "description": "run code", "input_schema": {"type": "object"}}],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == reply.calls[0][1] and final.content[1].id == reply.ids[0]


def test_scripted_root_calls_the_tool_and_exports_write_openai_tool_turns(tmp_path):
    from recursa.tasks import generate

    task = generate("niah", 20_000, seed=3)
    rlm = RLM("scripted/gpt5-like", sub_model="scripted/oracle", dialect="tools", trace_dir=tmp_path)
    result = rlm.run(task.question, task.context)
    assert result.stop_reason == "final" and task.score(result.answer) == 1.0
    rows, _ = sft_rows([tmp_path], scores={result.run_id: 1.0})
    second = rows[1]  # the second turn's prompt holds the first turn's call and its result
    said = second["prompt"][2]
    assert said["role"] == "assistant" and said["tool_calls"][0]["type"] == "function"
    assert json.loads(said["tool_calls"][0]["function"]["arguments"])["code"]
    assert second["prompt"][3] == {
        "role": "tool",
        "tool_call_id": said["tool_calls"][0]["id"],
        "content": second["prompt"][3]["content"],
    }
    assert rows[0]["completion"][0]["tool_calls"][0]["function"]["name"] == "call_python_repl"
    rl, _ = rl_rows([tmp_path], scores={result.run_id: 1.0})
    assert rl[0]["response_tool_calls"][0]["id"] == said["tool_calls"][0]["id"]
    assert rl[-1]["response_tool_calls"] is None  # the last reply answers in text


def test_rlmenv_takes_a_trainers_tool_call_message(tmp_path):
    with RLMEnv(max_depth=0, dialect="tools", trace_dir=tmp_path) as env:
        episode = env.start_sync("How long is the context?", "abcdef")
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "call_python_repl", "arguments": json.dumps({"code": "print(len(context))"})},
        }
        observations = episode.step_sync({"role": "assistant", "content": None, "tool_calls": [call]})
        assert observations == [
            {"role": "tool", "tool_call_id": "c1", "content": observations[0]["content"]}
        ]
        assert observations[0]["content"].startswith("REPL output:\n6")
        assert episode.messages[-2]["tool_calls"][0]["function"]["name"] == "call_python_repl"
        assert episode.step_sync({"role": "assistant", "content": "FINAL(6)"}) == []
        assert (episode.answer, episode.stop_reason) == ("6", "final")
        rows = episode.rollouts()
        assert rows[1]["prompt"][-1]["role"] == "tool" and rows[0]["response_tool_calls"][0]["id"] == "c1"
