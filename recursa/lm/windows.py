"""How many tokens each model takes in one call, and whether a prompt fits before it is sent.

Windows come from `context_windows={model: tokens}` first (a "provider/model" name or a bare
model name), then genai-prices' model data; a model neither knows has no window, and its calls
are sent as they are (the provider's own refusal is then the only check).

A prompt's tokens are estimated at one per three bytes of UTF-8 plus a few per message: above what
BPE tokenizers give for English text and code (about four characters per token), so a call
refused here would almost surely have been refused by the provider, after the wait and the
network; a prompt of unusual text (many digits, CJK) can still exceed its estimate, and the
provider's refusal is then reported the same way.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from recursa.errors import ContextLengthError
from recursa.lm.base import IMAGE_TOKENS_UPPER, Message
from recursa.lm.prices import genai
from recursa.lm.registry import parse_model

_BYTES_PER_TOKEN = 3
_TOKENS_PER_MESSAGE = 8


def prompt_tokens(messages: list[Message]) -> int:
    """The estimate described in the module docstring."""
    total = 0
    for m in messages:
        total += _TOKENS_PER_MESSAGE + _content_tokens(m.get("content"))
        if m.get("tool_calls"):
            total += _text_tokens(json.dumps(m["tool_calls"], ensure_ascii=False))
    return total


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):  # content parts: text and images
        return sum(
            IMAGE_TOKENS_UPPER if p.get("type") == "image" else _content_tokens(p.get("text"))
            for p in content
            if isinstance(p, dict)
        )
    return 0


def _text_tokens(text: str) -> int:
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // _BYTES_PER_TOKEN)


@functools.lru_cache(maxsize=512)
def listed_window(provider: str, model: str) -> int | None:
    """The context window genai-prices lists for the model, or None."""
    try:
        _, info = genai().data_snapshot.get_snapshot().find_provider_model(model, None, provider, None)
    except LookupError:
        return None
    window = getattr(info, "context_window", None)
    return window if isinstance(window, int) and window > 0 else None


class ContextWindows:
    """Windows by model spec: the user's overrides, then genai-prices."""

    def __init__(self, overrides: dict[str, int] | None = None) -> None:
        self.overrides = dict(overrides or {})

    def window(self, spec: str) -> int | None:
        provider, model = parse_model(spec)
        found = self.overrides.get(spec) or self.overrides.get(model)
        return found if found is not None else listed_window(provider, model)

    def check(self, spec: str, messages: list[Message], max_output_tokens: int) -> None:
        """Raise ContextLengthError, naming both sizes, when the prompt and the reply it may get
        cannot fit in the model's window. Nothing is sent."""
        window = self.window(spec)
        if window is None:
            return
        tokens = prompt_tokens(messages)
        if tokens + max_output_tokens <= window:
            return
        chars = sum(_chars(m.get("content")) for m in messages)
        raise ContextLengthError(
            f"the prompt is about {tokens:,} tokens ({chars:,} characters) and the reply may take "
            f"«max_output_tokens={max_output_tokens}», but {spec} takes {window:,} tokens in all; "
            "nothing was sent"
        )


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: the text's characters (images are counted as tokens)
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0
