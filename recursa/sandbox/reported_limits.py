"""What bounds a hardened worker's memory and its scratch folder, read from the worker's report:
the `memory` and `scratch` entries of a sandbox's `isolation`. Only what the worker reported as
applied is claimed; what is left open is said."""

from __future__ import annotations

from typing import Any

from recursa.sandbox.cgroups import TaskGroup
from recursa.sandbox.policy import Hardening
from recursa.sandbox.pools import MemoryPool


def memory_entry(
    opts: Hardening | None,
    group: TaskGroup | None,
    pool: MemoryPool | None,
    using_bwrap: bool,
    isolation: dict[str, Any],
    report: dict[str, Any],
) -> dict[str, Any]:
    """Which mechanisms bound the memory the REPL can make resident, and what they leave open."""
    if opts is None:
        return {"mechanisms": [], "tmpfs_bytes": {}, "not_covered": ["hardening is off"]}
    mechanisms = ["RLIMIT_DATA"]
    not_covered = []
    joined = report.get("memory_cgroup", report.get("cgroup")) if group is not None else None
    if isinstance(joined, str) and group is not None and group.memory_kind == "v1":
        isolation["warnings"].append(joined)
    limited = group is not None and (group.memory_bytes is not None or opts.memory_limit_bytes is None)
    if group is not None and group.memory_kind is not None and joined is True and limited:
        mechanisms.append(f"memory cgroup ({group.memory_kind})")
    else:
        not_covered.append("RLIMIT_DATA is per process: each process the code forks has its own")
    if isolation.get("seccomp"):
        mechanisms.append("seccomp (shared memory)")
    else:
        not_covered.append("shared anonymous memory, memfd and System V shared memory (no seccomp)")
    tmpfs: dict[str, int] = {}
    if using_bwrap:
        if opts.max_shm_bytes is not None:
            tmpfs["/dev/shm"] = opts.max_shm_bytes
        if opts.max_scratch_bytes is not None:
            tmpfs["scratch"] = opts.max_scratch_bytes
    elif isinstance(report.get("scratch_tmpfs"), int):
        tmpfs["scratch"] = report["scratch_tmpfs"]  # the worker's own mount (worker/mounts.py)
    if tmpfs:
        mechanisms.append("tmpfs size")
    if "scratch" not in tmpfs:
        why = report.get("scratch_tmpfs_error")
        not_covered.append(
            "the scratch folder is the host's: bounded per file (max_file_bytes) only"
            + (f" (no mount namespace of its own: {why})" if why else "")
        )
    out = {"mechanisms": mechanisms, "tmpfs_bytes": tmpfs, "not_covered": not_covered}
    if pool is not None:
        # The bound shared with the other REPLs of an environment: the kernel's where the pool's
        # group holds this REPL's, else a rule for admitting new episodes only.
        enforced = pool.enforced if group is not None and group.memory_kind is not None else None
        out["pool"] = {
            "limit_bytes": pool.limit_bytes,
            "by": enforced or "admission (resident memory)",
        }
    if group is not None and group.memory_bytes is not None:
        out["cgroup_limit_bytes"] = group.memory_bytes
    return out


def scratch_entry(
    options: Hardening | None, using_bwrap: bool, isolation: dict[str, Any], report: dict[str, Any]
) -> dict[str, Any]:
    """What bounds the scratch folder (the REPL's cwd): {"bytes": its total cap or None, "by":
    the mechanism that holds}, plus "file_bytes" (RLIMIT_FSIZE) and, when no total cap holds,
    "why". Only what the worker reported as applied is claimed."""
    file_bytes = (isolation.get("rlimits") or {}).get("fsize")
    tmpfs = isolation.get("memory", {}).get("tmpfs_bytes", {}).get("scratch")
    out: dict[str, Any] = {"bytes": tmpfs, "file_bytes": file_bytes}
    if tmpfs is not None and using_bwrap:
        out["by"] = "tmpfs (bwrap)"
    elif tmpfs is not None:
        own = (
            "user and mount namespaces"
            if report.get("scratch_tmpfs_by") == "user+mount"
            else "mount namespace"
        )
        out["by"] = f"tmpfs (the worker's own {own})"
    else:
        out["by"] = "RLIMIT_FSIZE (per file; no total)" if file_bytes is not None else "none"
        if options is None:
            out["why"] = "hardening is off"
        elif options.max_scratch_bytes is None:
            out["why"] = "max_scratch_bytes is None"
        else:
            out["why"] = str(report.get("scratch_tmpfs_error") or "the worker mounted no tmpfs")
    return out
