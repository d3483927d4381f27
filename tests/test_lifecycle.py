"""Lifecycle guarantees: every wait has a deadline; cancelling a run stops its calls, reaps every
REPL process of the tree and ends its trace; Ctrl-C in the CLI reports what was done; a host that
is SIGKILLed leaves a readable trace and no REPL process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from recursa import RLM, Budget
from recursa.sandbox.proc import running as _running
from recursa.tasks import generate
from recursa.trace import load
from recursa.trace.redact import Redactor
from recursa.trace.writer import TraceWriter

from .helpers import wait_until
from .serve_helpers import descendants
from .test_rlm_openai import code, make_rlm

KEY_ENV = {"OPENAI_API_KEY": "test-key-0123456789"}
# A deadline is met when the run is back within this long after it (the promise: a second).
LATE_S = 1.0

# -- processes -----------------------------------------------------------------------------------


def _still_running(pids: Iterable[int], within: float) -> set[int]:
    """The pids of `pids` still running once `within` seconds have passed (polling /proc)."""
    deadline = time.monotonic() + within
    left = {p for p in pids if _running(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = {p for p in left if _running(p)}
    return left


class Tracked:
    """Every process started below this one while the block runs (REPL workers, keepers, bwrap,
    snapshots), sampled from /proc, so a test can prove they are all gone afterwards."""

    def __init__(self) -> None:
        self.baseline = descendants(os.getpid())
        self.seen: set[int] = set()
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.seen |= descendants(os.getpid()) - self.baseline
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> Tracked:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def assert_reaped(self, within: float = 1.0) -> None:
        assert self.seen, "no REPL process was ever seen: the test did not test anything"
        left = _still_running(self.seen, within)
        assert not left, f"REPL processes still running {within} s after the run returned: {left}"


def test_a_wait_for_a_process_to_exit_is_woken_by_the_exit_not_by_polling() -> None:
    # A close waits while the kernel tears a REPL's processes down (0.1-0.5 s with dozens closing at
    # once): the wait sleeps on the process's pidfd, where a check every 2 ms cost a busy host CPU.
    from recursa.sandbox.processes import LocalProcess

    process = LocalProcess(subprocess.Popen(["sleep", "0.3"], start_new_session=True))
    stuck = LocalProcess(subprocess.Popen(["sleep", "30"], start_new_session=True))
    exited, checks = process.exited, []
    process.exited = lambda: checks.append(1) or exited()  # type: ignore[method-assign]

    async def waits() -> None:
        try:
            assert await process.wait_exit(5.0) and exited()
            assert len(checks) <= 5, f"{len(checks)} checks in 0.3 s: polled, not woken by the exit"
            began = time.monotonic()
            assert not await stuck.wait_exit(0.2)  # the deadline still holds
            assert 0.15 < time.monotonic() - began < 2
        finally:
            await process.kill()
            await stuck.kill()

    asyncio.run(waits())
    assert stuck.exited()


async def _timed(coro: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = await coro
    return result, time.monotonic() - started


# -- never a hang: deadlines -----------------------------------------------------------------------


async def test_a_model_that_never_answers_stops_at_the_run_deadline(tmp_path):
    rlm = RLM("scripted/gpt5-like:latency=60", trace_dir=tmp_path, budget=Budget(max_seconds=1))
    async with Tracked() as procs:
        result, took = await _timed(rlm.arun("Where is the needle?", "hay " * 100))
    assert result.stop_reason == "timeout" and "1 s" in result.error
    assert took < 1 + LATE_S, took
    procs.assert_reaped()
    trace = load(result.trace_path)
    assert trace.complete and trace.root.stop_reason == "timeout"


async def test_a_slow_server_stops_at_the_run_deadline_through_the_sdk(server, script, tmp_path):
    script.root("root-model", "FINAL(too late)")
    server.latency_s = 3.0  # ends by itself before the module's server stops
    rlm = make_rlm(server, tmp_path, budget=Budget(max_seconds=1))
    async with Tracked() as procs:
        result, took = await _timed(rlm.arun("q", "ctx"))
    assert result.stop_reason == "timeout" and result.answer != "too late"
    assert took < 1 + LATE_S, took
    procs.assert_reaped()


async def test_request_timeout_bounds_one_model_call_without_a_run_budget(server, script, tmp_path):
    script.root("root-model", "FINAL(too late)")
    server.latency_s = 3.0
    rlm = make_rlm(server, tmp_path, request_timeout=0.5, max_retries=0)
    result, took = await _timed(rlm.arun("q", "ctx"))
    assert result.stop_reason == "error" and "timed out" in result.error
    assert took < 2.5, took  # 0.5 s for the call, the rest is the REPL's start and close
    assert load(result.trace_path).complete


@pytest.mark.parametrize(
    "stuck",
    [
        "while True:\n    pass",  # Python code: SIGINT would stop it
        "import time\ntime.sleep(100)",  # a blocking call
        "sum(range(10**13))",  # C code holding the GIL: only a kill stops it
    ],
    ids=["busy-loop", "sleep", "c-loop"],
)
async def test_code_that_never_ends_stops_at_the_run_deadline(server, script, tmp_path, stuck):
    script.root("root-model", code(stuck))
    rlm = make_rlm(server, tmp_path, exec_timeout=100, budget=Budget(max_seconds=1))
    async with Tracked() as procs:
        result, took = await _timed(rlm.arun("q", "ctx"))
    assert result.stop_reason == "timeout"
    assert took < 1 + LATE_S, took
    procs.assert_reaped()
    assert load(result.trace_path).complete


async def test_stuck_child_runs_stop_at_the_deadline_and_each_ends_its_trace(server, script, tmp_path):
    script.root(
        "root-model", code("r = rlm_query_batched(['a', 'b', 'c'], contexts=['x', 'y', 'z'])\nFINAL(r)")
    )
    script.root("sub-model", code("while True:\n    pass"))  # what every child run writes
    rlm = make_rlm(server, tmp_path, max_depth=2, exec_timeout=100, budget=Budget(max_seconds=2))
    async with Tracked() as procs:
        result, took = await _timed(rlm.arun("q", "ctx"))
    assert result.stop_reason == "timeout"
    assert took < 2 + LATE_S, took
    procs.assert_reaped()
    trace = load(result.trace_path)
    children = trace.root.children
    assert len(children) == 3 and all(c.of_type("lm_call") for c in children)  # they really ran
    # Each child was stopped by the deadline (or by its parent's close, a moment later): either
    # way its run_end is written, for the children as for the root.
    assert trace.complete, trace.notes
    assert {c.stop_reason for c in children} <= {"timeout", "cancelled"}


# -- cancellation -----------------------------------------------------------------------------------


class Events:
    """An on_event listener that keeps every event, for waiting on what a run has done."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def count(self, kind: str, **match: Any) -> int:
        return sum(
            1 for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in match.items())
        )

    async def wait(self, kind: str, n: int, timeout: float = 20.0, **match: Any) -> None:
        deadline = time.monotonic() + timeout
        while self.count(kind, **match) < n:
            assert time.monotonic() < deadline, f"the run never had {n} {kind} events"
            await asyncio.sleep(0.01)


async def _cancel(task: asyncio.Task[Any]) -> float:
    """Cancel `task`, check it re-raises CancelledError, and say how long it took to end."""
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return time.monotonic() - started


async def test_cancelling_a_run_reaps_every_repl_of_its_tree_and_ends_every_trace(server, script, tmp_path):
    script.root(
        "root-model", code("r = rlm_query_batched(['a', 'b', 'c'], contexts=['x', 'y', 'z'])\nFINAL(r)")
    )
    # Children: a first cell that finishes (so their REPLs are surely up), then one stuck in C code.
    script.root("sub-model", code("x = 1"), code("sum(range(10**13))"))
    events = Events()
    rlm = make_rlm(server, tmp_path, max_depth=2, exec_timeout=100, on_event=events)
    async with Tracked() as procs:
        task = asyncio.create_task(rlm.arun("q", "ctx"))
        await events.wait("lm_call", 6, depth=1, purpose="root")  # every child's second cell is running
        took = await _cancel(task)
    assert took < LATE_S, took
    procs.assert_reaped()
    assert len(procs.seen) >= 4  # the root's REPL and the three children's
    trace = load(next(tmp_path.glob("*.jsonl")))
    assert trace.complete and len(trace.runs) == 4
    assert {run.stop_reason for run in trace.runs.values()} == {"cancelled"}


@pytest.mark.parametrize("after_s", [0.0, 0.002, 0.01, 0.03])
async def test_a_run_cancelled_while_its_repl_is_starting_leaves_no_process(
    server, script, tmp_path, after_s
):
    # The REPL starts while the first model call is in flight, its Popen in a worker thread: a
    # cancellation at any point of that start must still stop the process it started.
    script.root("root-model", code("FINAL(1)"))
    server.latency_s = 0.5  # the first model call is still out when the cancellation comes
    rlm = make_rlm(server, tmp_path)
    before = descendants(os.getpid())
    task = asyncio.create_task(rlm.arun("q", "ctx"))
    await asyncio.sleep(after_s)
    await _cancel(task)
    for _ in range(100):  # up to 2 s, with the event loop free to run any clean-up callbacks
        if not descendants(os.getpid()) - before:
            break
        await asyncio.sleep(0.02)
    left = {p for p in descendants(os.getpid()) - before if _running(p)}
    assert not left, f"processes left after a cancelled start: {left}"


@pytest.mark.parametrize("fork", [False, True], ids=["started", "forked"])
async def test_a_start_cancelled_as_its_worker_comes_up_is_cancelled(monkeypatch, fork):
    # On a loaded host a run's first reply is back before its REPL, so a caller's timeout finds the
    # run waiting for the REPL's start. If the worker's "ready" came in that same loop turn, Python
    # 3.11's asyncio.wait_for returned it and dropped the cancellation: the run went on into its
    # cell (a 100 s sleep in the caller-timeout test below, which then hit pytest's timeout).
    from recursa.sandbox import SubprocessSandbox
    from recursa.sandbox.connection import Connection
    from recursa.sandbox.forkserver import ForkServer

    starting: list[asyncio.Task[None]] = []
    dispatch = Connection._dispatch

    def ready_then_cancel(self: Connection, frame: dict[str, Any]) -> None:
        dispatch(self, frame)
        if frame.get("op") == "ready" and starting:
            starting.pop().cancel()  # in the loop turn the worker's "ready" is handled in

    server = ForkServer() if fork else None
    warm = SubprocessSandbox(fork_server=server)  # starts the zygote, if any, uncancelled
    await warm.start(_no_calls)
    monkeypatch.setattr(Connection, "_dispatch", ready_then_cancel)
    sb = SubprocessSandbox(fork_server=server)
    starting.append(asyncio.ensure_future(sb.start(_no_calls)))
    task = starting[0]
    try:
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await sb.close()
        await warm.close()
        if server is not None:
            await server.close()


async def _no_calls(fn: str, args: dict[str, Any]) -> Any:
    return None


async def test_cancelling_a_run_stops_its_in_flight_model_calls(server, script, tmp_path):
    def respond(model: str, messages: list[dict[str, Any]]) -> str:
        if model == "root-model":
            return code("r = llm_query_batched(['p%d' % i for i in range(5)])\nFINAL(r)")
        # The server pauses after asking: the sub-calls hang for longer than the test waits.
        server.latency_s = 3.0
        return "late"

    server.holder["responder"] = respond
    rlm = make_rlm(server, tmp_path)
    async with Tracked() as procs:
        task = asyncio.create_task(rlm.arun("q", "ctx"))
        await asyncio.to_thread(wait_until, lambda: len(server.requests) >= 6, 10.0, "the five sub-calls")
        took = await _cancel(task)
    assert took < LATE_S, took  # nobody waited for the five calls
    procs.assert_reaped()
    trace = load(next(tmp_path.glob("*.jsonl")))
    assert trace.complete and trace.root.stop_reason == "cancelled"
    assert not trace.root.of_type("lm_call")[1:], "a sub-call was completed after all"


async def test_a_caller_timeout_around_arun_cancels_the_run_and_surfaces_as_timeout(server, script, tmp_path):
    script.root("root-model", code("import time\ntime.sleep(100)"))
    rlm = make_rlm(server, tmp_path, exec_timeout=100)
    async with Tracked() as procs:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await rlm.arun("q", "ctx")
        took = time.monotonic() - started
    assert took < 1 + LATE_S, took
    procs.assert_reaped()
    assert load(next(tmp_path.glob("*.jsonl"))).root.stop_reason == "cancelled"


# -- Ctrl-C in the CLI ---------------------------------------------------------------------------


def _default_sigint() -> None:
    # A shell without job control starts background jobs with SIGINT ignored, and children inherit
    # that; this is about what Ctrl-C does, so give the CLI the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "recursa.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        preexec_fn=_default_sigint,
    )


def _events_in(folder: Path) -> list[dict[str, Any]]:
    """The whole events of the trace in `folder` so far (none before it exists)."""
    out = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # the line being written
    return out


def test_ctrl_c_in_recursa_run_prints_the_partial_answer_and_trace_and_exits_130(server, script, tmp_path):
    script.root(
        "root-model",
        code("answer['content'] = 'half of it: 21'\nprint('noted')"),
        code("while True:\n    pass"),
    )
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("some context")
    traces = tmp_path / "traces"
    proc = _start_cli(
        "run", "q", "--context", str(ctx), "--model", "openai/root-model", "--base-url", server.base_url,
        "--trace-dir", str(traces), env=KEY_ENV,
    )  # fmt: skip
    try:
        wait_until(lambda: len(server.requests) >= 2 or proc.poll() is not None, 30.0, "the second turn")
        workers = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert out.strip() == "half of it: 21" and "partial" in err
    trace_path = next(traces.glob("*.jsonl"))
    assert f"trace: {trace_path}" in err
    assert load(trace_path).root.stop_reason == "cancelled"
    assert workers and not _still_running(workers, 2.0)


def test_ctrl_c_with_json_prints_one_object_naming_the_trace(tmp_path):
    task = generate("niah", 20_000, seed=2)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(task.context)
    proc = _start_cli(
        "run", task.question, "--context", str(ctx), "--model", "scripted/gpt5-like:fault=loop",
        "--trace-dir", str(tmp_path), "--json",
    )  # fmt: skip
    try:
        # fault=loop: the first code block spins; it has started once its turn is in the trace.
        started = lambda: any(e["type"] == "lm_call" for e in _events_in(tmp_path))  # noqa: E731
        wait_until(lambda: started() or proc.poll() is not None, 30.0, "the first turn")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    data = json.loads(out)
    assert data["stop_reason"] == "cancelled" and Path(data["trace_path"]).exists()
    assert load(data["trace_path"]).root.stop_reason == "cancelled"


# -- crash safety: the host is SIGKILLed --------------------------------------------------------------


def _kill_host_when(proc: subprocess.Popen[str], ready: Callable[[], bool]) -> set[int]:
    """SIGKILL the host once `ready()`; return the processes that were running below it."""
    try:
        wait_until(lambda: ready() or proc.poll() is not None, 30.0, "the run to get going")
        assert proc.poll() is None, proc.communicate()[1]
        below = descendants(proc.pid)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return below


def test_a_killed_host_leaves_a_readable_trace_and_no_repl_process(tmp_path):
    task = generate("niah", 60_000, seed=3)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(task.context)
    # The root hands the context to child RLMs, whose first code block spins forever.
    proc = _start_cli(
        "run", task.question, "--context", str(ctx), "--model", "scripted/gpt5-like:recurse=1",
        "--sub-model", "scripted/gpt5-like:fault=loop", "--max-depth", "2", "--trace-dir", str(tmp_path),
    )  # fmt: skip

    def child_code_running() -> bool:  # a child's first reply is in: its loop runs next
        return any(e["type"] == "lm_call" and e.get("depth") == 1 for e in _events_in(tmp_path))

    below = _kill_host_when(proc, child_code_running)
    assert len(below) >= 2  # the root's REPL and a child's, at least
    assert not _still_running(below, 2.0), "REPL processes outlived their host"
    trace = load(next(tmp_path.glob("*.jsonl")))  # no exception: every line is whole
    assert not trace.complete and not trace.truncated
    assert trace.root.run_id in trace.incomplete_runs and not trace.root.complete
    assert len(trace.incomplete_runs) == len(trace.runs) >= 2  # the children too
    assert any("has no run_end" in note for note in trace.notes)


@pytest.mark.parametrize("sandbox", ["subprocess", "auto"])
def test_a_killed_host_takes_what_the_repl_code_forked_along(server, script, tmp_path, sandbox):
    # A process forked by the model's code asked for no parent-death signal: the keeper kills its
    # process group when the host dies (under bwrap the pid namespace ends as well).
    script.root(
        "root-model",
        code(
            "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(300)\n    os._exit(0)\n"
            "print('forked', pid, flush=True)\nwhile True:\n    pass"
        ),
    )
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("ctx")
    proc = _start_cli(
        "run", "q", "--context", str(ctx), "--model", "openai/root-model", "--base-url", server.base_url,
        "--sandbox", sandbox, "--trace-dir", str(tmp_path), env=KEY_ENV,
    )  # fmt: skip

    def forked() -> bool:
        if not server.requests:
            return False
        # The worker, its snapshot and the forked sleeper run below the keeper (or bwrap).
        names = [_cmdline(p) for p in descendants(proc.pid)]
        return sum(_is_worker(n) for n in names) >= 3

    below = _kill_host_when(proc, forked)
    assert not _still_running(below, 2.0), "a process forked by REPL code outlived its host"
    assert not load(next(tmp_path.glob("*.jsonl"))).complete


def _is_worker(cmdline: str) -> bool:
    # The worker runs from its cached bytecode when it can (recursa/sandbox/bytecode.py).
    return "sandbox/worker/" in cmdline


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


# -- the trace on disk ----------------------------------------------------------------------------------


def test_every_event_is_on_disk_when_it_is_emitted(tmp_path):
    path = tmp_path / "t.jsonl"
    lines_at_emit: list[int] = []

    def on_disk(event: dict[str, Any]) -> None:
        # Read through another handle, as a reader after a crash would: the line must be there.
        with open(path, encoding="utf-8") as fh:
            last = fh.read().splitlines()[-1]
        lines_at_emit.append(json.loads(last)["seq"] == event["seq"])

    writer = TraceWriter(path, Redactor([]), [on_disk])
    writer.emit("run_start", run_id="r", depth=0, question="q")
    writer.emit("turn", run_id="r", turn=1)
    assert lines_at_emit == [True, True]
    writer.close()


def test_a_lone_surrogate_in_an_event_is_written_not_a_crash(tmp_path):
    # A model reply can carry a lone surrogate as a JSON escape ("\\ud800"); writing it as UTF-8 used
    # to raise UnicodeEncodeError in the middle of the run.
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, Redactor([]))
    writer.emit("run_start", run_id="r", depth=0, question="a\ud800b")
    writer.emit("run_end", run_id="r", depth=0, stop_reason="final", answer="ok")
    writer.close()
    trace = load(path)
    # Read back as U+FFFD: a lone surrogate cannot be written to a page or a UTF-8 file downstream.
    assert trace.root.question == "a\ufffdb" and trace.complete and not trace.notes


def _finished_trace(tmp_path: Path) -> Path:
    result = RLM("scripted/gpt5-like", trace_dir=tmp_path).run(
        "What is the magic number?", generate("niah", 5_000, seed=1).context
    )
    assert result.stop_reason == "final"
    return result.trace_path


def test_load_reads_a_cut_trace_and_marks_what_is_missing(tmp_path):
    path = _finished_trace(tmp_path)
    whole = load(path)
    assert whole.complete and not whole.incomplete_runs and not whole.notes and whole.root.complete

    data = path.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 30])  # the run_end line cut mid-way
    trace = load(cut)
    assert trace.truncated and not trace.complete
    assert trace.incomplete_runs == [whole.root.run_id] and not trace.root.complete
    assert len(trace.events) == len(whole.events) - 1  # everything before the cut
    assert any("the last, is cut off" in n for n in trace.notes)

    lines = data.decode("utf-8").splitlines(keepends=True)
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("".join([lines[0], "{not json\n", '["a list"]\n', *lines[1:]]), encoding="utf-8")
    trace = load(damaged)
    assert not trace.truncated and trace.complete  # a bad line inside is skipped, not a cut
    assert len(trace.events) == len(whole.events)
    assert any("line 2 is not valid JSON" in n for n in trace.notes)
    assert any("line 3 is JSON but not a trace event" in n for n in trace.notes)


@pytest.mark.parametrize("order", ["abandon_after_popen", "abandon_before_popen_returns"])
def test_an_abandoned_launch_stops_the_process_it_started(order):
    # The hand-off behind a cancelled REPL start: whichever side comes second kills the process.
    import signal
    import socket
    import subprocess

    from recursa.sandbox.subprocess import _Launch

    ours, theirs = socket.socketpair()
    log = os.open(os.devnull, os.O_WRONLY)
    started: list[subprocess.Popen[bytes]] = []

    def popen() -> subprocess.Popen[bytes]:
        if order == "abandon_before_popen_returns":
            launch.abandon()  # the caller gives up while Popen is still running
        started.append(subprocess.Popen(["sleep", "30"], start_new_session=True))
        return started[0]

    launch = _Launch(popen, (ours, theirs), (log,))
    launch.run()
    if order == "abandon_after_popen":
        launch.abandon()
    assert started[0].wait(timeout=5) == -signal.SIGKILL
    assert ours.fileno() == -1 and theirs.fileno() == -1  # the channel is closed too
