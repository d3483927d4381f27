"""`recursa serve`: the OpenAI-compatible server, driven by the official `openai` client (JSON and
SSE streaming, a 50 MB context), plus request parsing, auth, bad input, concurrency, and
cancellation with sandbox reaping when the client disconnects."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx
import openai

from recursa import Budget
from recursa.asgi.background import BackgroundServer
from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION
from recursa.serve.openai_server import create_app
from recursa.serve.request import SETTING_KEYS, ApiError, parse_chat_request
from recursa.serve.settings import ServeSettings
from recursa.trace import load
from tests.serve_helpers import descendants, install_test_root, max_overlap, wait_until

KEY = "serve-test-key-0123456789"
ROOT = install_test_root()


def _settings(tmp: Path, **kw) -> ServeSettings:
    kw.setdefault("model", ROOT)
    kw.setdefault("sub_model", "scripted/oracle")
    kw.setdefault("trace_dir", tmp / "traces")
    return ServeSettings(**kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("allowed")
    (root / "notes.txt").write_text("alpha beta gamma\n" * 100 + "THE END")
    (root / "docs").mkdir()
    (root / "docs" / "a.md").write_text("first doc")
    (root / "docs" / "b.md").write_text("second doc")
    return root


@pytest.fixture(scope="module")
def srv(tmp_path_factory, files) -> Iterator[BackgroundServer]:
    tmp = tmp_path_factory.mktemp("serve")
    settings = _settings(
        tmp,
        api_key=KEY,
        context_roots=(files,),
        allow_context_urls=True,
        allow_private_urls=True,  # the test's web server is on 127.0.0.1
        budget=Budget(max_llm_calls=50),
    )
    with BackgroundServer(create_app(settings)) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def _described(text: str) -> dict:
    return json.loads(text)


def _service(srv: BackgroundServer):
    return srv.app.state.service


# -- the openai client, JSON and streaming ------------------------------------------------------


def test_earlier_messages_are_the_context_and_usage_is_the_whole_tree(client):
    r = client.chat.completions.create(
        model="recursa",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Alice likes tea."},
            {"role": "user", "content": "What does Alice like?"},
        ],
    )
    got = _described(r.choices[0].message.content)
    assert got["question"] == "What does Alice like?"
    assert got["type"] == "list" and got["len"] == 2
    assert got["head"] == "[system]\nBe brief." and got["tail"].endswith("Alice likes tea.")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    summary = r.model_extra["recursa"]
    assert summary["stop_reason"] == "final" and summary["llm_calls"] == 1 and summary["iterations"] == 1
    assert r.usage.model_extra["cost"] == 0.0  # scripted models are free; the field is always there


def test_streaming_sends_repl_steps_as_reasoning_then_the_answer_then_usage(client):
    stream = client.chat.completions.create(
        model="recursa",
        stream=True,
        stream_options={"include_usage": True},
        messages=[
            {"role": "user", "content": "some context text"},
            {"role": "user", "content": "RUN: x = 6 * 7\nprint('value', x) ||| FINAL(x)"},
        ],
    )
    reasoning, content, chunks = "", "", list(stream)
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert "turn 1" in reasoning and "turn 2" in reasoning
    assert "print('value', x)" in reasoning and "value 42" in reasoning  # the code, then its output
    assert content == "42"
    finish, last = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason == "stop"
    assert finish.model_extra["recursa"]["iterations"] == 2
    assert last.choices == [] and last.usage is not None and last.usage.prompt_tokens > 0
    # the reasoning arrived in several chunks, before the answer
    reasoning_chunks = [
        c for c in chunks if c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning_content")
    ]
    assert len(reasoning_chunks) >= 2
    assert chunks.index(reasoning_chunks[-1]) < next(
        i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content
    )


def test_a_50mb_context_through_the_openai_client_streaming(client):
    size = 50_000_000
    body = "HEAD-MARK " + "lorem ipsum dolor sit amet " * (size // 27 + 1) + " TAIL-MARK"
    assert len(body) >= size
    stream = client.chat.completions.create(
        model="recursa",
        stream=True,
        messages=[
            {"role": "user", "content": body},
            {"role": "user", "content": "RUN: FINAL(f'{len(context)}|{context[:9]}|{context[-9:]}')"},
        ],
    )
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == f"{len(body)}|HEAD-MARK|TAIL-MARK"


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_many_concurrent_requests_run_at_once(tmp_path):
    settings = _settings(tmp_path, model=ROOT + ":latency=0.3")
    with BackgroundServer(create_app(settings)) as server:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        n = 24

        async def one(i: int) -> str:
            r = await aclient.chat.completions.create(
                model="recursa",
                messages=[
                    {"role": "user", "content": f"doc {i}"},
                    {"role": "user", "content": f"RUN: FINAL('{i}')"},
                ],
            )
            return r.choices[0].message.content

        answers = await asyncio.gather(*(one(i) for i in range(n)))
        await aclient.close()
    assert answers == [str(i) for i in range(n)]  # no cross-talk between runs
    spans = []
    for path in (tmp_path / "traces").glob("*.jsonl"):
        root = load(path).root
        spans.append((root.start["ts"], root.end["ts"]))
    assert len(spans) == n
    assert max_overlap(spans) >= n // 2


async def test_max_runs_queues_requests_instead_of_overlapping(tmp_path):
    settings = _settings(tmp_path, model=ROOT + ":latency=0.1", max_runs=1)
    with BackgroundServer(create_app(settings)) as server:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "doc"}, {"role": "user", "content": "RUN: FINAL(1)"}]
        await asyncio.gather(
            *(aclient.chat.completions.create(model="recursa", messages=msgs) for _ in range(3))
        )
        await aclient.close()
    spans = [
        (load(p).root.start["ts"], load(p).root.end["ts"]) for p in (tmp_path / "traces").glob("*.jsonl")
    ]
    assert len(spans) == 3 and max_overlap(spans) == 1


# -- messages -> question + context -------------------------------------------------------------


def _parse(messages, **extra):
    body = {"model": "recursa", "messages": messages}
    if extra:
        body["recursa"] = extra
    return parse_chat_request(body, ServeSettings(model=ROOT, max_question_chars=1_000))


def test_a_lone_user_message_is_the_context_and_the_rlm_carries_it_out():
    req = _parse([{"role": "user", "content": "Summarise this: ..."}])
    assert req.completion_mode and req.question == PROMPT_AS_CONTEXT_QUESTION
    assert req.context == "Summarise this: ..."


def test_a_question_longer_than_the_limit_moves_into_the_context():
    long = "x" * 2_000
    req = _parse([{"role": "user", "content": "earlier"}, {"role": "user", "content": long}])
    assert req.completion_mode and req.context == ["[user]\nearlier", f"[user]\n{long}"]


def test_one_earlier_message_is_the_context_as_is_and_file_parts_join_it():
    assert _parse([{"role": "user", "content": "doc"}, {"role": "user", "content": "q?"}]).context == "doc"
    data = base64.b64encode(b"file text").decode()
    req = _parse(
        [
            {"role": "user", "content": "doc"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "q?"},
                    {
                        "type": "file",
                        "file": {"file_data": f"data:text/plain;base64,{data}", "filename": "a.txt"},
                    },
                ],
            },
        ]
    )
    assert req.question == "q?" and req.context == ["[user]\ndoc", "[file: a.txt]\nfile text"]


def test_an_explicit_question_makes_every_message_context():
    req = _parse([{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}], question="Q")
    assert req.question == "Q" and req.context == ["[user]\none", "[assistant]\ntwo"]


def test_per_request_budget_can_only_tighten_the_servers():
    settings = ServeSettings(model=ROOT, budget=Budget(max_llm_calls=50, max_seconds=60))
    body = {"model": "recursa", "messages": [{"role": "user", "content": "q"}]}
    req = parse_chat_request({**body, "recursa": {"max_llm_calls": 20, "budget": {"max_seconds": 5}}}, settings)
    assert req.settings["budget"].max_llm_calls == 20 and req.settings["budget"].max_seconds == 5
    # Asking for more than the operator allows is refused, naming the option and the limit.
    with pytest.raises(ApiError) as wider:
        parse_chat_request({**body, "recursa": {"max_llm_calls": 1_000}}, settings)
    assert wider.value.param == "recursa.max_llm_calls" and "at most 50" in wider.value.message
    req = parse_chat_request({**body, "recursa": {"max_usd": 0.5, "max_depth": 2}}, settings)
    assert req.settings["budget"].max_usd == 0.5 and req.settings["max_depth"] == 2


@pytest.mark.parametrize(
    ("messages", "extra", "status", "fragment"),
    [
        ([], {}, 400, "non-empty list"),
        ([{"role": "wizard", "content": "x"}], {}, 400, "role must be one of"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            400,
            "image URLs must be https:// URLs",
        ),
        ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "f1"}}]}], {}, 400, "file_id"),
        ([{"role": "user", "content": [{"type": "file", "file": {"file_data": "!!"}}]}], {}, 400, "base64"),
        ([{"role": "assistant", "content": "x"}], {}, 400, "no user message"),
        ([{"role": "user", "content": "q"}], {"colour": 1}, 400, "unknown recursa option"),
        (
            [{"role": "user", "content": "q"}],
            {"max_depth": 9},
            400,
            "recursa.max_depth=9 is more than the operator allows (at most 3)",
        ),
        ([{"role": "user", "content": "q"}], {"max_depth": -1}, 400, "recursa.max_depth must be an int >= 0"),
        ([{"role": "user", "content": "q"}], {"max_iterations": True}, 400, "recursa.max_iterations must be an int"),
        ([{"role": "user", "content": "q"}], {"budget": {"max_usd": 0.1}, "max_usd": 0.2}, 200, ""),
        ([{"role": "user", "content": "q"}], {"max_usd": -1}, 400, "non-negative"),
        ([{"role": "user", "content": "q"}], {"max_tokens": 0}, 400, "recursa.max_tokens=0: a cap of 0"),
        (
            [{"role": "user", "content": "q"}],
            {"max_tokens": 0},
            400,
            "; use a positive number such as recursa.max_tokens=200000, or leave recursa.max_tokens out for "
            "the operator's cap",
        ),
        ([{"role": "user", "content": "q"}], {"budget": {"max_llm_calls": 2.5}}, 400, "whole number"),
        ([{"role": "user", "content": "q"}], {"max_seconds": "60"}, 400, "a str, not a number"),
        ([{"role": "user", "content": "q"}], {"context": "a", "context_path": "/x"}, 400, "at most one"),
    ],
)
def test_bad_messages_and_options_are_clear_400s(messages, extra, status, fragment):
    if status == 200:  # a cap given one by one wins over the same cap in recursa.budget
        assert _parse(messages, **extra).settings["budget"].max_usd == extra["max_usd"]
        return
    with pytest.raises(ApiError) as info:
        _parse(messages, **extra)
    assert info.value.status == status and fragment in info.value.message
    if len(extra) == 1 and (key := next(iter(extra))) in SETTING_KEYS:  # the field the client fixes
        assert info.value.param == f"recursa.{key}"


# -- extra_body: explicit context, path, URL, per-request settings -------------------------------


def test_extra_body_names_a_context_path_a_folder_or_inline_text(client, files):
    def ask(**recursa) -> dict:
        r = client.chat.completions.create(
            model="recursa",
            messages=[{"role": "user", "content": "What is in it?"}],
            extra_body={"recursa": recursa},
        )
        return _described(r.choices[0].message.content)

    got = ask(context_path=str(files / "notes.txt"))
    assert got["question"] == "What is in it?" and got["tail"].endswith("THE END")
    got = ask(context_path=str(files / "docs"))
    assert got["type"] == "dict" and got["keys"] == ["a.md", "b.md"]
    got = ask(context=["one", "two", "three"], question="Explicit?")
    assert got["question"] == "Explicit?" and got["len"] == 3


def test_extra_body_context_url_is_fetched(client, files):
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(files))
    handler.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    web = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=web.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{web.server_address[1]}/notes.txt"
        r = client.chat.completions.create(
            model="recursa",
            messages=[{"role": "user", "content": "Q"}],
            extra_body={"recursa": {"context_url": url}},
        )
        assert _described(r.choices[0].message.content)["tail"].endswith("THE END")
        with pytest.raises(openai.BadRequestError, match="HTTP 404"):
            client.chat.completions.create(
                model="recursa",
                messages=[{"role": "user", "content": "Q"}],
                extra_body={"recursa": {"context_url": url + ".missing"}},
            )
    finally:
        web.shutdown()
        web.server_close()
        thread.join(5)


def test_per_request_depth_iterations_and_budget_reach_the_run(client, srv):
    r = client.chat.completions.create(
        model="recursa",
        messages=[
            {"role": "user", "content": "ctx"},
            {"role": "user", "content": "RUN: a = 1 ||| b = 2 ||| FINAL(3)"},
        ],
        extra_body={"recursa": {"max_iterations": 1, "max_depth": 0, "max_llm_calls": 40}},
    )
    summary = r.model_extra["recursa"]
    assert summary["stop_reason"] == "max_iterations"
    trace_dir = _service(srv).settings.run["trace_dir"]
    start = load(trace_dir / summary["trace"]).root.start
    assert start["config"]["max_iterations"] == 1 and start["config"]["max_depth"] == 0
    assert start["config"]["budget"]["max_llm_calls"] == 40  # the request's, below the server's 50


# -- auth and bad input over HTTP ----------------------------------------------------------------


def test_bearer_key_is_required_when_set(srv):
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong-key-000000", max_retries=0).models.list()
    r = httpx.get(srv.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "Bearer" in r.headers["www-authenticate"]
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"  # health needs no key


def test_models_lists_the_served_names(client):
    names = [m.id for m in client.models.list().data]
    assert names == ["recursa", ROOT]
    assert client.models.retrieve("recursa").id == "recursa"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "fragment"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("POST", "/v1/chat/completions", b'["a list"]', 400, "JSON object"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "`model` is required"),
        (
            "POST",
            "/v1/chat/completions",
            b'{"model": "gpt-4", "messages": [{"role": "user", "content": "q"}]}',
            404,
            "does not exist",
        ),
        ("GET", "/v1/nothing-here", None, 404, "no such endpoint"),
        ("PUT", "/v1/chat/completions", None, 405, "method not allowed"),
        ("GET", "/v1/chat/completions", None, 404, "stores no chat completions"),  # the stored list
    ],
)
def test_bad_requests_get_openai_format_errors_and_the_server_keeps_serving(
    srv, client, method, path, body, status, fragment
):
    r = httpx.request(method, srv.url + path, content=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] and {"message", "type", "param", "code"} <= set(error)
    ok = client.chat.completions.create(
        model="recursa", messages=[{"role": "user", "content": "RUN: FINAL(1)"}]
    )
    assert ok.choices[0].message.content  # still serving


@pytest.mark.parametrize(
    ("recursa", "error", "code"),
    [
        ({"context_path": "/etc/passwd"}, openai.PermissionDeniedError, "context_path_not_allowed"),
        ({"context_path": "__FILES__/missing.txt"}, openai.BadRequestError, "context_not_found"),
        ({"context_path": "__FILES__/../../etc"}, openai.PermissionDeniedError, "context_path_not_allowed"),
        ({"context_url": "ftp://example.invalid/x"}, openai.BadRequestError, None),
        ({"context_url": "http://127.0.0.1:1/x"}, openai.BadRequestError, "context_fetch_failed"),
    ],
)
def test_bad_context_sources_are_clear_http_errors(client, files, recursa, error, code):
    recursa = {k: v.replace("__FILES__", str(files)) for k, v in recursa.items()}
    with pytest.raises(error) as info:
        client.chat.completions.create(
            model="recursa", messages=[{"role": "user", "content": "Q"}], extra_body={"recursa": recursa}
        )
    assert info.value.code == code


def test_paths_and_urls_are_off_unless_the_operator_allows_them(tmp_path, files):
    with BackgroundServer(create_app(_settings(tmp_path))) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for recursa, flag in [
            ({"context_path": str(files / "notes.txt")}, "--allow-path"),
            ({"context_url": "http://127.0.0.1:1/"}, "--allow-urls"),
        ]:
            with pytest.raises(openai.PermissionDeniedError, match=flag):
                c.chat.completions.create(
                    model="recursa",
                    messages=[{"role": "user", "content": "Q"}],
                    extra_body={"recursa": recursa},
                )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file, so 'not readable' cannot happen")
def test_an_unreadable_context_path_is_a_403(client, files):
    secret = files / "secret.txt"
    secret.write_text("x")
    secret.chmod(0)
    with pytest.raises(openai.PermissionDeniedError, match="not readable"):
        client.chat.completions.create(
            model="recursa",
            messages=[{"role": "user", "content": "Q"}],
            extra_body={"recursa": {"context_path": str(secret)}},
        )


def test_a_run_that_fails_to_start_is_an_error_not_a_hang(tmp_path):
    # max_usd without a known price for the model: the RLM refuses to start.
    settings = _settings(
        tmp_path, model="openai/no-such-model", base_url="http://127.0.0.1:1/v1", upstream_api_key="k" * 20
    )
    with BackgroundServer(create_app(settings)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="cannot start the run"):
            c.chat.completions.create(
                model="recursa",
                messages=[{"role": "user", "content": "q"}],
                extra_body={"recursa": {"max_usd": 1.0}},
            )


# -- disconnects cancel the run and reap its sandbox ----------------------------------------------

_SLEEPER = [
    {"role": "user", "content": "ctx"},
    {"role": "user", "content": "RUN: import time\ntime.sleep(60)"},
]


def _assert_cancelled_and_reaped(srv, baseline: set[int], before: int) -> None:
    service = _service(srv)
    wait_until(lambda: not service.active, what="the server to drop the run")
    wait_until(lambda: not (descendants(os.getpid()) - baseline), what="the sandbox process to be reaped")
    assert service.cancelled == before + 1
    traces = sorted(service.settings.run["trace_dir"].glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    assert load(traces[-1]).root.stop_reason == "cancelled"


def test_a_streaming_client_that_disconnects_cancels_the_run_and_its_sandbox_is_reaped(srv):
    baseline = descendants(os.getpid())
    before = _service(srv).cancelled
    with (
        httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http,
        http.stream(
            "POST", "/v1/chat/completions", json={"model": "recursa", "stream": True, "messages": _SLEEPER}
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept referenced: a collected iterator would close the stream now
        for line in lines:
            if "turn 1" in line:
                break
        # The REPL starts while the first model call is out: wait until it runs the 60 s sleep, then
        # leaving the block disconnects the client mid-run.
        wait_until(lambda: bool(descendants(os.getpid()) - baseline), what="the sandbox to start")
    _assert_cancelled_and_reaped(srv, baseline, before)


def test_a_non_streaming_client_that_disconnects_cancels_the_run(srv):
    baseline = descendants(os.getpid())
    before = _service(srv).cancelled
    body = json.dumps({"model": "recursa", "messages": _SLEEPER}).encode()
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: bool(_service(srv).active), what="the run to start")
        wait_until(lambda: bool(descendants(os.getpid()) - baseline), what="the sandbox to start")
    _assert_cancelled_and_reaped(srv, baseline, before)


def test_a_request_may_set_any_run_setting_the_schema_lets_a_client_set_and_only_lower_the_costly():
    req = _parse([{"role": "user", "content": "q"}], tips="count in code", exec_timeout=5, subcall_errors="return")
    assert req.settings == {"tips": "count in code", "exec_timeout": 5.0, "subcall_errors": "return"}
    for extra, fragment in (
        ({"exec_timeout": 999}, "recursa.exec_timeout=999.0 is more than the operator allows (at most 120.0)"),
        ({"max_output_tokens": 0}, "recursa.max_output_tokens must be an int >= 1"),
        ({"prices": {}}, "unknown recursa option"),  # the operator's alone
        ({"sub_model": "openai/x"}, "unknown recursa option"),  # models stay the operator's
    ):
        with pytest.raises(ApiError) as info:
            _parse([{"role": "user", "content": "q"}], **extra)
        assert fragment in info.value.message, info.value.message
