"""A trace file as the viewer's data: a flat list of tree nodes with times, timeline rows and totals.

The tree: run > turn > (root call, executions) > (sub-calls and child runs started during that
execution) > the child run's own turns, and so on. Sub-calls are emitted before the execution
that made them finishes, so they are held per run until that execution's event arrives.

Node ids are assigned in event order, so a trace that grows (a live run) keeps the ids it had:
the browser keeps what was expanded and selected across reloads.

Details (code, output, prompts) are stored per node as a JSON string: the page parses the small
node list at once and each node's details only when it is opened.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.trace.viewer.reading import LIMITS, TraceFormatError, ViewLimits, read_trace

VIEW_VERSION = 1
# The newest trace layout this viewer understands (run_start's "format"; absent means 1).
SUPPORTED_FORMAT = 1
# Sub-call rows per run on the timeline: beyond this many calls at once, bars share rows.
MAX_LANES = 256
# Runs nested deeper than this are shown from the top level: under a crafted chain of thousands of
# children, placing each child below its parent's turn walks the whole chain, which is quadratic
# (docs/performance.md, "Figures behind choices in the code"). recursa's own traces nest max_depth
# runs deep.
MAX_RUN_NESTING = 64
KNOWN_TYPES = {
    "run_start",
    "sandbox",
    "turn",
    "lm_call",
    "exec",
    "run_end",
    "tool_call",
    "compact",
    "warning",
}


# A run's status is a CSS class and a badge in the page: a trace is anyone's file, so anything
# else becomes "unknown" (the stop_reason text itself is still shown, escaped, in the details).
RUN_STATUSES = frozenset({"final", "max_iterations", "budget", "timeout", "error", "cancelled", "ok"})


@dataclass
class _Node:
    id: int
    parent: int
    kind: str  # run | turn | call | sub | exec | tool | compact
    label: str
    t0: float
    t1: float | None
    run: int  # index of the run this node belongs to
    detail: dict[str, Any]
    tokens_in: int = 0
    tokens_out: int = 0
    cached: int = 0
    cost: float = 0.0
    status: str = "ok"  # ok | error | refused | cancelled | running | timeout | budget | max_iterations
    row: int = 0
    children: list[int] = field(default_factory=list)


@dataclass
class _RunState:
    node: int
    index: int
    turn: int | None = None
    pending: list[int] = field(default_factory=list)  # sub-calls and child runs since the last exec
    calls: int = 0
    level: int = 0  # runs above this one


def _num(value: Any, default: float = 0.0) -> float:
    # A crafted trace may hold 1e999 or a bool where a number goes: only finite numbers count.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            return default
        return number if math.isfinite(number) else default
    return default


def _constant(name: str) -> None:
    # NaN and Infinity are not JSON: the page's JSON.parse would refuse the whole view for one.
    return None


def _short(text: Any, limit: int = 90) -> str:
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def read_events(path: Path, limits: ViewLimits = LIMITS) -> tuple[list[dict[str, Any]], list[str]]:
    """The events the view shows (read within `limits`: reading.py), and warnings about what could
    not be read or is not shown."""
    read = read_trace(path, limits, _constant)
    events: list[dict[str, Any]] = []
    unknown: dict[str, int] = {}
    for event in read.events:
        if event["type"] not in KNOWN_TYPES:
            unknown[event["type"]] = unknown.get(event["type"], 0) + 1
            continue
        events.append(event)
    warnings = read.warnings(limits)
    if unknown:
        kinds = ", ".join(f"{_short(k, 40)} ({n})" for k, n in sorted(unknown.items()))
        warnings.append(f"events of unknown types were skipped: {kinds}; is the trace from a newer recursa?")
    formats = {f for e in events if e["type"] == "run_start" and isinstance(f := e.get("format", 1), int)}
    newer = sorted(f for f in formats if isinstance(f, int) and f > SUPPORTED_FORMAT)
    if newer:
        warnings.append(
            f"the trace has format {newer[-1]}, newer than this viewer's {SUPPORTED_FORMAT}: "
            "upgrade recursa to see everything in it"
        )
    if not any(e["type"] == "run_start" for e in events):
        raise TraceFormatError(
            f"{path} holds no run_start event: it is not a recursa trace, or it is empty or from an "
            "incompatible version"
        )
    return events, warnings


class _Builder:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = sorted(events, key=lambda e: _num(e.get("seq"), 0))
        self.origin = min(_num(e.get("ts"), float("inf")) for e in self.events)
        if self.origin == float("inf"):
            self.origin = 0.0
        self.nodes: list[_Node] = []
        self.runs: dict[str, _RunState] = {}
        self.roots: list[int] = []
        self.last_ts = 0.0
        self.run_count = 0
        self.warnings: list[str] = []  # what was wrong with the runs' shape (a trace is anyone's file)
        self.too_deep = False

    def t(self, event: dict[str, Any]) -> float:
        value = _num(event.get("ts"), self.origin) - self.origin
        self.last_ts = max(self.last_ts, value)
        return value

    def add(
        self, parent: int, kind: str, label: str, t0: float, t1: float | None, run: int, **detail: Any
    ) -> _Node:
        node = _Node(len(self.nodes), parent, kind, label, t0, t1, run, detail)
        self.nodes.append(node)
        if parent >= 0:
            self.nodes[parent].children.append(node.id)
        else:
            self.roots.append(node.id)
        return node

    def build(self) -> None:
        for event in self.events:
            handler = getattr(self, "_" + event["type"])
            handler(event)
        for state in self.runs.values():
            self._flush(state, self._anchor(state))

    def _anchor(self, state: _RunState) -> int:
        return state.turn if state.turn is not None else state.node

    def _within(self, node_id: int, ancestor: int) -> bool:
        """Whether `node_id` is `ancestor` or below it (parents are followed up to a root)."""
        seen: set[int] = set()
        while node_id >= 0 and node_id not in seen:
            if node_id == ancestor:
                return True
            seen.add(node_id)
            node_id = self.nodes[node_id].parent
        return False

    def _flush(self, state: _RunState, parent: int) -> None:
        for node_id in state.pending:
            if self._within(parent, node_id):
                continue  # runs named as each other's parents: moving it would make a loop
            node = self.nodes[node_id]
            old = self.nodes[node.parent] if node.parent >= 0 else None
            if old is not None and node_id in old.children:
                old.children.remove(node_id)
            node.parent = parent
            self.nodes[parent].children.append(node_id)
        state.pending = []

    def _run_start(self, e: dict[str, Any]) -> None:
        run_id = str(e.get("run_id"))
        parent_id = str(e.get("parent_run_id")) if e.get("parent_run_id") else None
        if run_id in self.runs:
            self.warnings.append(
                f"run id {_short(run_id, 40)} starts more than once: each start is shown as a run of its "
                "own, and later events go to the last one"
            )
        if parent_id == run_id:
            self.warnings.append(
                f"run {_short(run_id, 40)} names itself as its parent: shown as a top-level run"
            )
            parent_id = None
        parent_state = self.runs.get(parent_id) if parent_id else None
        if parent_state is not None and parent_state.level >= MAX_RUN_NESTING:
            if not self.too_deep:
                self.warnings.append(
                    f"runs are nested more than {MAX_RUN_NESTING} deep: those below are shown as top-level runs"
                )
            self.too_deep = True
            parent_state = None
        parent = self._anchor(parent_state) if parent_state else -1
        depth = int(_num(e.get("depth"), 0))
        node = self.add(
            parent,
            "run",
            f"run · depth {depth} · {_short(e.get('question'), 70)}",
            self.t(e),
            None,
            self.run_count,
            run_id=run_id,
            parent_run_id=e.get("parent_run_id"),
            depth=depth,
            model=e.get("model"),
            sub_model=e.get("sub_model"),
            question=e.get("question"),
            context=e.get("context"),
            config=e.get("config"),
        )
        node.status = "running"
        self.run_count += 1
        self.runs[run_id] = _RunState(node.id, node.run, level=parent_state.level + 1 if parent_state else 0)
        if parent_state is not None:
            parent_state.pending.append(node.id)

    def _sandbox(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is not None:
            self.nodes[state.node].detail["isolation"] = e.get("isolation")

    def _state(self, e: dict[str, Any]) -> _RunState | None:
        return self.runs.get(str(e.get("run_id")))

    def _turn(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is None:
            return
        if state.turn is not None:
            self._flush(state, state.turn)
            self.nodes[state.turn].t1 = self.t(e)
        turn = int(_num(e.get("turn"), 0))
        node = self.add(state.node, "turn", f"turn {turn}", self.t(e), None, state.index, turn=turn)
        state.turn = node.id

    def _lm_call(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is None:
            return
        end = self.t(e)
        # latency_s counts from the request (slot wait included); queued_s, where a trace has it,
        # is the part spent waiting for a concurrency slot, so the bar starts when the call was sent.
        start = max(0.0, end - _num(e.get("latency_s")) + _num(e.get("queued_s")))
        purpose = str(e.get("purpose") or "sub")
        usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
        is_sub = purpose == "sub"
        state.calls += 1
        if is_sub:
            number = str(e.get("call_id") or "").rpartition(".")[2]
            label = f"sub-call {number} · {_short(e.get('prompt'), 60)}"
        else:
            label = "final answer call" if purpose == "final" else "root model call"
        detail = {
            k: e.get(k)
            for k in (
                "call_id",
                "parent_id",
                "purpose",
                "model",
                "prompt",
                "prompt_chars",
                "new_messages",
                "response",
                "usage",
                "latency_s",
                "queued_s",
                "attempts",
                "finish_reason",
                "error",
                "refused",
            )
            if e.get(k) is not None
        }
        parent = state.node if purpose == "final" else self._anchor(state)
        node = self.add(parent, "sub" if is_sub else "call", label, start, end, state.index, **detail)
        node.tokens_in = int(_num(usage.get("input_tokens")))
        node.tokens_out = int(_num(usage.get("output_tokens")))
        node.cached = int(_num(usage.get("cached_tokens")))
        node.cost = _num(usage.get("cost_usd"))
        if e.get("refused"):
            node.status = "refused"
        elif e.get("error"):
            node.status = "error"
        if is_sub:
            state.pending.append(node.id)

    def _tool_call(self, e: dict[str, Any]) -> None:
        """A host tool call, from REPL code or a sub-model; like a sub-call, it joins the cell after it."""
        state = self._state(e)
        if state is None:
            return
        end = self.t(e)
        start = max(0.0, end - _num(e.get("duration_s")))
        caller = str(e.get("caller") or "repl")
        detail = {
            k: e.get(k)
            for k in ("tool", "caller", "where", "arguments", "result", "duration_s", "error")
            if e.get(k) is not None
        }
        node = self.add(
            self._anchor(state),
            "tool",
            f"tool {e.get('tool')} · from {caller}",
            start,
            end,
            state.index,
            **detail,
        )
        if e.get("error"):
            node.status = "error"
        state.pending.append(node.id)

    def _compact(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is None:
            return
        at = self.t(e)
        count = int(_num(e.get("compacted_messages")))
        detail = {k: e.get(k) for k in ("turn", "compacted_messages", "summary") if e.get(k) is not None}
        self.add(
            self._anchor(state),
            "compact",
            f"history compacted · {count} messages",
            at,
            at,
            state.index,
            **detail,
        )

    def _warning(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is not None:
            self.nodes[state.node].detail.setdefault("warnings", []).append(str(e.get("message")))

    def _exec(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is None:
            return
        end = self.t(e)
        start = max(0.0, end - _num(e.get("duration_s")))
        first_line = next((ln for ln in str(e.get("code") or "").splitlines() if ln.strip()), "")
        detail = {
            k: e.get(k)
            for k in (
                "turn",
                "block",
                "code",
                "stdout",
                "stderr",
                "omitted_chars",
                "error",
                "timed_out",
                "restarted",
                "restored_names",
                "notes",
                "final",
                "duration_s",
                "timeout_s",
            )
            if e.get(k) not in (None, [], "")
        }
        # duration_s may be measured inside the REPL process (a little short of what the host saw):
        # the execution began no later than the first sub-call or child run it made.
        start = min([start] + [self.nodes[i].t0 for i in state.pending])
        node = self.add(
            self._anchor(state), "exec", f"exec · {_short(first_line, 60)}", start, end, state.index, **detail
        )
        if e.get("error") or e.get("timed_out"):
            node.status = "error"
        self._flush(state, node.id)

    def _run_end(self, e: dict[str, Any]) -> None:
        state = self._state(e)
        if state is None:
            return
        end = self.t(e)
        if state.turn is not None:
            self._flush(state, state.turn)
            self.nodes[state.turn].t1 = end
        node = self.nodes[state.node]
        node.t1 = end
        reason = e.get("stop_reason") or "ok"
        node.status = reason if isinstance(reason, str) and reason in RUN_STATUSES else "unknown"
        node.detail.update(
            {
                k: e.get(k)
                for k in (
                    "stop_reason",
                    "answer",
                    "answer_protocol",
                    "iterations",
                    "usage",
                    "duration_s",
                    "error",
                )
                if e.get(k) is not None
            }
        )
        usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
        node.tokens_in = int(_num(usage.get("input_tokens")))
        node.tokens_out = int(_num(usage.get("output_tokens")))
        node.cached = int(_num(usage.get("cached_tokens")))
        node.cost = _num(usage.get("cost_usd"))


def _close_open_intervals(b: _Builder) -> None:
    """Unfinished runs and turns end at the last event, so the timeline can draw them."""
    for node in b.nodes:
        if node.t1 is None:
            node.t1 = b.last_ts
        if node.kind == "turn":
            node.tokens_in = sum(b.nodes[c].tokens_in for c in node.children if b.nodes[c].kind != "run")
            node.tokens_out = sum(b.nodes[c].tokens_out for c in node.children if b.nodes[c].kind != "run")
            node.cost = sum(b.nodes[c].cost for c in node.children if b.nodes[c].kind != "run")
        if node.kind == "exec":
            subs = [b.nodes[c] for c in node.children if b.nodes[c].kind == "sub"]
            node.tokens_in = sum(s.tokens_in for s in subs)
            node.tokens_out = sum(s.tokens_out for s in subs)
            node.cost = sum(s.cost for s in subs)


def _assign_rows(b: _Builder) -> int:
    """Timeline rows: each run gets a band, its own calls and executions on the band's first row
    (they are sequential) and its sub-calls packed greedily into the rows below, so calls that ran
    at the same time sit on different rows. Bands follow the tree (depth first)."""
    next_row = 0

    def walk(run_node: _Node) -> None:
        nonlocal next_row
        top = next_row
        own = by_run.get(run_node.run, [])
        # Interval partitioning with a min-heap of (free at, lane): O(n log n) for any fan-out.
        free: list[tuple[float, int]] = []
        lanes = 0
        for n in sorted((n for n in own if n.kind == "sub"), key=lambda n: (n.t0, n.id)):
            end = n.t1 if n.t1 is not None else n.t0
            # 1 µs of slack: trace times are rounded to microseconds.
            if free and (free[0][0] <= n.t0 + 1e-6 or lanes >= MAX_LANES):
                _, lane = heapq.heappop(free)
            else:
                lane = lanes
                lanes += 1
            n.row = top + 1 + lane
            heapq.heappush(free, (end, lane))
        for n in own:
            if n.kind != "sub":
                n.row = top
        next_row = top + 1 + lanes

    by_run: dict[int, list[_Node]] = {}
    children_of: dict[int, list[_Node]] = {}
    for n in b.nodes:
        by_run.setdefault(n.run, []).append(n)
        if n.kind == "run" and n.parent >= 0:
            children_of.setdefault(b.nodes[n.parent].run, []).append(n)
    # Depth first without recursion: a trace is anyone's file, and its runs may nest thousands deep.
    stack = [b.nodes[root] for root in reversed(b.roots)]
    while stack:
        run_node = stack.pop()
        walk(run_node)
        stack.extend(reversed(children_of.get(run_node.run, [])))
    return next_row


def build_view(path: str | Path, limits: ViewLimits = LIMITS) -> dict[str, Any]:
    """The viewer's data for one trace file, within `limits` (reading.py). Raises TraceFormatError
    for files that are not traces."""
    path = Path(path)
    events, warnings = read_events(path, limits)
    builder = _Builder(events)
    del events  # the builder holds them, in order, until the nodes are made
    builder.build()
    builder.events = []
    warnings.extend(dict.fromkeys(builder.warnings))
    _close_open_intervals(builder)
    rows = _assign_rows(builder)
    root_runs = [builder.nodes[r] for r in builder.roots]
    if any(n.status == "running" for n in builder.nodes if n.kind == "run"):
        warnings.append("some runs have no run_end event: they were still going (or crashed) when read")
    first = root_runs[0]
    summary = {
        "question": first.detail.get("question"),
        "answer": first.detail.get("answer"),
        "stop_reason": first.status,
        "model": first.detail.get("model"),
        "sub_model": first.detail.get("sub_model"),
        "runs": sum(1 for n in builder.nodes if n.kind == "run"),
        "llm_calls": sum(1 for n in builder.nodes if n.kind in ("call", "sub")),
        "execs": sum(1 for n in builder.nodes if n.kind == "exec"),
        "input_tokens": sum(n.tokens_in for n in builder.nodes if n.kind in ("call", "sub")),
        "output_tokens": sum(n.tokens_out for n in builder.nodes if n.kind in ("call", "sub")),
        "cost_usd": round(sum(n.cost for n in builder.nodes if n.kind in ("call", "sub")), 10),
        "duration_s": round(max((n.t1 or 0.0) for n in root_runs) - min(n.t0 for n in root_runs), 6),
        "started_at": builder.origin,
    }
    nodes = [
        {
            "i": n.id,
            "p": n.parent,
            "k": n.kind,
            "l": n.label,
            "a": round(n.t0, 6),
            "b": round(n.t1 if n.t1 is not None else n.t0, 6),
            "r": n.row,
            "u": n.run,
            "ti": n.tokens_in,
            "to": n.tokens_out,
            "ca": n.cached,
            "c": round(n.cost, 10),
            "s": n.status,
            "ch": n.children,
        }
        for n in builder.nodes
    ]
    details = [json.dumps(n.detail, ensure_ascii=False, default=str) for n in builder.nodes]
    return {
        "version": VIEW_VERSION,
        "file": path.name,
        "warnings": warnings,
        "summary": summary,
        "rows": rows,
        "roots": builder.roots,
        "nodes": nodes,
        "details": details,
    }
