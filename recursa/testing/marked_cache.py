"""Anthropic-style prompt caching, as accounting only: a prefix is cached only where the request
marks it with `cache_control`, and read back only by a later request that marks it again.

What Anthropic documents, kept here at message granularity (a mark on any block of a message is
taken as a mark at the message's end): a marked prefix of at least `min_tokens` is written (billed
as `cache_creation_input_tokens`) unless it is cached already; a request reads the longest cached
prefix that ends at one of its marks or at most `LOOKBACK` messages before one (billed as
`cache_read_input_tokens`); the rest of the prompt is plain input. Tokens are counted as the fake
server counts them (`recursa.lm.tokens.count_message_tokens`). Entries expire least recently used
first, beyond `capacity`; nothing expires by time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from recursa.lm.base import Message
from recursa.lm.tokens import count_message_tokens

LOOKBACK = 20  # Anthropic looks this many blocks back from a breakpoint for an earlier hit
MIN_TOKENS = 1024  # the smallest prompt Anthropic caches for most models


class MarkedCache:
    """Thread-safe (written on the server loop, read by tests)."""

    def __init__(self, min_tokens: int = MIN_TOKENS, capacity: int = 65_536) -> None:
        self.min_tokens = min_tokens
        self.capacity = capacity
        self._entries: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def lookup_and_store(self, messages: list[Message], marks: Sequence[int]) -> tuple[int, int]:
        """(tokens read from the cache, tokens written to it) for a prompt whose messages at the
        indices `marks` carry a `cache_control` mark; then remember the marked prefixes."""
        if not marks:
            return 0, 0
        keys: list[int] = []
        lengths: list[int] = []
        parent = 0
        for i, message in enumerate(messages[: max(marks) + 1]):
            parent = hash((parent, message.get("role"), message.get("content") or ""))
            keys.append(parent)
            lengths.append((lengths[-1] if i else 0) + count_message_tokens([message]))
        candidates = sorted({i for m in marks for i in range(max(0, m - LOOKBACK), m + 1)}, reverse=True)
        with self._lock:
            read = next((lengths[i] for i in candidates if keys[i] in self._entries), 0)
            written = 0
            for m in sorted(set(marks)):
                if lengths[m] < self.min_tokens:
                    continue
                if keys[m] in self._entries:
                    self._entries.move_to_end(keys[m])
                else:
                    self._entries[keys[m]] = None
                    written = max(written, lengths[m] - read)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            for i in candidates:
                if keys[i] in self._entries:
                    self._entries.move_to_end(keys[i])
                    break
        return read, written

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
