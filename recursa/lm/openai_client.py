"""OpenAI chat completions, and every OpenAI-compatible server (vLLM, SGLang, Ollama, llama.cpp)."""

from __future__ import annotations

import asyncio
from typing import Any

from recursa.lm.api_call import Endpoint, call_api, resolve_credentials
from recursa.lm.base import LMRequest, LMResponse, Message
from recursa.lm.billing import AttemptUsage, BilledFailure, reported_count
from recursa.lm.images import openai_content
from recursa.lm.json_http import JsonPoster, env_headers, shared_tls_context
from recursa.lm.retry import RetryPolicy, public_url
from recursa.lm.tool_format import has_tool_messages, openai_messages, openai_tool_calls, openai_tools

ENV_VAR = "OPENAI_API_KEY"
_OFFICIAL_HOST = "api.openai.com"
# Connecting should take seconds even when a completion may take minutes; a black-holed host must
# not hold a call for the whole request timeout.
_CONNECT_TIMEOUT = 20.0
# What the official SDK sends from the same environment variables.
_ENV_HEADERS = {"OpenAI-Organization": "OPENAI_ORG_ID", "OpenAI-Project": "OPENAI_PROJECT_ID"}


class OpenAIClient:
    """An `LMClient` for the Chat Completions API (`POST {base_url}/chat/completions`). Safe to call
    concurrently."""

    provider = "openai"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        retry: RetryPolicy | None = None,
        default_headers: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.retry = retry or RetryPolicy()
        creds = resolve_credentials(
            label="OpenAI",
            model=model,
            api_key=api_key,
            base_url=base_url,
            key_env=ENV_VAR,
            url_env="OPENAI_BASE_URL",
            official_host=_OFFICIAL_HOST,
            hint=" (or pass «base_url=» for a local OpenAI-compatible server, which needs no key)",
        )
        official, effective_url = creds.official, creds.base_url or "https://api.openai.com/v1"
        self._secret = creds.secret
        self._http = JsonPoster(
            effective_url,
            headers={
                "Authorization": f"Bearer {creds.key}",
                **env_headers(_ENV_HEADERS),
                **(default_headers or {}),
            },
            timeout=timeout,
            connect_timeout=min(timeout, _CONNECT_TIMEOUT),
        )
        self.base_url = public_url(effective_url)
        self._endpoint = Endpoint(self.provider, model, self.base_url, ENV_VAR, self._secret)
        # api.openai.com wants max_completion_tokens (reasoning models reject max_tokens); older
        # OpenAI-compatible servers only know max_tokens.
        self._max_tokens_field = "max_completion_tokens" if official else "max_tokens"
        # OpenAI routes requests with one prompt_cache_key to the same cache; other servers may
        # refuse a field they do not know, and vLLM and SGLang cache any repeated prefix anyway.
        self._cache_key_field = official

    def __repr__(self) -> str:
        return f"OpenAIClient(model={self.model!r}, base_url={self.base_url!r})"

    async def warm(self) -> None:
        """Load the TLS trust store in a thread now, for an https server (tens of ms of CPU, once per
        process), so the first calls of a fan-out do not wait for it. Nothing is sent: connections
        open on first use."""
        if self._http.uses_tls:
            await asyncio.to_thread(shared_tls_context)

    async def complete(self, request: LMRequest) -> LMResponse:
        tooling = bool(request.tools) or has_tool_messages(request.messages)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": openai_messages(request.messages) if tooling else _with_images(request.messages),
            self._max_tokens_field: request.max_output_tokens,
        }
        if request.tools:
            body["tools"] = openai_tools(request.tools)
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.cache_key is not None and self._cache_key_field:
            body["prompt_cache_key"] = request.cache_key
        body.update(request.extra)
        headers = request.meta.headers()
        return await call_api(
            self._endpoint,
            lambda: self._http.post("/chat/completions", body, headers),
            self._to_response,
            self.retry,
            messages=request.messages,
        )

    def _to_response(self, resp: Any) -> LMResponse:
        choices = resp.get("choices") if isinstance(resp, dict) else None
        usage = _usage(resp) if isinstance(resp, dict) else None
        if not choices or not isinstance(choices[0], dict):
            # A 200 without an answer: the server ran the request, so it counts (recursa.lm.billing).
            raise BilledFailure(f"openai/{self.model} at {self.base_url} returned no choices", usage=usage)
        choice = choices[0]
        message = choice.get("message") or {}
        text = message.get("content") or ""
        return LMResponse(
            text=text if isinstance(text, str) else str(text),
            # No usage reported: zeros here, estimated from the prompt and reply by call_api.
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            provider_cost_usd=usage.provider_cost_usd if usage else None,
            usage_estimated=usage is None,
            model=resp.get("model") or self.model,
            finish_reason=choice.get("finish_reason"),
            tool_calls=openai_tool_calls(message),
            **_token_data(resp, choice),
        )

    async def aclose(self) -> None:
        await self._http.aclose()


def _with_images(messages: list[Message]) -> list[Message]:
    """Messages with content parts (images) in the Chat Completions form; plain ones as they are.
    (A tool-calling conversation goes through tool_format.openai_messages, which does the same.)"""
    if all(isinstance(m.get("content"), str | None) for m in messages):
        return messages
    return [{**m, "content": openai_content(m.get("content"))} for m in messages]


def _usage(resp: dict[str, Any]) -> AttemptUsage | None:
    usage = resp.get("usage")
    if not isinstance(usage, dict):
        return None
    input_tokens = reported_count(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = reported_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    # OpenRouter (and some gateways) report what the call cost; it wins over our price table.
    raw_cost = usage.get("cost")
    return AttemptUsage(
        input_tokens=input_tokens,
        output_tokens=reported_count(usage.get("completion_tokens")),
        cached_tokens=min(cached, input_tokens) if input_tokens else cached,
        provider_cost_usd=float(raw_cost) if isinstance(raw_cost, int | float) and raw_cost >= 0 else None,
    )


def _token_data(resp: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    """Log-probs and token ids, when the server returned them (asked for through sampling settings).

    OpenAI and vLLM put per-token log-probs in `choice.logprobs.content`; vLLM gives token ids as
    `choice.token_ids` and `prompt_token_ids` with `return_token_ids`, or as "token_id:N" token
    strings with `return_tokens_as_token_ids`. Anything malformed is ignored, never an error.
    """
    out: dict[str, Any] = {}
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list) and content and all(isinstance(t, dict) for t in content):
        values = [t.get("logprob") for t in content]
        if all(isinstance(v, int | float) for v in values):
            out["logprobs"] = [float(v) for v in values]
        tokens = [t.get("token") for t in content]
        if all(isinstance(t, str) and t.startswith("token_id:") and t[9:].isdigit() for t in tokens):
            out["token_ids"] = [int(t[9:]) for t in tokens]
    for key, source in (("token_ids", choice), ("prompt_token_ids", choice), ("prompt_token_ids", resp)):
        ids = source.get(key)
        if key not in out and isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            out[key] = list(ids)
    return out
