"""Whose identity the worker runs with, as far as the host's files are concerned.

Landlock covers reading and writing files, not their metadata: a worker that keeps a root host's
uid could `chmod`, `chown`, `utime` or `setxattr` any file it can name. So a root host without
bwrap hands the worker an unprivileged uid and gid to take before its first cell (worker/hardening.py),
and gives it its scratch folder; and a root host where neither that nor a read-only view of its files
holds refuses to start the REPL rather than run one that could change root's files. (A non-root
host's worker keeps the host's uid: it may change only the user's own files, and only where no
read-only mount holds; `isolation["identity"]` says which.)
"""

from __future__ import annotations

import functools
import os
import pwd
import stat
from collections.abc import Iterable
from typing import Any

from recursa.errors import SandboxError


@functools.lru_cache(maxsize=1)
def unprivileged_ids() -> tuple[int, int]:
    """The uid and gid a worker of a root host without bwrap takes: "nobody"'s, else 65534."""
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


def identity_spec(paths: Iterable[str], ids: tuple[int, int] | None = None) -> dict[str, Any]:
    """The worker's `identity` spec: the ids to take, and whether to keep CAP_DAC_READ_SEARCH (where
    `paths`, what it must reach, are not reachable by every user: a pyenv in /root)."""
    uid, gid = ids or unprivileged_ids()
    return {"uid": uid, "gid": gid, "keep_search": not _reachable_by_all(paths)}


def _reachable_by_all(paths: Iterable[str]) -> bool:
    """Whether any user may reach `paths` (the interpreter, the worker's files, what the worker may
    read, the folder of its scratch folder): each, and every folder on the way, searchable by
    others. Else an unprivileged worker keeps CAP_DAC_READ_SEARCH (worker/hardening.py: why)."""
    for path in paths:
        parts = os.path.abspath(path).split(os.sep)
        for depth in range(2, len(parts) + 1):
            try:
                mode = os.stat(os.sep.join(parts[:depth]) or os.sep).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
    return True


def refuse_root_exposure(identity: dict[str, Any]) -> None:
    """On a root host, a worker whose report leaves root's files open to changes of mode and owner
    never runs: SandboxError with what to do."""
    if os.geteuid() == 0 and identity.get("host_files_metadata") != "protected":
        raise SandboxError(
            "the REPL worker would run as root with the host's files open to changes of mode and "
            f"owner ({identity.get('why')}); install bubblewrap (apt-get install "
            "bubblewrap) or let the host take an unprivileged uid (it needs CAP_SETUID)"
        )
