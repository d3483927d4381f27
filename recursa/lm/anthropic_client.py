"""Anthropic's Messages API, with prompt caching on the append-only root history."""

from __future__ import annotations

from typing import Any

import anthropic

from recursa.lm.base import LMRequest, LMResponse, Message
from recursa.lm.billing import AttemptUsage, BilledFailure
from recursa.lm.retry import RetryPolicy, public_url
from recursa.lm.sdk_call import Endpoint, call_sdk, lean_headers, resolve_credentials, shared_tls_context
from recursa.lm.tool_format import (
    anthropic_messages,
    anthropic_tool_calls,
    anthropic_tools,
    has_tool_messages,
)

ENV_VAR = "ANTHROPIC_API_KEY"
_OFFICIAL_HOST = "api.anthropic.com"
_CONNECT_TIMEOUT = 20.0
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
    """An `LMClient` over ``anthropic.AsyncAnthropic``. Safe to call concurrently."""

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
        self._timeout = anthropic.Timeout(timeout, connect=min(timeout, _CONNECT_TIMEOUT))
        self._client = anthropic.AsyncAnthropic(
            api_key=creds.key,
            base_url=base_url,
            timeout=self._timeout,
            max_retries=0,
            default_headers=lean_headers(anthropic),
            http_client=anthropic.DefaultAsyncHttpxClient(verify=shared_tls_context()),
        )
        self.base_url = public_url(str(self._client.base_url))
        self._endpoint = Endpoint(anthropic, self.provider, model, self.base_url, ENV_VAR, self._secret)

    def __repr__(self) -> str:
        return f"AnthropicClient(model={self.model!r}, base_url={self.base_url!r})"

    async def complete(self, request: LMRequest) -> LMResponse:
        if request.tools or has_tool_messages(request.messages):
            system, messages = anthropic_messages(request.messages)
        else:
            system, messages = to_anthropic(request.messages)
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": request.max_output_tokens,
            "extra_headers": request.meta.headers(),
            # Passing the timeout per request also skips the SDK's refusal of large non-streaming
            # max_tokens: we decide how long a call may take.
            "timeout": self._timeout,
        }
        if system is not None:
            kwargs["system"] = system
        if request.tools:
            kwargs["tools"] = anthropic_tools(request.tools)
        if request.temperature is not None:
            kwargs["temperature"] = request.temperature
        if request.extra:
            kwargs["extra_body"] = dict(request.extra)

        return await call_sdk(
            self._endpoint,
            lambda: self._client.messages.create(**kwargs),
            self._to_response,
            self.retry,
            messages=request.messages,
        )

    def _to_response(self, resp: Any) -> LMResponse:
        content = getattr(resp, "content", None)
        usage = _usage(getattr(resp, "usage", None))
        if not isinstance(content, list) or not content:
            # A 200 without an answer: the server ran the request, so it counts (recursa.lm.billing).
            raise BilledFailure(
                f"anthropic/{self.model} at {self.base_url} returned no content blocks", usage=usage
            )
        text = "".join(
            getattr(block, "text", "") for block in content if getattr(block, "type", "") == "text"
        )
        return LMResponse(
            text=text,
            # No usage reported: zeros here, estimated from the prompt and reply by call_sdk.
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            usage_estimated=usage is None,
            model=getattr(resp, "model", None) or self.model,
            finish_reason=getattr(resp, "stop_reason", None),
            tool_calls=anthropic_tool_calls(resp.content),
        )

    async def aclose(self) -> None:
        await self._client.close()


def _usage(usage: Any) -> AttemptUsage | None:
    if usage is None or getattr(usage, "input_tokens", None) is None:
        return None
    read = int(getattr(usage, "cache_read_input_tokens", None) or 0)
    written = int(getattr(usage, "cache_creation_input_tokens", None) or 0)
    return AttemptUsage(
        # Anthropic counts cached and cache-written tokens apart from input_tokens; ours include them.
        input_tokens=int(usage.input_tokens or 0) + read + written,
        output_tokens=int(getattr(usage, "output_tokens", None) or 0),
        cached_tokens=read,
    )
