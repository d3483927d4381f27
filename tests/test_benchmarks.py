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
