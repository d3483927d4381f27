"""Provider prompt caching: Anthropic cache_control marks on the root's turns, cache reads and
writes read and priced, OpenAI's prompt_cache_key; the fake server caching as each provider does."""

from __future__ import annotations

import itertools

import anthropic
import pytest
from genai_prices import Usage, calc_price

from recursa import RLM
from recursa.lm.base import CallMeta, LMRequest
from recursa.lm.openai_client import OpenAIClient
from recursa.lm.prices import ModelPrice, PriceBook
from recursa.testing.fake_server import FakeServer

MODEL = "claude-haiku-4-5"
LONG = "Background the model must keep in mind. " * 40  # ~400 fake tokens


def test_the_fake_server_caches_only_what_anthropic_requests_mark() -> None:
    marked = [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]
    with (
        FakeServer(responder=lambda m, msgs: "ok", min_cache_tokens=100) as srv,
        anthropic.Anthropic(base_url=srv.root_url, api_key="k", max_retries=0) as client,
    ):
        ask = [{"role": "user", "content": "q"}]
        first = client.messages.create(model=MODEL, max_tokens=50, system=marked, messages=ask)
        second = client.messages.create(model=MODEL, max_tokens=50, system=marked, messages=ask)
        plain = client.messages.create(model=MODEL, max_tokens=50, system=LONG, messages=ask)
        small = FakeServer(responder=lambda m, msgs: "ok")  # Anthropic's 1,024-token minimum
        with small, anthropic.Anthropic(base_url=small.root_url, api_key="k", max_retries=0) as c2:
            short = c2.messages.create(model=MODEL, max_tokens=50, system=marked, messages=ask)
    system_tokens = srv.requests[0].prompt_tokens - 5  # the user message is 4 + 1 tokens
    assert (first.usage.cache_creation_input_tokens, first.usage.cache_read_input_tokens) == (
        system_tokens,
        0,
    )
    assert (second.usage.cache_creation_input_tokens, second.usage.cache_read_input_tokens) == (
        0,
        system_tokens,
    )
    assert second.usage.input_tokens == 5
    assert (plain.usage.cache_creation_input_tokens, plain.usage.cache_read_input_tokens) == (0, 0)
    assert (short.usage.cache_creation_input_tokens, short.usage.cache_read_input_tokens) == (0, 0)


def root_turns(model: str, messages: list[dict]) -> str:
    if messages[0]["role"] != "system":
        return "sub answer"
    done = sum(1 for m in messages if m["role"] == "assistant")
    if done >= 3:
        return "FINAL(done)"
    return f"Step {done}.\n```repl\nprint(llm_query('same sub prompt ' * 300)[:4], 'x' * 2000)\n```"


def test_an_anthropic_root_writes_then_reads_its_history_and_pays_cache_prices(tmp_path) -> None:
    with FakeServer(responder=root_turns) as srv:
        rlm = RLM(f"anthropic/{MODEL}", base_url=srv.root_url, api_key="k", trace_dir=tmp_path)
        result = rlm.run("q", "ctx")
        records = list(srv.requests)
    assert result.answer == "done", result.error
    roots = [r for r in records if r.messages[0]["role"] == "system"]
    subs = [r for r in records if r.messages[0]["role"] != "system"]
    assert len(roots) == 4 and len(subs) == 3
    # Every root turn writes what is new; every turn after the first reads the turn before.
    assert all(r.cache_write_tokens > 0 for r in roots)
    assert roots[0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in roots[1:])
    for before, after in itertools.pairwise(roots):
        assert after.cached_tokens == before.cached_tokens + before.cache_write_tokens
    # Sub-calls carry no marks: a one-off write would cost 25% more than plain input.
    assert all(r.cached_tokens == 0 and r.cache_write_tokens == 0 for r in subs)
    usage = result.usage
    assert usage.cached_tokens == sum(r.cached_tokens for r in records)
    assert usage.cache_write_tokens == sum(r.cache_write_tokens for r in records)
    expected = sum(
        float(
            calc_price(
                Usage(
                    input_tokens=r.prompt_tokens,
                    output_tokens=r.completion_tokens,
                    cache_read_tokens=r.cached_tokens,
                    cache_write_tokens=r.cache_write_tokens,
                ),
                model_ref=MODEL,
                provider_id="anthropic",
            ).total_price
        )
        for r in records
    )
    assert usage.cost_usd == pytest.approx(expected, rel=1e-9)


async def test_openai_gets_prompt_cache_key_only_from_the_root_and_only_at_openai() -> None:
    sent: list[dict] = []

    async def post(path: str, body: dict, headers: dict) -> dict:
        sent.append(body)
        return {
            "choices": [{"message": {"content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }

    official = OpenAIClient("gpt-5-mini", api_key="sk-test")
    local = OpenAIClient("m", base_url="http://127.0.0.1:1/v1")
    for client in (official, local):
        client._http.post = post  # type: ignore[method-assign]
        for key in ("recursa-run_1", None):
            request = LMRequest([{"role": "user", "content": "q"}], 10, CallMeta("c"), cache_key=key)
            await client.complete(request)
        await client.aclose()
    assert [b.get("prompt_cache_key") for b in sent] == ["recursa-run_1", None, None, None]


def test_cache_writes_are_priced_from_genai_prices_and_overrides() -> None:
    book = PriceBook({"x/cheap": ModelPrice(1.0, 2.0, cached_input_per_mtok=0.1, cache_write_per_mtok=1.25)})
    for model in ("claude-haiku-4-5", "claude-sonnet-4-5"):  # flat rates, and tiers
        want = calc_price(
            Usage(input_tokens=5000, output_tokens=10, cache_read_tokens=1000, cache_write_tokens=3000),
            model_ref=model,
            provider_id="anthropic",
        ).total_price
        assert book.cost("anthropic", model, 5000, 10, 1000, 3000) == pytest.approx(float(want))
    assert book.cost("x", "cheap", 1_000_000, 0, 0, 1_000_000) == pytest.approx(1.25)
    assert book.cost("x", "cheap", 1_000_000, 0, 600_000, 600_000) == pytest.approx(0.06 + 0.4 * 1.25)
