"""Environment tips: every task family ships strategy text, `rlm-tips` puts it in the root's system
prompt (and `rlm` does not), and the benchmark reports `rlm-tips` as a method of its own."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import recursa.bench as bench
from recursa.methods.base import MethodSettings, get_method
from recursa.tasks import families, generate, get_family


def test_every_family_ships_short_distinct_tips() -> None:
    tips = {name: get_family(name).tips for name in families()}
    assert len(tips) == 7
    for name, text in tips.items():
        assert 100 < len(text) < 600, name  # strategy-level: a few sentences, not a manual
        assert text == text.strip() and "  " not in text, name
    assert len(set(tips.values())) == len(tips)
    assert "count" in tips["oolong"] and "batched sub-calls" in tips["oolong"]
    assert "FINAL_VAR" in tips["verbatim-copy"]


def _root_system_prompts(method: str, family: str, tmp_path: Path) -> tuple[list[str], float]:
    """The system messages the root model was sent in one run of `method`, and the run's score."""
    events: list[dict[str, Any]] = []
    task = generate(family, 8_000, seed=1)
    settings = MethodSettings(
        model="scripted/gpt5-like",
        sub_model="scripted/oracle",
        trace_dir=tmp_path,
        on_event=events.append,
    )
    result = asyncio.run(get_method(method).run(task, settings))
    systems = [
        m["content"]
        for e in events
        if e.get("type") == "lm_call" and e.get("purpose") == "root" and "usage" in e
        for m in e.get("new_messages") or []
        if m.get("role") == "system"
    ]
    return systems, task.score(result.answer)


def test_rlm_tips_puts_the_family_tips_in_the_root_prompt_and_rlm_does_not(tmp_path: Path) -> None:
    for family in ("oolong", "multihop-docs"):
        tips = get_family(family).tips
        with_tips, score = _root_system_prompts("rlm-tips", family, tmp_path)
        assert len(with_tips) == 1 and tips in with_tips[0], family  # sent once: the history is append-only
        assert with_tips[0].index(tips) > with_tips[0].index("context")  # added after the usual prompt
        assert score == 1.0
        plain, score = _root_system_prompts("rlm", family, tmp_path)
        assert len(plain) == 1 and tips not in plain[0] and "Tips for this task" not in plain[0]
        assert score == 1.0
    # Tips are per family: oolong's do not reach a multihop-docs run.
    multihop, _ = _root_system_prompts("rlm-tips", "multihop-docs", tmp_path)
    assert get_family("oolong").tips not in multihop[0]


def test_bench_reports_rlm_tips_as_its_own_method(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = bench.run("niah", sizes="2k", n=1, methods="rlm,rlm-tips", out=out, progress=False)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in rows) == ["rlm", "rlm-tips"]
    assert all(r["status"] == "ok" and r["score"] == 1.0 for r in rows)
    summary = (out / "summary.md").read_text()
    assert "| niah | rlm-tips | 2K | 1 | 1.000 |" in summary and "| niah | rlm | 2K | 1 | 1.000 |" in summary
    assert "| rlm-tips |" in summary.split("## Cost (USD) quantiles per method", 1)[1]
    assert report.mean_score("rlm-tips") == 1.0
    # The tips cost prompt tokens, and the row says so.
    tokens = {r["method"]: r["usage"]["input_tokens"] for r in rows}
    assert tokens["rlm-tips"] > tokens["rlm"]
