"""OpenAI chat completions, and every OpenAI-compatible server (vLLM, SGLang, Ollama, llama.cpp)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from recursa.lm.base import LMRequest, LMResponse
from recursa.lm.billing import AttemptUsage, BilledFailure
from recursa.lm.retry import RetryPolicy, public_url
from recursa.lm.sdk_call import Endpoint, call_sdk, lean_headers, resolve_credentials, shared_tls_context
from recursa.lm.tool_format import has_tool_messages, openai_messages, openai_tool_calls, openai_tools

ENV_VAR = "OPENAI_API_KEY"
_OFFICIAL_HOST = "api.openai.com"
# Connecting should take seconds even when a completion may take minutes; a black-holed host must
# not hold a call for the whole request timeout.
_CONNECT_TIMEOUT = 20.0


class OpenAIClient:
    """An `LMClient` over ``openai.AsyncOpenAI``. Safe to call concurrently."""

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
            hint=" (or pass base_url= for a local OpenAI-compatible server, which needs no key)",
        )
        official, effective_url = creds.official, creds.base_url
        self._secret = creds.secret
        self._sdk_options: dict[str, Any] = {
            "api_key": creds.key,
            "base_url": base_url,
            "timeout": openai.Timeout(timeout, connect=min(timeout, _CONNECT_TIMEOUT)),
            # Our own retry loop (RetryPolicy) replaces the SDK's so every provider behaves the same.
            "max_retries": 0,
            "default_headers": lean_headers(openai, default_headers),
        }
        self._client: openai.AsyncOpenAI | None = None
        self.base_url = public_url(effective_url or "https://api.openai.com/v1")
        self._endpoint = Endpoint(openai, self.provider, model, self.base_url, ENV_VAR, self._secret)
        # api.openai.com wants max_completion_tokens (reasoning models reject max_tokens); older
        # OpenAI-compatible servers only know max_tokens.
        self._max_tokens_field = "max_completion_tokens" if official else "max_tokens"

    def __repr__(self) -> str:
        return f"OpenAIClient(model={self.model!r}, base_url={self.base_url!r})"

    def _sdk(self) -> openai.AsyncOpenAI:
        """The SDK client, made on first use so its connection pool belongs to the running loop."""
        if self._client is None:
            self._client = self._new_sdk()
        return self._client

    def _new_sdk(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(**self._sdk_options, http_client=_http_client())

    async def warm(self) -> None:
        """Make the SDK client now, its imports (aiohttp and the SDK's transport: ~0.14 s in a
        fresh process) in a thread, so the first calls of a fan-out do not wait for them. Nothing
        is sent: connections still open on first use."""
        if self._client is None:
            made = await asyncio.to_thread(self._new_sdk)  # nothing bound to a loop yet: safe off it
            if self._client is None:
                self._client = made
            else:  # a call made one meanwhile
                await made.close()

    async def complete(self, request: LMRequest) -> LMResponse:
        tooling = bool(request.tools) or has_tool_messages(request.messages)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": openai_messages(request.messages) if tooling else request.messages,
            self._max_tokens_field: request.max_output_tokens,
        }
        if request.tools:
            body["tools"] = openai_tools(request.tools)
        if request.temperature is not None:
            body["temperature"] = request.temperature
        body.update(request.extra)
        options: Any = {"headers": request.meta.headers()}

        # The SDK's generic POST: same auth, headers and errors as chat.completions.create, without
        # its typed-parameter transform and response models, which cost about 1.5 ms of CPU per
        # call and held back fan-outs of hundreds of calls (benchmarks/fanout.py).
        return await call_sdk(
            self._endpoint,
            lambda: self._sdk().post("/chat/completions", body=body, cast_to=object, options=options),
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
            # No usage reported: zeros here, estimated from the prompt and reply by call_sdk.
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
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


def _usage(resp: dict[str, Any]) -> AttemptUsage | None:
    usage = resp.get("usage")
    if not isinstance(usage, dict):
        return None
    input_tokens = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    # OpenRouter (and some gateways) report what the call cost; it wins over our price table.
    raw_cost = usage.get("cost")
    return AttemptUsage(
        input_tokens=input_tokens,
        output_tokens=int(usage.get("completion_tokens") or 0),
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


def _http_client() -> Any:
    """aiohttp when installed: under hundreds of concurrent calls httpx's pool costs more CPU than
    the calls themselves (256 calls at 0.2 s with 64 slots: 1.1 s with httpx, 0.93 s with aiohttp)."""
    try:
        import aiohttp  # noqa: F401

        return openai.DefaultAioHttpClient(verify=shared_tls_context())
    except ImportError:
        return None
