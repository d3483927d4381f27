"""Token and cost accounting values, summed over a whole call tree."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # input tokens read from the provider's prompt cache (part of input_tokens)
    cache_write_tokens: int = 0  # input tokens written to it (Anthropic bills these above input)
    cost_usd: float = 0.0
    llm_calls: int = 0  # calls sent to a model
    cache_hits: int = 0  # sub-calls answered by recursa's call cache instead (not in llm_calls)
    cache_saved_usd: float = 0.0  # what those would have cost, had they been sent

    def add(self, other: ModelUsage) -> None:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens
        self.cache_write_tokens += other.cache_write_tokens
        self.cost_usd += other.cost_usd
        self.llm_calls += other.llm_calls
        self.cache_hits += other.cache_hits
        self.cache_saved_usd += other.cache_saved_usd

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_dict(self) -> dict[str, float | int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "cost_usd": round(self.cost_usd, 10),
            "llm_calls": self.llm_calls,
            "cache_hits": self.cache_hits,
            "cache_saved_usd": round(self.cache_saved_usd, 10),
        }


@dataclass
class Usage(ModelUsage):
    """Totals plus a per-model breakdown (`by_model[model] -> ModelUsage`)."""

    by_model: dict[str, ModelUsage] = field(default_factory=dict)

    def record(self, model: str, call: ModelUsage) -> None:
        self.add(call)
        self.by_model.setdefault(model, ModelUsage()).add(call)

    def to_dict(self) -> dict:  # type: ignore[override]
        out: dict = super().to_dict()
        out["by_model"] = {m: u.to_dict() for m, u in self.by_model.items()}
        return out
