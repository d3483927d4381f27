"""Mounts of a worker's own: a private mount namespace and sized tmpfs folders in it.

Standard library only. A tmpfs has a size the kernel enforces for all its files together (a write
past it fails with ENOSPC), which no rlimit does for a folder: RLIMIT_FSIZE caps each file. bwrap
mounts the scratch folder this way; a worker started without bwrap does it itself, before it drops
its capabilities: in a mount namespace of its own where it has CAP_SYS_ADMIN (a root host without
bubblewrap), else in a user namespace of its own (an unprivileged host, where the kernel lets users
make them); and a zygote's child does it for /dev/shm and its scratch folder (zygote.py).
"""

from __future__ import annotations

import ctypes
import errno
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
_MS_REC = 1 << 14
_MS_PRIVATE = 1 << 18
_MS_NOSUID = 1 << 1
_MS_NODEV = 1 << 2
_MS_BIND = 1 << 12
_SYS_MOUNT_SETATTR = 442  # the same on x86_64 and aarch64 (Linux 5.12+)
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY = 0x1

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


def own_user_namespace() -> None:
    """Enter a user namespace and a mount namespace of this process's own, as an unprivileged process
    may: inside, it holds every capability over the new mount namespace (none over the host's), so
    it may mount a tmpfs there. Its uid and gid map to themselves, so files keep their owners and
    every permission check on the host's files is what it was. The capabilities are dropped right
    after (hardening.py), and seccomp then refuses unshare, setns and mount to the code.

    Raises OSError where the kernel refuses. Nothing has changed then, unless the refusal comes
    after unshare (a map that cannot be written): the process then stays in the new namespace with
    its ids unmapped (shown as the overflow id inside), which changes no access to the host's files.
    """
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        # unshare would succeed there, into a namespace AppArmor gives no capability in.
        raise OSError(
            errno.EPERM,
            "unprivileged user namespaces are restricted (kernel.apparmor_restrict_unprivileged_userns=1)",
        )
    uid, gid = os.geteuid(), os.getegid()
    handle = libc()
    check(handle.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user and mount namespaces)")
    _write("/proc/self/setgroups", "deny")  # the kernel's condition for an unprivileged gid_map
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    check(handle.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making mounts private")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _mount_setattr(path: str, set_flags: int, clear_flags: int, recursive: bool) -> None:
    attr = _MountAttr(set_flags, clear_flags, 0, 0)
    rc = libc().syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_uint(_AT_RECURSIVE if recursive else 0),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    check(0 if rc == 0 else -1, f"mount_setattr({path})")


def read_only_except(writable: list[str], mounted: tuple[str, ...] = ()) -> None:
    """Make every mount of this (private) mount namespace read-only but the folders `writable`:
    then no call can change a file outside them, its mode, owner, times and extended attributes
    included, whoever owns it (EROFS). Landlock covers reads and writes of contents, not metadata.
    Each of `writable` not in `mounted` (a fresh tmpfs already) becomes a bind mount of itself
    first, so that it alone can stay writable. Raises OSError (an old kernel: ENOSYS)."""
    handle = libc()
    for path in writable:
        if path not in mounted:
            check(handle.mount(path.encode(), path.encode(), None, _MS_BIND, None), f"bind {path}")
    _mount_setattr("/", _MOUNT_ATTR_RDONLY, 0, recursive=True)
    for path in writable:
        _mount_setattr(path, 0, _MOUNT_ATTR_RDONLY, recursive=False)


def scratch_tmpfs(scratch: str, size: int | None, owner: tuple[int, int] | None = None) -> str:
    """Make the worker's scratch folder (its cwd) a tmpfs of `size` bytes (owned by `owner`, the
    unprivileged uid and gid the worker is about to take, if any), in a mount namespace of its own
    (size None: the namespace only, the folder stays as it is); returns the namespaces that allowed
    it: "mount" (CAP_SYS_ADMIN) or "user+mount" (a user namespace of its own). Raises OSError where
    the kernel refuses both."""
    try:
        private_namespace()
        how = "mount"
    except OSError as exc:
        if exc.errno != errno.EPERM:
            raise
        try:
            own_user_namespace()
        except OSError as second:
            raise OSError(second.errno, f"{exc.strerror}; {second.strerror}") from None
        how = "user+mount"
    if size is not None:
        mode = "mode=0700" if owner is None else f"mode=0700,uid={owner[0]},gid={owner[1]}"
        mount_tmpfs(scratch, mode, size)
        os.chdir(scratch)  # the cwd still named the folder under the mount
    return how


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"writing {path}: {exc.strerror}") from None
