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
