"""Training data from traces: SFT rows per root turn, step-wise RL rows with inherited advantages.

from recursa.train import export_sft, export_rl
report = export_sft(["bench-out/"], "sft.jsonl", min_score=0.5)
report = export_rl(["bench-out/"], "steps.jsonl", group_by="task", child_weight="1/k")
print(report)        # what was read, skipped, filtered, fixed and written

The same from the shell: `recursa export sft ...` and `recursa export rl ...`. Scores come from a
`recursa bench --out` folder's results.jsonl or a JSONL you supply (recursa.train.scores documents
the row format). No trainer is a dependency: rows are plain JSON in the formats TRL and
step-wise RL trainers read.
"""

from recursa.train.errors import ExportError
from recursa.train.report import ExportReport
from recursa.train.rl import export_rl, rl_rows
from recursa.train.sft import export_sft, sft_rows

__all__ = [
    "ExportError",
    "ExportReport",
    "export_rl",
    "export_sft",
    "rl_rows",
    "sft_rows",
]
