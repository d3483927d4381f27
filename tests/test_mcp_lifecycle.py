"""MCP servers' lifetimes, with real `mcp` servers (tests/mcp_tool_server.py): an ACP session connects
its servers once for all its prompts and closes them with the session or the connection; a run that
is cancelled or abandoned leaves no stdio server process behind (each checked by its pid)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import select
import sys
from pathlib import Path

import pytest

from recursa.asgi.background import BackgroundServer
from recursa.env import RLMEnv

from .mcp_tool_server import build
from .test_mcp_tools import SERVER_SCRIPT, use
from .test_rlm_openai import code, make_rlm


def ended(pid: int, timeout: float = 10.0) -> bool:
    """Whether process `pid` has exited, or exits within `timeout` (a wait on its pidfd)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def counted(tmp_path: Path) -> tuple[Path, dict]:
    """A folder where each start of the stdio test server leaves its pid, and the server's entry."""
    starts = tmp_path / "starts"
    starts.mkdir(exist_ok=True)
    entry = {"command": sys.executable, "args": [SERVER_SCRIPT, "local"], "env": {"STARTS_DIR": str(starts)}}
    return starts, entry


def pids(starts: Path) -> list[int]:
    return sorted(int(p.name) for p in starts.iterdir())


async def test_an_acp_session_connects_its_and_the_operators_mcp_servers_once_and_closes_them(
    server, script, tmp_path
):
    pytest.importorskip("acp", reason="agent-client-protocol is not installed (pip install recursa[acp])")
    from acp import PROTOCOL_VERSION, RequestError, spawn_agent_process, text_block
    from acp.schema import EnvVariable, HttpHeader, HttpMcpServer, McpServerStdio, SseMcpServer

    from .test_acp import Recorder, agent_env

    starts, entry = counted(tmp_path)
    stdio = McpServerStdio(
        name="local",
        command=entry["command"],
        args=entry["args"],
        env=[EnvVariable(name="STARTS_DIR", value=str(starts))],
    )
    app = build("web").streamable_http_app(streamable_http_path="/mcp")
    asked: list[str] = []  # the MCP method of each request to the client's HTTP server

    async def watched(scope, receive, send):
        if scope["type"] == "http":
            asked.append(dict(scope["headers"]).get(b"mcp-method", b"").decode())
        await app(scope, receive, send)

    script.root("policy", code("print('pid', local_pid(), 'sum', web_add(2, 3), ops_add(1))"), "FINAL(done)")
    with BackgroundServer(watched) as web, BackgroundServer(build("ops").streamable_http_app()) as ops:
        operator = tmp_path / "mcp.json"  # the operator's servers join every session's
        operator.write_text(json.dumps({"mcpServers": {"ops": {"url": ops.url + "/mcp", "tools": ["add"]}}}))
        args = ["-m", "recursa.cli", "acp", "--model", "openai/policy", "--base-url", server.base_url,
                "--trace-dir", str(tmp_path), "--mcp-servers", str(operator)]  # fmt: skip
        http = HttpMcpServer(
            type="http", name="web", url=web.url + "/mcp", headers=[HttpHeader(name="X-Team", value="t")]
        )
        # the agent is given time to end by itself once its stdin closes (the default is 2 s)
        ending = {"shutdown_timeout": 60.0}
        spawn = spawn_agent_process(
            Recorder(), sys.executable, *args, env=agent_env(), transport_kwargs=ending
        )
        async with spawn as (conn, proc):
            init = await conn.initialize(protocol_version=PROTOCOL_VERSION)
            first = await conn.new_session(cwd=str(tmp_path), mcp_servers=[stdio, http])
            [first_pid] = pids(starts)  # connected at session/new
            replies = [
                await conn.prompt(session_id=first.session_id, prompt=[text_block(f"go {i}")])
                for i in range(2)
            ]
            await conn.new_session(cwd=str(tmp_path), mcp_servers=[stdio])  # left open
            await conn.close_session(session_id=first.session_id)
            closed_with_its_session = ended(first_pid)
            [second_pid] = [p for p in pids(starts) if p != first_pid]
            open_before_the_end = not ended(second_pid, timeout=0)
            with pytest.raises(RequestError) as refused:
                sse = SseMcpServer(type="sse", name="old", url=web.url + "/mcp", headers=[])
                await conn.new_session(cwd=str(tmp_path), mcp_servers=[sse])
        # leaving the block closed the agent's stdin: it ended its sessions and exited by itself
        assert proc.returncode == 0

    caps = init.agent_capabilities
    assert caps.mcp_capabilities.http and not caps.mcp_capabilities.sse and caps.session_capabilities.close
    assert "'sse' is not supported" in str(refused.value.data)
    assert [r.field_meta["recursa/run-v1"]["stop_reason"] for r in replies] == ["final", "final"]
    roots = [r for r in server.requests if r.model == "policy"]
    shown = [r.messages[-1]["content"] for r in roots if len(r.messages) > 2]
    assert len(shown) == 2 and all(f"pid {first_pid} sum 5 11" in s for s in shown)
    assert "`local_weather(city: str) -> dict`" in roots[0].messages[0]["content"]
    # one start of the stdio server and one MCP connection over HTTP for both prompts of the session
    assert sorted(asked) == ["server/discover", "tools/call", "tools/call", "tools/list"]
    assert closed_with_its_session and open_before_the_end and ended(second_pid, timeout=0)


# -- no stdio server outlives a run that was cancelled or abandoned -------------------------------


def test_a_run_cancelled_mid_way_leaves_no_server_running(server, tmp_path):
    starts, entry = counted(tmp_path)
    use(server, code("print(pid())\nslow(60)"), "FINAL(never)")

    async def cancel_mid_run() -> None:
        loop = asyncio.get_running_loop()
        replied = asyncio.Event()  # the root's first reply is in: its code (slow(60)) runs next

        def on_event(event: dict) -> None:
            if event["type"] == "lm_call":
                loop.call_soon_threadsafe(replied.set)

        rlm = make_rlm(server, tmp_path, mcp_servers={"local": entry}, on_event=on_event)
        run = asyncio.ensure_future(rlm.arun("q", "ctx"))
        await replied.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(cancel_mid_run())
    assert ended(pids(starts)[0], timeout=0)  # closed before arun returned


def test_a_dropped_session_and_a_dropped_episode_leave_no_server_running(server, tmp_path):
    """Both are reaped by their finalizers without an event loop (CallTree.abandon)."""
    starts, entry = counted(tmp_path)
    use(server, code("print(pid())"), "FINAL(done)")
    session = make_rlm(server, tmp_path, mcp_servers={"local": entry}).session("ctx")
    assert session.ask("q").stop_reason == "final"
    [in_session] = pids(starts)
    del session  # never closed
    gc.collect()
    assert ended(in_session)

    env = RLMEnv("openai/sub-model", base_url=server.base_url, api_key="test-key-0123456789",
                 trace_dir=tmp_path, mcp_servers={"local": entry})  # fmt: skip
    episode = env.start_sync("q", "ctx")
    episode.step_sync(code("print(pid())"))
    [in_episode] = [p for p in pids(starts) if p != in_session]
    del episode  # aborted: dropped mid-episode
    gc.collect()
    assert ended(in_episode)
    env.close()
