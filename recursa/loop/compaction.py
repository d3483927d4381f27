"""Keeping the root's history inside its window: older turns become a summary, kept whole in the REPL.

The root history is append-only so provider prefix caches hit; compaction breaks that once, when
the history nears `RLM(root_window_tokens=...)`. The summary is written by the root model itself
(it knows what mattered); every message, compacted or not, stays in the REPL as `root_history`.
"""

from __future__ import annotations

from dataclasses import dataclass

from recursa.config import RLMConfig
from recursa.lm.base import Message

# Compact when the next prompt would pass this share of the window; keep this many recent turns.
COMPACT_AT = 0.8
KEEP_RECENT_TURNS = 2
# Rough characters per token for the part of the history the provider has not counted yet: low on
# purpose, so the estimate errs towards compacting early rather than overflowing the window.
_CHARS_PER_TOKEN = 3

SUMMARY_REQUEST = (
    "Your conversation is about to outgrow your context window, so the older turns will be replaced "
    "by a summary that you write now. Summarise the work so far for yourself: what you learned about "
    "the context, which REPL variables hold which results, what is done and what is left, and any "
    "answer candidates. Write only the summary, no code."
)


@dataclass
class WindowTracker:
    """Estimates the next root prompt's tokens from the provider's last count plus what came since."""

    window_tokens: int
    counted_tokens: int = 0  # prompt + reply tokens of the last root call, as the provider billed them
    counted_messages: int = 0  # messages those tokens cover

    def record(self, prompt_tokens: int, reply_tokens: int, messages_covered: int) -> None:
        self.counted_tokens = prompt_tokens + reply_tokens
        self.counted_messages = messages_covered

    def estimate(self, messages: list[Message]) -> int:
        new = messages[self.counted_messages :] if self.counted_messages <= len(messages) else messages
        base = self.counted_tokens if self.counted_messages <= len(messages) else 0
        return base + sum(len(m["content"]) // _CHARS_PER_TOKEN + 8 for m in new)

    def needs_compaction(self, messages: list[Message]) -> bool:
        return self.estimate(messages) > COMPACT_AT * self.window_tokens and _compactable(messages)

    @classmethod
    def for_run(cls, config: RLMConfig, model_window: int | None) -> WindowTracker | None:
        """A run's tracker: at RLM(root_window_tokens=...), else at the root model's own window
        (less the reply's max_output_tokens) when it is known, so a long run compacts before a call
        could overflow; None: no window known, no compaction."""
        if config.root_window_tokens:
            return cls(config.root_window_tokens)
        if model_window is not None and model_window - config.max_output_tokens >= 1_000:
            return cls(model_window - config.max_output_tokens)
        return None


def _compactable(messages: list[Message]) -> bool:
    # system + first message + at least one older exchange beyond the turns we keep
    return len(messages) > 2 + 2 * KEEP_RECENT_TURNS + 1


def split_for_compaction(messages: list[Message]) -> tuple[list[Message], list[Message], list[Message]]:
    """(head kept: system + question, the middle to summarise, the recent turns kept)."""
    head, rest = messages[:2], messages[2:]
    cut = len(rest) - 2 * KEEP_RECENT_TURNS
    if cut > 0 and rest[cut]["role"] != "assistant":
        cut -= 1  # start the kept part at an assistant reply, so roles keep alternating
    return head, rest[:cut], rest[cut:]


def summary_prompt(head: list[Message], middle: list[Message], budget_chars: int) -> list[Message]:
    """The summary call: the same system prompt and question, the older turns, then the request."""
    share = max(budget_chars // max(len(middle), 1), 400)
    shown = [_cut(m, share) for m in middle]
    if shown and shown[-1]["role"] == "user":
        last = shown.pop()
        request = {"role": "user", "content": last["content"] + "\n\n" + SUMMARY_REQUEST}
    else:
        request = {"role": "user", "content": SUMMARY_REQUEST}
    return [*head, *shown, request]


def compacted_history(
    head: list[Message], summary: str, compacted: int, kept: list[Message]
) -> list[Message]:
    """System prompt, the first message with the summary appended (roles keep alternating), recent turns."""
    system, first = head
    note = (
        f"\n\n[{compacted} earlier messages were compacted to stay within the context window. The full "
        "text of every message so far is in the REPL variable `root_history` (a list of "
        "{'role', 'content'} dicts).]\nYour summary of the work so far:\n" + summary.strip()
    )
    return [system, {"role": first["role"], "content": first["content"] + note}, *kept]


def _cut(message: Message, limit: int) -> Message:
    text = message["content"]
    if len(text) <= limit:
        return message
    half = limit // 2
    return {
        **message,
        "content": f"{text[:half]}\n[... {len(text) - 2 * half:,} characters cut ...]\n{text[-half:]}",
    }
