"""Sessions on `recursa serve`, through the official `openai` client: several requests over one
context and one REPL (`extra_body={"recursa": {"session": id}}`), context and settings checks,
one question at a time per session, expiry, the open-session cap, DELETE, and shutdown, each
checked against the REPL processes that are really alive."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx
import openai

from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from tests.serve_helpers import descendants, install_test_root, max_overlap, wait_until

KEY = "session-test-key-0123456789"
# This client's own secret: its sessions are private to it, so short ids are fine (test_session_owners).
CLIENT = {"X-Recursa-Client": "serve-session-tests-0123456789"}
ROOT = install_test_root()  # "RUN: code ||| code" runs one block per turn


class Spans:
    """Top-level runs' [start, end) times, from the server's event stream."""

    def __init__(self) -> None:
        self.open: dict[str, float] = {}
        self.done: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("depth", 0) != 0 or event["type"] not in ("run_start", "run_end"):
            return
        with self.lock:
            if event["type"] == "run_start":
                self.open[event["run_id"]] = time.perf_counter()
            else:
                self.done.append((self.open.pop(event["run_id"]), time.perf_counter()))


def _settings(tmp: Path, **kw: Any) -> ServeSettings:
    kw.setdefault("model", ROOT)
    kw.setdefault("sub_model", "scripted/oracle")
    kw.setdefault("trace_dir", tmp / "traces")
    return ServeSettings(**kw)


@pytest.fixture(scope="module")
def before() -> set[int]:
    """Processes from before this module (other modules' leftovers are not ours to judge)."""
    return repl_processes()


@pytest.fixture(autouse=True)
def every_repl_reaped(request, before) -> Iterator[None]:
    """Each test starts with no session open and leaves none: the module server's sessions are
    closed after each test, and every REPL process they started must then be gone."""
    yield
    if "srv" in request.fixturenames:
        server = request.getfixturevalue("srv")
        headers = {"Authorization": f"Bearer {KEY}", **CLIENT}
        for row in httpx.get(f"{server.url}/v1/recursa/sessions", headers=headers).json()["data"]:
            httpx.delete(f"{server.url}/v1/recursa/sessions/{row['id']}", headers=headers, timeout=20)
    wait_until(lambda: not (repl_processes() - before), what="every session's REPL to be reaped")


@pytest.fixture(scope="module")
def spans() -> Spans:
    return Spans()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, spans) -> Iterator[BackgroundServer]:
    settings = _settings(tmp_path_factory.mktemp("sessions"), api_key=KEY, on_event=spans)
    with BackgroundServer(create_app(settings)) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, default_headers=CLIENT)


def ask(client: openai.OpenAI, session: str, question: str, *, messages: list | None = None, **extra: Any):
    """One question on a session; returns (answer, the session header, the `recursa` summary)."""
    raw = client.chat.completions.with_raw_response.create(
        model="recursa",
        messages=[*(messages or []), {"role": "user", "content": question}],
        extra_body={"recursa": {"session": session, **extra}},
    )
    r = raw.parse()
    return r.choices[0].message.content, raw.headers.get("x-recursa-session"), r.model_extra["recursa"]


def repl_processes() -> set[int]:
    return descendants(os.getpid())


# -- one session, several questions -------------------------------------------------------------


def test_three_requests_share_the_repl_and_the_context_is_sent_once(client):
    answer, header, summary = ask(
        client, "three", "RUN: n = len(context)\nFINAL('stored')", context="x" * 1234
    )
    assert (answer, header, summary["session"]) == ("stored", "three", "three")
    answer, _, second = ask(client, "three", "RUN: FINAL(f'n={n} len={len(context)}')")
    assert answer == "n=1234 len=1234"  # a variable from request 1; the context was not re-sent
    answer, _, third = ask(client, "three", "RUN: FINAL(' / '.join(h['answer'] for h in history))")
    assert answer == "stored / n=1234 len=1234"
    assert summary["trace"] == second["trace"] == third["trace"]  # one session, one trace
    assert len({summary["run_id"], second["run_id"], third["run_id"]}) == 3


def test_a_chat_client_resending_its_conversation_is_accepted(client):
    system = {"role": "system", "content": "The password is swordfish."}
    a1, _, _ = ask(client, "replay", "RUN: FINAL(context.split()[-1])", messages=[system])
    assert a1 == "swordfish."
    conversation = [system, {"role": "user", "content": "RUN: FINAL(context.split()[-1])"}]
    conversation.append({"role": "assistant", "content": a1})
    a2, _, _ = ask(client, "replay", "RUN: FINAL(str(len(history)))", messages=conversation)
    assert a2 == "1"
    # The same context as an explicit option is the same context too.
    a3, _, _ = ask(client, "replay", "RUN: FINAL('ok')", context="The password is swordfish.")
    assert a3 == "ok"
    # A system message the session was not opened with is new context, not conversation.
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "replay", "RUN: FINAL('no')", messages=[{"role": "system", "content": "new document"}])
    assert err.value.code == "session_context_mismatch"


def test_a_different_context_or_different_limits_is_a_400(client):
    ask(client, "strict", "RUN: FINAL('opened')", context="first context", max_iterations=5)
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "strict", "RUN: FINAL('no')", context="another context")
    assert err.value.code == "session_context_mismatch" and "open a new session" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "strict", "RUN: FINAL('no')", max_iterations=6)
    assert err.value.code == "session_settings_mismatch"
    # None of that touched the session: it still answers, with its first context.
    assert ask(client, "strict", "RUN: FINAL(context)", max_iterations=5)[0] == "first context"
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "bad id!", "q", context="c")
    assert err.value.param == "recursa.session"


def test_streaming_on_a_session(client):
    ask(client, "stream", "RUN: word = 'kept'\nFINAL('set')", context="ctx")
    stream = client.chat.completions.create(
        model="recursa",
        stream=True,
        messages=[{"role": "user", "content": "RUN: print(word) ||| FINAL(word + '!')"}],
        extra_body={"recursa": {"session": "stream"}},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert content == "kept!" and "kept" in reasoning
    assert chunks[-1].model_extra["recursa"]["session"] == "stream"


def test_requests_on_one_session_run_one_at_a_time(client, spans):
    ask(client, "serial", "RUN: FINAL('open')", context="ctx")
    with spans.lock:
        spans.done.clear()
    sent: list[float] = []
    answers: list[str] = []

    def one(i: int) -> None:
        sent.append(time.perf_counter())
        answers.append(ask(client, "serial", f"RUN: import time\ntime.sleep(0.5)\nFINAL('{i}')")[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(answers) == ["0", "1", "2"]
    runs = sorted(spans.done)
    assert len(runs) == 3
    assert max(sent) < runs[0][1]  # all three were in flight while the first one ran ...
    assert max_overlap(runs) == 1  # ... and still ran one after another


def test_a_client_that_leaves_cancels_its_question_and_the_session_goes_on(srv, client):
    ask(client, "leaver", "RUN: x = 5\nFINAL('set')", context="ctx")
    body = {
        "model": "recursa",
        "messages": [{"role": "user", "content": "RUN: import time\ny = 1\ntime.sleep(20)\nFINAL('late')"}],
        "recursa": {"session": "leaver"},
    }
    headers = {"Authorization": f"Bearer {KEY}", **CLIENT}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers, timeout=1.0)
    started = time.perf_counter()
    answer = ask(client, "leaver", "RUN: FINAL(f'x={x} y={y} asked={len(history)}')")[0]
    assert time.perf_counter() - started < 10  # the 20 s cell was interrupted, not waited for
    assert answer == "x=5 y=1 asked=1"  # same REPL; the cancelled question is not in `history`


# -- closing ------------------------------------------------------------------------------------


def test_delete_closes_a_session_even_in_the_middle_of_a_question(srv, client):
    baseline = repl_processes()
    ask(client, "doomed", "RUN: FINAL('open')", context="ctx")
    repl = repl_processes() - baseline
    assert repl, "the session's REPL is not running"
    failure: list[BaseException] = []

    def long_question() -> None:
        try:
            ask(client, "doomed", "RUN: import time\ntime.sleep(30)\nFINAL('late')")
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=long_question)
    thread.start()
    sessions = srv.app.state.service.sessions
    (doomed,) = [h for h in sessions.open.values() if h.id == "doomed"]
    wait_until(lambda: doomed.current is not None, what="the question to start")
    headers = {"Authorization": f"Bearer {KEY}", **CLIENT}
    assert httpx.delete(f"{srv.url}/v1/recursa/sessions/doomed", headers=CLIENT).status_code == 401
    r = httpx.delete(f"{srv.url}/v1/recursa/sessions/doomed", headers=headers, timeout=20)
    assert r.status_code == 200 and r.json()["deleted"] is True
    thread.join(20)
    assert isinstance(failure[0], openai.APIStatusError) and failure[0].status_code == 409
    assert failure[0].code == "session_closed"
    wait_until(lambda: not (repl_processes() & repl), timeout_s=5, what="the closed session's REPL to go")
    listed = httpx.get(f"{srv.url}/v1/recursa/sessions", headers=headers).json()["data"]
    assert "doomed" not in {s["id"] for s in listed}
    assert httpx.delete(f"{srv.url}/v1/recursa/sessions/doomed", headers=headers).status_code == 404
    # The id is free again: a new session with a fresh REPL.
    assert ask(client, "doomed", "RUN: FINAL(str('history' in globals()))", context="new")[0] == "False"


def test_an_idle_session_expires_and_its_repl_is_reaped(tmp_path):
    baseline = repl_processes()
    with BackgroundServer(create_app(_settings(tmp_path, session_ttl_s=0.3))) as server:
        c = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, default_headers=CLIENT
        )
        ask(c, "ttl", "RUN: kept = 1\nFINAL('open')", context="ctx")
        repl = repl_processes() - baseline
        assert repl, "the session's REPL is not running"
        wait_until(lambda: not (repl_processes() & repl), timeout_s=10, what="the idle session's REPL to go")
        assert httpx.get(server.url + "/health").json()["sessions"] == 0
        # The same id now opens a new session: nothing of the old REPL is left.
        assert ask(c, "ttl", "RUN: FINAL(str('kept' in globals()))", context="ctx")[0] == "False"


def test_the_cap_answers_429_and_shutdown_reaps_every_session(tmp_path):
    baseline = repl_processes()
    with BackgroundServer(
        create_app(_settings(tmp_path, max_sessions=2, max_sessions_per_caller=2))
    ) as server:
        c = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, default_headers=CLIENT
        )
        ask(c, "a", "RUN: FINAL('a')", context="ctx a")
        ask(c, "b", "RUN: FINAL('b')", context="ctx b")
        with pytest.raises(openai.RateLimitError) as err:
            ask(c, "c", "RUN: FINAL('c')", context="ctx c")
        assert err.value.code == "too_many_sessions" and "DELETE /v1/recursa/sessions" in err.value.message
        # Requests without a session are not limited by it, and open sessions still answer.
        plain = c.chat.completions.create(
            model="recursa",
            messages=[{"role": "user", "content": "doc"}, {"role": "user", "content": "RUN: FINAL('p')"}],
        )
        assert plain.choices[0].message.content == "p"
        assert ask(c, "a", "RUN: FINAL('again')")[0] == "again"
        assert httpx.delete(server.url + "/v1/recursa/sessions/b", headers=CLIENT).status_code == 200
        assert ask(c, "c", "RUN: FINAL('c')", context="ctx c")[0] == "c"
        repl = repl_processes() - baseline
        assert repl
    # Leaving the block stops the server, which closes its two open sessions.
    wait_until(lambda: not (repl_processes() & repl), what="the sessions' REPLs to be reaped at shutdown")


def test_sessions_can_be_turned_off(tmp_path):
    with BackgroundServer(create_app(_settings(tmp_path, max_sessions=0))) as server:
        c = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, default_headers=CLIENT
        )
        with pytest.raises(openai.PermissionDeniedError) as err:
            ask(c, "off", "RUN: FINAL('x')", context="ctx")
        assert err.value.code == "sessions_disabled"
