"""Helpers shared by several test modules."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

# Debian's Chromium for the viewer's browser tests (the `browser` fixture in conftest.py).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most [start, end) intervals open at one instant (an end sorts before a start at a tie)."""
    spans = list(intervals)
    points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    best = cur = 0
    for _, step in points:
        cur += step
        best = max(best, cur)
    return best


def request_overlap(records: Iterable[Any]) -> int:
    """How many fake-server requests were generating at once, from their recorded times."""
    return max_overlap((r.started_at, r.finished_at) for r in records)


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll until `check()` holds; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}")
        time.sleep(0.02)
