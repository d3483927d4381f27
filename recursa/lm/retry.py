"""When a model call is worth repeating, and how long to wait before the next try.

The SDKs' own retries are switched off (``max_retries=0``) so every provider backs off the same way,
reports how many attempts a call took, and turns HTTP failures into the same `recursa.errors` types.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from recursa.errors import ContextLengthError, LMError
from recursa.lm.base import LMResponse
from recursa.trace.redact import redact

T = TypeVar("T")

# A provider may ask for a long pause; beyond this we wait this long instead of stalling a run for hours.
_RETRY_AFTER_CAP = 300.0

# Statuses that mean "the server is busy or briefly broken", the same set the official SDKs retry
# (529 is Anthropic's "overloaded").
RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})

_CONTEXT_PHRASES = (
    "context_length_exceeded",
    "maximum context length",  # OpenAI, vLLM
    "context length",  # SGLang, many OpenAI-compatible servers
    "context window",
    "context size",  # llama.cpp
    "prompt is too long",  # Anthropic
)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: try ``max_attempts`` times in all (1 means no retries)."""

    max_attempts: int = 4
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.25  # each wait is scaled by a random factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < 0 or not 0 <= self.jitter <= 1:
            raise ValueError("RetryPolicy delays must be >= 0 and jitter within [0, 1]")

    def delay(self, attempt: int, retry_after: float | None = None, rand: float | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based).

        ``rand`` in [0, 1) picks the jitter (random when None). A provider's ``retry_after`` is a
        floor: we never come back sooner than asked, only a little later, so that many callers
        told the same time do not all return at the same instant.
        """
        r = random.random() if rand is None else rand
        backoff = self.base_delay * 2 ** min(attempt - 1, 60) * (1 + self.jitter * (2 * r - 1))
        backoff = min(self.max_delay, backoff)
        if retry_after is not None and retry_after > 0:
            asked = min(retry_after, _RETRY_AFTER_CAP)
            return max(backoff, asked * (1 + self.jitter * r))
        return max(0.0, backoff)


class RetryBudget:
    """Retries left for a whole call tree (RLM(max_run_retries=...)), shared by all its calls.

    The per-call limit (RetryPolicy.max_attempts) bounds one call; this bounds their sum, so a
    fan-out of 500 calls against a failing API cannot turn into 2,000 requests. Thread-safe.
    """

    def __init__(self, limit: int | None = None, *, option: str = "max_run_retries") -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"{option} must be >= 0 or None")
        self.limit = limit
        self.option = option
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Use one retry; False (and nothing used) when none is left."""
        with self._lock:
            if self.limit is not None and self.used >= self.limit:
                return False
            self.used += 1
            return True

    def spent_error(self, err: LMError) -> LMError:
        """The error a call fails with when it could retry but the run has no retries left."""
        return LMError(
            f"{err} (not retried: this run has used all {self.limit} retries it may make across its "
            f"call tree; raise RLM({self.option}=...) to allow more, or find out why the model API "
            "keeps failing)",
            status=err.status,
        )


def gave_up(err: LMError, attempts: int) -> LMError:
    """``err`` with the number of attempts it took appended (for the last failure of a call)."""
    if attempts > 1:
        err.reword(f"{err.template} (gave up after {attempts} attempts)")
    return err


async def call_with_retries(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> T:
    """Await ``fn()`` until it succeeds, retrying `LMError`s marked ``retryable``.

    A returned `LMResponse` gets its ``attempts`` set. When every attempt fails, the last error is
    raised with the number of attempts appended to its message. Any other exception (and a
    non-retryable `LMError`) propagates at once.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            result = await fn()
        except LMError as err:
            if not err.retryable:
                raise
            if attempt >= policy.max_attempts:
                gave_up(err, attempt)
                raise
            await sleep(policy.delay(attempt, err.retry_after))
            continue
        if isinstance(result, LMResponse):
            result.attempts = attempt
        return result


def parse_retry_after(headers: Mapping[str, str] | None, *, now: float | None = None) -> float | None:
    """Seconds from ``retry-after-ms`` or ``Retry-After`` (delta seconds or an HTTP date), if present."""
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def error_fields(body: object) -> tuple[str | None, str | None]:
    """(message, code) from an error body shaped like ``{"error": {...}}`` or the inner dict itself."""
    if not isinstance(body, dict):
        return (body if isinstance(body, str) and body else None), None
    inner = body.get("error", body)
    if not isinstance(inner, dict):
        return (inner if isinstance(inner, str) else None), None
    message = inner.get("message")
    code = inner.get("code") or inner.get("type")
    return (
        str(message) if message is not None else None,
        str(code) if code is not None else None,
    )


def is_context_length(status: int, message: str | None, code: str | None) -> bool:
    if status not in (400, 413, 422):
        return False
    if status == 413 or code == "context_length_exceeded":
        # 413 is a request too large to accept: the same fix, send less text per call.
        return True
    text = (message or "").lower()
    return any(p in text for p in _CONTEXT_PHRASES)


def status_error(
    status: int,
    *,
    provider: str,
    model: str,
    where: str,
    env_var: str,
    message: str | None,
    code: str | None,
    headers: Mapping[str, str] | None,
    secret: str | None,
) -> LMError:
    """The `recursa.errors` exception for an HTTP error answer. Never echoes ``secret``."""
    detail = scrub(message or "", secret)[:500]
    said = f": {detail}" if detail else ""
    if is_context_length(status, message, code):
        return ContextLengthError(
            f"{provider}/{model} rejected the prompt as too long (HTTP {status}){said}. "
            "Send less text per call (smaller chunks per llm_query).",
            status=status,
        )
    if status in (401, 403):
        # The provider's own text can quote part of the key, so it is left out on purpose.
        what = "rejected the API key" if status == 401 else "refused access (key lacks permission?)"
        return LMError(
            f"{provider} {what} (HTTP {status}) for model {model!r} at {where}. "
            f"Set {env_var} or pass «api_key=» with a valid key.",
            status=status,
        )
    if status == 404:
        return LMError(
            f"model {model!r} was not found at {where} (HTTP 404){said}. Check the model name in "
            "'provider/model' and the «base_url» (OpenAI-compatible servers usually end in /v1).",
            status=status,
        )
    if status in RETRYABLE_STATUSES:
        return LMError(
            f"{provider}/{model} at {where} is temporarily unavailable (HTTP {status}){said}",
            status=status,
            retryable=True,
            retry_after=parse_retry_after(headers),
        )
    return LMError(f"{provider}/{model} at {where} failed (HTTP {status}){said}", status=status)


# Errors of the HTTP libraries under the SDKs, matched by class name (the SDKs pick the library):
# raised after the connection was made, so the request went out and the server may have run it...
_AFTER_SENDING = frozenset(
    {
        "ConnectionResetError",
        "BrokenPipeError",
        "ConnectionAbortedError",
        "RemoteProtocolError",
        "ReadError",
        "WriteError",
        "ReadTimeout",
        "WriteTimeout",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "SocketTimeoutError",
    }
)
# Of those, the ones that mean the connection broke (rather than that the answer was slow).
_CONNECTION_LOST = _AFTER_SENDING - {"ReadTimeout", "WriteTimeout", "SocketTimeoutError"}
# ...and raised while connecting, so nothing was sent.
_CONNECTING = frozenset(
    {"ConnectError", "ConnectTimeout", "ClientConnectorError", "ConnectionTimeoutError", "PoolTimeout"}
)


def _chain(cause: BaseException | None, limit: int = 12) -> list[BaseException]:
    links: list[BaseException] = []
    while cause is not None and len(links) < limit:
        links.append(cause)
        cause = cause.__cause__ or cause.__context__
    return links


def _names(cause: BaseException | None) -> set[str]:
    return {klass.__name__ for link in _chain(cause) for klass in type(link).__mro__}


def reached_server(cause: BaseException | None) -> bool:
    """Did a request that got no answer get as far as the server (which may have run and billed it)?

    ``cause`` is the HTTP library's exception under the SDK's connection error. Unknown causes
    count as reached: for a budget, counting a request that was never run is the safe mistake.
    """
    if any(isinstance(link, (ConnectionRefusedError, socket.gaierror)) for link in _chain(cause)):
        return False
    names = _names(cause)
    if names & _AFTER_SENDING:
        # Checked first: the SDK's aiohttp transport labels a reset connection a connect timeout.
        return True
    return not names & _CONNECTING


def connection_error(
    *, provider: str, model: str, where: str, timed_out: bool, cause: BaseException | None, secret: str | None
) -> LMError:
    """A retryable error for a request that got no answer: refused, reset, cut off, or timed out."""
    # The useful words are at both ends of the chain: the HTTP library's summary ("All connection
    # attempts failed") and the OS error underneath ("Connect call failed ... 111").
    texts: list[str] = []
    for link in _chain(cause):
        text = str(link)
        if text and text not in texts:
            texts.append(text)
    said = texts[0] if len(texts) < 2 else f"{texts[0]}: {texts[-1]}"
    detail = f" ({scrub(said, secret)[:300]})" if texts else ""
    if not reached_server(cause):
        # The SDK's aiohttp transport reports a refused connection as a connect *timeout*; the OS
        # error underneath tells the truth.
        refused = any(isinstance(x, OSError) and not isinstance(x, TimeoutError) for x in _chain(cause))
        if timed_out and not refused:
            reason = "timed out connecting"
        else:
            reason = _os_reason(cause) or (scrub(said, secret)[:200] if texts else "no reason given")
        message = (
            f"{provider}/{model}: cannot connect to {host_port(where)} ({reason}). Check that the server "
            f"at {where} is running and the base URL is right."
        )
    elif timed_out and not _names(cause) & _CONNECTION_LOST:
        # (The SDK's aiohttp transport also raises its timeout error for a reset connection.)
        message = (
            f"{provider}/{model}: timed out waiting for the answer from {where}{detail}. A slow model "
            "or a long reply may need a larger «request_timeout»."
        )
    else:
        message = f"{provider}/{model}: the connection to {where} was lost before the answer arrived{detail}."
    return LMError(message, retryable=True)


def _os_reason(cause: BaseException | None) -> str | None:
    """What the operating system said about a failed connect, in a few words."""
    for link in _chain(cause):
        if isinstance(link, socket.gaierror):
            return f"the host name does not resolve: {link.strerror or link}"
        if isinstance(link, OSError) and not isinstance(link, TimeoutError):
            # aiohttp's wrapper keeps the errno but writes its own strerror ("Connect call failed")
            if isinstance(link.errno, int) and link.errno > 0:
                return os.strerror(link.errno).lower()
            if link.strerror:
                return link.strerror[:1].lower() + link.strerror[1:]
    return None


def host_port(url: str) -> str:
    """HOST:PORT of a URL, with the scheme's default port when it names none."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    port = port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def scrub(text: str, secret: str | None) -> str:
    """Text we put into an error message, scrubbed of the call's key and anything key-like."""
    return redact(text, secret)


def public_url(url: str) -> str:
    """A base URL fit for an error message: no user:password, no query string (keys hide there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
