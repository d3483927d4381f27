"""Who is calling: the identity a server's sessions belong to.

A caller is the key a request authenticates with, refined by the client's own secret when it sends
one (`X-Recursa-Client`). Sessions live in their caller's namespace: another caller cannot list,
join or close them (to it they do not exist), even with the same id.

- A key from `ServeSettings.api_keys` (`--api-keys-file`) is one client's own: its sessions are
  private to it.
- The single `api_key` (`--api-key`), or no key at all, is shared: the server cannot tell its
  holders apart, so session ids are the only thing between them. There the server lists no ids,
  and a new session's id must be hard to guess (`"session": "new"` gets one from the server).
- `X-Recursa-Client: <secret of 16+ characters>` makes a caller of its own under any key, for
  clients that share a key but not their sessions.

How many sessions a caller may keep open is capped per caller as well as per server (`quota_of`).
"""

from __future__ import annotations

import hashlib
import secrets

from recursa.serve.api_error import ApiError
from recursa.serve.request import Caller, bearer_token, key_matches
from recursa.serve.settings import ServeSettings

CLIENT_HEADER = "x-recursa-client"
MIN_CLIENT_SECRET = 16
# A new session id a client picks in a shared namespace must be at least this long (a UUID is 36).
MIN_SHARED_SESSION_ID = 16


def identify(
    settings: ServeSettings, authorization: str, client_secret: str | None, api_key: str | None = None
) -> Caller:
    """The caller of an HTTP request, or ApiError 401 (bad key) / 400 (bad client secret). The key
    comes as `Authorization: Bearer <key>` (OpenAI's clients) or in `api_key`, the `x-api-key`
    header (Anthropic's)."""
    tokens = [t for t in (bearer_token(authorization), (api_key or "").strip()) if t]
    owner, private = _by_key(settings, tokens)
    if client_secret is not None:
        if len(client_secret) < MIN_CLIENT_SECRET:
            raise ApiError(
                400,
                f"the {CLIENT_HEADER} header must be a secret of at least {MIN_CLIENT_SECRET} characters "
                "(e.g. secrets.token_urlsafe()); it separates your sessions from others using the same key",
                code="invalid_client_secret",
            )
        digest = hashlib.sha256(client_secret.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return Caller(f"{owner}/client:{digest}", True)
    return Caller(owner, private)


# A 401's error type. Clients that sort errors by their body (LiteLLM does, for its Responses calls)
# take an "invalid_request_error" without OpenAI's exact wording for a bad request, not a bad key.
AUTH_ERROR = "authentication_error"


def _by_key(settings: ServeSettings, tokens: list[str]) -> tuple[str, bool]:
    if not settings.api_key and not settings.api_keys:
        return "open", False
    if not tokens:
        raise ApiError(
            401,
            "missing API key: send it as `Authorization: Bearer <key>` (or as `x-api-key: <key>`)",
            type=AUTH_ERROR,
            code="invalid_api_key",
        )
    found: tuple[str, bool] | None = None
    # Every key is compared (in constant time), so the time taken says nothing about which matched.
    for token in tokens:
        for name, key in settings.api_keys.items():
            if key_matches(token, key) and found is None:
                found = (f"key:{name}", True)
        if settings.api_key and key_matches(token, settings.api_key) and found is None:
            found = ("shared", False)
    if found is None:
        raise ApiError(401, "incorrect API key", type=AUTH_ERROR, code="invalid_api_key")
    return found


def quota_of(owner: str) -> str:
    """Whose share of the sessions a caller's open sessions count against (the per-caller cap).
    A client with a key of its own is one client whatever X-Recursa-Client secrets it sends, so
    minting secrets does not widen its share; under a shared key (or none) each secret is as far as
    the server can tell holders apart."""
    return owner.split("/client:", 1)[0] if owner.startswith("key:") else owner


def new_session_id() -> str:
    """A session id nobody can guess (192 random bits)."""
    return secrets.token_urlsafe(24)
