"""What an export did: rows written, and every run or turn it left out, counted by reason."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.lm.base import valid_unicode
from recursa.train.errors import ExportError

# Named examples of skipped inputs kept per reason: enough to find the files, not a flood.
_EXAMPLES_PER_REASON = 5


@dataclass
class ExportReport:
    kind: str  # "sft" | "rl"
    out: Path | None = None
    traces: int = 0  # trace files read
    runs: int = 0  # root runs found in them
    runs_used: int = 0  # root runs that gave at least one row
    rows: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # runs (or files) left out, by reason
    dropped: Counter[str] = field(default_factory=Counter)  # the filters' work, by reason
    fixes: Counter[str] = field(default_factory=Counter)  # programmatic fixes applied, by kind
    groups: dict[str, float] = field(default_factory=dict)  # RL: group statistics
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> a few file names
    notes: list[str] = field(default_factory=list)
    fixes_on: bool = True  # SFT: whether programmatic fixes were applied

    def skip(self, reason: str, where: str | Path | None = None, n: int = 1) -> None:
        self.skipped[reason] += n
        self._example(reason, where)

    def drop(self, reason: str, where: str | Path | None = None, n: int = 1) -> None:
        self.dropped[reason] += n
        self._example(reason, where)

    def _example(self, reason: str, where: str | Path | None) -> None:
        if where is None:
            return
        names = self.examples.setdefault(reason, [])
        if len(names) < _EXAMPLES_PER_REASON and str(where) not in names:
            names.append(str(where))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "out": str(self.out) if self.out else None,
            "traces": self.traces,
            "runs": self.runs,
            "runs_used": self.runs_used,
            "rows": self.rows,
            "skipped": dict(self.skipped),
            "dropped": dict(self.dropped),
            "fixes": dict(self.fixes),
            "groups": dict(self.groups),
            "examples": {k: list(v) for k, v in self.examples.items()},
            "notes": list(self.notes),
        }

    def lines(self) -> list[str]:
        """The human report the CLI prints."""
        out = [f"read {self.traces} trace file(s) holding {self.runs} root run(s)"]
        out += _section("skipped", self.skipped, self.examples)
        out += _section("filtered out", self.dropped, self.examples)
        if self.kind == "sft":
            if not self.fixes_on:
                out.append("programmatic fixes: off")
            elif self.fixes:
                out.append("programmatic fixes:")
                out += [f"  {n:>6}  {reason}" for reason, n in sorted(self.fixes.items())]
            else:
                out.append("programmatic fixes: none needed")
        if self.groups:
            g = self.groups
            out.append(
                f"groups: {int(g.get('groups', 0))} ({int(g.get('zero_variance', 0))} with zero reward "
                f"variance, flagged; {int(g.get('singletons', 0))} of a single run); "
                f"mean size {g.get('mean_size', 0.0):.2f}"
            )
        out += [f"note: {note}" for note in self.notes]
        target = f" to {self.out}" if self.out else ""
        out.append(f"wrote {self.rows} row(s) from {self.runs_used} run(s){target}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _section(title: str, counts: Counter[str], examples: dict[str, list[str]]) -> list[str]:
    if not counts:
        return []
    lines = [f"{title}:"]
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {n:>6}  {reason}")
        names = examples.get(reason)
        if names:
            more = f" (and {n - len(names)} more)" if n > len(names) else ""
            lines.append(f"          e.g. {', '.join(names)}{more}")
    return lines


def write_jsonl(rows: Iterable[dict[str, Any]], out: str | Path) -> int:
    """Write rows as JSON lines (UTF-8, one object per line); returns how many."""
    path = Path(out).expanduser()
    n = 0
    # Written beside the target and renamed over it at the end, so a failure half-way (a full
    # disk, a row that is not JSON) leaves the earlier file whole instead of cut short.
    partial = path.with_name(f".{path.name}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "w", encoding="utf-8") as fh:
            for row in rows:
                # A surrogate (from a context read with surrogateescape) has no UTF-8 form.
                fh.write(json.dumps(valid_unicode(row), ensure_ascii=False) + "\n")
                n += 1
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return n
