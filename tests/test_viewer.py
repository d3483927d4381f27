"""`recursa view`: the trace's tree model, the standalone HTML, the live server, and the page in
a real headless Chromium (content, search, a 10,000-node trace, live updates, a screenshot)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from recursa import RLM
from recursa.tasks import generate
from recursa.trace.viewer import TraceFormatError, ViewerServer, build_view, export_html, render_html
from tests.cli_launcher import CliLauncher
from tests.helpers import CHROMIUM

SCREENSHOTS = (
    Path(os.environ.get("RECURSA_SCREENSHOT_DIR", "")) if os.environ.get("RECURSA_SCREENSHOT_DIR") else None
)


# -- traces to look at ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_trace(tmp_path_factory) -> Path:
    """A real run with child RLMs (depth 2), sub-calls and several turns."""
    tmp = tmp_path_factory.mktemp("deep")
    task = generate("oolong", 60_000, seed=3)
    rlm = RLM("scripted/gpt5-like:recurse=1", sub_model="scripted/oracle", max_depth=2, trace_dir=tmp)
    result = rlm.run(task.question, task.context)
    assert result.stop_reason == "final"
    return result.trace_path


def synthetic_trace(path: Path, subs: int = 10_000, children: int = 20, turns: int = 5) -> Path:
    """A trace with `subs` sub-calls running 64 at a time, plus child runs, written directly so
    its times are exact."""
    lines: list[str] = []
    seq = 0

    def emit(kind: str, ts: float, **fields) -> None:
        nonlocal seq
        seq += 1
        lines.append(json.dumps({"seq": seq, "ts": round(ts, 6), "type": kind, **fields}))

    def run(run_id: str, parent: str | None, depth: int, t: float, turns: int, per_turn: int) -> float:
        emit(
            "run_start",
            t,
            format=1,
            run_id=run_id,
            parent_run_id=parent,
            depth=depth,
            question=f"Synthetic question for {run_id}?",
            model="scripted/gpt5-like",
            sub_model="scripted/oracle",
            context={"type": "str", "total_chars": 1_000_000},
            config={"max_depth": 2},
        )
        calls = 0
        for turn in range(1, turns + 1):
            emit("turn", t, run_id=run_id, turn=turn)
            t += 0.4
            calls += 1
            emit(
                "lm_call",
                t,
                run_id=run_id,
                call_id=f"{run_id}.c{calls}",
                purpose="root",
                depth=depth,
                model="scripted/gpt5-like",
                latency_s=0.4,
                new_messages=[{"role": "user", "content": f"REPL output for turn {turn - 1}"}],
                response=f"```repl\nparts = llm_query_batched(prompts_{turn})\n```",
                usage={"input_tokens": 900, "output_tokens": 40, "cached_tokens": 800, "cost_usd": 0.001},
                finish_reason="stop",
            )
            start = t
            for k in range(per_turn):
                calls += 1
                begin = start + (k // 64) * 0.2
                emit(
                    "lm_call",
                    begin + 0.2,
                    run_id=run_id,
                    call_id=f"{run_id}.c{calls}",
                    purpose="sub",
                    depth=depth + 1,
                    model="scripted/oracle",
                    latency_s=0.2,
                    prompt=f"Label line {k} of turn {turn}: needle-{run_id}-{turn}-{k} "
                    + "lorem ipsum " * 30,
                    prompt_chars=400,
                    response=f"label {k % 6}",
                    usage={"input_tokens": 100, "output_tokens": 3, "cached_tokens": 0, "cost_usd": 0.00001},
                    finish_reason="stop",
                )
            t = start + math.ceil(per_turn / 64) * 0.2 + 0.01
            if depth == 0 and turn == turns:
                for c in range(children):
                    run(f"{run_id}-child{c}", run_id, depth + 1, start + 0.001 * c, 1, 3)
                t += 1.0
            emit(
                "exec",
                t,
                run_id=run_id,
                turn=turn,
                block=1,
                code=f"parts = llm_query_batched(prompts_{turn})\nprint(len(parts))",
                stdout=f"{per_turn}\n",
                stderr="",
                error=None if turn != 2 else "ZeroDivisionError: division by zero",
                duration_s=round(t - start, 6),
            )
        usage = {
            "input_tokens": 100 * calls,
            "output_tokens": 3 * calls,
            "cached_tokens": 0,
            "cost_usd": 0.01,
        }
        emit(
            "run_end",
            t + 0.1,
            run_id=run_id,
            depth=depth,
            stop_reason="final",
            answer=f"answer of {run_id}",
            usage=usage,
        )
        return t + 0.1

    run("run_root", None, 0, 1_000.0, turns, subs // turns)
    path.write_text("\n".join(lines) + "\n")
    return path


# -- the model --------------------------------------------------------------------------------


def test_real_trace_becomes_a_tree_of_runs_turns_calls_execs_and_children(deep_trace):
    view = build_view(deep_trace)
    nodes = view["nodes"]
    kinds = {n["k"] for n in nodes}
    assert kinds == {"run", "turn", "call", "exec", "sub"}
    root = nodes[view["roots"][0]]
    assert root["k"] == "run" and root["s"] == "final" and root["p"] == -1
    turns = [nodes[c] for c in root["ch"]]
    assert all(t["k"] == "turn" for t in turns)
    # child runs hang under the execution that started them, and have their own turns
    child_runs = [n for n in nodes if n["k"] == "run" and n["p"] >= 0]
    assert child_runs and all(nodes[c["p"]]["k"] == "exec" for c in child_runs)
    assert all(any(nodes[k]["k"] == "turn" for k in c["ch"]) for c in child_runs)
    # every sub-call sits under an execution
    assert all(nodes[n["p"]]["k"] == "exec" for n in nodes if n["k"] == "sub")
    # details hold the code, output, prompts and answers
    execs = [json.loads(view["details"][n["i"]]) for n in nodes if n["k"] == "exec"]
    assert all("code" in d for d in execs) and any(d.get("stdout") for d in execs)
    assert view["summary"]["runs"] == len(child_runs) + 1
    assert view["summary"]["answer"] == json.loads(view["details"][root["i"]])["answer"]


def test_parallel_sub_calls_get_separate_timeline_rows(tmp_path):
    view = build_view(synthetic_trace(tmp_path / "t.jsonl", subs=640, children=0, turns=1))
    subs = [n for n in view["nodes"] if n["k"] == "sub"]
    rows = {n["r"] for n in subs}
    assert len(rows) == 64  # 64 calls at a time -> 64 rows, reused batch after batch
    for row in rows:  # calls on one row never overlap
        spans = sorted((n["a"], n["b"]) for n in subs if n["r"] == row)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    execs = [n for n in view["nodes"] if n["k"] == "exec"]
    assert all(e["a"] <= min(n["a"] for n in subs) for e in execs)


def test_truncated_unfinished_unknown_and_newer_traces_load_with_warnings(tmp_path, deep_trace):
    lines = deep_trace.read_text().splitlines()
    cut = [ln for ln in lines if '"run_end"' not in ln]  # no run finished
    cut.append('{"type": "hologram", "seq": 999999, "ts": 1}')
    cut[0] = (
        cut[0].replace('"format": 1', '"format": 7')
        if '"format"' in cut[0]
        else cut[0][:-1] + ', "format": 7}'
    )
    cut.append(lines[-1][: len(lines[-1]) // 2])  # a half-written last line
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(cut))
    view = build_view(path)
    text = " ".join(view["warnings"])
    assert "cut off" in text and "hologram" in text and "format 7" in text and "no run_end" in text
    assert view["summary"]["stop_reason"] == "running"
    assert all(n["b"] >= n["a"] for n in view["nodes"])  # open intervals end at the last event


def test_files_that_are_not_traces_are_refused_clearly(tmp_path):
    for content in ("", "not json at all\n", '{"type": "turn", "seq": 1, "ts": 1}\n'):
        path = tmp_path / "x.jsonl"
        path.write_text(content)
        with pytest.raises(TraceFormatError, match="not a recursa trace"):
            build_view(path)


def _view(launcher: CliLauncher, *args: str) -> subprocess.CompletedProcess[str]:
    """`recursa view ARGS` in a process of its own (tests/cli_launcher.py)."""
    return launcher.run(["view", *args], cwd=Path.cwd(), env=dict(os.environ), timeout=60)


def test_cli_writes_standalone_html_and_explains_bad_input(tmp_path, deep_trace, cli_launcher):
    out = tmp_path / "view.html"
    done = _view(cli_launcher, str(deep_trace), "--html", str(out))
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert html.startswith("<!doctype html>") and "/*__" not in html and "Synthetic" not in html
    assert "<script" in html and "fetch(" in html  # one self-contained file
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    done = _view(cli_launcher, str(bad), "--html", str(out))
    assert done.returncode == 2 and "not a recursa trace" in done.stderr
    done = _view(cli_launcher, str(tmp_path / "missing.jsonl"))
    assert done.returncode == 2 and "no trace file" in done.stderr


def test_embedded_data_cannot_close_the_script_element(tmp_path):
    path = synthetic_trace(tmp_path / "t.jsonl", subs=5, children=0, turns=1)
    path.write_text(path.read_text().replace("Synthetic question", "</script><script>alert(1)</script>"))
    html = render_html(build_view(path))
    assert "</script><script>alert(1)" not in html and "\\u003c/script\\u003e\\u003cscript" in html


def test_server_serves_the_page_and_rereads_a_growing_trace(tmp_path, deep_trace):
    path = tmp_path / "live.jsonl"
    lines = deep_trace.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")  # the root's run_end is the last line
    with ViewerServer(path) as viewer:
        page = httpx.get(viewer.url)
        assert page.status_code == 200 and "recursa" in page.text
        first = httpx.get(viewer.url + "trace.json").json()
        assert first["summary"]["stop_reason"] == "running"
        with path.open("a") as fh:
            fh.write(lines[-1] + "\n")
        assert httpx.get(viewer.url + "trace.json").json()["summary"]["stop_reason"] == "final"
        assert httpx.get(viewer.url + "nothing").status_code == 404


# -- in a real browser ------------------------------------------------------------------------

needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install -y chromium); CI installs it"
)


def _open(browser, url: str, width: int = 1400, height: int = 900):
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", state="attached", timeout=30_000)
    return page, errors


def _shot(page, tmp_path: Path, name: str) -> Path:
    out = (SCREENSHOTS or tmp_path) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))
    assert out.stat().st_size > 10_000  # a real picture, not an empty page
    return out


def _painted_pixels(page) -> int:
    return page.evaluate(
        """() => { const c = document.getElementById('timeline');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }"""
    )


@needs_chromium
def test_page_shows_the_tree_details_search_and_timeline(browser, deep_trace, tmp_path):
    html = export_html(deep_trace, tmp_path / "deep.html")
    page, errors = _open(browser, html.as_uri())
    view = build_view(deep_trace)
    header = page.text_content("#summary")
    assert view["summary"]["question"][:40] in header and str(view["summary"]["answer"]) in header
    assert page.locator(".row.k-run").first.is_visible() and page.locator(".row.k-turn").count() >= 2

    # an execution: its code and output in the details pane
    page.locator(".row.k-exec").nth(1).click()
    detail = page.text_content("#detail")
    assert "Code" in detail and "# step: solve" in detail and "Output" in detail
    assert page.locator(".row.k-exec").nth(1).get_attribute("class").count("sel") == 1

    # expanding it shows its child runs; a child run's question and answer are shown
    page.locator(".row.k-exec").nth(1).locator(".tog").click()
    page.locator(".row.k-run").nth(1).click()
    assert "Question" in page.text_content("#detail") and "Answer" in page.text_content("#detail")

    # a root call: tokens, latency and the folded prompt, unfolded on demand
    page.locator(".row.k-call").first.click()
    detail = page.text_content("#detail")
    assert "input tokens" in detail and "latency" in detail and "Prompt (new messages)" in detail
    unfold = page.locator("[data-unfold]").first
    assert unfold.count()
    before = len(page.text_content("#detail"))
    unfold.click()
    assert len(page.text_content("#detail")) > before

    # search narrows the tree to matches and their ancestors
    page.fill("#search", "FINAL_VAR")
    page.wait_for_selector("#search-count:has-text('found')")
    assert page.locator(".row.match").count() >= 1
    page.press("#search", "Enter")
    assert "FINAL_VAR" in page.text_content("#detail")
    page.fill("#search", "")
    from playwright.sync_api import expect

    expect(page.locator("#search-count")).to_have_text("")

    assert _painted_pixels(page) > 500  # the timeline is drawn
    assert not errors
    _shot(page, tmp_path, "viewer-deep.png")


@needs_chromium
def test_ten_thousand_nodes_stay_responsive(browser, tmp_path):
    path = synthetic_trace(tmp_path / "big.jsonl", subs=10_000, children=20)
    view = build_view(path)
    assert len(view["nodes"]) >= 10_000
    html = export_html(path, tmp_path / "big.html")
    started = time.perf_counter()
    page, errors = _open(browser, html.as_uri())
    load_s = time.perf_counter() - started
    state = page.evaluate("window.__recursaViewer")
    assert state["nodes"] == len(view["nodes"])
    assert load_s < 20, f"the page took {load_s:.1f} s to become ready"  # measured: well under 2 s

    # expand everything: the DOM still holds only the rows in view
    page.click("#expand-all")
    rows_in_dom = page.locator(".row").count()
    assert 10 <= rows_in_dom < 150
    page.evaluate("document.getElementById('tree').scrollTop = 1e9")
    page.wait_for_timeout(50)  # one animation frame for the scroll handler
    last_label = page.locator(".row").last.text_content()
    assert "sub-call" in last_label or "exec" in last_label or "turn" in last_label

    # a search over every node's text finds one needle among 10,000
    t = time.perf_counter()
    page.fill("#search", "needle-run_root-3-777 ")
    page.wait_for_selector("#search-count:has-text('found')")
    search_s = time.perf_counter() - t
    assert page.text_content("#search-count").startswith("1 found")
    page.press("#search", "Enter")
    assert "needle-run_root-3-777" in page.text_content("#detail")
    assert search_s < 10
    assert _painted_pixels(page) > 1000
    assert not errors
    _shot(page, tmp_path, "viewer-10k.png")


@needs_chromium
def test_live_view_follows_a_growing_trace(browser, tmp_path):
    full = synthetic_trace(tmp_path / "full.jsonl", subs=50, children=2, turns=2).read_text().splitlines()
    path = tmp_path / "growing.jsonl"
    path.write_text("\n".join(full[:-1]) + "\n")
    with ViewerServer(path) as viewer:
        page, errors = _open(browser, viewer.url, width=800, height=700)  # a narrow window too
        assert page.locator("#live").is_visible()
        assert "running" in page.text_content("#summary")
        with path.open("a") as fh:
            fh.write(full[-1] + "\n")
        page.wait_for_selector("#live", state="hidden", timeout=15_000)
        assert "final" in page.text_content("#summary")
        assert not errors
        _shot(page, tmp_path, "viewer-narrow.png")


def test_a_trace_whose_runs_form_a_loop_renders_what_it_can(tmp_path, cli_launcher):
    """Duplicate run ids made two runs share a tree slot and name each other as parents: the view
    recursed without end (RecursionError) and the page's tree would have looped."""
    from recursa.trace import load

    def start(seq, run, parent, question):
        return {
            "type": "run_start",
            "seq": seq,
            "ts": seq,
            "run_id": run,
            "parent_run_id": parent,
            "depth": 0 if parent is None else 1,
            "question": question,
        }

    events = [
        start(1, "A", None, "root"),
        start(2, "B", "A", "child of A"),
        start(3, "A", "B", "A again, under B"),
        start(4, "C", "A", "under the second A"),
        {"type": "turn", "seq": 5, "ts": 5, "run_id": "A", "turn": 1},
        start(6, "D", "D", "its own parent"),
        *(
            {"type": "run_end", "seq": 7 + i, "ts": 7 + i, "run_id": r, "stop_reason": "final", "answer": r}
            for i, r in enumerate("CBAD")
        ),
    ]
    path = tmp_path / "loop.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    view = build_view(path)
    text = " ".join(view["warnings"])
    assert "run id A starts more than once" in text and "run D names itself as its parent" in text
    runs = [n for n in view["nodes"] if n["k"] == "run"]
    assert len(runs) == 5 and len({n["u"] for n in runs}) == 5
    parents = {n["i"]: n["p"] for n in view["nodes"]}
    for node in view["nodes"]:  # every node reaches a root: no loop for the page to walk
        seen, at = set(), node["i"]
        while at >= 0:
            assert at not in seen
            seen.add(at)
            at = parents[at]
    trace = load(path)
    assert len(trace.runs) == 4 and sum(len(r.walk()) for r in trace.roots) == 5
    assert any("starts more than once" in n for n in trace.notes)
    out = tmp_path / "loop.html"
    done = _view(cli_launcher, str(path), "--html", str(out))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_runs_nested_thousands_deep_render_from_the_top_level(tmp_path):
    """A crafted chain of 3,000 child runs made every child's move below its parent's turn walk the
    whole chain: seconds per thousand runs before the page had its data. Past MAX_RUN_NESTING the
    runs are shown from the top level, and the view says so."""
    from recursa.trace.viewer.model import MAX_RUN_NESTING

    events = [{"type": "run_start", "run_id": "R", "depth": 0, "question": "root"}]
    for i in range(3000):
        parent = "R" if i == 0 else f"C{i - 1}"
        events.append({"type": "run_start", "run_id": f"C{i}", "parent_run_id": parent, "depth": i + 1})
        events.append({"type": "turn", "run_id": f"C{i}", "turn": 1})
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    view = build_view(path)
    assert any(f"nested more than {MAX_RUN_NESTING} deep" in w for w in view["warnings"])
    parents = {n["i"]: n["p"] for n in view["nodes"]}
    runs_above = []
    for node in view["nodes"]:
        at, runs = parents[node["i"]], 0
        while at >= 0:
            runs += view["nodes"][at]["k"] == "run"
            at = parents[at]
        runs_above.append(runs)
    assert (
        max(runs_above) == MAX_RUN_NESTING + 1 and len([n for n in view["nodes"] if n["k"] == "run"]) == 3001
    )


def test_malformed_fields_and_lone_surrogates_neither_crash_the_reader_nor_the_outputs(tmp_path):
    """What a cell printed or a model replied reaches the trace as-is: a lone surrogate (written as
    its JSON escape) made the standalone page unwritable (UnicodeEncodeError); a run id that is a
    list, a parent that is a dict, a line nested 100,000 deep and a context that is a number each
    crashed `recursa.trace.load` (and so `recursa export`) with a TypeError or RecursionError."""
    from recursa.trace import load
    from recursa.train import rl_rows

    start = {"type": "run_start", "run_id": "A", "depth": 0, "question": "q", "context": 5}
    lines = [
        json.dumps(start),
        json.dumps({**start, "run_id": ["x"]}),
        json.dumps({**start, "run_id": "B", "parent_run_id": {"a": 1}, "depth": "deep"}),
        '{"type": "turn", "run_id": "A", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        json.dumps({"type": "run_end", "run_id": "A", "stop_reason": "final", "answer": "ok\udc80"}),
    ]
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    trace = load(path)
    assert trace.root.answer == "ok\N{REPLACEMENT CHARACTER}" and trace.runs["B"].parent_run_id is None
    notes = " ".join(trace.notes)
    assert "run_id that is list" in notes and "line 4 is not valid JSON" in notes and "names a parent" in notes
    assert "ok\N{REPLACEMENT CHARACTER}" in export_html(path, tmp_path / "odd.html").read_text(encoding="utf-8")
    rows, _report = rl_rows([path], scores={"A": 1.0})
    assert isinstance(rows, list)
