"""`recursa acp`, driven by the agent-client-protocol package's own client over stdio."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
from pathlib import Path
from typing import Any

import pytest

acp = pytest.importorskip("acp", reason="agent-client-protocol is not installed (pip install recursa[acp])")

from acp import PROTOCOL_VERSION, RequestError, image_block, spawn_agent_process, text_block  # noqa: E402
from acp.schema import ClientCapabilities, EmbeddedResourceContentBlock, TextResourceContents  # noqa: E402

from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION  # noqa: E402
from recursa.testing.fake_server import FakeServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


class Recorder:
    """An ACP client that keeps every session update."""

    def __init__(self) -> None:
        self.updates: list[Any] = []

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update)

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise RequestError.method_not_found("session/request_permission")

    def on_connect(self, conn: Any) -> None:
        pass

    def texts(self, kind: str) -> list[str]:
        return [u.content.text for u in self.updates if u.session_update == kind]


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


def agent_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": "sk-test-key-never-echoed"}


async def test_a_prompt_is_an_rlm_run_over_the_attached_files(
    server: FakeServer, script, tmp_path: Path
) -> None:
    script.root(
        "policy", code("print(sorted(context))"), code("FINAL(context['file:///notes.txt'].split()[-1])")
    )
    client = Recorder()
    args = ["-m", "recursa.cli", "acp", "--model", "openai/policy", "--base-url", server.base_url,
            "--trace-dir", str(tmp_path)]  # fmt: skip
    async with spawn_agent_process(client, sys.executable, *args, env=agent_env()) as (conn, _proc):
        init = await conn.initialize(
            protocol_version=PROTOCOL_VERSION, client_capabilities=ClientCapabilities()
        )
        assert (
            init.agent_info.name == "recursa" and init.agent_capabilities.prompt_capabilities.embedded_context
        )
        session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
        notes = EmbeddedResourceContentBlock(
            type="resource",
            resource=TextResourceContents(uri="file:///notes.txt", text="the password is swordfish"),
        )
        picture = image_block(base64.b64encode(PNG).decode(), "image/png")  # an image of the context
        reply = await conn.prompt(
            session_id=session.session_id, prompt=[text_block("What is the password?"), notes, picture]
        )
        with pytest.raises(RequestError) as not_an_image:
            await conn.prompt(
                session_id=session.session_id, prompt=[text_block("q"), image_block("AAAA", "image/png")]
            )
    assert reply.stop_reason == "end_turn"
    run = reply.field_meta["recursa/run-v1"]
    assert run["stop_reason"] == "final" and run["iterations"] == 2 and run["trace_path"].endswith(".jsonl")
    assert client.texts("agent_message_chunk") == ["swordfish"]
    thoughts = "".join(client.texts("agent_thought_chunk"))
    assert "turn 1" in thoughts and "turn 2" in thoughts and "ran a REPL cell" in thoughts
    assert init.agent_capabilities.prompt_capabilities.image
    assert "prompt[1] is not a PNG, JPEG, GIF or WebP image" in str(not_an_image.value.data)
    assert "['file:///notes.txt', 'image-1.png']" in server.requests[1].messages[-1]["content"]
    first = server.requests[0]
    assert (
        "What is the password?" in first.messages[1]["content"] and "a dict" in first.messages[1]["content"]
    )


async def test_session_meta_points_the_model_elsewhere(server: FakeServer, script, tmp_path: Path) -> None:
    script.root("other", "FINAL(from the session's model)")
    client = Recorder()
    args = ["-m", "recursa.cli", "acp", "--model", "openai/unused", "--trace-dir", str(tmp_path)]
    meta = {
        "recursa/runtime-v1": {"model": "openai/other", "base_url": server.base_url, "api_key": "per-session"}
    }
    async with spawn_agent_process(client, sys.executable, *args, env=agent_env()) as (conn, _proc):
        await conn.initialize(protocol_version=PROTOCOL_VERSION)
        session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[], **meta)
        reply = await conn.prompt(session_id=session.session_id, prompt=[text_block("Summarise: a b c")])
        with pytest.raises(RequestError) as missing:
            await conn.prompt(session_id="nope", prompt=[text_block("x")])
        with pytest.raises(RequestError) as bad_model:
            await conn.new_session(
                cwd=str(tmp_path),
                mcp_servers=[],
                **{"recursa/runtime-v1": {"model": "bad/x", "api_key": "k"}},
            )
    assert "no session" in str(missing.value.data) and "unknown provider" in str(bad_model.value.data)
    assert reply.stop_reason == "end_turn" and client.texts("agent_message_chunk") == [
        "from the session's model"
    ]
    (request,) = server.requests
    assert request.model == "other" and request.headers["authorization"] == "<redacted>"
    assert PROMPT_AS_CONTEXT_QUESTION in request.messages[1]["content"]  # the prompt became the context
    assert "per-session" not in str(reply.field_meta)


async def test_a_client_chosen_base_url_never_gets_the_operators_key(tmp_path: Path) -> None:
    # The operator's key is OPENAI_API_KEY in the agent's environment. `foreign` is a server the
    # client names; `allowed` one the operator named with --allow-base-url.
    from recursa.testing.fake_state import key_digest

    operator_key, client_key = agent_env()["OPENAI_API_KEY"], "client-own-key-0123456789"
    where = "_meta.recursa/runtime-v1"

    def answer(model: str, messages: list[dict]) -> str:
        return "FINAL(ok)"

    with FakeServer(responder=answer) as foreign, FakeServer(responder=answer) as allowed:
        args = ["-m", "recursa.cli", "acp", "--model", "openai/policy", "--trace-dir", str(tmp_path),
                "--allow-base-url", allowed.base_url + "/"]  # fmt: skip

        async def open_session(conn: Any, **meta: Any) -> str:
            session = await conn.new_session(cwd=str(tmp_path), mcp_servers=[], **{where[6:]: meta})
            reply = await conn.prompt(session_id=session.session_id, prompt=[text_block("say ok")])
            assert reply.stop_reason == "end_turn"
            return session.session_id

        async with spawn_agent_process(Recorder(), sys.executable, *args, env=agent_env()) as (conn, _proc):
            await conn.initialize(protocol_version=PROTOCOL_VERSION)
            refusals = []
            for meta in (
                {"base_url": foreign.base_url},  # no key of its own: refused
                {"base_url": foreign.base_url, "api_key": ""},
                {"base_url": f"{allowed.base_url}@{foreign.base_url[7:]}"},  # not the allowed one
            ):
                with pytest.raises(RequestError) as refused:
                    await conn.new_session(cwd=str(tmp_path), mcp_servers=[], **{where[6:]: meta})
                refusals.append(str(refused.value.data))
            assert foreign.requests == [] and allowed.requests == []
            # With its own key the client may point anywhere: that key is what the server gets.
            await open_session(conn, base_url=foreign.base_url, api_key=client_key)
            # A URL the operator allowed gets the operator's key.
            await open_session(conn, base_url=allowed.base_url)
    assert f"{where}.base_url" in refusals[0] and f"{where}.api_key" in refusals[0]
    assert "--allow-base-url" in refusals[0]
    assert f"{where}.api_key must be a non-empty string" in refusals[1]
    assert f"{where}.base_url" in refusals[2]
    assert {r.key_digest for r in foreign.requests} == {key_digest(client_key)}
    assert {r.key_digest for r in allowed.requests} == {key_digest(operator_key)}
    assert all(operator_key not in text and client_key not in text for text in refusals)


async def test_cancel_mid_prompt_while_another_session_runs_and_bad_runtime_options(tmp_path: Path) -> None:
    from recursa.trace import load

    def answer(model: str, messages: list[dict]) -> str:
        if model == "slow":
            return code("import time\ntime.sleep(120)")
        return "FINAL(quick)"

    client = Recorder()
    where = "_meta.recursa/runtime-v1"
    with FakeServer(responder=answer) as server:
        args = ["-m", "recursa.cli", "acp", "--model", "openai/quick", "--base-url", server.base_url,
                "--trace-dir", str(tmp_path)]  # fmt: skip
        async with spawn_agent_process(client, sys.executable, *args, env=agent_env()) as (conn, _proc):
            await conn.initialize(protocol_version=PROTOCOL_VERSION)
            slow = await conn.new_session(
                cwd=str(tmp_path),
                mcp_servers=[],
                # Another model than the operator's: on the client's own key only.
                **{where[6:]: {"model": "openai/slow", "base_url": server.base_url, "api_key": "own-key"}},
            )
            quick = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
            running = asyncio.create_task(
                conn.prompt(session_id=slow.session_id, prompt=[text_block("wait")])
            )
            # The other session answers while the slow one's cell runs.
            reply = await conn.prompt(session_id=quick.session_id, prompt=[text_block("say quick")])
            assert reply.stop_reason == "end_turn" and not running.done()
            refusals = []
            for meta in (
                {"max_depth": "2"},
                {"budget": {"max_calls": 1}},
                {"budget": "small"},
                {"modle": "openai/x"},
                {"call_headers": "yes"},
                {"session_id": quick.session_id},  # someone else's session: not taken over
            ):
                with pytest.raises(RequestError) as refused:
                    await conn.new_session(cwd=str(tmp_path), mcp_servers=[], **{where[6:]: meta})
                refusals.append(str(refused.value.data))
            await conn.cancel(session_id=slow.session_id)
            cancelled = await running
            again = await conn.prompt(session_id=quick.session_id, prompt=[text_block("say quick")])
    assert cancelled.stop_reason == "cancelled" and again.stop_reason == "end_turn"
    assert f"{where}.max_depth='2': {where}.max_depth must be an int >= 0" in refusals[0]
    assert f"{where}.budget['max_calls'] is not an option" in refusals[1]
    assert f"{where}.budget is a str" in refusals[2]
    assert f"{where}.modle is not an option" in refusals[3] and "model" in refusals[3]
    assert f"{where}.call_headers='yes': {where}.call_headers must be True or False" in refusals[4]
    assert f"session_id {quick.session_id!r} is in use" in refusals[5]
    slow_runs = [p for p in _traces(tmp_path) if any(e.get("model") == "openai/slow" for e in load(p).events)]
    (trace,) = slow_runs
    ends = [e for e in load(trace).events if e["type"] == "run_end"]
    assert len(ends) == 1 and ends[0]["stop_reason"] == "cancelled"


async def test_a_session_never_widens_what_the_operator_pays_for(tmp_path: Path) -> None:
    # `recursa acp --max-usd 5` runs every session on the operator's key: a session may lower what
    # costs money or capacity, never raise it, and may not pick another model on that key.
    where = "_meta.recursa/runtime-v1"
    args = ["-m", "recursa.cli", "acp", "--model", "openai/gpt-5-mini", "--max-usd", "5",
            "--trace-dir", str(tmp_path)]  # fmt: skip
    widenings = (
        ({"budget": {"max_usd": 100000}}, f"{where}.budget.max_usd=100000", "at most 5.0"),
        ({"max_depth": 50}, f"{where}.max_depth=50", "at most 3"),
        ({"max_iterations": 1000}, f"{where}.max_iterations=1000", "at most 100"),
        ({"exec_timeout": 86400}, f"{where}.exec_timeout=86400", "at most 120.0"),
        ({"model": "openai/gpt-5"}, f"{where}.model='openai/gpt-5'", "'openai/gpt-5-mini'"),
        ({"sandbox": "inprocess"}, f"{where}.sandbox", "is not an option"),
    )
    async with spawn_agent_process(Recorder(), sys.executable, *args, env=agent_env()) as (conn, _proc):
        await conn.initialize(protocol_version=PROTOCOL_VERSION)
        refusals = []
        for meta, _, _ in widenings:
            with pytest.raises(RequestError) as refused:
                await conn.new_session(cwd=str(tmp_path), mcp_servers=[], **{where[6:]: meta})
            refusals.append(str(refused.value.data))
        # Lowering is the client's to do.
        tighter = {"budget": {"max_usd": 1}, "max_depth": 2, "max_iterations": 5}
        await conn.new_session(cwd=str(tmp_path), mcp_servers=[], **{where[6:]: tighter})
    for (_, named, limit), said in zip(widenings, refusals, strict=True):
        assert named in said and limit in said, said


async def test_sessions_are_bounded(tmp_path: Path) -> None:
    """Each open session may run a prompt at any time (a REPL, its children, model calls on the
    operator's key), and session/new had no bound: a client's thousand sessions were a thousand runs
    at once. At --max-sessions a new one is refused until one is closed."""
    args = ["-m", "recursa.cli", "acp", "--model", "openai/gpt-5-mini", "--max-sessions", "2",
            "--trace-dir", str(tmp_path)]  # fmt: skip
    async with spawn_agent_process(Recorder(), sys.executable, *args, env=agent_env()) as (conn, _proc):
        await conn.initialize(protocol_version=PROTOCOL_VERSION)
        first = await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
        await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
        with pytest.raises(RequestError) as refused:
            await conn.new_session(cwd=str(tmp_path), mcp_servers=[])
        assert "at most 2 sessions" in str(refused.value.data) and "--max-sessions" in str(refused.value.data)
        await conn.close_session(session_id=first.session_id)
        await conn.new_session(cwd=str(tmp_path), mcp_servers=[])


def _traces(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.jsonl"))


async def test_a_prompts_text_and_resources_are_held_to_the_context_cap(tmp_path: Path) -> None:
    """Embedded resources are the run's context: past max_context_bytes the prompt is refused
    before a context is built, as `recursa serve` refuses such a body."""
    from recursa.serve.acp_agent import RecursaAgent
    from recursa.serve.settings import ServeSettings

    agent = RecursaAgent(ServeSettings(model="scripted/gpt5-like", trace_dir=tmp_path, max_context_bytes=1_000))
    session = await agent.new_session(cwd=str(tmp_path), mcp_servers=[])
    files = [
        EmbeddedResourceContentBlock(type="resource", resource=TextResourceContents(uri=f"file:///{i}.txt", text="x" * 400))
        for i in range(3)
    ]
    with pytest.raises(RequestError) as refused:
        await agent.prompt(session_id=session.session_id, prompt=[text_block("What is in them?"), *files])
    assert "over 1,000 bytes" in str(refused.value.data) and "max_context_bytes" in str(refused.value.data)


async def test_sessions_opened_at_once_stay_within_the_cap(tmp_path: Path, monkeypatch) -> None:
    """The cap was checked before a session's MCP servers connected and the session counted only
    after: two session/new calls at once both passed it while they connected."""
    from acp.schema import McpServerStdio

    from recursa.serve import acp_agent
    from recursa.serve.acp_agent import RecursaAgent
    from recursa.serve.settings import ServeSettings

    closed: list[object] = []

    class Connected:
        async def aclose(self) -> None:
            closed.append(self)

    async def slow_connect(servers: Any) -> Connected:
        await asyncio.sleep(0.05)
        return Connected()

    monkeypatch.setattr(acp_agent.McpServers, "connect", slow_connect)
    agent = RecursaAgent(ServeSettings(model="scripted/gpt5-like", trace_dir=tmp_path, max_sessions=1))
    stdio = McpServerStdio(name="local", command=sys.executable, args=["-c", "pass"], env=[])
    opened = await asyncio.gather(
        *(agent.new_session(cwd=str(tmp_path), mcp_servers=[stdio]) for _ in range(2)), return_exceptions=True
    )
    refused = [o for o in opened if isinstance(o, RequestError)]
    assert len(refused) == 1 and "at most 1 sessions" in str(refused[0].data)
    assert len(closed) == 1  # the refused session's servers were closed, not left running
