"""The REPL sandboxes, against real worker processes (and the in-process REPL where it applies)."""

from __future__ import annotations

import ast
import asyncio
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from recursa.context import build_payload
from recursa.errors import BudgetExceeded, ConfigError, SandboxError
from recursa.sandbox import InProcessSandbox, Sandbox, SubprocessSandbox, make_sandbox
from recursa.sandbox.base import CallbackError
from recursa.sandbox.proc import running as _pid_exists
from recursa.sandbox.protocol import WORKER_PATH, FrameDecoder, encode_frame
from recursa.sandbox.worker_log import WorkerLog


class Host:
    """A call handler that records what the REPL asked for and how many calls overlapped."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        self.calls.append((fn, args))
        if fn == "llm_query_batched":
            return [f"echo:{p}" for p in args["prompts"]]
        if fn == "rlm_query_batched":
            return [f"child:{p}" for p in args["prompts"]]
        if fn == "rlm_query":
            return f"child:{args['prompt']}"
        prompt = args.get("prompt", "")
        if prompt == "non-json":
            return object()
        if prompt == "budget":
            raise BudgetExceeded("max_usd", "refused: this call could exceed the $1.00 budget")
        if prompt == "lm-error":
            raise CallbackError("SubcallError", "the provider failed after 3 retries")
        if prompt == "bug":
            raise RuntimeError("handler bug")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(10 if prompt == "slow" else self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        return f"echo:{prompt}"


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture(params=["subprocess", "inprocess"])
async def sandbox(request: pytest.FixtureRequest, host: Host) -> AsyncIterator[Sandbox]:
    sb: Sandbox = SubprocessSandbox() if request.param == "subprocess" else InProcessSandbox()
    await sb.start(host)
    yield sb
    await sb.close()


@pytest.fixture
async def proc_sandbox(host: Host) -> AsyncIterator[SubprocessSandbox]:
    sb = SubprocessSandbox(grace_s=0.5)
    await sb.start(host)
    yield sb
    await sb.close()


async def run(sb: Sandbox, code: str, timeout: float = 10.0, **kw: Any) -> Any:
    return await sb.execute(code, timeout, **kw)


# -- running code -------------------------------------------------------------------------------


async def test_protocol_and_persistence(sandbox: Sandbox) -> None:
    assert isinstance(sandbox, Sandbox)
    r = await run(sandbox, "x = 41\ndef inc(v):\n    return v + 1")
    assert (r.stdout, r.error) == ("", None)
    r = await run(sandbox, "inc(x)")
    assert r.stdout == "42\n"
    r = await run(sandbox, "print('a')\nNone")
    assert r.stdout == "a\n"  # a None result is not displayed
    r = await run(sandbox, "y = [1, 2]\ny")
    assert r.stdout == "[1, 2]\n"
    assert await sandbox.variable_names() == ["inc", "x", "y"]
    var = await sandbox.get_variable("y")
    assert var is not None and (var.value, var.text, var.var_name) == ([1, 2], "[1, 2]", "y")
    assert await sandbox.get_variable("nothing") is None


async def test_stdout_stderr_capture_and_truncation(sandbox: Sandbox) -> None:
    r = await run(sandbox, "import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.omitted_chars) == ("out\n", "err\n", 0)
    r = await run(sandbox, "print('a' * 500 + 'b' * 500)", max_output_chars=100)
    assert r.omitted_chars == 901  # 1001 characters printed, 100 kept
    assert r.stdout.startswith("a" * 50 + "\n[... 901 characters omitted ...]\n")
    assert r.stdout.endswith("b" * 49 + "\n")


async def test_many_small_prints_keep_head_and_tail(sandbox: Sandbox) -> None:
    r = await run(sandbox, "for i in range(100_000):\n    print(i)", max_output_chars=1000)
    assert r.stdout.startswith("0\n1\n2\n")
    assert r.stdout.endswith("99998\n99999\n")
    assert len(r.stdout) < 1100
    assert r.omitted_chars == len("".join(f"{i}\n" for i in range(100_000))) - 1000


async def test_100mb_print_stays_bounded(sandbox: Sandbox) -> None:
    r = await run(sandbox, "print('x' * 100_000_000)")
    assert r.error is None
    assert len(r.stdout) < 20_100
    assert r.omitted_chars == 100_000_001 - 20_000


async def test_syntax_error(sandbox: Sandbox) -> None:
    r = await run(sandbox, "x = (1,\ny = 2")
    assert r.error is not None and "SyntaxError" in r.error and '"<repl>"' in r.error
    assert "SyntaxError" in r.stderr


async def test_runtime_error_traceback_is_trimmed_to_repl(sandbox: Sandbox) -> None:
    r = await run(sandbox, "def f():\n    return undefined_name\n\nprint('before')\nf()")
    assert r.stdout == "before\n"
    assert r.error is not None
    assert r.error.endswith("NameError: name 'undefined_name' is not defined")
    assert 'File "<repl>", line 5, in <module>' in r.error
    assert "return undefined_name" in r.error  # the source line of the failing frame
    assert "sandbox/worker" not in r.error and "inprocess.py" not in r.error
    assert r.error in r.stderr


async def test_reserved_names_are_restored(sandbox: Sandbox, host: Host) -> None:
    r = await run(sandbox, "context = 'mine'\nllm_query = None\ndel FINAL\ndel answer")
    assert set(r.restored_names) == {"context", "llm_query", "FINAL", "answer"}
    assert any("restored" in n and "llm_query" in n for n in r.notes)
    r = await run(sandbox, "print(context, answer)\nllm_query('again')")
    assert r.stdout == "None {'content': None, 'ready': False}\n'echo:again'\n"
    assert r.restored_names == []
    r = await run(sandbox, "FINAL('ok')")
    assert r.final is not None and r.final.text == "ok"


async def test_answer_bound_to_a_value_of_the_models_own_is_kept(sandbox: Sandbox) -> None:
    # The paper's prompt writes `answer = llm_query(...)`; FINAL_VAR must return that value, not the
    # protocol dict restored over it.
    r = await run(sandbox, "answer = 42")
    assert r.restored_names == [] and any('FINAL_VAR("answer")' in n for n in r.notes)
    assert "answer" in await sandbox.variable_names()
    r = await run(sandbox, "print(answer + 1)")
    assert r.stdout == "43\n" and r.notes == []
    found = await sandbox.get_variable("answer")
    assert found is not None and (found.value, found.text) == (42, "42")
    r = await run(sandbox, "FINAL_VAR(answer)")
    assert r.final is not None and r.final.value == 42
    r = await run(sandbox, "FINAL_VAR('answer')")
    assert r.final is not None and (r.final.value, r.final.var_name) == (42, "answer")
    r = await run(sandbox, "del answer")  # the protocol comes back once the name is free
    assert r.restored_names == ["answer"] and "answer" not in await sandbox.variable_names()
    r = await run(sandbox, "answer['content'] = 'dict again'\nanswer['ready'] = True")
    assert r.final is not None and (r.final.protocol, r.final.text) == ("answer", "dict again")
    r = await run(sandbox, "answer = {'content': 'adopted', 'ready': True}")  # a protocol-shaped dict
    assert r.final is not None and (r.final.protocol, r.final.text) == ("answer", "adopted")


# -- answers ------------------------------------------------------------------------------------


async def test_final_protocols(sandbox: Sandbox) -> None:
    r = await run(sandbox, "FINAL('first')\nFINAL({'k': (1, 2), 'n': None})")
    assert r.final is not None
    assert (r.final.protocol, r.final.value, r.final.text) == (
        "FINAL",
        {"k": [1, 2], "n": None},
        str({"k": (1, 2), "n": None}),
    )
    r = await run(sandbox, "res = ['a', 'b']\nFINAL_VAR('res')")
    assert r.final is not None
    assert (r.final.protocol, r.final.value, r.final.var_name) == ("FINAL_VAR", ["a", "b"], "res")
    r = await run(sandbox, "answer['content'] = 42\nanswer['ready'] = True")
    assert r.final is not None and (r.final.protocol, r.final.text, r.final.value) == ("answer", "42", 42)
    r = await run(sandbox, "answer")
    assert r.final is None and r.stdout == "{'content': None, 'ready': False}\n"  # reset after use
    r = await run(sandbox, "class Odd:\n    def __str__(self):\n        return 'odd!'\nFINAL(Odd())")
    assert r.final is not None and (r.final.text, r.final.value) == ("odd!", "odd!")


async def test_final_var_edge_cases(sandbox: Sandbox) -> None:
    r = await run(sandbox, "total = 3\nFINAL_VAR('missing')")
    assert r.final is None and r.error is not None
    assert "NameError" in r.error and "'missing'" in r.error
    assert "total" in r.error and "FINAL(text)" in r.error
    r = await run(sandbox, "FINAL_VAR([1, 2])")  # a value, not a name
    assert r.final is not None and (r.final.value, r.final.var_name) == ([1, 2], None)
    assert any("FINAL_VAR" in n for n in r.notes)
    r = await run(sandbox, "rows = [3, 4]\nFINAL_VAR(rows)")
    assert r.final is not None and (r.final.value, r.final.var_name) == ([3, 4], "rows")
    assert any('FINAL_VAR("rows")' in n for n in r.notes)
    r = await run(sandbox, "summary = 'the answer is 7'\nFINAL_VAR(summary)")  # the str value itself
    assert r.final is not None and (r.final.text, r.final.var_name) == ("the answer is 7", "summary")
    assert any('FINAL_VAR("summary")' in n for n in r.notes)


# -- context ------------------------------------------------------------------------------------

CONTEXTS = {
    "str": "héllo wörld ✓ 日本語 🙂\nline two",
    "list": ["première", "", "🙂" * 3, "plain"],
    "dict": {"a.txt": "ünïcode", "b/c.md": "日本", "empty": ""},
}


@pytest.mark.parametrize("kind", sorted(CONTEXTS))
async def test_context_kinds(sandbox: Sandbox, kind: str) -> None:
    original = CONTEXTS[kind]
    payload = build_payload(original)
    await sandbox.load_context(payload)
    payload.close()  # the sandbox keeps what it needs
    r = await run(sandbox, "type(context).__name__")
    assert r.stdout == f"{kind!r}\n"
    var = await sandbox.get_variable("context")
    assert var is not None and var.value == original


async def test_context_survives_in_place_replacement(proc_sandbox: SubprocessSandbox) -> None:
    await proc_sandbox.load_context(build_payload("first"))
    await proc_sandbox.load_context(build_payload(["second", "third"]))
    r = await run(proc_sandbox, "context")
    assert r.stdout == "['second', 'third']\n"


# -- call-backs ---------------------------------------------------------------------------------


async def test_llm_query_round_trip(sandbox: Sandbox, host: Host) -> None:
    r = await run(sandbox, "reply = llm_query('héllo', model='small')\nreply")
    assert r.stdout == "'echo:héllo'\n"
    assert host.calls == [("llm_query", {"prompt": "héllo", "model": "small"})]


async def test_llm_query_batched_is_one_frame(sandbox: Sandbox, host: Host) -> None:
    r = await run(sandbox, "llm_batch(['a', 'b', 'c'])")
    assert r.stdout == "['echo:a', 'echo:b', 'echo:c']\n"
    assert host.calls == [("llm_query_batched", {"prompts": ["a", "b", "c"], "model": None})]
    r = await run(sandbox, "llm_query_batched('not a list')")
    assert r.error is not None and "TypeError" in r.error


async def test_rlm_query_calls_carry_child_contexts(sandbox: Sandbox, host: Host) -> None:
    r = await run(sandbox, "rlm_query('p', context=['a', 'b'])")
    assert r.stdout == "'child:p'\n"
    r = await run(sandbox, "rlm_query_batched(['p', 'q'], contexts=['x', {'k': 'v'}])")
    assert r.stdout == "['child:p', 'child:q']\n"
    assert host.calls == [
        ("rlm_query", {"prompt": "p", "context": ["a", "b"]}),
        ("rlm_query_batched", {"prompts": ["p", "q"], "contexts": ["x", {"k": "v"}]}),
    ]
    r = await run(sandbox, "rlm_query('p', context=[1, 2])")
    assert r.error is not None and "TypeError: a child context must be" in r.error
    assert len(host.calls) == 2  # refused in the REPL, never sent


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_threads_calling_llm_query_overlap(sandbox: Sandbox, host: Host) -> None:
    host.delay = 0.2
    code = (
        "import threading\n"
        "out = [None] * 16\n"
        "def work(i):\n"
        "    out[i] = llm_query(f'q{i}')\n"
        "threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "out[:2]"
    )
    started = time.perf_counter()
    r = await run(sandbox, code)
    elapsed = time.perf_counter() - started
    assert r.error is None and r.stdout == "['echo:q0', 'echo:q1']\n"
    assert len(host.calls) == 16
    assert host.max_in_flight >= 8
    assert elapsed < 1.5


async def test_a_cells_first_call_may_come_from_any_thread_after_any_call_free_stretch(
    sandbox: Sandbox, host: Host
) -> None:
    # A local worker hands the reading of its channel to its reader thread only at a cell's first
    # call to the host (sandbox/worker/wire.py): from a thread the cell started, from its main
    # thread, from both at once, long after the cell began.
    stretch = "sum(range(3_000_000))\n"
    cells = {
        "import threading\n" + stretch + "out = []\n"
        "t = threading.Thread(target=lambda: out.append(llm_query('from-thread')))\n"
        "t.start(); t.join(); print(out)": "['echo:from-thread']\n",
        stretch + "print(llm_query('from-main'))": "echo:from-main\n",
        stretch + "got = {}\n"
        "def work(i):\n    got[i] = llm_query(f't{i}')\n"
        "ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]\n"
        "for t in ts: t.start()\n"
        "got['main'] = llm_query('m')\n"
        "for t in ts: t.join()\n"
        "print(sorted(got.values()))": "['echo:m', 'echo:t0', 'echo:t1', 'echo:t2', 'echo:t3']\n",
    }
    for code, printed in cells.items():
        r = await run(sandbox, code)
        assert r.error is None and r.stdout == printed, (r.error, r.stdout)
    assert len(host.calls) == 7


async def test_error_replies_raise_matching_exceptions(sandbox: Sandbox) -> None:
    code = (
        "for p in ['budget', 'lm-error', 'bug', 'non-json']:\n"
        "    try:\n"
        "        llm_query(p)\n"
        "    except BudgetExceeded as e:\n"
        "        print('budget:', e)\n"
        "    except SubcallError as e:\n"
        "        print('subcall:', e)\n"
    )
    r = await run(sandbox, code)
    assert r.error is None
    assert r.stdout.splitlines() == [
        "budget: refused: this call could exceed the $1.00 budget",
        "subcall: the provider failed after 3 retries",
        "subcall: RuntimeError: handler bug",  # a kind outside ErrorKind: named in the message
        "subcall: Object of type object is not JSON serializable",
    ]
    r = await run(sandbox, "llm_query('budget')")
    assert r.error is not None and r.error.endswith(
        "BudgetExceeded: refused: this call could exceed the $1.00 budget"
    )


def test_error_kinds_are_one_closed_set_on_both_sides() -> None:
    from recursa.outcomes import ERROR_KINDS
    from recursa.sandbox.worker import errors

    assert set(errors._ERROR_CLASSES) <= set(ERROR_KINDS)  # the worker cannot import recursa
    for kind in ERROR_KINDS:
        exc = errors.error_for(kind, "m")
        assert exc.kind == kind and isinstance(exc, errors.SubcallError | errors.ToolError)
    assert CallbackError.of(KeyError("k")).kind == "SubcallError"
    assert CallbackError.of(ValueError("v")).kind == "ValueError"


# -- timeouts, crashes, restarts ------------------------------------------------------------------


async def test_timeout_interrupts_and_keeps_variables(sandbox: Sandbox) -> None:
    await run(sandbox, "kept = 'still here'")
    r = await run(sandbox, "while True:\n    pass", timeout=0.3)
    assert r.timed_out and not r.restarted
    assert r.error is not None and "KeyboardInterrupt" in r.error
    assert any("interrupted after 0.3s; variables kept" in n for n in r.notes)
    r = await run(sandbox, "kept")
    assert r.stdout == "'still here'\n"


@pytest.mark.parametrize("restored", [False, True], ids=["started", "restored"])
async def test_a_worker_started_with_sigint_blocked_is_still_interrupted(host: Host, restored: bool) -> None:
    # A Ray actor's thread blocks SIGINT, and a child inherits the mask: a REPL a node's host started
    # ignored every interrupt, so each timeout killed it and lost its variables. And a snapshot is a
    # copy of the worker's forking thread, which such a worker started before it unblocked SIGINT:
    # once restored, it waited out a call-back at the deadline (no other thread's signal wakes that
    # wait), killed and losing the cell's state where a local REPL is interrupted and keeps it.
    import signal

    sb = SubprocessSandbox(snapshots=restored, grace_s=0.3 if restored else 5)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        await sb.start(host)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        await run(sb, "kept = 'still here'")
        if restored:
            swallowing = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    time.sleep(60)"
            assert (await run(sb, swallowing, timeout=0.3)).restored
        r = await run(sb, "llm_query('slow')" if restored else "while True:\n    pass", timeout=0.3)
        assert r.timed_out and not r.restarted and "KeyboardInterrupt" in (r.error or ""), (r.error, r.notes)
        assert (await run(sb, "kept")).stdout == "'still here'\n"
    finally:
        await sb.close()


async def test_interrupt_cancels_the_pending_call(proc_sandbox: SubprocessSandbox, host: Host) -> None:
    r = await run(proc_sandbox, "llm_query('slow')", timeout=0.3)
    assert r.timed_out and not r.restarted and "KeyboardInterrupt" in (r.error or "")
    for _ in range(100):  # the cancel frame is handled on the loop; wait for it by event, not time
        if host.cancelled:
            break
        await asyncio.sleep(0.01)
    assert host.cancelled == 1


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_cell_ignoring_sigint_is_killed_and_sandbox_restarts(host: Host) -> None:
    # Without snapshots (see test_snapshots.py for the default, which keeps earlier variables).
    proc_sandbox = SubprocessSandbox(grace_s=0.5, snapshots=False)
    await proc_sandbox.start(host)
    try:
        await _ignoring_sigint_restarts(proc_sandbox)
    finally:
        await proc_sandbox.close()


async def _ignoring_sigint_restarts(proc_sandbox: SubprocessSandbox) -> None:
    await proc_sandbox.load_context(build_payload("ctx"))
    await run(proc_sandbox, "lost = 1")
    old_pid = proc_sandbox.pid
    # The interrupt lands inside the inner loop's try, is swallowed, and nothing interrupts again.
    code = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"
    started = time.perf_counter()
    r = await run(proc_sandbox, code, timeout=0.3)
    assert time.perf_counter() - started < 3
    assert r.timed_out and r.restarted
    assert any("restarted" in n and "variables were lost" in n for n in r.notes)
    assert old_pid is not None and not _pid_exists(old_pid)
    assert proc_sandbox.pid != old_pid
    r = await run(proc_sandbox, "print(context)\nlost")
    assert r.stdout == "ctx\n" and r.error is not None and "NameError" in r.error


async def test_a_dying_workers_last_words_are_reported_however_late_its_log_is_read(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The log's reader thread may not have run when the host finds the worker dead (a busy host):
    # the report still holds what the worker wrote to its stderr before it died.
    drain = WorkerLog._drain

    def late_drain(self: WorkerLog, *args: Any) -> None:
        time.sleep(1.0)
        drain(self, *args)

    monkeypatch.setattr(WorkerLog, "_drain", late_drain)
    sb = SubprocessSandbox(snapshots=False)
    await sb.start(host)
    try:
        r = await run(sb, "import os\nos.write(2, b'last words before exit\\n')\nos._exit(3)")
        assert r.restarted and "exit code 3" in r.error
        assert "last words before exit" in r.stderr
    finally:
        await sb.close()


async def test_worker_death_is_reported_and_restarted(proc_sandbox: SubprocessSandbox) -> None:
    await proc_sandbox.load_context(build_payload(["a", "b"]))
    r = await run(proc_sandbox, "import os\nos._exit(3)")
    assert r.restarted and not r.timed_out
    assert r.error is not None and "exit code 3" in r.error
    r = await run(proc_sandbox, "import ctypes\nctypes.string_at(0)")  # a segfault
    assert r.restarted and r.error is not None and "SIGSEGV" in r.error
    r = await run(proc_sandbox, "len(context)")
    assert r.stdout == "2\n" and not r.restarted


def _wait_until_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.005)


async def test_worker_dying_between_cells_is_noticed(proc_sandbox: SubprocessSandbox) -> None:
    for first in (True, False):
        if not first:  # a cell has run: its state comes back from the snapshot forked after it
            await run(proc_sandbox, "x = 1")
            assert await proc_sandbox.wait_snapshot() is not None
        pid = proc_sandbox.pid
        assert pid is not None
        os.kill(pid, 9)
        # The worker is the keeper's child, not ours (see worker/keeper.py): wait until the keeper reaped
        # it (a zombie leader whose threads are still exiting does not count as exited yet).
        await asyncio.to_thread(_wait_until_gone, pid, 2.0)
        r = await run(proc_sandbox, "1 + 1" if first else "x + 1")
        assert r.stdout == "2\n"
        said = "before any code ran; it was started again" if first else "restored from a snapshot"
        assert any("had stopped" in n and said in n for n in r.notes), r.notes


# -- isolation and lifecycle ---------------------------------------------------------------------


async def test_environment_is_scrubbed(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECURSA_TEST_SECRET", "s3cret")
    monkeypatch.setenv("RECURSA_TEST_ALLOWED", "visible")
    sb = SubprocessSandbox(env_allow=["RECURSA_TEST_ALLOWED"])
    await sb.start(host)
    try:
        r = await run(sb, "import os\nsorted(os.environ)")
        names = eval(r.stdout)  # a list of str, printed by repr
        assert "RECURSA_TEST_SECRET" not in names and "RECURSA_TEST_ALLOWED" in names
        assert not any(n.endswith("_API_KEY") for n in names)
        assert sb.isolation["process"] and sb.isolation["env_scrubbed"] and "core" in sb.isolation["rlimits"]
    finally:
        await sb.close()


async def test_cwd_home_and_tmp_are_the_scratch_dir(proc_sandbox: SubprocessSandbox) -> None:
    r = await run(
        proc_sandbox, "import os, tempfile\n(os.getcwd(), os.environ['HOME'], tempfile.gettempdir())"
    )
    scratch = proc_sandbox.scratch_dir
    assert scratch is not None and eval(r.stdout) == (scratch, scratch, scratch)
    assert os.getcwd() != scratch  # the host never changes directory


async def test_close_reaps_and_cleans_up(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    import recursa.sandbox.host as host_module

    removed_on: list[threading.Thread] = []
    rmtree = host_module.shutil.rmtree

    def recording_rmtree(path: str, *args: Any, **kwargs: Any) -> None:
        removed_on.append(threading.current_thread())
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(host_module.shutil, "rmtree", recording_rmtree)
    sb = SubprocessSandbox()
    await sb.start(host)
    # A forked child (the hardened worker may not exec programs) that outlives the cell.
    await run(
        sb, "import os, time\nchild_pid = os.fork()\nif child_pid == 0:\n    time.sleep(30)\n    os._exit(0)"
    )
    child = await sb.get_variable("child_pid")
    pid, scratch = sb.pid, sb.scratch_dir
    assert pid is not None and scratch is not None and child is not None and _isdir(scratch)
    await sb.close()
    assert not _pid_exists(pid) and not _isdir(scratch)
    # the scratch tree is removed off the loop's thread, which other REPLs are served on meanwhile
    assert removed_on and threading.current_thread() not in removed_on
    assert _wait_gone(int(child.value))  # the whole process group went with it
    await sb.close()  # idempotent
    with pytest.raises(SandboxError):
        await run(sb, "1")


async def test_dropped_sandbox_is_killed(host: Host) -> None:
    sb = SubprocessSandbox()
    await sb.start(host)
    pid, scratch = sb.pid, sb.scratch_dir
    assert pid is not None and scratch is not None
    del sb
    gc.collect()
    assert not _pid_exists(pid) and not _isdir(scratch)


async def test_inprocess_does_not_touch_host_stdout(capsys: pytest.CaptureFixture[str], host: Host) -> None:
    sb = InProcessSandbox()
    await sb.start(host)
    try:
        before = sys.stdout
        r = await run(sb, "print('inside')\nSHOW_VARS()")
        assert sys.stdout is before
        assert r.stdout == "inside\nNo variables defined yet.\n"
        assert capsys.readouterr().out == ""
        assert sb.isolation["process"] is False
    finally:
        await sb.close()


async def test_show_vars(sandbox: Sandbox) -> None:
    r = await run(sandbox, "import json\nrows = [1, 2, 3]\ntext = 'abc'\nSHOW_VARS()")
    assert r.stdout == "Variables:\n  rows: list (len 3 items)\n  text: str (len 3 chars)\n"


def test_make_sandbox() -> None:
    assert isinstance(make_sandbox(), SubprocessSandbox)
    assert isinstance(make_sandbox("subprocess", grace_s=1.0), SubprocessSandbox)
    with pytest.warns(UserWarning, match="no isolation"):
        assert isinstance(make_sandbox("inprocess"), InProcessSandbox)
    with pytest.raises(ConfigError, match="auto, subprocess, inprocess"):
        make_sandbox("docker-maybe")


def test_worker_stdio_mode_with_inline_context() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-u", str(WORKER_PATH), "--stdio"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert proc.stdin is not None and proc.stdout is not None
    decoder = FrameDecoder()
    frames: list[dict[str, Any]] = []

    def read_frame() -> dict[str, Any]:
        while not frames:
            data = os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
            assert data, "worker closed stdout"
            frames.extend(decoder.feed(data))
        return frames.pop(0)

    try:
        assert read_frame()["op"] == "ready"
        data = "añb🙂".encode()
        frame = {"op": "load_context", "id": 1, "kind": "list", "size": len(data), "transfer": "inline"}
        frame.update(byte_lengths=[3, 1, 4], keys=[])
        proc.stdin.write(encode_frame(frame) + data)
        proc.stdin.write(
            encode_frame({"op": "exec", "id": 2, "code": "import os\nos.write(1, b'noise')\ncontext"})
        )
        proc.stdin.flush()
        assert read_frame()["chars"] == 4
        done = read_frame()
        assert (done["op"], done["id"], done["stdout"]) == ("exec_done", 2, "['añ', 'b', '🙂']\n")
        proc.stdin.write(encode_frame({"op": "shutdown"}))
        proc.stdin.flush()
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_worker_is_standalone_stdlib() -> None:
    files = sorted(WORKER_PATH.parent.glob("*.py"))
    assert len(files) > 5 and all(len(f.read_text().splitlines()) <= 600 for f in files)
    for path in files:
        tree = ast.parse(path.read_text())
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        modules = {a.name.split(".")[0] for n in imports if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module.split(".")[0] for n in imports if isinstance(n, ast.ImportFrom) and n.level == 0}
        assert modules - {"__future__"} <= set(sys.stdlib_module_names), path.name
        assert "pickle" not in modules and "marshal" not in modules, path.name


def test_frames_are_json_only() -> None:
    raw = encode_frame({"op": "x", "s": "ü\ud800"})  # lone surrogates survive the trip
    assert json.loads(raw[4:].decode("utf-8", "surrogatepass")) == {"op": "x", "s": "ü\ud800"}
    assert FrameDecoder().feed(raw[:3]) == []


def _isdir(path: str) -> bool:
    return os.path.isdir(path)


def _wait_gone(pid: int) -> bool:
    """SIGKILL is asynchronous for a grandchild we cannot wait for: poll its state briefly."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if not _pid_exists(pid):
            return True
        time.sleep(0.01)
    return False


async def test_large_pieces_load_exactly_ascii_and_not():
    """Pieces above the loader's window take the in-place ASCII path or the windowed decoder."""
    from recursa.context import build_payload
    from recursa.sandbox import SubprocessSandbox

    ascii_text = ("0123456789abcdef" * (17 * 2**16)) + "END"
    mixed_text = "é" * (9 * 2**20) + "ü-end"  # 18 MB of UTF-8, two bytes per character
    for context in (ascii_text, [mixed_text, "x", ascii_text], {"a": mixed_text}):
        sandbox = SubprocessSandbox()

        async def handler(fn, args):
            return None

        await sandbox.start(handler)
        try:
            payload = build_payload(context)
            await sandbox.load_context(payload)
            result = await sandbox.execute(
                "import hashlib, json\n"
                "blob = json.dumps(context, ensure_ascii=False)\n"
                "print(hashlib.sha256(blob.encode()).hexdigest(), len(blob))",
                timeout=30,
            )
            import hashlib
            import json

            blob = json.dumps(context, ensure_ascii=False)
            assert result.stdout.split() == [hashlib.sha256(blob.encode()).hexdigest(), str(len(blob))]
            payload.close()
        finally:
            await sandbox.close()


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_worker_starts_are_limited_to_two_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting workers is CPU-bound: more at once than two per CPU would only starve the host."""
    from recursa.sandbox import subprocess as local
    from recursa.sandbox.host import WorkerHost

    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: {0})  # one CPU: two slots
    starting = peak = 0
    real = WorkerHost._new_worker

    async def counted(self: WorkerHost) -> Any:
        nonlocal starting, peak
        starting += 1
        peak = max(peak, starting)
        try:
            return await real(self)
        finally:
            starting -= 1

    monkeypatch.setattr(WorkerHost, "_new_worker", counted)
    boxes = [SubprocessSandbox(hardening=False, snapshots=False) for _ in range(5)]

    async def handler(fn: str, args: dict[str, Any]) -> Any:
        return None

    try:
        await asyncio.gather(*(box.start(handler) for box in boxes))
        results = await asyncio.gather(*(box.execute("print(6 * 7)", 5) for box in boxes))
    finally:
        await asyncio.gather(*(box.close() for box in boxes))
    assert peak == 2 and [r.stdout.strip() for r in results] == ["42"] * 5


# -- the context buffer is freed as the worker reads it -------------------------------------------


async def test_context_buffer_is_freed_while_loading_and_rebuilt_for_a_restart(host: Host) -> None:
    text = "0123456789" * 3_000_000  # 30 MB: two read windows
    payload = build_payload(text)
    sb = SubprocessSandbox(snapshots=False)  # no snapshot: a dead worker restarts from scratch
    other = SubprocessSandbox(snapshots=False)
    await sb.start(host)
    await other.start(host)
    probe = os.dup(payload.fd)  # a look at the buffer after the payload lets go of it
    try:
        assert os.fstat(probe).st_blocks > 0
        await sb.load_context(payload)
        # The memfd's pages are gone (holes punched as the worker read them): one copy, not two.
        # A partly covered last page may stay. The payload no longer holds the buffer either.
        assert payload.released and payload.fd == -1 and os.fstat(probe).st_blocks * 512 <= 8192
        with pytest.raises(SandboxError, match="build it again"):
            await other.load_context(payload)
        r = await run(sb, "import os\nos._exit(3)")
        assert r.restarted
        r = await run(sb, "len(context), context[-4:]")
        assert r.stdout == "(30000000, '6789')\n" and not r.restarted
    finally:
        os.close(probe)
        await sb.close()
        await other.close()


async def test_a_context_changed_after_loading_is_not_reloaded_silently(host: Host) -> None:
    pieces = ["alpha", "beta"]
    sb = SubprocessSandbox(snapshots=False)
    await sb.start(host)
    try:
        await sb.load_context(build_payload(pieces))
        pieces.append("gamma")  # the caller changes its object during the run
        with pytest.raises(SandboxError, match="changed after the run started"):
            await run(sb, "import os\nos._exit(3)")
    finally:
        await sb.close()


async def test_a_context_read_from_a_file_keeps_its_buffer(host: Host, tmp_path: Any) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("from a file")
    payload = build_payload(path)
    sb = SubprocessSandbox()
    await sb.start(host)
    try:
        await sb.load_context(payload)
        assert not payload.released and payload.read_bytes() == b"from a file"
    finally:
        await sb.close()
        payload.close()


async def test_a_sandbox_killed_while_loading_its_context_closes_no_descriptor_twice(host: Host) -> None:
    # kill_now (an abandoned episode's finalizer, maybe on another thread) closes the sandbox's
    # descriptors; the load it cut short then ended by closing its copy of the context memfd again.
    # By then that number may be a file opened since: here, the ones opened just after the kill.
    sb = SubprocessSandbox()
    await sb.start(host)
    # A context the worker takes a while to load (a small one could be answered before the kill
    # lands, on a busy machine).
    load = asyncio.create_task(sb.load_context(build_payload("ctx " * 4_000_000)))
    while sb._context is None:  # noqa: ASYNC110 - the load has its memfd copy, waits for the worker
        await asyncio.sleep(0)
    sb.kill_now()
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]  # the lowest free numbers
    try:
        with pytest.raises(SandboxError):
            await load
        for fd in opened:
            os.fstat(fd)  # EBADF if the load's end closed it
    finally:
        for fd in opened:
            os.close(fd)
        await sb.close()


async def test_a_cell_interrupted_as_soon_as_the_worker_is_up_does_not_end_the_worker(host: Host) -> None:
    # A reply's last sliver of time can interrupt the first cell of a fresh worker at once: the
    # SIGINT landed before the worker had its own handler, and Python's ended the process. (On a
    # busy machine the worker's answer can come in before the host's timer runs: no interrupt is
    # sent then, so such a round does not count.)
    interrupted = 0
    for _ in range(12):
        sb = SubprocessSandbox(snapshots=False)
        await sb.start(host)
        try:
            pid = sb.pid
            r = await sb.execute("x = 1", timeout=0)
            assert not r.restarted and r.error is None, (r.error, r.notes)
            assert sb.pid == pid
            interrupted += r.timed_out
        finally:
            await sb.close()
        if interrupted == 3:
            break
    assert interrupted >= 1


async def test_listing_the_variables_runs_none_of_the_code_s_own_methods(host: Host) -> None:
    # A key of globals() that is an object of the code's own: its startswith ran in the listing
    # (a prose FINAL's check, outside any cell's timeout) and hung it until the query timeout.
    sb = SubprocessSandbox(query_timeout=0.5, grace_s=0.2)
    await sb.start(host)
    try:
        await sb.execute(
            "import time\nclass Key:\n    def startswith(self, prefix):\n        time.sleep(30)\n"
            "globals()[Key()] = 1\nx = 2",
            timeout=10,
        )
        assert await sb.variable_names() == ["Key", "x"]
    finally:
        await sb.close()


async def test_a_request_that_timed_out_stays_out_and_its_answer_is_not_lost() -> None:
    # Connection.answer: a timeout leaves the request out; an answer coming in the same turn of
    # the event loop as the time running out goes to the next wait (a worker played by hand).
    import socket

    from recursa.sandbox.connection import Connection
    from recursa.sandbox.protocol import FrameSocket

    ours, theirs = socket.socketpair()

    async def handler(fn: str, args: dict[str, Any]) -> Any:
        return None

    conn = Connection(FrameSocket(ours), handler)
    try:
        fut = await conn.request({"op": "exec", "code": "x"})
        with pytest.raises(TimeoutError):
            await conn.answer(fut, 0.01)
        theirs.sendall(encode_frame({"op": "exec_done", "id": 1, "stdout": "late"}))
        assert (await conn.answer(fut, 5))["stdout"] == "late"
        second = await conn.request({"op": "exec", "code": "y"})
        waiting = asyncio.ensure_future(conn.answer(second, 5))
        await asyncio.sleep(0)
        (fid,) = conn.pending
        conn._expire(fid, second, conn.pending[fid])  # the time runs out, then the answer comes
        conn._resolve(fid, {"op": "exec_done", "id": fid, "stdout": "just then"})
        with pytest.raises(TimeoutError):
            await waiting
        assert (await conn.answer(second, 5))["stdout"] == "just then"
        # A request whose every wait timed out and that its caller then dropped leaves nothing
        # behind: a later request's future (which may reuse a freed one's id) never finds it.
        third = await conn.request({"op": "exec", "code": "z"})
        for _ in range(2):
            with pytest.raises(TimeoutError):
                await conn.answer(third, 0.01)
        del third
        await asyncio.sleep(0.05)  # the loop lets go of the cancelled timers that held it
        gc.collect()
        assert not conn._renewed
    finally:
        await conn.release()
        theirs.close()
