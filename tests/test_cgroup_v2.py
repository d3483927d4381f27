"""The cgroup v2 paths of the sandbox's control groups, run for real on a host whose controllers
are bound to v1 hierarchies: a cgroup2 hierarchy (the one mounted here, or one the test mounts) holds
the groups, by the test-only setting `cgroups.TEST_V2_ROOT`. The worker joins its group's `home` leaf
through the `cgroup.procs` descriptor the host hands it, the host moves the whole worker into the
cell's group before each cell and into the snapshots' after its answer, and kills what a cell leaves;
the attacks of tests/test_authority.py that do not need a task cap run against it.

What cannot run here: the `pids` controller (and `memory`) cannot be enabled in a cgroup2 hierarchy
while a v1 hierarchy holds it, and moving it would take unmounting the host's v1 `pids` hierarchy,
which every process of this machine is in. So the v2 task caps (`pids.max` of the sandbox, its
cell's group closed between cells, one snapshot's room) are not exercised: the groups here have none.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from typing import Any

import pytest

from recursa.sandbox import SubprocessSandbox, cgroups
from recursa.sandbox.bwrap import find_bwrap
from recursa.sandbox.proc import running
from tests.test_authority import FROM_THE_FORKER, FROM_THE_READER, LEAVE_CELL, WRITE_PIDS, _tagged

BWRAP = [False] + ([True] if find_bwrap() is not None else [])


def _cgroup2_mount() -> tuple[str | None, bool]:
    """(a cgroup2 mount point, whether this test mounted it), or (None, False)."""
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4], False
    if os.geteuid() != 0:
        return None, False
    where = tempfile.mkdtemp(prefix="recursa-cgroup2-")
    if subprocess.run(["mount", "-t", "cgroup2", "none", where], capture_output=True).returncode != 0:
        os.rmdir(where)
        return None, False
    return where, True


@pytest.fixture(scope="module")
def v2_root():
    with open("/proc/self/cgroup") as fh:
        if not any(line.startswith("0::") for line in fh):
            pytest.skip("this process has no place in a cgroup2 hierarchy (a kernel without cgroup v2)")
    root, mounted = _cgroup2_mount()
    if root is None:
        pytest.skip("no cgroup2 hierarchy is mounted and this user may not mount one")
    try:
        yield root
    finally:
        if mounted:
            subprocess.run(["umount", root], check=False)
            os.rmdir(root)


@pytest.fixture
def v2(v2_root, monkeypatch):
    """The sandbox's control groups in that cgroup2 hierarchy, for one test."""
    monkeypatch.setenv(cgroups.TEST_V2_ROOT, v2_root)
    cgroups._parent.cache_clear()
    parent = cgroups._parent()
    if parent is None or parent.version != 2:
        cgroups._parent.cache_clear()
        pytest.skip(f"this process may not make groups in the cgroup2 hierarchy at {v2_root}")
    yield parent
    monkeypatch.delenv(cgroups.TEST_V2_ROOT)
    cgroups._parent.cache_clear()


def _listing(folder: str) -> set[str]:
    return {os.path.join(folder, name) for name in os.listdir(folder)}


def _group_of(pid: int | None) -> str:
    with open(f"/proc/{pid}/cgroup") as fh:
        return next(line.strip().split(":", 2)[2] for line in fh if line.startswith("0::"))


@pytest.mark.parametrize("snapshots", [True, "idle"])
@pytest.mark.parametrize("bwrap", BWRAP)
async def test_the_worker_is_moved_into_the_cells_group_and_out_after_each_cell(tmp_path, v2, bwrap, snapshots):
    seen: list[str] = []
    sb: SubprocessSandbox

    async def handler(fn: str, args: dict[str, Any]) -> Any:
        seen.append(_group_of(sb.pid))  # asked from inside a cell: where the worker is meanwhile
        return "ok"

    sb = SubprocessSandbox(bwrap=bwrap, scratch_root=tmp_path, snapshots=snapshots)
    await sb.start(handler)
    try:
        group = sb._hardening.group
        assert group is not None and group.version == 2 and not group.capped
        assert sb.isolation["tasks"] != "pids cgroup"  # no cap is claimed where there is none
        base = "/" + group.path[len(v2.path) :].strip("/")
        assert _group_of(sb.pid) == f"{base}/home"  # joined through the descriptor, before any cell
        if snapshots == "idle":  # cells sent at once: no word, no snapshot, the moves as usual
            for code in ("x = 1", "x += 1", "print(x)"):
                r = await sb.execute(code, 30)
                assert r.error is None, r
            assert r.stdout == "2\n" and _group_of(sb.pid) == f"{base}/snap"
        for _ in range(2):
            r = await sb.execute("llm_query('where am I?')", 30)
            assert r.error is None, r
            assert seen.pop() == f"{base}/cell"
            assert await sb.wait_snapshot() is not None  # forked in the snapshots' group
            assert _group_of(sb.pid) == f"{base}/snap"
        # What a cell leaves running is killed as it ends; the snapshot of the state is kept.
        r = await sb.execute("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(600)\nprint(pid)", 30)
        assert r.error is None and any("were killed" in n for n in r.notes), r
        assert sb._hardening.group is not None and set(group.members("cell")) <= {sb.pid}
    finally:
        await sb.close()
    assert group.path not in _listing(v2.path)  # removed when the sandbox closed


@pytest.mark.parametrize("bwrap", BWRAP)
async def test_a_cell_cannot_get_the_host_to_kill_its_processes_on_v2(tmp_path, v2, victim, bwrap):
    sb = SubprocessSandbox(bwrap=bwrap, scratch_root=tmp_path)
    await sb.start(_noop)
    try:
        r = await sb.execute(WRITE_PIDS.format(pids=[victim.pid, os.getpid()]), 30)
        assert r.error is None, r
        assert running(victim.pid), "the host killed a process a cell named"
        r = await sb.execute(LEAVE_CELL, 30)
        assert r.error is None and any("were killed" in n for n in r.notes), r
        if not bwrap:  # (under bwrap the pid it printed is one of its namespace)
            assert not running(int(r.stdout)), "a process the cell forked outlived it"
    finally:
        await sb.close()


async def _noop(fn: str, args: dict[str, Any]) -> Any:
    return None


@pytest.mark.parametrize("attack", ["reader_thread", "forker_thread"])
async def test_no_process_a_cell_started_outlives_the_next_cell_on_v2(tmp_path, v2, attack):
    """Code run on the worker's other threads forks into the group the whole worker is in at that
    moment: what it forks is gone once the host has ended a cell after it. (Without `pids` here, the
    snapshots' group is not capped: how many it may fork there is not checked.)"""
    tag = f"v2stray{os.getpid() % 100000}{attack[:2]}"
    sb = SubprocessSandbox(bwrap=False, scratch_root=tmp_path)
    await sb.start(_noop)
    try:
        assert (await sb.execute("x = 1", 30)).error is None
        code = FROM_THE_READER if attack == "reader_thread" else FROM_THE_FORKER
        assert (await sb.execute(code.format(tag=tag), 30)).error is None
        r = await sb.execute("print(x)", 30)
        assert r.stdout == "1\n", r
        if attack == "forker_thread":
            forked = int((await sb.execute("print(open('forked').read())", 30)).stdout)
            assert forked >= 1, "the attack did not run"
        assert _tagged(tag) == [], "a process a cell forked outlived it"
    finally:
        await sb.close()
        for pid in _tagged(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
