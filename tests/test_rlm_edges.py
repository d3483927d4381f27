"""Providers other than openai, traces, bad input and the sync/async surface."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from recursa import RLM, Budget, ConfigError, ContextError
from recursa.trace import load

from .helpers import request_overlap
from .test_rlm_openai import code, make_rlm


def test_anthropic_provider_through_the_real_sdk(server, script, tmp_path):
    script.root("claude-root", code("FINAL(llm_query('ping'))"))
    script.sub("claude-sub", lambda p: "pong")
    rlm = RLM(
        "anthropic/claude-root",
        sub_model="anthropic/claude-sub",
        base_url=server.root_url,
        api_key="anthropic-test-key-123",
        trace_dir=tmp_path,
    )
    result = rlm.run("q", "ctx")
    assert result.answer == "pong"
    assert {r.endpoint for r in server.requests} == {"/v1/messages"}
    assert result.usage.input_tokens == sum(r.prompt_tokens for r in server.requests)


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
def test_arun_runs_concurrently_in_one_process(server, script, tmp_path):
    server.latency_s = 0.2
    script.root("root-model", code("FINAL(context[::-1])"))

    async def main():
        rlm = make_rlm(server, tmp_path)
        return await asyncio.gather(*(rlm.arun("reverse", f"ctx{i}") for i in range(8)))

    results = asyncio.run(main())
    assert [r.answer for r in results] == [f"{i}xtc" for i in range(8)]
    assert len({r.trace_path for r in results}) == 8
    assert request_overlap(server.requests) >= 4  # the runs' model calls really were in flight together


def test_run_works_inside_a_running_event_loop(server, script, tmp_path):
    script.root("root-model", code("FINAL('from a notebook')"))

    async def notebook_cell():
        return make_rlm(server, tmp_path).run("q", "ctx")

    assert asyncio.run(notebook_cell()).answer == "from a notebook"


def test_completion_treats_the_prompt_as_context(server, script, tmp_path):
    script.root("root-model", code("FINAL(context.split(':')[1].strip())"))
    result = make_rlm(server, tmp_path).completion("Repeat the word after the colon: banana")
    assert result.answer == "banana"


def test_trace_is_a_tree_without_the_context_or_secrets(server, script, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-abcdefghijklmnop1234567890")
    marker = "UNIQUE-CONTEXT-MARKER"
    context = ("filler line\n" * 200_000) + marker
    script.root(
        "root-model",
        code("import os\nprint('key', os.environ.get('OPENAI_API_KEY'))\nprint(len(context))"),
        code("FINAL('sk-proj-abcdefghijklmnop1234567890 leaked?')"),
    )
    result = make_rlm(server, tmp_path).run("q", context)
    raw = Path(result.trace_path).read_text()
    assert marker not in raw
    assert "sk-proj-abcdefghijklmnop1234567890" not in raw and "test-key-0123456789" not in raw
    assert len(raw) < 40_000
    trace = load(result.trace_path)
    root = trace.root
    assert root.start["context"]["total_chars"] == len(context)
    assert len(root.start["context"]["sha256"]) == 64
    assert [e["type"] for e in trace.events][:2] == ["run_start", "turn"]
    assert root.end["stop_reason"] == "final"
    execs = root.of_type("exec")
    assert "key None" in execs[0]["stdout"]  # the host's key never reached the REPL
    assert len(root.of_type("lm_call")) == 2


def test_trace_size_does_not_grow_with_context(server, script, tmp_path):
    script.root("root-model", code("print(context[:100])"), "FINAL(x)")
    sizes = []
    for n in (10_000, 2_000_000):
        result = make_rlm(server, tmp_path / str(n)).run("q", "a" * n)
        sizes.append(Path(result.trace_path).stat().st_size)
    assert abs(sizes[0] - sizes[1]) < 200


@pytest.mark.parametrize(
    ("context", "error", "needle"),
    [
        ("", ContextError, "empty"),
        (b"\xc3\x28", ContextError, "not valid UTF-8"),
        (12, ContextError, "unsupported context type"),
    ],
)
def test_bad_context_fails_before_any_call(server, script, tmp_path, context, error, needle):
    script.root("root-model", "FINAL(x)")
    with pytest.raises(error, match=needle):
        make_rlm(server, tmp_path).run("q", context)
    assert server.requests == []


def test_bad_configuration_is_refused_at_construction(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="provider"):
        RLM("mystery/model")
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        RLM("openai/gpt-5-mini")
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        RLM("anthropic/claude-sonnet-4-5")
    with pytest.raises(ConfigError, match="max_iterations"):
        RLM("scripted/gpt5-like", max_iterations=0)
    with pytest.raises(ConfigError, match="sandbox"):
        RLM("scripted/gpt5-like", sandbox="nope")
    with pytest.raises(ConfigError, match="question is empty"):
        RLM("scripted/gpt5-like", trace=False).run("  ", "ctx")


def test_unreachable_base_url_ends_the_run_with_a_clear_error(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    rlm = RLM(
        "openai/any",
        base_url=f"http://127.0.0.1:{port}/v1",
        trace_dir=tmp_path,
        max_retries=1,
        budget=Budget(max_seconds=20),
    )
    result = rlm.run("q", "ctx")
    assert result.stop_reason == "error"
    assert "connect" in result.error.lower() and str(port) in result.error
    assert load(result.trace_path).root.end["stop_reason"] == "error"


def test_time_budget_stops_a_slow_run(server, script, tmp_path):
    script.root("root-model", code("import time\ntime.sleep(30)"))
    result = make_rlm(server, tmp_path, budget=Budget(max_seconds=1.0)).run("q", "ctx")
    assert result.stop_reason == "timeout"
    assert result.duration_s < 3.0


def test_result_json_round_trip(server, script, tmp_path):
    script.root("root-model", code("FINAL('ok')"))
    result = make_rlm(server, tmp_path).run("q", "ctx")
    data = json.loads(json.dumps(result.to_dict()))
    assert data["answer"] == "ok" and data["usage"]["llm_calls"] == 1


def test_sandbox_options_reach_the_sandbox_and_bad_ones_are_named(server, script, tmp_path):
    script.root("root-model", code("import os\nFINAL(os.environ.get('RECURSA_ALLOWED_VAR'))"))
    import os

    os.environ["RECURSA_ALLOWED_VAR"] = "visible"
    try:
        result = make_rlm(server, tmp_path, sandbox_options={"env_allow": ["RECURSA_ALLOWED_VAR"]}).run(
            "q", "c"
        )
    finally:
        del os.environ["RECURSA_ALLOWED_VAR"]
    assert result.answer == "visible"
    with pytest.raises(ConfigError, match="sandbox_options"):
        make_rlm(server, tmp_path, sandbox_options={"no_such_option": 1}).run("q", "c")


def test_strict_reply_rules_are_one_setting(server, script, tmp_path):
    # Under the paper's protocol alone a ```python block does not run and `FINAL 345` is no answer.
    script.root("root-model", "```python\nprint(1)\n```", "FINAL 345", "```repl\nx = 345\n```", "FINAL(345)")
    result = make_rlm(server, tmp_path, dialect_options={"reply_rules": "strict"}).run("q", "ctx")
    assert result.answer == "345" and result.iterations == 4
    executed = [e["code"] for e in load(result.trace_path).events if e["type"] == "exec"]
    assert executed == ["x = 345"]
    with pytest.raises(ConfigError, match="reply_rules='loose'"):
        make_rlm(server, tmp_path, dialect_options={"reply_rules": "loose"})
