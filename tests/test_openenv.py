"""recursa served as an OpenEnv environment, driven by OpenEnv's own client (`GenericEnvClient`,
over its WebSocket sessions) against the server on 127.0.0.1.

openenv-core's dependencies (gradio pins pillow < 13) do not install beside the dev environment's,
so .ci/run runs this file in a venv of its own, as it does tests/test_verifiers.py, with the ray
extra: the last test serves episodes whose REPLs run on a Ray cluster (simulated here).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip(
    "openenv.core", reason="openenv-core is not installed here (pip install recursa[openenv])"
)

from openenv.core.generic_client import GenericEnvClient

from recursa.asgi.background import BackgroundServer
from recursa.env import RLMEnv
from recursa.integrations.openenv import create_openenv_app
from recursa.tasks import generate

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "training" / "trl_openenv.py"
NO_RAY = "Ray is not installed here (recursa[ray]; .ci/run adds it to this venv)"


async def until(condition) -> None:
    """The server ends a session after the client has gone, on its own thread: wait for that, at
    most 10 s."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server did not close the session's episode within 10 s")


@pytest.fixture(scope="module")
def served():
    env = RLMEnv(max_depth=0, trace=False, max_live_repls=2, max_turns=3)
    with BackgroundServer(create_openenv_app(env, max_sessions=3, family="niah", size_chars=4_000)) as srv:
        yield env, srv.url


async def test_an_episode_over_a_given_context_then_a_generated_task(served):
    env, url = served
    async with GenericEnvClient(base_url=url) as client:
        first = await client.reset(
            question="What is the code?", context="the code is 4711", expected_answer="4711"
        )
        assert first.done is False and first.reward is None
        assert [m["role"] for m in first.observation["messages"]] == ["system", "user"]
        ran = await client.step({"reply": "```repl\nprint(context[-4:])\n```"})
        assert ran.done is False and ran.reward is None
        assert ran.observation["messages"][0]["content"].startswith("REPL output:\n4711")
        end = await client.step({"reply": "FINAL(4711)"})
        assert end.done is True and end.reward == 1.0 and end.observation["answer"] == "4711"
        state = await client.state()
        assert state["done"] is True and state["step_count"] == 2

        task = generate("niah", 4_000, seed=5)
        second = await client.reset(seed=5)  # the server's default family and size
        assert second.observation["task_id"] == task.id
        scored = await client.step({"message": {"content": f"FINAL({task.gold})", "output_tokens": 3}})
        assert scored.done is True and scored.reward == 1.0

        with pytest.raises(Exception, match="this episode is done"):
            await client.step({"reply": "FINAL(again)"})
    await until(lambda: env.live_repls == 0)  # the session's end closed its episode


async def test_limits_hold_across_sessions(served):
    env, url = served
    question = {"question": "q", "context": "ctx"}
    async with GenericEnvClient(base_url=url) as one, GenericEnvClient(base_url=url) as two:
        await one.reset(**question)
        await two.reset(**question)
        assert env.live_repls == 2
        async with GenericEnvClient(base_url=url) as three:
            # max_live_repls=2: a third episode is refused with RLMEnv's own message
            with pytest.raises(RuntimeError, match="max_live_repls"):
                await three.reset(**question)
            # max_sessions=3: a fourth session is refused by OpenEnv's server (its error message,
            # or the closed connection when the close arrives before the message is read)
            with pytest.raises(Exception, match=r"(?i)capacity|sessions|1000"):
                async with GenericEnvClient(base_url=url) as four:
                    await four.reset(**question)
            assert env.live_repls == 2
        with pytest.raises(RuntimeError, match="give the context as a str"):
            await one.reset(question="q", context={"a": 1})
        assert env.live_repls == 1  # the failed reset closed one's episode first
    await until(lambda: env.live_repls == 0)


def test_the_trl_example_plays_episodes_with_a_scripted_policy(served):
    _env, url = served
    spec = importlib.util.spec_from_file_location("trl_openenv", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def policy(messages):
        return "```repl\nprint(len(context))\n```" if len(messages) == 2 else "FINAL(nothing)"

    rollouts = example.play(url, ["What is the secret?"] * 2, policy, family="niah", seed=1)
    assert len(rollouts) == 2
    assert all(r["reward"] == 0.0 and r["turns"] == 2 for r in rollouts)
    assert rollouts[0]["messages"][-1] == {"role": "assistant", "content": "FINAL(nothing)"}


async def test_a_step_may_be_a_tool_call_under_the_tools_dialect():
    env = RLMEnv(max_depth=0, trace=False, max_turns=3, dialect="tools")
    with BackgroundServer(create_openenv_app(env, max_sessions=1)) as srv:
        async with GenericEnvClient(base_url=srv.url) as client:
            await client.reset(question="What is six times seven?", context="6 7")
            code = json.dumps({"code": "print(6 * 7)"})
            call = {
                "id": "call_1",
                "type": "function",
                "function": {"name": "call_python_repl", "arguments": code},
            }
            ran = await client.step({"message": {"role": "assistant", "content": None, "tool_calls": [call]}})
            answer = ran.observation["messages"][0]
            assert (
                answer["role"] == "tool" and answer["tool_call_id"] == "call_1" and "42" in answer["content"]
            )
            end = await client.step({"reply": "FINAL(42)"})
            assert end.done and end.observation["answer"] == "42"


async def test_web_pages_floods_and_larger_tasks_are_refused(served):
    """The server has no keys: a page in the trainer's browser opened a WebSocket session (no CORS
    applies to those) and drove episodes on the operator's sub-model; an HTTP body had no cap, no
    deadline and no JSON bounds; reset(size_chars=50_000_000) wrote its task on the event loop for
    seconds, past the operator's --size. Each is refused now, and the server goes on serving."""
    import httpx
    import websockets

    from recursa.integrations.openenv import MAX_MESSAGE_BYTES
    from recursa.serve.json_limits import MAX_VALUES

    env, url = served
    ws_url = url.replace("http://", "ws://") + "/ws"
    with pytest.raises(websockets.InvalidStatus, match="403"):
        async with websockets.connect(ws_url, origin="https://evil.example"):
            pass
    reset = {"question": "q", "context": "ctx"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        page = await http.post("/reset", json=reset, headers={"Origin": "https://evil.example"})
        assert page.status_code == 403 and "origin" in page.text
        reader, writer = await asyncio.open_connection(*http.base_url.netloc.decode().split(":"))
        writer.write(
            f"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {MAX_MESSAGE_BYTES + 1}\r\n\r\n".encode()
        )
        assert (await reader.readline()).startswith(b"HTTP/1.1 413")  # before a byte of the body
        writer.close()
        tiny = b'{"question": "q", "context": [' + b'"",' * MAX_VALUES + b'""]}'
        assert (await http.post("/reset", content=tiny)).status_code == 413
    async with websockets.connect(ws_url) as ws:  # a message of too many values: closed, too big
        await ws.send(
            '{"type": "reset", "data": {"question": "q", "context": [' + '"",' * MAX_VALUES + '""]}}'
        )
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1009
    async with GenericEnvClient(base_url=url) as client:
        with pytest.raises(Exception, match=r"size_chars=5000.*at most 4000"):
            await client.reset(family="niah", size_chars=5_000)
        smaller = await client.reset(family="niah", size_chars=3_000, seed=2)
        assert smaller.observation["task_id"] == generate("niah", 3_000, seed=2).id
    await until(lambda: env.live_repls == 0)


async def test_an_idle_session_is_closed_socket_and_slot():
    """openenv-core's idle reaper freed a session's slot and environment but left its socket open,
    serving on an environment already closed, and without a timeout nothing closed an idle session:
    one client could hold every slot for good. The server closes an idle session now, and by the time
    the client reads the close, the episode and the slot are free for the next client."""
    import websockets

    env = RLMEnv(max_depth=0, trace=False, max_live_repls=2, max_turns=3)
    app = create_openenv_app(env, max_sessions=1, session_idle_timeout_s=0.3)
    with BackgroundServer(app) as srv:
        async with websockets.connect(srv.url.replace("http://", "ws://") + "/ws") as idle:
            await idle.send(json.dumps({"type": "reset", "data": {"question": "q", "context": "ctx"}}))
            assert json.loads(await idle.recv())["type"] == "observation"
            assert env.live_repls == 1
            async with asyncio.timeout(30):  # the client sends nothing more: the server closes it
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await idle.recv()
        assert closed.value.rcvd.code == 4408 and "idle for 0.3 s" in closed.value.rcvd.reason
        assert env.live_repls == 0  # the close frame comes after the session let go of everything
        async with GenericEnvClient(base_url=srv.url) as client:  # max_sessions=1: the slot is free
            ran = await client.reset(question="q", context="ctx")
            assert ran.done is False


async def test_one_client_address_holds_its_share_of_sessions():
    """One client opening sessions took every slot of the server (max_sessions) for as long as it
    liked. An address holds its share now, sessions and HTTP resets in progress together, and the
    rest of the server stays for everyone else."""
    import httpx
    import websockets

    env = RLMEnv(max_depth=0, trace=False, max_live_repls=2, max_turns=3)
    with BackgroundServer(create_openenv_app(env, max_sessions=4, sessions_per_client=1)) as srv:
        ws_url = srv.url.replace("http://", "ws://") + "/ws"
        async with websockets.connect(ws_url) as first:
            async with websockets.connect(ws_url) as second, asyncio.timeout(30):
                with pytest.raises(websockets.ConnectionClosed) as refused:
                    await second.recv()
            assert refused.value.rcvd.code == 1013 and "--max-sessions-per-client" in refused.value.rcvd.reason
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                busy = await http.post("/reset", json={"question": "q", "context": "ctx"})
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "client_busy"
            await first.send(json.dumps({"type": "reset", "data": {"question": "q", "context": "ctx"}}))
            assert json.loads(await first.recv())["type"] == "observation"  # the first goes on
        async with GenericEnvClient(base_url=srv.url) as client:  # its end gave the share back
            await client.reset(question="q", context="ctx")
    await until(lambda: env.live_repls == 0)


async def test_episodes_on_a_ray_cluster_are_served_unchanged(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason=NO_RAY)
    from ray.cluster_utils import Cluster

    from recursa.sandbox.cluster import node_hosts, shutdown_hosts

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    env = RLMEnv("scripted/gpt5-like", sandbox="ray", sandbox_options={"address": cluster.address},
                 trace_dir=tmp_path, max_live_repls=2, max_turns=3)  # fmt: skip
    try:
        with BackgroundServer(create_openenv_app(env, max_sessions=2)) as srv:
            async with GenericEnvClient(base_url=srv.url) as client:
                await client.reset(question="What is the code?", context="the code is 4711",
                                   expected_answer="4711")  # fmt: skip
                # The cell runs on the cluster's node; its sub-call comes back to this server's RLMEnv.
                ran = await client.step({"reply": "```repl\nprint(context[-4:], llm_query('say hi'))\n```"})
                text = ran.observation["messages"][0]["content"]
                assert text.startswith("REPL output:\n4711 ") and "Error" not in text, text
                end = await client.step({"reply": "FINAL(4711)"})
                assert end.done is True and end.reward == 1.0
            await until(lambda: env.live_repls == 0)
        facts = [ray.get(host.describe.remote()) for _, host in node_hosts()]
        assert len(facts) == 1 and facts[0]["opened"] == 1 and facts[0]["live_repls"] == 0, facts
    finally:
        env.close()
        shutdown_hosts()
        ray.shutdown()
        cluster.shutdown()
