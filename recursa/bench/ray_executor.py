"""`--executor ray`: rows run on a few async Ray actors, each running many rows at once.

Only the instance spec travels to an actor (family, size, seed, knobs; or a data file and a row
index), never a context: the actor rebuilds the task itself (generation is seeded), runs the
methods of the instance concurrently on its own event loop, and sends back plain row dicts. One
actor per core or so is enough; each holds up to `max_concurrency` instances in flight (a few
async actors beat one Ray task per run, by about 10x in the project's design notes; not measured in
docs/).
"""

from __future__ import annotations

import asyncio
from typing import Any

from recursa.bench.jobs import InstanceSpec, RunConfig, build_task, run_row
from recursa.bench.progress import BenchProgress
from recursa.bench.sizes import BenchError
from recursa.extras import install_hint
from recursa.sandbox.cluster.pool import RAY_ADDRESS, named_address, unreachable

ACTOR_CONCURRENCY = 16


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise BenchError(f"--executor ray needs Ray: {install_hint('ray')}") from None
    return ray


def preflight(address: str | None) -> None:
    """Before any row: Ray is installed, and the cluster at `address` (else RAY_ADDRESS's) answers
    (ray.init would retry an unreachable one for minutes) unless this process is connected already."""
    ray = _ray()
    named, _ = named_address(address)
    if named is None or named in ("auto", "local") or ray.is_initialized():
        return
    problem = unreachable(named)
    if problem is not None:
        given = f"--ray-address {address}" if address else f"${RAY_ADDRESS}={named}"
        raise BenchError(f"{given}: the Ray cluster cannot be reached: {problem}. Give the head node's "
                         f"address (`ray start --head` prints it), or leave it out (and ${RAY_ADDRESS} unset) "
                         "for a local one")


class BenchWorker:
    """The actor body: rebuilds an instance and runs its pending methods concurrently."""

    async def run_instance(
        self, spec: InstanceSpec, methods: list[str], config: RunConfig
    ) -> list[dict[str, Any]]:
        task = await asyncio.to_thread(build_task, spec)
        rows = await asyncio.gather(*(run_row(task, m, config, spec) for m in methods))
        return list(rows)

    def pid(self) -> int:
        import os

        return os.getpid()


async def run_on_ray(
    jobs: list[tuple[InstanceSpec, list[str]]],
    config: RunConfig,
    record: Any,
    bar: BenchProgress,
    *,
    actors: int = 2,
    address: str | None = None,
) -> None:
    ray = _ray()
    started_here = not ray.is_initialized()
    if started_here:  # the address given, else RAY_ADDRESS's, else a new local instance of our own
        named, _ = named_address(address)
        ray.init(address=named or "local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote_cls = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(BenchWorker)
        pool = [remote_cls.remote() for _ in range(max(1, actors))]
        pending: dict[Any, int] = {}
        for i, (spec, methods) in enumerate(jobs):
            ref = pool[i % len(pool)].run_instance.remote(spec, methods, config)
            pending[ref] = len(methods)
            bar.started(len(methods))
        while pending:
            ready, _ = await asyncio.to_thread(ray.wait, list(pending), num_returns=1)
            for ref in ready:
                pending.pop(ref)
                for row in await asyncio.to_thread(ray.get, ref):
                    record(row)
        for actor in pool:
            ray.kill(actor)
    finally:
        if started_here:
            ray.shutdown()
