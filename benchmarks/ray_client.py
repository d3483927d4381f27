"""What a step costs on `sandbox="ray"` by transport: the TCP stream, the relay over actor calls, and
both from a driver connected through the Ray Client (`ray://`), against local REPLs.

    python benchmarks/ray_client.py [--size-mb 1] [--alone 20] [--episodes 32] [--concurrency 16] [--rounds 2]

A one-node cluster is simulated on this machine (Ray's `cluster_utils`; its workers at this
process's niceness) with Ray's client server beside it. Each round runs, one after another: local
REPLs; this process as a driver on the cluster with `transport="stream"`, then `"relay"`; and a
subprocess connected through `ray://` with `"relay"` (what a driver outside the cluster gets), then
`"stream"` (what it gets when it can reach the nodes). Each measurement is env_rollouts.py's: a
warm episode, `--alone` episodes one at a time (the step's own latency), then `--episodes` at
`--concurrency` (episodes per second). Every episode takes four steps over a context of `--size-mb`.
First, `--calls` round trips of each kind, interleaved: a bare actor call to the node's host, and
a request to a REPL there over the stream and over the relay (what the relay adds to Ray's calls).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from env_rollouts import SizeResult, measure, pct

KINDS = (("local", "-"), ("cluster", "stream"), ("cluster", "relay"), ("ray://", "relay"), ("ray://", "stream"))


def run(args: argparse.Namespace, sandbox: str, transport: str) -> dict[str, Any]:
    options = None if sandbox == "auto" else {"resources": {"cpu_repl": 0.001}, "transport": transport}
    single, batch = asyncio.run(measure(args.size_mb, args.episodes, args.concurrency, args.alone,
                                        sandbox=sandbox, sandbox_options=options))  # fmt: skip
    return {"single": vars(single), "batch": vars(batch)}


def round_trips(count: int) -> dict[str, list[float]]:
    """A bare actor call to a node's host, and a request to a REPL there over the stream and over
    the relay, interleaved (so all three see the same moments of a shared machine): ms each."""
    from recursa.sandbox import make_sandbox
    from recursa.sandbox.cluster.link import settled

    async def answer(name: str, args: dict) -> str:
        return "x"

    times: dict[str, list[float]] = {"actor call": [], "stream request": [], "relay request": []}
    # A loop holds one link per node: each transport's REPL lives on a loop of its own.
    loops = {transport: asyncio.new_event_loop() for transport in ("stream", "relay")}
    repls = {transport: make_sandbox("ray", resources={"cpu_repl": 0.001}, transport=transport)
             for transport in loops}  # fmt: skip
    for transport, loop in loops.items():
        loop.run_until_complete(repls[transport].start(answer))
    host = repls["stream"].pool.host(repls["stream"].node)  # type: ignore[attr-defined]
    try:
        for i in range(count + 3):  # the first three warm each path
            began = time.perf_counter()
            loops["stream"].run_until_complete(settled(host.describe.remote()))
            call = time.perf_counter()
            loops["stream"].run_until_complete(repls["stream"].variable_names())
            stream = time.perf_counter()
            loops["relay"].run_until_complete(repls["relay"].variable_names())
            relay = time.perf_counter()
            if i >= 3:
                times["actor call"].append((call - began) * 1000)
                times["stream request"].append((stream - call) * 1000)
                times["relay request"].append((relay - stream) * 1000)
    finally:
        for transport, loop in loops.items():
            loop.run_until_complete(repls[transport].close())
            left = asyncio.all_tasks(loop)  # the links' readers: ended as asyncio.run ends its own
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.close()
    return times


def client_main(args: argparse.Namespace) -> int:
    """In the subprocess: connect through the Ray Client and measure one transport."""
    import ray

    ray.init(args.client, log_to_driver=False)
    try:
        print(json.dumps(run(args, "ray", args.transport)))
    finally:
        from recursa.sandbox.cluster import shutdown_hosts

        shutdown_hosts()
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--alone", type=int, default=20, help="episodes one at a time, per measurement")
    parser.add_argument("--episodes", type=int, default=32, help="episodes at once, per measurement")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="each kind this many times, in turn")
    parser.add_argument("--calls", type=int, default=50, help="round trips of each kind, interleaved")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the subprocess: its ray:// address
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args)

    import ray
    from ray.cluster_utils import Cluster

    from recursa.sandbox.cluster import shutdown_hosts

    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "_system_config": {"worker_niceness": niceness}})  # fmt: skip
    cluster.add_node(num_cpus=1, resources={"cpu_repl": 1})
    cluster.wait_for_nodes()
    port = random.randrange(20_000, 30_000)  # outside the ephemeral ports and Ray's worker ports
    server = subprocess.Popen(
        [sys.executable, "-m", "ray.util.client.server", f"--address={cluster.address}", "--host=127.0.0.1",
         f"--port={port}", "--mode=legacy"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(600):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.05)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    passed = [f"--size-mb={args.size_mb}", f"--alone={args.alone}", f"--episodes={args.episodes}",
              f"--concurrency={args.concurrency}"]  # fmt: skip
    try:
        trips = round_trips(args.calls)
        for _ in range(args.rounds):
            for driver, transport in KINDS:
                if driver == "ray://":
                    done = subprocess.run(
                        [sys.executable, __file__, *passed, f"--client=ray://127.0.0.1:{port}",
                         f"--transport={transport}"], capture_output=True, text=True, timeout=1800,
                    )  # fmt: skip
                    if done.returncode != 0:
                        print(f"failed: the ray:// driver: {done.stderr.strip()[-2000:]}")
                        return 1
                    results[(driver, transport)].append(json.loads(done.stdout.strip().splitlines()[-1]))
                else:
                    sandbox = "auto" if driver == "local" else "ray"
                    results[(driver, transport)].append(run(args, sandbox, transport))
    finally:
        shutdown_hosts()
        ray.shutdown()
        server.terminate()
        server.wait(30)
        cluster.shutdown()
    print(f"\n{args.size_mb:g} MB contexts, {args.rounds} round(s); step ms: one episode at a time; ep/s: "
          f"{args.episodes} episodes, {args.concurrency} at once")  # fmt: skip
    print(f"{'driver':>8} {'transport':>9} {'step p50':>8} {'step p95':>8} {'first p50':>9} {'start p50':>9} "
          f"{'ep/s':>6} {'errors':>6}")  # fmt: skip
    failed = False
    for (driver, transport), runs in results.items():
        single = [SizeResult(**r["single"]) for r in runs]
        batch = [SizeResult(**r["batch"]) for r in runs]
        steps = [t for s in single for t in s.later_ms]
        firsts = [t for s in single for t in s.first_ms]
        starts = [t for s in single for t in s.start_ms]
        errors = [e for r in single + batch for e in r.errors]
        failed = failed or bool(errors)
        print(f"{driver:>8} {transport:>9} {pct(steps, 0.5):>8.2f} {pct(steps, 0.95):>8.2f} "
              f"{statistics.median(firsts):>9.1f} {statistics.median(starts):>9.1f} "
              f"{statistics.mean(b.per_s for b in batch):>6.1f} {len(errors):>6}")  # fmt: skip
        for error in errors[:3]:
            print(f"  failed: {error}")
    print(f"\nround trips from this process to the node's host, {args.calls} of each, interleaved (ms):")
    for name, values in trips.items():
        print(f"{name:>15}: p50 {pct(values, 0.5):6.2f}  p95 {pct(values, 0.95):6.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
