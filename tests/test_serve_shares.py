"""Fair shares on `recursa serve` and `recursa mcp --http`: one caller's flood (of runs, of trickled
bodies, of values in one body, of idle sessions, of half-sent heads) leaves the server to everyone
else. Each test fails against a server without the share it checks."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx

from recursa.asgi.background import BackgroundServer
from recursa.serve.json_limits import MAX_VALUES, TooDeepJSON, TooMuchJSON, loads_bounded
from recursa.serve.openai_server import create_app
from tests.helpers import wait_until
from tests.serve_helpers import FOREVER, HELLO, serve_settings

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdefgh"
KEYS = {"alice": ALICE, "bob": BOB}
GUARD_S = 60.0  # bounds every wait below; none is reached when the shares hold


def _chat(question: str, **recursa: object) -> dict:
    body: dict = {"model": "recursa", "messages": [{"role": "user", "content": question}]}
    body["recursa"] = {"context": "a note", **recursa}
    return body


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _started_stream(client: httpx.AsyncClient, url: str, key: str, question: str):
    """A streamed chat request, once its first chunk came (the server has it and is waiting for, or
    running, its run); the caller closes it."""
    stream = client.stream("POST", url, json={**_chat(question), "stream": True}, headers=_auth(key))
    response = await stream.__aenter__()
    assert response.status_code == 200
    lines = response.aiter_lines()
    first = await anext(lines)
    assert first.startswith("data:")
    return stream, response, lines


async def test_one_callers_runs_leave_slots_and_room_to_others(tmp_path: Path) -> None:
    settings = serve_settings(
        tmp_path, None, api_keys=KEYS, max_runs=2, max_runs_per_caller=1, max_waiting_per_caller=1
    )
    with BackgroundServer(create_app(settings)) as srv:
        url = srv.url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            running, _, lines = await _started_stream(client, url, ALICE, FOREVER)
            async for line in lines:  # her first run has a slot: its steps stream
                if "reasoning_content" in line:
                    break
            waiting, *_ = await _started_stream(client, url, ALICE, HELLO)  # waits for her own slot
            refused = await client.post(url, json=_chat(HELLO), headers=_auth(ALICE))
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "caller_busy", (
                refused.text
            )
            # Alice holds one slot and waits for her second; the server's other slot is Bob's.
            async with asyncio.timeout(GUARD_S):
                answered = await client.post(url, json=_chat(HELLO), headers=_auth(BOB))
            assert answered.status_code == 200, answered.text
            assert answered.json()["choices"][0]["message"]["content"] == "hello from the rlm"
            await waiting.__aexit__(None, None, None)
            await running.__aexit__(None, None, None)


def _raw_request(port: int, body_sent: bytes, declared: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + body_sent)
    return sock


def test_a_trickled_body_cannot_hold_the_servers_slots(tmp_path: Path) -> None:
    # One run slot and no waiting: a body that never finishes held the only place for good.
    settings = serve_settings(tmp_path, None, api_keys=KEYS, max_runs=1, max_waiting=0, body_timeout_s=0.5)
    with BackgroundServer(create_app(settings)) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        slow = _raw_request(port, b'{"model": "recursa", ', 10_000)
        slow.settimeout(GUARD_S)
        reply = b""
        while chunk := slow.recv(4096):  # the answer closes the connection
            reply += chunk
        slow.close()
        reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
        answered = httpx.post(
            srv.url + "/v1/chat/completions", json=_chat(HELLO), headers=_auth(BOB), timeout=GUARD_S
        )
        assert answered.status_code == 200, answered.text


def _tiny_messages(n: int) -> bytes:
    return (
        b'{"model": "recursa", "messages": ['
        + b'{"role":"user","content":"x"},' * n
        + b'{"role":"user","content":"q"}]}'
    )


def test_a_body_of_many_tiny_messages_is_refused_before_it_is_built(tmp_path: Path) -> None:
    raw = _tiny_messages(300_000)  # 9 MB; parsed whole, some 190 MB of objects
    tracemalloc.start()
    try:
        with pytest.raises(TooMuchJSON, match=f"more than {MAX_VALUES:,} JSON values"):
            loads_bounded(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 48 * 1024**2, peak  # the text once, and the values up to the bound
    with pytest.raises(TooDeepJSON):
        loads_bounded(b"[" * 70 + b"]" * 70)
    # The same values as json.loads, on either path (a body full of commas goes to the counting one).
    for doc in (
        {"a": [1, 2.5, -3e2, None, True, False, 'x"y\\n', {"k": []}], "a2": {}},
        {"text": "a, b, c" * (MAX_VALUES // 2), "n": [0, -1, 1.0e-3], "dup": 1},
    ):
        text = json.dumps(doc).encode()
        assert loads_bounded(text) == json.loads(text)
    # Standard JSON only: a NaN is no JSON value, and it does not end the count early either (the
    # values after it are counted, and too many refuse the body before a value is built).
    with pytest.raises(json.JSONDecodeError):
        loads_bounded(b'{"a": NaN}')
    with pytest.raises(TooMuchJSON):
        loads_bounded(b'{"a": NaN, "b": [' + b"1," * MAX_VALUES + b"1]}")
    # Commas and brackets inside strings are no values, escaped quotes included; an empty pair is one.
    inside = json.dumps(["[{,\\\"" * MAX_VALUES, [[]] * (MAX_VALUES // 2 - 2)]).encode()
    assert loads_bounded(inside) == json.loads(inside)
    with pytest.raises(TooMuchJSON):
        loads_bounded(json.dumps([[]] * MAX_VALUES).encode())
    settings = serve_settings(tmp_path, None, api_keys=KEYS)
    with BackgroundServer(create_app(settings)) as srv:
        url = srv.url + "/v1/chat/completions"
        flood = httpx.post(url, content=_tiny_messages(200_000), headers=_auth(ALICE), timeout=GUARD_S)
        assert flood.status_code == 413 and flood.json()["error"]["code"] == "request_too_large", flood.text
        many = httpx.post(url, content=_tiny_messages(25_000), headers=_auth(ALICE), timeout=GUARD_S)
        assert many.status_code == 413 and many.json()["error"]["param"] == "messages", many.text
        assert httpx.post(url, json=_chat(HELLO), headers=_auth(ALICE), timeout=GUARD_S).status_code == 200


def test_idle_sessions_memory_is_bounded_across_sessions(tmp_path: Path) -> None:
    settings = serve_settings(
        tmp_path, None, api_keys=KEYS, idle_sessions_memory_bytes=1, sandbox="subprocess"
    )
    with BackgroundServer(create_app(settings)) as srv:
        url = srv.url + "/v1/chat/completions"
        for sid, key in (("s-alice-1", ALICE), ("s-bob-1", BOB)):
            answered = httpx.post(url, json=_chat(HELLO, session=sid), headers=_auth(key), timeout=GUARD_S)
            assert answered.status_code == 200, answered.text

        # Both REPLs hold memory and the bound is a byte: the older idle session is closed, the
        # most recent kept.
        def listed(key: str) -> int:
            got = httpx.get(srv.url + "/v1/recursa/sessions", headers=_auth(key), timeout=GUARD_S)
            return len(got.json()["data"])

        wait_until(lambda: listed(ALICE) == 0, timeout_s=GUARD_S, what="the older idle session to close")
        assert listed(BOB) == 1


_FLOOD_ADDRESSES = [f"127.0.0.{k}" for k in range(3, 11)]


def _half_open_heads(address: str, port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        sock = socket.socket()
        sock.bind((address, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        out.append(sock)
    return out


def test_an_anonymous_flood_of_heads_leaves_authenticated_callers_served(tmp_path: Path) -> None:
    """The server's descriptor limit is 128 here, so its caps are 64 connections and 16 per address:
    a flood of half-sent heads from one address and from many still leaves a caller served."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    keys = tmp_path / "keys"
    keys.write_text(f"alice {ALICE}\n")
    cmd = [sys.executable, "-m", "recursa.cli", "serve", "--model", "scripted/gpt5-like", "--port", str(port)]
    cmd += ["--api-keys-file", str(keys), "--trace-dir", str(tmp_path / "t"), "--no-access-log"]

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=low_limit
    )
    base = f"http://127.0.0.1:{port}"
    flood: list[socket.socket] = []
    try:
        wait_until(lambda: _health(base) or proc.poll() is not None, timeout_s=GUARD_S, what="recursa serve")
        assert proc.poll() is None
        flood += _half_open_heads("127.0.0.1", port, 150)  # one address: past its 16, closed at once
        for address in _FLOOD_ADDRESSES:  # many addresses: 160 heads, past the server's 64 in all
            flood += _half_open_heads(address, port, 20)
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=10) as caller:
            for _ in range(3):
                models = caller.get(base + "/v1/models", headers=_auth(ALICE))
                assert models.status_code == 200, models.text
    finally:
        for sock in flood:
            sock.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _health(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


_UPGRADE = (
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def test_websocket_upgrades_leave_the_connection_caps_when_they_close(tmp_path: Path) -> None:
    """An upgrade request (no key needed) moved its connection to uvicorn's WebSocket protocol, and
    the connection stayed counted after it closed: as many upgrades as the per-address cap shut
    that address out for good (and, from a few addresses, the whole server)."""
    settings = serve_settings(tmp_path, ALICE)
    with BackgroundServer(create_app(settings), max_connections=8, max_connections_per_address=2) as srv:
        for _ in range(4):
            with socket.create_connection((srv.host, srv.port), timeout=GUARD_S) as conn:
                conn.sendall(_UPGRADE)
                answer = b""
                while chunk := conn.recv(65536):  # the app has no WebSocket route: 403, then closed
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 403")
        wait_until(lambda: _health(srv.url), timeout_s=10, what="a request from the same address served")


def test_a_reader_that_takes_nothing_is_cut_off(tmp_path: Path) -> None:
    """A streamed answer its client never read waited in uvicorn's write, which has no time limit,
    holding the caller's place (here the server's one) for as long as the client kept the connection
    open. The connection is aborted once the client takes nothing for the write timeout."""
    settings = serve_settings(tmp_path, ALICE, max_runs=1, max_waiting=0)
    big = "RUN: big = 'x' * 16_000_000\nFINAL_VAR('big')"
    body = json.dumps({**_chat(big), "stream": True}).encode()
    with BackgroundServer(create_app(settings), write_timeout_s=0.5) as srv:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((srv.host, srv.port))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALICE}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        stalled.sendall(head.encode() + body)  # and never reads

        def served() -> bool:
            answer = httpx.post(
                srv.url + "/v1/chat/completions", json=_chat(HELLO), headers=_auth(ALICE), timeout=GUARD_S
            )
            return answer.status_code == 200

        try:
            wait_until(served, timeout_s=GUARD_S, what="the server's one place freed from the stalled reader")
        finally:
            stalled.close()
