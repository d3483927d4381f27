"""Fetching a context URL a client named (`--allow-urls`), without letting the client reach the
server's own network: recursa.public_fetch's pinned fetch, its failures as the API's errors.

`allow_private=True` (the operator's `--allow-private-urls`) turns the address check off.
"""

from __future__ import annotations

from recursa.public_fetch import FetchError, fetch_public
from recursa.serve.api_error import ApiError

_PARAM = "recursa.context_url"
_STATUS = {"invalid": 400, "refused": 403, "failed": 400, "too_large": 413}
_CODE = {"invalid": None, "refused": "context_url_not_allowed", "failed": "context_fetch_failed",
         "too_large": "context_too_large"}
_HINT = "; its operator can allow others with --allow-private-urls"


async def fetch_url(url: str, *, max_bytes: int, timeout_s: float, allow_private: bool = False) -> bytes:
    """GET a context over http(s): only public addresses (unless `allow_private`), every redirect
    checked like the URL, and no body over `max_bytes`."""
    try:
        fetched = await fetch_public(
            url,
            what=_PARAM,
            max_bytes=max_bytes,
            timeout_s=timeout_s,
            allow_private=allow_private,
            private_hint=_HINT,
        )
    except FetchError as exc:
        message = exc.message
        if exc.kind == "too_large":
            message = f"the context at {_PARAM} is larger than this server's limit of {max_bytes:,} bytes"
        raise ApiError(_STATUS[exc.kind], message, param=_PARAM, code=_CODE[exc.kind]) from None
    if not fetched.data:
        raise ApiError(400, f"{_PARAM} returned an empty body", param=_PARAM)
    return fetched.data
