"""sandbox="ray" from a driver that cannot reach the nodes (a Ray Client, `ray://`): the stream's
frames relayed over actor calls (relay.py).

First without a cluster, as test_ray_stream.py does: the plain host (RelayHost over NodeHost) behind a
stand-in for its actor handle, the driver's NodeLink choosing its carrier. Through a real Ray Client
(`ray://`): at the end of test_ray_sandbox.py, on its cluster."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
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
