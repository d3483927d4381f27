"""Step-wise RL rows with group-relative advantages that child runs inherit (the SkyRL recipe).

One row per model turn of every run in a trajectory (the root run and all its descendants):

    {"prompt": [...messages...], "response": "...", "trajectory_id": <root run id>,
     "run_id", "parent_run_id", "step" (0-based within its run), "depth", "is_last_step",
     "purpose", "reward" (the root's score on the root's last step, else 0.0), "trajectory_reward",
     "advantage", "weight", "group_id", "group_size", "group_zero_variance", "task_id", "model",
     "call_id", "temperature", "prompt_token_ids", "response_token_ids", "response_logprobs"}

Advantages are GRPO's, over the root runs of one group (by default one task):
A_i = (r_i - mean(r)) / (std(r) + 1e-4), with the sample standard deviation (Bessel-corrected),
as TRL's GRPOTrainer computes it. A group whose rewards are all equal (or that holds one run)
has advantage 0 and is flagged. Every step of a root run and of all its descendants carries the
root's advantage. `weight` is 1, or with child_weight="1/k" each of the k children of a run gets
its parent's weight divided by k, recursively (so a whole level of children weighs as much as
their parent).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recursa.lm.base import valid_unicode
from recursa.lm.tool_format import openai_messages
from recursa.trace import RunNode
from recursa.train.common import TracePaths, check_out, export_to, finished_nodes, load_scored
from recursa.train.errors import ExportError
from recursa.train.report import ExportReport
from recursa.train.scores import Score, ScoreSource
from recursa.train.source import SKIP_FOLDED, Step, TraceRun, run_steps, sub_steps

GROUP_BY = ("task", "question", "all")
CHILD_WEIGHTS = ("inherit", "1/k")
ADVANTAGE_EPS = 1e-4
DROP_ZERO_VARIANCE = "runs in groups with zero reward variance (--drop-zero-variance)"


def grpo_advantages(rewards: Sequence[float], eps: float = ADVANTAGE_EPS) -> tuple[list[float], bool]:
    """Group-relative advantages and whether the group has zero variance (then all are 0.0)."""
    if len(rewards) < 2:
        return [0.0] * len(rewards), True
    std = statistics.stdev(rewards)
    if math.isclose(std, 0.0, abs_tol=1e-12):
        return [0.0] * len(rewards), True
    mean = statistics.fmean(rewards)
    return [(r - mean) / (std + eps) for r in rewards], False


def child_weights(root: RunNode, mode: str = "inherit", *, count_subcalls: bool = False) -> dict[str, float]:
    """Weight per run id: 1.0 everywhere, or 1/k per level ("1/k"), k = the children a run spawned.

    With count_subcalls, a run's plain sub-calls count among its k children; their weight is
    under the key "<run id>/sub".
    """
    if mode not in CHILD_WEIGHTS:
        raise ExportError(f"child weight must be one of {', '.join(CHILD_WEIGHTS)}, got {mode!r}")
    weights: dict[str, float] = {}
    stack = [(root, 1.0)]  # not recursive: a crafted trace nests runs thousands deep
    while stack:
        node, weight = stack.pop()
        weights[node.run_id] = weight
        subs = _subcall_count(node) if count_subcalls else 0
        k = len(node.children) + subs
        share = weight / k if mode == "1/k" and k else weight
        if subs:
            weights[f"{node.run_id}/sub"] = share
        stack.extend((child, share) for child in reversed(node.children))
    return weights


def _subcall_count(node: RunNode) -> int:
    return sum(1 for e in node.of_type("lm_call") if e.get("purpose") == "sub")


def rl_rows(
    traces: TracePaths,
    *,
    scores: ScoreSource = None,
    group_by: str = "task",
    child_weight: str = "inherit",
    include_subcalls: bool = False,
    drop_zero_variance: bool = False,
    exclude: str | Path | None = None,
) -> tuple[list[dict[str, Any]], ExportReport]:
    """The rows and the report, without writing anything. See `export_rl` for the arguments;
    `exclude` is a file never read as input (the one being written)."""
    if group_by not in GROUP_BY:
        raise ExportError(f"group by must be one of {', '.join(GROUP_BY)}, got {group_by!r}")
    if child_weight not in CHILD_WEIGHTS:
        raise ExportError(f"child weight must be one of {', '.join(CHILD_WEIGHTS)}, got {child_weight!r}")
    report = ExportReport("rl")
    scored = load_scored(traces, scores, report, check_out(exclude))
    groups: dict[str, list[tuple[TraceRun, Score, float]]] = {}
    by_question = 0
    for item in scored:
        key, derived = _group_key(item[0], item[1], group_by)
        by_question += derived
        groups.setdefault(key, []).append(item)
    if by_question:
        report.notes.append(
            f"{by_question} run(s) had no task_id in the scores: grouped by question and context instead"
        )
    advantage: dict[str, tuple[float, str, int, bool]] = {}  # root run id -> (A, group, size, zero var)
    zero_groups = singletons = 0
    for key, members in groups.items():
        values, zero = grpo_advantages([value for _, _, value in members])
        zero_groups += zero
        singletons += len(members) == 1
        for (run, _, _), a in zip(members, values, strict=True):
            advantage[run.run_id] = (a, key, len(members), zero)
    report.groups = {
        "groups": len(groups),
        "zero_variance": zero_groups,
        "singletons": singletons,
        "mean_size": round(len(scored) / len(groups), 2) if groups else 0.0,
    }
    if singletons:
        report.notes.append(
            f"{singletons} group(s) hold a single run: their advantage is 0; sample several runs per task"
        )
    rows: list[dict[str, Any]] = []
    for run, score, value in scored:
        a, key, size, zero = advantage[run.run_id]
        if zero and drop_zero_variance:
            report.drop(DROP_ZERO_VARIANCE, run.path)
            continue
        shared = Trajectory(run.run_id, value, a, key, size, zero, score.task_id)
        made = trajectory_rows(
            run.node,
            shared,
            child_weight=child_weight,
            include_subcalls=include_subcalls,
            report=report,
            where=run.path,
        )
        rows.extend(made)
        if made:
            report.runs_used += 1
    report.rows = len(rows)
    return rows, report


@dataclass(frozen=True)
class Trajectory:
    """What every row of one root run and its descendants shares."""

    trajectory_id: str  # the root run's id
    trajectory_reward: float
    advantage: float = 0.0
    group_id: str = "all"
    group_size: int = 1
    group_zero_variance: bool = True
    task_id: str | None = None


def trajectory_rows(
    root: RunNode,
    shared: Trajectory,
    *,
    child_weight: str = "inherit",
    include_subcalls: bool = False,
    report: ExportReport | None = None,
    where: Path | None = None,
) -> list[dict[str, Any]]:
    """The rows of one root run and every finished descendant, each carrying the root's advantage
    (the reward sits on the root's last step). Also what `recursa.env` episodes hand a trainer."""
    report = report if report is not None else ExportReport("rl")
    where = where if where is not None else Path("<memory>")
    weights = child_weights(root, child_weight, count_subcalls=include_subcalls)
    rows: list[dict[str, Any]] = []
    for node in finished_nodes(root, report, where):
        steps = [s for s in run_steps(node, report) if _complete(s, report, where)]
        for i, step in enumerate(steps):
            is_last = i == len(steps) - 1
            reward = shared.trajectory_reward if node is root and is_last else 0.0
            rows.append(_row(step, node, shared, weights[node.run_id], is_last, reward))
        if include_subcalls:
            for step in sub_steps(node, report):
                rows.append(_row(step, node, shared, weights[f"{node.run_id}/sub"], True, 0.0))
    return rows


def _complete(step: Step, report: ExportReport, where: Path) -> bool:
    if not step.complete:
        report.skip(SKIP_FOLDED, where)
    return step.complete


def _group_key(run: TraceRun, score: Score, group_by: str) -> tuple[str, bool]:
    if group_by == "all":
        return "all", False
    if group_by == "task" and score.task_id is not None:
        # Samples of one policy on one task: a benchmark folder may hold several methods' runs.
        method = score.extra.get("method")
        return (f"{score.task_id}/{method}" if method else score.task_id), False
    digest = hashlib.sha1(run.task_key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"q-{digest}", group_by == "task"


def _row(
    step: Step, node: RunNode, shared: Trajectory, weight: float, is_last: bool, reward: float
) -> dict[str, Any]:
    return {
        # Valid Unicode for the trainer's tokenizer, in memory (Episode.rollouts) as in the file.
        "prompt": valid_unicode(openai_messages(step.prompt)),
        "response": valid_unicode(step.response),
        # The reply's native tool calls in OpenAI's format (the "tools" dialect); None for text replies.
        "response_tool_calls": valid_unicode(openai_messages([step.reply_message()])[0].get("tool_calls")),
        "trajectory_id": shared.trajectory_id,
        "run_id": node.run_id,
        "parent_run_id": node.parent_run_id,
        # Who made the call, as the X-RLM-Parent-Id header and a trainer's sub_call get it: the
        # parent run for a run's own turn, the calling run for a plain llm_query.
        "parent_id": node.run_id if step.purpose == "sub" else node.parent_run_id,
        "step": step.index,
        "depth": node.depth + (1 if step.purpose == "sub" else 0),
        "is_last_step": is_last,
        "purpose": step.purpose,
        "reward": reward,
        "trajectory_reward": shared.trajectory_reward,
        "advantage": shared.advantage,
        "weight": weight,
        "group_id": shared.group_id,
        "group_size": shared.group_size,
        "group_zero_variance": shared.group_zero_variance,
        "task_id": shared.task_id,
        "model": step.model,
        "call_id": step.call_id,
        "temperature": _temperature(step),
        "prompt_token_ids": step.prompt_token_ids,
        "response_token_ids": step.token_ids,
        "response_logprobs": step.logprobs,
    }


def _temperature(step: Step) -> float | None:
    value = (step.sampling or {}).get("temperature")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def export_rl(
    traces: TracePaths,
    out: str | Path,
    *,
    scores: ScoreSource = None,
    group_by: str = "task",
    child_weight: str = "inherit",
    include_subcalls: bool = False,
    drop_zero_variance: bool = False,
) -> ExportReport:
    """Write step-wise RL rows to `out` as JSONL and return the report.

    traces, scores: as for `export_sft`. group_by: "task" (the scores' task_id; runs without one
    are grouped by question and context hash), "question", or "all" (one group). child_weight:
    "inherit" (weight 1 everywhere) or "1/k" (each of k children gets its parent's weight / k,
    recursively). include_subcalls: also rows for plain llm_query calls whose prompt the trace holds
    whole (one step each; they count among their run's k children). drop_zero_variance: leave out
    runs whose group has no reward variance (their advantage is 0) instead of flagging them.
    """
    return export_to(
        out,
        lambda path: rl_rows(
            traces,
            scores=scores,
            group_by=group_by,
            child_weight=child_weight,
            include_subcalls=include_subcalls,
            drop_zero_variance=drop_zero_variance,
            exclude=path,
        ),
    )
