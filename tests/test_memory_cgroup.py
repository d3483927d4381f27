"""One memory cap for all of a sandbox's processes: the memory cgroup (recursa/sandbox/cgroups.py).

RLIMIT_DATA is per process, so code that forks holds the data limit once per child. Where this host
can make a memory cgroup (v1 here and in CI: a child of the host's own memory group), the kernel
counts every page any of the sandbox's processes faults, tmpfs files included, against one limit
and kills inside the group when it is reached. Run through the public path: an RLM run against the
fake server with scripted replies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import recursa.loop.tree as tree_module
from recursa.sandbox import Hardening, cgroups
from recursa.sandbox.hardened import MEMORY_MARGIN_BYTES
from recursa.sandbox.worker.landlock import landlock_abi
from tests.test_escapes import KINDS, assert_next_turn_ok, attack, feedback_before
from tests.test_rlm_openai import code, make_rlm

pytestmark = [
    pytest.mark.skipif(landlock_abi() < 6, reason="needs Landlock ABI >= 6 (Linux 6.12+), as test_escapes"),
    pytest.mark.skipif(
        cgroups.memory_available() is None,
        reason="this host can make no memory cgroup (no writable v1 memory group of its own, "
        "no v2 memory controller delegated)",
    ),
]

DATA = 256 << 20
SHM, SCRATCH = 32 << 20, 48 << 20

# Eight children, each touching 0.75x the per-process data limit (6x in all): every one passes
# RLIMIT_DATA, together they hold far more than the sandbox's budget.
FORK_HOGS = (
    "import os\n"
    "kids = []\n"
    "for _ in range(8):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    f"        b = bytearray({DATA * 3 // 4})\n"
    "        for i in range(0, len(b), 4096):\n"
    "            b[i] = 1\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "codes = [os.waitpid(p, 0)[1] for p in kids]\n"
    "print('finished', sum(c == 0 for c in codes), 'killed', sum(os.WIFSIGNALED(c) for c in codes))\n"
)


def memory_parent() -> str:
    parent = cgroups._parent()
    assert parent is not None
    return parent.memory_v1 or parent.path


def our_groups() -> set[str]:
    """This process's sandbox groups in the memory hierarchy."""
    mine = f"recursa-{os.getpid()}-"
    return {name for name in os.listdir(memory_parent()) if name.startswith(mine)}


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Every sandbox of this test's runs gets the data limit and tmpfs sizes above."""
    real = tree_module.make_sandbox

    def make(kind: str, **options):
        options.setdefault(
            "hardening", Hardening(memory_limit_bytes=DATA, max_shm_bytes=SHM, max_scratch_bytes=SCRATCH)
        )
        options.setdefault("scratch_root", tmp_path)
        return real(kind, **options)

    monkeypatch.setattr(tree_module, "make_sandbox", make)


@pytest.mark.parametrize("kind", KINDS)
def test_forked_children_share_one_memory_cap(server, script, tmp_path, kind, budget):
    before = our_groups()
    result, feedback = attack(server, script, tmp_path, FORK_HOGS, kind, exec_timeout=60)
    killed = int(feedback.split("killed ")[1].split()[0])
    assert killed >= 1, feedback  # without the group all eight finish: 8 x 192 MiB fit the machine
    assert "reached their memory cap" in feedback and "the kernel killed" in feedback, feedback
    memory = result.isolation["memory"]
    assert f"memory cgroup ({cgroups.memory_available()})" in memory["mechanisms"], memory
    assert memory["cgroup_limit_bytes"] == DATA + SHM + SCRATCH + MEMORY_MARGIN_BYTES
    assert not any("per process" in gap for gap in memory["not_covered"])
    assert_next_turn_ok(result)  # the host and the session survived
    assert our_groups() == before  # the sandbox's group went with it


def test_the_worker_killed_at_the_cap_is_restored(server, script, tmp_path, budget):
    # Children hold a little each; then the worker itself grows past what is left, so the kernel's
    # largest process (its victim) is the worker: the session comes back from its snapshot.
    grab = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        f"        b = bytearray({DATA * 2 // 5})\n"
        "        for i in range(0, len(b), 4096):\n"
        "            b[i] = 1\n"
        "        os.write(w, b'.')\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "for _ in range(4):\n"
        "    os.read(r, 1)\n"
        f"big = bytearray({DATA * 9 // 10})\n"
        "for i in range(0, len(big), 4096):\n"
        "    big[i] = 1\n"
        "print('worker kept', len(big))\n"
    )
    before = our_groups()
    script.root(
        "root-model",
        code("import os\nkept = 'earlier value'\nr, w = os.pipe()"),
        code(grab),
        code("FINAL(kept)"),
        "FINAL(fallback)",
    )
    result = make_rlm(server, tmp_path, sandbox="auto", exec_timeout=60).run("q", "ctx")
    told = feedback_before(server, 3)
    assert "worker kept" not in told
    assert "killed by SIGKILL" in told and "restored to its state before this cell" in told, told
    assert "reached their memory cap" in told
    assert result.stop_reason == "final" and result.answer == "earlier value", (result.answer, result.error)
    assert our_groups() == before


def test_a_group_left_by_a_killed_host_is_swept(tmp_path):
    # A host that dies (SIGKILL: no close, no finalizer) leaves its groups; its worker exits when
    # the channel closes. The next sandbox this machine makes removes them.
    host = (
        "import asyncio, os, sys\n"
        "from recursa.sandbox import Hardening, SubprocessSandbox\n"
        "async def handler(fn, args):\n"
        "    return None\n"
        "async def main():\n"
        f"    sb = SubprocessSandbox(hardening=Hardening(memory_limit_bytes={DATA}), scratch_root={str(tmp_path)!r})\n"
        "    await sb.start(handler)\n"
        "    print(sb._hardening.group.memory_path or sb._hardening.group.path, flush=True)\n"
        "    sys.stdin.read()\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", host], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    left = proc.stdout.readline().decode().strip()
    assert os.path.isdir(left), left
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    # The orphaned worker exits. (A sandbox another test process makes meanwhile may sweep the
    # group first: that is the behaviour under test too.)
    while cgroups._read(os.path.join(left, "cgroup.procs")).strip():  # "" once it is gone
        assert time.monotonic() < deadline, "the dead host's worker is still running"
        time.sleep(0.02)
    group = cgroups.TaskGroup.create(8, 64 << 20)
    assert group is not None
    try:
        assert not os.path.exists(left)  # ... and swept by the next host
    finally:
        assert group.remove()
