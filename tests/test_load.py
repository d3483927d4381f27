"""Load in CI: 20 RLM runs at once in this process, each with sub-calls and a child RLM, against the
fake OpenAI-compatible server. Every answer must be right, and afterwards the process must hold no
more worker processes, threads or file descriptors than before, with memory back near its baseline.

The 200-run version is `benchmarks/load.py` (figures in docs/performance.md); this test runs the
same code at a size CI can afford.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

RUNS = 20


def _load_benchmark() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "load.py"
    spec = importlib.util.spec_from_file_location("recursa_benchmark_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


load = _load_benchmark()


def _requests_per_run(index: int) -> int:
    """What one run sends: 2 root turns, one sum per chunk, one max, and the child's 2 turns and
    its count. Any other number means a call was lost, repeated or sent for someone else."""
    numbers = len(load.make_context(index)[0].split())
    return 2 + math.ceil(numbers / load.CHUNK) + 1 + 2 + 1


# Serial: beside another test, in a full run on a loaded machine (load 4-19), one of the 20
# in-process runs ended at max_iterations instead of answering.
@pytest.mark.serial
@pytest.mark.filterwarnings('ignore:sandbox="inprocess"')
@pytest.mark.parametrize("sandbox", ["auto", "inprocess"])
def test_concurrent_runs_answer_right_and_leave_nothing_behind(server, tmp_path, sandbox):
    server.holder["responder"] = load.responder
    server.latency_s = 0.02
    server.reset()
    (report,) = load.run_load(server.base_url, RUNS, sandbox, str(tmp_path))

    assert report.errors == []
    assert report.correct == RUNS
    # The runs really overlapped: at some moment every root and most children had a REPL open.
    if sandbox == "auto":
        assert report.peak["sandboxes"] >= RUNS
    else:
        assert report.peak["repl_threads"] >= RUNS
    # Each tree's calls reached the server exactly once (the warm-up run is index -1).
    expected = sum(_requests_per_run(i) for i in range(-1, RUNS))
    assert len(server.requests) == expected
    assert all(r.ok for r in server.requests)

    before, after = report.before, report.after
    assert report.leaked_pids == set()
    assert after.thread_names == before.thread_names
    assert after.fds <= before.fds
    # Generous: the host's Python heap returns to its baseline; glibc keeps some freed pages mapped.
    assert report.rss_trimmed_mb - before.rss_mb < 60
    assert len(list(tmp_path.glob("*.jsonl"))) == RUNS + 1  # one complete trace per run
