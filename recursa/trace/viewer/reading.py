"""A trace file read for the viewer within fixed bounds, whatever its size or its lines hold.

A trace is written by models and by code they wrote, and a file can be edited by hand: it may be
gigabytes long, hold one line of gigabytes, or a line of millions of tiny values that take many
times their bytes once parsed. The viewer reads the file a line at a time and keeps, per view:

- no line longer than `max_line_bytes` (it is skipped, unread past that bound, and counted), nor
  one holding more than `max_line_values` JSON values or nesting deeper than `max_line_nesting`
  (counted in its text before anything is built from it: recursa/json_bounds.py);
- from each event, strings up to `max_field_chars` and lists and objects up to `max_items`
  entries (the rest is marked as left out, with how much);
- at most `max_events` events and `max_weight` of what they hold (characters of text, and
  `_SLOT` for each value, list or object, about what Python keeps for one): the file past the
  first event beyond either bound is not read, and the view's warning says how far it got.

So one view (and so one request of `recursa view`'s server, which builds one at a time) holds a
bounded amount whatever the file is; docs/traces.md gives the measured figure.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from recursa.json_bounds import TooDeepJSON, TooMuchJSON, check_bounds
from recursa.trace.reader import parse_line


@dataclass(frozen=True)
class ViewLimits:
    """What one view of a trace may hold (see the module doc)."""

    max_events: int = 40_000
    max_weight: int = 32_000_000
    max_field_chars: int = 50_000
    max_items: int = 1_000
    max_line_bytes: int = 16 << 20
    max_line_values: int = 200_000  # JSON values in one line, counted before it is parsed
    max_line_nesting: int = 256


LIMITS = ViewLimits()
# What one kept value (a number, a list, an object, a string's own header) weighs beside its text.
_SLOT = 16


class TraceFormatError(ValueError):
    """The file is not a recursa trace (or nothing in it can be read)."""


@dataclass
class ReadTrace:
    """The events kept, and what the reading left out."""

    events: list[dict[str, Any]]
    bad_lines: int = 0
    last_line_cut: bool = False  # the last line is not JSON: the run was still writing or crashed
    long_lines: int = 0  # lines past max_line_bytes, skipped
    dense_lines: int = 0  # lines past max_line_values or max_line_nesting, skipped
    clipped: int = 0  # events with a field shown only in part
    stopped_at: int | None = None  # bytes read when a bound stopped the reading
    size: int = 0  # the file's size when it was opened

    def warnings(self, limits: ViewLimits) -> list[str]:
        out = []
        if self.last_line_cut:
            out.append("the last line is cut off: the run was still writing or crashed")
        if self.bad_lines:
            out.append(f"{self.bad_lines} lines are not trace events and were skipped")
        if self.long_lines:
            out.append(
                f"{self.long_lines} lines are longer than the viewer reads ({limits.max_line_bytes >> 20} MiB) "
                "and were skipped"
            )
        if self.dense_lines:
            out.append(
                f"{self.dense_lines} lines hold more JSON values than the viewer reads in one line "
                f"({limits.max_line_values:,}, nested at most {limits.max_line_nesting} deep) and were skipped"
            )
        if self.clipped:
            out.append(
                f"{self.clipped} events hold more text than the viewer shows (a string past "
                f"{limits.max_field_chars:,} characters, a list past {limits.max_items:,} items): each "
                "such field says how much was left out; the trace file holds it all"
            )
        if self.stopped_at is not None:
            out.append(
                f"this trace is larger than the viewer shows: it shows the first {len(self.events):,} "
                f"events ({_mb(self.stopped_at)} of {_mb(self.size)}), at most {limits.max_events:,} events "
                "and a bounded amount of text per view; the rest is in the file (recursa.trace.load reads "
                "it all)"
            )
        return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def read_trace(path: Path, limits: ViewLimits, parse_constant: Any) -> ReadTrace:
    """The events of `path` (each a dict with a str `type`), read within `limits`."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise TraceFormatError(f"cannot read {path}: {exc.strerror}") from None
    with fh:
        read = ReadTrace([], size=os.fstat(fh.fileno()).st_size)
        weight = 0
        at = 0  # bytes read
        pending_bad = False  # the last line read was not JSON: cut off if nothing follows it
        while raw := _line(fh, limits.max_line_bytes):
            start, at = at, at + len(raw)
            if len(raw) > limits.max_line_bytes:
                at += _skip_line(fh)
                read.long_lines += 1
                continue
            if not raw.strip():
                continue
            read.bad_lines += pending_bad
            pending_bad = False
            try:
                values = check_bounds(raw, limits.max_line_values, limits.max_line_nesting)
            except (TooMuchJSON, TooDeepJSON):
                read.dense_lines += 1
                continue
            line = raw.decode("utf-8", "replace")
            try:
                event = parse_line(line, parse_constant=parse_constant)
            except ValueError as exc:  # not JSON, or nested thousands deep (not an event recursa writes)
                if isinstance(exc, json.JSONDecodeError):
                    pending_bad = True
                else:
                    read.bad_lines += 1
                continue
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                read.bad_lines += 1
                continue
            kept = _Clip(limits)
            if len(raw) <= limits.max_field_chars and values <= limits.max_items:
                # Nothing in it can be cut (no string nor list that long): weighed by its text.
                kept.weight = len(raw) + _SLOT * values
            else:
                event = kept.value(event)
            if len(read.events) >= limits.max_events or weight + kept.weight > limits.max_weight:
                read.stopped_at = start
                break
            weight += kept.weight
            read.clipped += kept.clipped
            read.events.append(event)
        read.last_line_cut = pending_bad
    return read


def _line(fh: IO[bytes], limit: int) -> bytearray:
    """The next line (empty at the end of the file), or its first `limit` + 1 bytes when it is
    longer: read a bounded piece at a time into one buffer, so a line past the limit costs the limit
    once (readline(limit) held a second copy of it while joining its pieces)."""
    line = bytearray()
    while len(line) <= limit:
        piece = fh.readline(min(1 << 20, limit + 1 - len(line)))
        line += piece
        if not piece or piece.endswith(b"\n"):
            break
    return line


def _skip_line(fh: IO[bytes]) -> int:
    """Read past the rest of an overlong line, a bounded piece at a time; the bytes skipped."""
    skipped = 0
    while piece := fh.readline(1 << 20):
        skipped += len(piece)
        if piece.endswith(b"\n"):
            break
    return skipped


class _Clip:
    """One event cut to the limits, and what it weighs."""

    def __init__(self, limits: ViewLimits) -> None:
        self.limits = limits
        self.weight = 0
        self.clipped = 0  # 0 or 1: whether any field of the event was cut

    def value(self, value: Any) -> Any:
        self.weight += _SLOT
        limits = self.limits
        if isinstance(value, str):
            if len(value) <= limits.max_field_chars:
                self.weight += len(value)
                return value
            self.clipped = 1
            self.weight += limits.max_field_chars
            left = len(value) - limits.max_field_chars
            return value[: limits.max_field_chars] + f"… [{left:,} more characters in the trace file]"
        if not isinstance(value, (dict, list)):
            return value
        # (Recursion is bounded: a line nests at most max_line_nesting deep.)
        if isinstance(value, list):
            out = [self.value(item) for item in value[: limits.max_items]]
            if len(value) > limits.max_items:
                self.clipped = 1
                out.append(f"… [{len(value) - limits.max_items:,} more items in the trace file]")
            return out
        kept: dict[str, Any] = {}
        for i, (key, item) in enumerate(value.items()):
            if i == limits.max_items:
                self.clipped = 1
                kept["…"] = f"[{len(value) - limits.max_items:,} more entries in the trace file]"
                break
            if len(key) > limits.max_field_chars:
                self.clipped = 1
                key = key[: limits.max_field_chars] + "…"
            self.weight += len(key)
            kept[key] = self.value(item)
        return kept
