"""Training data from traces: SFT and step-wise RL rows, their filters, fixes and arithmetic, the CLI,
call attribution headers, sampling settings and token data, and one CPU training step per format.

Real traces come from real RLM runs (scripted models, real REPL, real children); hand-built traces
add the cases with known outcomes (each protocol slip, crashed and old-format runs)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from recursa import RLM
from recursa.cli import main
from recursa.scripted import get_policy
from recursa.tasks import generate
from recursa.testing.fake_server import ScriptedResponder
from recursa.trace import RunNode, load
from recursa.train import ExportError, export_rl, export_sft, rl_rows, sft_rows
from recursa.train import fixes as fx
from recursa.train.fixes import fix_reply, looks_like_plan
from recursa.train.rl import child_weights, grpo_advantages
from recursa.train.sft import DROP_ONE_TURN, DROP_ZERO
from recursa.train.source import (
    SKIP_BASELINE,
    SKIP_DUPLICATE,
    SKIP_NEWER,
    SKIP_NOT_TRACE,
    SKIP_OLDER,
    SKIP_UNFINISHED,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "training"

# -- real rollouts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bench-like folder: traces/ and results.jsonl, from real recursive RLM runs.

    Two OOLONG tasks, three samples each at different sub-model label noise (so rewards differ),
    with child RLMs (depth 2); one needle task sampled twice (both right: a zero-variance group).
    """
    out = tmp_path_factory.mktemp("bench")
    rows = []
    plan = [("oolong", 5, (0.0, 0.2, 0.5)), ("oolong", 6, (0.0, 0.3, 0.6)), ("niah", 1, (0.0, 0.0))]
    for family, seed, noises in plan:
        task = generate(family, 16_000, seed=seed)
        for sample, noise in enumerate(noises):
            rlm = RLM(
                "scripted/gpt5-like:recurse=1,batch=60",
                sub_model=f"scripted/gpt5-like:noise={noise},seed={sample}",
                max_depth=2,
                trace_dir=out / "traces",
            )
            result = rlm.run(task.question, task.context)
            assert result.stop_reason == "final", result.error
            rows.append(
                {
                    "task_id": task.id,
                    "family": family,
                    "method": "rlm",
                    "trace_path": str(result.trace_path.relative_to(out)),
                    "score": task.score(result.answer),
                }
            )
    # A baseline row with no trace, as a benchmark writes for methods without one: ignored.
    rows.append({"task_id": "oolong-16000-s5", "method": "base", "trace_path": None, "score": 0.0})
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def bench_scores(bench: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (bench / "results.jsonl").read_text().splitlines()][:-1]


def test_bench_rollouts_have_varied_rewards_and_child_runs(bench):
    scores = bench_scores(bench)
    by_task = defaultdict(set)
    for row in scores:
        by_task[row["task_id"]].add(round(row["score"], 6))
    assert len(by_task["oolong-16000-s5"]) > 1 and len(by_task["oolong-16000-s6"]) > 1
    assert by_task["niah-16000-s1"] == {1.0}
    trees = [load(bench / row["trace_path"]).root for row in scores]
    assert all(t.children for t in trees if t.question.startswith("The context lists"))


def test_sft_rows_are_the_exact_prompts_the_model_saw(server, script, tmp_path):
    """The rebuilt prompt of every turn equals the messages the server received for that call."""
    script.root(
        "root-model",
        "Peek first.\n```repl\nhead = context[:5]\nprint(head)\n```",
        "Count.\n```repl\nn = len(context)\nprint(n)\n```",
        "FINAL(11 characters)",
    )
    result = RLM(
        "openai/root-model", base_url=server.base_url, api_key="k" * 12, trace_dir=tmp_path / "t"
    ).run("How long is it?", "hello world")
    assert result.iterations == 3
    rows, report = sft_rows([tmp_path / "t"], scores={result.run_id: 1.0})
    assert report.rows == 3 and not report.skipped and not report.dropped
    seen = [r.messages for r in server.requests]
    assert [row["prompt"] for row in rows] == seen
    assert rows[0]["prompt"][0]["role"] == "system" and "How long is it?" in rows[0]["prompt"][1]["content"]
    assert [row["completion"][0]["content"] for row in rows] == [r.reply for r in server.requests]
    assert [row["metadata"]["turn"] for row in rows] == [1, 2, 3]


def test_sft_from_a_bench_folder_applies_the_papers_filters(bench, tmp_path):
    scores = bench_scores(bench)
    report = export_sft([bench], tmp_path / "sft.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert report.rows == len(rows) > 0 and report.traces == report.runs == len(scores)
    zero = sum(1 for r in scores if r["score"] == 0)
    assert report.dropped.get(DROP_ZERO, 0) == zero
    assert {r["metadata"]["depth"] for r in rows} == {0}
    for row in rows:
        meta = row["metadata"]
        assert meta["score"] > 0 and meta["task_id"] and meta["method"] == "rlm"
        assert set(meta) >= {"run_id", "task_id", "turn", "depth", "score"}
        assert row["completion"][0]["role"] == "assistant"
        assert all(set(m) == {"role", "content"} for m in row["prompt"])
    # Stricter score, children, a size limit: each shows in the rows.
    strict, _ = sft_rows([bench], min_score=0.9)
    assert 0 < len(strict) < len(rows) and all(r["metadata"]["score"] >= 0.9 for r in strict)
    with_children, _ = sft_rows([bench], include_children=True)
    assert {r["metadata"]["depth"] for r in with_children} == {0, 1}
    small, small_report = sft_rows([bench], max_chars=5_000)
    assert len(small) < len(rows) and any("over 5,000 characters" in k for k in small_report.dropped)
    assert all(len(json.dumps(r["prompt"])) < 6_000 for r in small)


def test_sft_rows_train_a_step_in_trl_sft_trainer(bench, tmp_path):
    """TRL's own SFTTrainer reads the rows as they are (metadata column included) and trains a step."""
    export_sft([bench], tmp_path / "sft.jsonl", include_children=True)
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "sft.jsonl"), split="train")
    assert {"prompt", "completion", "metadata"} <= set(ds.column_names)
    assert trl.data_utils.is_conversational(ds[0])
    # A byte-level tokenizer and a tiny random model, both made here: nothing is downloaded.
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        ["x"],
        tokenizers.trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=alphabet, special_tokens=["<pad>", "<eos>"]
        ),
    )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<eos>{% else %}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=1,
        per_device_train_batch_size=2,
        max_length=4_608,  # first turns (system prompt, question): about 4,000 byte-level tokens
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    sizes = [sum(len(m["content"]) for m in r["prompt"] + r["completion"]) for r in ds]
    shortest = sorted(range(len(ds)), key=sizes.__getitem__)[:2]
    trainer = trl.SFTTrainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=ds.select(shortest),
        processing_class=tok,
    )
    out = trainer.train()
    assert out.global_step == 1 and math.isfinite(out.training_loss)


# -- hand-built traces with known outcomes -------------------------------------------------------


class HandTrace:
    """Writes trace events the way the engine does (run_start, turn, lm_call, exec, run_end)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"seq": len(self.events) + 1, "ts": 0.0, "type": kind, **fields})

    def run(
        self,
        run_id: str,
        turns: list[tuple[str, str | None]],
        *,
        parent: str | None = None,
        depth: int = 0,
        question: str = "What is the answer?",
        end: bool = True,
        fmt: int | None = 1,
        history: bool = True,
        **start_fields: Any,
    ) -> HandTrace:
        start = ({"format": fmt} if fmt is not None else {}) | start_fields
        ctx = {"type": "str", "total_chars": 100, "sha256": "c0ffee", "prefix": "..."}
        self.emit(
            "run_start",
            **start,
            run_id=run_id,
            parent_run_id=parent,
            depth=depth,
            question=question,
            context=ctx,
        )
        feedback = None
        for k, (reply, code) in enumerate(turns, 1):
            self.emit("turn", run_id=run_id, turn=k)
            new = (
                [{"role": "system", "content": "You are an RLM."}, {"role": "user", "content": question}]
                if k == 1
                else [{"role": "user", "content": feedback}]
            )
            call = {"run_id": run_id, "call_id": f"{run_id}.c{k}", "parent_id": parent, "depth": depth}
            call |= {"purpose": "root", "model": "openai/m", "response": reply}
            if history:
                call["new_messages"] = new
            self.emit("lm_call", **call)
            if code is not None:
                self.emit("exec", run_id=run_id, turn=k, block=1, code=code, stdout="ok\n", stderr="")
            feedback = f"REPL output:\nok (turn {k})"
        if end:
            self.emit(
                "run_end", run_id=run_id, depth=depth, stop_reason="final", answer="42", iterations=len(turns)
            )
        return self

    def write(self, path: Path, cut_last_line: bool = False) -> Path:
        text = "".join(json.dumps(e) + "\n" for e in self.events)
        if cut_last_line:
            text = text[: len(text) - 20]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path


PEEK = ("Let me look.\n```repl\nresult = 6 * 7\nprint(result)\n```", "result = 6 * 7\nprint(result)")


def hand_corpus(folder: Path) -> Path:
    """One trace per case, and a scores file; returns the scores file."""
    HandTrace().run("r_good", [PEEK, ("It is computed.\nFINAL(result)", None)]).write(folder / "good.jsonl")
    HandTrace().run("r_zero", [PEEK, ("FINAL(41)", None)]).write(folder / "zero.jsonl")
    HandTrace().run("r_one", [("FINAL(42)", None)]).write(folder / "one.jsonl")
    HandTrace().run("r_value", [PEEK, ("So:\nFINAL_VAR(The answer is 42)", None)]).write(
        folder / "value.jsonl"
    )
    HandTrace().run("r_block", [PEEK, ("Answer:\n```repl\nFINAL(The answer is 42)\n```", None)]).write(
        folder / "block.jsonl"
    )
    plan = "Plan.\n```repl\nx = 1\n```\nFINAL(I will first chunk the context, then ask llm_query about each chunk.)"
    HandTrace().run("r_plan", [(plan, "x = 1"), ("FINAL(42)", None)]).write(folder / "plan.jsonl")
    HandTrace().run("r_long", [PEEK, ("FINAL(" + "7" * 3_000 + ")", None)]).write(folder / "long.jsonl")
    HandTrace().run("r_unscored", [PEEK, ("FINAL(42)", None)]).write(folder / "unscored.jsonl")
    HandTrace().run("r_null", [PEEK, ("FINAL(42)", None)]).write(folder / "null.jsonl")
    crashed = HandTrace().run("r_crashed", [PEEK, ("FINAL(42)", None)], end=False)
    crashed.emit("lm_call", run_id="r_crashed", purpose="root", response="half a line that never ended")
    crashed.write(folder / "crashed.jsonl", cut_last_line=True)
    HandTrace().run("r_old", [PEEK, ("FINAL(42)", None)], fmt=None, history=False).write(folder / "old.jsonl")
    HandTrace().run("r_newer", [PEEK, ("FINAL(42)", None)], fmt=99).write(folder / "newer.jsonl")
    HandTrace().run("r_base", [PEEK, ("FINAL(42)", None)], method="codeact").write(folder / "base.jsonl")
    (folder / "notes.jsonl").write_text('{"note": "not a trace"}\n')
    ids = ["r_good", "r_value", "r_block", "r_plan", "r_long", "r_crashed", "r_old", "r_newer", "r_base"]
    rows = [{"run_id": i, "task_id": i, "score": 1.0} for i in ids]
    # Written from another working directory: found by the file name, which holds the run id.
    rows += [{"trace_path": "elsewhere/traces/one.jsonl", "task_id": "o", "score": 1.0}]
    rows += [{"trace_path": "traces/zero.jsonl", "task_id": "z", "score": 0.0}]  # matched by path
    rows += [{"run_id": "r_null", "score": None}]
    scores = folder.parent / "my-scores.jsonl"
    scores.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return scores


def test_filters_and_fixes_on_hand_built_traces(tmp_path):
    scores = hand_corpus(tmp_path / "traces")
    rows, report = sft_rows([tmp_path / "traces"], scores=scores, max_chars=2_000)
    by_run = defaultdict(list)
    for row in rows:
        by_run[row["metadata"]["run_id"]].append(row)
    assert sorted(by_run) == ["r_block", "r_good", "r_long", "r_plan", "r_value"]
    last = {run: rs[-1]["completion"][0]["content"] for run, rs in by_run.items()}
    assert last["r_good"] == "It is computed.\nFINAL_VAR(result)"
    assert last["r_value"] == "So:\nFINAL(The answer is 42)"
    assert last["r_block"] == "Answer:\nFINAL(The answer is 42)"
    assert [r["metadata"]["turn"] for r in by_run["r_plan"]] == [2]  # the plan turn is gone
    assert [r["metadata"]["turn"] for r in by_run["r_long"]] == [1]  # the 3,000-character turn is gone
    assert by_run["r_good"][-1]["metadata"]["fixes"] == [fx.FIX_FINAL_FOR_VAR]
    assert report.fixes == {fx.FIX_FINAL_FOR_VAR: 1, fx.FIX_FINAL_VAR_OF_VALUE: 1, fx.FIX_ANSWER_IN_CODE: 1}
    assert report.dropped == {
        DROP_ZERO: 1,
        DROP_ONE_TURN: 1,
        fx.DROP_PLAN: 1,
        "turns over 2,000 characters (prompt + reply)": 1,
    }
    no_score = "runs without a score (no row for them in the scores, or score null)"
    assert report.skipped == {
        no_score: 2,
        SKIP_UNFINISHED: 1,
        SKIP_OLDER: 1,
        SKIP_NEWER: 1,
        SKIP_NOT_TRACE: 1,
        SKIP_BASELINE: 1,
    }
    assert report.traces == 13 and report.runs == 13 and report.runs_used == 5
    text = str(report)
    assert "crashed.jsonl" in text and "old.jsonl" in text and "notes.jsonl" in text
    # Without fixes the replies are exported as written, and the plan turn stays.
    raw, raw_report = sft_rows([tmp_path / "traces"], scores=scores, max_chars=2_000, fixes=False)
    assert not raw_report.fixes and len(raw) == len(rows) + 1
    assert any(r["completion"][0]["content"].endswith("FINAL(result)") for r in raw)


@pytest.mark.parametrize(
    ("reply", "names", "fixed", "fix"),
    [
        ("FINAL(result)", {"result"}, "FINAL_VAR(result)", fx.FIX_FINAL_FOR_VAR),
        ("FINAL(Paris)", {"result"}, "FINAL(Paris)", None),  # not a variable: a literal answer
        ('FINAL_VAR("42")', set(), "FINAL(42)", fx.FIX_FINAL_VAR_OF_VALUE),
        ("FINAL_VAR(result)", {"result"}, "FINAL_VAR(result)", None),
        (
            "```repl\nx = 2\nFINAL('x')\n```",
            set(),
            '```repl\nx = 2\nFINAL_VAR("x")\n```',
            fx.FIX_FINAL_FOR_VAR,
        ),
        (
            "```repl\nFINAL_VAR('The answer is 42')\n```",
            set(),
            "```repl\nFINAL('The answer is 42')\n```",
            fx.FIX_FINAL_VAR_OF_VALUE,
        ),
        (
            "```repl\nFINAL_VAR(total)\n```",
            {"total"},
            '```repl\nFINAL_VAR("total")\n```',
            fx.FIX_FINAL_VAR_OF_VALUE,
        ),
        ("```\nFINAL(42)\n```", set(), "FINAL(42)", fx.FIX_ANSWER_IN_CODE),
        ("```repl\nFINAL(42)\n```", set(), "```repl\nFINAL(42)\n```", None),  # valid code: it ran
        ("```repl\nFINAL(x)\nprint(y)\n```", set(), "```repl\nFINAL(x)\nprint(y)\n```", None),
        (  # fences read as the engine reads them: a fence inside a string is part of the code
            '```repl\np = """Reply as:\n```json\n{}\n```\n"""\nx = 2\nFINAL(\'x\')\n```',
            set(),
            '```repl\np = """Reply as:\n```json\n{}\n```\n"""\nx = 2\nFINAL_VAR("x")\n```',
            fx.FIX_FINAL_FOR_VAR,
        ),
        (  # a doubled opener
            "```\n```python\ntotal = 1\nFINAL_VAR(total)\n```",
            {"total"},
            '```\n```python\ntotal = 1\nFINAL_VAR("total")\n```',
            fx.FIX_FINAL_VAR_OF_VALUE,
        ),
    ],
)
def test_each_fix(reply, names, fixed, fix):
    result = fix_reply(reply, names)
    assert result.text == fixed
    assert result.fixes == ([fix] if fix else [])
    assert result.drop is None


def test_plan_detection():
    plans = [
        "I will first look at the context and then count the labels.",
        "Let me chunk the context into pieces",
        "First, split the context; then call llm_query on each piece and finally aggregate.",
        "Plan: peek, chunk, query, aggregate",
    ]
    answers = [
        "42",
        "Label: location",
        "The most common label is entity, then location.",
        "First place: Alice",
    ]
    assert all(looks_like_plan(p) for p in plans)
    assert not any(looks_like_plan(a) for a in answers)
    assert fix_reply("Ok.\nFINAL(I will look at the data first.)").drop == fx.DROP_PLAN


# -- RL: advantages, inheritance, weights -------------------------------------------------------


def tree_corpus(folder: Path) -> Path:
    """Task t: R1 (score 1.0) with children C1, C2, C3 and a grandchild G under C1; R2 (0.5); R3 (0.0).
    Task u: U1 alone. Task v: V1 and V2, both 1.0 (zero variance)."""
    t = HandTrace().run("R1", [PEEK, ("FINAL(42)", None)])
    t.run("C1", [PEEK, ("FINAL(a)", None)], parent="R1", depth=1)
    t.run("G", [PEEK, ("FINAL(b)", None)], parent="C1", depth=2)
    t.run("C2", [("FINAL(c)", None)], parent="R1", depth=1)
    t.run("C3", [PEEK, ("FINAL(d)", None)], parent="R1", depth=1)
    t.write(folder / "R1.jsonl")
    for run_id in ("R2", "R3", "U1", "V1", "V2"):
        HandTrace().run(run_id, [PEEK, ("FINAL(42)", None)]).write(folder / f"{run_id}.jsonl")
    scores = {
        "R1": ("t", 1.0),
        "R2": ("t", 0.5),
        "R3": ("t", 0.0),
        "U1": ("u", 0.3),
        "V1": ("v", 1.0),
        "V2": ("v", 1.0),
    }
    path = folder / "results.jsonl"
    path.write_text(
        "".join(json.dumps({"run_id": r, "task_id": t, "score": s}) + "\n" for r, (t, s) in scores.items())
    )
    return path


def test_advantages_inheritance_and_weights_on_a_hand_computed_tree(tmp_path):
    tree_corpus(tmp_path)
    rows, report = rl_rows([tmp_path], child_weight="1/k")
    a1 = (1.0 - 0.5) / (0.5 + 1e-4)  # rewards 1, 0.5, 0: mean 0.5, sample std 0.5
    by_run = defaultdict(list)
    for row in rows:
        by_run[row["run_id"]].append(row)
    r1_rows = [r for r in rows if r["trajectory_id"] == "R1"]
    assert {r["run_id"] for r in r1_rows} == {"R1", "C1", "C2", "C3", "G"}
    assert all(math.isclose(r["advantage"], a1) for r in r1_rows)
    assert all(r["advantage"] == 0.0 for r in by_run["R2"])
    assert all(math.isclose(r["advantage"], -a1) for r in by_run["R3"])
    weights = {run: {r["weight"] for r in rs} for run, rs in by_run.items()}
    assert weights["R1"] == {1.0} and weights["G"] == {1 / 3}
    assert weights["C1"] == weights["C2"] == weights["C3"] == {1 / 3}
    # Reward only on the root's last step; last steps marked per run; steps counted per run.
    assert [(r["step"], r["is_last_step"], r["reward"]) for r in by_run["R1"]] == [
        (0, False, 0.0),
        (1, True, 1.0),
    ]
    assert [(r["step"], r["is_last_step"], r["reward"]) for r in by_run["G"]] == [
        (0, False, 0.0),
        (1, True, 0.0),
    ]
    assert [r["depth"] for r in by_run["G"]] == [2, 2]
    assert all(
        r["trajectory_reward"] == 1.0 and r["group_id"] == "t" and r["group_size"] == 3 for r in r1_rows
    )
    # The single-run group and the all-equal group: advantage 0, flagged, and said so.
    assert all(
        r["group_zero_variance"] and r["advantage"] == 0.0 for r in by_run["U1"] + by_run["V1"] + by_run["V2"]
    )
    assert report.groups == {"groups": 3, "zero_variance": 2, "singletons": 1, "mean_size": 2.0}
    assert any("single run" in note for note in report.notes)
    # inherit: weight 1 everywhere; --drop-zero-variance leaves U and V out and counts them.
    inherit, _ = rl_rows([tmp_path])
    assert {r["weight"] for r in inherit} == {1.0}
    kept, dropped = rl_rows([tmp_path], drop_zero_variance=True)
    assert {r["trajectory_id"] for r in kept} == {"R1", "R2", "R3"}
    assert sum(dropped.dropped.values()) == 3
    # A copy of a trace elsewhere in the inputs is one run, not two samples of the task.
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "R2.jsonl").write_text((tmp_path / "R2.jsonl").read_text())
    again, again_report = rl_rows([tmp_path], child_weight="1/k")
    assert again == rows and again_report.skipped == {SKIP_DUPLICATE: 1}


def test_grpo_advantages_and_recursive_one_over_k():
    values, zero = grpo_advantages([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    assert not zero and all(
        math.isclose(v, s * 0.5 / (std + 1e-4)) for v, s in zip(values, [1, -1, -1, 1], strict=True)
    )
    assert math.isclose(sum(values), 0.0, abs_tol=1e-12)
    assert grpo_advantages([0.7]) == ([0.0], True) and grpo_advantages([0.2, 0.2]) == ([0.0, 0.0], True)

    def node(run_id: str, *children: RunNode) -> RunNode:
        return RunNode(run_id, None, 0, {}, children=list(children))

    root = node("R", node("A", node("A1"), node("A2")), node("B"), node("C", node("C1", node("C1x"))))
    w = child_weights(root, "1/k")
    assert w["R"] == 1.0 and w["A"] == w["B"] == w["C"] == pytest.approx(1 / 3)
    assert w["A1"] == w["A2"] == pytest.approx(1 / 6)
    assert w["C1"] == w["C1x"] == pytest.approx(1 / 3)
    assert set(child_weights(root).values()) == {1.0}


def test_rl_rows_from_real_runs(bench, tmp_path):
    report = export_rl([bench], tmp_path / "steps.jsonl", child_weight="1/k")
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    scores = {row["trace_path"]: row["score"] for row in bench_scores(bench)}
    assert report.rows == len(rows) and report.runs_used == len(scores)
    assert report.groups["groups"] == 3 and report.groups["zero_variance"] == 1  # the needle task
    by_traj = defaultdict(list)
    for row in rows:
        by_traj[row["trajectory_id"]].append(row)
        assert row["group_id"] == f"{row['task_id']}/rlm"  # one task, one method
    roots = {}
    for traj, rs in by_traj.items():
        assert len({r["advantage"] for r in rs}) == 1  # every descendant carries the root's advantage
        root_rows = [r for r in rs if r["run_id"] == traj]
        assert [r["reward"] for r in root_rows][-1] == rs[0]["trajectory_reward"]
        assert all(r["reward"] == 0.0 for r in rs if r is not root_rows[-1])
        roots[traj] = rs[0]
        children = {r["run_id"] for r in rs if r["depth"] == 1}
        if children:
            assert all(math.isclose(r["weight"], 1 / len(children)) for r in rs if r["depth"] == 1)
    for group in {r["group_id"] for r in roots.values()}:
        members = [r for r in roots.values() if r["group_id"] == group]
        assert math.isclose(sum(r["advantage"] for r in members), 0.0, abs_tol=1e-9)
        if len({r["trajectory_reward"] for r in members}) > 1:
            best = max(members, key=lambda r: r["trajectory_reward"])
            assert best["advantage"] > 0 and not best["group_zero_variance"]


def test_rl_rows_load_with_hugging_face_datasets(bench, tmp_path):
    report = export_rl([bench], tmp_path / "steps.jsonl", child_weight="1/k", include_subcalls=True)
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "steps.jsonl"), split="train")
    assert len(ds) == report.rows and {"prompt", "response", "advantage", "weight"} <= set(ds.column_names)
    assert set(ds["purpose"]) == {"root", "sub"}


# -- the command line ------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exports_and_prints_the_report(bench, tmp_path, capsys):
    code, out, err = run_cli(
        capsys, "export", "sft", str(bench), "-o", str(tmp_path / "a.jsonl"), "--include-children"
    )
    assert code == 0, err
    assert "wrote" in out and "row(s)" in out and (tmp_path / "a.jsonl").stat().st_size > 0
    code, out, _ = run_cli(
        capsys, "export", "rl", str(bench), "-o", str(tmp_path / "b.jsonl"), "--child-weight", "1/k", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["kind"] == "rl" and report["rows"] > 0 and report["groups"]["groups"] == 3


def test_cli_user_scores_by_trace_path(tmp_path, capsys):
    scores = hand_corpus(tmp_path / "traces")
    code, out, _ = run_cli(
        capsys,
        "export",
        "sft",
        str(tmp_path / "traces"),
        "-o",
        str(tmp_path / "o.jsonl"),
        "--scores",
        str(scores),
    )
    assert code == 0
    assert "runs that scored 0" in out and "FINAL(name) of a REPL variable" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sft", "{tmp}/missing.jsonl"], "no such file or folder"),
        (["sft", "{tmp}/notes.txt"], "is not a recursa trace"),
        (["sft", "{tmp}/good.jsonl"], "no scores for these traces"),
        (["rl", "{tmp}/good.jsonl", "--scores", "{tmp}/bad-scores.jsonl"], "bad-scores.jsonl:2 is not JSON"),
        (["rl", "{tmp}/good.jsonl", "--scores", "{tmp}/missing-scores.jsonl"], "no such scores file"),
        (["sft", "{tmp}/empty"], "no trace files"),
        (["sft", "{tmp}/good.jsonl", "--scores", "{tmp}/s.jsonl", "-o", "{tmp}"], "is a folder"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    HandTrace().run("r_good", [PEEK, ("FINAL(42)", None)]).write(tmp_path / "good.jsonl")
    (tmp_path / "notes.txt").write_text("just some notes\n")
    (tmp_path / "bad-scores.jsonl").write_text('{"run_id": "r_good", "score": 1}\n{oops\n')
    (tmp_path / "s.jsonl").write_text('{"run_id": "r_good", "score": 1}\n')
    (tmp_path / "empty").mkdir()
    argv = ["export", *(a.format(tmp=tmp_path) for a in args)]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out.jsonl")]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_python_api_bad_input_raises_export_error(tmp_path):
    with pytest.raises(ExportError, match="no such file"):
        export_sft([tmp_path / "nope"], tmp_path / "o.jsonl")
    HandTrace().run("x", [PEEK, ("FINAL(1)", None)]).write(tmp_path / "x.jsonl")
    with pytest.raises(ExportError, match="score must be a finite number"):
        sft_rows([tmp_path / "x.jsonl"], scores={"x": float("nan")})
    with pytest.raises(ExportError, match="child weight"):
        rl_rows([tmp_path / "x.jsonl"], scores={"x": 1.0}, child_weight="half")


# -- call attribution, sampling settings, token data ----------------------------------------------


def test_attribution_headers_let_a_trainer_rebuild_the_call_tree(server, tmp_path):
    server.holder["responder"] = ScriptedResponder()
    server.reset()
    server.latency_s = 0.0
    task = generate("oolong", 16_000, seed=1)
    rlm = RLM(
        "openai/gpt5-like:recurse=1,batch=30",
        sub_model="openai/gpt5-like:recurse=1,batch=50",
        base_url=server.base_url,
        api_key="k" * 12,
        trace_dir=tmp_path,
        max_depth=3,
        call_headers=True,  # attribution headers are opt-in
    )
    result = rlm.run(task.question, task.context)
    trace = load(result.trace_path)
    assert max(n.depth for n in trace.runs.values()) == 2  # root, children, grandchildren
    # What a trainer behind the base URL sees: headers only.
    parent_of: dict[str, str | None] = {}
    calls: dict[str, tuple[str, int]] = {}
    for rec in server.requests:
        h = rec.rlm_headers
        run, parent, depth = h["x-rlm-run-id"], h.get("x-rlm-parent-id"), int(h["x-rlm-depth"])
        calls[h["x-rlm-call-id"]] = (run, depth)
        if parent != run:  # a run's own turn (a sub-call names its caller as both run and parent)
            parent_of[run] = parent

    def trajectory(run: str) -> str:
        while parent_of[run] is not None:
            run = parent_of[run]
        return run

    assert parent_of == {rid: node.parent_run_id for rid, node in trace.runs.items()}
    assert {trajectory(r) for r in parent_of} == {result.run_id}
    events = [e for e in trace.events if e["type"] == "lm_call"]
    assert len(events) == len(server.requests)
    assert all(calls[e["call_id"]] == (e["run_id"], e["depth"]) for e in events)
    # Off when asked.
    server.reset()
    RLM(
        "openai/gpt5-like", base_url=server.base_url, api_key="k" * 12, trace_dir=tmp_path, call_headers=False
    ).run(generate("niah", 8_000, seed=1).question, generate("niah", 8_000, seed=1).context)
    assert server.requests and all(not rec.rlm_headers for rec in server.requests)


class _VLLMLike(BaseHTTPRequestHandler):
    """A tiny OpenAI-compatible server that returns log-probs and token ids the way vLLM does."""

    seen: list[tuple[dict[str, str], dict[str, Any]]]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
        text = get_policy(body["model"])(body["messages"])
        ids = list(text.encode("utf-8"))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        if body.get("logprobs"):
            as_ids = body.get("return_tokens_as_token_ids")
            choice["logprobs"] = {
                "content": [{"token": f"token_id:{i}" if as_ids else chr(i), "logprob": -0.25} for i in ids]
            }
        resp: dict[str, Any] = {
            "id": "c",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [choice],
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            resp["prompt_token_ids"] = [1, 2, 3]
        resp["usage"] = {"prompt_tokens": 10, "completion_tokens": len(ids), "total_tokens": 10 + len(ids)}
        payload = json.dumps(resp).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        return None


def test_sampling_settings_per_role_and_token_data_reach_the_rows(tmp_path):
    seen: list[tuple[dict[str, str], dict[str, Any]]] = []
    handler = type("Handler", (_VLLMLike,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        task = generate("oolong", 16_000, seed=2)
        sampling = {
            "root": {"temperature": 1.0, "seed": 11, "logprobs": True, "return_tokens_as_token_ids": True},
            "child": {"temperature": 0.7, "return_token_ids": True},
            "sub": {"temperature": 0.0},
        }
        result = RLM(
            "openai/gpt5-like:recurse=1,batch=60",
            sub_model="openai/gpt5-like",
            base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1",
            trace_dir=tmp_path,
            max_depth=2,
            sampling=sampling,
            call_headers=True,
        ).run(task.question, task.context)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert result.stop_reason == "final"
    roles = defaultdict(list)
    for headers, body in seen:
        depth, run, parent = (
            int(headers["x-rlm-depth"]),
            headers["x-rlm-run-id"],
            headers.get("x-rlm-parent-id"),
        )
        role = "sub" if parent == run else ("root" if depth == 0 else "child")
        roles[role].append({k: body.get(k) for k in ("temperature", "seed", "logprobs", "return_token_ids")})
    assert roles["root"] and all(
        b == {"temperature": 1.0, "seed": 11, "logprobs": True, "return_token_ids": None}
        for b in roles["root"]
    )
    assert roles["child"] and all(b["temperature"] == 0.7 and b["return_token_ids"] for b in roles["child"])
    assert roles["sub"] and all(
        b == {"temperature": 0.0, "seed": None, "logprobs": None, "return_token_ids": None}
        for b in roles["sub"]
    )
    rows, _ = rl_rows([tmp_path], scores={result.run_id: 1.0}, include_subcalls=True)
    root_rows = [r for r in rows if r["depth"] == 0]
    child_rows = [r for r in rows if r["depth"] == 1 and r["purpose"] != "sub"]
    for row in root_rows:
        assert row["response_token_ids"] == list(row["response"].encode("utf-8"))
        assert (
            row["response_logprobs"] == [-0.25] * len(row["response_token_ids"]) and row["temperature"] == 1.0
        )
    for row in child_rows:
        assert row["response_token_ids"] == list(row["response"].encode("utf-8"))
        assert row["prompt_token_ids"] == [1, 2, 3] and row["response_logprobs"] is None
    assert any(r["purpose"] == "sub" and r["temperature"] == 0.0 for r in rows)


@pytest.mark.parametrize(
    ("choice", "resp", "expected"),
    [
        (
            {"logprobs": {"content": [{"token": "token_id:5", "logprob": -1}]}},
            {},
            {"logprobs": [-1.0], "token_ids": [5]},
        ),
        ({"logprobs": {"content": [{"token": "a", "logprob": None}]}}, {}, {}),  # malformed: ignored
        (
            {"logprobs": None, "token_ids": [1, 2]},
            {"prompt_token_ids": [9]},
            {"token_ids": [1, 2], "prompt_token_ids": [9]},
        ),
        ({"token_ids": "1,2"}, {"prompt_token_ids": []}, {}),
    ],
)
def test_token_data_is_read_when_present_and_never_an_error(choice, resp, expected):
    from recursa.lm.openai_client import _token_data

    assert _token_data(resp, choice) == expected


def test_sampling_settings_are_validated():
    from recursa.errors import ConfigError

    with pytest.raises(ConfigError, match="roles: root, child, sub"):
        RLM("scripted/gpt5-like", sampling={"teacher": {"temperature": 1.0}})


# -- the worked example: one CPU training step per format ------------------------------------------


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"training_example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_one_cpu_training_step_per_format(bench, tmp_path):
    pytest.importorskip("torch")
    steps = _example("train_step")
    export_sft([bench], tmp_path / "sft.jsonl", include_children=True)
    export_rl([bench], tmp_path / "steps.jsonl", child_weight="1/k")
    sft = steps.sft_step(steps.read_jsonl(tmp_path / "sft.jsonl"), max_len=256)
    grpo = steps.grpo_step(steps.read_jsonl(tmp_path / "steps.jsonl"), max_len=256)
    for stats in (sft, grpo):
        assert math.isfinite(stats["loss"]) and stats["param_change"] > 0
        assert stats["loss_after"] < stats["loss"]  # the step went downhill on its own batch
    assert sft["rows"] == 8 and grpo["rows"] == 8


def test_hostile_traces_export_what_they_can(tmp_path):
    """A trace is anyone's file: runs nested 3,000 deep overflowed the stack when the RL export
    weighed the tree and when the SFT export walked children (RecursionError), and a turn number
    or an iteration count that is text stopped both exports (ValueError)."""

    def run(run_id, parent, depth):
        head = {
            "type": "run_start",
            "run_id": run_id,
            "parent_run_id": parent,
            "depth": depth,
            "question": "q",
        }
        call = {"type": "lm_call", "run_id": run_id, "purpose": "root", "response": "FINAL(x)"}
        call["new_messages"] = [{"role": "user", "content": "q"}]
        return [head, {"type": "turn", "run_id": run_id, "turn": "one"}, call]

    events = run("R", None, 0)
    for i in range(3000):
        events += run(f"C{i}", "R" if i == 0 else f"C{i - 1}", i + 1)
    end = {"type": "run_end", "stop_reason": "final", "answer": "x", "iterations": "two"}
    events += [{**end, "run_id": f"C{i}"} for i in reversed(range(3000))] + [
        {**end, "run_id": "R", "iterations": 2}
    ]
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    rl, _ = rl_rows([path], scores={"R": 1.0}, child_weight="1/k")
    assert len({row["run_id"] for row in rl}) == 3001
    sft, _ = sft_rows([path], scores={"R": 1.0}, include_children=True)
    assert len({row["metadata"]["run_id"] for row in sft}) == 3001
