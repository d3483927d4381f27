"""What model calls cost: the user's overrides first, then genai-prices' bundled, tier-aware table.

genai-prices works a cost out from scratch on every call (about 60 us, and a budgeted call asks
for three: its worst case, cached and not, and what it cost). Most of its models charge one flat
rate per kind of token; for those the rates are read once per process (by asking genai-prices
itself) and every cost after that is the same Decimal sum it would make. Models with tiers or
dated / time-of-day prices still go to genai-prices for every call.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from decimal import Decimal
from types import ModuleType
from typing import TYPE_CHECKING, Any

from recursa.errors import ConfigError

if TYPE_CHECKING:
    from genai_prices import Usage

_FREE_PROVIDERS = frozenset({"scripted"})


@functools.cache
def genai() -> ModuleType:
    """genai-prices, imported on the first price or window looked up: its table and types take
    longer to import than the rest of recursa, and a run of scripted or overridden models never
    needs them (nor `recursa --help`)."""
    import genai_prices
    import genai_prices.data_snapshot
    import genai_prices.types

    return genai_prices


@dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens. Cache reads and writes fall back to the input rate when not given."""

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    def __post_init__(self) -> None:
        # A negative or NaN rate would make every cap in dollars hold nothing back.
        for name, rate in vars(self).items():
            if rate is not None and not (isinstance(rate, int | float) and rate >= 0):
                raise ConfigError(f"ModelPrice({name}={rate!r}): a rate is USD per million tokens, a number >= 0")

    def cost(
        self, input_tokens: int, output_tokens: int, cached_tokens: int = 0, cache_write_tokens: int = 0
    ) -> float:
        """Cost of one call; ``cached_tokens`` and ``cache_write_tokens`` are part of ``input_tokens``."""
        cached, written = _cache_split(input_tokens, cached_tokens, cache_write_tokens)
        cached_rate = (
            self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        )
        write_rate = self.input_per_mtok if self.cache_write_per_mtok is None else self.cache_write_per_mtok
        return (
            (input_tokens - cached - written) * self.input_per_mtok
            + cached * cached_rate
            + written * write_rate
            + output_tokens * self.output_per_mtok
        ) / 1e6


FREE = ModelPrice(0.0, 0.0, 0.0, 0.0)


def _cache_split(input_tokens: int, cached_tokens: int, cache_write_tokens: int) -> tuple[int, int]:
    """(cache reads, cache writes) clamped so that together they fit in ``input_tokens``."""
    cached = max(0, min(cached_tokens, input_tokens))
    return cached, max(0, min(cache_write_tokens, input_tokens - cached))


def _as_price(key: str, value: ModelPrice | dict[str, Any]) -> ModelPrice:
    if isinstance(value, ModelPrice):
        return value
    if isinstance(value, dict):
        try:
            return ModelPrice(**value)
        except TypeError as err:
            raise ConfigError(
                f"price override for {key!r} must have input_per_mtok, output_per_mtok and optionally "
                f"cached_input_per_mtok and cache_write_per_mtok (USD per million tokens): {err}"
            ) from None
    raise ConfigError(
        f"price override for {key!r} must be a ModelPrice or a dict, got {type(value).__name__}"
    )


def _base_rate(value: Any) -> float | None:
    """A genai-prices rate as a float: a Decimal, or tiered prices (their base tier)."""
    if value is None:
        return None
    if isinstance(value, Decimal | int | float):
        return float(value)
    base = getattr(value, "base", None)
    return float(base) if base is not None else None


@dataclass(frozen=True)
class _FlatRates:
    """USD per request and per token of each kind, as genai-prices' own Decimals."""

    request: Decimal
    uncached: Decimal
    cached: Decimal
    output: Decimal
    written: Decimal

    def total(self, input_tokens: int, output_tokens: int, cached_tokens: int, written: int = 0) -> Decimal:
        return (
            self.request
            + (input_tokens - cached_tokens - written) * self.uncached
            + cached_tokens * self.cached
            + written * self.written
            + output_tokens * self.output
        )


# Points where a model's flat rates must give exactly what genai-prices gives, or the model is
# priced by genai-prices on every call: (input, output, cached, cache-written) tokens.
_CHECKS = ((1000, 7, 0, 0), (123_457, 98_765, 4_321, 1_234), (9_999_991, 3, 9_999_990, 0), (5000, 1, 0, 5000))
_UNKNOWN = object()  # no price in the table
_PER_CALL = object()  # priced, but not at flat rates: genai-prices works out every call


class _Table:
    """genai-prices' answers that do not change while its data does not, for every PriceBook in the
    process: which models it prices at all, and the flat rates of those priced that way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: object = None  # the genai-prices snapshot the entries were read from
        self._entries: dict[tuple[str, str], object] = {}

    def entry(self, provider: str, model: str) -> object:
        """_UNKNOWN, _PER_CALL or the model's _FlatRates."""
        data = genai().data_snapshot.get_snapshot()  # replaced when genai-prices' data is updated
        key = (provider, model)
        with self._lock:
            if data is not self._data:
                self._data, self._entries = data, {}
            found = self._entries.get(key)
        if found is None:
            found = _read_entry(provider, model)
            with self._lock:
                if data is self._data:
                    self._entries[key] = found
        return found


def _genai_total(
    provider: str, model: str, input_tokens: int, output_tokens: int, cached: int, written: int = 0
) -> Any:
    usage = genai().Usage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cache_read_tokens=cached,
        cache_write_tokens=written,
    )
    return genai().calc_price(usage, model_ref=model, provider_id=provider)


def _read_entry(provider: str, model: str) -> object:
    try:
        calc = _genai_total(provider, model, 0, 0, 0)
    except LookupError:
        return _UNKNOWN
    except Exception:  # cannot price an empty call: left to genai-prices on every call, as before
        return _PER_CALL
    try:
        return _flat_rates(provider, model, calc)
    except Exception:  # a model genai-prices cannot price at these points: asked on every call instead
        return _PER_CALL


def _flat_rates(provider: str, model: str, calc: Any) -> object:
    prices = calc.model.prices
    if not isinstance(prices, genai().types.ModelPrice) or any(
        isinstance(v, genai().types.TieredPrices) for v in calc.model_price.__dict__.values()
    ):
        return _PER_CALL  # tiers by prompt size, or prices that depend on the date or the hour
    request = calc.total_price

    def rate(input_tokens: int, output_tokens: int, cached: int, written: int = 0) -> Decimal:
        return _genai_total(provider, model, input_tokens, output_tokens, cached, written).total_price - request

    rates = _FlatRates(request, rate(1, 0, 0), rate(1, 0, 1), rate(0, 1, 0), rate(1, 0, 0, 1))
    for point in _CHECKS:
        if rates.total(*point) != _genai_total(provider, model, *point).total_price:
            return _PER_CALL
    return rates


_TABLE = _Table()


class PriceBook:
    """Prices keyed by "provider/model" (or a bare "model" that applies under every provider)."""

    def __init__(self, overrides: dict[str, ModelPrice | dict[str, Any]] | None = None) -> None:
        self.overrides = {key: _as_price(key, value) for key, value in (overrides or {}).items()}
        self._table_cache: dict[tuple[str, str], ModelPrice | None] = {}

    def _override(self, provider: str, model: str) -> ModelPrice | None:
        return self.overrides.get(f"{provider}/{model}") or self.overrides.get(model)

    def _genai(self, provider: str, model: str, usage: Usage) -> Any | None:
        try:
            return genai().calc_price(usage, model_ref=model, provider_id=provider)
        except LookupError:
            return None

    def price(self, provider: str, model: str) -> ModelPrice | None:
        """Base per-token rates, or None when nobody knows this model's price.

        For tiered models (long-context surcharges) this is the first tier; `cost` applies tiers.
        """
        if provider in _FREE_PROVIDERS:
            return FREE
        found = self._override(provider, model)
        if found is not None:
            return found
        key = (provider, model)
        if key not in self._table_cache:
            if _TABLE.entry(provider, model) is _UNKNOWN:  # known once per process, not per book
                return None
            calc = self._genai(provider, model, genai().Usage(input_tokens=1, output_tokens=1))
            if calc is None:
                self._table_cache[key] = None
            else:
                mp = calc.model_price
                self._table_cache[key] = ModelPrice(
                    input_per_mtok=_base_rate(getattr(mp, "input_mtok", None)) or 0.0,
                    output_per_mtok=_base_rate(getattr(mp, "output_mtok", None)) or 0.0,
                    cached_input_per_mtok=_base_rate(getattr(mp, "cache_read_mtok", None)),
                    cache_write_per_mtok=_base_rate(getattr(mp, "cache_write_mtok", None)),
                )
        return self._table_cache[key]

    def known(self, provider: str, model: str) -> bool:
        return self.price(provider, model) is not None

    def cost(
        self,
        provider: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None:
        """USD for one call (``cached_tokens`` read from and ``cache_write_tokens`` written to the
        provider's prompt cache are part of ``input_tokens``), or None if unpriced."""
        if provider in _FREE_PROVIDERS:
            return 0.0
        found = self._override(provider, model)
        if found is not None:
            return found.cost(input_tokens, output_tokens, cached_tokens, cache_write_tokens)
        entry = _TABLE.entry(provider, model)
        if entry is _UNKNOWN:
            return None
        cached, written = _cache_split(input_tokens, cached_tokens, cache_write_tokens)
        if isinstance(entry, _FlatRates):
            return float(entry.total(input_tokens, output_tokens, cached, written))
        calc = self._genai(
            provider,
            model,
            genai().Usage(
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                cache_read_tokens=cached,
                cache_write_tokens=written,
            ),
        )
        return None if calc is None else float(calc.total_price)

    def worst_case(self, provider: str, model: str, input_tokens: int, output_tokens: int) -> float | None:
        """The most a call of this size can cost: every input token at the uncached rate.

        What a budget reserves before sending the call.
        """
        return self.cost(provider, model, input_tokens, output_tokens, cached_tokens=0)
