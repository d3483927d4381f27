"""Workers forked from a zygote (sandbox/forkserver.py, sandbox/worker/zygote.py): they work like workers
started anew, and siblings cannot reach each other although they share bwrap's pid namespace."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from recursa import RLM
from recursa.sandbox import Hardening, SubprocessSandbox
from recursa.sandbox.bwrap import find_bwrap
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.proc import running as alive  # a zombie counts as gone
from recursa.sandbox.subprocess import _sibling_gap
from recursa.sandbox.worker import landlock as hmod
from recursa.sandbox.worker.server import parse_args

pytestmark = [
    pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.skipif(hmod.landlock_abi() < 6, reason="needs Landlock ABI >= 6 (Linux 6.12+)"),
]


async def echo(fn: str, args: dict[str, Any]) -> Any:
    return f"echo:{args.get('prompt')}"


async def forked(server: ForkServer, **kw: Any) -> SubprocessSandbox:
    sb = SubprocessSandbox(bwrap=True, fork_server=server, **kw)
    await sb.start(echo)
    return sb


async def out(sb: SubprocessSandbox, src: str, timeout: float = 10.0) -> str:
    r = await sb.execute(src, timeout)
    return r.stdout + (r.error or "")


def exists(path: str) -> bool:
    return os.path.exists(path)


def zygote_dirs(root: str | os.PathLike[str] | None = None) -> set[str]:
    folder = tempfile.gettempdir() if root is None else root
    return {name for name in os.listdir(folder) if name.startswith("recursa-zygote-")}


async def test_forked_workers_run_cells_fully_hardened_each_in_its_own_scratch() -> None:
    server = ForkServer()
    a = await forked(server)
    b = await forked(server)
    try:
        assert server.forks == 2 and server.unavailable is None
        for sb in (a, b):
            iso = sb.isolation
            assert iso["forked"] and iso["level"] == "hardened+namespaces", iso
            assert iso["seccomp"] and iso["signals"] == "landlock" and iso["capabilities_dropped"]
            assert sb._hardening.last_report["capabilities"]["bounding"] == "0000000000000000"
            assert sb.scratch_dir is not None and Path(sb.scratch_dir).parent == Path(server.root or "")
        assert a.scratch_dir != b.scratch_dir
        assert (
            await out(a, "import os\nprint(os.getcwd(), os.environ['HOME'])")
            == f"{a.scratch_dir} {a.scratch_dir}\n"
        )
        assert await out(a, "llm_query('hi')") == "'echo:hi'\n"
        assert "PermissionError" in await out(a, "import socket\nsocket.socket()")  # seccomp
    finally:
        await a.close()
        await b.close()
        await server.close()


async def test_siblings_share_no_files_no_shm_no_ipc_and_cannot_signal_each_other() -> None:
    server = ForkServer()
    a = await forked(server)
    b = await forked(server)
    try:
        a_pid = int(await out(a, "import os\nprint(os.getpid())"))
        await out(a, "open('mine.txt', 'w').write('secret')\nopen('/dev/shm/sem.x', 'w').write('1')")
        assert await out(a, "print(open('mine.txt').read())") == "secret\n"
        reach = f"open({os.path.join(a.scratch_dir or '', 'mine.txt')!r}).read()"
        # Its own scratch tmpfs (the folder is empty from outside), and Landlock: only its own.
        assert "FileNotFoundError" in await out(b, reach)
        assert await out(b, "import os\nos.listdir('/dev/shm')") == "[]\n"  # a /dev/shm of its own
        # Each has a pid namespace of its own: a's pid means nothing (or b's own process) in b's.
        assert a_pid == int(await out(b, "import os\nprint(os.getpid())"))
        assert os.readlink(f"/proc/{a.pid}/ns/pid") != os.readlink(f"/proc/{b.pid}/ns/pid")
        await out(b, "import os\nos.kill(-1, 9)")  # everything it may signal: its own snapshot at most
        assert await out(a, "print('still here')") == "still here\n"
        zygote = server._slot.zygote
        assert zygote is not None and alive(zygote.pid)
        # System V shared memory: refused by seccomp (memory no rlimit counts); own IPC namespaces.
        shm = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.shmget(4242, 4096, {flags}) >= 0)"
        assert await out(a, shm.format(flags=0o1600)) == "False\n"  # IPC_CREAT | 0600
        # Each killable on its own: closing one leaves the other working.
        pid = a._worker.process.pid if a._worker else -1
        await a.close()
        assert not alive(pid)
        assert await out(b, "1 + 1") == "2\n"
    finally:
        await a.close()
        await b.close()
        await server.close()


async def test_a_forked_worker_survives_timeouts_with_its_state() -> None:
    server = ForkServer()
    sb = await forked(server, snapshots=True, grace_s=0.5)
    try:
        await sb.execute("kept = 41", 5)
        r = await sb.execute("while True:\n    pass", 0.3)
        assert r.timed_out and "KeyboardInterrupt" in (r.error or "")
        r = await sb.execute("sum(range(10**13))", 0.3)  # C code: only a kill stops it
        assert r.timed_out
        assert await out(sb, "kept + 1") == "42\n"
    finally:
        await sb.close()
        await server.close()


async def test_closing_the_server_ends_the_zygote_and_removes_its_folder() -> None:
    server = ForkServer()
    sb = await forked(server)
    zygote = server._slot.zygote
    assert zygote is not None and alive(zygote.pid) and server.root is not None
    root = server.root
    await sb.close()
    await server.close()
    assert not alive(zygote.pid) and not exists(root)
    later = SubprocessSandbox(bwrap=True, fork_server=server)
    await later.start(echo)
    try:
        assert not later.isolation.get("forked") and await out(later, "1") == "1\n"  # started anew
    finally:
        await later.close()


async def test_a_dead_zygote_means_workers_start_anew() -> None:
    server = ForkServer()
    first = await forked(server)
    zygote = server._slot.zygote
    assert zygote is not None
    os.kill(zygote.pid, 9)
    await asyncio.sleep(0.1)
    second = await forked(server)
    try:
        assert not second.isolation.get("forked") and await out(second, "2 * 3") == "6\n"
        assert server.unavailable is not None
        # The first one's worker died with the zygote: it comes back, started anew.
        r = await first.execute("1 + 1", 10)
        assert r.stdout == "2\n" or r.restarted, r
        assert await out(first, "3 + 3") == "6\n" and not first.isolation.get("forked")
    finally:
        await first.close()
        await second.close()
        await server.close()


@pytest.mark.parametrize("seen", [True, False], ids=["seen", "gone-before-seen"])
async def test_a_worker_the_zygote_cannot_prepare_is_started_anew_and_forks_stop(
    seen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ForkServer()
    first = await forked(server)
    assert server.root is not None
    if not seen:
        # The worker dies at once; on a loaded host it can be gone (reaped: the zygote ignores
        # SIGCHLD) before the host looks its pid up. That stopped the zygote, killing `first`'s
        # worker with it, and the reason said only that the pid was not found.
        monkeypatch.setattr("recursa.sandbox.forkserver.inner_pid", lambda outer, ns: None)
    broken = SubprocessSandbox(bwrap=True, fork_server=server)
    broken.scratch_dir = os.path.join(server.root, "not-there")  # the forked child cannot chdir
    broken._zygote_root = server.root
    await broken.start(echo)
    try:
        assert not broken.isolation.get("forked") and await out(broken, "5 * 5") == "25\n"
        assert "cannot prepare a worker" in (server.unavailable or ""), server.unavailable
        assert await out(first, "7 * 7") == "49\n"  # its forked sibling is untouched
    finally:
        await first.close()
        await broken.close()
        await server.close()


def test_a_forked_worker_must_report_every_layer_that_keeps_siblings_apart() -> None:
    full = {
        "seccomp": True,
        "landlock_scopes": ["abstract_unix_socket", "signal"],
        "capabilities_dropped": True,
    }
    assert _sibling_gap(full) is None
    assert _sibling_gap({**full, "seccomp": False}) == "no seccomp filter"
    assert _sibling_gap({**full, "landlock_scopes": []}) == "no Landlock signal scoping"
    assert _sibling_gap({**full, "capabilities_dropped": False}) == "capabilities left"


async def test_only_sandboxes_with_the_zygotes_settings_and_full_isolation_are_forked() -> None:
    server = ForkServer()
    a = await forked(server)
    other = await forked(server, hardening=Hardening(max_open_files=64))  # settings differ
    no_scope = SubprocessSandbox(bwrap=True, hardening=Hardening(landlock_max_abi=5), fork_server=server)
    try:
        assert a.isolation["forked"] and not other.isolation.get("forked")
        assert "signal scoping" in (no_scope._hardening.why_not_forked() or "")
        assert "hardening is off" in (SubprocessSandbox(hardening=False)._hardening.why_not_forked() or "")
        assert server.forks == 1
    finally:
        await a.close()
        await other.close()
        await server.close()


async def test_a_tree_with_child_rlms_forks_their_repls_and_ends_the_zygote(server, script, tmp_path) -> None:
    script.root("root-model", code("r = rlm_query_batched(['a', 'b'], contexts=['x', 'y'])\nFINAL_VAR('r')"))
    script.root("sub-model", code("FINAL(context)"))

    def tree_rlm(**kw: Any) -> RLM:
        return RLM(
            "openai/root-model",
            sub_model="openai/sub-model",
            base_url=server.base_url,
            api_key="test-key-0123456789",
            max_depth=2,
            trace_dir=tmp_path,
            **kw,
        )

    # A scratch folder of this test's own: the system temp folder also holds the zygotes of tests
    # running beside this one (xdist workers, other checkouts).
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = await tree_rlm(sandbox_options={"scratch_root": str(scratch)}).arun("q", "ctx")
    assert result.value == ["x", "y"] and result.isolation.get("forked") is True, result.error
    assert zygote_dirs(scratch) == set()  # ended with the tree
    plain = await tree_rlm(sandbox_options={"fork_server": None}).arun("q", "ctx")
    assert plain.value == ["x", "y"] and not plain.isolation.get("forked")


def code(src: str) -> str:
    return f"```repl\n{src}\n```"


def test_the_worker_takes_a_zygote_control_socket() -> None:
    assert parse_args(["--zygote", "5"]) == (5, {"_zygote": True})
    with pytest.raises(SystemExit, match="one of --fd and --zygote"):
        parse_args(["--zygote", "5", "--fd", "6"])


async def test_closing_forked_workers_kills_their_group_without_scanning_every_process(monkeypatch) -> None:
    """A forked worker's group is killed by number: a /proc scan for members first (one read per
    process on the machine, on every close) could only find what killpg itself finds."""
    import recursa.sandbox.processes as processes

    scans: list[int] = []

    def counted(pgid: int) -> list[tuple[int, int, str]]:
        scans.append(pgid)
        return []

    server = ForkServer()
    plain = await forked(server)
    restored = await forked(server, snapshots=True, grace_s=0.3)
    try:
        await restored.execute("kept = 1", 5)
        assert (await restored.execute("sum(range(10**13))", 0.3)).restored  # now an adopted snapshot
        assert plain._worker is not None and restored._worker is not None
        handles = [plain._worker.process, restored._worker.process]
        assert isinstance(handles[0], processes.ForkedProcess)
        assert isinstance(handles[1], processes.AdoptedProcess)
        pids = [h.pid for h in handles]
        assert all(pid is not None and alive(pid) for pid in pids)
        monkeypatch.setattr(processes, "group_members", counted)
        await plain.close()
        await restored.close()
        assert scans == []
        assert not any(alive(pid) for pid in pids if pid is not None)
    finally:
        await plain.close()
        await restored.close()
        await server.close()


HIDDEN = os.path.realpath(aiohttp.__file__)  # in site-packages: its files stay unreadable in a worker


async def test_a_forked_worker_applies_the_zygotes_open_rules_and_keeps_none_of_them() -> None:
    """The zygote opens every read rule's path once; each worker adds its rules from those
    descriptors and closes them before any cell runs."""
    server = ForkServer()
    sb = await forked(server)
    try:
        report = sb._hardening.last_report
        assert report["landlock_rules"] > 100, report["landlock_rules"]  # the stdlib split entry by entry
        open_fds = "import os\nn = 0\nfor fd in range(4096):\n    try:\n        os.fstat(fd)\n        n += 1\n    except OSError:\n        pass\nprint(n)"
        assert int(await out(sb, open_fds)) < 32
        assert await out(sb, "import json, email.message, xml.dom.minidom\nprint('ok')") == "ok\n"
        assert "PermissionError" in await out(sb, f"open({HIDDEN!r}).read()")
    finally:
        await sb.close()
        await server.close()
