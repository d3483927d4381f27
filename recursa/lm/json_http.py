"""JSON over HTTP to a model API: one POST, its JSON answer, and errors that say what happened.

The model clients send plain JSON bodies they build themselves and read plain JSON answers, so
they need from an HTTP stack only a pooled POST. Going through the `openai` SDK's generic POST
(request models, httpx header merging, the SDK's httpx-to-aiohttp bridge) costs several times the
client CPU of aiohttp alone, on every root turn and, multiplied by hundreds, on every fan-out
(docs/performance.md, "Figures behind choices in the code").

Errors come out as two exceptions that `recursa.lm.api_call` turns into `LMError`s:
`HttpStatusError` (an error answer, with its parsed body and headers) and `HttpConnectionError`
(no answer; the aiohttp or OS error is its cause, which `retry.reached_server` reads).
"""

from __future__ import annotations

import functools
import json
import os
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from recursa.lm.base import utf8_json
from recursa.public_fetch import read_capped, tls_context
from recursa.version import __version__

USER_AGENT = f"recursa/{__version__}"


class HttpError(Exception):
    """A POST that did not give a usable answer."""


class HttpStatusError(HttpError):
    def __init__(self, status: int, body: Any, headers: Mapping[str, str]) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body  # the parsed JSON, else the text
        self.headers = headers


# An answer is read up to this many bytes: a model's reply with its log-probs and token ids is a few
# MB, and a server that sent an endless body filled the host's memory.
MAX_ANSWER_BYTES = 64 << 20


class AnswerTooLarge(ValueError):
    """The server's answer is over MAX_ANSWER_BYTES; it was not read past them."""


class HttpConnectionError(HttpError):
    def __init__(self, timed_out: bool) -> None:
        super().__init__("timed out" if timed_out else "connection failed")
        self.timed_out = timed_out


class JsonPoster:
    """POSTs JSON to one base URL over a pooled aiohttp session. Safe to call concurrently.

    The session is made on first use, inside the running event loop it then belongs to (aiohttp
    binds its connections to one loop). Proxies follow HTTPS_PROXY / HTTP_PROXY / NO_PROXY, read
    once here: a session with trust_env=True reads them, and ~/.netrc, in a worker thread on every
    request, two thread hand-offs per call that cost a fan-out about a fifth of its client CPU.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str],
        timeout: float,
        connect_timeout: float,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": USER_AGENT,
            **headers,
        }
        # Like the SDKs: a bound on connecting and on each wait for data, not on the whole answer.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout)
        try:
            self.proxy, self.proxy_auth = get_env_proxy_for_url(URL(self.base_url))
        except LookupError:  # no proxy for this URL
            self.proxy, self.proxy_auth = None, None
        self._session: aiohttp.ClientSession | None = None
        # The trust store only for https: loading it delays a fresh process's first call.
        self.uses_tls = self.base_url.startswith("https://")

    def _new_session(self) -> aiohttp.ClientSession:
        # No cap on connections here: the gateway's limiter (max_concurrency) bounds calls in flight.
        connector = aiohttp.TCPConnector(limit=0, ssl=shared_tls_context() if self.uses_tls else True)
        return aiohttp.ClientSession(connector=connector, timeout=self._timeout)

    async def post(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Any:
        """The answer's JSON. Raises HttpStatusError, HttpConnectionError, or json.JSONDecodeError
        / UnicodeDecodeError for a 2xx whose body is not JSON."""
        if self._session is None or self._session.closed:
            self._session = self._new_session()
        data = utf8_json(body)  # surrogates made valid: a strict server refuses invalid UTF-8
        send_headers = {**self.headers, **headers} if headers else self.headers
        try:
            async with self._session.post(
                self.base_url + path,
                data=data,
                headers=send_headers,
                allow_redirects=False,
                proxy=self.proxy,
                proxy_auth=self.proxy_auth,
            ) as resp:
                raw = await _bounded_body(resp)
                status, resp_headers = resp.status, resp.headers
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            # aiohttp's connect and read timeouts are TimeoutErrors too.
            raise HttpConnectionError(isinstance(err, TimeoutError)) from err
        if status >= 300:
            raise HttpStatusError(status, _error_body(raw), resp_headers)
        try:
            return json.loads(raw)
        except RecursionError:  # the answer is hostile input: nested past what the parser takes
            raise json.JSONDecodeError("nested too deeply", "", 0) from None

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


async def _bounded_body(resp: aiohttp.ClientResponse) -> bytes:
    too_large = AnswerTooLarge(f"over {MAX_ANSWER_BYTES:,} bytes")
    declared = resp.headers.get("Content-Length")
    return await read_capped(declared, resp.content.iter_chunked(1 << 20), MAX_ANSWER_BYTES, too_large)


def _error_body(raw: bytes) -> Any:
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text.strip()


def env_headers(pairs: Mapping[str, str]) -> dict[str, str]:
    """Headers taken from environment variables that are set, e.g. OpenAI-Organization from
    OPENAI_ORG_ID (what the SDKs send from the same variables)."""
    return {header: value for header, var in pairs.items() if (value := os.environ.get(var))}


@functools.cache
def shared_tls_context() -> ssl.SSLContext:
    """One TLS context for every client in the process (per SSL_CERT_FILE / SSL_CERT_DIR).

    Each client would otherwise build its own, loading the CA bundle again, and every run makes its
    own clients (docs/performance.md, "Figures behind choices in the code"). The trust store is
    certifi's bundle (what the provider SDKs use), unless SSL_CERT_FILE or SSL_CERT_DIR name another.
    """
    return tls_context()
