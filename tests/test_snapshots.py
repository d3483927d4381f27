"""Timeouts that keep state: fork snapshots of the worker, against real processes."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from recursa.context import build_payload
from recursa.sandbox import SubprocessSandbox
from recursa.sandbox.proc import processes, stat_fields
from recursa.sandbox.proc import running as _alive
from tests.helpers import host_process, spinning_in_c, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork snapshots need Linux")

# SIGINT lands inside the inner loop's try and is swallowed; nothing interrupts the outer loop again.
SWALLOWS_INTERRUPTS = (
    "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"
)
C_LOOP = "sum(range(10**13))"  # holds the GIL in C: SIGINT is never looked at


class Host:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        self.calls.append((fn, args))
        return f"echo:{args.get('prompt')}"


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
async def sandbox(host: Host) -> AsyncIterator[SubprocessSandbox]:
    sb = SubprocessSandbox(grace_s=0.3)
    await sb.start(host)
    yield sb
    await sb.close()


def _stat(pid: int) -> list[str]:
    fields = stat_fields(pid)
    assert fields is not None, f"process {pid} is gone"
    return [f.decode() for f in fields]


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the processes whose parent is `pid`."""
    return [(child, f[0].decode()) for child, f in processes() if int(f[1]) == pid]


def _live_group(pgid: int) -> list[int]:
    return [member for member, f in processes() if int(f[2]) == pgid and f[0] != b"Z"]


def _wait_until(predicate: Any, timeout: float = 3.0) -> bool:
    """Poll a condition on processes we cannot wait for (signals are delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# -- the two ways a timeout ends ---------------------------------------------------------------


async def test_c_loop_is_killed_and_the_state_before_the_cell_comes_back(sandbox: SubprocessSandbox) -> None:
    await sandbox.execute("x = 41", 5)
    old_pid = sandbox.pid
    started = time.perf_counter()
    r = await sandbox.execute(f"x = 0\n{C_LOOP}", 0.5)
    took = time.perf_counter() - started
    assert r.timed_out and r.restarted and r.restored
    assert r.error is not None and r.error.startswith("TimeoutError")
    (note,) = r.notes
    assert "killed after 0.8s" in note and "restored to its state before this cell" in note
    assert "earlier ones are kept" in note
    assert took < 0.5 + 0.3 + 1.5  # deadline + grace + the takeover (milliseconds; slack for load)
    assert old_pid is not None and not _alive(old_pid) and sandbox.pid != old_pid
    r = await sandbox.execute("x", 5)
    assert (r.stdout, r.notes, r.restarted) == ("41\n", [], False)


async def test_code_swallowing_the_interrupt_is_restored(sandbox: SubprocessSandbox) -> None:
    await sandbox.execute("kept = [1, 2]", 5)
    r = await sandbox.execute(f"lost = 1\n{SWALLOWS_INTERRUPTS}", 0.3)
    # It really swallowed SIGINT: the interrupt alone did not end the cell.
    assert r.restored and r.error is not None and "ignored the interrupt" in r.error
    r = await sandbox.execute("print(kept)\nlost", 5)
    assert r.stdout == "[1, 2]\n" and r.error is not None and "NameError" in r.error


async def test_plain_loop_is_interrupted_and_keeps_what_the_cell_set(sandbox: SubprocessSandbox) -> None:
    pid = sandbox.pid
    r = await sandbox.execute("before = 'set in this cell'\nwhile True:\n    pass", 0.3)
    assert r.timed_out and not r.restarted and not r.restored
    assert r.error is not None and "KeyboardInterrupt" in r.error
    assert any("interrupted after 0.3s; variables kept" in n for n in r.notes)
    r = await sandbox.execute("before", 5)
    assert r.stdout == "'set in this cell'\n" and sandbox.pid == pid


async def test_context_and_call_backs_survive_a_restore(sandbox: SubprocessSandbox, host: Host) -> None:
    await sandbox.load_context(build_payload(["alpha", "beta"]))
    r = await sandbox.execute(f"context = None\n{C_LOOP}", 0.3)
    assert r.restored
    r = await sandbox.execute("print(context)\nllm_query('after the restore')", 5)
    assert r.stdout == "['alpha', 'beta']\n'echo:after the restore'\n"
    assert host.calls[-1] == ("llm_query", {"prompt": "after the restore", "model": None})


async def test_restores_chain_and_a_restored_worker_can_be_interrupted(sandbox: SubprocessSandbox) -> None:
    await sandbox.execute("n = 0", 5)
    pids = {sandbox.pid}
    for _ in range(3):
        r = await sandbox.execute(f"n += 1\nfirst = n\n{C_LOOP}", 0.2)
        assert r.restored
        pids.add(sandbox.pid)
        r = await sandbox.execute("n += 1", 5)  # a normal cell after each restore: its change stays
    assert len(pids) == 4
    r = await sandbox.execute("while True:\n    pass", 0.2)  # SIGINT reaches a worker we did not start
    assert r.timed_out and not r.restored and "KeyboardInterrupt" in (r.error or "")
    r = await sandbox.execute("n, 'first' in dir()", 5)
    assert r.stdout == "(3, False)\n"


async def test_random_state_is_part_of_the_snapshot(sandbox: SubprocessSandbox) -> None:
    await sandbox.execute("import random\nrandom.seed(7)", 5)
    r = await sandbox.execute(f"random.random()\n{C_LOOP}", 0.2)  # advanced, then rolled back
    assert r.restored
    r = await sandbox.execute("random.random()", 5)
    assert r.stdout == f"{__import__('random').Random(7).random()!r}\n"


async def test_crash_in_a_cell_is_restored(sandbox: SubprocessSandbox) -> None:
    await sandbox.execute("x = 'kept'", 5)
    r = await sandbox.execute("import os\nx = 'lost'\nos._exit(3)", 5)
    assert r.restored and not r.timed_out
    assert r.error is not None and "exit code 3" in r.error
    assert any("died (exit code 3)" in n and "restored" in n for n in r.notes)
    r = await sandbox.execute("x", 5)
    assert r.stdout == "'kept'\n"


# -- the first cell: a state no cell has changed ------------------------------------------------


@pytest.mark.parametrize("cell", [C_LOOP, "import os\nos._exit(3)"], ids=["killed", "crashed"])
async def test_a_lost_first_cell_comes_back_to_the_started_state_without_a_snapshot(
    host: Host, cell: str
) -> None:
    """Before the first cell the worker keeps no snapshot (two forks per REPL saved): a restart with
    the context and definitions replayed is that state, and is reported as a restore."""
    sb = SubprocessSandbox(grace_s=0.2)
    await sb.start(host)
    try:
        await sb.load_context(build_payload("the context"))
        await sb.define([{"name": "unit", "kind": "value", "value": "kg"}])
        assert await sb.wait_snapshot(timeout=0.3) is None
        first = sb.pid
        r = await sb.execute(cell, 0.3)
        assert r.restarted and r.restored, r
        (note,) = r.notes
        assert "restored to its state before this cell" in note and "no earlier cell had run" in note
        assert sb.pid != first
        r = await sb.execute("print(context, unit)", 5)
        assert (r.stdout, r.error, r.notes) == ("the context kg\n", None, [])
        await sb.execute("x = 'kept'", 5)  # from the second cell on, snapshots as before
        r = await sb.execute(f"x = 'lost'\n{C_LOOP}", 0.3)
        assert r.restored and "earlier ones are kept" in r.notes[0]
        assert (await sb.execute("x", 5)).stdout == "'kept'\n"
    finally:
        await sb.close()


# -- when there is no snapshot ------------------------------------------------------------------


async def test_without_a_snapshot_the_model_is_told_the_variables_are_gone(host: Host) -> None:
    sb = SubprocessSandbox(grace_s=0.2, restore_timeout=0.5)
    await sb.start(host)
    try:
        await sb.execute("x = 1", 5)
        # The cell kills the snapshot waiting for it, then cannot be stopped.
        snapshot = await sb.wait_snapshot()
        r = await sb.execute(f"import os, signal\nos.kill({snapshot}, signal.SIGKILL)\n{C_LOOP}", 0.3)
        assert r.restarted and not r.restored
        (note,) = r.notes
        assert "all variables were lost" in note and "no snapshot to restore from" in note
        r = await sb.execute("x", 5)
        assert r.error is not None and "NameError" in r.error
        r = await sb.execute(f"y = 2\n{C_LOOP}", 0.2)  # the fresh worker has snapshots again
        assert r.restored
    finally:
        await sb.close()


async def test_idle_snapshots_skip_a_cell_sent_at_once_and_keep_one_sent_later(host: Host) -> None:
    # snapshots="idle" (RLMEnv's default): the worker forks only on the host's word, which waits
    # until the host has sent nothing for `snapshot_idle_s` (a minute here: the cells below that
    # follow at once always come first).
    sb = SubprocessSandbox(grace_s=0.2, snapshots="idle")
    sb.snapshot_idle_s = 60.0
    await sb.start(host)
    try:
        await sb.execute("x = 1", 5)
        await sb.execute("y = 2", 5)
        r = await sb.execute(f"x = 3\n{C_LOOP}", 0.2)  # no snapshot of the state before it
        assert r.restarted and not r.restored
        assert "no time to take one (snapshots='idle')" in r.notes[-1], r.notes
        r = await sb.execute("x", 5)
        assert r.error is not None and "NameError" in r.error
        # A host that waits (a policy thinking) gives the word: the next cell is snapshotted.
        sb.snapshot_idle_s = 0.01
        await sb.execute("z = 4", 5)
        assert await sb.wait_snapshot() is not None
        r = await sb.execute(f"z = 5\n{C_LOOP}", 0.2)
        assert r.restored, r.notes
        assert (await sb.execute("print(z)", 5)).stdout == "4\n"
    finally:
        await sb.close()


def test_a_snapshot_mode_is_true_false_or_idle() -> None:
    from recursa.errors import ConfigError

    with pytest.raises(ConfigError, match="'idle' or False"):
        SubprocessSandbox(snapshots="sometimes")  # type: ignore[arg-type]


# -- no processes left behind -------------------------------------------------------------------


async def test_twenty_cells_leave_one_waiting_snapshot(sandbox: SubprocessSandbox) -> None:
    for i in range(20):
        await sandbox.execute(f"v{i} = {i}", 5)
    worker, snapshot = sandbox.pid, await sandbox.wait_snapshot()
    assert worker is not None and snapshot is not None
    # No zombies, no stale snapshots: the one replaced last is reaped once the worker is idle
    # (not before the next cell), so within moments rather than at once.
    assert _wait_until(lambda: [pid for pid, state in _children(worker)] == [snapshot])
    assert _alive(snapshot)


async def test_close_reaps_everything_even_after_restores(host: Host) -> None:
    sb = SubprocessSandbox(grace_s=0.2)
    await sb.start(host)
    assert sb.pid is not None
    group = keeper = os.getpgid(sb.pid)  # the keeper leads the group; the worker is its child
    assert int(_stat(sb.pid)[1]) == keeper
    fork = "import os, time\nkid = os.fork()\nif kid == 0:\n    time.sleep(60)\n    os._exit(0)\nkid"
    done = await sb.execute(fork, 5)
    first = int(done.stdout)
    if sb.isolation["tasks"] == "pids cgroup":  # what a cell started does not outlive it
        assert any("1 process(es) this cell started" in n for n in done.notes)
        assert _wait_until(lambda: not _alive(first))
    r = await sb.execute(f"{fork}\n{C_LOOP}", 0.2)  # this cell's child too outlives the killed worker
    assert r.restored
    # Processes are not part of a snapshot: what the old worker had started is stopped, and said so.
    assert any("started by earlier code were stopped" in n for n in r.notes)
    assert _wait_until(lambda: not _alive(first))
    second = int((await sb.execute(fork, 5)).stdout)
    worker, snapshot = sb.pid, await sb.wait_snapshot()
    assert worker is not None and snapshot is not None
    kept = [] if sb.isolation["tasks"] == "pids cgroup" else [second]
    assert _wait_until(lambda: sorted(_live_group(group)) == sorted([keeper, *kept, worker, snapshot]))
    assert int(_stat(worker)[1]) == keeper  # the restored worker: adopted by the keeper, not by init
    await sb.close()
    assert _wait_until(lambda: not _live_group(group))
    assert not _alive(worker) and not _alive(snapshot)
    assert [kid for kid in _children(os.getpid()) if kid[0] in (group, worker, snapshot)] == []


async def test_dropped_sandbox_takes_its_restored_worker_along(host: Host) -> None:
    sb = SubprocessSandbox(grace_s=0.2)
    await sb.start(host)
    assert sb.pid is not None
    group = os.getpgid(sb.pid)
    r = await sb.execute(C_LOOP, 0.2)
    assert r.restored
    del sb, r
    gc.collect()
    assert _wait_until(lambda: not _live_group(group))


_HOST_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from recursa.sandbox import SubprocessSandbox

    async def handler(fn, args):
        return "ok"

    async def main():
        sb = SubprocessSandbox(grace_s=0.2)
        await sb.start(handler)
        await sb.execute("x = 1", 5)
        if sys.argv[1] == "after-restore":
            assert (await sb.execute("sum(range(10**13))", 0.2)).restored
        print(json.dumps({"worker": sb.pid, "snapshot": await sb.wait_snapshot()}), flush=True)
        await sb.execute("sum(range(10**13))", 3600)  # the worker is stuck in C when we die

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("case", ["fresh", "after-restore"])
def test_worker_and_snapshot_die_with_a_killed_host(case: str) -> None:
    with host_process(_HOST_SCRIPT, case) as (harness, pids):
        worker, snapshot = pids["worker"], pids["snapshot"]
        assert _alive(worker) and _alive(snapshot)
        # Wait until the worker is spinning in C, then kill the host without any warning.
        wait_until(lambda: spinning_in_c(worker), 3, "the worker spinning in its cell")
        harness.kill()
        harness.wait()
        assert _wait_until(lambda: not _alive(worker) and not _alive(snapshot))


def test_takeover_latency_is_milliseconds() -> None:
    async def main() -> float:
        sb = SubprocessSandbox(grace_s=0.05)
        await sb.start(Host())
        try:
            await sb.execute("x = 1", 5)
            r = await sb.execute(C_LOOP, 0.05)
            assert r.restored
            return r.duration_s - 0.1  # what the restore took beyond the deadline and the grace
        finally:
            await sb.close()

    assert asyncio.run(main()) < 1.5  # milliseconds when quiet; a fresh-worker restart would not set restored


def test_sigint_is_ignored_by_a_waiting_snapshot() -> None:
    async def main() -> None:
        sb = SubprocessSandbox(grace_s=0.2)
        await sb.start(Host())
        try:
            await sb.execute("x = 'kept'", 5)
            snapshot = await sb.wait_snapshot()
            assert snapshot is not None
            os.kill(snapshot, signal.SIGINT)  # as a group-wide Ctrl-C would
            r = await sb.execute(C_LOOP, 0.2)
            assert r.restored and sb.pid == snapshot
            assert (await sb.execute("x", 5)).stdout == "'kept'\n"
        finally:
            await sb.close()

    asyncio.run(main())


async def test_a_forged_restored_pid_never_aims_the_hosts_signals_elsewhere(
    sandbox: SubprocessSandbox,
) -> None:
    # Code may rewrite the worker's own functions; the snapshot inherits them. Claim to be the host.
    forge = (
        "import sys\n"
        "W = sys.modules['recursa_worker.snapshots']\n"
        "real = W.Snapshots._take_over\n"
        "def forged(self, parent, fds):\n"
        "    transport, info = real(self, parent, fds)\n"
        f"    info['pid'] = {os.getpid()}\n"
        "    return transport, info\n"
        "W.Snapshots._take_over = forged\n"
        "x = 'kept'"
    )
    assert (await sandbox.execute(forge, 5)).error is None
    r = await sandbox.execute(C_LOOP, 0.2)
    assert r.restored and sandbox.pid is None  # taken over, but its pid is not believed
    r = await sandbox.execute("while True:\n    pass", 0.2)  # the interrupt goes in-band instead
    assert r.timed_out and not r.restarted and "KeyboardInterrupt" in (r.error or "")
    r = await sandbox.execute(C_LOOP, 0.2)  # and kills go to the whole sandbox, never to that pid
    assert r.timed_out and r.restarted
    last = await sandbox.execute("x", 5)
    assert last.stdout == "'kept'\n", last  # this process is still here, too


def test_huge_page_join_builds_canonical_strs() -> None:
    """The non-ASCII context loader joins windows into a str allocated before it is filled (so its
    memory can be advised for huge pages, which keeps fork snapshots cheap); it must equal "".join."""
    import random

    from recursa.sandbox.worker.context import _join_in_huge_pages

    rnd = random.Random(3)
    alphabets = [(32, 127), (128, 256), (256, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    cases = [["ab", "cd"], ["é", "abc"], ["\udc80", "x"], ["😀", "é", "Ā"], ["", ""], []]
    for _ in range(200):
        cases.append(
            [
                "".join(chr(rnd.randrange(*rnd.choice(alphabets))) for _ in range(rnd.randrange(0, 30)))
                for _ in range(rnd.randrange(1, 5))
            ]
        )
    for parts in cases:
        joined, expected = _join_in_huge_pages(parts), "".join(parts)
        assert joined == expected and hash(joined) == hash(expected)
        assert joined.isascii() == expected.isascii() and sys.getsizeof(joined) == sys.getsizeof(expected)
