"""The scripted personas driving the real loop, the real REPL process and real sub-calls."""

from __future__ import annotations

import pytest

from recursa import RLM
from recursa.tasks import generate
from recursa.trace import load


def solve(model: str, family: str, size: int, tmp_path, seed: int = 1, **kw):
    task = generate(family, size, seed=seed)
    rlm = RLM(model, sub_model=kw.pop("sub_model", "scripted/oracle"), trace_dir=tmp_path, **kw)
    result = rlm.run(task.question, task.context)
    return task, result


@pytest.mark.parametrize("persona", ["gpt5-like", "qwen-coder-like"])
@pytest.mark.parametrize("family", ["niah", "oolong"])
def test_personas_with_sub_calls_solve_both_families(persona, family, tmp_path):
    task, result = solve(f"scripted/{persona}", family, 60_000, tmp_path)
    assert result.stop_reason == "final", result.error
    assert task.score(result.answer) == 1.0, (result.answer, task.gold)
    if family == "oolong":
        assert result.usage.by_model["scripted/oracle"].llm_calls >= 1


def test_persona_call_patterns_differ(tmp_path):
    _, few = solve("scripted/gpt5-like", "oolong", 60_000, tmp_path / "a")
    _, many = solve("scripted/qwen-coder-like", "oolong", 60_000, tmp_path / "b")
    assert many.usage.llm_calls > 5 * few.usage.llm_calls


def test_no_subcalls_persona_never_calls_a_model_below_the_root(tmp_path):
    task, result = solve("scripted/no-subcalls", "niah", 60_000, tmp_path)
    assert task.score(result.answer) == 1.0
    assert set(result.usage.by_model) == {"scripted/no-subcalls"}
    assert result.answer_protocol == "answer"


@pytest.mark.parametrize("fault", ["syntax", "bigprint", "wrong-final", "loop"])
def test_faulty_models_recover_through_the_real_loop(fault, tmp_path):
    task, result = solve(f"scripted/gpt5-like:fault={fault}", "niah", 40_000, tmp_path, exec_timeout=0.5)
    assert task.score(result.answer) == 1.0, (fault, result.answer)
    assert result.iterations >= 3
    execs = load(result.trace_path).root.of_type("exec")
    if fault == "loop":
        assert any(e["timed_out"] for e in execs)
    if fault == "syntax":
        assert any("SyntaxError" in (e["error"] or "") for e in execs)
    if fault == "bigprint":
        assert any(e["omitted_chars"] > 0 for e in execs)


def test_recursive_persona_spawns_children_at_depth_two(tmp_path):
    task, result = solve("scripted/gpt5-like:recurse=1", "oolong", 60_000, tmp_path, max_depth=2)
    assert task.score(result.answer) == 1.0
    root = load(result.trace_path).root
    assert root.children and all(c.depth == 1 and c.stop_reason == "final" for c in root.children)


def test_scripted_models_through_the_real_openai_sdk(server, tmp_path):
    """The same personas behind the fake server: the default responder serves scripted policies."""
    from recursa.testing.fake_server import ScriptedResponder

    server.holder["responder"] = ScriptedResponder()
    server.reset()
    server.latency_s = 0.0
    task = generate("oolong", 80_000, seed=5)
    rlm = RLM(
        "openai/gpt5-like",
        sub_model="openai/oracle",
        base_url=server.base_url,
        api_key="k" * 12,
        trace_dir=tmp_path,
    )
    result = rlm.run(task.question, task.context)
    assert task.score(result.answer) == 1.0
    totals = server.totals()
    assert result.usage.llm_calls == sum(t["requests"] for t in totals.values())
    assert result.usage.input_tokens == sum(t["prompt_tokens"] for t in totals.values())


@pytest.mark.parametrize("persona", ["gpt5-like", "qwen-coder-like"])
def test_the_messy_style_writes_like_real_models_and_still_solves(persona, tmp_path):
    # Seeds shift which form each turn takes, so together these runs use every form messy.py has.
    _, clean = solve(f"scripted/{persona}", "niah", 40_000, tmp_path / "clean")
    replies: list[str] = []
    for seed in range(8):
        task, result = solve(
            f"scripted/{persona}:style=messy,seed={seed}", "niah", 40_000, tmp_path / str(seed)
        )
        assert result.stop_reason == "final" and task.score(result.answer) == 1.0, (seed, result.answer)
        assert result.answer == clean.answer
        calls = load(result.trace_path).root.of_type("lm_call")
        replies += [c["response"] for c in calls if c.get("response")]
    text = "\n".join(replies)
    for form in (
        "```Python",
        "```json",
        "   ```python",
        "```\n```python",
        "Output:\n```",
        "<think>",
        "<|im_end|>",
        "Next I run this code.",
    ):
        assert form in text, form
    if persona == "gpt5-like":  # it answers in prose: the forms without parentheses show up too
        assert any(f in text for f in ("\nFINAL ", "Final Answer: ", "FINAL: ", "FINAL_VAR: "))
        assert any(f in text for f in ("final(", "final_var(", "Final_Var(", "<answer>", "**Answer:**"))
