"""The hardened worker: what each layer blocks, what keeps working, and honest reporting.

The seccomp program is checked by running it through a small classic-BPF interpreter (both
machines, no kernel needed); everything else runs real worker processes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from recursa.context import build_payload
from recursa.errors import SandboxError
from recursa.sandbox import Hardening, InProcessSandbox, SubprocessSandbox, make_sandbox
from recursa.sandbox.bwrap import bwrap_command, find_bwrap
from recursa.sandbox.guard import ProcessGuard, group_members, threads_total
from recursa.sandbox.hardened import HostHardening
from recursa.sandbox.policy import describe
from recursa.sandbox.reported_limits import memory_entry
from recursa.sandbox.worker import landlock as hmod
from recursa.sandbox.worker import seccomp
from recursa.sandbox.worker_log import WorkerLog
from tests.helpers import FILL_SCRATCH

linux_only = pytest.mark.skipif(hmod.landlock_abi() < 6, reason="needs Landlock ABI >= 6 (Linux 6.12+)")
needs_bwrap = pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap (bwrap) is not installed")

ALLOW, KILL = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
X86, ARM = 0xC000003E, 0xC00000B7


async def echo(fn: str, args: dict[str, Any]) -> Any:
    if fn == "llm_query_batched":
        return [f"echo:{p}" for p in args["prompts"]]
    return f"echo:{args.get('prompt')}"


@pytest.fixture
async def hardened() -> AsyncIterator[SubprocessSandbox]:
    sb = SubprocessSandbox(snapshots=False)
    await sb.start(echo)
    yield sb
    await sb.close()


async def started(**kw: Any) -> SubprocessSandbox:
    kw.setdefault("snapshots", False)
    sb = SubprocessSandbox(**kw)
    await sb.start(echo)
    return sb


async def out(sb: SubprocessSandbox, src: str, timeout: float = 10.0) -> str:
    r = await sb.execute(src, timeout)
    return r.stdout + (r.error or "")


# -- the seccomp program, interpreted ------------------------------------------------------------


def run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Evaluate a classic-BPF seccomp program on one syscall; returns the action value."""
    args = tuple(args) + (0,) * (6 - len(args))
    data = nr.to_bytes(4, "little", signed=True) + arch.to_bytes(4, "little") + bytes(8)
    data += b"".join((a & (2**64 - 1)).to_bytes(8, "little") for a in args)
    insns = [
        (int.from_bytes(program[i : i + 2], "little"), program[i + 2], program[i + 3],
         int.from_bytes(program[i + 4 : i + 8], "little"))
        for i in range(0, len(program), 8)
    ]  # fmt: skip
    pc, acc = 0, 0
    for _ in range(len(insns) + 1):
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = int.from_bytes(data[k : k + 4], "little")
            pc += 1
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if hit else jf)
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
    raise AssertionError("the program did not return")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_program_decisions(machine: str) -> None:
    prog = seccomp.seccomp_filter(machine, own_pid=100, own_pgid=100, restrict_signals=False)
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096
    arch = X86 if machine == "x86_64" else ARM
    col = 0 if machine == "x86_64" else 1

    def nr(name: str) -> int:
        n = seccomp._NR[name][col]
        assert n is not None
        return n

    read = 0 if machine == "x86_64" else 63
    assert run_bpf(prog, read, arch) == ALLOW
    assert run_bpf(prog, read, 0x40000003) == KILL  # i386 through int 0x80: another ABI, killed
    for name in ("socket", "connect", "bind", "execve", "execveat", "ptrace", "mount", "unshare", "setns",
                 "bpf", "io_uring_setup", "kexec_load", "keyctl", "perf_event_open", "userfaultfd",
                 "process_vm_readv", "init_module", "setsid", "setpgid", "pidfd_getfd"):  # fmt: skip
        assert run_bpf(prog, nr(name), arch) == EPERM, name
    assert run_bpf(prog, nr("clone3"), arch) == ENOSYS  # glibc falls back to clone()
    assert run_bpf(prog, nr("clone"), arch, (0x11 | 0x01000000 | 0x00200000,)) == ALLOW  # fork()
    assert run_bpf(prog, nr("clone"), arch, (0x3D0F00,)) == ALLOW  # pthread_create
    assert run_bpf(prog, nr("clone"), arch, (0x10000000 | 0x11,)) == EPERM  # CLONE_NEWUSER
    assert run_bpf(prog, nr("socketpair"), arch, (1,)) == ALLOW  # AF_UNIX: asyncio's self-pipe
    assert run_bpf(prog, nr("socketpair"), arch, (2,)) == EPERM
    assert run_bpf(prog, nr("prlimit64"), arch, (0, 9, 0, 0x7FFF0000)) == ALLOW  # getrlimit
    assert run_bpf(prog, nr("prlimit64"), arch, (0, 9, 0x7FFF0000, 0)) == EPERM  # setrlimit
    assert run_bpf(prog, nr("prlimit64"), arch, (1234, 9, 0, 0x7FFF0000)) == EPERM  # another process
    assert run_bpf(prog, nr("setpriority"), arch, (0, 0, 19)) == ALLOW
    assert run_bpf(prog, nr("setpriority"), arch, (0, 1234, 19)) == EPERM
    assert run_bpf(prog, nr("kill"), arch, (1234, 9)) == ALLOW  # Landlock's signal scope decides
    for name in ("memfd_create", "memfd_secret", "shmget", "msgget", "mq_open"):  # memory no rlimit counts
        assert run_bpf(prog, nr(name), arch) == EPERM, name
    mmap = nr("mmap")
    assert run_bpf(prog, mmap, arch, (0, 1 << 30, 3, 0x22)) == ALLOW  # private anonymous: RLIMIT_DATA
    assert run_bpf(prog, mmap, arch, (0, 1 << 30, 3, 0x21)) == EPERM  # shared anonymous
    assert run_bpf(prog, mmap, arch, (0, 1 << 30, 3, 0x23)) == EPERM  # MAP_SHARED_VALIDATE
    assert run_bpf(prog, mmap, arch, (0, 4096, 3, 0x01, 5)) == ALLOW  # a shared file mapping
    if machine == "x86_64":
        assert run_bpf(prog, 0x40000000 | 41, arch) == EPERM  # x32 socket()


def test_seccomp_restricts_signals_when_landlock_cannot() -> None:
    prog = seccomp.seccomp_filter("x86_64", own_pid=100, own_pgid=100, restrict_signals=True)
    kill, tgkill, fcntl = 62, 234, 72
    assert run_bpf(prog, kill, X86, (100, 2)) == ALLOW
    assert run_bpf(prog, kill, X86, (0, 2)) == ALLOW
    assert run_bpf(prog, kill, X86, ((-100) & 0xFFFFFFFF, 2)) == ALLOW  # our own group
    assert run_bpf(prog, kill, X86, (1, 9)) == EPERM
    assert run_bpf(prog, tgkill, X86, (100, 101, 2)) == ALLOW
    assert run_bpf(prog, tgkill, X86, (55, 55, 9)) == EPERM
    assert run_bpf(prog, fcntl, X86, (3, 8, 55)) == EPERM  # F_SETOWN: SIGIO to another process
    assert run_bpf(prog, fcntl, X86, (3, 1)) == ALLOW  # F_GETFD


def test_no_table_for_other_machines() -> None:
    with pytest.raises(KeyError):
        seccomp.seccomp_filter("riscv64", own_pid=1, own_pgid=1, restrict_signals=False)


# -- honest reporting ----------------------------------------------------------------------------


def _report(**over: Any) -> dict[str, Any]:
    base = {
        "requested": True,
        "landlock": 7,
        "landlock_fs": True,
        "landlock_net": True,
        "landlock_scopes": ["abstract_unix_socket", "signal"],
        "seccomp": True,
        "verified": {"filesystem": True, "network": True},
        "namespaces": [],
        "rlimits": {"core": 0},
        "warnings": [],
    }
    return {**base, **over}


def test_levels_follow_what_was_verified() -> None:
    assert describe(_report(), bwrap=False, process_limit=64)["level"] == "hardened"
    ns = ["user", "mnt", "pid", "net", "ipc", "uts"]
    assert describe(_report(namespaces=ns), bwrap=True, process_limit=64)["level"] == "hardened+namespaces"
    lying = describe(_report(verified={"filesystem": False, "network": True}), bwrap=False, process_limit=1)
    assert lying["level"] == "partial" and lying["landlock"] is False and lying["warnings"]
    no_ll = describe(_report(landlock=False, landlock_fs=False), bwrap=False, process_limit=1)
    assert no_ll["level"] == "partial" and no_ll["seccomp"] is True
    half = describe(_report(namespaces=["user"]), bwrap=True, process_limit=1)
    assert half["level"] == "hardened" and any("shares namespaces" in w for w in half["warnings"])
    off = describe({"requested": False, "rlimits": {"core": 0}}, bwrap=False, process_limit=None)
    assert off["level"] == "partial" and off["landlock"] is False and off["process"] is True


def test_a_worker_that_cannot_load_hardening_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from recursa.sandbox.worker import server

    monkeypatch.setattr(server, "HARDENING_MODULE", "no_such_hardening")
    report = server.harden({"hardening": {"read_write": ["/nonexistent"]}})
    assert report["requested"] and "error" in report
    isolation = describe(report, bwrap=False, process_limit=None)
    assert isolation["level"] == "partial" and not isolation["landlock"] and not isolation["seccomp"]
    assert any("not confined" in w for w in isolation["warnings"])


def test_inprocess_is_level_none() -> None:
    assert InProcessSandbox().isolation["level"] == "none"


# -- real workers --------------------------------------------------------------------------------


@linux_only
async def test_hardened_worker_reports_what_it_applied(hardened: SubprocessSandbox) -> None:
    iso = hardened.isolation
    assert iso["level"] == "hardened" and iso["landlock"] == hmod.landlock_abi() and iso["seccomp"]
    assert iso["env_scrubbed"] and iso["no_new_privs"] and iso["capabilities_dropped"]
    assert iso["landlock_net"] and iso["signals"] == "landlock" and iso["warnings"] == []
    assert (
        iso["rlimits"]["core"] == 0
        and iso["rlimits"]["fsize"] == 1 << 30
        and iso["rlimits"]["nofile"] == 1024
    )
    assert iso["rlimits"]["data"] is None  # set once a context is loaded
    payload = build_payload("x" * 1000)
    try:
        await hardened.load_context(payload)
    finally:
        payload.close()
    data = hardened.isolation["rlimits"]["data"]
    assert 4 << 30 < data < (4 << 30) + (512 << 20)  # what it uses plus the 4 GiB headroom
    assert await out(hardened, "len(context)") == "1000\n"


@linux_only
async def test_what_keeps_working_under_seccomp(hardened: SubprocessSandbox) -> None:
    src = (
        "import asyncio, threading, os, json, re, decimal, datetime, tempfile\n"
        "async def main():\n"
        "    await asyncio.sleep(0)\n"
        "    return 'async ok'\n"
        "print(asyncio.run(main()))\n"
        "res = []\n"
        "ts = [threading.Thread(target=lambda i=i: res.append(llm_query(str(i)))) for i in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(len(res), sorted(res)[0])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(7)\n"
        "print('child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "with tempfile.NamedTemporaryFile('w') as fh:\n"
        "    fh.write('x'); fh.flush(); print('tmp in scratch', os.path.dirname(fh.name) == os.getcwd())\n"
        "print(os.cpu_count() >= 1, exit.__class__.__name__)"
    )
    text = await out(hardened, src)
    assert text == "async ok\n8 echo:0\nchild exit 7\ntmp in scratch True\nTrue Quitter\n"


@linux_only
async def test_calls_aimed_at_other_processes_are_refused(hardened: SubprocessSandbox) -> None:
    before = os.getpriority(os.PRIO_PROCESS, os.getpid())
    src = (
        "import os, resource\n"
        "ppid = os.getppid()\n"
        "for name, call in [('setsid', os.setsid), ('setpgid', lambda: os.setpgid(0, 0)),\n"
        "        ('prlimit', lambda: resource.prlimit(ppid, resource.RLIMIT_NOFILE, (1, 1))),\n"
        "        ('renice', lambda: os.setpriority(os.PRIO_PROCESS, ppid, 19)),\n"
        "        ('affinity', lambda: os.sched_setaffinity(ppid, {0})),\n"
        "        ('raise rlimit', lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096)))]:\n"
        "    try:\n"
        "        call()\n"
        "        print(name, 'DONE')\n"
        "    except (OSError, ValueError) as e:\n"
        "        print(name, 'refused')"
    )
    text = await out(hardened, src)
    assert "DONE" not in text and text.count("refused") == 6
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == before


@linux_only
async def test_memory_limit_raises_memoryerror_and_the_session_survives() -> None:
    sb = await started(hardening=Hardening(memory_limit_bytes=300 << 20))
    try:
        assert sb.isolation["rlimits"]["data"] == 300 << 20
        assert await out(sb, "kept = 'still here'\nlen(kept)") == "10\n"
        text = await out(sb, "big = bytearray(400 * 2**20)")
        assert text.endswith("MemoryError")
        text = await out(sb, "hog = []\nwhile True:\n    hog.append(bytearray(20 * 2**20))")
        assert text.endswith("MemoryError")
        assert await out(sb, "del hog\nkept") == "'still here'\n"
    finally:
        await sb.close()


@linux_only
async def test_file_size_and_open_file_limits() -> None:
    sb = await started(hardening=Hardening(max_file_bytes=1 << 20, max_open_files=64))
    try:
        text = await out(sb, "open('big.bin', 'wb').write(b'x' * (2 << 20))")
        assert "File too large" in text
        text = await out(sb, "fhs = [open('f%d' % i, 'w') for i in range(100)]")
        assert "Too many open files" in text
        assert await out(sb, "import os\nlen(os.listdir('.')) > 10") == "True\n"  # still alive
    finally:
        await sb.close()


@linux_only
@pytest.mark.parametrize("bwrap", [False, True], ids=["landlock", "bwrap"])
async def test_allowed_folders_are_readable_with_and_without_bwrap(tmp_path, bwrap) -> None:
    if bwrap and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed here (.ci/run installs it)")
    data = tmp_path / "data.txt"
    data.write_text("shared data")
    sb = await started(hardening=Hardening(allow_read=(str(tmp_path),)), bwrap=bwrap)
    try:
        # Without bwrap the worker's only namespaces are those of its sized scratch folder.
        namespaces = set(sb.isolation["namespaces"])
        assert {"mnt", "pid", "net"} <= namespaces if bwrap else namespaces <= {"user", "mnt"}
        assert await out(sb, f"open({str(data)!r}).read()") == "'shared data'\n"
        assert "Error" in await out(sb, f"open({str(data)!r}, 'a').write('x')")
    finally:
        await sb.close()


@linux_only
async def test_packages_are_hidden_unless_allowed(tmp_path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("shared data")
    sb = await started(hardening=Hardening(allow_read=(str(tmp_path),)))
    try:
        assert "ModuleNotFoundError" in await out(sb, "import numpy")
        site_file = os.path.join(os.path.dirname(os.__file__), "site-packages", "README.txt")
        assert "PermissionError" in await out(sb, f"open({site_file!r}).read()")
        assert await out(sb, f"open({str(data)!r}).read()") == "'shared data'\n"
        written = await out(sb, f"open({str(data)!r}, 'a').write('x')")
        assert "PermissionError" in written or "Read-only file system" in written, written
    finally:
        await sb.close()
    try:
        import numpy  # noqa: F401
    except ImportError:
        return
    sb = await started(hardening=Hardening(allow_site_packages=True))
    try:
        assert await out(sb, "import numpy\nint(numpy.arange(4).sum())") == "6\n"
    finally:
        await sb.close()


@linux_only
async def test_without_signal_scoping_seccomp_keeps_signals_home() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])  # noqa: ASYNC220
    sb = await started(hardening=Hardening(landlock_max_abi=5))
    try:
        iso = sb.isolation
        assert (
            iso["landlock"] == 5 and iso["landlock_scopes"] == [] and iso["signals"] == "seccomp (self only)"
        )
        assert iso["level"] == "hardened"
        text = await out(sb, f"import os\nos.kill(os.getpid(), 0)\nos.kill({sleeper.pid}, 9)")
        assert text.endswith("PermissionError: [Errno 1] Operation not permitted")
        assert sleeper.poll() is None
    finally:
        await sb.close()
        sleeper.kill()
        sleeper.wait()


@linux_only
@pytest.mark.parametrize(
    ("options", "missing"),
    [(Hardening(landlock=False), "Landlock"), (Hardening(seccomp=False), "seccomp")],
)
async def test_a_missing_layer_is_reported_and_warned(options: Hardening, missing: str) -> None:
    with pytest.warns(UserWarning, match="only partial"):
        sb = await started(hardening=options)
    try:
        iso = sb.isolation
        assert iso["level"] == "partial" and any(missing in w for w in iso["warnings"])
        assert iso["landlock" if missing == "Landlock" else "seccomp"] is False
        assert await out(sb, "1 + 1") == "2\n"  # the run still works
    finally:
        await sb.close()


async def test_hardening_off_is_partial() -> None:
    sb = await started(hardening=False)
    try:
        assert sb.isolation["level"] == "partial" and sb.isolation["seccomp"] is False
        assert await out(sb, "import os\nlen(os.listdir('/')) > 0") == "True\n"  # not confined, as reported
    finally:
        await sb.close()


# -- bwrap ---------------------------------------------------------------------------------------


@linux_only
@needs_bwrap
async def test_bwrap_namespaces_fd_passing_and_interrupts() -> None:
    sb = await started(bwrap=True, grace_s=1.0)
    try:
        iso = sb.isolation
        assert iso["level"] == "hardened+namespaces" and iso["bwrap"]
        assert {"user", "mnt", "pid", "net", "ipc", "uts"} <= set(iso["namespaces"])
        text = await out(sb, "import os\n(os.getpid() < 10, os.path.exists('/etc/passwd'), llm_query('hi'))")
        assert text == "(True, False, 'echo:hi')\n"  # own pid namespace, no host files, channel works
        pool = "import multiprocessing as mp\nwith mp.get_context('fork').Pool(2) as p:\n    print(p.map(abs, [-1, -2]))"
        assert await out(sb, pool) == "[1, 2]\n"  # semaphores in a private /dev/shm
        await sb.execute("kept = 1", 5)
        r = await sb.execute("while True:\n    pass", 0.3)
        assert r.timed_out and not r.restarted and "KeyboardInterrupt" in (r.error or "")
        assert await out(sb, "kept") == "1\n"
    finally:
        await sb.close()


@linux_only
@needs_bwrap
async def test_auto_falls_back_when_bwrap_cannot_start(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr("recursa.sandbox.hardened.find_bwrap", lambda: str(fake))
    monkeypatch.setattr(HostHardening, "bwrap_broken", None)
    sb = make_sandbox("auto", snapshots=False)
    with pytest.warns(UserWarning, match="could not start the REPL worker"):
        await sb.start(echo)
    try:
        assert sb.isolation["level"] == "hardened" and not sb.isolation["bwrap"]
        assert await out(sb, "1 + 1") == "2\n"  # type: ignore[arg-type]
    finally:
        await sb.close()
    strict = SubprocessSandbox(bwrap=True, snapshots=False)
    with pytest.raises(SandboxError, match="No permissions"):
        await strict.start(echo)
    await strict.close()


@linux_only
@needs_bwrap
async def test_a_failed_start_names_what_the_worker_wrote_even_when_its_log_is_read_late(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a busy host the log's reader thread may not have run yet when the worker is found dead.
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr("recursa.sandbox.hardened.find_bwrap", lambda: str(fake))
    drain = WorkerLog._drain

    def late_drain(self: WorkerLog, *args: object) -> None:
        time.sleep(0.5)
        drain(self, *args)

    monkeypatch.setattr(WorkerLog, "_drain", late_drain)
    strict = SubprocessSandbox(bwrap=True, snapshots=False)
    with pytest.raises(SandboxError, match="No permissions"):
        await strict.start(echo)
    await strict.close()


def test_bwrap_required_but_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("recursa.sandbox.hardened.find_bwrap", lambda: None)
    with pytest.raises(SandboxError, match="bubblewrap is not installed"):
        SubprocessSandbox(bwrap=True)


# -- the process guard's pieces ------------------------------------------------------------------


def test_group_members_and_thread_total() -> None:
    members = dict(group_members(os.getpgid(0)))
    assert os.getpid() in members and members[os.getpid()] in "RS"
    assert threads_total() >= 1


def test_bwrap_command_probes_the_system_once_but_user_folders_every_time(tmp_path: Path) -> None:
    later = tmp_path / "data"
    first = bwrap_command("/usr/bin/bwrap", sys.executable, [], str(tmp_path / "s1"), [str(later)])
    later.mkdir()
    second = bwrap_command("/usr/bin/bwrap", sys.executable, [], str(tmp_path / "s2"), [str(later)])
    assert str(later) not in first and second[second.index(str(later)) - 1] == "--ro-bind"
    assert second[-6:] == [
        "--bind",
        str(tmp_path / "s2"),
        str(tmp_path / "s2"),
        "--chdir",
        str(tmp_path / "s2"),
        "--",
    ]
    assert first[: first.index("--bind")] == second[: second.index(str(later)) - 1]


def test_the_task_cap_falls_back_to_rlimit_nproc_only_in_bwraps_user_namespace_and_not_for_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host = HostHardening(Hardening(max_processes=40), bwrap=None, python=sys.executable)
    monkeypatch.setattr(host, "_bwrap_path", lambda: "/usr/bin/bwrap")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert host.config(str(tmp_path))["hardening"]["max_tasks"] == 40  # counted per user namespace
    assert "max_tasks" not in host.config(str(tmp_path), grouped=True)["hardening"]  # the group holds
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "max_tasks" not in host.config(str(tmp_path))["hardening"]  # root ignores RLIMIT_NPROC
    monkeypatch.setattr(host, "_bwrap_path", lambda: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "max_tasks" not in host.config(str(tmp_path))["hardening"]  # would count all the user's


def test_isolation_names_what_caps_tasks() -> None:
    host = HostHardening(Hardening(), bwrap=False, python=sys.executable)
    iso: dict[str, Any] = {"warnings": []}
    assert host._tasks({"rlimits": {"nproc": 40}}, iso) == "RLIMIT_NPROC"
    assert host._tasks({"rlimits": {}}, iso) == "poller"
    assert host._tasks({"cgroup": "joining the control group failed: EACCES"}, iso) == "poller"
    assert iso["warnings"] == ["joining the control group failed: EACCES"]
    assert HostHardening(None, bwrap=False, python=sys.executable)._tasks({}, iso) == "none"


@pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap (bwrap) is not installed")
@linux_only
async def test_a_non_root_host_without_a_control_group_gets_rlimit_nproc_in_bwrap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the host's view only: the worker is a process apart
    sb = SubprocessSandbox(hardening=Hardening(cgroups=False, max_processes=40), bwrap=True)
    try:
        await sb.start(lambda fn, args: None)  # type: ignore[arg-type, return-value]
        assert sb.isolation["tasks"] == "RLIMIT_NPROC" and sb.isolation["rlimits"]["nproc"] == 40
        assert (
            await sb.execute("import resource\nresource.getrlimit(resource.RLIMIT_NPROC)", 10)
        ).stdout == ("(40, 40)\n")
    finally:
        await sb.close()


def _may_mount() -> bool:
    """Whether a process here may make a mount namespace of its own (CAP_SYS_ADMIN), as a worker
    started without bwrap does for its sized scratch folder."""
    pid = os.fork()
    if pid == 0:
        import ctypes

        os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.skipif(not _may_mount(), reason="no CAP_SYS_ADMIN here: a worker without bwrap cannot mount")
@linux_only
async def test_without_bwrap_the_scratch_folder_is_capped_in_total(tmp_path: Path) -> None:
    # Each file is under the per-file limit; together they pass the scratch cap.
    hardening = Hardening(max_scratch_bytes=8 << 20, max_file_bytes=6 << 20)
    sb = await started(hardening=hardening, bwrap=False, scratch_root=tmp_path)
    try:
        assert await out(sb, FILL_SCRATCH) == "['ok', 'No space left on device', 'No space left on device']\n"
        memory = sb.isolation["memory"]
        assert memory["tmpfs_bytes"] == {"scratch": 8 << 20} and "tmpfs size" in memory["mechanisms"]
        assert not any("scratch" in gap for gap in memory["not_covered"])
        assert os.listdir(sb.scratch_dir or "") == []  # the files were never on the host's disk
    finally:
        await sb.close()


def test_isolation_says_why_the_scratch_folder_is_the_hosts() -> None:
    report = {"scratch_tmpfs": None, "scratch_tmpfs_error": "unshare: Operation not permitted"}
    memory = memory_entry(Hardening(max_scratch_bytes=8 << 20), None, None, False, {"warnings": []}, report)
    assert "scratch" not in memory["tmpfs_bytes"]
    assert any("per file" in gap and "Operation not permitted" in gap for gap in memory["not_covered"])


def test_a_finished_event_loop_is_not_kept_alive_by_the_process_guard() -> None:
    # Every sync RLM.run() is an asyncio.run() of its own: a watcher holding its loop kept each one.
    async def guarded() -> weakref.ref[asyncio.AbstractEventLoop]:
        guard = ProcessGuard(
            pgid=2**22 - 3,  # no such group: the watcher never finds anything to judge
            main_pid=lambda: 0,
            spare=set,
            limit=4,
            alive=lambda: True,  # still watched when the loop ends
            on_trip=lambda message: None,
        )
        guard.start()
        await asyncio.sleep(0)
        return weakref.ref(asyncio.get_running_loop())

    loop = asyncio.run(guarded())
    gc.collect()
    assert loop() is None
