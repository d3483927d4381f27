"""The worker's end of the channel (sandbox/worker/wire.py): who reads the host's frames, and when.

Between requests the main thread reads the next one itself; while a cell runs it lends the reading
to the reader thread, which delivers the replies to the cell's calls: for the whole cell where the
channel is the only way the worker learns that its host is gone (`watch`), else from the cell's
first call on. These tests drive a WorkerChannel over a socketpair in this process, with this
test's thread as the worker's main one; the last ones kill real hosts.
"""

from __future__ import annotations

import contextlib
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from recursa.sandbox.bwrap import find_bwrap
from recursa.sandbox.proc import running, stat_fields
from recursa.sandbox.worker.landlock import landlock_abi
from recursa.sandbox.worker.wire import SocketTransport, WorkerChannel, decode_frame, encode_frame
from tests.helpers import host_process, spinning_in_c, wait_until


class RecordingTransport(SocketTransport):
    """Notes which thread made each read that returned data, and whether two reads ever overlapped."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.readers: list[int] = []
        self._reading = threading.Lock()
        self.overlapped = False

    def recv(self) -> tuple[bytes, list[int]]:
        if not self._reading.acquire(blocking=False):
            self.overlapped = True
            self._reading.acquire()
        try:
            data, fds = super().recv()
        finally:
            self._reading.release()
        if data:
            self.readers.append(threading.get_ident())
        return data, fds


@pytest.fixture
def no_process_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A channel that reads end-of-file ends the worker process; here that would be pytest's.
    monkeypatch.setattr(WorkerChannel, "_exit", lambda self: None)


@contextlib.contextmanager
def _channel(watch: bool) -> Iterator[tuple[WorkerChannel, RecordingTransport, socket.socket]]:
    ours, host = socket.socketpair()
    transport = RecordingTransport(ours)
    chan = WorkerChannel(transport, watch=watch)
    before = set(threading.enumerate())
    chan.start_reader()
    (reader,) = set(threading.enumerate()) - before
    try:
        yield chan, transport, host
    finally:
        chan.watch = True
        chan.lend_reader()  # so the reader thread reads the end-of-file below and leaves
        host.close()
        reader.join(5)  # before the real _exit is back
        assert not reader.is_alive()
        assert not transport.overlapped  # never two readers at once


@pytest.fixture
def pair(no_process_exit: None) -> Iterator[tuple[WorkerChannel, RecordingTransport, socket.socket]]:
    with _channel(watch=True) as made:
        yield made


@pytest.fixture(params=[True, False], ids=["watching", "on-demand"])
def either(
    no_process_exit: None, request: pytest.FixtureRequest
) -> Iterator[tuple[WorkerChannel, RecordingTransport, socket.socket]]:
    """A channel whose reader reads for whole cells (`watch`), and one that reads from a cell's first call."""
    with _channel(watch=request.param) as made:
        yield made


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        body += sock.recv(size - len(body))
    return decode_frame(body)


def test_the_main_thread_reads_its_next_request_itself(pair: Any) -> None:
    chan, transport, host = pair
    host.sendall(encode_frame({"op": "exec", "id": 1, "code": "x = 1"}))
    msg = chan.next_request()
    assert msg == {"op": "exec", "id": 1, "code": "x = 1"}
    assert transport.readers == [threading.get_ident()]  # no hand-off through the reader thread


def test_the_next_request_is_awaited_in_poll_which_the_host_reading_our_frames_does_not_wake(
    pair: Any,
) -> None:
    # Asleep in a read of a Unix socket, a thread is woken each time the other end takes a frame this
    # end sent (the kernel wakes every sleeper on the socket: room to write again); in poll() it
    # sleeps on until a request, the end of the channel or an error.
    chan, _transport, host = pair
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(chan.next_request()))
    waiter.start()
    task = f"self/task/{waiter.native_id}"
    deadline = time.monotonic() + 10
    while (stat_fields(task) or [b"?"])[0] != b"S" and time.monotonic() < deadline:
        time.sleep(0.001)
    with open(f"/proc/{task}/wchan") as f:
        where = f.read()
    host.sendall(encode_frame({"op": "list_vars", "id": 5}))
    waiter.join(5)
    assert got == [{"op": "list_vars", "id": 5}]
    if where in ("", "0"):
        pytest.skip("this kernel does not show where a thread sleeps (/proc/<tid>/wchan reads 0)")
    assert "poll" in where and "unix_stream" not in where, where


def test_next_request_with_a_timeout_returns_none_when_nothing_came(pair: Any) -> None:
    chan, _transport, host = pair
    assert chan.next_request(timeout=0.01) is None
    host.sendall(encode_frame({"op": "list_vars", "id": 2}))
    assert chan.next_request(timeout=5) == {"op": "list_vars", "id": 2}


def test_a_frame_split_across_reads_and_readers_arrives_whole(pair: Any) -> None:
    chan, transport, host = pair
    frame = encode_frame({"op": "get_var", "id": 3, "name": "x" * 5000})
    host.sendall(frame[:7])
    assert chan.next_request(timeout=0.05) is None  # half a frame is not a request
    chan.lend_reader()  # a cell starts: the reader thread reads the next piece
    host.sendall(frame[7:3000])
    deadline = time.monotonic() + 10
    while len(transport.readers) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert transport.readers[1:] and transport.readers[1] != threading.get_ident()
    assert not chan.has_pending()  # the cell is over: this thread takes the reading back
    host.sendall(frame[3000:])
    assert chan.next_request() == {"op": "get_var", "id": 3, "name": "x" * 5000}
    assert transport.readers[-1] == threading.get_ident()


def test_calls_during_a_cell_get_their_replies_through_the_reader_thread(either: Any) -> None:
    chan, transport, host = either
    chan.lend_reader()

    def host_side() -> None:
        call = _read_frame(host)
        host.sendall(
            encode_frame({"op": "reply", "id": call["id"], "ok": True, "value": call["args"]["n"] * 2})
        )

    server = threading.Thread(target=host_side)
    server.start()
    assert chan.call("double", {"n": 21}) == 42
    server.join()
    assert transport.readers and threading.get_ident() not in transport.readers


def test_replies_to_a_background_thread_are_delivered_while_the_main_thread_waits(either: Any) -> None:
    chan, _transport, host = either
    results: list[Any] = []
    caller = threading.Thread(target=lambda: results.append(chan.call("echo", {"v": "bg"})))
    caller.start()
    call = _read_frame(host)
    host.sendall(encode_frame({"op": "reply", "id": call["id"], "ok": True, "value": "back"}))
    host.sendall(encode_frame({"op": "exec", "id": 9, "code": ""}))
    assert chan.next_request(timeout=5) == {"op": "exec", "id": 9, "code": ""}
    caller.join(5)
    assert results == ["back"]


def test_a_cell_that_calls_nothing_wakes_no_reader_where_the_worker_does_not_watch(
    no_process_exit: None,
) -> None:
    with _channel(watch=False) as (chan, transport, host):
        chan.lend_reader()  # a cell starts
        assert not chan._reader_on.is_set()  # the reader thread sleeps on: nothing to read for it
        host.sendall(encode_frame({"op": "list_vars", "id": 4}))  # sent while the cell runs
        assert chan.next_request(timeout=5) == {"op": "list_vars", "id": 4}  # read once it is over
        assert transport.readers == [threading.get_ident()]


def test_calls_from_a_cells_threads_and_its_main_thread_all_get_their_replies(either: Any) -> None:
    chan, transport, host = either
    chan.lend_reader()
    calls = 5

    def host_side() -> None:
        got = [_read_frame(host) for _ in range(calls)]
        for call in reversed(got):  # answered out of order, all at once
            reply = {"op": "reply", "id": call["id"], "ok": True, "value": call["args"]["who"]}
            host.sendall(encode_frame(reply))

    server = threading.Thread(target=host_side)
    server.start()
    results: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, chan.call("echo", {"who": i})))
        for i in range(calls - 1)
    ]
    for thread in threads:
        thread.start()
    results[-1] = chan.call("echo", {"who": -1})
    for thread in threads:
        thread.join(10)
    server.join(10)
    assert results == {i: i for i in range(-1, calls - 1)}
    assert not chan.has_pending()  # the cell ends: the reading comes back to this thread
    assert threading.get_ident() not in transport.readers


def test_a_call_racing_the_end_of_its_cell_is_answered_and_no_frame_is_torn(no_process_exit: None) -> None:
    # A thread of the cell lends the reading on its call while the main thread, the cell over,
    # takes it back: whichever comes first, one thread reads at a time and the reply arrives.
    rounds = 100
    with _channel(watch=False) as (chan, _transport, host):

        def host_side() -> None:
            for i in range(rounds):
                call = _read_frame(host)
                reply = encode_frame(
                    {"op": "reply", "id": call["id"], "ok": True, "value": call["args"]["i"]}
                )
                host.sendall(reply + encode_frame({"op": "exec", "id": i, "code": "x" * 3000}))

        server = threading.Thread(target=host_side)
        server.start()
        for i in range(rounds):
            chan.lend_reader()
            results: list[Any] = []
            caller = threading.Thread(target=lambda i=i, out=results: out.append(chan.call("echo", {"i": i})))
            caller.start()
            if i % 2:
                caller.join(10)  # answered within the cell: through the reader thread
            assert chan.next_request(timeout=10) == {"op": "exec", "id": i, "code": "x" * 3000}
            caller.join(10)
            assert results == [i]
        server.join(10)


_KILLED_HOST = textwrap.dedent(
    """
    import asyncio, json, sys
    from recursa.sandbox import SubprocessSandbox
    from recursa.sandbox.forkserver import ForkServer

    async def handler(fn, args):
        return "ok"

    async def main():
        settings = {
            "plain": dict(hardening=False, snapshots=False),
            "bwrap": dict(bwrap=True, snapshots=False),
            "forked": dict(bwrap=True, fork_server=ForkServer()),
        }[sys.argv[1]]
        sb = SubprocessSandbox(**settings)
        await sb.start(handler)
        await sb.execute("x = llm_query('p')", 30)
        print(json.dumps(sb.pid), flush=True)
        await sb.execute("while True:\\n    pass", 3600)  # Python: a reader thread could run beside it

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("mode", ["plain", "bwrap", "forked"])
def test_a_local_worker_busy_in_a_cell_that_calls_nothing_dies_with_its_killed_host(mode: str) -> None:
    # Its reader thread is not reading then: the kernel takes it down with its parent (keeper.py,
    # bwrap --die-with-parent, zygote.py), which goes with the host. (With snapshots, the keeper's
    # case, also after a takeover: tests/test_snapshots.py.)
    if mode != "plain" and find_bwrap() is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    if mode == "forked" and landlock_abi() < 6:
        pytest.skip("the fork server needs Landlock ABI >= 6 (Linux 6.12+)")
    with host_process(_KILLED_HOST, mode) as (host, worker):
        wait_until(lambda: spinning_in_c(worker), 30, "the worker spinning in its cell")
        host.kill()
        host.wait()
        wait_until(lambda: not running(worker), 10, f"the {mode} worker to go with its host")


async def test_a_cells_child_process_inherits_none_of_the_channels_descriptors() -> None:
    # The channel's socket and its wake-up pipe stay in the worker: a program the cell runs must
    # not be able to write frames to the host or wake the reader. (The default lockdown forbids
    # running programs at all; a sandbox without it still must not hand these over.)
    from recursa.sandbox import SubprocessSandbox

    async def host(fn: str, args: dict[str, Any]) -> Any:
        return None

    sb = SubprocessSandbox(hardening=False)
    await sb.start(host)
    try:
        res = await sb.execute(
            "import subprocess, sys\n"
            "probe = 'import os\\nopen_fds = []\\nfor fd in range(3, 256):\\n"
            "    try:\\n        os.fstat(fd)\\n    except OSError:\\n        continue\\n"
            "    open_fds.append(fd)\\nprint(open_fds)'\n"
            "run = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, close_fds=False)\n"
            "print(run.stdout)",
            60,
        )
        assert res.error is None, res.stderr
        assert res.stdout.strip() == "[]"
    finally:
        await sb.close()
