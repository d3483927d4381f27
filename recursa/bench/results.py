"""`results.jsonl`: one row per task instance and method, appended as each finishes, read back to resume."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

# Answers and golds of long-output families (pairs, copies) can be megabytes: rows keep the head,
# the tail, the length and the score, never the whole text.
ROW_TEXT_CHARS = 2_000
# ok: answered; failed: a clean method failure (scored 0); error: a harness error (tried again).
RowStatus = Literal["ok", "failed", "error"]


def clip(text: str | None, limit: int = ROW_TEXT_CHARS) -> str | None:
    if text is None or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ... [{len(text) - 2 * half:,} characters left out] ... {text[-half:]}"


def row_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """(instance, method, model, sub-model): what makes two rows the same piece of work."""
    instance = row.get("instance") or row["task_id"]
    return (str(instance), str(row["method"]), str(row["model"]), str(row.get("sub_model") or ""))


def finished(row: dict[str, Any]) -> bool:
    """Rows a re-run skips: answered or cleanly failed. Harness errors are tried again."""
    return row.get("status") in ("ok", "failed")


class ResultsFile:
    """Thread-safe appender over `results.jsonl`; every row is flushed and fsynced as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._tail_checked = False
        path.parent.mkdir(parents=True, exist_ok=True)

    def rows(self) -> list[dict[str, Any]]:
        """Every readable row; a line cut short by a crash is skipped, later rows win for one key."""
        if not self.path.exists():
            return []
        latest: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        with self.path.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and "task_id" in row and "method" in row:
                    latest[row_key(row)] = row
        return list(latest.values())

    def done_keys(self) -> set[tuple[str, str, str, str]]:
        return {row_key(r) for r in self.rows() if finished(r)}

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, ensure_ascii=False, default=str) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as fh:
            if not self._tail_checked:
                self._tail_checked = True
                # A crash can leave the last row cut short: start on a fresh line, or the first new
                # row would be glued to the broken one and lost with it.
                if _ends_mid_line(self.path):
                    line = "\n" + line
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self.append(row)


def _ends_mid_line(path: Path) -> bool:
    with path.open("rb") as fh:
        if fh.seek(0, os.SEEK_END) == 0:
            return False
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) != b"\n"
