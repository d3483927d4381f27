"""The benchmark methods end to end through the real loop, sandbox and clients, with scripted models.

The persona expectations of the benchmark hold here at small sizes: the RLM with the oracle
sub-model solves every family; base-llm fails cleanly past its window; no-subcalls loses on
low-cue OOLONG and on OOLONG-Pairs; OOLONG scores fall with oracle label noise exactly as
0.75 ** |error| predicts.
"""

from __future__ import annotations

import asyncio

import pytest

from recursa.methods.base import METHODS, MethodSettings, get_method, model_window
from recursa.scripted.name_options import DEFAULT_WINDOW, Settings
from recursa.scripted.oracle import label_for
from recursa.tasks import families, generate
from recursa.trace import load


def run(
    method: str, task, model: str = "scripted/gpt5-like", sub_model: str | None = "scripted/oracle", **kw
):
    settings = MethodSettings(model=model, sub_model=sub_model, **kw)
    return asyncio.run(get_method(method).run(task, settings))


@pytest.mark.parametrize("family", sorted(families()))
def test_rlm_with_the_oracle_solves_every_family(family: str, tmp_path) -> None:
    task = generate(family, 30_000, seed=2)
    result = run("rlm", task, trace_dir=tmp_path)
    assert result.stop_reason == "final", result.error
    assert task.score(result.answer) == 1.0, (family, result.answer[:300], task.gold[:300])
    assert result.trace_path and result.iterations >= 2


@pytest.mark.parametrize("family", ["oolong-pairs", "multihop-docs", "codeqa", "evidence-spans"])
def test_the_over_calling_persona_also_solves_the_new_families(family: str, tmp_path) -> None:
    task = generate(family, 30_000, seed=5)
    result = run("rlm", task, model="scripted/qwen-coder-like", trace_dir=tmp_path)
    assert task.score(result.answer) == 1.0, (family, result.answer[:200])


def test_base_llm_fails_cleanly_past_its_window_and_reads_within_it(tmp_path) -> None:
    task = generate("niah", 40_000, seed=1)  # about 10K tokens
    small = run("base", task, model="scripted/base-llm:window=4000", sub_model=None, trace_dir=tmp_path)
    assert small.failure == "context_window" and small.answer == "" and "window" in (small.error or "")
    assert small.usage.llm_calls == 0  # the provider refused it: nothing was billed
    big = run("base", task, model="scripted/base-llm:window=20000", sub_model=None, trace_dir=tmp_path)
    assert big.failure is None and task.score(big.answer) == 1.0
    cut = run(
        "base",
        task,
        model="scripted/base-llm:window=4000",
        sub_model=None,
        base_overflow="truncate",
        trace_dir=tmp_path,
    )
    assert cut.failure is None and cut.usage.llm_calls == 1
    assert (
        model_window("scripted/base-llm:window=4000") == 4000 and model_window("openai/gpt-5-mini") == 272_000
    )
    # The baselines fit a scripted model's context to the window the scripted model enforces.
    assert model_window("scripted/base-llm") == DEFAULT_WINDOW


def test_no_subcalls_loses_on_low_cue_oolong_and_on_pairs(tmp_path) -> None:
    oolong_scores, pairs_plain, pairs_rlm = [], [], []
    for seed in range(4):
        task = generate("oolong", 30_000, seed=seed, giveaway=0.0, question="count")
        oolong_scores.append(
            task.score(run("rlm", task, model="scripted/no-subcalls", trace_dir=tmp_path).answer)
        )
        pairs = generate("oolong-pairs", 30_000, seed=seed, query=[2, 12, 16, 20][seed])
        pairs_plain.append(
            pairs.score(run("rlm", pairs, model="scripted/no-subcalls", trace_dir=tmp_path).answer)
        )
        pairs_rlm.append(pairs.score(run("rlm", pairs, trace_dir=tmp_path).answer))
    assert sum(oolong_scores) / 4 < 0.5
    assert sum(pairs_rlm) / 4 == 1.0 and sum(pairs_plain) / 4 < 0.8


def test_oolong_scores_fall_with_label_noise_as_predicted(tmp_path) -> None:
    means = []
    for noise in (0.0, 0.05, 0.2):
        scores = []
        for seed in range(3):
            task = generate("oolong", 20_000, seed=seed, question="count")
            result = run("rlm", task, sub_model=f"scripted/oracle:noise={noise}", trace_dir=tmp_path)
            instances = [line.split("Instance: ", 1)[1] for line in task.context.split("\n")]
            noisy = sum(label_for(i, Settings(noise=noise)) == task.meta["query"]["label"] for i in instances)
            expected = 0.75 ** abs(noisy - int(task.gold))
            assert task.score(result.answer) == pytest.approx(expected), (noise, result.answer, task.gold)
            scores.append(expected)
        means.append(sum(scores) / len(scores))
    assert means[0] == 1.0 and means[0] > means[1] > means[2]


def test_codeact_bm25_searches_the_whole_context(tmp_path) -> None:
    task = generate("niah", 60_000, seed=3)
    result = run("codeact-bm25", task, model="scripted/gpt5-like:window=5000", trace_dir=tmp_path)
    assert task.score(result.answer) == 1.0  # the needle lies past the window; search found it
    events = [e for e in load(result.trace_path).events if e.get("type") == "tool_call"]
    assert events and events[0]["tool"] == "search" and events[0]["where"] == "host"
    assert events[0]["hits"] > 0 and events[0]["error"] is None


def test_codeact_subcalls_and_summary_make_their_calls(tmp_path) -> None:
    task = generate("niah", 40_000, seed=2)
    sub = run("codeact-subcalls", task, trace_dir=tmp_path)
    assert sub.sub_calls >= 1 and sub.usage.by_model["scripted/oracle"].llm_calls == sub.sub_calls
    summary = run("summary", task, model="scripted/gpt5-like:window=26000", trace_dir=tmp_path)
    assert summary.iterations >= 3  # several parts, then the answer from the notes
    assert task.score(summary.answer) == 1.0  # the needle sentence shares the question's words
    plain = run("codeact", task, trace_dir=tmp_path)
    assert plain.iterations == 2 and task.score(plain.answer) == 1.0


def test_rlm_gets_the_task_tools_and_rlm_nosub_makes_no_sub_calls(tmp_path) -> None:
    task = generate("evidence-spans", 40_000, seed=4)
    result = run("rlm", task, trace_dir=tmp_path)
    assert task.score(result.answer) == 1.0
    code = "\n".join(e["code"] for e in load(result.trace_path).root.of_type("exec"))
    assert "search(" in code
    # The tools come as RLM(tools=...): described in the root's system prompt, shipped to the sandbox.
    first = next(e for e in load(result.trace_path).events if e.get("type") == "lm_call")
    system = first["new_messages"][0]["content"]
    assert "`search(query: str, k: int = 10) -> list[tuple[str, str, str]]`" in system
    assert "`list_papers() -> list[tuple[str, str]]`" in system and "runs outside the sandbox" not in system
    nosub = run("rlm-nosub", task, trace_dir=tmp_path)
    assert nosub.sub_calls == 0 and set(nosub.usage.by_model) == {"scripted/gpt5-like"}
    assert 0.0 < task.score(nosub.answer) < 1.0  # names both entities, so it keeps the hard negatives


def test_method_registry() -> None:
    assert set(METHODS) == {
        "base",
        "codeact",
        "codeact-bm25",
        "codeact-subcalls",
        "summary",
        "rlm",
        "rlm-nosub",
        "rlm-tips",
        "rlm-subtools",
    }
    with pytest.raises(ValueError, match="unknown method"):
        get_method("react")
