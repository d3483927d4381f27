"""Steps shared by both exporters: inputs, scores, and walking a run tree."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from recursa.trace import RunNode
from recursa.train.errors import ExportError
from recursa.train.report import ExportReport, write_jsonl
from recursa.train.scores import Score, ScoreSource, build_scorebook
from recursa.train.source import SKIP_CHILD_UNFINISHED, TraceRun, find_inputs, load_runs

SKIP_NO_SCORE = "runs without a score (no row for them in the scores, or score null)"

TracePaths = str | Path | Iterable[str | Path]


def load_scored(
    traces: TracePaths, scores: ScoreSource, report: ExportReport, out: Path | None = None
) -> list[tuple[TraceRun, Score, float]]:
    """Every usable root run that has a score, with that score; the rest counted in the report."""
    paths = [traces] if isinstance(traces, str | Path) else list(traces)
    inputs = find_inputs(paths, exclude=[*([out] if out else []), *_score_files(scores)])
    runs = load_runs(inputs, report)  # first: a named file that is not a trace is the error to show
    book = build_scorebook(scores, inputs.score_files)
    if len(book) == 0:
        raise ExportError(
            "no scores for these traces: pass --scores FILE.jsonl (rows like "
            '{"run_id": "run_...", "task_id": "t1", "score": 1.0}) or a `recursa bench --out` folder, '
            "whose results.jsonl holds them"
        )
    if book.conflicts:
        report.notes.append(f"{book.conflicts} run(s) had more than one score; the last one given was used")
    scored: list[tuple[TraceRun, Score, float]] = []
    for run in runs:
        found = book.lookup(run.run_id, run.path)
        if found is None or found.score is None:
            report.skip(SKIP_NO_SCORE, run.path)
            continue
        scored.append((run, found, found.score))
    return scored


def _score_files(scores: ScoreSource) -> list[Path]:
    if isinstance(scores, str | Path):
        return [Path(scores)]
    if isinstance(scores, list | tuple):
        return [Path(s) for s in scores if isinstance(s, str | Path)]
    return []


def finished_nodes(root: RunNode, report: ExportReport, where: Path) -> Iterator[RunNode]:
    """The root and every descendant run, depth first; an unfinished child is skipped with its subtree.
    Without recursion: a trace is anyone's file, and runs nested thousands deep are one line each."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        for child in reversed(node.children):
            if child.end is None:
                report.skip(SKIP_CHILD_UNFINISHED, where, n=len(child.walk()))
                continue
            stack.append(child)


def check_out(out: str | Path | None) -> Path | None:
    if out is None:
        return None
    path = Path(out).expanduser()
    if path.is_dir():
        raise ExportError(f"-o {path} is a folder; give the file to write, e.g. {path / 'rows.jsonl'}")
    return path


def export_to(
    out: str | Path, build: Callable[[Path], tuple[list[dict[str, Any]], ExportReport]]
) -> ExportReport:
    """Rows from `build(path)` written to `out` as JSONL; the report records where.

    `build` gets the output path so that a rerun into a folder of traces does not read its own
    earlier output as an input.
    """
    path = check_out(out)
    assert path is not None
    rows, report = build(path)
    if not rows and path.is_file() and path.stat().st_size > 0:
        # Nothing to write must not wipe what an earlier export wrote there.
        report.notes.append(f"no rows to write, so {path} was left as it was")
        return report
    write_jsonl(rows, path)
    report.out = path
    return report
