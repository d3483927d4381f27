"""The whole worked example: rollouts, both exports, one training step on each, on the CPU.

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # the CPU build
    python examples/training/run.py [WORK_DIR]

Step by step from the shell, the same thing is:

    python examples/training/rollouts.py WORK_DIR/rollouts
    recursa export sft WORK_DIR/rollouts -o WORK_DIR/sft.jsonl --include-children
    recursa export rl WORK_DIR/rollouts -o WORK_DIR/steps.jsonl --group-by task --child-weight 1/k
    python examples/training/train_step.py WORK_DIR/sft.jsonl WORK_DIR/steps.jsonl
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rollouts import generate_rollouts
from train_step import grpo_step, read_jsonl, sft_step

from recursa.train import export_rl, export_sft


def main(work: Path) -> None:
    runs = generate_rollouts(work / "rollouts")
    print(f"{len(runs)} rollouts: scores {sorted({round(r['score'], 3) for r in runs})}\n")
    sft = export_sft([work / "rollouts"], work / "sft.jsonl", include_children=True)
    print(sft, end="\n\n")
    rl = export_rl([work / "rollouts"], work / "steps.jsonl", group_by="task", child_weight="1/k")
    print(rl, end="\n\n")
    for name, step, path in (("SFT", sft_step, sft.out), ("GRPO", grpo_step, rl.out)):
        assert path is not None
        stats = step(read_jsonl(path))
        print(
            f"{name:<5} rows={int(stats['rows'])} loss={stats['loss']:.4f} -> {stats['loss_after']:.4f} "
            f"after one step; parameters moved by {stats['param_change']:.4f} (L2)"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
