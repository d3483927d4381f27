"""RL environment throughput: episodes per second and the engine's time per step (recursa.env).

An instant policy (replies prepared in advance, no model server) drives many `RLMEnv` episodes at
once, so what is measured is recursa's own work per step: recording the reply, running its cell in
the episode's REPL (a real sandboxed process), building the feedback. Each episode takes four
steps: three small cells over `context`, then FINAL.

    python benchmarks/env_rollouts.py [--sizes-mb 1,100] [--episodes 64] [--concurrency 64,8]
    python benchmarks/env_rollouts.py --sizes-mb 1 --episodes 256 --concurrency 64 --ray-nodes 2
    python benchmarks/env_rollouts.py --sizes-mb 1 --vs-skyrl
    python benchmarks/env_rollouts.py --sizes-mb 1 --think-ms 20 --alone 20 --episodes 8

`--ray-nodes N` runs the same episodes on local REPLs and with `sandbox="ray"` on a cluster of N
nodes simulated on this machine (Ray's own `cluster_utils`; its workers at this process's niceness,
as the local REPLs are, unless `--ray-niceness` says otherwise): one at a time, a local and a Ray episode
in turn (so both see the same moment of a shared machine), then all at once, local then Ray
(`--rounds` alternates more). It reports the extra hop per step, episodes per second against local,
the CPU time per episode of each kind of process (the driver, the node hosts, the REPL workers,
Ray's own daemons), how many episodes each node took, and each node's peak memory.
`--vs-skyrl` steps SkyRL-gym's own in-process `rlm` environment through the same cells beside ours.
`--think-ms T` waits T ms before each step, as a policy generating its reply would: the REPL then
forks its snapshot of the state after a cell (and takes the next cell's copy-on-write faults in a
dry run) while the policy thinks, as in training, instead of on the next step's path.
`--fresh-contexts` gives every episode a context object of its own (else all share one, as the
samples of one task do, and the environment encodes it once: recursa/env/contexts.py).

`--concurrency` is per size: 64 episodes of a 100 MB context at once would hold 64 copies of it
(about 13 GB with the REPLs' decoded strings); the default runs those 8 at a time. The first step
of an episode also waits for its REPL to start and load the context (it overlaps the trainer's
first generation in real use), so it is reported apart. Target: under 2 ms per later step at
100 MB; 64 concurrent episodes without errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
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
    by_step: list[list[float]] = field(default_factory=list)  # later_ms by the step's place in its episode
    errors: list[str] = field(default_factory=list)

    @property
    def per_s(self) -> float:
        return self.episodes / self.wall_s if self.wall_s else 0.0


def make_context(size_mb: float) -> str:
    line = "the quick brown fox jumps over the lazy dog while the engine steps along\n"
    return (line * (int(size_mb * 1_000_000) // len(line) + 1))[: int(size_mb * 1_000_000)]


async def one_episode(
    env: RLMEnv, context: str, i: int, out: SizeResult, gate: asyncio.Semaphore, think_s: float = 0.0,
    fresh: bool = False,
) -> None:
    async with gate:
        if fresh:
            context = context[:-8] + f"{i:08d}"  # a new object, made before the start is timed
        began = time.perf_counter()
        episode = await env.start(f"Question {i}?", context)
        out.start_ms.append((time.perf_counter() - began) * 1000)
        try:
            for reply in REPLIES:
                if think_s:
                    await asyncio.sleep(think_s)  # the policy generating this reply (not in step_times)
                await episode.step(reply)
                if episode.done:
                    break
            if episode.stop_reason != "final" or episode.answer != "done":
                out.errors.append(f"episode {i}: {episode.stop_reason} {episode.error or ''}".strip())
            times = [t * 1000 for t in episode.step_times]
            out.first_ms.append(times[0])
            out.later_ms.extend(times[1:])
            for k, t in enumerate(times[1:]):
                if k == len(out.by_step):
                    out.by_step.append([])
                out.by_step[k].append(t)
        finally:
            await episode.close()


def snapshot_mode(snapshots: bool, every_cell: bool) -> dict:
    """`sandbox_options` for RLMEnv's default ("idle": none for a cell the policy answers at once),
    no snapshots, or one after every cell."""
    return {} if snapshots and not every_cell else {"snapshots": snapshots}


async def measure(
    size_mb: float, episodes: int, concurrency: int, alone: int, snapshots: bool = True,
    sandbox: str = "auto", sandbox_options: dict | None = None, think_s: float = 0.0, fresh: bool = False,
    every_cell: bool = False, probe: Callable[[], None] | None = None,
) -> tuple[SizeResult, SizeResult]:
    """Episodes one at a time (the engine's own time per step), then `episodes` at `concurrency`.
    `snapshots`: RLMEnv's default ("idle"), or off; `every_cell`: a snapshot after every cell.
    `probe()` is called just before the episodes at `concurrency` and just after them, while the
    environment (and its REPL workers) is still up."""
    single = SizeResult(size_mb, alone, 1)
    out = SizeResult(size_mb, episodes, concurrency)
    context = make_context(size_mb)
    gate = asyncio.Semaphore(concurrency)
    limit = max(64, concurrency)
    options = {**(sandbox_options or {}), **snapshot_mode(snapshots, every_cell)}
    async with RLMEnv(
        max_depth=0, max_turns=len(REPLIES), trace=False, max_live_repls=limit, sandbox=sandbox,
        sandbox_options=options or None,
    ) as env:
        await one_episode(env, context, -1, SizeResult(size_mb, 1, 1), gate)  # warm: zygote, imports
        started = time.perf_counter()
        for i in range(alone):
            await one_episode(env, context, i, single, gate, think_s, fresh)
        single.wall_s = time.perf_counter() - started
        if probe is not None:
            probe()
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_episode(env, context, i, out, gate, think_s, fresh) for i in range(episodes)),
            return_exceptions=True,
        )
        out.wall_s = time.perf_counter() - started
        if probe is not None:
            probe()
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
                snapshots: bool, rounds: int, niceness: int | None = None, think_s: float = 0.0,
                fresh: bool = False, every_cell: bool = False) -> int:  # fmt: skip
    """Local REPLs against sandbox="ray" on a simulated cluster of `nodes` nodes; 1 on errors.
    `think_s`, `fresh` and `every_cell` as for `measure`, in every phase."""
    import os
    import threading

    import ray
    from ray.cluster_utils import Cluster

    from recursa.sandbox.cluster import node_hosts, shutdown_hosts
    from recursa.sandbox.cluster.node import tree_rss

    # Ray starts its workers (the node hosts, and so their REPLs) at niceness 15 unless told
    # otherwise; local REPLs run at this process's. On cores shared with other work the two would
    # then not be compared at the same priority: by default the cluster's workers get ours.
    niceness = os.getpriority(os.PRIO_PROCESS, 0) if niceness is None else niceness
    clock = TreeClock.made()  # before the cluster starts: its processes are counted too
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "_system_config": {"worker_niceness": niceness}})  # fmt: skip
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, resources={"cpu_repl": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    peak: dict[str, int] = {}
    host_pids: dict[str, int] = {}  # node id -> its host's pid
    sampling = [0.0]  # the sampler thread's own CPU seconds, taken out of the driver's figure
    stop = threading.Event()

    def sample() -> None:
        # The cluster is simulated on this machine: the hosts' trees are read here, in this thread,
        # so the hosts' event loops do not pay for it (a look scans all of /proc).
        while not stop.wait(2.0):
            began = time.thread_time()
            for node_id, host in node_hosts():
                if node_id not in host_pids:
                    try:
                        host_pids[node_id] = ray.get(host.describe.remote(), timeout=5)["pid"]
                    except Exception:
                        continue
                peak[node_id] = max(peak.get(node_id, 0), tree_rss(host_pids[node_id]))
            sampling[0] += time.thread_time() - began

    ray_options = {"resources": {"cpu_repl": 0.001}}
    local_steps, ray_steps = SizeResult(size_mb, alone, 1), SizeResult(size_mb, alone, 1)
    batches: list[tuple[str, SizeResult, dict[str, float]]] = []
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(one_at_a_time(size_mb, alone, snapshot_mode(snapshots, every_cell), ray_options,
                                  local_steps, ray_steps, think_s, fresh))  # fmt: skip
        for _ in range(rounds):
            for where in ("local", "ray"):
                # Taken while the environment is up, so that its local REPL workers count too.
                marks: list[tuple[dict[str, float], float]] = []

                def mark() -> None:
                    marks.append((cpu_times(set(host_pids.values()), clock), sampling[0]))  # noqa: B023

                _, batch = asyncio.run(measure(size_mb, episodes, concurrency, 0, snapshots,
                                               sandbox="auto" if where == "local" else "ray",
                                               sandbox_options=None if where == "local" else ray_options,
                                               think_s=think_s, fresh=fresh, every_cell=every_cell,
                                               probe=mark))  # fmt: skip
                (before, sampled), (after, sampled_after) = marks
                spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                spent["driver"] -= sampled_after - sampled
                batches.append((where, batch, spent))
        opened = {node_id: ray.get(host.describe.remote(), timeout=30)["opened"] for node_id, host in node_hosts()}
    finally:
        stop.set()
        sampler.join()
        shutdown_hosts()
        ray.shutdown()
        cluster.shutdown()
        if clock is not None:
            clock.close()
    print(f"\nRay workers (node hosts and their REPLs) at niceness {niceness}; this process at "
          f"{os.getpriority(os.PRIO_PROCESS, 0)}")
    print(f"\n{'where':>6} {'episodes':>8} {'at once':>7} {'ep/s':>7} {'step ms p50':>11} {'first ms p50':>12} {'errors':>6}")
    for name, r in [("local", local_steps), ("ray", ray_steps)] + [(w, b) for w, b, _ in batches]:
        print(f"{name:>6} {r.episodes:>8} {r.concurrency:>7} {r.per_s:>7.1f} {pct(r.later_ms, 0.5):>11.2f} "
              f"{statistics.median(r.first_ms) if r.first_ms else float('nan'):>12.1f} {len(r.errors):>6}")  # fmt: skip
        for error in r.errors[:3]:
            print(f"  failed: {error}")
    print("\nCPU ms per episode, all at once (" + ", ".join(KINDS) + "; REPL workers: the REPLs' processes,"
          " local ones or a node host's, " + ("exited ones included, from a cpuacct control group):" if clock else
          "live ones only: no cpuacct control group could be made, and a forked worker's CPU time is lost when it"
          " exits, its zygote ignoring SIGCHLD):"))
    for where, batch, spent in batches:
        print(f"{where:>6}: " + "  ".join(f"{spent.get(k, 0.0) * 1000 / batch.episodes:6.1f}" for k in KINDS)
              + f"  total {sum(spent.values()) * 1000 / batch.episodes:.1f}")  # fmt: skip
    hop = pct(ray_steps.later_ms, 0.5) - pct(local_steps.later_ms, 0.5)
    local_rate = statistics.mean(b.per_s for w, b, _ in batches if w == "local")
    ray_rate = statistics.mean(b.per_s for w, b, _ in batches if w == "ray")
    ratio = ray_rate / local_rate if local_rate else float("nan")
    print(f"\nhop per step (ray p50 - local p50, one at a time, in turn): {hop:.2f} ms (target <= 1 ms: "
          f"{'met' if hop <= 1.0 else 'NOT met'})")
    print(f"episodes per second, ray / local at {concurrency} at once: {ratio:.2f}x ({ray_rate:.1f} / "
          f"{local_rate:.1f}; target >= 0.9x: {'met' if ratio >= 0.9 else 'NOT met'})")
    for i, (node_id, rss) in enumerate(sorted(peak.items())):
        print(f"node {i} ({node_id[:12]}): {opened.get(node_id, 0)} episodes, peak {rss / 1e6:.0f} MB "
              "(REPL host and its workers)")
    return 1 if any(r.errors for r in [local_steps, ray_steps, *(b for _, b, _ in batches)]) else 0


async def one_at_a_time(size_mb: float, alone: int, extra: dict, ray_options: dict,
                        local: SizeResult, remote: SizeResult, think_s: float = 0.0,
                        fresh: bool = False) -> None:  # fmt: skip
    """`alone` episodes on each side, one at a time, a local one and a Ray one in turn; `extra`: the
    REPLs' snapshot options (`snapshot_mode`)."""
    context = make_context(size_mb)
    gate = asyncio.Semaphore(1)
    async with (
        RLMEnv(max_depth=0, max_turns=len(REPLIES), trace=False, sandbox_options=extra or None) as here,
        RLMEnv(max_depth=0, max_turns=len(REPLIES), trace=False, sandbox="ray",
               sandbox_options={**ray_options, **extra}) as there,
    ):  # fmt: skip
        for env in (here, there):  # warm: zygote, imports, the node's host
            await one_episode(env, context, -1, SizeResult(size_mb, 1, 1), gate)
        for i in range(alone):
            await one_episode(here, context, i, local, gate, think_s, fresh)
            await one_episode(there, context, i, remote, gate, think_s, fresh)


KINDS = ("driver", "node hosts", "REPL workers", "Ray daemons")


class TreeClock:
    """CPU seconds of this process and every process it starts, exited ones included, from a cgroup
    v1 `cpuacct` group of its own. /proc alone misses most REPL workers: one forked by a zygote is
    reaped by the kernel (the zygote ignores SIGCHLD), so its CPU time reaches no parent's `cutime`
    and is gone when it exits (at 1 MB, 64 at once, some 40 ms an episode of the 60 in all)."""

    def __init__(self, root: str, path: str) -> None:
        self.root, self.path = root, path

    @classmethod
    def made(cls) -> TreeClock | None:
        """A group of its own for this process, or None where none can be made (not root, or no
        cpuacct hierarchy of its own: mounted with `cpu`, a new group would change CPU shares)."""
        import os

        try:
            with open("/proc/self/mounts") as fh:
                mounts = [line.split() for line in fh]
            with open("/proc/self/cgroup") as fh:
                own = {c: line.rstrip("\n").split(":", 2)[2] for line in fh for c in line.split(":", 2)[1].split(",")}
        except OSError:
            return None
        for fields in mounts:
            options = set(fields[3].split(",")) if len(fields) > 3 and fields[2] == "cgroup" else set()
            if "cpuacct" in options and "cpu" not in options and "cpuacct" in own:
                root = fields[1] + own["cpuacct"].rstrip("/")
                path = f"{root}/recursa-bench-{os.getpid()}"
                try:
                    os.mkdir(path)
                except OSError:
                    return None
                clock = cls(root, path)
                try:
                    clock._move(path)
                except OSError:
                    os.rmdir(path)
                    return None
                return clock
        return None

    def _move(self, group: str) -> None:
        import os

        with open(f"{group}/cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def seconds(self) -> float:
        with open(f"{self.path}/cpuacct.usage") as fh:
            return int(fh.read()) / 1e9

    def close(self) -> None:
        """Back to the group this process came from; the group goes once what was in it has exited."""
        import os

        with contextlib.suppress(OSError):
            self._move(self.root)
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def cpu_times(host_pids: set[int], clock: TreeClock | None = None) -> dict[str, float]:
    """CPU seconds so far of this process and everything below it (the simulated cluster's daemons,
    the node hosts and every REPL worker), by kind. A process's reaped children count with it, so
    REPL workers that ended count under their fork server's kind; with `clock`, the REPL workers are
    all the rest of the clock's count, every exited process included."""
    import os

    from recursa.sandbox.proc import processes

    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    stats = dict(processes())
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    spent: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    frontier = [(me, "driver")]
    while frontier:
        pid, kind = frontier.pop()
        fields = stats.get(pid)
        if fields is None:
            continue
        own, reaped = (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick
        spent[kind] += own
        spent["REPL workers" if kind in ("driver", "node hosts") else kind] += reaped
        for child in children.get(pid, []):
            if child in host_pids:
                frontier.append((child, "node hosts"))
            elif kind in ("node hosts", "REPL workers"):
                frontier.append((child, "REPL workers"))
            else:
                frontier.append((child, "Ray daemons" if _is_ray(child) else "REPL workers"))
    if clock is not None:
        spent["REPL workers"] = clock.seconds() - sum(v for k, v in spent.items() if k != "REPL workers")
    return spent


def _is_ray(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            command = fh.read()
    except OSError:
        return False
    return b"/site-packages/ray/" in command or command.startswith(b"ray::")


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
    parser.add_argument(
        "--every-cell",
        action="store_true",
        help="a snapshot after every cell (snapshots=True), where RLMEnv's default ('idle') skips the "
        "snapshot of a cell the policy answers at once",
    )
    parser.add_argument("--ray-nodes", type=int, default=0, help="also run on a simulated Ray cluster of N nodes")
    parser.add_argument("--rounds", type=int, default=1, help="with --ray-nodes: local and Ray batches, alternated")
    parser.add_argument("--ray-niceness", type=int, default=None,
                        help="with --ray-nodes: the niceness of Ray's workers (default: this process's; Ray's own is 15)")  # fmt: skip
    parser.add_argument("--vs-skyrl", action="store_true", help="SkyRL-gym's in-process environment beside ours")
    parser.add_argument("--think-ms", type=float, default=0.0, help="the policy's time per reply, waited before each step")
    parser.add_argument("--fresh-contexts", action="store_true", help="a context object of its own per episode")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.ray_nodes:
        concurrency = int(args.concurrency.split(",")[0])
        return ray_compare(sizes[0], args.episodes, min(concurrency, args.episodes), args.alone, args.ray_nodes,
                           not args.no_snapshots, args.rounds, args.ray_niceness, args.think_ms / 1000,
                           args.fresh_contexts, args.every_cell)  # fmt: skip
    limits = [int(c) for c in args.concurrency.split(",")]
    limits = (limits + [limits[-1]] * len(sizes))[: len(sizes)]
    print(f"{'size':>7} {'episodes':>8} {'at once':>7} {'wall s':>7} {'ep/s':>7} {'first ms p50':>12} "
          f"{'step ms p50':>11} {'step ms p95':>11} {'errors':>6}")  # fmt: skip
    rows = []
    for size, limit in zip(sizes, limits, strict=True):
        single, batch = asyncio.run(
            measure(size, args.episodes, min(limit, args.episodes), args.alone, not args.no_snapshots,
                    think_s=args.think_ms / 1000, fresh=args.fresh_contexts, every_cell=args.every_cell)
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
        # The p50 above pools an episode's later steps; the first ones after the REPL's start (tens
        # of ms of other work) run slower, as any step after a pause does (docs/performance.md).
        places = ", ".join(f"step {k + 2}: {pct(v, 0.5):.2f}" for k, v in enumerate(single.by_step))
        print(f"{'':>7} one at a time, p50 by the step's place in its episode ({len(REPLIES)}: the answer): {places} ms")
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
