"""A rough, deterministic token count: what the offline stand-ins (scripted models, fake server)
report, and what the baselines use to fit a context into a window.

Roughly what BPE tokenizers give for English (one token per ~4 characters), and deterministic so
tests can compare the usage the engine adds up with what the server saw. For a bound that holds
for every tokenizer, see `recursa.lm.base.estimate_tokens_upper`.
"""

from __future__ import annotations

from recursa.lm.base import Message


def count_tokens(text: str) -> int:
    return tokens_for_chars(len(text))


def tokens_for_chars(chars: int) -> int:
    return (chars + 3) // 4


def count_message_tokens(messages: list[Message]) -> int:
    return sum(count_tokens(m.get("content", "")) + 4 for m in messages)
