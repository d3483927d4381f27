"""One benchmark row: build the task instance (anywhere: the driver or a Ray actor), run one method
on it, score it, and describe the run as a plain JSON-friendly dict."""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from recursa.bench.results import RowStatus, clip
from recursa.bench.sizes import CHARS_PER_TOKEN
from recursa.budget import Budget
from recursa.lm.prices import PriceBook
from recursa.lm.registry import parse_model
from recursa.methods.base import MethodSettings, get_method
from recursa.tasks import generate
from recursa.tasks.base import Task, context_chars
from recursa.usage import Usage

# What scripted models' tokens are priced as in reports (the paper's GPT-5 root, GPT-5-mini sub-calls),
# so offline runs show cost shapes; the row says so in `cost_basis`.
SCRIPTED_PRICE_AS = {"root": "openai/gpt-5", "oracle": "openai/gpt-5-mini"}


@dataclass(frozen=True)
class InstanceSpec:
    """How to rebuild one task instance: a generated family at a size and seed, or a row of a file."""

    family: str
    seed: int
    size_tokens: int | None = None
    knobs: tuple[tuple[str, Any], ...] = ()
    data_path: str | None = None
    data_index: int | None = None


@dataclass
class RunConfig:
    """What every row of a benchmark shares, so rows compare: the methods' settings, and the real
    models that scripted models' tokens are priced as in the reports."""

    settings: MethodSettings
    price_as: dict[str, str] | None = None

    def public(self) -> dict[str, Any]:
        """The settings for config.json and the summary: never a key, nor MCP servers' entries (their
        environment may hold one)."""
        run = {k: v for k, v in self.settings.run.items() if k not in _PRIVATE}
        if isinstance(run.get("budget"), Budget):
            run["budget"] = asdict(run["budget"])
        return {
            "model": self.settings.model,
            "sub_model": self.settings.sub_model,
            **run,
            **self.settings.options.model_dump(),
            "price_as": self.price_as,
        }


_PRIVATE = ("api_key", "mcp_servers", "on_event")


@lru_cache(maxsize=4)
def _loaded(family: str, path: str) -> tuple[Task, ...]:
    from recursa.tasks.loaders import load

    return tuple(load(family, path))


def build_task(spec: InstanceSpec) -> Task:
    if spec.data_path is not None:
        tasks = _loaded(spec.family, spec.data_path)
        return tasks[spec.data_index or 0]
    assert spec.size_tokens is not None
    return generate(spec.family, spec.size_tokens * CHARS_PER_TOKEN, seed=spec.seed, **dict(spec.knobs))


def instance_id(spec: InstanceSpec) -> str:
    """The task id a spec generates, without generating it (for resume checks)."""
    from recursa.tasks.base import get_family, task_id

    if spec.data_path is not None:
        return f"{Path(spec.data_path).name}#{spec.data_index}"
    assert spec.size_tokens is not None
    fam = get_family(spec.family)
    return task_id(
        spec.family,
        spec.size_tokens * CHARS_PER_TOKEN,
        spec.seed,
        {**fam.knobs, **dict(spec.knobs)},
        fam.knobs,
    )


def estimate_cost(usage: Usage, price_as: dict[str, str] | None) -> tuple[float, str]:
    """The run's cost in USD and its basis: the provider's, or scripted tokens priced as real models."""
    scripted = [m for m in usage.by_model if m.startswith("scripted/")]
    if not scripted:
        return usage.cost_usd, "provider"
    mapping = price_as or SCRIPTED_PRICE_AS
    book = PriceBook()
    total = usage.cost_usd
    used: set[str] = set()
    for model, part in usage.by_model.items():
        if not model.startswith("scripted/"):
            continue
        role = "oracle" if model.split("/", 1)[1].startswith("oracle") else "root"
        real = mapping.get(model) or mapping.get(role)
        if not real:
            continue
        provider, name = parse_model(real)
        cost = book.cost(provider, name, part.input_tokens, part.output_tokens, part.cached_tokens)
        if cost is not None:
            total += cost
            used.add(f"{model.split(':', 1)[0]} as {real}")
    return total, ("priced as " + ", ".join(sorted(used))) if used else "provider"


def _status(stop_reason: str, failure: str | None) -> RowStatus:
    if failure:
        return "failed"  # the method failed the way it is expected to (past its window, over budget)
    if stop_reason in ("final", "max_iterations"):
        return "ok"
    if stop_reason in ("timeout", "budget"):
        return "failed"
    return "error"


async def run_row(task: Task, method: str, config: RunConfig, spec: InstanceSpec) -> dict[str, Any]:
    """Run `method` on `task`; never raises for a failed run (the row records it)."""
    started = time.time()
    base: dict[str, Any] = {
        "instance": instance_id(spec),
        "task_id": task.id,
        "family": task.family,
        "source": task.meta.get("source", "generated"),
        "size_chars": context_chars(task.context),
        "size_tokens": context_chars(task.context) // CHARS_PER_TOKEN,
        "target_tokens": spec.size_tokens,
        "seed": spec.seed,
        "knobs": dict(spec.knobs),
        "method": method,
        "model": config.settings.model,
        "sub_model": config.settings.sub_model or config.settings.model,
        "started_at": round(started, 3),
        "worker_pid": os.getpid(),  # which process ran it (the driver, or a Ray actor)
    }
    try:
        result = await get_method(method).run(task, config.settings)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug or a broken environment: recorded, retried on the next run
        return {
            **base,
            "status": "error",
            "score": None,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=6),
            "latency_s": round(time.time() - started, 4),
        }
    status = _status(result.stop_reason, result.failure)
    score = task.score(result.answer) if status != "error" else None
    metrics = task.metrics(result.answer) if status != "error" else {}
    cost, basis = estimate_cost(result.usage, config.price_as)
    return {
        **base,
        "status": status,
        "answer": clip(result.answer),
        "answer_chars": len(result.answer),
        "gold": clip(task.gold),
        "score": score,
        "metrics": metrics,
        "usage": result.usage.to_dict(),
        "total_tokens": result.usage.input_tokens + result.usage.output_tokens,
        "cost_usd": round(cost, 8),
        "cost_basis": basis,
        "latency_s": round(result.latency_s, 4),
        "iterations": result.iterations,
        "sub_calls": result.sub_calls,
        "stop_reason": result.stop_reason,
        "trace_path": result.trace_path,
        "error": result.error,
        "failure": result.failure,
    }


def unreachable(row: dict[str, Any]) -> bool:
    """A row that failed because the model server could not be reached at all."""
    error = str(row.get("error") or "")
    return row.get("status") == "error" and ("cannot connect to" in error or "timed out connecting" in error)
