"""One attempt-and-retry loop and one error mapping for both official SDKs.

The `openai` and `anthropic` SDKs are generated from the same template, so their exception
classes line up (APIError, APIConnectionError, APITimeoutError, APIStatusError); this module
turns either into a `recursa.errors.LMError` the same way, and applies the billing policy
(`recursa.lm.billing`) to each attempt: a failure the provider may have billed is raised as a
`BilledFailure` carrying what to count, and usage a 200 did not report is estimated.
"""

from __future__ import annotations

import functools
import json
import os
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from recursa.errors import ConfigError, LMError
from recursa.lm.base import LMResponse, Message
from recursa.lm.billing import (
    BilledFailure,
    as_billed,
    estimate_prompt_tokens,
    estimate_reply_tokens,
    estimated_prompt_usage,
)
from recursa.lm.retry import (
    RetryPolicy,
    call_with_retries,
    connection_error,
    error_fields,
    reached_server,
    scrub,
    status_error,
)

# Local servers ignore the key, but both SDKs insist on one.
PLACEHOLDER_KEY = "not-needed"


@dataclass(frozen=True)
class Credentials:
    key: str  # what the SDK gets: the real key, or a placeholder for a keyless local server
    secret: str | None  # the real key, only so it can be scrubbed out of any text we repeat
    base_url: str | None  # base_url=, else the SDK's own environment variable, else None
    official: bool  # talking to the provider's own API (which needs a real key)


def resolve_credentials(
    *,
    label: str,
    model: str,
    api_key: str | None,
    base_url: str | None,
    key_env: str,
    url_env: str,
    official_host: str,
    hint: str = "",
) -> Credentials:
    """The key and endpoint a client uses; a missing key for the provider's own API is a ConfigError."""
    key = api_key or os.environ.get(key_env) or None
    effective_url = base_url or os.environ.get(url_env) or None
    official = effective_url is None or urlsplit(effective_url).hostname == official_host
    if key is None:
        if official:
            raise ConfigError(f"no {label} API key for model {model!r}: set {key_env} or pass api_key={hint}")
        return Credentials(PLACEHOLDER_KEY, None, effective_url, official)
    return Credentials(key, key, effective_url, official)


@dataclass(frozen=True)
class Endpoint:
    """Who a call goes to, for error messages (never the key itself)."""

    sdk: ModuleType  # the `openai` or `anthropic` module
    provider: str
    model: str
    where: str  # the base URL without credentials
    env_var: str
    secret: str | None  # the key, only so it can be scrubbed out of any text we repeat


async def call_sdk(
    endpoint: Endpoint,
    send: Callable[[], Awaitable[Any]],
    to_response: Callable[[Any], LMResponse],
    retry: RetryPolicy,
    *,
    messages: Sequence[Message],
) -> LMResponse:
    """Send, retrying per ``retry``; ``messages`` (the prompt sent) price a billed failure or an
    answer without usage. ``to_response`` may raise `BilledFailure` for a 200 it cannot use."""

    async def once() -> LMResponse:
        try:
            raw = await send()
        except endpoint.sdk.APIError as err:
            mapped = map_error(endpoint, err)
            if mapped.status not in (401, 403):
                if isinstance(err, endpoint.sdk.APIConnectionError) and reached_server(err.__cause__):
                    raise as_billed(mapped, estimated_prompt_usage(messages)) from err
                raise mapped from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BilledFailure(
                f"{endpoint.provider}/{endpoint.model} at {endpoint.where} answered with a body that is "
                f"not valid JSON ({scrub(str(err), endpoint.secret)[:200]})",
                usage=estimated_prompt_usage(messages),
            ) from err
        else:
            return _priced(to_response, raw, messages)
        # An auth failure is raised outside the handler so it carries no link to the SDK's
        # exception, whose text can quote part of the rejected key.
        raise mapped

    return await call_with_retries(once, retry)


def _priced(to_response: Callable[[Any], LMResponse], raw: Any, messages: Sequence[Message]) -> LMResponse:
    try:
        response = to_response(raw)
    except BilledFailure as failure:
        if failure.usage is None:
            failure.usage = estimated_prompt_usage(messages)
        raise
    if response.usage_estimated:
        response.input_tokens = estimate_prompt_tokens(messages)
        response.output_tokens = estimate_reply_tokens(response)
        response.cached_tokens = 0
    return response


def map_error(endpoint: Endpoint, err: Any) -> LMError:
    sdk = endpoint.sdk
    if isinstance(err, sdk.APIConnectionError):
        return connection_error(
            provider=endpoint.provider,
            model=endpoint.model,
            where=endpoint.where,
            timed_out=isinstance(err, sdk.APITimeoutError),
            cause=err.__cause__,
            secret=endpoint.secret,
        )
    if isinstance(err, sdk.APIStatusError):
        message, code = error_fields(err.body)
        return status_error(
            err.status_code,
            provider=endpoint.provider,
            model=endpoint.model,
            where=endpoint.where,
            env_var=endpoint.env_var,
            message=message or err.message,
            code=getattr(err, "code", None) or code,
            headers=err.response.headers,
            secret=endpoint.secret,
        )
    # A 200 whose body did not parse, and similar: the server is not speaking the protocol.
    return LMError(
        f"{endpoint.provider}/{endpoint.model} at {endpoint.where}: unexpected response "
        f"({scrub(str(err), endpoint.secret)})"
    )


# Platform telemetry the Stainless-generated SDKs (openai, anthropic) add to every request. No server
# needs them, and each extra header costs CPU on every call: httpx merges headers in quadratic time,
# and these seven took a third of the client's CPU per request (0.84 -> 0.55 ms, 64 concurrent
# calls to a local server, measured when this was added). The SDKs keep their retry/timeout headers.
_SDK_TELEMETRY_HEADERS = (
    "X-Stainless-Lang",
    "X-Stainless-Package-Version",
    "X-Stainless-OS",
    "X-Stainless-Arch",
    "X-Stainless-Runtime",
    "X-Stainless-Runtime-Version",
    "X-Stainless-Async",
)


def lean_headers(sdk: Any, user_headers: dict[str, str] | None = None) -> dict[str, Any]:
    """`default_headers` for an SDK client: its telemetry headers left out, the user's kept."""
    return {**{name: sdk.Omit() for name in _SDK_TELEMETRY_HEADERS}, **(user_headers or {})}


@functools.cache
def shared_tls_context() -> ssl.SSLContext:
    """One TLS context for every SDK client in the process.

    Each SDK client otherwise builds its own, loading the CA bundle again: about 37 ms of CPU per
    client, and every run makes its own clients (8 s of a 41 s load test with 200 runs). The trust
    store is the one the SDKs' HTTP stacks use by default: certifi's bundle, unless SSL_CERT_FILE or
    SSL_CERT_DIR name another.
    """
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if cafile is None and capath is None:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:  # no certifi: the system store
            pass
    return ssl.create_default_context(cafile=cafile, capath=capath)
