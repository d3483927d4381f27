"""Anthropic's Messages API, with prompt caching on the append-only root history."""

from __future__ import annotations

from typing import Any

from recursa.lm.api_call import Endpoint, call_api, resolve_credentials
from recursa.lm.base import LMRequest, LMResponse, Message
from recursa.lm.billing import AttemptUsage, BilledFailure
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
    wants strict alternation); the last content block of the final user message carries
    ``cache_control`` so each root turn reuses the cached prefix of the previous one.
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
        if out and out[-1]["role"] == role:
            out[-1]["content"] = f"{out[-1]['content']}\n\n{content}"
        else:
            out.append({"role": role, "content": content})
    for msg in out:
        if not msg["content"].strip():
            msg["content"] = _EMPTY
    if out and out[-1]["role"] == "assistant":
        # A trailing assistant message is a prefill; the API rejects trailing whitespace there.
        out[-1]["content"] = out[-1]["content"].rstrip()
    for msg in reversed(out):
        if msg["role"] == "user":
            msg["content"] = [
                {"type": "text", "text": msg["content"], "cache_control": {"type": "ephemeral"}}
            ]
            break
    return ("\n\n".join(system) if system else None), out


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
        value = usage.get(key)
        return value if isinstance(value, int) and value > 0 else 0

    read = count("cache_read_input_tokens")
    return AttemptUsage(
        # Anthropic counts cached and cache-written tokens apart from input_tokens; ours include them.
        input_tokens=count("input_tokens") + read + count("cache_creation_input_tokens"),
        output_tokens=count("output_tokens"),
        cached_tokens=read,
    )
