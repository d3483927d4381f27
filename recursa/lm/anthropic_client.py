"""Anthropic's Messages API, with prompt caching on the append-only root history.

Anthropic caches a prompt's prefix only up to a block marked with `cache_control` (at most four
marks per request), and bills what it writes at 1.25x the input rate and what it reads at 0.1x.
A call that continues a conversation (`LMRequest.cache_key` set: the root's turns) marks three
places, as Anthropic advises for multi-turn conversations: the end of the system prompt (the
tools before it are in that prefix too), the last user message (written now, read by the next
turn) and the user message before it (the mark the previous turn wrote, so this turn reads it
even when the newest messages span more blocks than Anthropic looks back). A one-off sub-call
marks nothing: a write it never reads would cost 25% more than plain input.
"""

from __future__ import annotations

from typing import Any

from recursa.lm.api_call import Endpoint, call_api, resolve_credentials
from recursa.lm.base import LMRequest, LMResponse, Message
from recursa.lm.billing import AttemptUsage, BilledFailure, reported_count
from recursa.lm.images import anthropic_content
from recursa.lm.json_http import JsonPoster
from recursa.lm.retry import RetryPolicy, public_url
from recursa.lm.tool_format import (
    anthropic_messages,
    anthropic_tool_calls,
    anthropic_tool_choice,
    anthropic_tools,
    has_tool_messages,
)

ENV_VAR = "ANTHROPIC_API_KEY"
_OFFICIAL_HOST = "api.anthropic.com"
_CONNECT_TIMEOUT = 20.0
_API_VERSION = "2023-06-01"
_EMPTY = "(empty)"  # the API rejects empty text blocks


def to_anthropic(messages: list[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """Chat messages in Anthropic's shape: (system text, alternating user/assistant messages).

    System messages move to ``system``; consecutive messages of one role are joined (the API
    wants strict alternation).
    """
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role", "user")
        content = m.get("content", "")
        if role == "system":
            system.append(content)
            continue
        if role != "assistant":
            role = "user"
        if isinstance(content, list):  # content parts with images (recursa/lm/images.py)
            content = anthropic_content(content)
        if out and out[-1]["role"] == role:
            out[-1]["content"] = _joined(out[-1]["content"], content)
        else:
            out.append({"role": role, "content": content})
    for msg in out:
        if isinstance(msg["content"], str) and not msg["content"].strip():
            msg["content"] = _EMPTY
    if out and out[-1]["role"] == "assistant" and isinstance(out[-1]["content"], str):
        # A trailing assistant message is a prefill; the API rejects trailing whitespace there.
        out[-1]["content"] = out[-1]["content"].rstrip()
    return ("\n\n".join(system) if system else None), out


def _joined(first: str | list[dict[str, Any]], second: str | list[dict[str, Any]]) -> Any:
    """Two messages' contents as one: text joined by a blank line, blocks kept in order."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"

    def blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"type": "text", "text": content or _EMPTY}] if isinstance(content, str) else content

    return [*blocks(first), *blocks(second)]


_MARK = {"type": "ephemeral"}
_USER_MARKS = 2  # the last user message and the one before it (with the system prompt: 3 of 4)


def mark_cache(
    system: str | None, messages: list[dict[str, Any]]
) -> tuple[str | list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """`system` and `messages` with `cache_control` marks (see the module docstring); the messages
    given are not changed."""
    marked_system: str | list[dict[str, Any]] | None = system
    if system:
        marked_system = [{"type": "text", "text": system, "cache_control": _MARK}]
    out = list(messages)
    left = _USER_MARKS
    for i in range(len(out) - 1, -1, -1):
        if left == 0:
            break
        if out[i]["role"] != "user":
            continue
        content = out[i]["content"]
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        else:
            blocks = [dict(b) for b in content]
        if blocks:
            blocks[-1]["cache_control"] = _MARK
            out[i] = {**out[i], "content": blocks}
            left -= 1
    return marked_system, out


class AnthropicClient:
    """An `LMClient` for Anthropic's Messages API (`POST {base_url}/v1/messages`). Safe to call
    concurrently."""

    provider = "anthropic"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.model = model
        self.retry = retry or RetryPolicy()
        creds = resolve_credentials(
            label="Anthropic",
            model=model,
            api_key=api_key,
            base_url=base_url,
            key_env=ENV_VAR,
            url_env="ANTHROPIC_BASE_URL",
            official_host=_OFFICIAL_HOST,
        )
        self._secret = creds.secret
        effective_url = creds.base_url or f"https://{_OFFICIAL_HOST}"
        self._http = JsonPoster(
            effective_url,
            headers={"x-api-key": creds.key, "anthropic-version": _API_VERSION},
            timeout=timeout,
            connect_timeout=min(timeout, _CONNECT_TIMEOUT),
        )
        self.base_url = public_url(effective_url)
        self._endpoint = Endpoint(self.provider, model, self.base_url, ENV_VAR, self._secret)

    def __repr__(self) -> str:
        return f"AnthropicClient(model={self.model!r}, base_url={self.base_url!r})"

    async def complete(self, request: LMRequest) -> LMResponse:
        if request.tools or has_tool_messages(request.messages):
            system, messages = anthropic_messages(request.messages)
        else:
            system, messages = to_anthropic(request.messages)
        if request.cache_key is not None:
            system, messages = mark_cache(system, messages)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": request.max_output_tokens,
        }
        if system is not None:
            body["system"] = system
        if request.tools:
            body["tools"] = anthropic_tools(request.tools)
        if request.temperature is not None:
            body["temperature"] = request.temperature
        body.update(request.extra)
        if "tool_choice" in body:
            body["tool_choice"] = anthropic_tool_choice(body["tool_choice"])
        headers = request.meta.headers()
        return await call_api(
            self._endpoint,
            lambda: self._http.post("/v1/messages", body, headers),
            self._to_response,
            self.retry,
            messages=request.messages,
        )

    def _to_response(self, resp: Any) -> LMResponse:
        content = resp.get("content") if isinstance(resp, dict) else None
        usage = _usage(resp.get("usage")) if isinstance(resp, dict) else None
        if not isinstance(content, list) or not content:
            # A 200 without an answer: the server ran the request, so it counts (recursa.lm.billing).
            raise BilledFailure(
                f"anthropic/{self.model} at {self.base_url} returned no content blocks", usage=usage
            )
        blocks = [b for b in content if isinstance(b, dict)]
        text = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
        model = resp.get("model")
        stop = resp.get("stop_reason")
        return LMResponse(
            text=text,
            # No usage reported: zeros here, estimated from the prompt and reply by call_api.
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            cache_write_tokens=usage.cache_write_tokens if usage else 0,
            usage_estimated=usage is None,
            model=model if isinstance(model, str) and model else self.model,
            finish_reason=stop if isinstance(stop, str) else None,
            tool_calls=anthropic_tool_calls(blocks),
        )

    async def aclose(self) -> None:
        await self._http.aclose()


def _usage(usage: Any) -> AttemptUsage | None:
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return None

    def count(key: str) -> int:
        return reported_count(usage.get(key))

    read, written = count("cache_read_input_tokens"), count("cache_creation_input_tokens")
    return AttemptUsage(
        # Anthropic counts cached and cache-written tokens apart from input_tokens; ours include them.
        input_tokens=count("input_tokens") + read + written,
        output_tokens=count("output_tokens"),
        cached_tokens=read,
        cache_write_tokens=written,
    )
