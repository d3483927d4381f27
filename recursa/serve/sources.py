"""Contexts named by a server-side path or a URL, checked before a run starts so a bad one is a
clear HTTP error rather than a failed run."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import httpx

from recursa.confined import ConfinedPath
from recursa.serve.request import ApiError, read_capped

_MAX_REDIRECTS = 5


def check_path(raw: str, roots: tuple[Path, ...], *, flag: str = "--allow-path") -> ConfinedPath:
    """The path, resolved, as a ConfinedPath under the allowed root it is in, if it exists and is
    readable. The check is for a clear error now; the run reads it again without leaving the root."""
    if not roots:
        raise ApiError(
            403,
            f"context paths are turned off on this server; its operator can allow folders with {flag} DIR",
            param="recursa.context_path",
            code="context_path_not_allowed",
        )
    path = Path(raw).expanduser()
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError):
        resolved = path
    # Resolving first means a symlink inside an allowed folder cannot lead out of it.
    inside = [root for root in roots if resolved == root or resolved.is_relative_to(root)]
    if not inside:
        raise ApiError(
            403,
            f"context path {raw!r} is outside the folders this server may read",
            param="recursa.context_path",
            code="context_path_not_allowed",
        )
    if not resolved.exists():
        raise ApiError(
            400,
            f"context path {raw!r} does not exist on the server",
            param="recursa.context_path",
            code="context_not_found",
        )
    readable = os.access(resolved, os.R_OK | (os.X_OK if resolved.is_dir() else 0))
    if not readable:
        raise ApiError(
            403,
            f"context path {raw!r} is not readable by the server",
            param="recursa.context_path",
            code="context_not_readable",
        )
    root = max(inside, key=lambda r: len(r.parts))
    return ConfinedPath(root, PurePosixPath(resolved.relative_to(root).as_posix()))


async def fetch_url(url: str, *, max_bytes: int, timeout_s: float) -> bytes:
    """GET a context over http(s), refusing bodies over `max_bytes` before holding them."""
    if not url.startswith(("http://", "https://")):
        raise ApiError(
            400, "recursa.context_url must be an http:// or https:// URL", param="recursa.context_url"
        )
    try:
        async with (
            httpx.AsyncClient(
                follow_redirects=True, max_redirects=_MAX_REDIRECTS, timeout=timeout_s
            ) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code >= 400:
                raise ApiError(
                    400,
                    f"fetching recursa.context_url gave HTTP {response.status_code}",
                    param="recursa.context_url",
                    code="context_fetch_failed",
                )
            data = await read_capped(
                response.headers.get("content-length"),
                response.aiter_bytes(),
                max_bytes,
                _too_large(max_bytes),
            )
    except httpx.HTTPError as exc:
        raise ApiError(
            400,
            f"could not fetch recursa.context_url: {type(exc).__name__}",
            param="recursa.context_url",
            code="context_fetch_failed",
        ) from None
    if not data:
        raise ApiError(400, "recursa.context_url returned an empty body", param="recursa.context_url")
    return data


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the context at recursa.context_url is larger than this server's limit of {max_bytes:,} bytes",
        param="recursa.context_url",
        code="context_too_large",
    )
