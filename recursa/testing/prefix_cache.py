"""vLLM-style automatic prefix caching, as accounting only (nothing is computed, hits are counted).

A prompt is a token sequence: per message four marker tokens for its role, then its content in
4-character tokens (so the length is exactly `tokens.count_message_tokens`). Tokens are grouped in
full blocks of 16; a block's key is the hash of its parent's key and its own tokens, so a block hits
only when everything before it matched too. A lookup counts the leading blocks already cached (never
the whole prompt: like vLLM, at least the last token is computed), then stores every full block,
evicting the least recently used when over capacity. When a reply is done, the blocks it filled
are stored too (`store_generated`), so the next turn of a conversation hits on the previous reply.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from recursa.lm.base import Message

BLOCK_TOKENS = 16
_ROLE_TOKENS = 4


def _tokens(messages: list[Message]) -> Iterator[str]:
    for m in messages:
        role = m.get("role", "user")
        for k in range(_ROLE_TOKENS):
            yield f"\x00{role}\x00{k}"
        content = m.get("content", "")
        for start in range(0, len(content), 4):
            yield content[start : start + 4]


def block_keys(messages: list[Message]) -> tuple[list[int], int]:
    """(keys of the prompt's full blocks, total tokens)."""
    keys: list[int] = []
    parent = 0
    block: list[str] = []
    total = 0
    for tok in _tokens(messages):
        total += 1
        block.append(tok)
        if len(block) == BLOCK_TOKENS:
            parent = hash((parent, tuple(block)))
            keys.append(parent)
            block = []
    return keys, total


class PrefixCache:
    """An LRU set of block keys with hit counters; thread-safe (written on the server loop, read by tests)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self.lookups = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup_and_store(self, messages: list[Message]) -> tuple[int, int]:
        """(cached tokens, prompt tokens) for one request, then remember its blocks."""
        keys, total = block_keys(messages)
        with self._lock:
            self.lookups += 1
            self.prompt_tokens += total
            if self.capacity_blocks <= 0:
                return 0, total
            usable = (total - 1) // BLOCK_TOKENS  # the last token is always computed
            hits = 0
            for key in keys[:usable]:
                if key not in self._blocks:
                    break
                hits += 1
            self._store(keys)
            cached = hits * BLOCK_TOKENS
            self.cached_tokens += cached
            return cached, total

    def store_generated(self, messages: list[Message], reply: str) -> None:
        """Remember the blocks the reply filled, as vLLM does once decode completes a block.

        The sequence is the prompt, the assistant's role tokens and the reply: exactly how the next
        turn's prompt starts when it carries this reply, so a root's history hits there too.
        """
        if self.capacity_blocks <= 0 or not reply:
            return
        keys, _ = block_keys([*messages, {"role": "assistant", "content": reply}])
        with self._lock:
            self._store(keys)

    def _store(self, keys: list[int]) -> None:
        """Mark `keys` most recently used (adding the new ones), evicting beyond capacity. Lock held."""
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.evictions += 1

    @property
    def hit_ratio(self) -> float:
        with self._lock:
            return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.lookups = self.prompt_tokens = self.cached_tokens = self.evictions = 0
