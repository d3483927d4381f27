"""What the hardened worker should enforce, and an honest summary of what it did enforce.

`Hardening` holds the knobs (memory, files, processes, what may be read). `worker_spec` turns them
into the dict the worker's `harden()` receives. `describe` turns the worker's report (syscall return
values and self-probes, never assumptions) plus the host's own facts into the `isolation` dict that
ends up on the sandbox, in `RLMResult.isolation` and in the trace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20

# Namespaces that make the host's filesystem, processes and network absent: all needed for the top level.
_KEY_NAMESPACES = {"mnt", "pid", "net"}


@dataclass(frozen=True)
class Hardening:
    """Limits and access rules for the hardened REPL worker.

    memory_limit_bytes: RLIMIT_DATA for the worker. None (default): set by the host right after the
        context is loaded, to what the worker then uses plus `memory_headroom_bytes`; until a
        context is loaded there is no data limit. An explicit value applies from the start (the
        context must fit in it).
    max_file_bytes: RLIMIT_FSIZE; a larger write fails with OSError (EFBIG).
    max_open_files: RLIMIT_NOFILE.
    max_processes: tasks (processes and their threads) the REPL may have at once, itself, its keeper
        and its snapshot included. Where the host can make a control group (cgroups.py) the kernel
        enforces it exactly: a fork or thread past it fails (BlockingIOError, RuntimeError "can't
        start new thread"). Elsewhere RLIMIT_NPROC does inside a user namespace of the sandbox's own
        for a non-root host (bwrap's, or the worker's for its scratch tmpfs); and the host's poller (guard.py) counts processes, kills the extra ones and
        interrupts the cell. `isolation["tasks"]` says which holds.
    max_shm_bytes: the size of the REPL's private /dev/shm (and /tmp) under bwrap: files there are
        memory that no rlimit counts. None: no size of ours (the kernel's default, half the RAM).
    max_scratch_bytes: the scratch folder (the REPL's cwd, HOME and TMPDIR) is a tmpfs of this
        size, so files written there are bounded memory, gone with the REPL: bwrap mounts it, and
        without bwrap the worker does, in a mount namespace of its own, where it may (CAP_SYS_ADMIN:
        a root host; else a user namespace of its own, where the kernel lets users make them).
        Elsewhere, or with None, it is the host's folder itself (bounded per file only, by
        max_file_bytes); `isolation["scratch"]` says which.
    allow_read: extra paths the code may read (read-only), e.g. a data folder.
    allow_site_packages: let code import installed third-party packages (numpy, ...). Off by
        default: only the standard library is readable.
    cgroups: give the REPL a control group where the host may make one (exact task cap, a cell's
        leftover processes killed when it ends) and a memory group where the host's own is writable
        (cgroup v1) or the memory controller is delegated (v2): all its processes together hold at
        most the data limit + max_shm_bytes + max_scratch_bytes + 256 MiB. False: rlimits and the
        poller only.
    landlock, seccomp: turn a layer off (debugging). landlock_max_abi: pretend the kernel's Landlock
        is older (tests of the fallbacks).
    """

    memory_limit_bytes: int | None = None
    memory_headroom_bytes: int = 4 * GIB
    max_file_bytes: int | None = GIB
    max_open_files: int | None = 1024
    max_processes: int = 128
    max_shm_bytes: int | None = 256 * MIB
    max_scratch_bytes: int | None = GIB
    allow_read: tuple[str, ...] = ()
    allow_site_packages: bool = False
    cgroups: bool = True
    landlock: bool = True
    seccomp: bool = True
    landlock_max_abi: int | None = None

    def worker_spec(self, scratch: str, host_namespaces: dict[str, str]) -> dict[str, Any]:
        return {
            "read_write": [scratch],
            "read_only": [os.path.abspath(p) for p in self.allow_read],
            "allow_site_packages": self.allow_site_packages,
            "memory_limit_bytes": self.memory_limit_bytes,
            "max_file_bytes": self.max_file_bytes,
            "max_open_files": self.max_open_files,
            "shm_bytes": self.max_shm_bytes,
            "scratch_bytes": self.max_scratch_bytes,
            "landlock": self.landlock,
            "landlock_max_abi": self.landlock_max_abi,
            "seccomp": self.seccomp,
            "host_namespaces": host_namespaces,
        }


def unconfined(process: bool, warning: str) -> dict[str, Any]:
    """The isolation dict of a sandbox that enforces nothing beyond (maybe) a separate process."""
    return {
        "level": "partial" if process else "none",
        "process": process,
        "landlock": False,
        "seccomp": False,
        "namespaces": [],
        "rlimits": {},
        "env_scrubbed": process,
        "warnings": [warning],
    }


def identity(report: dict[str, Any], *, bwrap: bool, host_uid: int) -> dict[str, Any]:
    """Whose identity the worker holds and whether it can change the metadata (mode, owner, times,
    extended attributes: what Landlock does not cover) of the host's files outside scratch.

    {"uid": its uid as the host sees it, "user_namespace": bool, "host_files_metadata": "protected"
    or "exposed", "by": what protects them, and "why" when exposed}."""
    own = report.get("identity") if isinstance(report.get("identity"), dict) else {}
    uid = own.get("uid") if isinstance(own.get("uid"), int) else host_uid
    userns = "user" in (report.get("namespaces") or [])
    by: list[str] = []
    if uid != host_uid:
        by.append(f"an unprivileged uid ({uid}) instead of root")
    if bwrap:
        by.append("bwrap's user namespace, the host's files bound read-only")
    if report.get("read_only_outside_scratch") is True:
        by.append("every mount but scratch read-only in the worker's own mount namespace")
    out: dict[str, Any] = {"uid": uid, "user_namespace": userns, "by": by}
    out["host_files_metadata"] = "protected" if by else "exposed"
    if not by:
        why = [str(own["error"])] if own.get("error") else []
        why.append(str(report.get("read_only_outside_scratch") or "hardening is off"))
        out["why"] = "; ".join(why)
    return out


def describe(
    report: dict[str, Any], *, bwrap: bool, process_limit: int | None, host_uid: int | None = None
) -> dict[str, Any]:
    """The `isolation` dict for a worker that sent `report` in its ready message."""
    who = identity(report, bwrap=bwrap, host_uid=os.geteuid() if host_uid is None else host_uid)
    if not report.get("requested"):
        out = unconfined(
            True, "hardening was turned off: a separate process with a scrubbed environment only"
        )
        out["rlimits"] = dict(report.get("rlimits") or {})
        out["identity"] = who
        return out
    if who["host_files_metadata"] == "exposed":
        report = {
            **report,
            "warnings": [
                *(report.get("warnings") or []),
                f"the REPL runs as the host's uid {who['uid']} and can change the mode, owner and times of "
                f"the host's files it can name ({who['why']})",
            ],
        }
    verified = report.get("verified") or {}
    landlock = report.get("landlock") if report.get("landlock_fs") and verified.get("filesystem") else False
    seccomp = bool(report.get("seccomp")) and bool(verified.get("network"))
    namespaces = list(report.get("namespaces") or [])
    warnings = list(report.get("warnings") or [])
    if report.get("landlock_fs") and not verified.get("filesystem"):
        warnings.append("Landlock reported success but a read outside the allowed paths still worked")
    if report.get("seccomp") and not verified.get("network"):
        warnings.append("seccomp reported success but socket() still worked")
    if bwrap and not _KEY_NAMESPACES <= set(namespaces):
        warnings.append(f"bwrap was used but the worker shares namespaces with the host: {namespaces}")
    if landlock and seccomp:
        level = "hardened+namespaces" if _KEY_NAMESPACES <= set(namespaces) else "hardened"
    else:
        level = "partial"
    caps = report.get("capabilities") or {}
    return {
        "level": level,
        "process": True,
        "landlock": landlock,
        "seccomp": seccomp,
        "namespaces": namespaces,
        "rlimits": dict(report.get("rlimits") or {}),
        "env_scrubbed": True,
        "warnings": warnings,
        "landlock_net": bool(report.get("landlock_net")) and bool(landlock),
        "landlock_scopes": list(report.get("landlock_scopes") or []) if landlock else [],
        "signals": report.get("signals", "unrestricted"),
        "capabilities_dropped": bool(caps.get("dropped")),
        "no_new_privs": bool(report.get("no_new_privs")),
        "process_limit": process_limit,
        "bwrap": bwrap,
        "identity": who,
    }
