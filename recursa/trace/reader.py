"""Read a JSONL trace back as a tree of runs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.outcomes import StopReason

# A JSON escape of a UTF-16 surrogate. Alone (not half of a pair) it decodes to a str that no UTF-8
# writer accepts: a cell's output (or a model's reply) put one in the trace, and the viewer's page
# or an export could not be written.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_line(line: str, **options: Any) -> Any:
    """One line of a trace as JSON (`options` for json.loads); a lone surrogate in it comes back as
    U+FFFD. Raises ValueError for a line that is not JSON or is nested too deeply to parse."""
    try:
        value = json.loads(line, **options)
        if _SURROGATE_ESCAPE.search(line):
            text = json.dumps(value, ensure_ascii=False).encode("utf-16-le", "surrogatepass")
            value = json.loads(text.decode("utf-16-le", "replace"), **options)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    return value


@dataclass
class RunNode:
    run_id: str
    parent_run_id: str | None
    depth: int
    start: dict[str, Any]
    end: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # this run's own events, in order
    children: list[RunNode] = field(default_factory=list)

    @property
    def question(self) -> str:
        return self.start.get("question", "")

    @property
    def answer(self) -> str | None:
        return self.end.get("answer") if self.end else None

    @property
    def stop_reason(self) -> StopReason | None:
        return self.end.get("stop_reason") if self.end else None

    @property
    def complete(self) -> bool:
        """False for a run whose run_end was never written: its process died (or it is still going)."""
        return self.end is not None

    def of_type(self, event_type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == event_type]

    def walk(self) -> list[RunNode]:
        """This run and every run below it, depth first (without recursion: any depth)."""
        out: list[RunNode] = []
        stack = [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out


@dataclass
class Trace:
    path: Path
    events: list[dict[str, Any]]
    runs: dict[str, RunNode]
    roots: list[RunNode]
    truncated: bool = False  # the last line was cut off (the writer crashed mid-line)
    # Runs that started but have no run_end (their host was killed, or they are still running), in
    # the order they started.
    incomplete_runs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was skipped or is missing, and why

    @property
    def root(self) -> RunNode:
        return self.roots[0]

    @property
    def complete(self) -> bool:
        """True when every run that started has ended and nothing was cut off."""
        return not self.truncated and not self.incomplete_runs


def run_tree(
    events: list[dict[str, Any]], notes: list[str] | None = None
) -> tuple[dict[str, RunNode], list[RunNode]]:
    """Runs by id and the root runs, from events in the order they were written (a file's, or
    ones collected in memory by an `on_event` listener). What is wrong with the runs' shape (an id
    that starts twice, a run that is its own parent) goes to `notes`; the tree stays a tree: a run
    only ever hangs under a run that started before it."""
    runs: dict[str, RunNode] = {}
    roots: list[RunNode] = []
    problems = notes if notes is not None else []
    for event in events:
        run_id = event.get("run_id")
        if not isinstance(run_id, str):  # a list or a dict would not even be a dict key
            if event["type"] == "run_start":
                problems.append(f"a run_start has a run_id that is {type(run_id).__name__}, not text; skipped")
            continue
        if event["type"] == "run_start":
            parent_id, depth = event.get("parent_run_id"), event.get("depth", 0)
            if parent_id is not None and not isinstance(parent_id, str):
                problems.append(f"run {run_id} names a parent that is not a run id; read as a top-level run")
                parent_id = None
            if not isinstance(depth, int) or isinstance(depth, bool):
                depth = 0
            node = RunNode(run_id, parent_id, depth, event)
            if run_id in runs:
                problems.append(f"run {run_id} starts more than once; its later events go to the last start")
            if node.parent_run_id == run_id:
                problems.append(f"run {run_id} names itself as its parent; read as a top-level run")
            # Looked up before this run is registered: a run never becomes its own parent.
            parent = runs.get(node.parent_run_id) if node.parent_run_id else None
            runs[run_id] = node
            (parent.children if parent else roots).append(node)
        elif run_id in runs:
            runs[run_id].events.append(event)
            if event["type"] == "run_end":
                runs[run_id].end = event
    return runs, roots


def load(path: str | Path) -> Trace:
    """Parse a trace file. Tolerates a cut-off last line, as a crashed run can leave."""
    path = Path(path)
    events: list[dict[str, Any]] = []
    notes: list[str] = []
    unreadable: list[int] = []  # line numbers that are not JSON
    last = 0  # the last line with any text
    # errors="replace": a crash can cut the last line inside a multi-byte character, and that must
    # not make the events before it unreadable.
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            last = number
            try:
                event = parse_line(line)
            except ValueError:
                unreadable.append(number)
                continue
            if isinstance(event, dict) and isinstance(event.get("type"), str):
                events.append(event)  # anything else is not an event of ours: skip it, do not crash
            else:
                notes.append(f"line {number} is JSON but not a trace event; skipped")
    # Events are written one whole line at a time (writer.py), so only the last line can be cut off:
    # a process killed mid-write. Bad lines elsewhere were damaged some other way.
    truncated = bool(unreadable) and unreadable[-1] == last
    for number in unreadable:
        if number == last:
            notes.append(
                f"line {number}, the last, is cut off (the writer stopped mid-line: its process was "
                "killed or crashed); skipped"
            )
        else:
            notes.append(f"line {number} is not valid JSON; skipped")
    runs, roots = run_tree(events, notes)
    if not roots:
        raise ValueError(
            f"{path} holds no run_start event: it is not a recursa trace, or the run was cut off before "
            "its first event was written; pass a .jsonl file from a run's trace_path."
        )
    incomplete = [run_id for run_id, node in runs.items() if node.end is None]
    for run_id in incomplete:
        notes.append(
            f"run {run_id} has no run_end: it did not finish (its process was killed, or it is still running)"
        )
    return Trace(path, events, runs, roots, truncated, incomplete, notes)
