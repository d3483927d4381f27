"""Model clients: retry policy, limiter, prices, model specs, and the real SDKs against the fake server."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from recursa.errors import ConfigError, ContextLengthError, LMError
from recursa.lm import AnthropicClient, CallMeta, LMClient, LMRequest, LMResponse, ModelPrice, OpenAIClient
from recursa.lm.anthropic_client import mark_cache, to_anthropic
from recursa.lm.limiter import Limiter
from recursa.lm.prices import PriceBook
from recursa.lm.registry import make_client, parse_model
from recursa.lm.retry import RetryPolicy, call_with_retries, parse_retry_after, status_error
from recursa.testing.fake_server import FakeServer, Fault

from .helpers import max_overlap

FAST = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01, jitter=0.0)
SECRET = "sk-test-DO-NOT-LEAK-0123456789abcdef"


class FakeSleep:
    """Records requested waits instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def flaky(errors: list[LMError], result: Any = "ok") -> tuple[list[int], Any]:
    """A callable that raises the given errors in turn, then returns `result`; counts its calls."""
    calls = [0]

    async def fn() -> Any:
        calls[0] += 1
        if errors:
            raise errors.pop(0)
        return result

    return calls, fn


def request(text: str = "hello", *, call_id: str = "call-1", **meta: Any) -> LMRequest:
    return LMRequest(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        max_output_tokens=64,
        meta=CallMeta(call_id=call_id, **meta),
    )


def error_chain_text(err: BaseException) -> str:
    """Every message along the exception chain, as a traceback would show them."""
    parts: list[str] = []
    link: BaseException | None = err
    while link is not None and len(parts) < 20:
        parts.append(f"{type(link).__name__}: {link} {link.args!r}")
        link = link.__cause__ or link.__context__
    return "\n".join(parts)


def closed_port() -> int:
    # Bind then close: nothing listens there afterwards, so connecting is refused at once.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def echo_server() -> Iterator[FakeServer]:
    with FakeServer(responder=lambda model, messages: f"echo: {messages[-1]['content']}") as srv:
        yield srv


def openai_client(srv: FakeServer, model: str = "m", **kw: Any) -> OpenAIClient:
    kw.setdefault("api_key", "test-key")
    kw.setdefault("retry", FAST)
    return OpenAIClient(model, base_url=srv.base_url, **kw)


def anthropic_client(srv: FakeServer, model: str = "m", **kw: Any) -> AnthropicClient:
    kw.setdefault("api_key", "test-key")
    kw.setdefault("retry", FAST)
    return AnthropicClient(model, base_url=srv.root_url, **kw)


def client_for(provider: str, srv: FakeServer, model: str = "m", **kw: Any) -> LMClient:
    return openai_client(srv, model, **kw) if provider == "openai" else anthropic_client(srv, model, **kw)


BOTH = pytest.mark.parametrize("provider", ["openai", "anthropic"])


# -- retry ---------------------------------------------------------------------------------------


async def test_retry_honours_retry_after_and_counts_attempts() -> None:
    sleep = FakeSleep()
    errs = [LMError("busy", status=429, retryable=True, retry_after=3.0), LMError("down", retryable=True)]
    calls, fn = flaky(errs, LMResponse("hi", 1, 1))
    policy = RetryPolicy(base_delay=0.5, jitter=0.25)
    out = await call_with_retries(fn, policy, sleep=sleep)
    assert out.text == "hi" and out.attempts == 3 and calls[0] == 3
    assert len(sleep.delays) == 2
    # The provider's 3 s is a floor (plus at most the jitter fraction on top).
    assert 3.0 <= sleep.delays[0] <= 3.0 * 1.25
    # The second wait is plain backoff for attempt 2: 1.0 s +- 25 %.
    assert 0.75 <= sleep.delays[1] <= 1.25


async def test_retry_gives_up_after_max_attempts() -> None:
    sleep = FakeSleep()
    calls, fn = flaky([LMError("busy", status=503, retryable=True) for _ in range(10)])
    with pytest.raises(LMError) as info:
        await call_with_retries(fn, RetryPolicy(max_attempts=4, jitter=0.0), sleep=sleep)
    assert calls[0] == 4
    assert sleep.delays == [0.5, 1.0, 2.0]  # exponential, no jitter
    assert info.value.status == 503 and "gave up after 4 attempts" in str(info.value)


@pytest.mark.parametrize(
    "err", [LMError("bad request", status=400), ContextLengthError("too long", status=400), ValueError("bug")]
)
async def test_no_retry_on_non_retryable_errors(err: Exception) -> None:
    sleep = FakeSleep()
    calls, fn = flaky([err])  # type: ignore[list-item]
    with pytest.raises(type(err)):
        await call_with_retries(fn, RetryPolicy(), sleep=sleep)
    assert calls[0] == 1 and sleep.delays == []


def test_backoff_is_capped_and_jitter_bounded() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=5.0, jitter=0.5)
    assert policy.delay(1, rand=0.0) == pytest.approx(0.5)
    assert policy.delay(1, rand=0.999999) == pytest.approx(1.5, rel=1e-5)
    assert policy.delay(10, rand=0.5) == 5.0  # 512 s capped at max_delay
    assert policy.delay(1, retry_after=20.0, rand=0.0) == 20.0  # a provider's ask beats the cap
    for _ in range(200):
        assert 1.0 <= policy.delay(2) <= 3.0
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after({"retry-after": "7"}) == 7.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=1445412480.0) == 10.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_status_error_mapping() -> None:
    common: dict[str, Any] = dict(provider="openai", model="m", where="http://h/v1", env_var="OPENAI_API_KEY")
    busy = status_error(
        429, message="slow down", code=None, headers={"retry-after": "2"}, secret=None, **common
    )
    assert busy.retryable and busy.retry_after == 2.0 and busy.status == 429
    for status in (500, 502, 503, 504):
        assert status_error(status, message=None, code=None, headers=None, secret=None, **common).retryable
    ctx = status_error(400, message="x", code="context_length_exceeded", headers=None, secret=None, **common)
    assert isinstance(ctx, ContextLengthError) and not ctx.retryable
    vllm = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens"
    assert isinstance(
        status_error(400, message=vllm, code=None, headers=None, secret=None, **common), ContextLengthError
    )
    plain = status_error(400, message="bad temperature", code=None, headers=None, secret=None, **common)
    assert type(plain) is LMError and not plain.retryable
    leaky = status_error(
        418, message=f"key {SECRET} is odd", code=None, headers=None, secret=SECRET, **common
    )
    assert SECRET not in str(leaky)


# -- limiter -------------------------------------------------------------------------------------


async def _hold(limiter: Limiter, key: str, log: list[tuple[str, float, float]]) -> None:
    async with limiter.slot(key):
        start = time.perf_counter()
        await asyncio.sleep(0.01)  # the "model call"
        log.append((key, start, time.perf_counter()))


def _max_overlap(log: list[tuple[str, float, float]], key: str | None = None) -> int:
    return max_overlap((s, e) for k, s, e in log if key is None or k == key)


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_limiter_caps_global_concurrency() -> None:
    limiter = Limiter(max_concurrency=3)
    log: list[tuple[str, float, float]] = []
    await asyncio.gather(*(_hold(limiter, "openai/a", log) for _ in range(12)))
    assert limiter.max_in_flight == 3 and limiter.in_flight == 0
    assert _max_overlap(log) == 3


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_limiter_caps_per_model_without_starving_others() -> None:
    limiter = Limiter(max_concurrency=10, per_model={"openai/a": 2, "b": 3})  # "b" = bare model name
    log: list[tuple[str, float, float]] = []
    tasks = [_hold(limiter, "openai/a", log) for _ in range(8)]
    tasks += [_hold(limiter, "anthropic/b", log) for _ in range(8)]
    tasks += [_hold(limiter, "openai/c", log) for _ in range(8)]
    await asyncio.gather(*tasks)
    assert limiter.max_in_flight_for("openai/a") == 2 and _max_overlap(log, "openai/a") == 2
    assert limiter.max_in_flight_for("anthropic/b") == 3
    assert limiter.max_in_flight == 10  # a's queue held no global slots, so c filled the rest
    assert limiter.max_in_flight_for("openai/c") >= 5


async def test_limiter_is_fifo() -> None:
    limiter = Limiter(max_concurrency=1)
    order: list[int] = []

    async def one(i: int) -> None:
        async with limiter.slot("openai/a"):
            order.append(i)
            await asyncio.sleep(0)

    await asyncio.gather(*(one(i) for i in range(20)))
    assert order == list(range(20))


def test_limiter_built_outside_a_loop_works_in_successive_loops() -> None:
    limiter = Limiter(max_concurrency=2, per_model={"openai/a": 1})

    async def burst() -> None:
        log: list[tuple[str, float, float]] = []
        await asyncio.gather(*(_hold(limiter, "openai/a", log) for _ in range(3)))
        await asyncio.gather(*(_hold(limiter, "openai/b", log) for _ in range(4)))

    asyncio.run(burst())  # contention binds primitives to this loop...
    asyncio.run(burst())  # ...and a fresh loop must still work
    assert limiter.max_in_flight == 2 and limiter.max_in_flight_for("openai/a") == 1


async def test_limiter_paces_requests_per_minute() -> None:
    now = [100.0]
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    limiter = Limiter(requests_per_minute={"openai/a": 120}, clock=lambda: now[0], sleep=fake_sleep)

    async def one(key: str) -> None:
        async with limiter.slot(key):
            pass

    await asyncio.gather(*(one("openai/a") for _ in range(4)), one("openai/b"))
    assert waits == [0.5, 1.0, 1.5]  # 120/min: starts 0.5 s apart; b is not paced


# -- prices --------------------------------------------------------------------------------------


def test_known_models_have_positive_costs() -> None:
    book = PriceBook()
    for provider, model in [
        ("openai", "gpt-5-mini"),
        ("openai", "gpt-4o-mini"),
        ("anthropic", "claude-sonnet-4-5"),
    ]:
        assert book.known(provider, model)
        cost = book.cost(provider, model, 10_000, 1_000)
        assert cost is not None and cost > 0
        price = book.price(provider, model)
        assert price is not None and price.input_per_mtok > 0 and price.output_per_mtok > 0
    # gpt-5-mini: $0.25 in, $2 out per million tokens, cached input $0.025.
    assert book.cost("openai", "gpt-5-mini", 1_000_000, 1_000_000) == pytest.approx(2.25)
    cached = book.cost("openai", "gpt-5-mini", 1_000_000, 0, cached_tokens=1_000_000)
    assert cached == pytest.approx(0.025)
    assert book.worst_case("openai", "gpt-5-mini", 1_000_000, 0) == pytest.approx(0.25)


def test_price_overrides_win() -> None:
    book = PriceBook(
        {
            "openai/gpt-5-mini": {
                "input_per_mtok": 1.0,
                "output_per_mtok": 2.0,
                "cached_input_per_mtok": 0.5,
            },
            "Llama-3-8B": ModelPrice(0.1, 0.2),  # bare name: any provider
        }
    )
    assert book.cost("openai", "gpt-5-mini", 1_000_000, 1_000_000) == pytest.approx(3.0)
    assert book.cost("openai", "gpt-5-mini", 1_000_000, 0, cached_tokens=500_000) == pytest.approx(0.75)
    assert book.worst_case("openai", "gpt-5-mini", 1_000_000, 0) == pytest.approx(1.0)
    assert book.cost("openai", "Llama-3-8B", 2_000_000, 0, cached_tokens=1_000_000) == pytest.approx(0.2)
    with pytest.raises(ConfigError):
        PriceBook({"x/y": {"input": 1}})


def test_unknown_models_have_no_price_and_scripted_is_free() -> None:
    book = PriceBook()
    assert book.price("openai", "meta-llama/Llama-3-8B") is None
    assert not book.known("openai", "meta-llama/Llama-3-8B")
    assert book.cost("openai", "meta-llama/Llama-3-8B", 100, 100) is None
    assert book.worst_case("anthropic", "no-such-model", 100, 100) is None
    assert book.cost("scripted", "gpt5-like", 10**6, 10**6) == 0.0
    assert book.known("scripted", "anything")


# -- model specs and construction -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("openai/gpt-5-mini", ("openai", "gpt-5-mini")),
        ("anthropic/claude-sonnet-4-5", ("anthropic", "claude-sonnet-4-5")),
        ("openai/meta-llama/Llama-3-8B", ("openai", "meta-llama/Llama-3-8B")),
        ("scripted/gpt5-like", ("scripted", "gpt5-like")),
        ("OpenAI/gpt-5", ("openai", "gpt-5")),
    ],
)
def test_parse_model(spec: str, expected: tuple[str, str]) -> None:
    assert parse_model(spec) == expected


@pytest.mark.parametrize("spec", ["gpt-5-mini", "google/gemini", "openai/", ""])
def test_parse_model_errors_name_the_valid_forms(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_model(spec)
    message = str(info.value)
    assert "provider/model" in message
    if spec != "openai/":
        assert all(p in message for p in ("openai", "anthropic", "scripted"))


@pytest.mark.usefixtures("no_env_keys")
def test_missing_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        OpenAIClient("gpt-5-mini")
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        make_client("openai/gpt-5-mini")
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        make_client("anthropic/claude-sonnet-4-5")
    # Credentials in the URL were refused by the HTTP client at the first call, as an internal error.
    for url in ("http://user:PassWord9Secret@127.0.0.1:1/v1", "https://:PassWord9Secret@h.example/v1"):
        for spec in ("openai/m", "anthropic/m"):
            with pytest.raises(ConfigError, match=r"carries credentials") as refused:
                make_client(spec, base_url=url, api_key="k")
            assert "PassWord9Secret" not in str(refused.value)
    # A local server needs no key.
    assert make_client("openai/llama3", base_url="http://127.0.0.1:1/v1").model == "llama3"
    assert make_client("anthropic/x", base_url="http://127.0.0.1:1").provider == "anthropic"


def test_max_tokens_field_depends_on_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert OpenAIClient("gpt-5", api_key="k")._max_tokens_field == "max_completion_tokens"
    assert OpenAIClient("q", base_url="http://127.0.0.1:8000/v1")._max_tokens_field == "max_tokens"


def test_make_client_scripted() -> None:
    client = make_client("scripted/gpt5-like")
    assert client.provider == "scripted" and client.model == "gpt5-like"


def test_a_registered_provider_serves_its_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    from recursa.lm import registry

    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    made: list[tuple[str, dict[str, Any]]] = []

    def factory(model: str, **settings: Any) -> Any:
        made.append((model, settings))
        return "client"

    registry.register_provider("Local-Echo", factory)
    assert registry.providers()[-1] == "local-echo" and "scripted" in registry.providers()
    assert registry.make_client("local-echo/m-1", timeout=5.0) == "client"
    ((model, settings),) = made
    assert model == "m-1" and settings["timeout"] == 5.0
    assert set(settings) == {"base_url", "api_key", "timeout", "retry"}
    # A provider given as "module:attribute" is imported when first used.
    registry.register_provider("by-path", "recursa.scripted.client:scripted_provider")
    assert registry.make_client("by-path/oracle").model == "oracle"


# -- message and response shapes ------------------------------------------------------------------


def test_to_anthropic_moves_system_merges_roles_and_marks_cache() -> None:
    system, msgs = to_anthropic(
        [
            {"role": "system", "content": "sys A"},
            {"role": "user", "content": "q1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a1"},
            {"role": "system", "content": "sys B"},
            {"role": "user", "content": "q3"},
        ]
    )
    assert system == "sys A\n\nsys B"
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0]["content"] == "q1\n\nq2"
    assert msgs[-1]["content"] == "q3"  # marks are mark_cache's, for calls that ask for them
    assert not any(isinstance(m["content"], list) for m in msgs)


def test_mark_cache_marks_the_system_prompt_and_the_last_two_user_turns() -> None:
    mark = {"type": "ephemeral"}
    history = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ]
    system, msgs = mark_cache("sys", history)
    assert system == [{"type": "text", "text": "sys", "cache_control": mark}]
    assert msgs[0] == history[0] and msgs[1] == history[1] and msgs[3] == history[3]
    assert msgs[2]["content"] == [{"type": "tool_result", "tool_use_id": "t", "content": "r", "cache_control": mark}]
    assert msgs[4]["content"] == [{"type": "text", "text": "q3", "cache_control": mark}]
    assert "cache_control" not in history[2]["content"][0]  # the caller's messages are not changed
    # Anthropic allows four marks per request: this never uses more than three.
    marks = str([system, msgs]).count("cache_control")
    assert marks == 3


def test_openai_usage_mapping_with_provider_cost_and_missing_details() -> None:
    client = OpenAIClient("m", base_url="http://127.0.0.1:1/v1")
    base: dict[str, Any] = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m-2025",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    }
    usage = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
    # The client reads the JSON body as the server sent it (see OpenAIClient.complete).
    routed = {**base, "usage": {**usage, "cost": 0.0042, "prompt_tokens_details": {"cached_tokens": 60}}}
    out = client._to_response(routed)
    assert (out.input_tokens, out.output_tokens, out.cached_tokens) == (100, 5, 60)
    assert out.provider_cost_usd == 0.0042 and out.model == "m-2025"
    bare = client._to_response({**base, "usage": {**usage, "prompt_tokens_details": {"cached_tokens": None}}})
    assert bare.cached_tokens == 0 and bare.provider_cost_usd is None


def test_usage_a_server_reports_never_hands_budget_back_nor_fails_the_answer() -> None:
    # A negative count was spent as it came (the budget grew back by it); a string or a NaN
    # raised ValueError out of the client, and the run failed with an internal error.
    from recursa.budget import Budget, Ledger

    client = OpenAIClient("m", base_url="http://127.0.0.1:1/v1")
    answer = {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}
    for usage in ({"prompt_tokens": -10**12, "completion_tokens": -5}, {"prompt_tokens": "x"},
                  {"prompt_tokens": float("nan"), "completion_tokens": float("inf")}):  # fmt: skip
        out = client._to_response({**answer, "usage": usage})
        assert (out.text, out.input_tokens, out.output_tokens) == ("hi", 0, 0)
    deep = "[" * 50_000 + "]" * 50_000
    calls = client._to_response(
        {"choices": [{"message": {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}]}}]}
    ).tool_calls
    assert calls[0].error is not None and "not valid JSON" in calls[0].error
    tracker = Ledger(Budget(max_tokens=100, max_usd=1.0))
    tracker.settle(tracker.reserve(10, 0.1), -10**9, -100.0)
    tracker.charge(-10**9, float("-inf"))
    assert (tracker.spent_tokens, tracker.spent_usd) == (0, 0.0)


async def test_an_answer_nested_too_deeply_or_too_large_is_a_failed_call_not_a_crash() -> None:
    from aiohttp import web

    nested = b"[" * 100_000 + b"]" * 100_000

    async def chat(request: web.Request) -> web.StreamResponse:
        model = (await request.json())["model"]
        if model == "endless":  # a body with no length that never ends: it was read into memory whole
            stream = web.StreamResponse(headers={"Content-Type": "application/json"})
            await stream.prepare(request)
            for _ in range(80):
                await stream.write(b" " * (1 << 20))
            return stream
        status = 400 if model == "refuses" else 200
        return web.Response(body=b'{"error": ' + nested + b"}", status=status, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        for model, said in (("answers", "not valid JSON"), ("refuses", "HTTP 400"), ("endless", "too large")):
            client = OpenAIClient(model, base_url=f"http://127.0.0.1:{port}/v1", api_key="k", retry=FAST)
            try:
                with pytest.raises(LMError, match=said):  # was a RecursionError out of the client
                    await client.complete(request("ping"))
            finally:
                await client.aclose()
    finally:
        await runner.cleanup()


def test_anthropic_usage_counts_cache_reads_and_writes_as_input() -> None:
    client = AnthropicClient("m", base_url="http://127.0.0.1:1")
    msg = {  # the Messages API's JSON answer
        "id": "x",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 3,
            "cache_read_input_tokens": 900,
            "cache_creation_input_tokens": 90,
        },
    }
    out = client._to_response(msg)
    assert (out.input_tokens, out.output_tokens, out.cached_tokens) == (1000, 3, 900)


# -- the real SDKs against the fake server --------------------------------------------------------


@BOTH
async def test_text_usage_and_headers_reach_the_server(provider: str, echo_server: FakeServer) -> None:
    client = client_for(provider, echo_server, "model-x")
    try:
        out = await client.complete(request("ping", call_id="c-42", parent_id="p-7", depth=2))
    finally:
        await client.aclose()
    (rec,) = echo_server.requests
    assert out.text == "echo: ping" and out.attempts == 1
    assert (out.input_tokens, out.output_tokens) == (rec.prompt_tokens, rec.completion_tokens)
    assert out.input_tokens > 0 and out.output_tokens > 0
    assert out.model == "model-x" and out.finish_reason in ("stop", "end_turn")
    assert rec.rlm_headers == {"x-rlm-call-id": "c-42", "x-rlm-parent-id": "p-7", "x-rlm-depth": "2"}
    assert rec.messages[0] == {"role": "system", "content": "be brief"} and rec.max_tokens == 64
    assert rec.headers["user-agent"].startswith("recursa/")
    assert ("authorization" if provider == "openai" else "x-api-key") in rec.headers  # (recorded redacted)
    if provider == "anthropic":
        assert rec.headers["anthropic-version"] == "2023-06-01"


@BOTH
async def test_surrogates_in_a_prompt_go_out_as_valid_utf8(provider: str, echo_server: FakeServer) -> None:
    # Text decoded with surrogateescape (a context file with a stray byte) holds lone surrogates,
    # and a str can hold a pair of them; neither has a UTF-8 form of its own.
    client = client_for(provider, echo_server, "model-x")
    try:
        out = await client.complete(request("byte \udcff, pair \ud83d\ude00"))
    finally:
        await client.aclose()
    (rec,) = echo_server.requests
    assert rec.messages[-1]["content"] == "byte \ufffd, pair \U0001f600"
    assert out.text == "echo: byte \ufffd, pair \U0001f600"


async def test_organization_and_project_come_from_the_sdk_environment_variables(
    echo_server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_ORG_ID", "org-7")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-9")
    client = openai_client(echo_server, "model-x")
    try:
        await client.complete(request("ping"))
    finally:
        await client.aclose()
    (rec,) = echo_server.requests
    assert (rec.headers["openai-organization"], rec.headers["openai-project"]) == ("org-7", "proj-9")


async def test_user_default_headers_still_reach_the_server(echo_server: FakeServer) -> None:
    client = openai_client(echo_server, "model-x", default_headers={"X-Team": "search"})
    try:
        await client.complete(request("ping"))
    finally:
        await client.aclose()
    (rec,) = echo_server.requests
    assert rec.headers["x-team"] == "search"


@BOTH
async def test_429_with_retry_after_is_retried(provider: str) -> None:
    faults = {0: Fault(429, retry_after_s=0.2)}
    with FakeServer(responder=lambda m, msgs: "fine", faults=faults) as srv:
        client = client_for(provider, srv)
        try:
            out = await client.complete(request())
        finally:
            await client.aclose()
        first, second = srv.requests
    assert out.text == "fine" and out.attempts == 2
    assert (first.status, second.status) == (429, 200)
    # FAST's own backoff is 1 ms: the 0.2 s gap can only come from the server's Retry-After.
    assert second.received_at - first.received_at >= 0.2


@BOTH
async def test_persistent_overload_gives_up(provider: str) -> None:
    with FakeServer(responder=lambda m, msgs: "never", faults=lambda rec: 503) as srv:
        client = client_for(provider, srv)
        try:
            with pytest.raises(LMError) as info:
                await client.complete(request())
        finally:
            await client.aclose()
        assert len(srv.requests) == FAST.max_attempts
    assert info.value.status == 503 and info.value.retryable
    assert "gave up after 3 attempts" in str(info.value)


@BOTH
async def test_context_length_error(provider: str) -> None:
    with FakeServer(responder=lambda m, msgs: "x", max_context_tokens=10) as srv:
        client = client_for(provider, srv)
        try:
            with pytest.raises(ContextLengthError) as info:
                await client.complete(request("word " * 100))
        finally:
            await client.aclose()
        assert len(srv.requests) == 1  # never retried
    assert info.value.status == 400 and "too long" in str(info.value)


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
@BOTH
async def test_unreachable_base_url_fails_fast(provider: str) -> None:
    port = closed_port()
    url = f"http://127.0.0.1:{port}" + ("/v1" if provider == "openai" else "")
    client: LMClient = (
        OpenAIClient("m", base_url=url, retry=FAST)
        if provider == "openai"
        else AnthropicClient("m", base_url=url, retry=FAST)
    )
    started = time.perf_counter()
    try:
        with pytest.raises(LMError) as info:
            await client.complete(request())
    finally:
        await client.aclose()
    assert time.perf_counter() - started < 5.0
    message = str(info.value)
    assert (
        f"cannot connect to 127.0.0.1:{port} (connection refused)" in message and "gave up after 3" in message
    )


@BOTH
@pytest.mark.parametrize("echoes_key", [False, True])
async def test_rejected_key_never_appears_in_errors(
    provider: str, echoes_key: bool, no_env_keys: None
) -> None:
    # Some providers quote the rejected key back in their error text; that text must not reach us.
    faults = {0: Fault(401, message=f"Incorrect API key provided: {SECRET}")} if echoes_key else None
    key = None if echoes_key else "the-right-key"  # with a key the server's own check answers first
    with FakeServer(responder=lambda m, msgs: "x", api_key=key, faults=faults) as srv:
        client = client_for(provider, srv, api_key=SECRET)
        try:
            with pytest.raises(LMError) as info:
                await client.complete(request())
        finally:
            await client.aclose()
        assert len(srv.requests) == 1  # an auth failure is not retried
    err = info.value
    assert err.status == 401 and not err.retryable
    assert SECRET not in error_chain_text(err) and SECRET not in repr(err)
    env_var = "OPENAI_API_KEY" if provider == "openai" else "ANTHROPIC_API_KEY"
    assert env_var in str(err) and "api_key=" in str(err)


@BOTH
async def test_unknown_model_names_model_and_url(provider: str) -> None:
    with FakeServer(responder=lambda m, msgs: "x", models=["served"]) as srv:
        client = client_for(provider, srv, "not-served")
        try:
            with pytest.raises(LMError) as info:
                await client.complete(request())
        finally:
            await client.aclose()
    assert info.value.status == 404
    assert "not-served" in str(info.value) and f"127.0.0.1:{srv.port}" in str(info.value)


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
async def test_concurrent_calls_overlap_through_one_client() -> None:
    with FakeServer(responder=lambda m, msgs: "ok", latency_s=0.1, slots=64) as srv:
        client = openai_client(srv)
        limiter = Limiter(max_concurrency=16)

        async def one(i: int) -> LMResponse:
            async with limiter.slot("openai/m"):
                return await client.complete(request(f"q{i}", call_id=f"c{i}"))

        try:
            outs = await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.aclose()
        assert all(o.text == "ok" for o in outs)
        assert srv.max_in_flight == 16 and limiter.max_in_flight == 16


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
@BOTH
async def test_slow_server_hits_the_timeout(provider: str) -> None:
    with FakeServer(responder=lambda m, msgs: "late", latency_s=2.0) as srv:
        client = client_for(provider, srv, timeout=0.1, retry=RetryPolicy(max_attempts=1))
        started = time.perf_counter()
        try:
            with pytest.raises(LMError) as info:
                await client.complete(request())
        finally:
            await client.aclose()
        elapsed = time.perf_counter() - started
    assert elapsed < 1.5 and info.value.retryable and "timed out" in str(info.value)


async def test_https_is_verified_against_the_trust_store_ssl_cert_file_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    trustme = pytest.importorskip("trustme")
    import ssl

    from aiohttp import web

    from recursa.lm.json_http import shared_tls_context

    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {
                "model": body["model"],
                "choices": [{"message": {"content": "over tls"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        shared_tls_context.cache_clear()
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        client = OpenAIClient("m", base_url=f"https://127.0.0.1:{port}/v1", api_key="k", retry=FAST)
        try:
            out = await client.complete(request("ping"))
        finally:
            await client.aclose()
        assert out.text == "over tls" and (out.input_tokens, out.output_tokens) == (3, 2)
        # Without the CA in the trust store the same server is refused, not trusted.
        shared_tls_context.cache_clear()
        monkeypatch.delenv("SSL_CERT_FILE")
        client = OpenAIClient("m", base_url=f"https://127.0.0.1:{port}/v1", api_key="k", retry=FAST)
        try:
            with pytest.raises(LMError, match=r"cannot connect|certificate|SSL"):
                await client.complete(request("ping"))
        finally:
            await client.aclose()
    finally:
        shared_tls_context.cache_clear()
        await runner.cleanup()
