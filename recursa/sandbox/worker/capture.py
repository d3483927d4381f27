"""Bounded capture of what a cell prints: the head and tail of each stream, and a count of the rest."""

from __future__ import annotations

import collections
import io
import threading


class BoundedText(io.TextIOBase):
    """A text stream that keeps the first and last `keep` characters and counts the rest.

    Printing 100 MB costs at most 2*keep characters of memory and never blocks.
    """

    def __init__(self, keep: int, name: str) -> None:
        super().__init__()
        self.keep = max(0, keep)
        self._name = name
        self.head: list[str] = []
        self.head_len = 0
        self.tail: collections.deque[str] = collections.deque()
        self.tail_len = 0
        self.dropped = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._name

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:  # type: ignore[override]
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        n = len(s)
        with self._lock:
            room = self.keep - self.head_len
            if room > 0:
                part = s[:room]
                self.head.append(part)
                self.head_len += len(part)
                s = s[room:]
            if s:
                if len(s) >= self.keep:
                    self.dropped += self.tail_len + len(s) - self.keep
                    self.tail.clear()
                    s = s[len(s) - self.keep :] if self.keep else ""
                    self.tail_len = 0
                if s:
                    self.tail.append(s)
                    self.tail_len += len(s)
                while self.tail_len > self.keep:  # drop whole chunks from the left, then trim one
                    first = self.tail[0]
                    excess = self.tail_len - self.keep
                    if len(first) <= excess:
                        self.tail.popleft()
                        self.tail_len -= len(first)
                        self.dropped += len(first)
                    else:
                        self.tail[0] = first[excess:]
                        self.tail_len -= excess
                        self.dropped += excess
        return n

    def parts(self) -> tuple[str, int, str]:
        with self._lock:
            return "".join(self.head), self.dropped, "".join(self.tail)


def _fit(head: str, dropped: int, tail: str, limit: int) -> tuple[str, int]:
    """Cut head+tail to `limit` characters around the middle; returns (text, omitted count)."""
    total = len(head) + len(tail)
    if total > limit:
        text = head + tail
        keep_head = (limit + 1) // 2
        keep_tail = limit - keep_head
        dropped += total - limit
        head, tail = text[:keep_head], text[len(text) - keep_tail :] if keep_tail else ""
    if dropped:
        return f"{head}\n[... {dropped:,} characters omitted ...]\n{tail}", dropped
    return head + tail, 0


class Capture:
    """stdout and stderr of one execution, cut to `limit` characters in total (stderr gets a third)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.out = BoundedText((self.limit + 1) // 2, "<stdout>")
        self.err = BoundedText((self.limit + 1) // 2, "<stderr>")

    def finish(self) -> tuple[str, str, int]:
        oh, od, ot = self.out.parts()
        eh, ed, et = self.err.parts()
        out_len, err_len = len(oh) + len(ot), len(eh) + len(et)
        err_share = min(err_len, max(self.limit // 3, self.limit - out_len))
        out_share = self.limit - err_share
        out, out_omitted = _fit(oh, od, ot, out_share)
        err, err_omitted = _fit(eh, ed, et, err_share)
        return out, err, out_omitted + err_omitted
