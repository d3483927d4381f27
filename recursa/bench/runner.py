"""`recursa.bench.run(...)` and `recursa bench TASK ...`: rows for every (size, instance, method).

Rows are appended to `OUT/results.jsonl` as they finish; a re-run with the same `out` skips rows
already answered or cleanly failed and retries harness errors. After the run (also one cut short)
`summary.md` and the PNG plots are rewritten from every row in the file.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.bench.jobs import InstanceSpec, RunConfig, build_task, instance_id, run_row, unreachable
from recursa.bench.progress import BenchProgress
from recursa.bench.report import plots_skipped, write_plots, write_summary
from recursa.bench.results import ResultsFile
from recursa.bench.sizes import DEFAULT_SIZES, BenchError, parse_sizes
from recursa.budget import Budget
from recursa.config import BUDGET_CAPS, Spelling
from recursa.methods.base import METHODS, MethodSettings, missing_requirement
from recursa.overrides import budget_of
from recursa.sync import run_sync
from recursa.tasks import families, get_family

EXECUTORS = ("local", "ray")
SPELLING = Spelling("python", "recursa.bench.run")
DEFAULT_METHODS = ("base", "rlm")


@dataclass
class BenchReport:
    out: Path
    results_path: Path
    summary_path: Path
    plots: list[Path]
    rows: list[dict[str, Any]]  # every row in the results file after this run
    ran: int  # rows run by this call
    skipped: int  # rows found finished from an earlier run
    aborted: str | None = None  # why the run stopped early (rows finished before are kept)
    plots_skipped: str | None = None  # why no plots were written (matplotlib missing, nothing scored)
    new_rows: list[dict[str, Any]] = field(default_factory=list)

    def mean_score(self, method: str | None = None, family: str | None = None) -> float:
        rows = [
            r
            for r in self.rows
            if r.get("status") in ("ok", "failed")
            and (method is None or r["method"] == method)
            and (family is None or r["family"] == family)
        ]
        return sum(float(r.get("score") or 0) for r in rows) / len(rows) if rows else float("nan")


class BenchAborted(BenchError):
    pass


def _parse_methods(methods: str | Sequence[str]) -> list[str]:
    names = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise BenchError(
            f"unknown method(s) {', '.join(unknown) or '(none given)'}; methods: {', '.join(METHODS)}"
        )
    # A method that cannot run at all would give every one of its rows a harness error.
    missing = [why for why in map(missing_requirement, names) if why]
    if missing:
        raise BenchError("; ".join(missing))
    return names


def _parse_knobs(knobs: str | dict[str, Any] | None) -> dict[str, Any]:
    if knobs is None or isinstance(knobs, dict):
        return dict(knobs or {})
    out: dict[str, Any] = {}
    for item in knobs.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchError(f"knob {item!r} must look like name=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def _settings(
    model: str, sub_model: str | None, given: dict[str, Any], spelling: Spelling
) -> MethodSettings:
    """The rows' settings, checked before any row runs (and before the results file is touched): a
    wrong model name, provider, key or setting would only give every row a harness error. A budget's
    caps may come one by one (`max_usd=1.0`): each holds per row."""
    caps = {cap: given.pop(cap) for cap in BUDGET_CAPS if given.get(cap) is not None}
    if caps and isinstance(base := given.get("budget") or Budget(), Budget):
        given["budget"] = budget_of(caps, spelling, base=base)
    settings = MethodSettings(model, sub_model, spelling=spelling, **given)
    from recursa.rlm import RLM

    RLM.configured({"model": model, "sub_model": sub_model, **settings.run, "trace": False}, spelling)
    return settings


def plan(
    task: str,
    *,
    sizes: Sequence[int],
    n: int,
    seed: int,
    knobs: dict[str, Any],
    data: str | None,
) -> list[InstanceSpec]:
    if data is not None:
        from recursa.tasks.loaders import load

        loaded = load(task, data, limit=n if n > 0 else None)
        return [
            InstanceSpec(family=task, seed=0, data_path=str(Path(data).expanduser()), data_index=i)
            for i in range(len(loaded))
        ]
    if task not in families():
        raise BenchError(f"unknown task family {task!r}; families: {', '.join(families())}")
    fam = get_family(task)
    unknown = sorted(set(knobs) - set(fam.knobs))
    if unknown:
        raise BenchError(
            f"unknown knob(s) {', '.join(unknown)} for {task!r}; knobs: {', '.join(fam.knobs) or 'none'}"
        )
    frozen = tuple(sorted(knobs.items()))
    return [
        InstanceSpec(family=task, seed=seed + i, size_tokens=size, knobs=frozen)
        for size in sizes
        for i in range(n)
    ]


async def arun(
    task: str,
    *,
    sizes: str | Sequence[int] = DEFAULT_SIZES,
    n: int = 3,
    seed: int = 0,
    methods: str | Sequence[str] = DEFAULT_METHODS,
    model: str = "scripted/gpt5-like",
    sub_model: str | None = None,
    executor: str = "local",
    out: str | Path | None = None,
    knobs: str | dict[str, Any] | None = None,
    data: str | None = None,
    concurrency: int = 4,
    ray_actors: int = 2,
    ray_address: str | None = None,
    progress: bool = True,
    price_as: dict[str, str] | None = None,
    spelling: Spelling = SPELLING,
    **settings: Any,
) -> BenchReport:
    """Run the benchmark; see `run` for the arguments. `spelling`: how a bad setting is named (the
    CLI passes its flags')."""
    if executor not in EXECUTORS:
        raise BenchError(f"unknown executor {executor!r}; executors: {', '.join(EXECUTORS)}")
    method_names = _parse_methods(methods)
    size_list = parse_sizes(sizes) if data is None else [0]
    if n < 1:
        raise BenchError("n must be at least 1")
    if concurrency < 1 or ray_actors < 1:
        raise BenchError("concurrency and ray_actors must be at least 1 (instances, or Ray actors, at once)")
    if sub_model is None and model.startswith("scripted/"):
        sub_model = "scripted/oracle"  # a scripted root's default sub-model: the oracle
    out_dir = Path(out) if out is not None else Path("bench-results") / task
    if out_dir.exists() and not out_dir.is_dir():
        raise BenchError(
            f"out {str(out_dir)!r} is a file; give a folder for the results (re-use one to resume)"
        )
    if settings.get("sandbox") == "ray" and ray_address is not None:
        # The rows' REPLs join the cluster the rows run on (or, run locally, the one named).
        settings["sandbox_options"] = {"address": ray_address, **(settings.get("sandbox_options") or {})}
    config = RunConfig(_settings(model, sub_model, settings, spelling), price_as)
    if executor == "ray":
        from recursa.bench.ray_executor import preflight

        preflight(ray_address)
    specs = plan(task, sizes=size_list, n=n, seed=seed, knobs=_parse_knobs(knobs), data=data)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.settings.run.get("trace_dir") is None:
        config.settings.run["trace_dir"] = out_dir / "traces"
    results = ResultsFile(out_dir / "results.jsonl")
    done = results.done_keys()
    model_key = (config.settings.model, config.settings.sub_model or config.settings.model)
    jobs: list[tuple[InstanceSpec, list[str]]] = []
    skipped = 0
    for spec in specs:
        key = instance_id(spec)
        pending = [m for m in method_names if (key, m, *model_key) not in done]
        skipped += len(method_names) - len(pending)
        if pending:
            jobs.append((spec, pending))
    total = sum(len(p) for _, p in jobs)
    new_rows: list[dict[str, Any]] = []
    aborted: str | None = None
    with BenchProgress(total, enabled=progress, skipped=skipped) as bar:

        def record(row: dict[str, Any]) -> None:
            if unreachable(row):
                raise BenchAborted(f"the model cannot be reached, stopping: {row.get('error')}")
            results.append(row)
            new_rows.append(row)
            bar.finished(row)

        try:
            if executor == "ray":
                from recursa.bench.ray_executor import run_on_ray

                await run_on_ray(jobs, config, record, bar, actors=ray_actors, address=ray_address)
            else:
                await _run_local(jobs, config, record, bar, concurrency=concurrency)
        except BenchAborted as exc:
            aborted = str(exc)
    rows = results.rows()
    title = f"recursa bench {task}"
    summary = write_summary(rows, out_dir / "summary.md", title=title, config=config.public())
    plots = write_plots(rows, out_dir, title=task)
    (out_dir / "config.json").write_text(
        json.dumps(
            {
                "task": task,
                "methods": method_names,
                "sizes": list(size_list),
                "n": n,
                "seed": seed,
                "data": data,
                **config.public(),
            },
            indent=2,
            default=str,
        )
        + "\n",
        encoding="utf-8",
    )
    report = BenchReport(
        out_dir,
        results.path,
        summary,
        plots,
        rows,
        len(new_rows),
        skipped,
        aborted,
        plots_skipped(rows),
        new_rows,
    )
    if aborted:
        raise BenchAborted(
            f"{aborted} ({len(new_rows)} rows finished in this run are kept in {results.path})"
        )
    return report


async def _run_local(
    jobs: list[tuple[InstanceSpec, list[str]]],
    config: RunConfig,
    record: Any,
    bar: BenchProgress,
    *,
    concurrency: int,
) -> None:
    """Instances run `concurrency` at a time on this event loop; the methods of one instance together."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(spec: InstanceSpec, pending: list[str]) -> None:
        async with gate:
            task = await asyncio.to_thread(build_task, spec)
            bar.started(len(pending))
            rows = await asyncio.gather(*(run_row(task, m, config, spec) for m in pending))
            for row in rows:
                record(row)

    runners = [asyncio.create_task(one(spec, pending)) for spec, pending in jobs]
    try:
        await asyncio.gather(*runners)
    finally:
        for r in runners:
            r.cancel()
        await asyncio.gather(*runners, return_exceptions=True)


def run(task: str, **options: Any) -> BenchReport:
    """Run a benchmark and write `results.jsonl`, `summary.md` and PNG plots under `out`.

    task: a family (`recursa.tasks.families()`), or with `data=PATH` a family whose real dataset
    loads from PATH (oolong, oolong-pairs, multihop-docs for BrowseComp-Plus, codeqa for LongBench
    v2). Options: sizes ("8k,32k,131k,1m,10m", tokens), n (instances per size), seed, methods
    ("base,codeact,codeact-bm25,codeact-subcalls,summary,rlm,rlm-nosub,rlm-tips,rlm-subtools"),
    model, sub_model (default for a scripted root: scripted/oracle), executor ("local" or "ray"),
    out, knobs ("name=value,..." for the family), concurrency (instances at once, local),
    ray_actors, ray_address, progress, price_as (the real models scripted tokens are priced as,
    by model or role), and the rows' settings: any run setting of `RLM(...)` but those each method
    sets itself (max_depth, tools, sub_tools, tips), the budget's caps one by one (max_usd,
    max_tokens, max_seconds, max_llm_calls), and the methods' own (window_tokens, base_overflow,
    notes_chars); docs/reference/settings.md lists them. Each holds per row.
    """
    return run_sync(arun(task, **options))
