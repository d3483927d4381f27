"""A REPL that writes its own frames to the host's channel cannot stall or swamp the host.

Code in the REPL can find the channel's file descriptor and write `call` frames faster than any
host can serve them, or frames too large or too complex to parse. The host reads no more calls than
it has room for, answers bad ones without starting work, refuses what it will not parse with an
error the REPL sees, and keeps its event loop free for everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from typing import Any

import pytest

from recursa.sandbox import SubprocessSandbox
from recursa.sandbox.connection import MAX_CALLS_IN_FLIGHT
from recursa.sandbox.frames import MAX_FRAME_VALUES, FrameDecoder, RefusedFrame, count_values
from recursa.sandbox.protocol import FeedChannel, ProtocolError, encode_frame
from recursa.tools.spec import host_tool
from tests.test_escapes import feedback_before as feedback
from tests.test_rlm_openai import code, make_rlm

# Finds the worker's end of the channel (the one stream Unix socket it holds) and writes raw frames.
RAW_WRITER = """
import json, os, socket

def _channel_fd():
    found = []
    for fd in range(3, 256):
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.family == socket.AF_UNIX and s.type == socket.SOCK_STREAM:
                found.append(fd)
        finally:
            s.detach()
    return found[-1]

def frame(obj):
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "big") + data

def write_all(data):
    fd = _channel_fd()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
"""

FLOOD = (
    RAW_WRITER
    + """
import gc

def call(i, x):
    return {"op": "call", "id": i, "fn": "tool", "args": {"name": "slow_echo", "args": [x], "kwargs": {}}}

def tool(i, x):
    return frame(call(i, x))

# The first frame goes as a call sends it (`lend=True`), so that the worker's reader thread takes the
# host's replies off the channel while the flood goes out; a cell that never has them read blocks
# only itself, on a full socket, until its timeout.
chan = next(o for o in gc.get_objects() if type(o).__name__ == "WorkerChannel")
chan.send(call(10**9, "dup"), lend=True)
dup = tool(10**9, "dup")
calls = [tool(10**9 + 1 + i, f"p{i}") for i in range(600)]
junk = [frame({"op": "call", "id": 2 * 10**9 + i, "fn": "no_such_function", "args": {}}) for i in range(20000)]
junk += [frame({"op": "call", "id": 3 * 10**9 + i, "fn": "llm_query", "args": [i]}) for i in range(10000)]
junk += [frame({"op": "call", "fn": "llm_query", "args": {}}) for i in range(10000)]
write_all(dup + b"".join(calls) + b"".join(junk))
print("flood written")
"""
)


class LoopWatch:
    """A ticker on the host's loop: the most CPU time the loop's thread spent between two ticks
    (time the loop was held; unlike wall time it does not grow when a busy machine leaves the
    process waiting), the longest wall-clock gap, and the most tasks alive at once."""

    def __init__(self) -> None:
        self.max_held = 0.0
        self.max_gap = 0.0
        self.max_tasks = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.002)
            self.max_held = max(self.max_held, time.thread_time() - cpu)
            self.max_gap = max(self.max_gap, time.perf_counter() - wall - 0.002)
            self.max_tasks = max(self.max_tasks, len(asyncio.all_tasks()))

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_a_flood_of_raw_call_frames_does_not_stall_the_host(server, script, tmp_path) -> None:
    seen: list[str] = []
    running = peak = 0
    bound_reached = asyncio.Event()

    @host_tool
    async def slow_echo(x: str) -> str:
        """Answers once the bound of calls in flight was reached (or after 5 s)."""
        nonlocal running, peak
        seen.append(x)
        running += 1
        peak = max(peak, running)
        if running >= MAX_CALLS_IN_FLIGHT:
            bound_reached.set()
        # Held until the bound is reached, not for a fixed time: on a loaded machine the worker's
        # frames came slower than 50 ms calls ended, and the bound was never reached.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await bound_reached.wait()
        running -= 1
        return x

    script.root("root-model", code(FLOOD), code("FINAL('next turn ok')"), "FINAL(fallback)")
    rlm = make_rlm(server, tmp_path, sandbox="subprocess", exec_timeout=60, tools=[slow_echo])
    # Objects left by earlier tests are set aside, so that a full collection of a large test
    # process's heap does not count as the loop being held by the channel.
    gc.collect()
    gc.freeze()
    try:
        async with LoopWatch() as watch:
            result = await rlm.arun("q", "ctx")
    finally:
        gc.unfreeze()
    assert result.stop_reason == "final" and result.answer == "next turn ok", (result.answer, result.error)
    assert "flood written" in feedback(server, 2)
    # Every well-formed call was served once; the duplicate id (still in flight) was not served twice,
    # the 40,000 bad frames reached nobody, and no more calls ran at once than the bound.
    assert len(seen) == 601 and seen.count("dup") == 1
    assert peak == MAX_CALLS_IN_FLIGHT
    # The host never held more tasks than that bound allows (a tool call is two: its own and its
    # timeout's; a task per frame would show here), and its loop was never held for long between
    # two ticks (a generous safety bound, not a timing; before the fix it was held for seconds).
    assert watch.max_tasks < 3 * MAX_CALLS_IN_FLIGHT, watch.max_tasks
    assert watch.max_held < 0.2, (watch.max_held, watch.max_gap)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        self.calls.append((fn, args))
        if fn == "llm_query_batched":
            return ["ok"] * len(args["prompts"])
        return "ok"


@pytest.fixture
async def box():
    handler = Recorder()
    sandbox = SubprocessSandbox()
    await sandbox.start(handler)
    yield sandbox, handler
    await sandbox.close()


async def test_too_many_values_in_a_call_is_an_error_in_the_repl(box) -> None:
    sandbox, handler = box
    many = MAX_FRAME_VALUES + 10
    r = await sandbox.execute(
        f"try:\n    llm_query_batched([''] * {many})\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "print(llm_query('still here'))",
        timeout=30,
    )
    assert r.error is None, r.error
    assert f"the limit is {MAX_FRAME_VALUES:,}" in r.stdout and "SubcallError" in r.stdout
    assert r.stdout.strip().endswith("ok") and handler.calls == [
        ("llm_query", {"prompt": "still here", "model": None})
    ]


async def test_an_oversized_call_is_dropped_unread_and_answered(box) -> None:
    sandbox, handler = box
    r = await sandbox.execute(
        "try:\n    llm_query('x' * (65 << 20))\nexcept Exception as e:\n    print(type(e).__name__, str(e)[:200])\n"
        "print(llm_query('after'))",
        timeout=60,
    )
    assert r.error is None, r.error
    assert "SubcallError" in r.stdout and "too large" in r.stdout and r.stdout.strip().endswith("ok")
    assert [fn for fn, _ in handler.calls] == ["llm_query"]


async def test_an_answer_with_too_many_values_is_an_error_and_the_repl_goes_on(box) -> None:
    sandbox, _ = box
    r = await sandbox.execute(f"big = [[] for _ in range({MAX_FRAME_VALUES + 10})]\nFINAL(big)", timeout=30)
    assert r.final is None and r.error is not None and "too large to send to the host" in r.error
    r = await sandbox.execute("print(len(big))", timeout=30)
    assert r.stdout.strip() == str(MAX_FRAME_VALUES + 10) and not r.restarted


async def test_unknown_malformed_and_idless_calls_never_reach_the_handler(box) -> None:
    sandbox, handler = box
    src = (
        RAW_WRITER + "write_all(frame({'op': 'call', 'id': 777, 'fn': 'os_system', 'args': {}})"
        " + frame({'op': 'call', 'id': 778, 'fn': 'llm_query', 'args': 'x'})"
        " + frame({'op': 'call', 'fn': 'llm_query', 'args': {'prompt': 'no id'}})"
        " + frame({'op': 'call', 'id': True, 'fn': 'llm_query', 'args': {'prompt': 'bool id'}}))\n"
        "print(llm_query('real'))"
    )
    r = await sandbox.execute(src, timeout=30)
    assert r.error is None and r.stdout.strip() == "ok", (r.error, r.stdout)
    assert handler.calls == [("llm_query", {"prompt": "real", "model": None})]


async def test_an_answer_the_cell_forged_with_fields_of_the_wrong_kind_or_size_is_read_bounded(box) -> None:
    # The cell answers its own request before the worker does, with every field of the wrong kind:
    # the host raised ValueError out of execute() (the whole run failed with a traceback).
    sandbox, _ = box
    forged = {"op": "exec_done", "stdout": {"a": 1}, "omitted_chars": "zz", "duration_s": [1],
              "notes": [None, 2, *["N" * 3_000] * 2_000],  # went to the trace whole (GBs a cell)
              "final": {"text": 5, "protocol": "forced", "value_is_text": True}}  # fmt: skip
    src = RAW_WRITER + f"write_all(frame({{**{forged!r}, 'id': 1}}))"  # the sandbox's first request
    r = await sandbox.execute(src, timeout=30)
    assert (r.stdout, r.omitted_chars, r.duration_s, r.notes[:2]) == ('{"a": 1}', 0, 0.0, ["", "2"])
    assert r.final is not None and (r.final.text, r.final.protocol) == ("5", "FINAL")
    assert len(r.notes) <= 100 and max(map(len, r.notes)) <= 2_000
    r = await sandbox.execute("print('next')", timeout=30)
    assert r.stdout == "next\n" and not r.restarted


def test_value_count_ignores_commas_inside_strings_and_bounds_the_rest() -> None:
    prose = json.dumps({"op": "call", "id": 1, "args": {"prompt": 'a, "b", \\, c\\\\' * 100_000}}).encode()
    assert count_values(prose) < 10
    for obj in ([[]] * 60_000, [0] * 60_000, {str(i): i for i in range(60_000)}, ["a,b"] * 60_000):
        assert count_values(json.dumps(obj).encode()) >= 60_000


def test_decoder_refuses_complex_frames_with_their_op_and_id() -> None:
    body = {"op": "exec_done", "id": 5, "value": [0] * (MAX_FRAME_VALUES + 1)}
    raw = encode_frame(body) + encode_frame({"op": "ready"})
    out = FrameDecoder().feed(raw)
    assert isinstance(out[0], RefusedFrame) and (out[0].op, out[0].id) == ("exec_done", 5)
    assert out[1] == {"op": "ready"}
    deep = b'{"op":"call","id":9,"args":' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert FrameDecoder().feed(len(deep).to_bytes(4, "big") + deep) == [
        RefusedFrame("call", 9, "nested too deeply")
    ]


async def test_a_remote_channel_stops_a_worker_that_floods_it() -> None:
    async def write(data: bytes) -> None:
        pass

    chan = FeedChannel(write, lines=False)
    frame = encode_frame({"op": "cancel", "id": 1, "pad": "x" * 1_000_000})
    for _ in range(70):  # 70 MB sent while the host reads nothing
        chan.feed(frame)
    with pytest.raises(ProtocolError, match="has not read yet"):
        async for _ in chan.frames():
            pass
