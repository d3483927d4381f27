"""Cached sub-calls: identical sub-calls answered once per run, session or RLMEnv group."""

from __future__ import annotations

import asyncio
import json

import pytest

from recursa.env import RLMEnv
from recursa.errors import ConfigError
from recursa.lm.base import LMResponse
from recursa.lm.call_cache import Cached, CallCache
from recursa.testing.fake_state import FaultRule, FaultSchedule
from tests.test_escapes import feedback_before
from tests.test_rlm_openai import code, make_rlm, subs

REPEATS = "out = llm_query_batched(['a', 'a', 'b', 'a'])\nagain = llm_query('a')\nprint(out, again)"


def sub_prompts(server) -> list[str]:
    return [r.messages[-1]["content"] for r in subs(server)]


def cache_events(trace_path) -> list[dict]:
    events = [json.loads(line) for line in open(trace_path)]
    return [e for e in events if e["type"] == "lm_call" and e.get("purpose") == "sub"]


def test_identical_sub_calls_are_sent_once_and_counted_apart(server, script, tmp_path):
    script.root("root-model", code(REPEATS), code("FINAL('done')"))
    script.sub("sub-model", lambda p: f"<{p}>")
    result = make_rlm(server, tmp_path, cache_subcalls=True).run("q", "ctx")
    assert result.answer == "done", result.error
    # The batch's duplicates waited for the first 'a'; the later llm_query was answered as stored.
    assert sorted(sub_prompts(server)) == ["a", "b"]
    assert "['<a>', '<a>', '<b>', '<a>'] <a>" in feedback_before(server, 2)
    sub = result.usage.by_model["openai/sub-model"]
    assert (sub.llm_calls, sub.cache_hits) == (2, 3)
    assert result.usage.cache_hits == 3 and result.usage.llm_calls == 4  # two roots, two subs
    events = cache_events(result.trace_path)
    hits = [e for e in events if e.get("cache_hit")]
    assert len(events) == 5 and len(hits) == 3
    assert {e["cache_hit"] for e in hits} <= {"waited", "stored"} and "stored" in {
        e["cache_hit"] for e in hits
    }
    assert all(e["usage"]["llm_calls"] == 0 and e["usage"]["input_tokens"] == 0 for e in hits)


def test_off_by_default_every_sub_call_is_sent(server, script, tmp_path):
    script.root("root-model", code(REPEATS), code("FINAL('done')"))
    script.sub("sub-model", lambda p: f"<{p}>")
    result = make_rlm(server, tmp_path).run("q", "ctx")
    assert sorted(sub_prompts(server)) == ["a", "a", "a", "a", "b"]
    assert result.usage.cache_hits == 0


def test_a_failed_call_is_not_cached(server, script, tmp_path):
    server.faults = FaultSchedule(FaultRule(400, model="sub-model"))
    try:
        script.root(
            "root-model",
            code(
                "try:\n    llm_query('x')\nexcept SubcallError as e:\n    print('failed once')\n"
                "print('then', llm_query('x'), llm_query('x'))"
            ),
            code("FINAL('done')"),
        )
        script.sub("sub-model", lambda p: "ok")
        result = make_rlm(server, tmp_path, cache_subcalls=True).run("q", "ctx")
    finally:
        server.faults = None
    assert "failed once" in feedback_before(server, 2) and "then ok ok" in feedback_before(server, 2)
    assert len(subs(server)) == 2  # the failure, then one call whose answer served the third
    assert result.usage.cache_hits == 1


def test_a_session_shares_the_cache_between_questions(server, script, tmp_path):
    script.root("root-model", code("FINAL(llm_query('same'))"))
    script.sub("sub-model", lambda p: "S")
    with make_rlm(server, tmp_path, cache_subcalls=True).session("ctx") as session:
        first, second = session.ask("q1"), session.ask("q2")
    assert first.answer == second.answer == "S"
    assert len(subs(server)) == 1
    assert (first.usage.cache_hits, second.usage.cache_hits) == (0, 1)


async def test_episodes_of_one_task_share_answers(server, script, tmp_path):
    script.sub("policy", lambda p: f"<{p}>")
    env = RLMEnv(
        "openai/policy", base_url=server.base_url, api_key="k", trace_dir=tmp_path, cache_subcalls=True
    )
    try:
        group = [await env.start("q", "ctx", task_id="t1") for _ in range(2)]
        other = await env.start("q", "ctx", task_id="t2")
        for episode in [*group, other]:
            await episode.step(code("print(llm_query('hello'))"))
            await episode.close()
    finally:
        await env.aclose()
    assert len(subs_of(server, "policy")) == 2  # one for task t1's two episodes, one for t2


def subs_of(server, model: str) -> list:
    return [r for r in server.requests if r.model == model and r.messages[0]["role"] != "system"]


def test_cache_subcalls_must_be_a_bool(server, tmp_path):
    with pytest.raises(ConfigError, match="cache_subcalls must be True"):
        make_rlm(server, tmp_path, cache_subcalls="yes")


async def test_waiters_send_their_own_call_when_the_first_is_cancelled_or_fails():
    cache = CallCache()
    gate = asyncio.Event()
    sent: list[str] = []

    async def slow() -> LMResponse:
        sent.append("first")
        await gate.wait()
        raise AssertionError("never reached")

    async def fine() -> LMResponse:
        sent.append("second")
        return LMResponse("answer", 1, 1)

    first = asyncio.ensure_future(cache.answer("k", slow))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(cache.answer("k", fine))
    await asyncio.sleep(0)
    first.cancel()
    got = await waiter
    assert sent == ["first", "second"] and not isinstance(got, Cached) and got.text == "answer"
    stored = await cache.answer("k", fine)
    assert isinstance(stored, Cached) and not stored.waited and sent == ["first", "second"]

    async def boom() -> LMResponse:
        raise RuntimeError("provider down")

    with pytest.raises(RuntimeError):
        await cache.answer("other", boom)
    assert len(cache) == 1
