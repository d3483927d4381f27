"""`GET /metrics` of the fake model server: its ledger and prefix cache in Prometheus text format."""

from __future__ import annotations

from recursa.testing.host import FakeHost


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(server: FakeHost) -> str:
    records = server.ledger.snapshot()
    by_status: dict[tuple[str, int], int] = {}
    per_model: dict[str, list[float]] = {}  # prompt, cached, completion, cost, ttft sum, ttft count
    for rec in records:
        if rec.status == 0:  # still running
            continue
        by_status[(rec.model, rec.status)] = by_status.get((rec.model, rec.status), 0) + 1
        if not rec.ok:
            continue
        row = per_model.setdefault(rec.model, [0.0] * 6)
        row[0] += rec.prompt_tokens
        row[1] += rec.cached_tokens
        row[2] += rec.completion_tokens
        row[3] += rec.cost_usd
        if rec.first_token_at:
            row[4] += rec.ttft_s
            row[5] += 1
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    family("fake_requests_total", "counter", "Finished model requests by model and HTTP status.")
    for (model, status), n in sorted(by_status.items()):
        lines.append(f'fake_requests_total{{model="{_label(model)}",status="{status}"}} {n}')
    counters = [
        ("fake_prompt_tokens_total", 0, "Prompt tokens of successful requests."),
        ("fake_cached_prompt_tokens_total", 1, "Prompt tokens served from the prefix cache."),
        ("fake_completion_tokens_total", 2, "Completion tokens of successful requests."),
        ("fake_cost_usd_total", 3, "Cost at the profile's prices."),
        ("fake_time_to_first_token_seconds_sum", 4, "Sum of real times to first token."),
        ("fake_time_to_first_token_seconds_count", 5, "Requests with a first token."),
    ]
    for name, col, help_text in counters:
        family(name, "counter", help_text)
        for model, row in sorted(per_model.items()):
            value = row[col]
            text = f"{value:.9g}" if col == 3 or col == 4 else str(int(value))
            lines.append(f'{name}{{model="{_label(model)}"}} {text}')
    gauges = [
        ("fake_in_flight", server.ledger.in_flight, "Requests holding a concurrency slot."),
        ("fake_max_in_flight", server.ledger.max_in_flight, "Most requests ever holding a slot at once."),
        ("fake_queue_waiting", server.gate.waiting, "Requests waiting for a slot."),
        ("fake_slots", server.slots, "Concurrency slots."),
        ("fake_prefix_cache_blocks", len(server.cache), "16-token blocks in the prefix cache."),
        ("fake_prefix_cache_evictions_total", server.cache.evictions, "Blocks evicted (LRU)."),
    ]
    for name, value, help_text in gauges:
        family(name, "counter" if name.endswith("_total") else "gauge", help_text)
        lines.append(f"{name} {value}")
    family("fake_prefix_cache_hit_ratio", "gauge", "Cached over all prompt tokens looked up.")
    lines.append(f"fake_prefix_cache_hit_ratio {server.cache.hit_ratio:.6f}")
    return "\n".join(lines) + "\n"
