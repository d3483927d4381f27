"""RL environment throughput: episodes per second and the engine's time per step (recursa.env).

An instant policy (replies prepared in advance, no model server) drives many `RLMEnv` episodes at
once, so what is measured is recursa's own work per step: recording the reply, running its cell in
the episode's REPL (a real sandboxed process), building the feedback. Each episode takes four
steps: three small cells over `context`, then FINAL.

    python benchmarks/env_rollouts.py [--sizes-mb 1,100] [--episodes 64] [--concurrency 64,8]
    python benchmarks/env_rollouts.py --sizes-mb 1 --episodes 256 --concurrency 64 --ray-nodes 2
    python benchmarks/env_rollouts.py --sizes-mb 1 --vs-skyrl

`--ray-nodes N` runs the same episodes twice, on local REPLs and with `sandbox="ray"` on a cluster of
N nodes simulated on this machine (Ray's own `cluster_utils`), and reports the extra hop per step,
episodes per second against local, and each node's peak memory (its REPL host and workers).
`--vs-skyrl` steps SkyRL-gym's own in-process `rlm` environment through the same cells beside ours.

`--concurrency` is per size: 64 episodes of a 100 MB context at once would hold 64 copies of it
(about 13 GB with the REPLs' decoded strings); the default runs those 8 at a time. The first step
of an episode also waits for its REPL to start and load the context (it overlaps the trainer's
first generation in real use), so it is reported apart. Target: under 2 ms per later step at
100 MB; 64 concurrent episodes without errors.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

from recursa.env import RLMEnv

REPLIES = (
    "```repl\nprint(len(context))\n```",
    "```repl\nhead = context[:200]\nprint(head[:40])\n```",
    "```repl\nn = context.count('e', 0, 100_000)\nprint(n)\n```",
    "FINAL(done)",
)
TARGET_MS = 2.0


@dataclass
class SizeResult:
    size_mb: float
    episodes: int
    concurrency: int
    wall_s: float = 0.0
    start_ms: list[float] = field(default_factory=list)  # env.start(): the call a trainer waits on
    first_ms: list[float] = field(default_factory=list)
    later_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return self.episodes / self.wall_s if self.wall_s else 0.0


def make_context(size_mb: float) -> str:
    line = "the quick brown fox jumps over the lazy dog while the engine steps along\n"
    return (line * (int(size_mb * 1_000_000) // len(line) + 1))[: int(size_mb * 1_000_000)]


async def one_episode(env: RLMEnv, context: str, i: int, out: SizeResult, gate: asyncio.Semaphore) -> None:
    async with gate:
        began = time.perf_counter()
        episode = await env.start(f"Question {i}?", context)
        out.start_ms.append((time.perf_counter() - began) * 1000)
        try:
            for reply in REPLIES:
                await episode.step(reply)
                if episode.done:
                    break
            if episode.stop_reason != "final" or episode.answer != "done":
                out.errors.append(f"episode {i}: {episode.stop_reason} {episode.error or ''}".strip())
            times = [t * 1000 for t in episode.step_times]
            out.first_ms.append(times[0])
            out.later_ms.extend(times[1:])
        finally:
            await episode.close()


async def measure(
    size_mb: float, episodes: int, concurrency: int, alone: int, snapshots: bool = True,
    sandbox: str = "auto", sandbox_options: dict | None = None,
) -> tuple[SizeResult, SizeResult]:
    """Episodes one at a time (the engine's own time per step), then `episodes` at `concurrency`."""
    single = SizeResult(size_mb, alone, 1)
    out = SizeResult(size_mb, episodes, concurrency)
    context = make_context(size_mb)
    gate = asyncio.Semaphore(concurrency)
    limit = max(64, concurrency)
    options = {**(sandbox_options or {}), **({} if snapshots else {"snapshots": False})}
    async with RLMEnv(
        max_depth=0, max_turns=len(REPLIES), trace=False, max_live_repls=limit, sandbox=sandbox,
        sandbox_options=options or None,
    ) as env:
        await one_episode(env, context, -1, SizeResult(size_mb, 1, 1), gate)  # warm: zygote, imports
        started = time.perf_counter()
        for i in range(alone):
            await one_episode(env, context, i, single, gate)
        single.wall_s = time.perf_counter() - started
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_episode(env, context, i, out, gate) for i in range(episodes)), return_exceptions=True
        )
        out.wall_s = time.perf_counter() - started
    out.errors.extend(f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException))
    return single, out


def skyrl_times(size_mb: float, episodes: int) -> tuple[list[float], list[float]]:
    """SkyRL-gym's in-process `rlm` environment over the same cells: (init ms, step ms) lists."""
    from skyrl_gym.envs.rlm.env import BaseRLMEnv

    context = make_context(size_mb)
    starts, steps = [], []
    for _ in range(episodes + 1):  # the first warms imports, as ours does
        env = BaseRLMEnv(extras={"extra_info": {"context_text": context}, "max_turns": 10})
        began = time.perf_counter()
        env.init([{"role": "user", "content": "Question?"}])
        starts.append((time.perf_counter() - began) * 1000)
        for reply in REPLIES[:-1]:
            began = time.perf_counter()
            env.step(reply)
            steps.append((time.perf_counter() - began) * 1000)
        env.close()
    return starts[1:], steps[len(REPLIES) - 1 :]


def ray_compare(size_mb: float, episodes: int, concurrency: int, alone: int, nodes: int,
                snapshots: bool) -> int:  # fmt: skip
    """Local REPLs against sandbox="ray" on a simulated cluster of `nodes` nodes; 1 on errors."""
    import threading

    import ray
    from ray.cluster_utils import Cluster

    from recursa.sandbox.cluster import node_hosts, shutdown_hosts

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, resources={"cpu_repl": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    peak: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            for node_id, host in node_hosts():
                try:
                    rss = ray.get(host.describe.remote(), timeout=5)["rss_bytes"]
                except Exception:
                    continue
                peak[node_id] = max(peak.get(node_id, 0), rss)

    try:
        local = asyncio.run(measure(size_mb, episodes, concurrency, alone, snapshots))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        remote = asyncio.run(measure(size_mb, episodes, concurrency, alone, snapshots, sandbox="ray",
                                     sandbox_options={"resources": {"cpu_repl": 0.001}}))  # fmt: skip
        stop.set()
        sampler.join()
    finally:
        shutdown_hosts()
        ray.shutdown()
        cluster.shutdown()
    print(f"\n{'where':>6} {'episodes':>8} {'at once':>7} {'ep/s':>7} {'step ms p50':>11} {'first ms p50':>12} {'errors':>6}")
    for name, (single, batch) in (("local", local), ("ray", remote)):
        for r in (single, batch):
            print(f"{name:>6} {r.episodes:>8} {r.concurrency:>7} {r.per_s:>7.1f} {pct(r.later_ms, 0.5):>11.2f} "
                  f"{statistics.median(r.first_ms) if r.first_ms else float('nan'):>12.1f} {len(r.errors):>6}")
    hop = pct(remote[0].later_ms, 0.5) - pct(local[0].later_ms, 0.5)
    ratio = remote[1].per_s / local[1].per_s if local[1].per_s else float("nan")
    print(f"hop per step (ray p50 - local p50, one at a time): {hop:.2f} ms (target <= 1 ms: "
          f"{'met' if hop <= 1.0 else 'NOT met'})")
    print(f"episodes per second, ray / local at {concurrency} at once: {ratio:.2f}x (target >= 0.9x: "
          f"{'met' if ratio >= 0.9 else 'NOT met'})")
    for i, (node_id, rss) in enumerate(sorted(peak.items())):
        print(f"node {i} ({node_id[:12]}): peak {rss / 1e6:.0f} MB (REPL host and its workers)")
    return 1 if any(r.errors for pair in (local, remote) for r in pair) else 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,100")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", default="64,8", help="episodes at once, per size (one value: all)")
    parser.add_argument("--alone", type=int, default=8, help="episodes stepped one at a time, for step times")
    parser.add_argument(
        "--no-snapshots",
        action="store_true",
        help="REPLs without state-keeping snapshots (an instant policy leaves no time to take them)",
    )
    parser.add_argument("--ray-nodes", type=int, default=0, help="also run on a simulated Ray cluster of N nodes")
    parser.add_argument("--vs-skyrl", action="store_true", help="SkyRL-gym's in-process environment beside ours")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.ray_nodes:
        concurrency = int(args.concurrency.split(",")[0])
        return ray_compare(sizes[0], args.episodes, min(concurrency, args.episodes), args.alone, args.ray_nodes,
                           not args.no_snapshots)  # fmt: skip
    limits = [int(c) for c in args.concurrency.split(",")]
    limits = (limits + [limits[-1]] * len(sizes))[: len(sizes)]
    print(f"{'size':>7} {'episodes':>8} {'at once':>7} {'wall s':>7} {'ep/s':>7} {'first ms p50':>12} "
          f"{'step ms p50':>11} {'step ms p95':>11} {'errors':>6}")  # fmt: skip
    rows = []
    for size, limit in zip(sizes, limits, strict=True):
        single, batch = asyncio.run(
            measure(size, args.episodes, min(limit, args.episodes), args.alone, not args.no_snapshots)
        )
        rows.append(single)
        for r in (single, batch):
            print(
                f"{size:>5g}MB {r.episodes:>8} {r.concurrency:>7} {r.wall_s:>7.2f} {r.per_s:>7.1f} "
                f"{statistics.median(r.first_ms) if r.first_ms else float('nan'):>12.1f} "
                f"{pct(r.later_ms, 0.5):>11.2f} {pct(r.later_ms, 0.95):>11.2f} {len(r.errors):>6}"
            )
            for error in r.errors[:3]:
                print(f"  failed: {error}")
        rows.append(batch)
    if args.vs_skyrl:
        starts, steps = skyrl_times(sizes[0], args.alone)
        ours = rows[0]
        print(f"\nsame cells at {sizes[0]:g} MB, one episode at a time:")
        print(f"  SkyRL-gym rlm (in-process, no isolation): init {statistics.median(starts):.2f} ms, "
              f"step {statistics.median(steps):.3f} ms p50")
        print(f"  recursa RLMEnv (sandboxed REPL):           start {statistics.median(ours.start_ms):.2f} ms, "
              f"step {pct(ours.later_ms, 0.5):.3f} ms p50 (first step, REPL start included: "
              f"{statistics.median(ours.first_ms):.1f} ms)")
    big = [r for r in rows if r.size_mb >= 100]
    if big:
        p50 = pct(big[0].later_ms, 0.5)  # one at a time: the engine's own time per step
        verdict = "met" if p50 < TARGET_MS else "NOT met"
        print(f"target: engine time per step under {TARGET_MS:g} ms at 100 MB: {verdict} ({p50:.2f} ms p50)")
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
