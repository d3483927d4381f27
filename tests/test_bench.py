"""`recursa bench` and `recursa.bench.run`: rows, resume, reports, plots, bad input, Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import recursa.bench as bench
from recursa.bench.report import quantile
from recursa.bench.results import ResultsFile
from recursa.bench.sizes import BenchError
from tests.helpers import cli_in_process

ROW_FIELDS = {
    "task_id",
    "family",
    "size_chars",
    "size_tokens",
    "method",
    "model",
    "sub_model",
    "answer",
    "gold",
    "score",
    "usage",
    "cost_usd",
    "latency_s",
    "iterations",
    "sub_calls",
    "trace_path",
    "error",
    "status",
}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC"))}
    return subprocess.run(
        [sys.executable, "-m", "recursa.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


def test_run_writes_rows_summary_and_plots_then_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = bench.run("niah", sizes="2k,4k", n=2, methods="base,rlm", out=out, progress=False)
    assert report.ran == 8 and report.skipped == 0 and report.aborted is None
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(ROW_FIELDS <= set(r) for r in rows)
    assert {r["method"] for r in rows} == {"base", "rlm"} and {r["target_tokens"] for r in rows} == {
        2000,
        4000,
    }
    assert all(r["status"] == "ok" and r["score"] == 1.0 for r in rows)
    rlm_rows = [r for r in rows if r["method"] == "rlm"]
    assert all(
        r["sub_calls"] >= 1 and r["iterations"] >= 2 and Path(r["trace_path"]).exists() for r in rlm_rows
    )
    assert all(r["cost_usd"] > 0 and "priced as" in r["cost_basis"] for r in rows)  # scripted tokens priced
    summary = (out / "summary.md").read_text()
    assert "| niah | rlm | 2K | 2 | 1.000 |" in summary and "p95" in summary
    for name in ("score_vs_context.png", "cost_quantiles.png", "latency_quantiles.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.mean_score("rlm") == 1.0
    again = bench.run("niah", sizes="2k,4k", n=2, methods="base,rlm", out=out, progress=False)
    assert again.ran == 0 and again.skipped == 8 and len(again.rows) == 8
    # A harness error is not a finished row: the next run tries that one again, and only that one.
    broken = dict(rows[0], status="error", error="RuntimeError: boom", score=None)
    ResultsFile(out / "results.jsonl").append(broken)
    third = bench.run("niah", sizes="2k,4k", n=2, methods="base,rlm", out=out, progress=False)
    assert third.ran == 1 and third.new_rows[0]["method"] == rows[0]["method"]


def test_base_fails_cleanly_past_the_window_in_the_rows(tmp_path: Path) -> None:
    report = bench.run(
        "niah",
        sizes="4k",
        n=1,
        methods="base,rlm",
        model="scripted/gpt5-like:window=2000",
        out=tmp_path,
        progress=False,
    )
    by_method = {r["method"]: r for r in report.rows}
    assert by_method["base"]["status"] == "failed" and by_method["base"]["failure"] == "context_window"
    assert by_method["base"]["score"] == 0.0 and by_method["rlm"]["score"] == 1.0


def test_cli_bench_and_its_bad_input(tmp_path: Path, monkeypatch, capsys) -> None:
    ok = cli(
        "bench",
        "verbatim-copy",
        "--sizes",
        "2k",
        "--n",
        "1",
        "--method",
        "rlm",
        "--out",
        "o",
        "--json",
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["summary"][0]["score"] == 1.0
    for args, needle in (
        (("bench", "nope"), "unknown task family 'nope'"),
        (("bench", "niah", "--sizes", "8x"), "does not parse"),
        (("bench", "niah", "--method", "react"), "unknown method"),
        (("bench", "niah", "--knobs", "colour=red"), "unknown knob"),
        (("bench", "niah", "--executor", "spark"), "invalid choice: 'spark' (choose from 'local', 'ray')"),
        (("bench", "niah", "--model", "nowhere/m"), "unknown provider"),
    ):
        code, err = cli_in_process(capsys, *args, "--out", str(tmp_path / "bad"))
        assert code == 2 and needle in err and "Traceback" not in err, (args, err)
    (tmp_path / "rows.jsonl").write_text('{"text": "no question"}\n')
    monkeypatch.chdir(tmp_path)
    code, err = cli_in_process(capsys, "bench", "codeqa", "--data", "rows.jsonl", "--out", "bad")
    assert code == 2 and "missing field" in err
    assert not (tmp_path / "bad").exists()  # nothing written for a run that could not start


def test_unreachable_model_stops_with_an_error_and_keeps_finished_rows(tmp_path: Path, capsys) -> None:
    out_dir = str(tmp_path / "o")
    first = cli_in_process(
        capsys, "bench", "niah", "--sizes", "2k", "--n", "1", "--method", "base", "--out", out_dir
    )
    assert first[0] == 0, first[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = cli_in_process(
        capsys,
        "bench",
        "niah",
        "--sizes",
        "2k",
        "--n",
        "1",
        "--method",
        "base",
        "--out",
        out_dir,
        "--max-retries",
        "0",
        "--model",
        "openai/m",
        "--base-url",
        f"http://127.0.0.1:{port}/v1",
    )
    assert code == 2 and "cannot be reached" in err and "Traceback" not in err
    rows = ResultsFile(tmp_path / "o" / "results.jsonl").rows()
    assert len(rows) == 1 and rows[0]["model"] == "scripted/gpt5-like"  # the finished row is kept


def test_a_method_missing_its_extra_stops_before_any_row(tmp_path, monkeypatch, capsys) -> None:
    from recursa.cli import main

    monkeypatch.setitem(sys.modules, "bm25s", None)  # an import of it now fails, as without the extra
    code = main(
        [
            "bench",
            "niah",
            "--sizes",
            "1k",
            "--n",
            "1",
            "--method",
            "base,codeact-bm25",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "method codeact-bm25 needs the bm25s package of the bench extra: pip install" in err
    assert not (tmp_path / "o").exists()  # no row started, no results file


def test_missing_matplotlib_says_the_plots_were_skipped(tmp_path, monkeypatch, capsys) -> None:
    from recursa.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(
        ["bench", "niah", "--sizes", "1k", "--n", "1", "--method", "base", "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert code == 0 and "plots skipped: matplotlib is not installed (pip install" in err
    assert not list((tmp_path / "o").glob("*.png"))


def test_a_run_with_nothing_scored_plots_nothing_and_warns_nothing(tmp_path, recwarn) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BenchError, match="cannot be reached"):
        bench.run(
            "niah",
            sizes="1k",
            n=1,
            methods="base",
            model="openai/m",
            base_url=f"http://127.0.0.1:{port}/v1",
            max_retries=0,
            out=tmp_path / "o",
            progress=False,
        )
    assert [str(w.message) for w in recwarn] == []  # matplotlib warned of an empty legend
    assert not list((tmp_path / "o").glob("*.png"))


def test_real_data_through_the_bench(tmp_path: Path) -> None:
    row = {
        "_id": "x",
        "domain": "Code Repository Understanding",
        "question": "What does f return?",
        "choice_A": "1",
        "choice_B": "2",
        "choice_C": "3",
        "choice_D": "4",
        "answer": "C",
        "context": "### pkg/f.py\ndef f(n):\n    return 3\n",
    }
    data = tmp_path / "lb.jsonl"
    data.write_text(json.dumps(row) + "\n")
    report = bench.run("codeqa", data=str(data), methods="base,rlm", out=tmp_path / "o", progress=False)
    assert report.ran == 2 and {r["source"] for r in report.rows} == {"longbench-v2"}
    assert all(r["status"] == "ok" and r["score"] in (0.0, 1.0) for r in report.rows)


def test_quantiles_interpolate_like_numpy() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)
    assert quantile([7.0], 0.25) == 7.0


def test_rows_take_the_run_settings_by_name_and_refuse_bad_ones_as_written(tmp_path, capsys) -> None:
    from recursa.cli import main
    from recursa.errors import ConfigError

    for given, said in (
        ({"max_iteration": 3}, "recursa.bench.run(max_iteration=3): max_iteration is not a setting; did you mean"),
        ({"max_depth": 2}, "recursa.bench.run(max_depth=2): each method sets max_depth itself"),
        ({"window_tokens": 0}, "recursa.bench.run(window_tokens=0): window_tokens must be an int >= 1"),
        ({"max_usd": -1}, "recursa.bench.run(max_usd=-1): a cap below zero"),
        ({"max_llm_calls": 0}, "recursa.bench.run(max_llm_calls=0): a cap of 0 stops every run at once (a run needs at least one "
         "model call); use a positive number such as max_llm_calls=50, or leave max_llm_calls out for no cap"),
    ):
        with pytest.raises(ConfigError) as refused:
            bench.run("niah", sizes="1k", n=1, out=tmp_path / "o", progress=False, **given)
        assert str(refused.value).startswith(said), refused.value
    assert main(["bench", "niah", "--window", "0", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("recursa: error: --window 0: --window must be an int >= 1")
    assert not (tmp_path / "o").exists()  # nothing written for a run that could not start
    # A run setting reaches each row's method as it is (the base method starts no REPL).
    report = bench.run("niah", sizes="1k", n=1, methods="base", trace_dir=tmp_path / "mine", max_llm_calls=5,
                       out=tmp_path / "o", progress=False)  # fmt: skip
    assert Path(report.rows[0]["trace_path"]).parent == tmp_path / "mine"
    saved = json.loads((tmp_path / "o" / "config.json").read_text())
    assert saved["budget"]["max_llm_calls"] == 5 and "api_key" not in saved
