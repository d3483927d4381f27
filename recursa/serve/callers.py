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

How many sessions a caller may keep open, how many runs it may have going and how many of its
requests may wait are capped per caller as well as per server (`quota_of`: the key, whatever
secret it sends).
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
    """Whose share of the server (sessions, run slots, waiting requests) a caller draws on: its key.
    X-Recursa-Client secrets separate sessions' namespaces but never widen a share: a holder of the
    shared key who mints a secret per request is still the shared key, one caller with one share
    (before, each secret was a share of its own, and one holder took every session)."""
    return owner.split("/client:", 1)[0]


def caller_quota(settings: ServeSettings, headers: dict[bytes, bytes]) -> str | None:
    """The share a raw HTTP request's headers draw on, None when they do not authenticate (the app
    answers those itself, reading nothing)."""
    try:
        caller = identify(
            settings,
            headers.get(b"authorization", b"").decode("latin-1"),
            None,
            headers.get(b"x-api-key", b"").decode("latin-1") or None,
        )
    except ApiError:
        return None
    return quota_of(caller.owner)


def new_session_id() -> str:
    """A session id nobody can guess (192 random bits)."""
    return secrets.token_urlsafe(24)
