"""What a model call attempt counts for when it fails or reports no usage: recursa's billing policy.

Usage, cost and the budget count every attempt the provider could have billed, not just the one
that succeeded:

- Not billed: an HTTP error answer (429, 5xx, any 4xx: the provider refused or failed the request
  before producing anything it charges for), and a request that never reached the server
  (connection refused, DNS failure, connect timeout).
- Billed: an attempt that reached the server and then failed without an error status: a 200 whose
  body was not valid JSON or carried no choices (Anthropic: no content blocks), a response cut off
  mid-body or a connection reset after the request went out, a read timeout. The provider may have
  run the model for it. Usage the body reported is counted as reported; otherwise the prompt is
  counted as input tokens, estimated, and the output as zero (the reply never arrived to count).
- A 200 that answered but reported no usage: both sides are estimated (the prompt, and the reply
  text), never counted as zero.

Estimates use about four characters per token plus four tokens of chat framing per message, the
usual ratio for English text under BPE tokenizers; the trace marks them (`usage_estimated`).
Budget caps still hold: every counted attempt is settled against its own worst-case reservation,
and a retry reserves afresh, so a run that cannot afford another attempt stops instead of
overspending.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recursa.errors import LMError
from recursa.lm.base import IMAGE_TOKENS_UPPER, LMResponse, Message

_CHARS_PER_TOKEN = 4
_TOKENS_PER_MESSAGE = 4


def reported_count(value: Any) -> int:
    """A token count as a server reported it: a whole number >= 0, else 0. A server's usage is
    hostile input too: a negative count would hand budget back, and a NaN or a string failed the
    run where the answer was fine."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass(frozen=True)
class AttemptUsage:
    """What one billed attempt counts for."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    provider_cost_usd: float | None = None
    estimated: bool = False


class BilledFailure(LMError):
    """A failed attempt the provider may have billed.

    `usage` is None when the answer reported none; whoever knows the prompt fills in an estimate
    (`recursa.lm.api_call` does, before the error leaves the client).
    """

    def __init__(
        self,
        message: str,
        *,
        usage: AttemptUsage | None = None,
        status: int | None = None,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status=status, retryable=retryable, retry_after=retry_after)
        self.usage = usage


def estimate_text_tokens(text: str) -> int:
    return (len(text) + _CHARS_PER_TOKEN - 1) // _CHARS_PER_TOKEN


def estimate_prompt_tokens(messages: Sequence[Message]) -> int:
    return sum(estimate_text_tokens(_message_text(m)) + _TOKENS_PER_MESSAGE for m in messages)


def estimate_reply_tokens(response: LMResponse) -> int:
    calls = [{"name": c.name, "arguments": c.arguments} for c in response.tool_calls]
    return estimate_text_tokens(response.text) + (estimate_text_tokens(_json(calls)) if calls else 0)


def _message_text(message: Message) -> str:
    # Tool-calling turns carry their calls beside (or instead of) text; the provider bills both.
    text = message.get("content") or ""
    if isinstance(text, list):  # content parts: an image counts as its worst case, not its base64
        images = sum(1 for p in text if isinstance(p, dict) and p.get("type") == "image")
        words = "".join(str(p.get("text") or "") for p in text if isinstance(p, dict))
        text = words + "x" * (IMAGE_TOKENS_UPPER * _CHARS_PER_TOKEN * images)
    elif not isinstance(text, str):
        text = _json(text)
    calls = message.get("tool_calls")
    return f"{text}{_json(calls)}" if calls else text


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def estimated_prompt_usage(messages: Sequence[Message]) -> AttemptUsage:
    """The count for an attempt that reported nothing: its prompt, and no output."""
    return AttemptUsage(input_tokens=estimate_prompt_tokens(messages), output_tokens=0, estimated=True)


def as_billed(err: LMError, usage: AttemptUsage) -> BilledFailure:
    """The same error, marked as billed with `usage`."""
    return BilledFailure(
        str(err), usage=usage, status=err.status, retryable=err.retryable, retry_after=err.retry_after
    )
