"""Episodes to training rows: the rows `recursa export rl` writes, from events kept in memory.

`group_rollouts(episodes)` is GRPO over a group of episodes of one task: each root's advantage is
(r - mean) / (std + eps), and every turn of its descendants inherits it (the SkyRL recipe), without
a round trip through trace files.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from recursa.env.shared import EnvError
from recursa.trace.reader import run_tree
from recursa.train.rl import Trajectory, grpo_advantages, trajectory_rows


class FinishedEpisode(Protocol):
    """An episode as `group_rollouts` reads it (`recursa.env.Episode` is the one there is); a
    protocol, so the episode module imports this one and not the other way round."""

    reward: float | None
    task_id: str | None

    def rollouts(
        self,
        *,
        reward: float | None = None,
        advantage: float = 0.0,
        group_id: str | None = None,
        group_size: int = 1,
        child_weight: str = "inherit",
        include_subcalls: bool = False,
    ) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Rollouts:
    reward: float
    advantage: float
    group_id: str
    group_size: int
    task_id: str | None


def episode_rows(
    events: list[dict[str, Any]],
    run_id: str,
    spec: Rollouts,
    child_weight: str = "inherit",
    include_subcalls: bool = False,
) -> list[dict[str, Any]]:
    runs, _ = run_tree(events)
    root = runs[run_id]
    shared = Trajectory(
        trajectory_id=run_id,
        trajectory_reward=spec.reward,
        advantage=spec.advantage,
        group_id=spec.group_id,
        group_size=spec.group_size,
        group_zero_variance=spec.advantage == 0.0 and spec.group_size > 0,
        task_id=spec.task_id,
    )
    return trajectory_rows(root, shared, child_weight=child_weight, include_subcalls=include_subcalls)


def checked_reward(value: Any, said: str, noun: str = "a reward") -> float:
    """A reward as a float: a real number (a bool counts as 1.0 / 0.0), finite. NaN would make every
    advantage of its group NaN, and infinity every other one zero."""
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    what = repr(value) if isinstance(value, numbers.Real) else f"{value!r} (a {type(value).__name__})"
    raise EnvError(f"{said} {what}; {noun} must be a finite number")


def group_rollouts(
    episodes: Sequence[FinishedEpisode],
    rewards: Sequence[float] | None = None,
    *,
    group_id: str | None = None,
    child_weight: str = "inherit",
    include_subcalls: bool = False,
) -> list[dict[str, Any]]:
    """Rows of a group of finished episodes (e.g. several samples of one task) with group-relative
    advantages that children inherit. `rewards` default to each episode's scorer reward (0.0 without
    one). A group with no reward variance gets advantage 0 and `group_zero_variance: true`."""
    if not episodes:
        return []
    values = list(rewards) if rewards is not None else [e.reward or 0.0 for e in episodes]
    if len(values) != len(episodes):
        raise EnvError(f"group_rollouts: {len(episodes)} episodes but {len(values)} rewards")
    values = [checked_reward(v, f"group_rollouts: reward {i} is") for i, v in enumerate(values)]
    advantages, zero = grpo_advantages(values)
    key = group_id or episodes[0].task_id or "group"
    rows: list[dict[str, Any]] = []
    for episode, value, advantage in zip(episodes, values, advantages, strict=True):
        made = episode.rollouts(
            reward=value,
            advantage=advantage,
            group_id=key,
            group_size=len(episodes),
            child_weight=child_weight,
            include_subcalls=include_subcalls,
        )
        for row in made:
            row["group_zero_variance"] = zero
        rows.extend(made)
    return rows
