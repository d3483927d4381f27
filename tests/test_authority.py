"""The host never acts on what sandboxed code names, and the code holds no authority of the host's.

Attacks from inside a cell: write the pid of a host process (or of a sibling REPL) into every file
descriptor the worker holds, hoping one is a control group's `cgroup.procs`/`tasks` opened by the
host, whose kill at the end of the cell would then hit it; fork a child that tries to leave the
cell's group so that it outlives the cell; change the mode, owner, times or extended attributes of
a file of the host's outside scratch (Landlock does not cover metadata).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from recursa.sandbox import Hardening, SubprocessSandbox
from recursa.sandbox.bwrap import find_bwrap
from recursa.sandbox.proc import running

BWRAP = [False] + ([True] if find_bwrap() is not None else [])

# Every descriptor that is not the channel (a socket): write `pids` into it, as text, one by one.
WRITE_PIDS = """
import os, stat
hits = 0
for fd in range(3, 1024):
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        continue
    if stat.S_ISSOCK(mode):
        continue
    for pid in {pids}:
        try:
            os.write(fd, str(pid).encode())
            hits += 1
        except OSError:
            pass
print("hits", hits)
"""

# A child that tries to leave the cell's group (write "0", itself, into every descriptor) and live on.
LEAVE_CELL = """
import os, stat, time
r, w = os.pipe()
child = os.fork()
if child == 0:
    for fd in reversed(range(3, 1024)):  # the sandbox's own group last: out of the cell's
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.write(fd, b"0")
        except OSError:
            pass
    os.write(w, b"x")
    time.sleep(600)
    os._exit(0)
os.read(r, 1)
print(child)
"""


async def _noop(fn: str, args: dict[str, Any]) -> Any:
    return None


@pytest.mark.parametrize("bwrap", BWRAP)
async def test_a_cell_cannot_get_the_host_to_kill_its_processes(tmp_path, victim, bwrap):
    sb = SubprocessSandbox(bwrap=bwrap, scratch_root=tmp_path)
    await sb.start(_noop)
    try:
        pids = [victim.pid]  # (the host itself died this way too: a victim is kinder to the test run)
        r = await sb.execute(WRITE_PIDS.format(pids=pids), 30)
        assert r.error is None, r
        assert running(victim.pid), "the host killed a process a cell named"
        r = await sb.execute("print('still here')", 30)
        assert r.stdout == "still here\n" and not r.restarted
    finally:
        await sb.close()


async def test_a_child_that_tries_to_leave_its_cell_does_not_outlive_it(tmp_path):
    sb = SubprocessSandbox(bwrap=False, scratch_root=tmp_path)
    await sb.start(_noop)
    try:
        r = await sb.execute(LEAVE_CELL, 30)
        assert r.error is None, r
        child = int(r.stdout)
        if sb._hardening.group is None:
            pytest.skip("no control group on this host: the poller alone watches the cell's processes")
        assert not running(child), "a process the cell forked outlived the cell"
    finally:
        await sb.close()


def _metadata_attack(path: str) -> str:
    return f"""
import contextlib
import os
done = []
for name, call in [
    ("chmod", lambda: os.chmod({path!r}, 0o4777)),
    ("chown", lambda: os.chown({path!r}, 4321, 4321)),
    ("utime", lambda: os.utime({path!r}, (0, 0))),
    ("setxattr", lambda: os.setxattr({path!r}, "user.recursa", b"1")),
]:
    try:
        call()
        done.append(name)
    except OSError:
        pass
print("done", done)
"""


@pytest.mark.parametrize("bwrap", BWRAP)
async def test_a_cell_cannot_change_the_metadata_of_a_host_file(tmp_path, bwrap):
    data = tmp_path / "data"
    data.mkdir()
    secret = data / "secret"
    secret.write_text("host secret")
    secret.chmod(0o600)
    before = os.stat(secret)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # The file is as visible as it can be: the user allowed its folder to be read.
    sb = SubprocessSandbox(bwrap=bwrap, scratch_root=scratch, hardening=Hardening(allow_read=(str(data),)))
    await sb.start(_noop)
    try:
        r = await sb.execute(_metadata_attack(str(secret)), 30)
        assert r.stdout == "done []\n", r
        after = os.stat(secret)
        assert (after.st_mode, after.st_uid, after.st_gid, after.st_mtime_ns) == (
            before.st_mode,
            before.st_uid,
            before.st_gid,
            before.st_mtime_ns,
        )
        assert stat.S_IMODE(after.st_mode) == 0o600
        # In scratch the code's own files stay its own to change.
        r = await sb.execute("open('f', 'w').close()\nimport os\nos.chmod('f', 0o600)\nprint('ok')", 30)
        assert r.stdout == "ok\n", r
        identity = sb.isolation["identity"]
        assert identity["host_files_metadata"] == "protected", identity
        if os.geteuid() == 0:
            r = await sb.execute("import os\nprint(os.getuid(), os.geteuid())", 30)
            assert r.stdout != "0 0\n" or identity["user_namespace"], (r.stdout, identity)
            assert identity["uid"] != 0 or identity["user_namespace"], identity
    finally:
        await sb.close()


async def test_repls_of_one_fork_server_cannot_see_or_kill_each_other(tmp_path):
    """One REPL's cell names its sibling (by the pid the sibling has in the zygote's namespace) to
    the kernel and to the host: the sibling, its variables and its snapshot live on."""
    from recursa.sandbox.forkserver import ForkServer
    from recursa.sandbox.worker.landlock import landlock_abi

    if find_bwrap() is None or landlock_abi() < 6:
        pytest.skip("forked REPLs need bubblewrap and Landlock ABI >= 6")
    server = ForkServer()
    a = SubprocessSandbox(bwrap=True, fork_server=server, scratch_root=tmp_path)
    b = SubprocessSandbox(bwrap=True, fork_server=server, scratch_root=tmp_path)
    await a.start(_noop)
    await b.start(_noop)
    try:
        assert a.isolation.get("forked") and b.isolation.get("forked")
        assert (await b.execute("x = 41", 30)).error is None
        assert (await b.execute("x += 1", 30)).error is None
        snapshot = await b.wait_snapshot()
        assert snapshot is not None and b.pid is not None
        # Every pid the sibling's processes have in the zygote's namespace (which the two shared).
        names = set()
        for pid in {b.pid, *_descendants_and_self(b._hardening._outer_pid)}:
            names.update(_ns_pids(pid)[1:2])
        kill = (
            "\nimport signal\nfor pid in {pids}:\n    if pid in (1, os.getpid()):\n        continue\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
        )
        r = await a.execute(WRITE_PIDS.format(pids=sorted(names)) + kill.format(pids=sorted(names)), 30)
        assert r.error is None, r
        r = await b.execute("print(x)", 30)
        assert r.stdout == "42\n" and not r.restarted, r
        assert await b.wait_snapshot() is not None  # and it forks its snapshots as before
        ns = {os.readlink(f"/proc/{sb.pid}/ns/pid") for sb in (a, b)}
        assert len(ns) == 2, "forked REPLs share a pid namespace"
    finally:
        await a.close()
        await b.close()
        await server.close()


def _descendants_and_self(pid: int | None) -> set[int]:
    from recursa.sandbox.proc import descendants

    return set() if pid is None else {pid, *descendants(pid)}


def _ns_pids(pid: int) -> list[int]:
    """NSpid of `pid`: its pid in each namespace from the host's down ([] once it has exited: an
    old snapshot replaced by a newer one between the listing and this read)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except FileNotFoundError:
        pass
    return []


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is a root host's: this test runs as a user")
async def test_a_root_host_refuses_a_worker_that_could_change_its_files(tmp_path, monkeypatch):
    """Where the worker keeps root's identity and no read-only mount holds (here: the unprivileged
    ids are root's own, and the worker is not asked for a mount namespace, as where the kernel
    refuses it one), the start fails
    with what to do, and leaves no worker behind: never a silent mode open to chmod of root's files."""
    from recursa.errors import SandboxError
    from recursa.sandbox import hardened

    monkeypatch.setattr(hardened, "unprivileged_ids", lambda: (0, 0))
    monkeypatch.setattr(hardened.HostHardening, "config", _no_mount_namespace(hardened.HostHardening.config))
    sb = SubprocessSandbox(bwrap=False, scratch_root=tmp_path)
    with pytest.raises(SandboxError, match="bubblewrap"):
        await sb.start(_noop)
    await sb.close()


def _no_mount_namespace(config):
    """HostHardening.config without the worker's own mount namespace: what a kernel that refuses it
    one leaves (user namespaces off, a container's seccomp)."""

    def patched(self, scratch, grouped=False):
        out = config(self, scratch, grouped)
        out.get("hardening", {}).pop("scratch_tmpfs", None)
        return out

    return patched


# Forge the end of the cell: send the host an answer to the running request, wait until the host
# has taken it (its word after an answer arrives), then go on running and try to fork children that
# would outlive the cell. Each child names itself `tag` so that the host can find it whatever its
# pid; the code then tells the host how many forks the kernel allowed, through a call.
FORGED_END = """
import ctypes, os, sys, time
f, server, request = sys._getframe(), None, None
while f is not None:
    here = f.f_locals.get("self")
    if server is None and hasattr(here, "snapshots") and hasattr(here, "chan"):
        server, request = here, f.f_locals.get("msg")
    f = f.f_back
chan = server.chan
chan.send({{"op": "exec_done", "id": request["id"], "stdout": "forged\\n", "stderr": "", "omitted_chars": 0,
           "error": None, "final": None, "restored_names": [], "notes": [], "duration_s": 0.0}})
word = chan.inbox.get(timeout=20)  # the host has taken the answer and acted on it
chan.inbox.put(word)
forked = 0
for _ in range(4):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        ctypes.CDLL(None).prctl(15, {tag!r}.encode(), 0, 0, 0)
        time.sleep(600)
        os._exit(0)
    forked += 1
chan.call("llm_query", {{"prompt": f"forked {{forked}}"}})
"""


@pytest.mark.parametrize("bwrap", BWRAP)
async def test_code_that_forges_the_end_of_its_cell_starts_nothing_after_it(tmp_path, bwrap):
    """The host took the forged answer and ended the cell: from then on the kernel refuses the code
    every new task in the cell's group, until the next cell starts (whose end kills what it makes)."""
    tag = f"forged{os.getpid() % 100000}{int(bwrap)}"
    told: asyncio.Queue[str] = asyncio.Queue()

    async def handler(fn: str, args: dict[str, Any]) -> Any:
        told.put_nowait(str(args.get("prompt")))
        return "ok"

    sb = SubprocessSandbox(bwrap=bwrap, scratch_root=tmp_path)
    await sb.start(handler)
    try:
        if sb._hardening.group is None:
            pytest.skip("no control group on this host: the poller alone watches the cell's processes")
        assert (await sb.execute("x = 1", 30)).error is None
        r = await sb.execute(FORGED_END.format(tag=tag), 30)
        assert r.stdout == "forged\n", r  # the host took the forged answer
        said = await asyncio.wait_for(told.get(), 30)  # the code ran on after it, and is done forking
        assert said == "forked 0", said
        assert _tagged(tag) == [], "a process forked after the host ended the cell is alive"
        r = await sb.execute("print(x)", 30)
        assert r.stdout == "1\n", r
    finally:
        await sb.close()
        for pid in _tagged(tag):  # never leave them to the rest of the run
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


# Run code on the worker's reader thread (which delivers the replies to a cell's calls) by replacing
# what it calls, and fork from there: a thread the host never moves into the cell's group.
FROM_THE_READER = """
import ctypes, os, sys, time
f, server = sys._getframe(), None
while f is not None:
    here = f.f_locals.get("self")
    if server is None and hasattr(here, "snapshots") and hasattr(here, "chan"):
        server = here
    f = f.f_back
chan = server.chan
route = chan._route
def hijacked(msg):
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, {tag!r}.encode(), 0, 0, 0)
        time.sleep(600)
        os._exit(0)
    chan._route = route
    route(msg)
chan._route = hijacked
chan.call("llm_query", {{"prompt": "x"}})
"""


# Run code on the thread that forks the worker's snapshots (it calls os.fork) and fork from there,
# as many as it may (reaping what it can: a killed snapshot counts until it is reaped); once only
# (the host empties the snapshots' group as each cell ends).
FROM_THE_FORKER = """
import ctypes, os, time
real_fork = os.fork
def hijacked():
    os.fork = real_fork
    forked = 0
    for _ in range(200):
        try:
            pid = real_fork()
        except OSError:
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.005)
            continue
        if pid == 0:
            ctypes.CDLL(None).prctl(15, {tag!r}.encode(), 0, 0, 0)
            time.sleep(600)
            os._exit(0)
        forked += 1
        if forked == 4:
            break
    with open("forked", "w") as fh:
        fh.write(str(forked))
    return real_fork()
os.fork = hijacked
"""
ATTACKS = {"reader_thread": FROM_THE_READER, "forker_thread": FROM_THE_FORKER}


@contextlib.asynccontextmanager
async def _sandbox(tmp_path: Any, tag: str, **options: Any) -> AsyncIterator[SubprocessSandbox]:
    """A started SubprocessSandbox without bwrap, closed after, and every process named `tag` killed."""
    sb = SubprocessSandbox(bwrap=None, scratch_root=tmp_path, **options)
    await sb.start(_noop)
    try:
        yield sb
    finally:
        await sb.close()
        for pid in _tagged(tag):  # never leave them to the rest of the run
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


def _gone_soon(tag: str) -> bool:
    """Whether the processes named `tag` are gone within a few seconds (a process just killed
    takes a moment to exit: bounded, not a wait for something to happen)."""
    import time

    deadline = time.monotonic() + 5.0
    while _tagged(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _tagged(tag: str) -> list[int]:
    """Live processes (zombies excepted) whose name is `tag`."""
    from recursa.sandbox.proc import processes

    found = []
    for pid, fields in processes():
        if fields[0] in (b"Z", b"X"):
            continue
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() == tag:
                    found.append(pid)
        except OSError:
            pass
    return found


# (The "idle" snapshots, RLMEnv's default, fork later and only when the host is quiet: the forker's
# attack there runs at the snapshot the host waits for, and not at all for the cell sent at once.)
@pytest.mark.parametrize(
    ("attack", "snapshots"), [("reader_thread", True), ("forker_thread", True), ("forker_thread", "idle")]
)
@pytest.mark.parametrize("bwrap", BWRAP)
async def test_no_process_a_cell_started_outlives_it_whatever_it_writes(tmp_path, bwrap, attack, snapshots):
    """A cell that ends itself early by writing its own answer, or runs code on the worker's other
    threads (the one that carries replies, the one that forks snapshots) to fork from there, leaves
    nothing running once the host has ended a cell after it."""
    tag = f"stray{os.getpid() % 100000}{int(bwrap)}{attack[:2]}{str(snapshots)[0]}"
    sb = SubprocessSandbox(bwrap=bwrap, scratch_root=tmp_path, snapshots=snapshots)
    await sb.start(_noop)
    try:
        if sb._hardening.group is None:
            pytest.skip("no control group on this host: the poller alone watches the cell's processes")
        assert (await sb.execute("x = 1", 30)).error is None
        r = await sb.execute(ATTACKS[attack].format(tag=tag), 30)
        assert r.error is None, r
        if attack == "forker_thread":
            # It forks once the host has taken the answer, in the snapshots' group: as soon as the
            # worker reports its snapshot, before the next cell runs, nothing else lives there.
            await sb.wait_snapshot()
            assert _gone_soon(tag), "a process forked in the snapshots' group outlived the report"
        # Sent after that cell's code has finished (the worker runs one request at a time).
        r = await sb.execute("print(x)", 30)
        assert r.stdout == "1\n", r
        if attack != "reader_thread":
            forked = int((await sb.execute("print(open('forked').read())", 30)).stdout)
            assert forked >= 1, "the attack did not run"
            if attack == "forker_thread":  # the kernel's cap on the snapshots' group holds
                assert forked <= 2, f"{forked} processes forked in the snapshots' group"
        assert _tagged(tag) == [], "a process a cell forked outlived it"
    finally:
        await sb.close()
        for pid in _tagged(tag):  # never leave them to the rest of the run
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


# Code of a cell that finds the worker's snapshot-forking thread (by garbage collector) and has it
# fork a process of its own, into the snapshots' group, whether snapshots are on or off.
ON_THE_FORKER = """
import ctypes, gc, os, time
forker = next(o for o in gc.get_objects() if type(o).__name__ == "Forker")
def job():
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None).prctl(15, {tag!r}.encode(), 0, 0, 0)
        time.sleep(600)
        os._exit(0)
    return pid
print(forker.run(job))
"""


@pytest.mark.parametrize("snapshots", [False, True])
async def test_what_code_forks_on_the_snapshots_thread_dies_with_its_cell(tmp_path, snapshots):
    tag = f"snapthr{os.getpid() % 100000}{int(snapshots)}"
    async with _sandbox(tmp_path, tag, snapshots=snapshots) as sb:
        if not sb._hardening.cells_placed:
            pytest.skip("no snapshots' thread here: the worker's threads are not placed in groups (cgroup v1)")
        assert (await sb.execute("x = 1", 30)).error is None
        r = await sb.execute(ON_THE_FORKER.format(tag=tag), 30)
        assert r.error is None and int(r.stdout) > 0, r  # it forked, into the snapshots' group
        assert (await sb.execute("print(x)", 30)).stdout == "1\n"
        assert _gone_soon(tag), "a process forked on the snapshots' thread outlived the cell after it"


# A cell that forks a sleeper named {tag}; with `start`, it also starts a thread of the worker that
# waits for the next cell, which ends it and forks another sleeper: the cell's group then counts as
# many tasks as after the first cell, one of them no longer the worker's (own_threads.py).
SWAP_A_THREAD = """
import ctypes, os, threading, time
def sleeper():
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, {tag!r}.encode(), 0, 0, 0)
        time.sleep(600)
        os._exit(0)
if {start}:
    stop = threading.Event()
    waiter = threading.Thread(target=stop.wait, daemon=True)
    waiter.start()
else:
    stop.set()
    waiter.join()
sleeper()
"""


async def test_a_process_in_place_of_a_thread_of_the_worker_does_not_outlive_its_cell(tmp_path):
    """The host takes the cell's group count for the worker's own threads only while each of them
    lives: a cell that ends one of them and forks a process has that process killed as it ends, as
    is one forked by the first cell (where the host finds the worker's threads)."""
    tag = f"swap{os.getpid() % 100000}"
    async with _sandbox(tmp_path, tag, snapshots=False) as sb:
        if not sb._hardening.cells_placed:
            pytest.skip("the worker's threads are not placed in groups here (cgroup v1 only)")
        killed = "1 process(es) this cell started were still running when it ended and were killed"
        for start in (True, False):
            r = await sb.execute(SWAP_A_THREAD.format(tag=tag, start=start), 30)
            assert r.error is None and killed in r.notes, r
            assert _gone_soon(tag), "a process a cell forked outlived it"


# A host that is no root: this interpreter as the uid and gid of nobody, with no capability at all.
# Its Python may live below a folder only root may enter (a pyenv in /root): the host then runs in a
# mount namespace of its own in which that folder is a world-readable tmpfs holding that tree alone,
# as a user's own Python would be to the user.
UNPRIVILEGED_HOST = """
set -e
mount --make-rprivate /
for top in $TOPS; do
    mkdir -p "$WORK/real$top"
    mount --bind "$top" "$WORK/real$top"
    mount -t tmpfs -o mode=0755,size=1m recursa-test "$top"
done
for tree in $TREES; do
    mkdir -p "$tree"
    mount --bind "$WORK/real$tree" "$tree"
done
exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all "$@"
"""

# What the unprivileged host runs: the metadata attack in a REPL per mode; a JSON line per mode.
AS_USER = """
import asyncio, json, sys, warnings
from recursa.sandbox import Hardening, SubprocessSandbox

data, scratch, attack_mine, attack_roots = sys.argv[1:5]

def no_mount_namespace(config):
    def patched(scratch, grouped=False):
        out = config(scratch, grouped)
        out.get("hardening", {}).pop("scratch_tmpfs", None)
        return out
    return patched

async def noop(fn, args):
    return None

async def mode(bwrap, refused):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb = SubprocessSandbox(bwrap=bwrap, scratch_root=scratch, hardening=Hardening(allow_read=(data,)))
        if refused:  # as where the kernel refuses the worker a namespace of its own (no user namespaces)
            sb._hardening.config = no_mount_namespace(sb._hardening.config)
        await sb.start(noop)
    try:
        mine = (await sb.execute(attack_mine, 30)).stdout
        roots = (await sb.execute(attack_roots, 30)).stdout
        own = (await sb.execute("open('f', 'w').close()\\nimport os\\nos.chmod('f', 0o600)\\nprint('ok')", 30)).stdout
        return {"bwrap": sb.isolation["bwrap"], "identity": sb.isolation["identity"], "mine": mine,
                "roots": roots, "scratch": own, "warned": [str(w.message) for w in caught]}
    finally:
        await sb.close()

async def main():
    for bwrap, refused in ((False, False), (False, True), (None, False)):
        print(json.dumps(await mode(bwrap, refused)), flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a root host plays the user here; as a user the tests above are that")
def test_an_unprivileged_hosts_worker_cannot_change_the_users_files(tmp_path):
    """A host that is no root and has no capability: without bwrap the worker keeps the host's uid,
    so its own user's files are the ones at stake. Where the worker makes a user and mount namespace
    of its own, every mount but scratch is read-only: metadata calls on the user's files fail and
    `isolation` says what protects them. Where the kernel refuses it one, it says they are exposed,
    with a warning, never silently; and root's files stay root's either way.
    Bwrap where it is installed (the default "if available") binds them read-only."""
    import json
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="recursa-user-host-")  # not below pytest's root-only folders
    try:
        data = os.path.join(work, "data")
        os.mkdir(data)
        mine, roots = os.path.join(data, "mine"), os.path.join(data, "roots")
        for path in (mine, roots):
            with open(path, "w") as fh:
                fh.write("x")
        os.chmod(mine, 0o600)
        os.chown(mine, 65534, 65534)  # the user's own secret
        for path in (work, data, os.path.join(work, "scratch")):
            os.makedirs(path, exist_ok=True)
            os.chown(path, 65534, 65534)
        before = {p: os.stat(p) for p in (mine, roots)}
        python = os.path.realpath(sys.executable)
        # The top folders on the interpreter's path that only root may enter, and what they must show.
        tops = sorted({"/" + p.split("/")[1] for p in (python, sys.prefix) if not os.stat("/" + p.split("/")[1]).st_mode & 0o001})
        trees = sorted({"/".join(sys.prefix.split("/")[:3])} if tops else set())
        env = {**os.environ, "WORK": work, "TOPS": " ".join(tops), "TREES": " ".join(trees)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(os.path.join(p, "recursa")))
        cmd = ["unshare", "--mount", "sh", "-c", UNPRIVILEGED_HOST, "host", python, "-c", AS_USER]
        cmd += [data, os.path.join(work, "scratch"), _metadata_attack(mine), _metadata_attack(roots)]
        out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        own_ns, no_ns, auto = (json.loads(line) for line in out.stdout.splitlines())
        for mode in (own_ns, no_ns, auto):
            assert mode["roots"] == "done []\n", mode  # root's files: the user may not, nor may the worker
            assert mode["scratch"] == "ok\n", mode  # its own files in scratch stay its own to change
        assert own_ns["identity"]["uid"] == 65534 and own_ns["identity"]["host_files_metadata"] == "protected"
        assert own_ns["mine"] == "done []\n", own_ns
        assert no_ns["identity"]["host_files_metadata"] == "exposed", no_ns
        assert any("can change the mode" in w for w in no_ns["warned"]), no_ns  # said, never silent
        assert "chmod" in no_ns["mine"], no_ns  # and it is so: the user's own file was open to it
        if find_bwrap() is not None:
            assert auto["bwrap"] and auto["identity"]["host_files_metadata"] == "protected", auto
            assert auto["mine"] == "done []\n", auto
        assert os.stat(roots) == before[roots]
    finally:
        shutil.rmtree(work, ignore_errors=True)
