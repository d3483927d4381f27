"""One attempt-and-retry loop and one error mapping for the model APIs.

Each client (OpenAI-compatible, Anthropic) builds its JSON body, sends it with `json_http` and
reads the JSON answer; this module turns a failed attempt into a `recursa.errors.LMError` the same
way for both, and applies the billing policy (`recursa.lm.billing`) to each attempt: a failure
the provider may have billed is raised as a `BilledFailure` carrying what to count, and usage a 200
did not report is estimated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
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
from recursa.lm.json_http import (
    AnswerTooLarge,
    HttpConnectionError,
    HttpError,
    HttpStatusError,
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

# Local servers ignore the key; a placeholder keeps the Authorization header well formed.
PLACEHOLDER_KEY = "not-needed"


@dataclass(frozen=True)
class Credentials:
    key: str  # what is sent: the real key, or a placeholder for a keyless local server
    secret: str | None  # the real key, only so it can be scrubbed out of any text we repeat
    base_url: str | None  # base_url=, else the provider's environment variable, else None
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
    parts = urlsplit(effective_url or "")
    if parts.username is not None or parts.password is not None:
        # Beside the key's header they were refused by the HTTP client at the first call as an
        # internal error (OpenAI), or sent as a second credential (Anthropic); a message never
        # repeats them, so say so without them.
        raise ConfigError(
            f"the base URL for {model!r} carries credentials ({parts.scheme}://...@{parts.hostname}); "
            f"give the server's URL without them, and the key with «api_key=» or {key_env}"
        )
    official = effective_url is None or urlsplit(effective_url).hostname == official_host
    if key is None:
        if official:
            raise ConfigError(f"no {label} API key for model {model!r}: set {key_env} or pass «api_key=»{hint}")
        return Credentials(PLACEHOLDER_KEY, None, effective_url, official)
    return Credentials(key, key, effective_url, official)


@dataclass(frozen=True)
class Endpoint:
    """Who a call goes to, for error messages (never the key itself)."""

    provider: str
    model: str
    where: str  # the base URL without credentials
    env_var: str
    secret: str | None  # the key, only so it can be scrubbed out of any text we repeat


async def call_api(
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
        except HttpError as err:
            failure: LMError = map_error(endpoint, err)
            if isinstance(err, HttpConnectionError) and reached_server(err.__cause__):
                failure = as_billed(failure, estimated_prompt_usage(messages))
        except AnswerTooLarge as err:
            failure = BilledFailure(
                f"{endpoint.provider}/{endpoint.model} at {endpoint.where} answered with a body too large "
                f"to read ({err})",
                usage=estimated_prompt_usage(messages),
            )
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            failure = BilledFailure(
                f"{endpoint.provider}/{endpoint.model} at {endpoint.where} answered with a body that is "
                f"not valid JSON ({scrub(str(err), endpoint.secret)[:200]})",
                usage=estimated_prompt_usage(messages),
            )
        else:
            return _priced(to_response, raw, messages)
        # Raised outside the handler, so it carries no link to the HTTP error: an error body can
        # quote part of a rejected key, and the useful words are already in the message, scrubbed.
        raise failure

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


def map_error(endpoint: Endpoint, err: HttpError) -> LMError:
    if isinstance(err, HttpStatusError):
        message, code = error_fields(err.body)
        return status_error(
            err.status,
            provider=endpoint.provider,
            model=endpoint.model,
            where=endpoint.where,
            env_var=endpoint.env_var,
            message=message,
            code=code,
            headers=err.headers,
            secret=endpoint.secret,
        )
    assert isinstance(err, HttpConnectionError)
    return connection_error(
        provider=endpoint.provider,
        model=endpoint.model,
        where=endpoint.where,
        timed_out=err.timed_out,
        cause=err.__cause__,
        secret=endpoint.secret,
    )
