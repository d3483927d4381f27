"""SFT rows: one per root turn, in TRL's conversational prompt/completion form.

    {"prompt": [{"role": "system", ...}, {"role": "user", ...}, ...],   # what the model saw
     "completion": [{"role": "assistant", "content": "..."}],           # what it replied
     "metadata": {"run_id", "root_run_id", "parent_run_id", "task_id", "turn", "depth", "score",
                  "purpose", "model", "call_id", "fixes", "trace", "method", "family"}}

The paper's filters: runs that scored 0 (or below --min-score) and runs that ended in one turn
are dropped, and so are turns whose prompt and reply together exceed `max_chars`. Answer-protocol
slips are fixed or the turn dropped (recursa.train.fixes); every drop and fix is counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recursa.lm.tool_format import openai_messages
from recursa.loop.answers import assigned_names
from recursa.train.common import TracePaths, check_out, export_to, finished_nodes, load_scored
from recursa.train.errors import ExportError
from recursa.train.fixes import fix_reply
from recursa.train.report import ExportReport
from recursa.train.scores import ScoreSource
from recursa.train.source import SKIP_FOLDED, executed_code, run_steps, whole

DEFAULT_MAX_CHARS = 100_000
DROP_ZERO = "runs that scored 0"
DROP_ONE_TURN = "runs that ended in one turn"


def sft_rows(
    traces: TracePaths,
    *,
    scores: ScoreSource = None,
    min_score: float | None = None,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    include_children: bool = False,
    fixes: bool = True,
    exclude: str | Path | None = None,
) -> tuple[list[dict[str, Any]], ExportReport]:
    """The rows and the report, without writing anything. See `export_sft` for the arguments;
    `exclude` is a file never read as input (the one being written)."""
    if max_chars is not None and max_chars <= 0:
        raise ExportError(f"max_chars must be a positive number of characters, got {max_chars}")
    report = ExportReport("sft", fixes_on=fixes)
    rows: list[dict[str, Any]] = []
    for run, score, value in load_scored(traces, scores, report, check_out(exclude)):
        root = run.node
        if min_score is None and value <= 0:
            report.drop(DROP_ZERO, run.path)
            continue
        if min_score is not None and value < min_score:
            report.drop(f"runs scored below --min-score {min_score:g}", run.path)
            continue
        if whole(root.end.get("iterations") if root.end else 0, 0) <= 1:
            report.drop(DROP_ONE_TURN, run.path)
            continue
        nodes = list(finished_nodes(root, report, run.path)) if include_children else [root]
        before = len(rows)
        for node in nodes:
            for step in run_steps(node, report):
                if not step.complete:
                    report.skip(SKIP_FOLDED, run.path)
                    continue
                reply, applied = step.response, []
                if fixes:
                    known = assigned_names(executed_code(node, step.turn - 1))
                    fixed = fix_reply(step.response, known)
                    if fixed.drop:
                        report.drop(fixed.drop, run.path)
                        continue
                    reply, applied = fixed.text, fixed.fixes
                chars = step.chars - len(step.response) + len(reply)
                if max_chars is not None and chars > max_chars:
                    report.drop(f"turns over {max_chars:,} characters (prompt + reply)", run.path)
                    continue
                report.fixes.update(applied)
                rows.append(
                    {
                        "prompt": openai_messages(step.prompt),
                        "completion": openai_messages([step.reply_message(reply)]),
                        "metadata": {
                            "run_id": node.run_id,
                            "root_run_id": root.run_id,
                            "parent_run_id": node.parent_run_id,
                            "task_id": score.task_id,
                            "turn": step.turn,
                            "depth": node.depth,
                            "score": value,
                            "purpose": step.purpose,
                            "model": step.model,
                            "call_id": step.call_id,
                            "fixes": applied,
                            "trace": str(run.path),
                            "method": score.extra.get("method"),
                            "family": score.extra.get("family"),
                        },
                    }
                )
        if len(rows) > before:
            report.runs_used += 1
    report.rows = len(rows)
    return rows, report


def export_sft(
    traces: TracePaths,
    out: str | Path,
    *,
    scores: ScoreSource = None,
    min_score: float | None = None,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    include_children: bool = False,
    fixes: bool = True,
) -> ExportReport:
    """Write SFT rows (one per root turn) to `out` as JSONL and return the report.

    traces: trace files and/or folders (searched recursively; a `results.jsonl` found there is read
        as scores). scores: a scores JSONL path (or several), a {run_id: score} mapping, or rows
        as dicts; these win over results.jsonl files. min_score: keep runs scored >= this (default:
        drop only runs that scored 0). max_chars: drop turns whose prompt + reply is longer (None: no
        limit). include_children: also the turns of child runs (rlm_query), with the root's score.
        fixes: repair answer-protocol slips (see recursa.train.fixes).
    """
    return export_to(
        out,
        lambda path: sft_rows(
            traces,
            scores=scores,
            min_score=min_score,
            max_chars=max_chars,
            include_children=include_children,
            fixes=fixes,
            exclude=path,
        ),
    )
