"""Prices from genai-prices' table: costs read from flat rates kept per process must be exactly what
genai-prices works out itself, for every model, and follow its data when that is replaced."""

from __future__ import annotations

import copy
import random
from decimal import Decimal

import pytest
from genai_prices import Usage, calc_price, data_snapshot, types

from recursa.lm.prices import PriceBook


def _genai_cost(
    provider: str, model: str, input_tokens: int, output_tokens: int, cached: int
) -> float | None:
    usage = Usage(input_tokens=input_tokens, output_tokens=output_tokens, cache_read_tokens=cached)
    try:
        return float(calc_price(usage, model_ref=model, provider_id=provider).total_price)
    except LookupError:
        return None


def test_every_table_model_costs_exactly_what_genai_prices_says() -> None:
    # Flat-rate models (most), tiered ones and those with dated or time-of-day prices alike.
    rng = random.Random(7)
    book = PriceBook()
    differ = []
    for provider in data_snapshot.get_snapshot().providers:
        for model in provider.models:
            for _ in range(2):
                input_tokens = rng.choice([0, 1, 17, 199_999, 200_001, rng.randrange(1, 2_000_000)])
                output_tokens = rng.randrange(0, 200_000)
                cached = rng.randrange(0, input_tokens + 1)
                want = _genai_cost(provider.id, model.id, input_tokens, output_tokens, cached)
                got = book.cost(provider.id, model.id, input_tokens, output_tokens, cached)
                if got != want:
                    differ.append((provider.id, model.id, input_tokens, output_tokens, cached, got, want))
    assert not differ, differ[:5]


def test_repeated_costs_agree_and_cached_tokens_are_capped_at_the_input() -> None:
    book = PriceBook()
    for _ in range(3):  # the first call reads the rates, the next ones use them
        assert book.cost("openai", "gpt-4o-mini", 5_000, 700, 1_000) == _genai_cost(
            "openai", "gpt-4o-mini", 5_000, 700, 1_000
        )
    assert book.cost("openai", "gpt-4o-mini", 10, 0, 50) == _genai_cost("openai", "gpt-4o-mini", 10, 0, 10)
    assert book.worst_case("openai", "gpt-4o-mini", 10, 5) == _genai_cost("openai", "gpt-4o-mini", 10, 5, 0)


def test_unknown_models_stay_unknown_for_every_book() -> None:
    for _ in range(2):
        book = PriceBook()
        assert not book.known("openai", "no-such-model-xyz")
        assert book.cost("openai", "no-such-model-xyz", 10, 10) is None
        assert book.price("openai", "no-such-model-xyz") is None


def test_new_genai_data_is_read_again() -> None:
    # UpdatePrices (genai-prices' own updater) swaps in a new snapshot: costs follow it at once.
    book = PriceBook()
    before = book.cost("openai", "gpt-4o-mini", 1_000_000, 0)
    providers = copy.deepcopy(data_snapshot.get_snapshot().providers)
    openai = next(p for p in providers if p.id == "openai")
    model = next(m for m in openai.models if m.is_match("gpt-4o-mini"))
    assert isinstance(model.prices, types.ModelPrice)
    object.__setattr__(model.prices, "input_mtok", Decimal("7"))
    data_snapshot.set_custom_snapshot(data_snapshot.DataSnapshot(providers=providers, from_auto_update=True))
    try:
        assert book.cost("openai", "gpt-4o-mini", 1_000_000, 0) == pytest.approx(7.0)
    finally:
        data_snapshot.set_custom_snapshot(None)
    assert book.cost("openai", "gpt-4o-mini", 1_000_000, 0) == before


def test_a_model_genai_prices_cannot_price_at_the_probe_points_is_asked_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Data where pricing an empty call fails (a rule on zero usage, say): no flat rates are read,
    # and each cost is genai-prices' own, as before the rates were kept.
    from recursa.lm import prices

    def picky(usage: Usage, **kwargs: object) -> object:
        if not usage.input_tokens and not usage.output_tokens:
            raise ValueError("no usage to price")
        return calc_price(usage, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prices, "_TABLE", prices._Table())
    monkeypatch.setattr(prices.genai(), "calc_price", picky)
    book = PriceBook()
    assert book.cost("openai", "gpt-4o-mini", 5_000, 700, 1_000) == _genai_cost(
        "openai", "gpt-4o-mini", 5_000, 700, 1_000
    )
    assert prices._TABLE.entry("openai", "gpt-4o-mini") is prices._PER_CALL
    assert book.cost("openai", "no-such-model-xyz", 10, 10) is None
