"""The scratch folder's size cap without bwrap and without root (recursa/sandbox/worker/mounts.py).

A worker started without bwrap makes its scratch folder (its cwd, HOME and TMPDIR) a tmpfs of
`max_scratch_bytes` in a mount namespace of its own. With CAP_SYS_ADMIN (a root host) that is a plain
mount namespace; an unprivileged worker makes a user namespace first, where the kernel lets users
make them. Without either the folder is the host's, capped per file only (RLIMIT_FSIZE), and
`isolation["scratch"]` must say so, never a cap that does not hold. The same user namespace gives
a non-root host without a control group an exact task cap: RLIMIT_NPROC counts in it alone.

This machine's tests run as root, so the worker is run as an unprivileged user here: its Python is
a wrapper that hands it the scratch folder and then drops to uid/gid 65534 (setpriv), so the worker
starts with no capability at all, as it would under a non-root host.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from recursa.sandbox import Hardening, SubprocessSandbox
from recursa.sandbox.reported_limits import memory_entry, scratch_entry
from tests.helpers import FILL_SCRATCH

NOBODY = 65534
CLONE_NEWUSER_AND_NS = 0x10000000 | 0x00020000
# Three files of 5 MiB: each under the 6 MiB per-file limit, together past the 8 MiB scratch cap.
CAPS = Hardening(max_scratch_bytes=8 << 20, max_file_bytes=6 << 20, cgroups=False)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="mount namespaces are Linux's")


def _as_nobody(python: str, *args: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, *args]


def _unprivileged_python() -> str | None:
    """A Python of our version that uid 65534 may run (ours may sit in root's 0700 home)."""
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (
        sys.executable,
        os.path.realpath(sys.executable),
        f"/usr/bin/{minor}",
        shutil.which(minor),
    ):
        if not candidate:
            continue
        probe = subprocess.run(_as_nobody(candidate, "-c", "pass"), capture_output=True, timeout=30)
        if probe.returncode == 0:
            return candidate
    return None


def _user_namespaces_allowed(python: str | None) -> bool:
    """Whether an unprivileged process may make a user and a mount namespace here."""
    code = f"import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare({CLONE_NEWUSER_AND_NS}))"
    if python is None:  # we are unprivileged ourselves
        pid = os.fork()
        if pid == 0:
            os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER_AND_NS) == 0 else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return subprocess.run(_as_nobody(python, "-c", code), capture_output=True, timeout=30).returncode == 0


def _wrapper(folder: Path, python: str) -> str:
    """A worker 'Python' that gives the worker's scratch folder to uid 65534, then runs the worker
    as that user (setpriv keeps the channel's descriptor open)."""
    script = folder / "python-as-nobody"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "scratch = json.loads(args[args.index('--config') + 1])['hardening']['read_write'][0]\n"
        f"os.chown(scratch, {NOBODY}, {NOBODY})\n"
        f"argv = {_as_nobody(python)!r} + args\n"
        "os.execvp(argv[0], argv)\n"
    )
    script.chmod(0o755)
    return str(script)


async def _fill(kw: dict[str, Any]) -> tuple[str, dict[str, Any], list[str]]:
    sb = SubprocessSandbox(hardening=CAPS, bwrap=False, snapshots=False, **kw)

    async def no_calls(fn: str, args: dict[str, Any]) -> Any:
        return None

    await sb.start(no_calls)
    try:
        res = await sb.execute(FILL_SCRATCH + "print(os.geteuid())\n", timeout=30)
        return res.stdout + (res.error or ""), dict(sb.isolation), os.listdir(sb.scratch_dir or "")
    finally:
        await sb.close()


@pytest.fixture
def unprivileged() -> Any:
    """The sandbox's keyword arguments that start its worker as an unprivileged user, and the
    Python that user runs (None: we are unprivileged already)."""
    if os.geteuid() != 0:
        with tempfile.TemporaryDirectory() as root:
            yield {"scratch_root": root}, None
        return
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot run the worker as an unprivileged user")
    python = _unprivileged_python()
    if python is None:
        pytest.skip(f"no python{sys.version_info.major}.{sys.version_info.minor} that uid 65534 may run")
    # A folder uid 65534 can reach (pytest's own is root's, 0700), holding the scratch folders.
    root = Path(tempfile.mkdtemp(prefix="recursa-unprivileged-"))
    try:
        root.chmod(0o755)
        yield {"scratch_root": str(root), "python": _wrapper(root, python)}, python
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_unprivileged_worker_caps_its_scratch_folder_in_its_own_user_namespace(unprivileged) -> None:
    kw, python = unprivileged
    if not _user_namespaces_allowed(python):
        pytest.skip("this kernel lets no unprivileged user make a user namespace (the mechanism is absent)")
    out, isolation, left = asyncio.run(_fill(kw))
    assert out.startswith("['ok', 'No space left on device', 'No space left on device']\n"), out
    assert out.splitlines()[1] == str(NOBODY), out  # as the unprivileged user
    assert out.split("]")[1].strip() != "0", "the worker ran as root: the test shows nothing"
    assert isolation["scratch"] == {
        "bytes": 8 << 20,
        "file_bytes": 6 << 20,
        "by": "tmpfs (the worker's own user and mount namespaces)",
    }
    assert {"user", "mnt"} <= set(isolation["namespaces"])
    assert (
        isolation["capabilities_dropped"] and isolation["seccomp"]
    )  # nothing of the namespace's caps is left
    assert left == []  # the files were never on the host's disk


def test_isolation_claims_no_scratch_cap_that_does_not_hold() -> None:
    options = Hardening(max_scratch_bytes=8 << 20)
    report = {"scratch_tmpfs": None, "scratch_tmpfs_error": "unshare: Operation not permitted"}
    isolation: dict[str, Any] = {"warnings": [], "rlimits": {"fsize": 6 << 20}, "seccomp": True}
    isolation["memory"] = memory_entry(options, None, None, False, isolation, report)
    scratch = scratch_entry(options, False, isolation, report)
    assert scratch["bytes"] is None and scratch["by"] == "RLIMIT_FSIZE (per file; no total)"
    assert scratch["file_bytes"] == 6 << 20 and "Operation not permitted" in scratch["why"]


# Forks children that wait, until the kernel refuses one; then ends them.
FORK_TO_THE_CAP = (
    "import os, time\n"
    "kids, refused = [], None\n"
    "for _ in range(64):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError as e:\n"
    "        refused = type(e).__name__\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "for pid in kids:\n"
    "    os.kill(pid, 9)\n"
    "    os.waitpid(pid, 0)\n"
    "print(len(kids), refused)\n"
)


def test_an_unprivileged_workers_own_user_namespace_caps_its_tasks_exactly(unprivileged) -> None:
    # No control group: RLIMIT_NPROC, set inside the worker's own user namespace, counts the
    # sandbox's tasks alone; forks past max_processes fail at once instead of racing the poller.
    kw, python = unprivileged
    if not _user_namespaces_allowed(python):
        pytest.skip("this kernel lets no unprivileged user make a user namespace (the mechanism is absent)")

    async def main() -> tuple[str, dict[str, Any]]:
        hardening = Hardening(max_scratch_bytes=8 << 20, max_processes=12, cgroups=False)
        sb = SubprocessSandbox(hardening=hardening, bwrap=False, snapshots=False, **kw)

        async def no_calls(fn: str, args: dict[str, Any]) -> Any:
            return None

        await sb.start(no_calls)
        try:
            res = await sb.execute(FORK_TO_THE_CAP, timeout=30)
            after = await sb.execute("print('alive')", timeout=30)
            assert after.stdout == "alive\n", after
            return res.stdout + (res.error or ""), dict(sb.isolation)
        finally:
            await sb.close()

    out, isolation = asyncio.run(main())
    assert isolation["tasks"] == "RLIMIT_NPROC" and isolation["rlimits"]["nproc"] == 12, isolation
    forked, refused = out.split()
    assert refused == "BlockingIOError" and 0 < int(forked) < 12, out
