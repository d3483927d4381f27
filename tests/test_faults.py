"""Model-API faults injected by the fake server and handled through the real `openai` and
`anthropic` SDKs: retries with backoff, per-call and per-run retry limits, the billing policy
(recursa.lm.billing), missing usage, context-length errors, and runs that fail for good."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

import recursa.loop.tree as tree_module
from recursa import RLM, Budget
from recursa.lm.base import estimate_tokens_upper
from recursa.lm.retry import RetryPolicy
from recursa.lm.tokens import count_tokens
from recursa.testing.fake_server import FakeServer, Fault, FaultRule, FaultSchedule

KEY = "sk-faults-test-0123456789abcdef"
PROVIDERS = ("openai", "anthropic")
BOTH = pytest.mark.parametrize("provider", PROVIDERS)
DONE = "FINAL(done)"


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    # The policy's own waits shrink to milliseconds; a server's Retry-After still sets the floor.
    fast = functools.partial(RetryPolicy, base_delay=0.001, max_delay=0.01)
    monkeypatch.setattr(tree_module, "RetryPolicy", fast)


@pytest.fixture
def faults(server: FakeServer, script: Any) -> Any:
    """Sets the server's fault plan for one test (after `script` has reset the server's ledger)."""

    def use(plan: Any) -> None:
        server.faults = plan

    yield use
    server.faults = None


def make_rlm(server: FakeServer, tmp_path: Path, provider: str, **kw: Any) -> RLM:
    url = server.base_url if provider == "openai" else server.root_url
    return RLM(
        f"{provider}/root-model",
        sub_model=f"{provider}/sub-model",
        base_url=url,
        api_key=KEY,
        trace_dir=tmp_path,
        **kw,
    )


def code(src: str) -> str:
    return f"Running this.\n```repl\n{src}\n```"


def events(result: Any, kind: str | None = None) -> list[dict[str, Any]]:
    text = Path(result.trace_path).read_text()
    assert KEY not in text  # the key never reaches a trace, whatever failed
    out = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [e for e in out if kind is None or e["type"] == kind]


def of(server: FakeServer, model: str) -> list[Any]:
    return [r for r in server.requests if r.model == model]


# -- transient faults: retried, the run succeeds, billed attempts counted ------------------------

# (fault, provider may have billed the failed attempt, its usage had to be estimated)
TRANSIENT = {
    "429": (Fault(429), False, False),
    "500": (Fault(500), False, False),
    "502": (Fault(502), False, False),
    "503": (Fault(503, message="overloaded"), False, False),
    "reset-before-response": (Fault.reset(), True, True),
    "cut-mid-body": (Fault.cut(40), True, True),
    "malformed-json": (Fault.malformed(), True, True),
    "no-choices": (Fault.no_choices(), True, False),
}


@BOTH
@pytest.mark.parametrize("name", list(TRANSIENT))
def test_a_transient_fault_is_retried_and_billed_attempts_count(
    server, script, faults, tmp_path, provider, name
):
    fault, billed, estimated = TRANSIENT[name]
    faults({0: fault})
    script.root("root-model", DONE)
    result = make_rlm(server, tmp_path, provider).run("q", "ctx")

    assert (result.stop_reason, result.answer) == ("final", "done")
    first, second = server.requests
    assert first.fault == fault.kind and second.fault is None and second.status == 200
    assert first.status == (fault.status if fault.kind == "http" else 0 if fault.kind == "reset" else 200)
    # Both attempts sent the same prompt; the billing policy decides how many of them count.
    prompt, reply = second.prompt_tokens, second.completion_tokens
    counted = 1 + billed
    assert result.usage.llm_calls == counted
    assert result.usage.input_tokens == prompt * counted  # estimates use the server's own ratio
    assert result.usage.output_tokens == reply * (2 if name == "no-choices" else 1)
    (call,) = events(result, "lm_call")
    assert call["attempts"] == 2 and len(call["retry_errors"]) == 1
    assert call["usage"]["llm_calls"] == counted and call.get("usage_estimated", False) == estimated


@BOTH
def test_429_retry_after_is_honoured_and_its_absence_backs_off_briefly(
    server, script, faults, tmp_path, provider
):
    faults({0: Fault(429, retry_after_s=0.3), 2: Fault(429)})
    script.root("root-model", DONE)
    rlm = make_rlm(server, tmp_path, provider)
    assert rlm.run("q", "ctx").answer == "done"
    assert rlm.run("q", "ctx").answer == "done"
    told, after_told, untold, after_untold = server.requests
    assert [r.status for r in server.requests] == [429, 200, 429, 200]
    assert after_told.received_at - told.finished_at >= 0.3  # never sooner than the server asked
    assert after_untold.received_at - untold.finished_at < 0.25  # our own (shrunk) backoff


@BOTH
@pytest.mark.serial  # a 0.3 s request timeout: a busy neighbour test can make the retry time out too
def test_a_read_timeout_is_retried_and_counted_as_possibly_billed(server, script, faults, tmp_path, provider):
    faults({0: Fault.hang(1.0)})
    script.root("root-model", DONE)
    result = make_rlm(server, tmp_path, provider, request_timeout=0.3).run("q", "ctx")
    assert result.answer == "done"
    assert len(server.requests) == 2
    (call,) = events(result, "lm_call")
    assert call["attempts"] == 2 and "timed out waiting for the answer" in call["retry_errors"][0]
    assert "request_timeout" in call["retry_errors"][0]
    assert result.usage.llm_calls == 2 and call["usage_estimated"] is True
    assert result.usage.input_tokens == 2 * server.requests[1].prompt_tokens


@BOTH
def test_missing_usage_is_estimated_not_zero(server, script, faults, tmp_path, provider):
    faults({0: Fault.no_usage()})
    reply = "The answer is in.\nFINAL(done)"
    script.root("root-model", reply)
    result = make_rlm(server, tmp_path, provider).run("q", "ctx")
    assert result.answer == "done"
    (rec,) = server.requests
    assert rec.fault == "no_usage"
    assert result.usage.input_tokens == rec.prompt_tokens > 0
    assert result.usage.output_tokens == count_tokens(reply) > 0
    (call,) = events(result, "lm_call")
    assert call["usage_estimated"] is True and call["attempts"] == 1


# -- faults that are not retried, and runs that fail for good -----------------------------------


@BOTH
def test_a_root_call_that_finally_fails_ends_the_run_with_a_complete_trace(
    server, script, faults, tmp_path, provider
):
    faults(FaultSchedule(FaultRule(Fault(503), model="root-model", skip=1, times=None)))
    script.root("root-model", code("x = 6 * 7\nprint(x)"), DONE)
    result = make_rlm(server, tmp_path, provider, max_retries=2).run("q", "ctx")

    assert result.stop_reason == "error" and result.answer == ""
    assert [r.status for r in server.requests] == [200, 503, 503, 503]
    assert "the root model call failed" in result.error and "HTTP 503" in result.error
    assert "gave up after 3 attempts" in result.error and KEY not in result.error
    trace = events(result)
    assert trace[0]["type"] == "run_start" and trace[-1]["type"] == "run_end"
    assert trace[-1]["stop_reason"] == "error" and trace[-1]["error"] == result.error
    assert any(e["type"] == "exec" for e in trace)  # the work before the failure is kept
    failed = [e for e in trace if e["type"] == "lm_call" and "error" in e]
    assert len(failed) == 1 and failed[0]["attempts"] == 3 and "billed_usage" not in failed[0]
    assert result.usage.llm_calls == 1  # 503s bill nothing


@BOTH
def test_a_context_length_error_is_not_retried(server, script, faults, tmp_path, provider):
    faults(FaultSchedule(FaultRule(Fault.context_length(), model="root-model")))
    script.root("root-model", DONE)
    result = make_rlm(server, tmp_path, provider).run("q", "ctx")
    # The provider's own refusal of a root call stops the run as the window guard would.
    assert result.stop_reason == "context_window" and len(server.requests) == 1
    assert "too long" in result.error and "Send less text per call" in result.error
    assert result.usage.llm_calls == 0


@BOTH
def test_a_sub_call_context_length_error_tells_the_model_to_send_less(
    server, script, faults, tmp_path, provider
):
    faults(FaultSchedule(FaultRule("context_length", model="sub-model")))
    probe = "try:\n    llm_query('a long chunk')\nexcept Exception as exc:\n    print('ERR', exc)"
    script.root("root-model", code(probe), DONE)
    result = make_rlm(server, tmp_path, provider).run("q", "ctx")
    assert result.answer == "done"
    assert len(of(server, "sub-model")) == 1  # never retried
    feedback = of(server, "root-model")[1].messages[-1]["content"]
    assert "ERR" in feedback and "send less text per call" in feedback


# -- the per-run retry budget ------------------------------------------------------------------


@BOTH
def test_the_run_retry_budget_caps_retries_across_the_whole_tree(server, script, faults, tmp_path, provider):
    faults(FaultSchedule(FaultRule(Fault(503), model="sub-model", times=None)))
    batch = (
        "try:\n    llm_query_batched(['a', 'b', 'c', 'd'])\nexcept Exception as exc:\n    print('ERR', exc)"
    )
    script.root("root-model", code(batch), DONE)
    result = make_rlm(server, tmp_path, provider, max_retries=5, max_run_retries=3).run("q", "ctx")

    assert result.answer == "done"
    # Four calls of up to six attempts each, but only three retries in the whole run.
    assert len(of(server, "sub-model")) == 4 + 3
    errors = [e["error"] for e in events(result, "lm_call") if "error" in e]
    assert len(errors) == 4
    assert all("max_run_retries" in e or "gave up" in e for e in errors)
    assert any("used all 3 retries" in e and "RLM(max_run_retries=...)" in e for e in errors)


@BOTH
def test_a_spent_run_retry_budget_ends_a_failing_root_with_a_clear_error(
    server, script, faults, tmp_path, provider
):
    faults(lambda rec: 429)
    script.root("root-model", DONE)
    result = make_rlm(server, tmp_path, provider, max_retries=10, max_run_retries=2).run("q", "ctx")
    assert result.stop_reason == "error" and len(server.requests) == 3
    assert "used all 2 retries" in result.error and "max_run_retries" in result.error


# -- budgets hold across billed retries ----------------------------------------------------------


@BOTH
def test_a_billed_failure_counts_against_max_llm_calls(server, script, faults, tmp_path, provider):
    faults({0: Fault.no_choices()})
    script.root("root-model", DONE)
    result = make_rlm(server, tmp_path, provider, budget=Budget(max_llm_calls=1)).run("q", "ctx")
    assert result.stop_reason == "budget" and len(server.requests) == 1
    assert result.usage.llm_calls == 1 and "retried" in result.error


@BOTH
def test_max_tokens_is_never_exceeded_by_a_retry(server, script, faults, tmp_path, provider):
    script.root("root-model", DONE)
    out_tokens = 200
    make_rlm(server, tmp_path, provider, max_output_tokens=out_tokens).run("q", "ctx")
    worst = estimate_tokens_upper(server.requests[0].messages, out_tokens)
    server.reset()

    # Room for one attempt's worst case, not for a second after a billed failure.
    faults(lambda rec: Fault.malformed())
    cap = worst + 5
    rlm = make_rlm(server, tmp_path, provider, max_output_tokens=out_tokens, budget=Budget(max_tokens=cap))
    result = rlm.run("q", "ctx")
    assert result.stop_reason == "budget" and len(server.requests) == 1
    assert 0 < result.usage.input_tokens + result.usage.output_tokens <= cap
    assert "token budget" in result.error and "retried" in result.error


# -- streams: our clients never stream, so the fake's SSE cut is checked on the raw SDKs ---------


async def test_a_stream_cut_mid_way_surfaces_as_an_error_in_both_sdks() -> None:
    async with FakeServer(responder=lambda m, msgs: "word " * 200, faults=lambda rec: Fault.cut(600)) as srv:
        oai = openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0)
        text = ""
        with pytest.raises(openai.APIConnectionError):
            stream = await oai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            )
            async for chunk in stream:
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        await oai.close()
        assert 0 < len(text) < 1000  # some of the reply arrived, then the stream broke

        ant = anthropic.AsyncAnthropic(base_url=srv.root_url, api_key="k", max_retries=0)
        # Found here: mid-stream the Anthropic SDK lets its HTTP library's own error through, not
        # an anthropic.APIError. A client of ours that streams must catch both.
        libraries = [importlib.import_module(n) for n in ("httpx", "httpx2") if importlib.util.find_spec(n)]
        with pytest.raises((anthropic.APIError, *(lib.TransportError for lib in libraries))) as info:
            async with ant.messages.stream(
                model="m", max_tokens=1000, messages=[{"role": "user", "content": "x"}]
            ) as astream:
                async for _ in astream.text_stream:
                    pass
        await ant.close()
        assert "incomplete" in str(info.value) or "peer closed" in str(info.value)
        assert [(r.status, r.fault, r.stream) for r in srv.requests] == [(200, "cut", True)] * 2


def test_the_served_stream_survives_an_upstream_reply_cut_mid_body(server, script, faults, tmp_path):
    from recursa.asgi.background import BackgroundServer
    from recursa.serve.openai_server import create_app
    from recursa.serve.settings import ServeSettings

    faults({0: Fault.cut(30)})
    script.root("root-model", DONE)
    settings = ServeSettings(
        model="openai/root-model",
        sub_model="openai/sub-model",
        base_url=server.base_url,
        upstream_api_key=KEY,
        trace_dir=tmp_path,
    )
    with BackgroundServer(create_app(settings)) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="recursa", stream=True, messages=[{"role": "user", "content": "ctx"}]
        )
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        client.close()
    assert content == "done"
    assert [(r.status, r.fault) for r in server.requests] == [(200, "cut"), (200, None)]
    assert all(KEY not in p.read_text() for p in tmp_path.rglob("*.jsonl"))


# -- the fault plan itself -----------------------------------------------------------------------


async def test_fault_schedules_match_by_model_skip_and_count() -> None:
    schedule = FaultSchedule(
        FaultRule(Fault(503), model="a", skip=1, times=2),
        FaultRule("reset", model="b", times=None),
        FaultRule(429, api="anthropic"),
    )
    async with FakeServer(responder=lambda m, msgs: "ok", faults=schedule) as srv:
        oai = openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=srv.root_url, api_key="k", max_retries=0)

        async def send(model: str) -> str:
            try:
                await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
            except openai.APIStatusError as exc:
                return str(exc.status_code)
            except openai.APIConnectionError:
                return "dropped"
            return "ok"

        seen = [await send("a") for _ in range(4)] + [await send("b"), await send("b")]
        assert seen == ["ok", "503", "503", "ok", "dropped", "dropped"]
        with pytest.raises(anthropic.RateLimitError):
            await ant.messages.create(model="c", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert await ant.messages.create(model="c", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        srv.reset()  # counts start again
        assert await send("a") == "ok" and await send("a") == "503"
        await oai.close()
        await ant.close()


def test_fault_constructors_and_plan_entries() -> None:
    assert Fault(503) == Fault(status=503, kind="http")
    assert Fault.hang(2.0).delay_s == 2.0 and Fault.cut(10).after_bytes == 10
    assert Fault.context_length().status == 400
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault(kind="explode")
    from recursa.testing.fake_state import as_fault

    assert as_fault("hang") is not None and as_fault("hang").delay_s > 1  # type: ignore[union-attr]
    assert as_fault(502) == Fault(502) and as_fault(None) is None


def test_estimates_match_the_fake_servers_count() -> None:
    # The billing estimate and the fake's token count use one ratio, so tests can compare exactly.
    from recursa.lm.billing import estimate_prompt_tokens
    from recursa.lm.tokens import count_message_tokens

    messages = [{"role": "system", "content": "s" * 101}, {"role": "user", "content": "héllo " * 9}]
    assert estimate_prompt_tokens(messages) == count_message_tokens(messages) == 26 + 4 + 14 + 4
