"""Syscall numbers, libc through ctypes, and the report of what the lockdown applied."""

from __future__ import annotations

import ctypes
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_GET_SECCOMP = 21
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_VERSION_3 = 0x20080522

SYSCALLS = {  # the syscalls we call ourselves, per machine
    "x86_64": {"capset": 126, "seccomp": 317, "ll_create": 444, "ll_add": 445, "ll_restrict": 446},
    "aarch64": {"capset": 91, "seccomp": 277, "ll_create": 444, "ll_add": 445, "ll_restrict": 446},
}


class Report:
    """What the lockdown applied, as the kernel accepted it: sent to the host in the ready frame."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "requested": True,
            "machine": os.uname().machine,
            "euid": os.geteuid(),
            "rlimits": {},
            "no_new_privs": False,
            "capabilities": None,
            "landlock": False,
            "landlock_fs": False,
            "landlock_net": False,
            "landlock_scopes": [],
            "seccomp": False,
            "signals": "unrestricted",
            "namespaces": [],
            "verified": {},
            "warnings": [],
        }

    def warn(self, text: str) -> None:
        self.data["warnings"].append(text)


def libc_handle() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def errno_text() -> str:
    return os.strerror(ctypes.get_errno())
