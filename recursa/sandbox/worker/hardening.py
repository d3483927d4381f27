"""Worker-side lockdown: rlimits, capabilities, Landlock and seccomp, applied before generated code runs.

Standard library only. The worker (server.py) imports this module only when the host asks for a
lockdown, calls `apply(spec)` once while the process still has a single thread, and sends the returned report to the host. The report only states what
the kernel accepted: every entry comes from a syscall's return value or a read-back, and the two
main layers are probed afterwards (listing "/" must fail, `socket()` must fail).

Order matters: read what needs /proc first, then set rlimits, then no_new_privs, drop capabilities
(as root, rlimits bind only without CAP_SYS_RESOURCE), Landlock, and seccomp last.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import sys
import time

from .keeper import die_with_parent
from .landlock import apply_landlock, kernel_abi, open_plan, release_opened_plans
from .mounts import read_only_except, scratch_tmpfs
from .seccomp import apply_seccomp, seccomp_filter
from .syscalls import (
    CAP_VERSION_3,
    PR_CAP_AMBIENT,
    PR_CAP_AMBIENT_CLEAR_ALL,
    PR_CAPBSET_DROP,
    PR_GET_NO_NEW_PRIVS,
    PR_SET_NO_NEW_PRIVS,
    SYSCALLS,
    Report,
    errno_text,
    libc_handle,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _namespaces(host: dict[str, str]) -> list[str]:
    """The namespaces this process does not share with the host (compared by /proc/self/ns inode)."""
    out = []
    for name in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
        theirs = host.get(name)
        try:
            ours = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            continue
        if theirs and ours != theirs:
            out.append(name)
    return out


def _set_rlimits(spec: dict[str, Any], report: Report) -> None:
    wanted = {
        "core": (resource.RLIMIT_CORE, 0),
        "fsize": (resource.RLIMIT_FSIZE, spec.get("max_file_bytes")),
        "nofile": (resource.RLIMIT_NOFILE, spec.get("max_open_files")),
        "data": (resource.RLIMIT_DATA, spec.get("memory_limit_bytes")),
        "nproc": (resource.RLIMIT_NPROC, spec.get("max_tasks")),
    }
    for name, (res, value) in wanted.items():
        if value is None:
            continue
        try:
            resource.setrlimit(res, (int(value), int(value)))
        except (ValueError, OSError) as exc:
            report.warn(f"setrlimit({name}) failed: {exc}")
    for name, (res, value) in wanted.items():
        if name == "nproc" and value is None:
            continue  # per user outside a user namespace of our own: not ours to report
        _soft, hard = resource.getrlimit(res)  # read back: report what holds, not what we asked
        report.data["rlimits"][name] = None if hard == resource.RLIM_INFINITY else hard
    # Past RLIMIT_FSIZE a write must fail with EFBIG (an OSError the code sees), not kill the REPL.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _cap_line(field: str) -> str | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return line.split()[1]
    except OSError:
        pass
    return None


def _empty_capability_sets(libc: Any, sysnr: dict[str, int], keep: int = 0) -> int:
    """Drop the bounding set, clear the ambient one, set the rest to nothing but the capabilities
    in the bit mask `keep` (effective and permitted; capabilities 0-31 only); capset's return code."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read().strip())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        if not keep >> cap & 1:
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: nothing to drop then
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(keep, keep, 0, 0, 0, 0)  # effective, permitted, inheritable (low, high)
    return int(libc.syscall(ctypes.c_long(sysnr["capset"]), ctypes.byref(header), ctypes.byref(data)))


def drop_all_capabilities() -> None:
    """Empty every capability set, or raise: for a process that must not go on holding any (a
    zygote's child, which starts with what the zygote kept of bwrap's user namespace)."""
    rc = _empty_capability_sets(libc_handle(), SYSCALLS[os.uname().machine])
    left = {name: _cap_line(name) for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    if rc != 0 or any(value is None or int(value, 16) for value in left.values()):
        raise PermissionError(f"capabilities left after dropping them all: {left}")


def _drop_capabilities(libc: Any, sysnr: dict[str, int], report: Report, keep: int = 0) -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets (but `keep`).

    Matters when the host runs as root: without CAP_SYS_RESOURCE the rlimits above cannot be raised
    again, without CAP_DAC_OVERRIDE file modes count, without CAP_KILL signals need a matching uid.
    """
    before = _cap_line("CapEff")
    rc = _empty_capability_sets(libc, sysnr, keep)
    after = _cap_line("CapEff")
    bounding = _cap_line("CapBnd")
    report.data["capabilities"] = {
        "effective_before": before,
        "effective": after,
        "bounding": bounding,
        "dropped": rc == 0 and after is not None and int(after, 16) == keep,
        "kept": ["CAP_DAC_READ_SEARCH"] if keep else [],
    }
    if rc != 0:
        report.warn(f"capset() failed: {errno_text()}")


_CAP_DAC_READ_SEARCH = 2
_PR_SET_KEEPCAPS = 8


def _drop_identity(want: dict[str, Any], libc: Any, report: Report) -> int:
    """Take the unprivileged uid and gid the host chose (a root host without bubblewrap): files of
    the host's are then someone else's, whose mode, owner, times and attributes it may not change.
    With `keep_search` the worker keeps CAP_DAC_READ_SEARCH alone (returned as the mask to keep):
    the interpreter lives below a folder only root may enter (a pyenv in /root), and reads still
    pass Landlock's rules, which know nothing of capabilities; it grants no write and no change of
    metadata (open_by_handle_at, which it would also allow, is refused by seccomp)."""
    keep = 1 << _CAP_DAC_READ_SEARCH if want.get("keep_search") else 0
    uid, gid = int(want["uid"]), int(want["gid"])
    parent = os.getppid()
    try:
        if keep:
            libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        report.data["identity"] = {"uid": os.geteuid(), "error": f"could not take uid {uid}: {exc}"}
        report.warn(f"the worker kept the host's identity (uid {os.geteuid()}): {exc}")
        return 0
    finally:
        if keep:
            libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)
    die_with_parent()  # a change of uid clears the parent-death signal
    if os.getppid() != parent:
        os._exit(0)
    report.data["identity"] = {"uid": os.getuid(), "gid": os.getgid()}
    return keep


def _scratch_tmpfs(want: dict[str, Any], owner: tuple[int, int] | None, report: Report) -> None:
    """Without bwrap: a mount namespace of the worker's own where the kernel allows it (CAP_SYS_ADMIN,
    e.g. a root host without bubblewrap, or else a user namespace of its own: mounts.py), with the
    scratch folder as a sized tmpfs there (unless `bytes` is None: then it stays the host's folder)
    and every other mount read-only. Elsewhere the folder stays the host's, bounded per file only,
    the host's files are as open to metadata calls as to the worker's uid, and the report says why."""
    size = want.get("bytes")
    try:
        how = scratch_tmpfs(str(want["path"]), None if size is None else int(size), owner)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        report.data["scratch_tmpfs"] = None
        report.data["scratch_tmpfs_error"] = str(exc)
        report.data["read_only_outside_scratch"] = f"no mount namespace of its own: {exc}"
        return
    report.data["scratch_tmpfs"] = None if size is None else int(size)
    report.data["scratch_tmpfs_by"] = how
    mounted = () if size is None else (str(want["path"]),)
    try:
        read_only_except([str(want["path"])], mounted=mounted)
    except OSError as exc:
        report.data["read_only_outside_scratch"] = str(exc)
    else:
        report.data["read_only_outside_scratch"] = True
    tasks = want.get("max_tasks")
    if how == "user+mount" and isinstance(tasks, int) and os.geteuid() != 0:
        # The kernel counts RLIMIT_NPROC per user namespace: in this one, the sandbox's tasks only.
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
        except (ValueError, OSError) as exc:
            report.warn(f"setrlimit(nproc) failed: {exc}")
        else:
            report.data["rlimits"]["nproc"] = resource.getrlimit(resource.RLIMIT_NPROC)[1]


def _probe(report: Report) -> None:
    """Check from the inside that the layers hold: these must fail now."""
    verified = report.data["verified"]
    try:
        os.listdir("/")
        verified["filesystem"] = False
    except PermissionError:
        verified["filesystem"] = True
    except OSError:
        verified["filesystem"] = False
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        verified["network"] = False
    except PermissionError:
        verified["network"] = True
    except OSError:
        verified["network"] = False


def prepare(spec: dict[str, Any]) -> None:
    """What `apply(spec)` would work out that is the same for every worker: do it now, once."""
    open_plan(spec)
    with contextlib.suppress(KeyError):  # a machine without a table: apply() says so
        seccomp_filter(os.uname().machine, own_pid=0, own_pgid=0, restrict_signals=False)


def apply(spec: dict[str, Any]) -> dict[str, Any]:
    """Apply everything `spec` asks for that this kernel supports; returns the report for the host.

    spec: {"read_write": [scratch], "read_only": [...], "allow_site_packages": bool,
           "memory_limit_bytes", "max_file_bytes", "max_open_files": int | None,
           "landlock": bool, "landlock_max_abi": int | None, "seccomp": bool,
           "host_namespaces": {"pid": "pid:[4026531836]", ...}}
    """
    try:
        return _apply(spec)
    finally:
        release_opened_plans()  # a zygote's open rule paths, inherited: not for the cells


def _apply(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    report = Report()
    machine = report.data["machine"]
    _set_rlimits(spec, report)
    if sys.platform != "linux" or machine not in SYSCALLS:
        report.warn(f"no Landlock/seccomp support for {sys.platform}/{machine}: only rlimits apply")
        report.data["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
        return report.data
    sysnr = SYSCALLS[machine]
    libc = libc_handle()
    identity = spec.get("identity") if isinstance(spec.get("identity"), dict) else None
    owner = (int(identity["uid"]), int(identity["gid"])) if identity is not None else None
    if isinstance(spec.get("scratch_tmpfs"), dict):  # first: it needs capabilities, mount and unshare
        _scratch_tmpfs(spec["scratch_tmpfs"], owner, report)
    # After the mount: the namespaces it made are the worker's own too.
    report.data["namespaces"] = _namespaces(spec.get("host_namespaces") or {})
    keep = _drop_identity(identity, libc, report) if identity is not None else 0
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        report.warn(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno_text()}")
    report.data["no_new_privs"] = libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1
    _drop_capabilities(libc, sysnr, report, keep)

    abi = kernel_abi(libc, sysnr) if spec.get("landlock", True) else 0
    max_abi = spec.get("landlock_max_abi")
    if max_abi is not None:
        abi = min(abi, int(max_abi))
    if abi <= 0:
        report.warn(
            "Landlock is unavailable (kernel too old, disabled, or not in the LSM list): files are not confined"
        )
    elif not report.data["no_new_privs"]:
        report.warn("Landlock needs no_new_privs, which could not be set: files are not confined")
    else:
        apply_landlock(libc, sysnr, spec, abi, report)
        if abi < 4:
            report.warn(f"Landlock ABI {abi} has no network rules: TCP is blocked by seccomp only")
    signals_scoped = "signal" in report.data["landlock_scopes"]
    if signals_scoped:
        report.data["signals"] = "landlock"

    if spec.get("seccomp", True):
        ok = apply_seccomp(libc, sysnr, machine, not signals_scoped, report)
        report.data["seccomp"] = ok
        if ok and not signals_scoped:
            report.data["signals"] = "seccomp (self only)"
    else:
        report.warn("seccomp was turned off")
    if not report.data["seccomp"] and not signals_scoped:
        report.warn("signals are not restricted: the REPL may signal other processes of the same user")
    _probe(report)
    report.data["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
    return report.data
