"""Context-window guards: calls that cannot fit their model's window are not sent; the root
compacts first, or stops with stop_reason "context_window"."""

from __future__ import annotations

import argparse
import json

import pytest

from recursa.errors import ConfigError
from recursa.lm.windows import ContextWindows, prompt_tokens
from recursa.loop.compaction import SUMMARY_REQUEST
from recursa.result import STOP_REASONS
from tests.test_escapes import feedback_before
from tests.test_rlm_openai import ROOT, SUB, code, make_rlm, subs


def roots(server) -> list:
    return [r for r in server.requests if r.model == "root-model"]


def test_windows_come_from_genai_prices_and_overrides_win() -> None:
    listed = ContextWindows()
    assert listed.window("openai/gpt-4o") == 128_000
    assert listed.window("anthropic/claude-sonnet-4-5") == 200_000
    assert listed.window("openai/my-local-model") is None  # unknown: no guard
    mine = ContextWindows({"gpt-4o": 8_000, "openai/my-local-model": 32_768})
    assert mine.window("openai/gpt-4o") == 8_000 and mine.window("openai/my-local-model") == 32_768


def test_a_sub_call_too_big_for_its_window_is_refused_naming_both_sizes(server, script, tmp_path):
    script.root(
        "root-model",
        code("try:\n    llm_query('word ' * 3000)\nexcept SubcallError as e:\n    print('refused:', e)"),
        code("FINAL(llm_query('short'))"),
    )
    script.sub("sub-model", lambda p: "fine")
    rlm = make_rlm(server, tmp_path, context_windows={SUB: 4_000}, max_output_tokens=500)
    result = rlm.run("q", "ctx")
    assert result.answer == "fine", result.error
    seen = feedback_before(server, 2)
    assert "refused: the prompt (15,000 characters) is too long for openai/sub-model" in seen
    assert "about 5,008 tokens" in seen and "max_output_tokens=500" in seen and "takes 4,000 tokens" in seen
    assert [r.messages[-1]["content"] for r in subs(server)] == ["short"]  # the big one was never sent
    events = [json.loads(line) for line in open(result.trace_path)]
    assert [e["refused"] for e in events if e.get("refused")] == ["context_window"]


def test_the_root_compacts_before_its_window_would_overflow(server, script, tmp_path):
    turns = iter([*(code(f"print('{i}' * 3000)") for i in range(8)), code("FINAL('done')")])

    def root(model: str, messages: list[dict]) -> str:
        if SUMMARY_REQUEST in messages[-1]["content"]:
            return "summary of the work"
        return next(turns)

    server.holder["responder"] = root
    system = prompt_tokens([{"role": "system", "content": "x" * 12_000}])  # the prompt is under this
    rlm = make_rlm(server, tmp_path, context_windows={ROOT: system + 6_000}, max_output_tokens=500)
    result = rlm.run("q", "ctx")
    assert result.stop_reason == "final", result.error
    events = [json.loads(line) for line in open(result.trace_path)]
    assert any(e["type"] == "compact" for e in events)
    window = system + 6_000
    assert all(prompt_tokens(r.messages) + 500 <= window for r in roots(server))


def test_a_root_that_cannot_fit_stops_with_context_window_and_sends_nothing(server, script, tmp_path):
    script.root("root-model", code("FINAL('never')"))
    rlm = make_rlm(server, tmp_path, context_windows={ROOT: 1_500}, max_output_tokens=500)
    result = rlm.run("q", "ctx")
    assert "context_window" in STOP_REASONS
    assert result.stop_reason == "context_window" and result.answer == ""
    assert "openai/root-model takes 1,500 tokens" in result.error and "max_output_tokens=500" in result.error
    assert roots(server) == []


@pytest.mark.parametrize("value", [{"m": 0}, {"m": "big"}, [("m", 1)]])
def test_bad_context_windows_fail_at_construction(server, tmp_path, value):
    with pytest.raises(ConfigError, match="context_windows"):
        make_rlm(server, tmp_path, context_windows=value)


# -- the command line: --context-window MODEL=TOKENS, derived from the setting --------------------


def test_every_command_that_starts_runs_takes_context_window_flags(tmp_path) -> None:
    import subprocess
    import sys

    from recursa.cli import _parser, _rlm_from_args
    from recursa.cli_options import add_model_options, run_kwargs

    from .test_cli_options import _env, _subparsers

    starting = {name for name, p in _subparsers().items() if "--cache-subcalls" in p._option_string_actions}
    assert {"run", "chat", "serve", "mcp", "acp", "openenv", "bench"} <= starting
    for name in starting:
        assert _subparsers()[name]._option_string_actions["--context-window"].dest == "context_windows"

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    given = ["--model", "scripted/gpt5-like", "--context-window", "a=1", "--context-window", "openai/b=32_768"]
    assert run_kwargs(parser.parse_args(given))["context_windows"] == {"a": 1, "openai/b": 32_768}
    assert run_kwargs(parser.parse_args(given[:2]))["context_windows"] is None
    for bad, said in [
        ("m=0", "--context-window m=0: --context-window must be a window in tokens, an int >= 1"),
        ("m=big", "--context-window m=big: --context-window must be"),
        ("m", "--context-window 'm': write MODEL=TOKENS, e.g. --context-window openai/my-vllm-model=32768"),
    ]:
        with pytest.raises(ConfigError) as refused:
            _rlm_from_args(parser.parse_args([*given[:2], "--context-window", bad]), print)
        assert str(refused.value).startswith(said) and "\n" not in str(refused.value)
    assert _parser().parse_args(["serve", "--context-window", "m=9"]).context_windows == ["m=9"]

    # the window reaches the run: the root's first call cannot fit, nothing is sent
    (tmp_path / "notes.txt").write_text("some notes")
    run = subprocess.run(
        [sys.executable, "-m", "recursa.cli", "run", "q", "--context", str(tmp_path / "notes.txt"),
         "--model", "scripted/gpt5-like", "--context-window", "scripted/gpt5-like=1500",
         "--max-output-tokens", "500", "--trace-dir", str(tmp_path), "--json"],
        capture_output=True, text=True, env=_env(), timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    result = json.loads(run.stdout)
    assert result["stop_reason"] == "context_window" and result["usage"]["llm_calls"] == 0
