"""From trace files to the model turns a trainer needs: inputs found, runs checked, prompts rebuilt.

A trace stores each root-history message once: a root call's `new_messages` are the messages
added since the previous root call (the first call's hold the system prompt and the question),
and its `response` is the assistant message that follows. Because the history is append-only,
the exact prompt of turn k is every earlier call's new messages and response, then turn k's new
messages. Sub-calls (`llm_query`) store their prompt folded to a few thousand characters, so only
the ones that fit whole can become training rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.lm.gateway import REPLY_TRACE_CHARS
from recursa.trace import TRACE_FORMAT, RunNode, Trace, load
from recursa.train.errors import ExportError
from recursa.train.report import ExportReport

Message = dict[str, str]
RESULTS_FILE = "results.jsonl"  # a `recursa bench --out` folder's scores; never a trace

# What writer.fold() leaves in the middle of a text it shortened.
_FOLD_MARK = re.compile(r"\n\.\.\. \[[\d,]+ characters folded\] \.\.\.\n")

SKIP_NOT_TRACE = "files that are not recursa traces"
SKIP_UNFINISHED = "runs in truncated traces: the run never finished (it crashed or is still running)"
SKIP_DAMAGED = "runs in damaged traces: a line in the middle does not parse"
SKIP_OLDER = "runs in an older trace format: root calls carry no message history to rebuild prompts from"
SKIP_NEWER = f"runs in a newer trace format (this recursa reads format {TRACE_FORMAT}): upgrade recursa"
SKIP_FOLDED = (
    "turns the trace cannot rebuild: a reply over 100,000 characters was folded (that turn and later ones)"
)
SKIP_FAILED_CALL = "model calls that failed or were refused (no reply to learn from)"
SKIP_FOLDED_SUB = "sub-calls whose prompt or reply the trace folded (prompts over 4,000 characters)"
SKIP_CHILD_UNFINISHED = "child runs that never finished (with their descendants)"
SKIP_DUPLICATE = "runs seen twice (the same run id in another file): the first copy is used"
SKIP_BASELINE = "runs of a baseline method, not an RLM (run_start names the method)"


@dataclass
class Inputs:
    traces: list[Path]
    explicit: set[Path]  # trace files named on the command line: a bad one is an error, not a skip
    score_files: list[Path]


@dataclass
class Step:
    """One model call of a run, ready to become a row."""

    index: int  # 0-based among the run's own turns (or its sub-calls)
    turn: int  # the engine's turn number; the forced last call after max_iterations is iterations + 1
    purpose: str  # "root" | "final" | "sub"
    prompt: list[Message]
    response: str
    call_id: str
    model: str
    complete: bool = True  # False when the trace folded part of this prompt or reply
    logprobs: list[float] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] | None = None
    # The reply's native tool calls (the "tools" dialect), recursa's neutral shape: {"id", "name",
    # "arguments"}; exporters write them in the OpenAI messages format (recursa/lm/tool_format.py).
    tool_calls: list[dict[str, Any]] | None = None

    def reply_message(self, text: str | None = None) -> Message:
        """The assistant message of this step (its text, or `text` in its place, and its calls)."""
        message: Message = {"role": "assistant", "content": self.response if text is None else text}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    @property
    def chars(self) -> int:
        return sum(len(m.get("content", "")) for m in self.prompt) + len(self.response)


@dataclass
class TraceRun:
    """One root run of one trace file, checked and ready to export."""

    path: Path
    trace: Trace
    node: RunNode
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.node.run_id

    @property
    def task_key(self) -> str:
        """The question and the context's hash: identifies a task when no task id was given."""
        ctx = self.node.start.get("context")
        digest = ctx.get("sha256", "") if isinstance(ctx, dict) else ""
        return f"{self.node.question}\x00{digest}"


def find_inputs(paths: Iterable[str | Path], exclude: Iterable[Path] = ()) -> Inputs:
    """Trace files and score files from files and folders (folders are searched recursively).

    Files in `exclude` (the file being written, scores files given apart) are never read as
    traces, so re-running an export into the same folder does not read its own earlier output.
    """
    traces: list[Path] = []
    explicit: set[Path] = set()
    score_files: list[Path] = []
    given = [Path(p).expanduser() for p in paths]
    if not given:
        raise ExportError("no traces given: name trace files or folders that hold them")
    for path in given:
        if not path.exists():
            raise ExportError(
                f"no such file or folder: {path}; name trace files (a result's trace_path) or folders "
                "that hold them"
            )
        if path.is_dir():
            for found in sorted(path.rglob("*.jsonl")):
                (score_files if found.name == RESULTS_FILE else traces).append(found)
        elif path.name == RESULTS_FILE:
            score_files.append(path)
        else:
            traces.append(path)
            explicit.add(path.resolve())
    seen: set[Path] = {p.expanduser().resolve() for p in exclude}
    unique = []
    for path in traces:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    if not unique:
        raise ExportError(f"no trace files (*.jsonl) in {', '.join(str(p) for p in given)}")
    return Inputs(unique, explicit, score_files)


def load_runs(inputs: Inputs, report: ExportReport) -> list[TraceRun]:
    """Every usable root run; unusable ones are counted in the report (or raise, if named outright)."""
    runs: list[TraceRun] = []
    seen: set[str] = set()
    for path in inputs.traces:
        named = path.resolve() in inputs.explicit
        trace = _read_trace(path, named, report)
        if trace is None:
            continue
        report.traces += 1
        for root in trace.roots:
            report.runs += 1
            problem = SKIP_DUPLICATE if root.run_id in seen else run_problem(trace, root)
            seen.add(root.run_id)
            if problem is not None:
                report.skip(problem, path)
                continue
            runs.append(TraceRun(path, trace, root))
    return runs


def _read_trace(path: Path, named: bool, report: ExportReport) -> Trace | None:
    why = _not_a_trace(path)
    if why is None:
        try:
            return load(path)
        except Exception as exc:  # any file can be handed to us; none may end in a traceback
            why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    if named:
        raise ExportError(
            f"{path} is not a recursa trace ({why}); pass the .jsonl trace files of finished runs, "
            "or a folder of them (files there that are not traces are skipped and counted)"
        )
    report.skip(SKIP_NOT_TRACE, path)
    return None


def _not_a_trace(path: Path) -> str | None:
    """Why the file's first line is not a trace event, or None. Reads one line, not the file."""
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if raw.strip():
                    break
            else:
                return "the file is empty"
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    # A run killed while writing its first event leaves one line with no end: say so rather than
    # calling a recursa trace "not JSON" or "not UTF-8" (it can stop inside a multi-byte character).
    cut = "the file ends part-way through its first line: the run was cut off as it started"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and not raw.endswith(b"\n"):
            return cut
        return "not UTF-8 text"
    try:
        first = json.loads(line)
    except json.JSONDecodeError:
        return cut if line.startswith('{"') and not raw.endswith(b"\n") else "its first line is not JSON"
    if not isinstance(first, dict) or not isinstance(first.get("type"), str) or "run_id" not in first:
        return "its first line is not a trace event"
    return None


def run_problem(trace: Trace, root: RunNode) -> str | None:
    """Why a root run cannot be exported, or None."""
    method = root.start.get("method")
    if isinstance(method, str) and not method.startswith("rlm"):
        return SKIP_BASELINE  # a benchmark baseline (base model, CodeAct, ...) written on the same machinery
    fmt = root.start.get("format")
    if isinstance(fmt, int) and fmt > TRACE_FORMAT:
        return SKIP_NEWER
    if any("new_messages" not in e for e in root.of_type("lm_call") if e.get("purpose") in ("root", "final")):
        return SKIP_OLDER
    if root.end is None:
        return SKIP_UNFINISHED
    if trace.truncated:
        return SKIP_DAMAGED
    return None


def folded(text: str, limit: int = REPLY_TRACE_CHARS) -> bool:
    return len(text) > limit and _FOLD_MARK.search(text) is not None


def run_steps(node: RunNode, report: ExportReport | None = None) -> list[Step]:
    """The run's own turns (root and forced-final calls) with the exact prompt each one saw."""
    history: list[Message] = []
    steps: list[Step] = []
    turn = 0
    broken = False  # a folded reply corrupts every later prompt of the run
    for event in node.events:
        if event["type"] == "turn":
            turn = whole(event.get("turn"), turn + 1)
            continue
        if event["type"] == "compact":  # older turns were replaced by a summary: the prompt restarts
            history = _messages(event.get("messages"))
            continue
        if event["type"] != "lm_call" or event.get("purpose") not in ("root", "final"):
            continue
        new = _messages(event.get("new_messages"))
        # A dialect's transient prompt (SkyRL's) was part of this call's prompt only.
        transient = [m for m in new if m.get("transient")]
        history.extend(m for m in new if not m.get("transient"))
        for m in transient:
            del m["transient"]
        response = event.get("response")
        if not isinstance(response, str):
            if report is not None:
                report.skip(SKIP_FAILED_CALL)
            continue
        purpose = event["purpose"]
        broken = broken or folded(response)
        steps.append(
            Step(
                index=len(steps),
                turn=turn + 1 if purpose == "final" else turn,
                purpose=purpose,
                prompt=[dict(m) for m in [*history, *transient]],
                response=response,
                call_id=str(event.get("call_id", "")),
                model=str(event.get("model", "")),
                complete=not broken,
                tool_calls=_calls(event.get("tool_calls")),
                **_token_data(event),
            )
        )
        history.append(steps[-1].reply_message())
    return steps


def sub_steps(node: RunNode, report: ExportReport | None = None) -> list[Step]:
    """The run's plain sub-calls (llm_query) whose prompt and reply the trace holds whole."""
    steps: list[Step] = []
    for event in node.of_type("lm_call"):
        if event.get("purpose") != "sub":
            continue
        response = event.get("response")
        prompt = event.get("prompt")
        if not isinstance(response, str) or not isinstance(prompt, str):
            if report is not None:
                report.skip(SKIP_FAILED_CALL)
            continue
        whole = event.get("prompt_chars") == len(prompt) and not folded(response)
        if not whole:
            if report is not None:
                report.skip(SKIP_FOLDED_SUB)
            continue
        steps.append(
            Step(
                index=len(steps),
                turn=0,
                purpose="sub",
                prompt=[{"role": "user", "content": prompt}],
                response=response,
                call_id=str(event.get("call_id", "")),
                model=str(event.get("model", "")),
                **_token_data(event),
            )
        )
    return steps


def executed_code(node: RunNode, upto_turn: int) -> list[str]:
    """The code the run's REPL executed in turns up to and including `upto_turn`."""
    return [
        e["code"]
        for e in node.of_type("exec")
        if isinstance(e.get("code"), str) and whole(e.get("turn"), 0) <= upto_turn
    ]


def whole(value: Any, default: int) -> int:
    """A trace's whole number (a turn's), or `default` where a crafted or damaged line holds
    something else (a string, a float past any int, a bool)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return default


def _messages(raw: Any) -> list[Message]:
    """The trace's messages as rows hold them: role and text, and the tool-calling fields."""
    if not isinstance(raw, list):
        return []
    out: list[Message] = []
    for m in raw:
        if not isinstance(m, dict):
            continue
        message: Message = {"role": str(m.get("role", "user")), "content": str(m.get("content") or "")}
        for key in ("tool_call_id", "name", "transient"):
            if key in m:
                message[key] = m[key]
        calls = _calls(m.get("tool_calls"))
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _calls(raw: Any) -> list[dict[str, Any]] | None:
    if not isinstance(raw, list):
        return None
    calls = [
        {
            "id": str(c.get("id") or ""),
            "name": str(c.get("name") or ""),
            "arguments": c.get("arguments") or {},
        }
        for c in raw
        if isinstance(c, dict)
    ]
    return calls or None


def _token_data(event: dict[str, Any]) -> dict[str, Any]:
    return {
        "logprobs": event.get("logprobs"),
        "token_ids": event.get("token_ids"),
        "prompt_token_ids": event.get("prompt_token_ids"),
        "sampling": event.get("sampling"),
    }
