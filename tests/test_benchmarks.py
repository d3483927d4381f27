"""benchmarks/run_all.py knows every benchmark script, so CI's quick run (.ci/run) covers them all."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", BENCH / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_all", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_is_in_run_all() -> None:
    scripts = {p.relative_to(BENCH).as_posix() for p in BENCH.glob("*.py")}
    scripts -= {"run_all.py"}
    scripts = {s for s in scripts if not s.startswith("_")} | {"vs_official/run.py"}
    registered = {s.path for s in _run_all().SCRIPTS}
    assert scripts - registered == set(), "add the new script to SCRIPTS in benchmarks/run_all.py"
    assert registered - scripts == set()
    for script in _run_all().SCRIPTS:
        assert (BENCH / script.path).exists()


def test_unknown_script_name_is_refused_with_the_known_ones() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--only", "nope"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "unknown script name(s) nope" in done.stderr and "turn_overhead" in done.stderr
    assert "Traceback" not in done.stderr


def _responder():
    spec = importlib.util.spec_from_file_location("bench_responder", BENCH / "vs_official" / "responder.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_responder", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_side_by_side_root_writes_each_engines_dialect() -> None:
    """recursa and the official package get ```repl cells ending in answer[...]; minrlm (its question
    marked ENGINE[minrlm]) gets the same trivial code in ```python, ending in FINAL after reading
    input_0 (its FINAL refuses an answer until the code has read the context)."""
    reply = _responder().reply
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "Step. BENCH[turns:2]"}]
    later = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "out"}]
    assert reply("bench-root", first) == "Next step.\n```repl\nx = 0\nprint(x)\n```"
    assert "answer['ready'] = True" in reply("bench-root", first + later)
    first[1]["content"] += " ENGINE[minrlm]"
    assert reply("bench-root", first) == "Next step.\n```python\nx = 0\nprint(x)\n```"
    assert reply("bench-root", first + later) == "```python\n_ = input_0[:0]\nFINAL('done')\n```"
    # recursive-llm: recursa's conventions in a python fence (it would run a ```repl tag as code).
    first[1]["content"] = "Step. BENCH[turns:2] ENGINE[recursive-llm]"
    assert reply("bench-root", first) == "Next step.\n```python\nx = 0\nprint(x)\n```"
    assert reply("bench-root", first + later).startswith("```python\nanswer['content'] = 'done'")
    # minrlm's sub-calls carry a system prompt and go to the root model; they are plain calls still.
    assert (
        reply("bench-root", [{"role": "system", "content": "s"}, {"role": "user", "content": "item 7"}])
        == "ok"
    )


def test_side_by_side_refuses_an_unknown_engine() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "vs_official" / "run.py"), "overhead", "--engines", "recursa,nope"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--engines takes a comma-separated subset of recursa, official, minrlm" in done.stderr
    assert "Traceback" not in done.stderr
