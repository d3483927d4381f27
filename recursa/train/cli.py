"""`recursa export sft|rl`: the argument parser and the command, kept out of recursa/cli.py."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from recursa.train.errors import ExportError

_SCORES_HELP = (
    'a JSONL of {"run_id" or "trace_path", "score", "task_id"} rows (repeatable); a results.jsonl '
    "inside a TRACES folder is read too"
)


def add_export_parser(sub: Any) -> None:
    export = sub.add_parser("export", help="training data from traces: SFT rows or step-wise RL rows")
    kinds = export.add_subparsers(dest="export_kind", required=True, help="what to export: sft or rl rows")

    sft = kinds.add_parser("sft", help="one row per root turn, TRL conversational prompt/completion")
    _common(sft)
    sft.add_argument(
        "--min-score",
        type=float,
        default=None,
        help="keep runs scored >= this (default: drop only runs that scored 0)",
    )
    sft.add_argument(
        "--max-chars",
        type=int,
        default=100_000,
        help="drop turns whose prompt + reply is longer (default 100000; 0: no limit)",
    )
    sft.add_argument("--include-children", action="store_true", help="also the turns of child runs")
    sft.add_argument("--no-fixes", action="store_true", help="export replies as they were, unrepaired")

    rl = kinds.add_parser("rl", help="step-wise rows with GRPO advantages that child runs inherit")
    _common(rl)
    rl.add_argument(
        "--group-by",
        choices=["task", "question", "all"],
        default="task",
        help="which root runs form one GRPO group: task (one task id, else as question), question (one "
        "question over one context), all (every run)",
    )
    rl.add_argument(
        "--child-weight",
        choices=["inherit", "1/k"],
        default="inherit",
        help="weight of child runs' steps: 1 (inherit), or 1/k of the parent's per level",
    )
    rl.add_argument(
        "--include-subcalls",
        action="store_true",
        help="also rows for llm_query calls whose prompt the trace holds whole",
    )
    rl.add_argument(
        "--drop-zero-variance",
        action="store_true",
        help="leave out groups whose rewards are all equal (default: keep them with advantage 0, flagged)",
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACES", help="trace files or folders that hold them")
    p.add_argument("-o", "--out", required=True, help="the JSONL file to write")
    p.add_argument("--scores", action="append", default=None, metavar="FILE", help=_SCORES_HELP)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run_export(args: argparse.Namespace) -> int:
    from recursa.train.rl import export_rl
    from recursa.train.sft import export_sft

    scores = list(args.scores) if args.scores else None
    if args.export_kind == "sft":
        if args.max_chars < 0:
            raise ExportError("--max-chars must be >= 0 (0: no limit)")
        report = export_sft(
            args.traces,
            args.out,
            scores=scores,
            min_score=args.min_score,
            max_chars=args.max_chars or None,
            include_children=args.include_children,
            fixes=not args.no_fixes,
        )
    else:
        report = export_rl(
            args.traces,
            args.out,
            scores=scores,
            group_by=args.group_by,
            child_weight=args.child_weight,
            include_subcalls=args.include_subcalls,
            drop_zero_variance=args.drop_zero_variance,
        )
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False))
    else:
        print(report)
        if report.rows == 0:
            print("warning: no rows were written; see what was skipped and filtered above", file=sys.stderr)
    return 0
