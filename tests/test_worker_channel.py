"""The worker's end of the channel (sandbox/worker/wire.py): who reads the host's frames, and when.

Between requests the main thread reads the next one itself; while a cell runs it lends the reading
to the reader thread, which delivers the replies to the cell's calls. These tests drive a
WorkerChannel over a socketpair in this process, with this test's thread as the worker's main one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from recursa.sandbox.worker.wire import SocketTransport, WorkerChannel, decode_frame, encode_frame


class RecordingTransport(SocketTransport):
    """Notes which thread made each read that returned data."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.readers: list[int] = []

    def recv(self) -> tuple[bytes, list[int]]:
        data, fds = super().recv()
        if data:
            self.readers.append(threading.get_ident())
        return data, fds


@pytest.fixture
def no_process_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A channel that reads end-of-file ends the worker process; here that would be pytest's.
    monkeypatch.setattr(WorkerChannel, "_exit", lambda self: None)


@pytest.fixture
def pair(no_process_exit: None) -> Iterator[tuple[WorkerChannel, RecordingTransport, socket.socket]]:
    ours, host = socket.socketpair()
    transport = RecordingTransport(ours)
    chan = WorkerChannel(transport)
    before = set(threading.enumerate())
    chan.start_reader()
    (reader,) = set(threading.enumerate()) - before
    try:
        yield chan, transport, host
    finally:
        chan.lend_reader()  # so the reader thread reads the end-of-file below and leaves
        host.close()
        reader.join(5)  # before the real _exit is back
        assert not reader.is_alive()


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


def test_calls_during_a_cell_get_their_replies_through_the_reader_thread(pair: Any) -> None:
    chan, transport, host = pair
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


def test_replies_to_a_background_thread_are_delivered_while_the_main_thread_waits(pair: Any) -> None:
    chan, _transport, host = pair
    results: list[Any] = []
    caller = threading.Thread(target=lambda: results.append(chan.call("echo", {"v": "bg"})))
    caller.start()
    call = _read_frame(host)
    host.sendall(encode_frame({"op": "reply", "id": call["id"], "ok": True, "value": "back"}))
    host.sendall(encode_frame({"op": "exec", "id": 9, "code": ""}))
    assert chan.next_request(timeout=5) == {"op": "exec", "id": 9, "code": ""}
    caller.join(5)
    assert results == ["back"]


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
