"""Contexts named by a server-side path, checked before a run starts so a bad one is a clear HTTP
error rather than a failed run."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from recursa.confined import ConfinedPath
from recursa.serve.api_error import ApiError


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
    if "\x00" in raw:
        raise ApiError(
            400,
            "context path contains a NUL byte, which no file name can hold",
            param="recursa.context_path",
            code="invalid_context_path",
        )
    path = Path(raw).expanduser()
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a loop of links, a name too long
        why = exc.strerror if isinstance(exc, OSError) else "a loop of symbolic links"
        raise ApiError(
            400,
            f"context path {_short(raw)!r} cannot be opened on the server: {why}",
            param="recursa.context_path",
            code="invalid_context_path",
        ) from None
    # Resolving first means a symlink inside an allowed folder cannot lead out of it.
    inside = [root for root in roots if resolved == root or resolved.is_relative_to(root)]
    if not inside:
        raise ApiError(
            403,
            f"context path {_short(raw)!r} is outside the folders this server may read",
            param="recursa.context_path",
            code="context_path_not_allowed",
        )
    try:
        resolved.stat()
    except FileNotFoundError:
        raise ApiError(
            400,
            f"context path {_short(raw)!r} does not exist on the server",
            param="recursa.context_path",
            code="context_not_found",
        ) from None
    except OSError as exc:  # a name too long, a loop of links, a component that is a file
        raise ApiError(
            400,
            f"context path {_short(raw)!r} cannot be opened on the server: {exc.strerror}",
            param="recursa.context_path",
            code="invalid_context_path",
        ) from None
    readable = os.access(resolved, os.R_OK | (os.X_OK if resolved.is_dir() else 0))
    if not readable:
        raise ApiError(
            403,
            f"context path {_short(raw)!r} is not readable by the server",
            param="recursa.context_path",
            code="context_not_readable",
        )
    root = max(inside, key=lambda r: len(r.parts))
    return ConfinedPath(root, PurePosixPath(resolved.relative_to(root).as_posix()))


def _short(raw: str) -> str:
    return raw if len(raw) <= 200 else raw[:200] + "..."
