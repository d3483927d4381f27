"""examples/training/rollouts_env.py: groups of RLMEnv episodes to RL rows, end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "training" / "rollouts_env.py"


def load_example():
    spec = importlib.util.spec_from_file_location("rollouts_env_example", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_groups_of_episodes_become_rows_with_inherited_advantages(tmp_path: Path) -> None:
    example = load_example()
    out = tmp_path / "rows.jsonl"
    summary = await example.make_rows(out, families=("oolong",), tasks_per_family=1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["episodes"] == 3 and summary["rows"] == len(rows) and summary["child_rows"] > 0
    (rewards,) = summary["rewards"].values()
    assert len(set(rewards)) > 1  # the noisier children cost the root reward
    roots = {r["trajectory_id"]: r for r in rows if r["depth"] == 0 and r["is_last_step"]}
    assert sorted(r["reward"] for r in roots.values()) == sorted(rewards)
    assert abs(sum(r["advantage"] for r in roots.values())) < 1e-6  # group-relative
    for row in rows:
        assert row["advantage"] == roots[row["trajectory_id"]]["advantage"]  # children inherit
        assert row["group_size"] == 3 and row["prompt"] and isinstance(row["response"], str)
    children = [r for r in rows if r["depth"] == 1]
    assert all(r["parent_run_id"] != r["run_id"] and r["parent_run_id"] for r in children)
