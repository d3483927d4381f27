"""sandbox="ray" from a driver that cannot reach the nodes (a Ray Client, `ray://`): the stream's
frames relayed over actor calls (relay.py).

First without a cluster, as test_ray_stream.py does: the plain host (RelayHost over NodeHost) behind a
stand-in for its actor handle, the driver's NodeLink choosing its carrier. Then through a real Ray
Client: a cluster on this machine, Ray's client server for it in a process of its own, and this
process connected to it by `ray://`, running an RLM and RLMEnv episodes whose REPLs call back to
the driver, and losing the node's host under one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from recursa.errors import SandboxError
from recursa.sandbox import frames
from recursa.sandbox.cluster import NodeLost, relay
from recursa.sandbox.cluster.link import Node, NodeLink
from recursa.sandbox.cluster.relay import RelayHost, carrier_for
from tests.test_ray_stream import SERVED, Actor, Fake, answer, opened

pytestmark = pytest.mark.timeout(120)


class Unreachable(RelayHost):
    """A host whose stream's port the driver cannot reach, as with a firewall between them: `port`,
    by default one that refuses a connect."""

    port: int | None = None

    async def listen(self, client: str, address: str, token: bytes) -> int:
        await super().listen(client, address, token)
        if self.port is not None:
            return self.port
        with socket.socket() as closed:  # bound, never listening: a connect there is refused
            closed.bind(("127.0.0.1", 0))
            return int(closed.getsockname()[1])


# `ray` as carrier_for sees it in a process that is not a Ray Client.
NO_CLIENT = SimpleNamespace(
    util=SimpleNamespace(client=SimpleNamespace(ray=SimpleNamespace(is_connected=lambda: False)))
)


@pytest.fixture
async def host() -> AsyncIterator[tuple[RelayHost, list[Fake]]]:
    made: list[Fake] = []

    def make(kind: str, **options: Any) -> Fake:
        made.append(Fake(**options))
        return made[-1]

    served = Unreachable(make, fork=False)  # type: ignore[arg-type]
    yield served, made
    await served.shutdown()


async def relayed(
    host: RelayHost, transport: relay.Transport = "auto", lost: list[NodeLink] | None = None,
    unreachable: set[str] | None = None,
) -> NodeLink:
    link = NodeLink(Node("r" * 12, "127.0.0.1", {}), Actor(host), "client-r", answer,
                    (lost if lost is not None else []).append)  # fmt: skip
    await link.connect(carrier_for(NO_CLIENT, transport, set() if unreachable is None else unreachable))
    return link


async def test_a_node_whose_stream_is_refused_is_relayed_with_the_same_semantics(
    host: tuple[RelayHost, list[Fake]], monkeypatch: pytest.MonkeyPatch
) -> None:
    served, made = host
    with pytest.raises(
        SandboxError,
        match=r"could not open its stream.*127\.0\.0\.1:\d+: .*Connect call failed.*\"transport\": \"relay\"",
    ):
        await relayed(served, "stream")
    unreachable: set[str] = set()  # the pool's: nodes relayed from now on
    link = await relayed(served, unreachable=unreachable)  # "auto": the stream is refused, so the frames ride actor calls
    assert "client-r" in served._relays and unreachable == {"r" * 12}
    await opened(link)
    SERVED.clear()
    # Cells, results and call-backs, concurrently: a cell that waits on its call-back does not hold
    # up the others, and the driver's handler answers each (an error as its kind).
    first, asked, refused = await asyncio.gather(
        link.request("execute", repl="r", code="a", timeout=5),
        link.request("execute", repl="r", code="ask:hi", timeout=5),
        link.request("execute", repl="r", code="ask:dear", timeout=5),
    )
    assert (first.stdout, first.restored, asked.stdout) == ("a", True, "answered hi")
    assert refused.error == "BudgetExceeded: used up" and SERVED == [("r", "llm_query")] * 2
    with pytest.raises(SandboxError, match="the REPL host failed"):
        await link.request("execute", repl="r", code="bad", timeout=5)
    # A wait given up on the driver stops the cell on the node; a long quiet pull is no loss.
    monkeypatch.setattr(relay, "_POLL_S", 0.05)
    waiting = asyncio.ensure_future(link.request("execute", repl="r", code="hang", timeout=5))
    await asyncio.sleep(0.2)
    waiting.cancel()
    await asyncio.wait_for(made[0].cancelled.wait(), 5)
    assert (await link.request("execute", repl="r", code="after", timeout=5)).stdout == "after"
    # The host's refusal of an oversized frame fails that request only, as on the stream.
    monkeypatch.setattr(frames, "MAX_HOST_FRAME_BYTES", 64 << 10)
    with pytest.raises(SandboxError, match=r"too large to send to the driver .*limit is 65,536"):
        await link.request("execute", repl="r", code="big:100000", timeout=5)
    result = await link.request("execute", repl="r", code="askbig:100000", timeout=5)
    assert result.error and "arguments are too large to send to the driver" in result.error, result
    # Bigger than one pull carries: it comes in several.
    monkeypatch.setattr(relay, "_PULL_BYTES", 16 << 10)
    assert (await link.request("execute", repl="r", code="big:60000", timeout=5)).stdout == "x" * 60_000
    assert link.lost is None
    await link.aclose()
    assert made[0].closed and served.describe()["streams"] == 0
    for _ in range(100):  # the host lets go of the relay once its end is read
        if not served._relays:
            break
        await asyncio.sleep(0.01)
    assert served._relays == {}


@pytest.mark.skipif(sys.platform != "linux", reason="a full accept queue drops a SYN on Linux")
async def test_a_node_whose_stream_hangs_is_relayed_once_its_bound_passes(
    host: tuple[RelayHost, list[Fake]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A firewall that drops packets: the connect hangs rather than being refused. Here the port is a
    # listener whose accept queue (listen(0): one connection) is full, so the kernel drops the SYN.
    served, _ = host
    monkeypatch.setattr(relay, "_TRY_STREAM_S", 0.2)  # the bound, 5 s, shortened
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        with socket.create_connection(hole.getsockname(), timeout=5):  # the one the queue holds
            served.port = hole.getsockname()[1]  # type: ignore[attr-defined]
            unreachable: set[str] = set()
            link = await relayed(served, unreachable=unreachable)
    assert unreachable == {"r" * 12} and "client-r" in served._relays
    await opened(link)
    assert (await link.request("execute", repl="r", code="a", timeout=5)).stdout == "a"
    await link.aclose()


async def test_a_hostile_relay_loses_only_its_node(host: tuple[RelayHost, list[Fake]]) -> None:
    served, made = host
    real_pull = served.relay_pull
    forged: list[Any] = []  # what the next pull that carries bytes returns instead of them

    async def pull(client: str) -> Any:
        data = await real_pull(client)
        return forged.pop() if data and forged else data

    served.relay_pull = pull  # type: ignore[method-assign]
    # A length past the channel's limit (read by the stream's own frame reader), a pull that is not
    # bytes, and one past the pull's bound: each loses the node, and only for that stream.
    for bad, expect in ((b"\xff\xff\xff\xff", "limit is"), ("not bytes", "not at most"),
                        (b"x" * (relay._PULL_BYTES + 1), "not at most")):  # fmt: skip
        lost: list[NodeLink] = []
        link = await relayed(served, "relay", lost)
        await opened(link)
        forged.append(bad)
        with pytest.raises(NodeLost, match=rf"r{{12}} \(127\.0\.0\.1\).*invalid message.*{expect}"):
            await link.request("execute", repl="r", code="x", timeout=5)
        assert lost == [link]
        with pytest.raises(NodeLost):
            await link.request("execute", repl="r", code="x", timeout=5)
        # The host saw the stream end, as when a socket closes: that driver's REPLs there are closed.
        for _ in range(100):
            if made[-1].closed:
                break
            await asyncio.sleep(0.01)
        assert made[-1].closed and served.describe()["live_repls"] == 0
    link = await relayed(served, "relay")  # a new stream is served as before
    await opened(link)
    assert (await link.request("execute", repl="r", code="fine", timeout=5)).stdout == "fine"

    async def refuse(client: str, number: int, data: bytes, end: bool) -> None:
        raise ConnectionError("gone")

    served.relay_push = refuse  # type: ignore[method-assign]
    # A push that did not arrive leaves a hole in the stream: the node is lost, not the frames misread.
    with pytest.raises(NodeLost, match=r"relay push to its REPL host failed: ConnectionError"):
        await link.request("execute", repl="r", code="x", timeout=5)
    await link.aclose()


def test_without_an_address_rays_own_variable_names_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    # How `recursa acp --sandbox ray` under a verifiers rollout, or `recursa openenv --sandbox ray`,
    # joins a cluster: Ray's RAY_ADDRESS, checked and named as an address given in sandbox_options is.
    ray = pytest.importorskip("ray", reason="sandbox='ray' needs the ray extra (installed by the dev extra)")
    from recursa import RLM
    from recursa.bench.ray_executor import preflight
    from recursa.bench.sizes import BenchError
    from recursa.errors import ConfigError
    from recursa.sandbox.cluster.pool import connect

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    from_env = r"'127\.0\.0\.1:9' \(from \$RAY_ADDRESS\) cannot be reached"
    with pytest.raises(ConfigError, match=from_env):
        connect(None)
    with pytest.raises(ConfigError, match=from_env):  # when the run is made, before any REPL
        RLM("scripted/gpt5-like", sandbox="ray")
    with pytest.raises(ConfigError, match=r"'127\.0\.0\.1:7' cannot be reached"):  # a given address wins
        connect("127.0.0.1:7")
    with pytest.raises(BenchError, match=r"^\$RAY_ADDRESS=127\.0\.0\.1:9: the Ray cluster cannot be reached"):
        preflight(None)  # recursa bench --executor ray


# -- a real Ray Client -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[str]:
    """A one-node cluster and Ray's client server for it (in a process of its own, as on a head);
    this process is not connected yet: the first test connects it through `ray://`, as a laptop would."""
    ray = pytest.importorskip("ray", reason="sandbox='ray' needs the ray extra (installed by the dev extra)")
    from ray._private.utils import get_ray_client_dependency_error
    from ray.cluster_utils import Cluster

    from recursa.sandbox.cluster import shutdown_hosts

    if get_ray_client_dependency_error() is not None:
        pytest.skip("the Ray Client needs grpcio (ray[client], in the ray extra)")
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                          "resources": {"cpu_repl": 1}})  # fmt: skip
    # The server's "legacy" mode is itself the client's driver on the cluster. (`ray start --head`
    # runs the "proxy" mode, which starts such a server per client; on this loaded machine that
    # start failed one time in three, inside Ray.) A port outside the kernel's ephemeral range and
    # Ray's worker ports, which other processes here may hold.
    server, port, log = None, 0, tempfile.TemporaryFile()
    try:
        for _ in range(3):  # a port another process took meanwhile: the server exits, try another
            port = random.randrange(20_000, 30_000)
            server = subprocess.Popen(
                [sys.executable, "-m", "ray.util.client.server", f"--address={made.address}", "--host=127.0.0.1",
                 f"--port={port}", "--mode=legacy"], stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
            if _listening(server, port, deadline=time.monotonic() + 120):
                break
            server.kill()
            server.wait(30)
            log.seek(0)
            why = log.read().decode(errors="replace")[-2000:]
        else:
            pytest.fail(f"Ray's client server did not start: {why}")
        yield f"ray://127.0.0.1:{port}"
    finally:
        shutdown_hosts()
        ray.shutdown()
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(30)
        log.close()
        made.shutdown()


def _listening(server: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
    """Whether the server listens on `port` before `deadline` (False once it has exited)."""
    while time.monotonic() < deadline and server.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        time.sleep(0.05)
    return False


def _bench(out: Path, *flags: str) -> list[dict[str, Any]]:
    """`recursa bench` on the command line: its rows."""
    from recursa.cli import main

    assert main(["bench", "niah", "--sizes", "1k", "--n", "1", "--json", "--out", str(out), *flags]) == 0
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _ray_node(row: dict[str, Any]) -> str | None:
    """The Ray node a bench row's REPL ran on, from its trace."""
    events = [json.loads(line) for line in Path(row["trace_path"]).read_text().splitlines()]
    return next(e for e in events if e["type"] == "run_end")["isolation"].get("ray_node")


# Alone: it starts a Ray cluster, and two starting at once beside other tests on two shared cores
# (test_ray_sandbox.py's) time out in Ray's own startup wait. First in the module: this process is
# not connected yet, so the command connects it through `ray://` itself. Its time counts the
# fixture's start of the cluster, which took up to a minute on this machine at load 50-80.
@pytest.mark.serial
@pytest.mark.timeout(300)
def test_bench_through_a_ray_client(
    client: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setattr("recursa.bench.runner.write_plots", lambda *a, **k: [])  # not what is tested: CPU
    # --executor ray, the cluster named by Ray's RAY_ADDRESS: the command connects through the
    # client, runs the rows on an actor of the cluster (each row's REPL on a node, put there from
    # inside the cluster), and lets go of the client at its end.
    monkeypatch.setenv("RAY_ADDRESS", client)
    rows = _bench(tmp_path / "actors", "--method", "rlm", "--executor", "ray", "--ray-actors", "1",
                  "--sandbox", "ray")  # fmt: skip
    assert [(r["status"], r["score"]) for r in rows] == [("ok", 1.0)], rows
    assert rows[0]["worker_pid"] != os.getpid() and not ray.is_initialized()
    assert _ray_node(rows[0])
    monkeypatch.delenv("RAY_ADDRESS")
    # --sandbox ray: the rows run here, their REPLs on the cluster over the relay.
    rows = _bench(tmp_path / "here", "--method", "rlm", "--sandbox", "ray", "--ray-address", client)
    assert [(r["status"], r["score"]) for r in rows] == [("ok", 1.0)], rows
    assert relay.is_ray_client(ray) and rows[0]["worker_pid"] == os.getpid()
    assert _ray_node(rows[0])
    capsys.readouterr()


@pytest.mark.serial
def test_a_ray_client_driver_runs_repls_over_the_relay_with_sub_calls(client: str, tmp_path: Path) -> None:
    import ray

    from recursa import RLM, Budget
    from recursa.env import RLMEnv
    from recursa.errors import ConfigError
    from recursa.sandbox import make_sandbox
    from recursa.sandbox.cluster import node_hosts
    from recursa.tasks import generate

    task = generate("oolong", 4_000, seed=3)
    rlm = RLM("scripted/gpt5-like", sub_model="scripted/oracle", sandbox="ray", trace_dir=tmp_path,
              sandbox_options={"address": client, "resources": {"cpu_repl": 0.001}},
              budget=Budget(max_llm_calls=400))  # fmt: skip
    result = rlm.run(task.question, context=task.context)
    assert relay.is_ray_client(ray), "the run did not connect through the Ray Client"
    assert result.stop_reason == "final", result.error
    assert task.score(result.answer) > 0.5, (result.answer, task.answer)
    assert result.isolation["process"] is True and result.isolation["ray_node"]
    # llm_query_batched ran in the node's REPL and its sub-calls came back to this process's ledger.
    assert result.usage.llm_calls > result.iterations
    # An environment's episode on the same cluster: a step whose code calls the driver.
    env = RLMEnv("scripted/gpt5-like", sandbox="ray", trace_dir=tmp_path, max_turns=3,
                 sandbox_options={"resources": {"cpu_repl": 0.001}})  # fmt: skip
    try:
        episode = env.start_sync("q?", "the context\n")
        text = episode.step_sync("```repl\nprint('sub:', llm_query('say hi'))\n```")[0]["content"]
        assert "sub:" in text and "Error" not in text, text
        episode.step_sync("FINAL(done)")
        assert episode.done and episode.answer == "done"
        # Training rows as locally: the root's two turns, then the sub-call the node's REPL made.
        rows = episode.rollouts(reward=1.0, include_subcalls=True)
        assert [(r["depth"], r["purpose"], r["reward"]) for r in rows] == [
            (0, "root", 0.0), (0, "root", 1.0), (1, "sub", 0.0)], rows  # fmt: skip
        assert rows[1]["response"] == "FINAL(done)"
        facts = [ray.get(host.describe.remote()) for _, host in node_hosts()]
        # The node's host carried it over a relay and never listened for a TCP stream.
        assert facts and all(f["relays"] >= 1 and not f["listening"] for f in facts), facts
    finally:
        env.close()
    facts = [ray.get(host.describe.remote()) for _, host in node_hosts()]
    assert all(f["live_repls"] == 0 for f in facts), facts

    # A ray:// driver that can reach the nodes (as here) may ask for the stream itself.
    async def streamed() -> tuple[str, bool]:
        sandbox = make_sandbox("ray", resources={"cpu_repl": 0.001}, transport="stream")
        await sandbox.start(lambda name, args: asyncio.sleep(0, "from the driver"))
        try:
            said = (await sandbox.execute("print(llm_query('hi'))", 30)).stdout.strip()
            # While the stream is open (a host with no driver left stops listening).
            return said, all(ray.get(host.describe.remote())["listening"] for _, host in node_hosts())
        finally:
            await sandbox.close()

    assert asyncio.run(streamed()) == ("from the driver", True)
    with pytest.raises(ConfigError, match=r"transport='tcp'.*\"stream\".*\"relay\""):
        make_sandbox("ray", transport="tcp")

    # The node's host dies mid-episode: Ray fails the relay's calls, and the episode stops naming the node.
    env = RLMEnv("scripted/gpt5-like", sandbox="ray", trace_dir=tmp_path, max_turns=3,
                 sandbox_options={"resources": {"cpu_repl": 0.001}})  # fmt: skip
    try:
        episode = env.start_sync("q?", "the context\n")
        episode.step_sync("```repl\nx = 1\nprint(x)\n```")
        node = episode.result.isolation["ray_node"]
        ray.kill(dict(node_hosts())[node])
        episode.step_sync("```repl\nprint(x)\n```")
        assert episode.done and episode.stop_reason == "error", episode.messages[-1]
        assert f"the Ray node {node[:12]}" in (episode.error or ""), episode.error
    finally:
        env.close()
