"""Sessions belong to the caller that opened them: another caller cannot list, join or close them
(they do not exist for it), under per-client keys, under one shared key with client secrets, and
over MCP. Under a shared key the ids are the only guard, so the server issues unguessable ones and
lists none."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx

from recursa.asgi.background import BackgroundServer
from recursa.errors import ConfigError
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from tests.helpers import serve_process
from tests.serve_helpers import install_test_root

ROOT = install_test_root()  # "RUN: code" runs the code
ALICE, BOB, SHARED = "alice-key-0123456789", "bob-key-0123456789", "shared-key-0123456789"
PRIVATE = "ALICE-PRIVATE-CONTEXT"


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    settings = ServeSettings(
        model=ROOT,
        sub_model="scripted/oracle",
        trace_dir=tmp_path_factory.mktemp("owners"),
        api_key=SHARED,
        api_keys={"alice": ALICE, "bob": BOB},
    )
    with BackgroundServer(create_app(settings)) as server:
        yield server


def _headers(key: str, client: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"X-Recursa-Client": client} if client else {})}


def ask(srv, headers: dict[str, str], session: str, code: str, **extra) -> httpx.Response:
    body = {
        "model": "recursa",
        "messages": [{"role": "user", "content": f"RUN: {code}"}],
        "recursa": {"session": session, **extra},
    }
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def answer(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def listed(srv, headers: dict[str, str]) -> list[dict]:
    return httpx.get(srv.url + "/v1/recursa/sessions", headers=headers).json()["data"]


def close(srv, headers: dict[str, str], session: str) -> int:
    return httpx.delete(f"{srv.url}/v1/recursa/sessions/{session}", headers=headers, timeout=20).status_code


def test_per_client_keys_keep_sessions_apart(srv) -> None:
    alice, bob = _headers(ALICE), _headers(BOB)
    assert answer(ask(srv, alice, "notes", "secret = context\nFINAL('ok')", context=PRIVATE)) == "ok"
    assert [s["id"] for s in listed(srv, alice)] == ["notes"]
    assert listed(srv, bob) == []  # not even its id
    assert close(srv, bob, "notes") == 404
    # Bob naming Alice's id gets a session of his own: nothing of hers is in it.
    got = answer(
        ask(srv, bob, "notes", "FINAL(str(globals().get('secret')) + '|' + context)", context="bob's")
    )
    assert PRIVATE not in got and got == "None|bob's"
    assert [s["id"] for s in listed(srv, bob)] == ["notes"]
    # Alice's session is untouched and still hers.
    assert answer(ask(srv, alice, "notes", "FINAL(secret)")) == PRIVATE
    assert close(srv, alice, "notes") == 200 and close(srv, bob, "notes") == 200
    assert listed(srv, alice) == [] and listed(srv, bob) == []


def test_a_shared_key_gets_unguessable_ids_and_lists_none(srv) -> None:
    shared = _headers(SHARED)
    reply = ask(srv, shared, "new", "FINAL('opened')", context=PRIVATE)
    sid = reply.headers["x-recursa-session"]
    assert answer(reply) == "opened" and reply.json()["recursa"]["session"] == sid
    assert len(sid) >= 32 and sid != "new"
    assert [s["id"] for s in listed(srv, shared)] == [None]  # another holder of the key sees no id
    assert answer(ask(srv, shared, sid, "FINAL(context)")) == PRIVATE  # the id is the capability
    short = ask(srv, shared, "s1", "FINAL('x')", context="c")
    assert short.status_code == 400 and short.json()["error"]["code"] == "session_id_too_short"
    # Other keys never see it.
    assert listed(srv, _headers(ALICE)) == [] and close(srv, _headers(ALICE), sid) == 404
    assert close(srv, shared, sid) == 200


def test_client_secrets_separate_holders_of_one_key(srv) -> None:
    one, two = _headers(SHARED, "first-client-secret-000"), _headers(SHARED, "second-client-secret-00")
    assert answer(ask(srv, one, "mine", "FINAL('ok')", context=PRIVATE)) == "ok"
    assert [s["id"] for s in listed(srv, one)] == ["mine"]  # one client's own: ids listed
    assert listed(srv, two) == [] and listed(srv, _headers(SHARED)) == []
    assert close(srv, two, "mine") == 404
    assert PRIVATE not in answer(ask(srv, two, "mine", "FINAL(context)", context="two's"))
    assert close(srv, one, "mine") == 200 and close(srv, two, "mine") == 200
    weak = httpx.get(srv.url + "/v1/recursa/sessions", headers=_headers(SHARED, "short"))
    assert weak.status_code == 400 and weak.json()["error"]["code"] == "invalid_client_secret"
    assert httpx.get(srv.url + "/v1/recursa/sessions", headers=_headers("wrong-key")).status_code == 401


@contextlib.asynccontextmanager
async def _mcp_callers(settings: ServeSettings) -> AsyncIterator[tuple[Any, Any]]:
    """Alice's and Bob's MCP clients, each with their own key, on an MCP server for `settings`."""
    pytest.importorskip("mcp")
    from mcp import Client
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    from recursa.serve.mcp_server import build_mcp_server, with_bearer_key

    server = build_mcp_server(settings)
    app = with_bearer_key(server.streamable_http_app(streamable_http_path="/mcp"), [ALICE, BOB])

    def client(url: str, key: str) -> Client:
        http = create_mcp_http_client(headers=_headers(key))
        return Client(streamable_http_client(url, http_client=http), read_timeout_seconds=60)

    with BackgroundServer(app) as http:
        url = http.url + "/mcp"
        async with client(url, ALICE) as alice, client(url, BOB) as bob:
            yield alice, bob


async def test_mcp_sessions_belong_to_their_caller(tmp_path: Path) -> None:
    settings = ServeSettings(
        model=ROOT, sub_model="scripted/oracle", trace_dir=tmp_path, api_keys={"alice": ALICE, "bob": BOB}
    )
    async with _mcp_callers(settings) as (alice, bob):
        opened = await alice.call_tool("recursa_session_open", {"context_text": PRIVATE})
        sid = opened.structured_content["session"]
        assert len(sid) >= 32
        theirs = await bob.call_tool(
            "recursa_session_ask", {"session": sid, "question": "RUN: FINAL(context)"}
        )
        assert theirs.is_error and "no open session" in theirs.content[0].text
        assert PRIVATE not in theirs.content[0].text
        closed = await bob.call_tool("recursa_session_close", {"session": sid})
        assert closed.structured_content["result"] is False
        mine = await alice.call_tool(
            "recursa_session_ask", {"session": sid, "question": "RUN: FINAL(context)"}
        )
        assert mine.structured_content["answer"] == PRIVATE
        closed = await alice.call_tool("recursa_session_close", {"session": sid})
        assert closed.structured_content["result"] is True


def test_recursa_serve_reads_per_client_keys_from_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# clients\nalice {ALICE}\nbob {BOB}\n")
    with serve_process(tmp_path, "--api-keys-file", str(keys)) as base:
        body = {
            "model": "recursa",
            "messages": [{"role": "user", "content": "What is it?"}],
            "recursa": {"session": "report", "context": PRIVATE, "max_iterations": 1},
        }
        r = httpx.post(base + "/v1/chat/completions", json=body, headers=_headers(ALICE), timeout=60)
        assert r.status_code == 200, r.text
        sessions = base + "/v1/recursa/sessions"
        assert [s["id"] for s in httpx.get(sessions, headers=_headers(ALICE)).json()["data"]] == ["report"]
        assert httpx.get(sessions, headers=_headers(BOB)).json()["data"] == []
        assert httpx.delete(sessions + "/report", headers=_headers(BOB)).status_code == 404
        assert httpx.get(sessions, headers=_headers("not-a-key")).status_code == 401
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    cmd = [sys.executable, "-m", "recursa.cli", "serve", "--model", "scripted/gpt5-like"]
    bad = tmp_path / "bad-keys"
    bad.write_text("alice\n")
    done = subprocess.run(
        [*cmd, "--api-keys-file", str(bad)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode != 0 and "line 1" in done.stderr and "Traceback" not in done.stderr


def test_one_caller_cannot_take_every_session(tmp_path: Path) -> None:
    settings = ServeSettings(
        model=ROOT,
        sub_model="scripted/oracle",
        trace_dir=tmp_path,
        api_key=SHARED,
        api_keys={"alice": ALICE, "bob": BOB},
        max_sessions=5,
        max_sessions_per_caller=2,
    )
    alice = _headers(ALICE)
    with BackgroundServer(create_app(settings)) as srv:
        for sid in ("a1", "a2"):
            assert answer(ask(srv, alice, sid, "FINAL('ok')", context="c")) == "ok"
        full = ask(srv, alice, "a3", "FINAL('ok')", context="c")
        assert full.status_code == 429, full.text
        error = full.json()["error"]
        assert error["code"] == "too_many_sessions_per_caller" and error["param"] == "recursa.session"
        assert "--max-sessions-per-caller 2" in error["message"] and "2 open sessions" in error["message"]
        # A client with a key of its own does not get more by sending client secrets.
        minted = ask(srv, _headers(ALICE, "alice-minted-secret-01"), "a3", "FINAL('ok')", context="c")
        assert minted.status_code == 429 and minted.json()["error"]["code"] == "too_many_sessions_per_caller"
        # Nor does a holder of the shared key: its secrets keep sessions apart, but the shared key is
        # one caller with one share however it labels itself (a fresh secret per request took every
        # session, and keyed callers then got 429 until the sessions expired).
        for secret in ("first-client-secret-000", "second-client-secret-00"):
            assert answer(ask(srv, _headers(SHARED, secret), "s-one", "FINAL('ok')", context="c")) == "ok"
        third = ask(srv, _headers(SHARED, "third-client-secret-000"), "s-one", "FINAL('ok')", context="c")
        assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_sessions_per_caller"
        # Everyone else still gets sessions, up to the server's cap.
        assert answer(ask(srv, _headers(BOB), "b1", "FINAL('ok')", context="c")) == "ok"
        over = ask(srv, _headers(BOB), "b2", "FINAL('ok')", context="c")
        assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_sessions", over.text
        # A session Alice closes is room for her next one; her open ones still answer.
        assert answer(ask(srv, alice, "a1", "FINAL('again')")) == "again"
        assert close(srv, alice, "a2") == 200
        assert answer(ask(srv, alice, "a3", "FINAL('ok')", context="c")) == "ok"


def test_the_per_caller_default_is_a_quarter_of_the_server_cap() -> None:
    keyed = {"api_keys": {"alice": ALICE}}
    assert ServeSettings(model=ROOT, max_sessions=32, **keyed).sessions_per_caller == 8
    assert ServeSettings(model=ROOT, max_sessions=2, **keyed).sessions_per_caller == 1
    assert ServeSettings(model=ROOT, max_sessions_per_caller=5).sessions_per_caller == 5
    shares = ServeSettings(model=ROOT, max_runs=8, max_waiting=40, **keyed)
    assert (shares.runs_per_caller, shares.waiting_per_caller) == (2, 10)
    # Where every request is the one caller (no key, or only the shared one), its share is the server.
    alone = ServeSettings(model=ROOT, api_key=SHARED, max_sessions=32, max_runs=8, max_waiting=0)
    assert (alone.sessions_per_caller, alone.runs_per_caller, alone.waiting_per_caller) == (32, 8, 0)
    with pytest.raises(ConfigError, match="max_sessions_per_caller must be an int >= 1"):
        ServeSettings(model=ROOT, max_sessions_per_caller=0)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    cmd = [sys.executable, "-m", "recursa.cli", "mcp", "--model", "scripted/gpt5-like"]
    done = subprocess.run(
        [*cmd, "--max-sessions-per-caller", "0"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2 and "--max-sessions-per-caller must be an int >= 1" in done.stderr
    assert "Traceback" not in done.stderr


async def test_mcp_sessions_count_against_their_callers_share(tmp_path: Path) -> None:
    settings = ServeSettings(
        model=ROOT,
        sub_model="scripted/oracle",
        trace_dir=tmp_path,
        api_keys={"alice": ALICE, "bob": BOB},
        max_sessions=4,
        max_sessions_per_caller=1,
    )
    async with _mcp_callers(settings) as (alice, bob):
        first = await alice.call_tool("recursa_session_open", {"context_text": "c"})
        assert not first.is_error
        second = await alice.call_tool("recursa_session_open", {"context_text": "c"})
        assert second.is_error and "--max-sessions-per-caller 1" in second.content[0].text
        theirs = await bob.call_tool("recursa_session_open", {"context_text": "c"})
        assert not theirs.is_error
        for who, opened in ((alice, first), (bob, theirs)):
            sid = opened.structured_content["session"]
            assert (await who.call_tool("recursa_session_close", {"session": sid})).structured_content[
                "result"
            ]


def test_one_caller_cannot_push_others_responses_out_of_the_chain() -> None:
    from recursa.serve.responses_api import ResponseChain

    chain = ResponseChain(limit=8)  # a share of 2 per caller
    chain.record("key:bob", "resp-bob", "bob-session")
    for i in range(50):  # Alice floods, also under minted client secrets of her key
        chain.record(f"key:alice/client:{i % 3}", f"resp-{i}", "alice-session")
    assert chain.session_of("key:bob", "resp-bob") == "bob-session"
    assert chain.session_of("key:alice/client:1", "resp-49") == "alice-session"  # her newest stay
    assert chain.session_of("key:alice/client:0", "resp-0") is None  # her oldest went
    assert len(chain._sessions) <= 3
