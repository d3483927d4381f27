"""Stream a run tree's events to one JSONL file as they happen, so a crash loses nothing.

Every event is one line: `{"seq", "ts", "type", "run_id", ...}`. Children write into the same
file as their parent (with `parent_run_id`), which makes a trace self-contained. Long texts are
folded (head, tail and length) so a trace's size does not grow with the context.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recursa.trace.redact import Redactor

EventListener = Callable[[dict[str, Any]], None]

DEFAULT_FOLD_CHARS = 4_000
# Stored in every run_start as "format". Bump it when readers must tell traces apart (exporters refuse
# what they cannot rebuild). 1: root calls carry `new_messages` (the append-only history, each
# message once). Traces from before this field existed have the same layout.
TRACE_FORMAT = 1


def fold(text: str | None, limit: int = DEFAULT_FOLD_CHARS) -> str | None:
    """Head and tail of a long text with the number of characters left out, for storing in traces."""
    if text is None or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half:,} characters folded] ...\n{text[-half:]}"


def default_trace_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recursa" / "traces"


class TraceWriter:
    """Thread-safe JSONL event sink; also fans events out to in-process listeners (progress, UIs)."""

    def __init__(
        self,
        path: Path | None,
        redactor: Redactor,
        listeners: list[EventListener] | None = None,
    ) -> None:
        self.path = path
        self.redact = redactor  # also for the tree's other host messages (tools, model errors)
        self._listeners = list(listeners or [])
        self._lock = threading.Lock()
        self._seq = 0
        self._file = None
        # Recordings put off by `defer`, the thread that put them off, and what one of them raised
        # when the event loop ran it (raised again by the next `flush`).
        self._deferred: collections.deque[Callable[[], object]] = collections.deque()
        self._deferring = 0
        self._failed: BaseException | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Line-buffered: every event reaches the OS as soon as it is written, so a host that is
            # killed leaves every event before that moment on disk (at most the last line is cut).
            # backslashreplace: a lone surrogate (a model reply can carry one as a JSON escape) is
            # written as its JSON escape instead of failing the write, and with it the run.
            self._file = open(path, "a", encoding="utf-8", errors="backslashreplace", buffering=1)

    def defer(self, record: Callable[[], object]) -> None:
        """Run `record` (a recording that emits) at the event loop's next turn, or before any later
        event of this thread, or at `flush`, whichever comes first: the events keep their order, and
        a trainer's reply is recorded while its cell runs in the REPL, not before the cell is sent
        (docs/performance.md, "RL step, fourth pass"). Called on the event loop's thread."""
        self._deferred.append(record)
        self._deferring = threading.get_ident()
        if len(self._deferred) == 1:
            asyncio.get_running_loop().call_soon(self._flush_soon)

    def flush(self) -> None:
        """Run the recordings `defer` holds, now; raises what one of them raised meanwhile."""
        failed, self._failed = self._failed, None
        while self._deferred:
            self._deferred.popleft()()
        if failed is not None:
            raise failed

    def _flush_soon(self) -> None:
        try:
            self.flush()
        except BaseException as exc:  # for the run's own flush to raise, as if recorded in its turn
            self._failed = exc

    def emit(self, event_type: str, **fields: Any) -> dict[str, Any]:
        if self._deferred and threading.get_ident() == self._deferring:
            self.flush()  # what was put off comes first
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "ts": round(time.time(), 6), "type": event_type, **fields}
            if isinstance(event.get("error"), str):  # a host's message: scrubbed in full, listeners too
                event["error"] = self.redact(event["error"])
            if self._file is not None:
                line = self.redact.bulk(_ENCODER.encode(event))
                self._file.write(line + "\n")
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken progress bar must never break a run
                pass
        return event

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return repr(value)


# One encoder for every event: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, default=_jsonable)
