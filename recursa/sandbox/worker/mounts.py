"""Mounts of a worker's own: a private mount namespace and sized tmpfs folders in it.

Standard library only. A tmpfs has a size the kernel enforces for all its files together (a write
past it fails with ENOSPC), which no rlimit does for a folder: RLIMIT_FSIZE caps each file. bwrap
mounts the scratch folder this way; a worker started without bwrap does it itself where it may
(CAP_SYS_ADMIN: a root host without bubblewrap), before it drops its capabilities, and a zygote's
child does it for /dev/shm and its scratch folder (zygote.py).
"""

from __future__ import annotations

import ctypes
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
_MS_REC = 1 << 14
_MS_PRIVATE = 1 << 18
_MS_NOSUID = 1 << 1
_MS_NODEV = 1 << 2

_loaded: list[Any] = []


def libc() -> Any:
    """The C library, with `mount` and `prctl` declared (loaded once per process)."""
    if not _loaded:
        handle = ctypes.CDLL(None, use_errno=True)
        handle.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        handle.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _loaded.append(handle)
    return _loaded[0]


def check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def private_namespace(flags: int = CLONE_NEWNS) -> None:
    """Leave the host's mount namespace (and others in `flags`): mounts made from now on are this
    process's and its children's only, and the host's later ones do not reach in."""
    handle = libc()
    check(handle.unshare(flags), "unshare")
    check(handle.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making mounts private")


def mount_tmpfs(path: str, mode: str, size: int | None) -> None:
    """An empty tmpfs over `path` (of `size` bytes; None: the kernel's default, half the RAM)."""
    options = mode if size is None else f"{mode},size={int(size)}"
    check(
        libc().mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()),
        f"mount tmpfs on {path}",
    )


def scratch_tmpfs(scratch: str, size: int) -> None:
    """Make the worker's scratch folder (its cwd) a tmpfs of `size` bytes, in a mount namespace of
    its own. Raises OSError where the kernel refuses (no CAP_SYS_ADMIN): nothing has changed then."""
    private_namespace()
    mount_tmpfs(scratch, "mode=0700", size)
    os.chdir(scratch)  # the cwd still named the folder under the mount
