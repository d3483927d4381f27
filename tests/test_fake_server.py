"""The fake model server, driven through the real openai and anthropic SDKs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import anthropic
import httpx
import openai
import pytest

from recursa.lm.base import CallMeta
from recursa.lm.tokens import count_message_tokens, count_tokens
from recursa.testing.fake_server import FakeServer, Fault, ScriptedResponder, UnknownModelError

from .helpers import request_overlap

USER = [{"role": "user", "content": "ping"}]


def echo(model: str, messages: list[dict[str, str]]) -> str:
    return f"{model} heard: {messages[-1]['content']}"


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(responder=echo) as srv:
        yield srv


@pytest.fixture
def oai(server: FakeServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        yield client


def test_openai_completion_usage_and_ledger(server: FakeServer, oai: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    meta = CallMeta(call_id="c1", parent_id="p0", depth=1)
    resp = oai.chat.completions.create(model="m1", messages=messages, extra_headers=meta.headers())

    reply = "m1 heard: hello there"
    assert resp.choices[0].message.content == reply
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == count_message_tokens(messages)
    assert resp.usage.completion_tokens == count_tokens(reply)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0

    (rec,) = server.requests
    assert (rec.endpoint, rec.model, rec.status, rec.stream) == ("/v1/chat/completions", "m1", 200, False)
    assert rec.messages == messages
    assert (rec.prompt_tokens, rec.completion_tokens) == (
        resp.usage.prompt_tokens,
        resp.usage.completion_tokens,
    )
    assert rec.rlm_headers == {"x-rlm-call-id": "c1", "x-rlm-parent-id": "p0", "x-rlm-depth": "1"}
    assert rec.headers["authorization"] == "<redacted>"
    assert rec.received_at <= rec.started_at <= rec.finished_at


def test_openai_content_parts_are_flattened(server: FakeServer, oai: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    resp = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": parts}])
    assert resp.choices[0].message.content == "m heard: abcd"
    assert server.requests[0].messages == [{"role": "user", "content": "abcd"}]


def test_openai_streaming_with_usage(server: FakeServer, oai: openai.OpenAI) -> None:
    prompt = "x" * 200
    stream = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == f"m heard: {prompt}"
    assert len([c for c in chunks if c.choices]) > 3  # really streamed in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == count_tokens(text)
    assert usage.prompt_tokens == count_message_tokens([{"role": "user", "content": prompt}])
    assert all(c.usage is None for c in chunks[:-1])
    (rec,) = server.requests
    assert rec.stream and rec.status == 200 and rec.completion_tokens == usage.completion_tokens


def test_openai_streaming_without_usage(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(model="m", messages=USER, stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "m heard: ping"


def test_streamed_chunks_are_not_held_back(oai: openai.OpenAI) -> None:
    # Nagle's algorithm on the server socket would hold each chunk ~40 ms for a delayed ACK.
    # Every request would pay the ~40 ms; load slows only some, so the fastest one tells.
    durations = []
    for _ in range(10):
        t0 = time.perf_counter()
        assert list(oai.chat.completions.create(model="m", messages=USER, stream=True))
        durations.append(time.perf_counter() - t0)
    assert min(durations) < 0.035


def test_max_tokens_cuts_the_reply(server: FakeServer, oai: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "y" * 400}]
    resp = oai.chat.completions.create(model="m", messages=long, max_tokens=10)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 10
    assert resp.choices[0].message.content == echo("m", long)[:40]
    chunks = list(oai.chat.completions.create(model="m", messages=long, max_completion_tokens=5, stream=True))
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert server.totals()["m"]["completion_tokens"] == 15


def test_anthropic_messages_with_system(server: FakeServer) -> None:
    with anthropic.Anthropic(base_url=server.root_url, api_key="k", max_retries=0) as client:
        msg = client.messages.create(
            model="claude-x",
            max_tokens=200,
            system="you are terse",
            messages=[{"role": "user", "content": "what is up"}],
            extra_headers={"X-RLM-Call-Id": "a1", "X-RLM-Depth": "0"},
        )
        blocks = client.messages.create(
            model="claude-x",
            max_tokens=200,
            system=[
                {"type": "text", "text": "sys-", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "tail"},
            ],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "part1 "}, {"type": "text", "text": "part2"}],
                },
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"},
            ],
        )
    assert msg.content[0].type == "text" and msg.content[0].text == "claude-x heard: what is up"
    assert msg.stop_reason == "end_turn"
    expected_messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "what is up"},
    ]
    assert msg.usage.input_tokens == count_message_tokens(expected_messages)
    assert msg.usage.output_tokens == count_tokens(msg.content[0].text)
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0
    first, second = server.requests
    assert first.endpoint == "/v1/messages" and first.messages == expected_messages
    assert first.rlm_headers == {"x-rlm-call-id": "a1", "x-rlm-depth": "0"}
    # SDK versions differ in how they send the key (x-api-key or a bearer token): either is redacted.
    assert first.headers.get("x-api-key", first.headers.get("authorization")) == "<redacted>"
    assert second.messages == [
        {"role": "system", "content": "sys-tail"},
        {"role": "user", "content": "part1 part2"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    assert blocks.usage.input_tokens == second.prompt_tokens


def test_anthropic_streaming(server: FakeServer) -> None:
    with anthropic.Anthropic(base_url=server.root_url, api_key="k", max_retries=0) as client:
        with client.messages.stream(
            model="c", max_tokens=500, system="s", messages=[{"role": "user", "content": "z" * 100}]
        ) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
    assert "".join(pieces) == "c heard: " + "z" * 100 and len(pieces) > 3
    assert final.usage.output_tokens == count_tokens("".join(pieces))
    assert final.usage.input_tokens == server.requests[0].prompt_tokens
    assert final.stop_reason == "end_turn"


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_concurrent_requests_overlap() -> None:
    async with FakeServer(responder=echo, latency_s=0.2, slots=64) as srv:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": str(i)}])
                    for i in range(32)
                )
            )
    assert sorted(r.choices[0].message.content or "" for r in replies) == sorted(
        f"m heard: {i}" for i in range(32)
    )
    assert srv.max_in_flight >= 16
    records = srv.requests
    assert len(records) == 32 and all(r.finished_at - r.started_at >= 0.2 for r in records)
    assert request_overlap(records) >= 16


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_slots_serialise() -> None:
    async with FakeServer(responder=echo, latency_s=0.05, slots=2) as srv:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            t0 = time.perf_counter()
            await asyncio.gather(
                *(client.chat.completions.create(model="m", messages=USER) for _ in range(6))
            )
            wall = time.perf_counter() - t0
    assert srv.max_in_flight == 2
    assert request_overlap(srv.requests) == 2
    assert wall >= 3 * 0.05


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_streams_hold_their_slot_until_done() -> None:
    async with FakeServer(responder=echo, latency_s=0.03, per_output_token_s=0.002, slots=1) as srv:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:

            async def one() -> str:
                stream = await client.chat.completions.create(model="m", messages=USER, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            texts = await asyncio.gather(one(), one(), one())
    assert texts == ["m heard: ping"] * 3
    assert srv.max_in_flight == 1 and request_overlap(srv.requests) == 1
    decode = count_tokens("m heard: ping") * 0.002
    assert all(r.finished_at - r.started_at >= 0.03 + decode for r in srv.requests)


async def test_full_queue_answers_429_with_retry_after() -> None:
    release = threading.Event()

    async def blocking(model: str, messages: list[dict[str, str]]) -> str:
        await asyncio.to_thread(release.wait, 10)  # holds the only slot until the test lets go
        return "done"

    async with FakeServer(responder=blocking, slots=1, max_queue=1, retry_after_s=2.0) as srv:
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            first = asyncio.create_task(client.chat.completions.create(model="m", messages=USER))
            await wait_until(lambda: srv.in_flight == 1)
            second = asyncio.create_task(client.chat.completions.create(model="m", messages=USER))
            await wait_until(lambda: srv.gate.waiting == 1)
            with pytest.raises(openai.RateLimitError) as info:
                await client.chat.completions.create(model="m", messages=USER)
            release.set()
            done = await asyncio.gather(first, second)
    assert info.value.response.headers["retry-after"] == "2"
    assert info.value.response.headers["retry-after-ms"] == "2000"
    assert info.value.code == "rate_limit_exceeded"
    assert [d.choices[0].message.content for d in done] == ["done", "done"]
    assert [r.status for r in srv.requests] == [200, 200, 429]
    assert srv.totals()["m"]["failed"] == 1 and srv.totals()["m"]["requests"] == 2


def test_context_length_errors() -> None:
    with FakeServer(responder=echo, max_context_tokens=50) as srv:
        big = [{"role": "user", "content": "w" * 400}]
        with openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="m", messages=big)
            assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content
        with anthropic.Anthropic(base_url=srv.root_url, api_key="k", max_retries=0) as aclient:
            with pytest.raises(anthropic.BadRequestError) as ainfo:
                aclient.messages.create(model="c", max_tokens=10, messages=big)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length" in info.value.message
    assert isinstance(ainfo.value.body, dict)
    assert ainfo.value.body["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in ainfo.value.body["error"]["message"]
    assert [r.status for r in srv.requests] == [400, 200, 400]
    assert srv.requests[0].prompt_tokens == count_message_tokens(big)


def test_api_key_is_required_and_never_recorded() -> None:
    key = "sekret-key-123"
    with FakeServer(responder=echo, api_key=key) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model="m", messages=USER)
        with openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0) as good:
            assert good.chat.completions.create(model="m", messages=USER).choices[0].message.content
            assert [m.id for m in good.models.list()] == ["m"]
        with anthropic.Anthropic(base_url=srv.root_url, api_key="wrong", max_retries=0) as abad:
            with pytest.raises(anthropic.AuthenticationError):
                abad.messages.create(model="c", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        with anthropic.Anthropic(base_url=srv.root_url, api_key=key, max_retries=0) as agood:
            assert agood.messages.create(
                model="c", max_tokens=50, messages=[{"role": "user", "content": "x"}]
            )
        assert httpx.get(f"{srv.base_url}/models").status_code == 401
        assert httpx.get(f"{srv.root_url}/health").json() == {"status": "ok"}
    assert [r.status for r in srv.requests] == [401, 200, 401, 200]
    assert key not in repr(srv.requests)


def test_unknown_model_is_404() -> None:
    def picky(model: str, messages: list[dict[str, str]]) -> str:
        if model == "gone":
            raise UnknownModelError(model)
        return "ok"

    with FakeServer(responder=picky, models=["known", "gone"]) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as info:
                client.chat.completions.create(model="nope", messages=USER)
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="gone", messages=USER)
            assert (
                client.chat.completions.create(model="known", messages=USER).choices[0].message.content
                == "ok"
            )
            assert [m.id for m in client.models.list()] == ["known", "gone"]
        with anthropic.Anthropic(base_url=srv.root_url, api_key="k", max_retries=0) as aclient:
            with pytest.raises(anthropic.NotFoundError) as ainfo:
                aclient.messages.create(
                    model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}]
                )
    assert info.value.code == "model_not_found"
    assert isinstance(info.value.body, dict) and set(info.value.body) >= {"message", "type", "code"}
    assert isinstance(ainfo.value.body, dict) and ainfo.value.body["error"]["type"] == "not_found_error"
    assert [r.status for r in srv.requests] == [404, 404, 200, 404]


def test_default_responder_uses_scripted_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    from recursa.scripted import catalog

    made: list[str] = []

    def factory() -> Callable[[list[dict[str, str]]], str]:
        made.append("policy")
        return lambda messages: f"policy saw {len(messages)} messages"

    monkeypatch.setitem(catalog._POLICIES, "fake-echo", factory)
    with FakeServer() as srv:
        assert isinstance(srv.responder, ScriptedResponder)
        with openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            for _ in range(3):
                resp = client.chat.completions.create(model="scripted/fake-echo", messages=USER * 2)
                assert resp.choices[0].message.content == "policy saw 2 messages"
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="scripted/no-such-policy", messages=USER)
            assert "scripted/fake-echo" in [m.id for m in client.models.list()]
    assert made == ["policy"]  # one cached policy per model name


def test_fault_plans() -> None:
    plan = [Fault(429, retry_after_s=0.01), Fault(503, retry_after_s=0.01, message="busy")]
    with FakeServer(responder=echo, faults=plan) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=2) as client:
            resp = client.chat.completions.create(model="m", messages=USER)
    assert resp.choices[0].message.content == "m heard: ping"
    assert [r.status for r in srv.requests] == [429, 503, 200]
    assert [r.headers["x-stainless-retry-count"] for r in srv.requests] == ["0", "1", "2"]
    assert srv.requests[1].error == "busy"

    with FakeServer(responder=echo, faults={0: 429, 1: 500}) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as info:
                client.chat.completions.create(model="m", messages=USER)
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(model="m", messages=USER)
            assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content
    assert "retry-after" not in info.value.response.headers

    with FakeServer(responder=echo, faults=lambda rec: 503 if rec.model == "flaky" else None) as srv:
        with anthropic.Anthropic(base_url=srv.root_url, api_key="k", max_retries=0) as aclient:
            with pytest.raises(anthropic.InternalServerError) as ainfo:
                aclient.messages.create(
                    model="flaky", max_tokens=5, messages=[{"role": "user", "content": "x"}]
                )
            assert aclient.messages.create(
                model="fine", max_tokens=50, messages=[{"role": "user", "content": "x"}]
            )
    assert ainfo.value.status_code == 503
    assert [(r.model, r.status) for r in srv.requests] == [("flaky", 503), ("fine", 200)]


def test_responder_errors_become_500(oai: openai.OpenAI, server: FakeServer) -> None:
    def broken(model: str, messages: list[dict[str, str]]) -> str:
        raise ZeroDivisionError("policy bug")

    server.responder = broken
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(model="m", messages=USER)
    assert "ZeroDivisionError: policy bug" in info.value.message
    assert server.in_flight == 0 and server.gate.free == server.slots  # the slot came back


def test_totals_and_reset(server: FakeServer, oai: openai.OpenAI) -> None:
    for model in ("a", "a", "b"):
        oai.chat.completions.create(model=model, messages=USER)
    totals = server.totals()
    assert set(totals) == {"a", "b"}
    assert totals["a"]["requests"] == 2
    assert totals["a"]["prompt_tokens"] == 2 * count_message_tokens(USER)
    assert totals["a"]["completion_tokens"] == 2 * count_tokens("a heard: ping")
    assert totals["b"]["total_tokens"] == count_message_tokens(USER) + count_tokens("b heard: ping")
    server.reset()
    assert server.requests == [] and server.totals() == {} and server.max_in_flight == 0
    oai.chat.completions.create(model="c", messages=USER)
    assert server.requests[0].index == 0


def test_start_stop_is_quick_and_leaves_no_threads() -> None:
    before = set(threading.enumerate())
    srv = FakeServer(responder=echo)
    t0 = time.perf_counter()
    srv.start()
    started = time.perf_counter() - t0
    assert srv.running and srv.base_url == f"http://127.0.0.1:{srv.port}/v1"
    with httpx.Client() as client:  # a keep-alive connection stays open across stop()
        assert client.get(f"{srv.root_url}/health").status_code == 200
        t0 = time.perf_counter()
        srv.stop()
        stopped = time.perf_counter() - t0
    srv.stop()  # idempotent
    assert started < 2.0 and stopped < 2.0  # generous: shared CI machines
    assert not srv.running
    assert set(threading.enumerate()) == before
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.root_url}/health")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_serves_until_interrupted() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recursa.testing.fake_server", "--port", "0", "--latency", "0.01"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # A shell without job control starts background jobs with SIGINT ignored, and that is
        # inherited; this test is about what Ctrl-C does, so give the server the default disposition.
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.stderr else "")
        root = line.rsplit(" ", 1)[-1].strip()
        assert httpx.get(f"{root}/health").json() == {"status": "ok"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # generous: CI machines are shared
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_real_time_records_first_token_and_contended_decode() -> None:
    # Real-time mode with prefill and contention: the order of the recorded times must hold.
    srv = FakeServer(
        responder=lambda model, messages: "y" * 80,  # 20 output tokens: two decode steps of 16 and 4
        latency_s=0.1,  # long enough that all three arrive while the first two hold the slots
        prefill_tokens_per_s=100_000,
        per_output_token_s=0.0005,
        contention=1.0,
        slots=2,
        cache_blocks=64,
    )
    async with srv, openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client:

        async def one() -> None:
            await client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]

        await asyncio.gather(one(), one(), one())
        recs = srv.requests
        assert len(recs) == 3 and all(r.ok for r in recs)
        for r in recs:
            assert r.received_at <= r.started_at < r.first_token_at < r.finished_at
            assert r.ttft_s >= 0.1
        assert max(r.queue_wait_s for r in recs) > 0  # two slots, three requests: one waited
        async with httpx.AsyncClient() as http:
            assert len((await http.get(f"{srv.root_url}/ledger")).json()) == 3
            await http.post(f"{srv.root_url}/ledger/reset")
        assert srv.requests == [] and len(srv.cache) == 0
