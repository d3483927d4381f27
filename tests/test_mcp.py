"""`recursa mcp`: the MCP server through the official `mcp` client, over stdio (a real
`recursa mcp` subprocess) and streamable HTTP, with per-turn progress and clear tool errors."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp")
import httpx
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from recursa.asgi.background import BackgroundServer
from recursa.serve.mcp_server import TOOL_NAME, build_mcp_server, with_bearer_key
from recursa.serve.settings import ServeSettings
from recursa.tasks import generate
from recursa.version import __version__

MODEL, SUB = "scripted/gpt5-like", "scripted/oracle"


@pytest.fixture(scope="module")
def needle(tmp_path_factory):
    task = generate("niah", 200_000, seed=4)
    folder = tmp_path_factory.mktemp("mcp-files")
    path = folder / "haystack.txt"
    path.write_text(task.context)
    return task, path


class Progress:
    def __init__(self) -> None:
        self.seen: list[tuple[float, float | None, str | None]] = []

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.seen.append((progress, total, message))


def _check_progress(progress: Progress, turns: int, total: int = 30) -> None:
    values = [p for p, _, _ in progress.seen]
    # The total is the run's own turn limit: the operator's, or the client's lower one.
    assert {t for _, t, _ in progress.seen} == {total}
    assert values == sorted(values) and len(set(values)) == len(values)  # strictly increasing
    turn_messages = [m for _, _, m in progress.seen if m and m.startswith("turn ")]
    assert len(turn_messages) == turns  # one notification per turn
    assert progress.seen[-1][2].startswith("done after")


async def test_stdio_server_answers_over_a_path_with_progress_per_turn(needle, tmp_path):
    task, path = needle
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            *["-m", "recursa.cli", "mcp", "--model", MODEL, "--sub-model", SUB],
            *["--allow-path", str(path.parent), "--trace-dir", str(tmp_path)],
        ],
    )
    progress = Progress()
    # A transport, not the parameters: Client takes stdio parameters only from mcp 2.3 on, and the
    # server side also runs on 2.0 (the version verifiers pins).
    async with Client(stdio_client(params), read_timeout_seconds=60) as client:
        tools = (await client.list_tools()).tools
        assert [t.name for t in tools] == [
            TOOL_NAME,
            "recursa_session_open",
            "recursa_session_ask",
            "recursa_session_close",
        ]
        assert {"question", "context_path", "context_text"} <= set(tools[0].input_schema["properties"])
        result = await client.call_tool(
            TOOL_NAME, {"question": task.question, "context_path": str(path)}, progress_callback=progress
        )
        assert not result.is_error
        out = result.structured_content
        assert task.score(out["answer"]) == 1.0 and out["stop_reason"] == "final"
        assert out["llm_calls"] >= 2 and Path(out["trace_path"]).parent == tmp_path
        _check_progress(progress, out["iterations"])

        # A path outside the allowed folder is a tool error, and the server keeps serving.
        bad = await client.call_tool(TOOL_NAME, {"question": "q", "context_path": "/etc/hostname"})
        assert bad.is_error and "outside the folders" in bad.content[0].text
        again = await client.call_tool(TOOL_NAME, {"question": task.question, "context_path": str(path)})
        assert not again.is_error


async def test_streamable_http_server_answers_inline_text_with_progress(tmp_path):
    task = generate("niah", 60_000, seed=2)
    settings = ServeSettings(model=MODEL, sub_model=SUB, trace_dir=tmp_path)
    app = build_mcp_server(settings).streamable_http_app(streamable_http_path="/mcp")
    with BackgroundServer(app) as server:
        progress = Progress()
        async with Client(server.url + "/mcp", read_timeout_seconds=60) as client:
            result = await client.call_tool(
                TOOL_NAME,
                {"question": task.question, "context_text": task.context, "max_iterations": 12},
                progress_callback=progress,
            )
            assert not result.is_error
            assert task.score(result.structured_content["answer"]) == 1.0
            _check_progress(progress, result.structured_content["iterations"], total=12)


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"question": "q"}, "exactly one of context_path"),
        ({"question": "q", "context_text": "a", "context_path": "/x"}, "exactly one of context_path"),
        ({"question": "  ", "context_text": "a"}, "question is empty"),
        (
            {"question": "q", "context_text": "a", "max_depth": 99},
            "arguments['max_depth']=99 is more than the operator allows (at most 3)",
        ),
        ({"question": "q", "context_path": "/tmp"}, "turned off on this server"),
    ],
)
async def test_bad_tool_arguments_are_clear_tool_errors(tmp_path, arguments, fragment):
    server = build_mcp_server(ServeSettings(model=MODEL, sub_model=SUB, trace_dir=tmp_path))
    async with Client(server) as client:
        result = await client.call_tool(TOOL_NAME, arguments)
        assert client.server_info.version == __version__  # what the client's initialize reports
    assert result.is_error and fragment in result.content[0].text


def test_http_transport_can_require_a_bearer_key(tmp_path):
    server = build_mcp_server(ServeSettings(model=MODEL, sub_model=SUB, trace_dir=tmp_path))
    app = with_bearer_key(server.streamable_http_app(streamable_http_path="/mcp"), "mcp-key-0123456789")
    with BackgroundServer(app) as srv:
        r = httpx.post(srv.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert r.status_code == 401 and "API key" in r.text
        r = httpx.post(
            srv.url + "/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
            headers={
                "authorization": "Bearer mcp-key-0123456789",
                "accept": "application/json, text/event-stream",
            },
        )
        # Past the key check, the MCP app itself answers (this bare ping has no session yet).
        assert r.status_code == 400 and "Missing session ID" in r.text


async def test_a_cancelled_call_cancels_the_run_and_reaps_its_sandbox(tmp_path):
    import anyio

    from recursa.trace import load
    from tests.serve_helpers import descendants, wait_until

    # fault=loop: the root's code spins until exec_timeout, so the run is alive until cancelled.
    settings = ServeSettings(model=MODEL + ":fault=loop", sub_model=SUB, trace_dir=tmp_path)
    app = build_mcp_server(settings).streamable_http_app(streamable_http_path="/mcp")
    with BackgroundServer(app) as server:
        baseline = descendants(os.getpid())
        async with Client(server.url + "/mcp") as client:
            first_turn = anyio.Event()

            async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                first_turn.set()

            async with anyio.create_task_group() as group:

                async def call() -> None:
                    await client.call_tool(
                        TOOL_NAME,
                        {"question": "How many lines?", "context_text": "a\nb\n" * 50},
                        progress_callback=on_progress,
                    )

                group.start_soon(call)
                await first_turn.wait()
                # The REPL starts while the first model call is out: wait until it runs the loop.
                await anyio.to_thread.run_sync(
                    lambda: wait_until(lambda: bool(descendants(os.getpid()) - baseline), what="the REPL")
                )
                group.cancel_scope.cancel()
            # Still inside the session: the cancellation itself, not a closed session, stops the run.
            await anyio.to_thread.run_sync(
                lambda: wait_until(lambda: not (descendants(os.getpid()) - baseline), what="the REPL reaped")
            )
    (trace,) = tmp_path.glob("*.jsonl")
    assert load(trace).root.stop_reason == "cancelled"


async def test_mcp_sessions_answer_several_questions_in_one_repl(tmp_path):
    from tests.serve_helpers import descendants, install_test_root, wait_until

    model = install_test_root()  # "RUN: code ||| code" questions run their code, one block per turn
    settings = ServeSettings(model=model, sub_model=SUB, trace_dir=tmp_path)
    server = build_mcp_server(settings)
    app = server.streamable_http_app(streamable_http_path="/mcp")
    with BackgroundServer(app) as http:
        baseline = descendants(os.getpid())
        async with Client(http.url + "/mcp") as client:
            opened = await client.call_tool("recursa_session_open", {"context_text": "alpha beta"})
            assert not opened.is_error, opened.content
            sid = opened.structured_content["session"]
            assert descendants(os.getpid()) - baseline  # the REPL is up before the first question
            ask = {"session": sid, "question": "RUN: words = context.split()"}
            first = await client.call_tool("recursa_session_ask", ask)
            assert not first.is_error and first.structured_content["stop_reason"] == "final"
            ask = {"session": sid, "question": "RUN: FINAL(f'{words[1]}|{len(history)}')"}
            second = await client.call_tool("recursa_session_ask", ask)
            assert second.structured_content["answer"] == "beta|1"  # variables and history carried over
            closed = await client.call_tool("recursa_session_close", {"session": sid})
            assert closed.structured_content["result"] is True
            gone = await client.call_tool("recursa_session_ask", {"session": sid, "question": "RUN: x = 1"})
            assert gone.is_error and "no open session" in gone.content[0].text
        wait_until(lambda: not (descendants(os.getpid()) - baseline), what="the session's REPL reaped")


def test_http_transport_caps_request_bodies(tmp_path):
    """The SDK reads a body whole: a declared length over the cap is refused before a byte is read,
    and a chunked body is cut off where it passes the cap; the server goes on answering."""
    from recursa.serve.mcp_server import http_app

    settings = ServeSettings(model=MODEL, sub_model=SUB, trace_dir=tmp_path, max_context_bytes=10_000)
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    with BackgroundServer(http_app(build_mcp_server(settings), settings)) as srv:
        declared = httpx.post(srv.url + "/mcp", content=b"{" + b" " * 20_000 + b"}", headers=headers)
        assert declared.status_code == 413 and "10,000 bytes" in declared.text

        def chunks():
            yield b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "pad": "'
            for _ in range(50):
                yield b"x" * 1000
            yield b'"}'

        chunked = httpx.post(srv.url + "/mcp", content=chunks(), headers=headers)
        assert chunked.status_code == 413
        ping = httpx.post(
            srv.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers
        )
        assert ping.status_code == 400 and "Missing session ID" in ping.text


async def test_an_answer_holding_surrogates_reaches_the_client(tmp_path):
    # The SDK's JSON cannot encode a surrogate: the client got "Error executing tool" instead.
    from tests.serve_helpers import install_test_root

    server = build_mcp_server(ServeSettings(model=install_test_root(), sub_model=SUB, trace_dir=tmp_path))
    question = "RUN: FINAL('lone \\udc80 pair \\ud83d\\ude00 end')"
    async with Client(server) as client:
        result = await client.call_tool(TOOL_NAME, {"question": question, "context_text": "ctx"})
    assert not result.is_error, result.content
    assert result.structured_content["answer"] == "lone \ufffd pair \U0001f600 end"


def test_http_transport_keeps_the_servers_shares(tmp_path):
    """As for recursa serve: a body past the JSON bounds is a 413 before the SDK builds it, a trickled
    body is a 408 at its deadline, and a caller past its share of requests is a 429 (one shared key's
    holders are one caller)."""
    import socket

    from recursa.serve.mcp_server import http_app
    from tests.helpers import wait_until

    key = "mcp-shared-key-0123456789"
    settings = ServeSettings(
        model=MODEL,
        sub_model=SUB,
        trace_dir=tmp_path,
        api_key=key,
        body_timeout_s=3,
        max_runs=1,
        max_waiting=8,
        max_runs_per_caller=1,
        max_waiting_per_caller=0,
    )
    headers = {
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
        "authorization": f"Bearer {key}",
    }
    with BackgroundServer(http_app(build_mcp_server(settings), settings)) as srv:
        flood = b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": [' + b"1," * 150_000 + b"1]}}"
        refused = httpx.post(srv.url + "/mcp", content=flood, headers=headers, timeout=60)
        assert refused.status_code == 413 and "JSON values" in refused.text
        slow = socket.create_connection(("127.0.0.1", srv.port))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        slow.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Length: 500\r\n\r\n{{".encode())

        # While the trickled body holds the caller's one place (once its head is in), the caller gets
        # a 429 ...
        def busy() -> bool:
            ping = httpx.post(
                srv.url + "/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "ping"}, headers=headers
            )
            return ping.status_code == 429 and "caller_busy" in ping.text

        wait_until(busy, timeout_s=30, what="the trickled request to hold the caller's place")
        slow.settimeout(60)
        reply = slow.recv(4096).decode()
        slow.close()
        assert reply.startswith("HTTP/1.1 408"), reply
        # ... and once the deadline freed it, its place is back.
        ping = httpx.post(
            srv.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers
        )
        assert ping.status_code == 400 and "Missing session ID" in ping.text


async def test_http_transport_takes_contexts_up_to_the_operators_cap(tmp_path):
    """The SDK's own body cap (4 MiB) refused a 5 MB context_text with 413, under the 2 GiB the
    server promises (ServeSettings.max_context_bytes); the operator's cap is the one that holds."""
    from recursa.serve.mcp_server import http_app
    from tests.serve_helpers import install_test_root

    settings = ServeSettings(model=install_test_root(), sub_model=SUB, trace_dir=tmp_path)
    with BackgroundServer(http_app(build_mcp_server(settings), settings)) as server:
        async with Client(server.url + "/mcp", read_timeout_seconds=60) as client:
            question = "RUN: FINAL(str(len(context)))"
            result = await client.call_tool(
                TOOL_NAME, {"question": question, "context_text": "x" * 5_000_000}
            )
    assert not result.is_error, result.content
    assert result.structured_content["answer"] == "5000000"


def test_one_caller_cannot_take_every_mcp_client_slot(tmp_path):
    """Every `initialize` opens a transport session in the SDK, capped only for the whole server:
    one key opening them as fast as it could took them all, and others' clients were refused for
    the SDK's half-hour idle timeout. A caller holds its share now, whatever X-Recursa-Client it
    sends, and a session it deletes leaves its count."""
    from recursa.serve.mcp_server import http_app

    keys = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdefgh"}
    settings = ServeSettings(model=MODEL, sub_model=SUB, trace_dir=tmp_path, api_keys=keys, max_mcp_clients=8)
    assert settings.mcp_clients_per_caller == 2
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize"}
    init["params"] = {
        "protocolVersion": "2025-03-26",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    }

    def headers(key, **more):
        return {"accept": "application/json, text/event-stream", "authorization": f"Bearer {key}", **more}

    with BackgroundServer(http_app(build_mcp_server(settings), settings)) as srv, httpx.Client() as http:
        url = srv.url + "/mcp"
        opened = [http.post(url, json=init, headers=headers(keys["alice"])) for _ in range(2)]
        assert [r.status_code for r in opened] == [200, 200]
        for extra in ({}, {"x-recursa-client": "another-label-0123456789"}):
            third = http.post(url, json=init, headers=headers(keys["alice"], **extra))
            assert third.status_code == 429 and "your share" in third.text, third.text
        assert http.post(url, json=init, headers=headers(keys["bob"])).status_code == 200
        gone = opened[0].headers["mcp-session-id"]
        assert http.delete(url, headers=headers(keys["alice"], **{"mcp-session-id": gone})).status_code < 400
        assert http.post(url, json=init, headers=headers(keys["alice"])).status_code == 200

        async def at_once(n):  # openings sent together cannot pass the share together
            async with httpx.AsyncClient() as client:
                sent = [client.post(url, json=init, headers=headers(keys["bob"])) for _ in range(n)]
                return sorted(r.status_code for r in await asyncio.gather(*sent))

        assert asyncio.run(at_once(6)) == [200] + [429] * 5  # bob holds one already


def test_an_open_http_server_on_every_address_refuses_web_pages(tmp_path):
    """The SDK checks Origin and Host only when the server is told a loopback host: `recursa mcp
    --http --host 0.0.0.0` without a key let a page in the operator's browser (cross-site, or on a
    name rebound to 127.0.0.1) call the tools on the operator's model key."""
    from recursa.serve.mcp_server import http_app

    settings = ServeSettings(model=MODEL, sub_model=SUB, trace_dir=tmp_path)
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize"}
    init["params"] = {
        "protocolVersion": "2025-03-26",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    }
    headers = {"accept": "application/json, text/event-stream"}
    with BackgroundServer(http_app(build_mcp_server(settings), settings, host="0.0.0.0")) as srv:
        url = srv.url + "/mcp"
        page = httpx.post(url, json=init, headers={**headers, "origin": "https://evil.example"})
        assert page.status_code == 403 and "origin_not_allowed" in page.text
        rebound = httpx.post(url, json=init, headers={**headers, "host": f"evil.example:{srv.port}"})
        assert rebound.status_code == 403
        assert httpx.post(url, json=init, headers=headers).status_code == 200
