"""The one small protocol every model backend implements, and its values."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# {"role": "system" | "user" | "assistant" | "tool", "content": str}; tool conversations add the
# keys described in recursa/lm/tool_format.py; a sub-call with images has a list of content parts
# (recursa/lm/images.py).
Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A model's request to call one tool. `error` is set when its arguments were unusable."""

    id: str
    name: str
    arguments: dict[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class CallMeta:
    """Who is calling: carried to the trace and, as X-RLM-* headers, to trainers behind a base URL."""

    call_id: str
    parent_id: str | None = None
    depth: int = 0
    purpose: str = "root"  # "root" | "sub" | "final"
    run_id: str | None = None  # the run that makes the call (the gateway fills it in)
    send_headers: bool = True  # RLM(call_headers=False) keeps the X-RLM-* headers off the wire

    def headers(self) -> dict[str, str]:
        if not self.send_headers:
            return {}
        out = {"X-RLM-Call-Id": self.call_id, "X-RLM-Depth": str(self.depth)}
        if self.run_id:
            out["X-RLM-Run-Id"] = self.run_id
        if self.parent_id:
            out["X-RLM-Parent-Id"] = self.parent_id
        return out


@dataclass
class LMRequest:
    messages: list[Message]
    max_output_tokens: int
    meta: CallMeta
    temperature: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # {"name", "description", "parameters"} offered to the model
    # Set on calls whose conversation goes on (a run's own turns): the same key on every turn of
    # one run. Clients pass it to what helps the provider's prompt cache (Anthropic cache_control
    # marks, OpenAI's prompt_cache_key); None (sub-calls) asks for nothing.
    cache_key: str | None = None


@dataclass
class LMResponse:
    text: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # read from the provider's prompt cache; part of input_tokens
    cache_write_tokens: int = 0  # written to it (Anthropic); part of input_tokens
    provider_cost_usd: float | None = None  # a cost the provider reported wins over our price table
    model: str | None = None  # the model name the provider says answered
    finish_reason: str | None = None
    attempts: int = 1
    # The answer reported no usage, so the token counts are estimates (see recursa.lm.billing).
    usage_estimated: bool = False
    # Filled only when the backend returned them (e.g. vLLM with logprobs / return_token_ids): what
    # policy-gradient trainers need to score a rollout without re-tokenising it.
    logprobs: list[float] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@runtime_checkable
class LMClient(Protocol):
    """An async chat model. Implementations must be safe to call concurrently.

    This is also what `RLM(model=..., sub_model=...)` accepts in place of a model name (docs/clients.md).
    For those objects only `complete` is required, and it may be a plain `def` (it then runs in a
    thread) returning just the reply text (usage is then estimated); `provider` and `model` name the
    client in usage and traces and let its price be found; recursa does not close it.
    """

    provider: str
    model: str

    async def complete(self, request: LMRequest) -> LMResponse:
        """One chat completion. Raises `recursa.errors.LMError` (or a subclass) on failure."""
        ...

    async def aclose(self) -> None: ...


def estimate_tokens_upper(messages: list[Message], max_output_tokens: int = 0) -> int:
    """A worst case for the tokens a call can be billed: what budget reservations use.

    Every BPE tokenizer we know of (tiktoken, SentencePiece, Claude's) emits at most one token per
    UTF-8 byte plus a few per message for the chat template, so this bound holds for any provider.
    """
    total = 8
    for m in messages:
        total += content_bytes(m.get("content")) + 8
        if m.get("tool_calls"):
            total += _utf8_len(json.dumps(m["tool_calls"], ensure_ascii=False))
    return total + max_output_tokens


# No provider bills more for one image than this, after its own resizing (Anthropic about 1,600
# tokens, OpenAI at most about 1,100): what a reservation counts per image part.
IMAGE_TOKENS_UPPER = 2_000


def content_bytes(content: Any) -> int:
    """UTF-8 bytes of a message's text (str content, or the text parts of a list of content parts,
    recursa/lm/images.py), plus IMAGE_TOKENS_UPPER per image part."""
    if isinstance(content, list):
        return sum(
            IMAGE_TOKENS_UPPER if p.get("type") == "image" else _utf8_len(p.get("text") or "")
            for p in content
            if isinstance(p, dict)
        )
    return _utf8_len(content or "")


def _utf8_len(text: str) -> int:
    # Every call prices the whole history: ASCII text (most of it) is measured without encoding.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def valid_unicode(value: Any) -> Any:
    """`value` (a str, or dicts and lists holding them) with every surrogate made valid Unicode: two
    that form a pair become the character they encode, a lone one U+FFFD. A str can hold them (a
    context decoded with `surrogateescape`, a string cut inside a UTF-16 pair) and the REPL passes
    them on, but a trainer's tokenizer, a UTF-8 file and a strict JSON reader all refuse them."""
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return _paired(value)
        return value
    if isinstance(value, dict):
        return {k: valid_unicode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [valid_unicode(v) for v in value]
    return value


def utf8_json(value: Any) -> bytes:
    """`value` as UTF-8 JSON, with surrogates made valid as `valid_unicode` does: sent as they are,
    they have no UTF-8 form, so encoding the body failed (or sent invalid UTF-8) wherever a str held
    them. Text with none (nearly all of it) is encoded once, unchanged."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _paired(text).encode("utf-8")


def _paired(text: str) -> str:
    """`text` with each surrogate pair made the character it encodes and each lone surrogate U+FFFD
    (what browsers' encoders send): through UTF-16, which joins pairs, replacing what it cannot."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
