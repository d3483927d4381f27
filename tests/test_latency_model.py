"""The fake server's latency model, prefix cache, cost ledger and /metrics, in virtual time.

Every expected number here is worked out by hand from the rules in recursa.testing.latency and
recursa.testing.prefix_cache; nothing is timed on the real clock.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from recursa.lm.tokens import count_message_tokens
from recursa.testing.fake_server import FakeServer, VirtualClock
from recursa.testing.latency import PROFILES, LatencyProfile, SimRequest, get_profile, simulate
from recursa.testing.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys

SYSTEM = "s" * 640  # 160 content tokens + 4 role tokens = 164 tokens: 10 full blocks and 4 over


def reply_ok(model: str, messages: list[dict[str, str]]) -> str:
    return "x" * 40  # 10 output tokens


def times(results: list) -> list[tuple[float, float, float]]:
    return [(round(r.started, 9), round(r.first_token, 9), round(r.finished, 9)) for r in results]


# -- the simulation -------------------------------------------------------------------------------


def test_slots_queue_fifo_and_time_to_first_token() -> None:
    profile = LatencyProfile(base_s=0.1, slots=2)
    out = simulate(profile, [SimRequest(0.0)] * 4)
    assert times(out) == [(0, 0.1, 0.1), (0, 0.1, 0.1), (0.1, 0.2, 0.2), (0.1, 0.2, 0.2)]
    assert [round(r.queue_wait, 9) for r in out] == [0, 0, 0.1, 0.1]
    # Later arrivals queue behind earlier ones even when listed first.
    late_first = simulate(
        LatencyProfile(base_s=0.1, slots=1), [SimRequest(0.05), SimRequest(0.0), SimRequest(0.05)]
    )
    assert [round(r.started, 9) for r in late_first] == [0.1, 0.0, 0.2]


def test_prefill_counts_only_uncached_tokens() -> None:
    profile = LatencyProfile(base_s=0.05, prefill_tokens_per_s=1000)
    out = simulate(profile, [SimRequest(0.0, uncached_tokens=100), SimRequest(1.0, uncached_tokens=0)])
    assert round(out[0].ttft, 9) == 0.15
    assert round(out[1].ttft, 9) == 0.05


def test_decode_slows_with_active_sequences() -> None:
    alone = simulate(LatencyProfile(per_token_s=0.01, contention=0.5), [SimRequest(0.0, output_tokens=10)])
    assert round(alone[0].finished, 9) == 0.1
    # Two decode together at 0.01 * 1.5 s per token; when the short one ends the long one speeds up:
    # A: 10 tokens done at 0.15; B: 10 of 20 by then, the last 10 alone at 0.01 -> 0.25.
    both = simulate(
        LatencyProfile(per_token_s=0.01, contention=0.5),
        [SimRequest(0.0, output_tokens=10), SimRequest(0.0, output_tokens=20)],
    )
    assert [round(r.finished, 9) for r in both] == [0.15, 0.25]


def test_fanout_profile_gives_the_ideal_waves() -> None:
    out = simulate(get_profile("fanout"), [SimRequest(0.0)] * 256)
    assert round(max(r.finished for r in out), 9) == 0.8  # 4 waves of 64 at 0.2 s
    assert get_profile("fanout", slots=128).slots == 128
    with pytest.raises(KeyError, match="unknown latency profile"):
        get_profile("nope")


# -- the prefix cache -----------------------------------------------------------------------------


def test_prefix_cache_counts_leading_full_blocks() -> None:
    cache = PrefixCache(capacity_blocks=1000)
    first = [{"role": "system", "content": SYSTEM}]
    assert cache.lookup_and_store(first) == (0, 164)
    longer = [*first, {"role": "user", "content": "u" * 400}]
    total = count_message_tokens(longer)
    assert cache.lookup_and_store(longer) == (160, total)  # block 11 mixes system and user tokens
    # A full repeat: at least the last token is computed, so (total - 1) // 16 blocks at most.
    assert cache.lookup_and_store(longer) == ((total - 1) // BLOCK_TOKENS * BLOCK_TOKENS, total)
    assert cache.hit_ratio == pytest.approx((160 + (total - 1) // 16 * 16) / (164 + 2 * total))


def test_a_reply_is_cached_for_the_next_turn_that_carries_it() -> None:
    # SYSTEM is 160 tokens of content + 4 role tokens; the reply is 96 tokens + 4 role tokens.
    cache = PrefixCache(capacity_blocks=1000)
    prompt = [{"role": "system", "content": SYSTEM}]
    reply = "r" * 384
    assert cache.lookup_and_store(prompt) == (0, 164)
    cache.store_generated(prompt, reply)
    turn2 = [*prompt, {"role": "assistant", "content": reply}, {"role": "user", "content": "u" * 64}]
    total = count_message_tokens(turn2)
    assert total == 164 + 100 + 20
    # prompt + reply = 264 tokens = 16 full blocks, all stored when the reply finished
    assert cache.lookup_and_store(turn2) == (16 * BLOCK_TOKENS, total)
    # without the reply's blocks only the prompt's 10 full blocks would have hit
    fresh = PrefixCache(capacity_blocks=1000)
    fresh.lookup_and_store(prompt)
    assert fresh.lookup_and_store(turn2) == (10 * BLOCK_TOKENS, total)


def test_prefix_blocks_chain_on_their_parent() -> None:
    a = [{"role": "user", "content": "a" * 64 + "b" * 64}]
    b = [{"role": "user", "content": "c" * 64 + "b" * 64}]
    keys_a, _ = block_keys(a)
    keys_b, _ = block_keys(b)
    assert keys_a[1] != keys_b[1]  # same tokens, different prefix: a different block
    cache = PrefixCache(capacity_blocks=1000)
    cache.lookup_and_store(a)
    assert cache.lookup_and_store(b)[0] == 0


def test_prefix_cache_evicts_least_recently_used() -> None:
    cache = PrefixCache(capacity_blocks=10)
    a = [{"role": "system", "content": SYSTEM}]
    b = [{"role": "system", "content": "t" * 640}]
    cache.lookup_and_store(a)
    assert len(cache) == 10
    cache.lookup_and_store(b)  # ten new blocks push all of a's out
    assert cache.evictions == 10
    assert cache.lookup_and_store(a)[0] == 0
    assert PrefixCache(0).lookup_and_store(a) == (0, 164)


# -- the server in virtual time -------------------------------------------------------------------


def test_virtual_server_times_requests_exactly() -> None:
    clock = VirtualClock()
    with (
        FakeServer(responder=reply_ok, clock=clock, latency_s=0.2, per_output_token_s=0.01, slots=2) as srv,
        openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client,
    ):
        for _ in range(3):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        clock.advance(1.0)
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "x" * 40
        sim = srv.simulate()
    # Three arrive at 0 with 2 slots: two run 0-0.3 (0.2 + 10 x 0.01), the third 0.3-0.6.
    assert [(round(s.started, 9), round(s.finished, 9)) for s in sim.values()] == [
        (0, 0.3),
        (0, 0.3),
        (0.3, 0.6),
        (1.0, 1.3),
    ]
    assert round(sim[2].queue_wait, 9) == 0.3 and round(sim[2].ttft, 9) == 0.5


def test_virtual_queue_full_answers_429_then_recovers() -> None:
    clock = VirtualClock()
    with (
        FakeServer(
            responder=reply_ok, clock=clock, latency_s=1.0, slots=1, max_queue=0, retry_after_s=2
        ) as srv,
        httpx.Client(base_url=srv.base_url) as http,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/chat/completions", json=body).status_code == 200
        busy = http.post("/chat/completions", json=body)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "2"
        clock.advance(1.0)  # the first request is done at t = 1.0
        assert http.post("/chat/completions", json=body).status_code == 200
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_cached_tokens_in_usage_cost_ledger_and_metrics() -> None:
    profile = LatencyProfile(
        cache_blocks=1000, input_per_mtok=1.0, cached_input_per_mtok=0.1, output_per_mtok=4.0
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "question"}]
    total = count_message_tokens(messages)  # 164 + 4 + 2 = 170
    with (
        FakeServer(responder=reply_ok, profile=profile, clock=VirtualClock()) as srv,
        openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as client,
    ):
        first = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        second = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        an = anthropic.Anthropic(base_url=srv.root_url, api_key="k", max_retries=0).messages.create(
            model="m", max_tokens=100, system=SYSTEM, messages=[{"role": "user", "content": "question"}]
        )
        metrics = httpx.get(f"{srv.root_url}/metrics").text
        ledger = httpx.get(f"{srv.root_url}/ledger").json()
        assert first.usage is not None and second.usage is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
        assert second.usage.prompt_tokens == total
        assert second.usage.prompt_tokens_details.cached_tokens == 160  # type: ignore[union-attr]
        # Anthropic caches only what a request marks with cache_control: nothing here.
        assert (an.usage.input_tokens, an.usage.cache_read_input_tokens) == (total, 0)
        cost = srv.cost_usd()["m"]
        expected = (2 * (total * 1.0 + 10 * 4.0) + (total - 160) * 1.0 + 160 * 0.1 + 10 * 4.0) / 1e6
        assert cost == pytest.approx(expected)
        assert srv.totals()["m"]["cached_tokens"] == 160
    assert 'fake_requests_total{model="m",status="200"} 3' in metrics
    assert 'fake_cached_prompt_tokens_total{model="m"} 160' in metrics
    assert f"fake_prefix_cache_hit_ratio {160 / (2 * total):.6f}" in metrics  # the OpenAI requests'
    assert [r["cached_tokens"] for r in ledger] == [0, 160, 0]


def test_profiles_give_defaults_and_arguments_override() -> None:
    srv = FakeServer(profile="fanout", latency_s=0.05)
    assert (srv.latency_s, srv.slots, srv.profile.cache_blocks) == (0.05, 64, PROFILES["fanout"].cache_blocks)
    plain = FakeServer()
    assert (plain.latency_s, plain.slots, plain.cache.capacity_blocks) == (0.0, 64, 0)
    vllm = FakeServer(profile="vllm-small")
    assert vllm.max_context_tokens == 131_072 and vllm.contention > 0


def test_cli_profile_serves_metrics() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recursa.testing.fake_server",
            "--port",
            "0",
            "--profile",
            "fanout",
            "--latency",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        root = proc.stdout.readline().rsplit(" ", 1)[-1].strip()
        assert "fake_slots 64" in httpx.get(f"{root}/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _side_by_side_smoke(case: str) -> str:
    """One case of the benchmark script at tiny sizes, recursa side only (the official package is
    not installed in CI); its printed tables."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_official" / "run.py"
    out = subprocess.run(
        [sys.executable, str(script), case, "--smoke", "--engines", "recursa"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_side_by_side_benchmark_smoke() -> None:
    row = next(line for line in _side_by_side_smoke("cache").splitlines() if line.startswith("| recursa"))
    later = float(row.split("|")[-2].strip().rstrip("%"))
    assert later >= 90.0, row  # append-only root history: later turns hit the prefix cache


@pytest.mark.serial  # samples memory while the run holds its buffer: not beside another test
def test_memory_benchmark_smoke_counts_the_context_buffer() -> None:
    """The memory case at 1 MB: the context's buffer (a memfd, in no process's RSS) is measured."""
    tables = _side_by_side_smoke("memory")
    row = next(line for line in tables.splitlines() if line.startswith("| 1 MB | recursa"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].endswith("MB") and float(cells[3].split()[0]) >= 1, row  # buffer +
    assert float(cells[6].rstrip("x")) >= 0 and int(cells[7].replace(",", "")) < 50_000, row
