"""The root prompt: per-family variants chosen from the model name, what the prompt teaches, the
importable modules it states (checked against the sandbox), the question repeated in every
feedback message, and its size."""

from __future__ import annotations

import pytest

from recursa import RLM
from recursa.context import ContextInfo, build_payload
from recursa.lm.tokens import count_tokens
from recursa.loop.importable import modules_line
from recursa.loop.prompts import PromptSettings, family_for, first_message, system_prompt, template_for
from recursa.sandbox import Hardening
from recursa.trace import load


def code(src: str) -> str:
    return f"Running this.\n```repl\n{src}\n```"


def make_rlm(server, tmp_path, model="openai/root-model", **kw) -> RLM:
    return RLM(
        model,
        sub_model="openai/sub-model",
        base_url=server.base_url,
        api_key="test-key-0123456789",
        trace_dir=tmp_path,
        **kw,
    )


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("openai/gpt-5", "default"),
        ("gemini/gemini-2.5-pro", "default"),
        ("openai/Qwen/Qwen3-Coder-480B-A35B-Instruct", "qwen"),
        ("openai/qwen3-30b-a3b", "qwen"),  # 30B total: the "a3b" is the active part of a MoE
        ("openai/Qwen/Qwen3-8B", "small"),
        ("openai/meta-llama/Llama-3.1-8B-Instruct", "small"),
        ("openai/gemma-3-4b-it", "small"),
        ("anthropic/claude-sonnet-4-5", "claude"),
        ("openai/claude-opus-4-1", "claude"),
        ("openai/Mixtral-8x7B", "default"),
        ("scripted/qwen-coder-like", "qwen"),
    ],
)
def test_the_family_variant_is_chosen_from_the_model_name(model, family):
    assert family_for(model) == family


@pytest.mark.parametrize(
    "model",
    [
        "openai/phi-4-mini",
        "openai/microsoft/Phi-3.5-mini-instruct",
        "ollama/phi3:mini",
        "openai/Phi-3-mini-128k-instruct",  # "128k" is a context length, "mini" the size
        "openai/phi4-mini:3.8b",
        "openai/google/gemma-2b-it",
        "ollama/gemma2:2b",
        "openai/gemma-3n-E2B-it",  # Gemma 3n: "E2B", an effective 2B
        "openai/gemma3:270m",
        "openai/meta-llama/Llama-3.2-1B-Instruct",
        "ollama/llama3.2:3b",
        "openai/Qwen/Qwen2.5-0.5B-Instruct",
        "ollama/qwen2.5:1.5b",
        "openai/deepseek-r1-distill-qwen-1.5b",
        "openai/HuggingFaceTB/SmolLM2-135M-Instruct",
        "openai/TinyLlama-1.1B-Chat-v1.0",
        "openai/Qwen2.5-14B-Instruct-1M",  # 14B is the size; "1M" is the context length
    ],
)
def test_small_models_get_the_small_variant(model):
    assert family_for(model) == "small"


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("openai/gpt-4o-mini", "default"),  # hosted models name capable ones "mini" / "nano"
        ("openai/o4-mini", "default"),
        ("openai/gpt-5-nano", "default"),
        ("gemini/gemini-2.0-flash-lite", "default"),
        ("mistral/mistral-small-latest", "default"),
        ("openai/phi-4", "default"),  # 14B, but the name does not say so
        ("openai/Llama-3.3-70B-Instruct", "default"),
        ("openai/Qwen2.5-72B-Instruct", "qwen"),
        ("openai/some-model-1m", "default"),  # a one-digit "m" is a context length, not a size
        ("anthropic/claude-3-5-haiku", "claude"),
    ],
)
def test_larger_and_hosted_models_keep_their_variant(model, family):
    assert family_for(model) == family


def _prompt(model: str, depth: int = 1, info: ContextInfo | None = None) -> str:
    info = info or ContextInfo("str", 1_000, [1_000], [], "x", "0" * 64)
    return system_prompt(template_for(model), info, PromptSettings(depth, 20_000, 500_000))


def test_each_variant_adds_its_own_advice_to_the_default():
    default, qwen, small, claude = (
        _prompt(m) for m in ("x/gpt-5", "x/qwen3-coder", "x/qwen3-8b", "anthropic/claude-sonnet-4-5")
    )
    assert "Never call a model once per line" in qwen and "Never call a model once per line" not in default
    assert "about 200,000 characters" in qwen  # the paper's figure for a 500K-character sub-model
    assert "one ```repl block that does one step" in small and "llm_query_batched(prompts)" in small
    assert "never write the output yourself" in claude
    for variant in (qwen, small, claude):
        assert "never write the output yourself" not in default
        assert variant.startswith(default.split("\nWorking well:")[0])  # the same head as the default


def test_the_prompt_teaches_what_the_paper_prompt_teaches():
    deep = _prompt("x/gpt-5", depth=2)
    assert "Use sub-calls freely for anything that needs understanding" in deep
    assert "`rlm_query` gives a sub-problem to a child" in deep  # when to use which
    assert "llm_query_batched" in deep and "FINAL_VAR(complaints)" in deep  # the worked example
    assert "assign it in a ```repl block first" in deep and "SHOW_VARS()" in deep
    assert "Do the work now" in deep
    assert "respond to the original question" in deep
    one = _prompt("x/gpt-5", depth=1)
    assert "`rlm_query` gives a sub-problem" not in one  # children do not exist at depth 1
    none = _prompt("x/gpt-5", depth=0)
    assert "FINAL_VAR(complaints)" not in none and "llm_query_batched" not in none


def test_the_additions_cost_under_1500_tokens():
    # Before the paper's points were added, the largest default prompt (depth 2, a list of 100
    # pieces) measured 952 tokens with system prompt and first message together.
    info = ContextInfo("list", 5_000_000, [50_000] * 100, [], "x" * 300, "0" * 64)
    for model in ("x/gpt-5", "x/qwen3-coder", "x/qwen3-8b", "anthropic/claude-sonnet-4-5"):
        settings = PromptSettings(2, 20_000, 500_000, modules=modules_line("auto", None))
        total = count_tokens(system_prompt(template_for(model), info, settings))
        total += count_tokens(first_message("Which user asked the most questions?", info))
        assert total < 952 + 1_500, model


def test_the_first_message_lists_piece_lengths_and_says_not_to_answer_yet():
    payload = build_payload([f"document number {i}" for i in range(60)])
    first = first_message("q", payload.info)
    assert "It has 60 elements; their lengths in characters: 17, 17," in first
    assert "do not answer before you have seen what it prints" in first


def test_the_modules_line_follows_the_sandbox():
    assert "do not import them" in modules_line("auto", None)
    assert "do not import them" in modules_line("subprocess", {"hardening": Hardening()})
    allowed = modules_line("subprocess", {"hardening": Hardening(allow_site_packages=True)})
    assert "installed third-party packages" in allowed and "do not import" not in allowed
    assert "installed third-party packages" in modules_line("subprocess", {"hardening": False})
    assert "installed third-party packages" in modules_line("inprocess", None)
    assert "docker image installs them" in modules_line("docker", {})


@pytest.mark.parametrize("allow", [False, True])
def test_what_the_prompt_says_about_imports_is_true_in_the_repl(server, script, tmp_path, allow):
    script.root("root-model", code("import pydantic\nprint('imported')"), "FINAL(done)")
    options = {"hardening": Hardening(allow_site_packages=True)} if allow else None
    make_rlm(server, tmp_path, sandbox="subprocess", sandbox_options=options).run("q", "ctx")
    system = server.requests[0].messages[0]["content"]
    feedback = server.requests[1].messages[-1]["content"]
    if allow:
        assert "installed third-party packages" in system and "imported" in feedback
    else:
        assert "do not import them" in system and "ModuleNotFoundError" in feedback


def test_the_variant_is_recorded_in_the_result_and_trace_and_can_be_overridden(server, script, tmp_path):
    script.root("claude-sonnet-4-5", "FINAL(a)")
    auto = make_rlm(server, tmp_path, model="openai/claude-sonnet-4-5").run("q", "ctx")
    assert auto.prompt_variant == "claude" and auto.to_dict()["prompt_variant"] == "claude"
    assert "never write the output yourself" in server.requests[0].messages[0]["content"]
    start = next(e for e in load(auto.trace_path).events if e["type"] == "run_start")
    assert start["prompt_variant"] == "claude"

    server.reset()
    chosen = make_rlm(server, tmp_path, model="openai/claude-sonnet-4-5", prompt="small").run("q", "ctx")
    assert chosen.prompt_variant == "small"
    system = server.requests[0].messages[0]["content"]
    assert "one ```repl block that does one step" in system and "never write the output" not in system


def test_every_feedback_message_repeats_the_question(server, script, tmp_path):
    script.root("root-model", code("x = 1"), "no code here", code("print(x)"), "FINAL(1)")
    question = "Which of the " + "many " * 200 + "users wrote most?"
    result = make_rlm(server, tmp_path, max_iterations=3).run(question, "ctx")
    assert result.stop_reason == "max_iterations" and result.answer == "1"
    feedbacks = [r.messages[-1]["content"] for r in server.requests[1:]]
    assert len(feedbacks) == 3  # after turns 1 and 2, and the last call's request
    for text in feedbacks:
        reminder = text.split("\n\n(The question you are answering: ")[1]
        assert reminder.startswith("Which of the many many") and reminder.endswith(" ...)")
        assert len(reminder) <= 505
