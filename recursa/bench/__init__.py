"""Benchmarks: every task family against every method, with scores, cost and latency reports.

import recursa.bench
report = recursa.bench.run("oolong", sizes="8k,32k", n=3, methods="base,rlm",
                           model="scripted/gpt5-like", out="bench-out/oolong")
report.summary_path, report.plots, report.mean_score("rlm")
"""

from __future__ import annotations

from recursa.bench.report import summary_table
from recursa.bench.runner import BenchReport, arun, run

__all__ = [
    "BenchReport",
    "arun",
    "run",
    "summary_table",
]
