"""sandbox="ray": REPLs on the nodes of a Ray cluster, simulated on this machine by Ray's own test
utilities (`ray.cluster_utils.Cluster`: a head and worker nodes, each a raylet of its own with its
own resources). Sub-calls and the budget stay on the driver; a node that leaves fails only the
REPLs it held. Last, the same cluster from a driver that cannot reach the nodes: Ray's client
server in a process of its own, and this process connected to it by `ray://`, running bench rows,
an RLM and RLMEnv episodes whose REPLs call back to the driver over the relay, and losing the
node's host under one (the relay without a cluster is in test_ray_relay.py)."""

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="sandbox='ray' needs the ray extra (installed by the dev extra)")
from ray.cluster_utils import Cluster  # noqa: E402

from recursa import RLM, Budget  # noqa: E402
from recursa.env import RLMEnv  # noqa: E402
from recursa.errors import ConfigError, SandboxLost  # noqa: E402
from recursa.sandbox import cgroups, make_sandbox  # noqa: E402
from recursa.sandbox.base import CallbackError, start_loaded  # noqa: E402
from recursa.sandbox.cluster import NodeLost, RaySandbox, node_hosts, relay, shutdown_hosts  # noqa: E402
from recursa.tasks import generate  # noqa: E402
from tests import ray_parity as parity  # noqa: E402
from tests.conftest import Script  # noqa: E402
from tests.helpers import cli_in_process  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REPL = {"cpu_repl": 0.001}  # the custom resource that marks the nodes REPLs may use


def path_without_bwrap(folder: Path) -> str:
    """A PATH that finds every program of this one but bubblewrap: a node started with it is a
    machine without bwrap."""
    folder.mkdir()
    for where in os.environ.get("PATH", "").split(os.pathsep):
        with contextlib.suppress(OSError):
            for name in os.listdir(where):
                if name != "bwrap" and not (folder / name).exists():
                    (folder / name).symlink_to(Path(where) / name)
    return str(folder)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A head that takes no REPLs (it stands for a GPU node) and two CPU nodes that do: a, labelled,
    and b, a machine without bubblewrap."""
    with pytest.MonkeyPatch.context() as env:  # the nodes' raylets and their workers inherit it
        env.setenv("OPENAI_API_KEY", parity.KEY)  # (a node's keys reach no REPL either: the parity test)
        made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                              "resources": {"gpu_like": 1}})  # fmt: skip
        a = made.add_node(num_cpus=1, resources={"cpu_repl": 1, "node_a": 1}, labels={"pool": "cpu-a"})
        env.setenv("PATH", path_without_bwrap(tmp_path_factory.mktemp("nodeb") / "bin"))
        b = made.add_node(num_cpus=1, resources={"cpu_repl": 1, "node_b": 1})
    made.wait_for_nodes()
    ray.init(address=made.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield {"cluster": made, "head": made.head_node.node_id, "a": a.node_id, "b": b.node_id}  # type: ignore[misc]
    finally:
        shutdown_hosts()
        ray.shutdown()
        made.shutdown()


def ray_options(**more: object) -> dict[str, object]:
    return {"resources": REPL, **more}


def test_a_run_on_the_cluster_keeps_sub_calls_and_budget_on_the_driver(cluster: dict, tmp_path: Path) -> None:
    task = generate("oolong", 20_000, seed=3)
    rlm = RLM("scripted/gpt5-like", sub_model="scripted/oracle", sandbox="ray", sandbox_options=ray_options(),
              trace_dir=tmp_path, budget=Budget(max_llm_calls=400))  # fmt: skip
    result = rlm.run(task.question, context=task.context)
    assert result.stop_reason == "final", result.error
    assert task.score(result.answer) > 0.5, (result.answer, task.answer)
    # The REPL ran on a CPU node with the node's own local isolation; the head took none.
    assert result.isolation["ray_node"] in (cluster["a"], cluster["b"])
    assert result.isolation["process"] is True and result.isolation.get("seccomp") is True
    # llm_query_batched ran in the node's REPL and came back to this process's gateway and ledger.
    assert result.usage.llm_calls > result.iterations


async def test_placement_follows_resources_and_labels_and_spreads(cluster: dict) -> None:
    isolation: dict[str, dict] = {}

    async def on(options: dict) -> str:
        sandbox = make_sandbox("ray", **options)
        await sandbox.start(lambda name, args: asyncio.sleep(0))
        try:
            assert isinstance(sandbox, RaySandbox) and sandbox.node is not None
            isolation[sandbox.node.node_id] = sandbox.isolation
            return sandbox.node.node_id
        finally:
            await sandbox.close()

    assert await on({"resources": {"node_b": 1}}) == cluster["b"]
    assert await on({"labels": {"pool": "cpu-a"}}) == cluster["a"]  # a Ray node label (ray start --labels)
    # Each REPL reports what its own node enforced: bubblewrap where that node has it (a has what
    # this machine has), a hardened worker without namespaces on b.
    here = make_sandbox("auto")
    await here.start(lambda name, args: asyncio.sleep(0))
    await here.close()
    assert isolation[cluster["a"]]["bwrap"] == here.isolation["bwrap"]
    assert isolation[cluster["b"]]["bwrap"] is False and isolation[cluster["b"]]["seccomp"] is True
    assert isolation[cluster["b"]]["level"] == "hardened" and isolation[cluster["a"]]["ray_node"] == cluster["a"]
    spread = [make_sandbox("ray", **ray_options()) for _ in range(4)]
    await asyncio.gather(*(s.start(lambda name, args: asyncio.sleep(0)) for s in spread))
    try:
        nodes = [s.node.node_id for s in spread]  # type: ignore[attr-defined]
        assert set(nodes) == {cluster["a"], cluster["b"]}  # never the head, and both CPU nodes
    finally:
        await asyncio.gather(*(s.close() for s in spread))
    with pytest.raises(Exception, match="no live Ray node fits"):
        await on({"resources": {"tpu": 1}})
    with pytest.raises(Exception, match=r"no live Ray node fits .*labels=\{'pool': 'gpu'\}"):
        await on({"labels": {"pool": "gpu"}})


async def test_one_tree_stays_on_one_node_and_a_context_crosses_once_per_node(cluster: dict) -> None:
    from recursa.context import load_payload

    payload = await load_payload("the same context for every REPL\n" * 5_000)
    calls: list[tuple[str, dict]] = []

    async def handler(name: str, args: dict) -> str:
        calls.append((name, args))
        if args.get("prompt") == "too dear":
            raise CallbackError("BudgetExceeded", "the budget's max_usd=1 is used up")
        return "from the driver"

    repls = [make_sandbox("ray", **ray_options(affinity="tree-1")) for _ in range(3)]
    for sandbox in repls:
        await sandbox.start(handler)
    try:
        assert len({s.node.node_id for s in repls}) == 1  # type: ignore[attr-defined]
        await asyncio.gather(*(s.load_context(payload) for s in repls))
        results = await asyncio.gather(*(s.execute("print(len(context), llm_query('hi'))", 30) for s in repls))
        assert all(r.stdout.strip() == f"{len('the same context for every REPL') * 5_000 + 5_000} from the driver"
                   for r in results), [r.stdout + r.stderr for r in results]  # fmt: skip
        assert [c[0] for c in calls] == ["llm_query"] * 3
        # An error raised on the driver reaches the node's code as the same exception, as locally.
        refused = await repls[0].execute(
            "try:\n    llm_query('too dear')\nexcept BudgetExceeded as e:\n    print('refused:', e)", 30
        )
        assert "refused: the budget's max_usd=1 is used up" in refused.stdout, refused
        # A cell past its timeout is interrupted and its REPL keeps its variables, as locally (the
        # host's thread blocks SIGINT, and its REPL workers must not inherit that).
        await repls[1].execute("kept = 'still here'", 30)
        spun = await repls[1].execute("while True:\n    pass", 0.5)
        assert spun.timed_out and not spun.restarted and "KeyboardInterrupt" in (spun.error or ""), spun
        assert (await repls[1].execute("print(kept)", 30)).stdout == "still here\n"
        # A cell that kills its own worker reads as it does locally, word for word.
        local = make_sandbox("auto")
        await local.start(handler)
        try:
            await local.execute("x = 1", 30)  # (the node's REPL ran a cell before, too)
            killed = [await s.execute("import os\nos.kill(os.getpid(), 9)", 30) for s in (repls[2], local)]
        finally:
            await local.close()
        assert killed[0].restarted and (killed[0].error, killed[0].notes) == (killed[1].error, killed[1].notes), killed
        host = repls[0].pool.host(repls[0].node)  # type: ignore[attr-defined]
        facts = await host.describe.remote()
        assert facts["contexts"] == 1 and facts["live_repls"] >= 3
    finally:
        await asyncio.gather(*(s.close() for s in repls))
    facts = await host.describe.remote()
    assert facts["contexts"] == 0 and facts["kept_contexts"] == 1  # no REPL holds it; kept for the next
    # The next REPL there loads the node's copy, in its start's own request (as a run's REPL starts):
    # no object put, no actor call (the pool's refs are dropped and a put would fail).
    pool = repls[0].pool  # type: ignore[attr-defined]
    pool._contexts.clear()
    pool._put = None
    again = make_sandbox("ray", **ray_options(affinity="tree-1"))
    link = pool._connected(repls[0].node)  # type: ignore[attr-defined]
    asked: list[str] = []
    request = link.request

    async def counted(method: str, **fields: Any) -> Any:
        asked.append(method)
        return await request(method, **fields)

    link.request = counted
    try:
        await start_loaded(again, handler, payload)
        assert asked == ["open"], asked
        assert (await again.execute("print(len(context))", 30)).stdout.strip() == str(payload.size_bytes)
        assert (await host.describe.remote())["contexts"] == 1
    finally:
        await again.close()
        payload.close()


async def test_an_answer_a_local_repl_hands_back_comes_back_from_a_node(cluster: dict) -> None:
    # Over half the driver's 64 MiB frame bound: its text crossed from the node twice (as text and
    # as value), and the driver refused the frame, where a local REPL's worker sends it once.
    answers = {}
    for kind in ("ray", "auto"):
        sandbox = make_sandbox(kind, **(ray_options() if kind == "ray" else {}))
        await sandbox.start(lambda name, args: asyncio.sleep(0))
        try:
            done = await sandbox.execute("long = 'x' * (33 << 20)\nFINAL_VAR('long')", 60)
            named = await sandbox.get_variable("long")
            answers[kind] = (done.error, done.final and len(done.final.text), named and len(named.value))
        finally:
            await sandbox.close()
    assert answers["ray"] == answers["auto"] == (None, 33 << 20, 33 << 20), answers


async def test_folder_and_file_contexts_are_read_on_the_driver_and_reach_the_node_as_locally(
    cluster: dict, tmp_path: Path
) -> None:
    import shutil

    from recursa.context import load_payload

    folder = tmp_path / "notes"
    (folder / "deeper").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha\n")
    (folder / "deeper" / "b.md").write_text("beta\n")
    single = tmp_path / "one.txt"
    single.write_text("just one file\n")
    seen: dict[str, list[str]] = {}
    for source in (folder, single):
        payload = await load_payload(source)
        # Gone from the disk before any REPL loads it: what reaches the node is what the driver read.
        if source == folder:
            shutil.rmtree(folder)
        else:
            single.unlink()
        try:
            for kind in ("ray", "auto"):
                sandbox = make_sandbox(kind, **(ray_options() if kind == "ray" else {}))
                await sandbox.start(lambda name, args: asyncio.sleep(0))
                try:
                    await sandbox.load_context(payload)
                    shown = await sandbox.execute("print(type(context).__name__, repr(context))", 30)
                    seen.setdefault(source.name, []).append(shown.stdout + (shown.error or ""))
                finally:
                    await sandbox.close()
        finally:
            payload.close()
    assert "alpha" in seen["notes"][0] and "beta" in seen["notes"][0], seen
    assert "just one file" in seen["one.txt"][0], seen
    assert all(on_node == here for on_node, here in seen.values()), seen


def test_missing_ray_is_named_at_every_front_door(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Before any run or row: at construction, and as one line of the CLI, never a traceback.
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install .*\[ray\]"):
        make_sandbox("ray")
    for make in (RLM, RLMEnv):
        with pytest.raises(ConfigError, match=r"sandbox='ray' needs Ray, which is not installed: pip install .*\[ray\]"):
            make("scripted/gpt5-like", sandbox="ray")
    (tmp_path / "c.txt").write_text("ctx")
    bench = ("bench", "niah", "--sizes", "1k", "--n", "1", "--method", "rlm", "--out", str(tmp_path / "o"))
    for args, needle in ((("run", "q?", "--context", str(tmp_path / "c.txt"), "--sandbox", "ray"), "--sandbox ray needs Ray"),
                         ((*bench, "--sandbox", "ray"), "--sandbox ray needs Ray"),
                         ((*bench, "--executor", "ray"), "--executor ray needs Ray")):  # fmt: skip
        code, err = cli_in_process(capsys, *args)
        assert code == 2 and needle in err and "[ray]" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()  # no row started, no results file


def test_an_unreachable_address_is_named_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # (This process may be connected already, as a trainer's is: then the address is not used.)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    for make in (RLM, RLMEnv):
        with pytest.raises(ConfigError, match=r"'127\.0\.0\.1:9' cannot be reached: nothing answers there"):
            make("scripted/gpt5-like", sandbox="ray", sandbox_options={"address": "127.0.0.1:9"})
    bench = ("bench", "niah", "--sizes", "1k", "--n", "1", "--method", "rlm", "--out", str(tmp_path / "o"),
             "--ray-address", "127.0.0.1:9")  # fmt: skip
    for more in (("--sandbox", "ray"), ("--executor", "ray")):  # (ray.init would retry it for minutes)
        code, err = cli_in_process(capsys, *bench, *more)
        assert code == 2 and "127.0.0.1:9" in err and "cannot be reached" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
    assert issubclass(NodeLost, SandboxLost)


def test_bench_rows_run_their_repls_on_the_cluster(cluster: dict, tmp_path: Path) -> None:
    from recursa.bench import run as run_bench

    def opened() -> dict[str, int]:
        return {node_id: ray.get(host.describe.remote())["opened"] for node_id, host in node_hosts()}

    before = opened()
    report = run_bench("niah", sizes=[4_000], n=2, methods="rlm", out=tmp_path / "bench", progress=False,
                       sandbox="ray", sandbox_options={"resources": {"node_a": 1}})  # fmt: skip
    assert [r["status"] for r in report.rows] == ["ok", "ok"], report.rows
    assert report.mean_score() == 1.0
    # Each row's REPL went to the node the placement named, and is closed.
    after = opened()
    assert after[cluster["a"]] - before.get(cluster["a"], 0) == 2
    assert all(after[n] == before.get(n, 0) for n in after if n != cluster["a"])
    assert ray.get(dict(node_hosts())[cluster["a"]].describe.remote())["live_repls"] == 0


def test_bench_rows_spread_over_actors_on_the_cluster(cluster: dict, tmp_path: Path) -> None:
    # --executor ray: the rows themselves run on actors of the cluster this process is connected to.
    from recursa.bench import run as run_bench

    report = run_bench("niah", sizes="2k", n=4, methods="base,rlm", executor="ray", ray_actors=2,
                       out=tmp_path, progress=False)  # fmt: skip
    assert report.ran == 8 and all(r["status"] == "ok" and r["score"] == 1.0 for r in report.rows)
    pids = {r["worker_pid"] for r in report.rows}
    assert os.getpid() not in pids and len(pids) == 2  # two actors, each running several rows


def test_children_join_their_parents_node_unless_spread(cluster: dict, tmp_path: Path) -> None:
    code = "```repl\nanswers = rlm_query_batched(['a?', 'b?', 'c?'], ['x', 'y', 'z'])\nprint(answers)\n```"
    for placement, expect_one in (("tree", True), ("spread", False)):
        env = RLMEnv("scripted/gpt5-like", sandbox="ray", trace_dir=tmp_path, max_turns=3, max_depth=2,
                     sandbox_options=ray_options(placement=placement))  # fmt: skip
        try:
            episode = env.start_sync("q?", "the context\n")
            episode.step_sync(code)
            children = [e["isolation"].get("ray_node") for e in episode.events if e["type"] == "run_end"]
            parent = episode.result.isolation["ray_node"]
        finally:
            env.close()
        assert len(children) == 3 and None not in children, episode.events[-3:]
        assert (set(children) == {parent}) is expect_one, (placement, parent, children)


def test_skyrl_rows_run_on_the_cluster_unchanged(cluster: dict) -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (the skyrl extra)")
    from recursa.integrations import skyrl as adapter

    # The sandbox and its options are the operator's (env_config); a row may only repeat them.
    config = {"sandbox": "ray", "sandbox_options": {"resources": {"node_a": 1}}}
    env = skyrl_gym.make(adapter.ENV_ID, env_config=config, extras={
        "sandbox": "ray", "max_turns": 3, "reward_spec": {"ground_truth": "14"},
        "extra_info": {"context_text": "fourteen letters"}})  # fmt: skip
    env.init([{"role": "user", "content": "How long is the context?"}])
    first = env.step("```repl\nprint(len(context))\n```")
    assert not first["done"] and "16" in first["observations"][0]["content"]
    last = env.step("FINAL(16)")
    assert last["done"] and env.episode.result.isolation["ray_node"] == cluster["a"]  # the node the options chose
    env.close()


async def test_an_async_environment_closed_on_a_loop_that_goes_on_lets_go_of_its_nodes(cluster: dict) -> None:
    # aclose() on the caller's loop (a server's, a trainer's): the loop's streams to the nodes close
    # with it, as a sync close() ends its loop's; Ray stays as the caller connected it.
    env = RLMEnv("scripted/gpt5-like", sandbox="ray", max_turns=3, sandbox_options={"resources": {"node_a": 1}})
    episode = await env.start("q?", "the context\n")
    assert "REPL output" in (await episode.step("```repl\nprint(len(context))\n```"))[0]["content"]
    host = dict(node_hosts())[cluster["a"]]
    streams = (await host.describe.remote())["streams"]  # (other tests' drivers may hold one too)
    await env.aclose()
    assert (await host.describe.remote())["streams"] == streams - 1 and ray.is_initialized()


@pytest.mark.skipif(cgroups.memory_available() is None, reason="this host can make no memory control group")
def test_the_environments_memory_bound_holds_on_the_nodes(cluster: dict, tmp_path: Path) -> None:
    env = RLMEnv("scripted/gpt5-like", sandbox="ray", trace_dir=tmp_path, max_turns=5, exec_timeout=60,
                 max_memory_bytes=256 << 20, sandbox_options={"resources": {"node_a": 1}})  # fmt: skip
    try:
        episode = env.start_sync("q?", "ctx")
        grab = "held = bytearray(300 << 20)\nfor i in range(0, len(held), 4096):\n    held[i] = 1\nprint('holding')"
        text = episode.step_sync(f"```repl\n{grab}\n```")[0]["content"]
        assert "reached their memory bound (256 MiB)" in text, text
        assert episode.result.isolation["ray_node"] == cluster["a"]
    finally:
        env.close()


@pytest.fixture(scope="module")
def outcomes(cluster: dict, server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every parity case (tests/ray_parity.py) with local REPLs, then with its REPLs on node a
    (which has bubblewrap, as this machine does), one after the other on one event loop, with a
    provider key in this process's environment as in the nodes'."""
    server.holder["responder"] = Script()
    folder = tmp_path_factory.mktemp("parity")

    async def both() -> dict[str, dict[str, Any]]:
        found = {}
        for name, case in parity.CASES.items():
            local = await parity.run_case(server, folder / "local", case, "auto", {})
            remote = await parity.run_case(server, folder / "ray", case, "ray", {"resources": {"node_a": 1}})
            found[name] = {"local": local, "ray": remote}
        return found

    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENAI_API_KEY", parity.KEY)
        return asyncio.run(both())


@pytest.mark.parametrize("name", list(parity.CASES))
def test_a_run_on_the_cluster_is_a_local_run(outcomes: dict[str, dict[str, Any]], name: str) -> None:
    # Answers, stop reasons, errors, what the root saw, sub-calls, the trace's events in order,
    # rollout rows and the isolation report: the same as with local REPLs (ray_parity.py).
    local, remote = outcomes[name]["local"], outcomes[name]["ray"]
    missing = parity.expected_in(local, parity.CASES[name])
    assert not missing, f"expected in the {name} run, locally: {missing}"
    assert local == remote, "\n".join(parity.differences(local, remote))


def test_env_on_the_cluster_a_lost_node_fails_only_its_episodes_and_close_reaps(cluster: dict, tmp_path: Path) -> None:
    # Before only the Ray Client tests, which leave the cluster: it takes node b out of it.
    doomed = next(n for n in cluster["cluster"].worker_nodes if n.node_id == cluster["b"])
    env = RLMEnv("scripted/gpt5-like", sandbox="ray", trace_dir=tmp_path, max_turns=5,
                 sandbox_options=ray_options(max_repls_per_node=1))  # fmt: skip
    try:
        episodes = [env.start_sync(f"q{i}?", f"context {i}\n" * 100) for i in range(2)]
        for episode in episodes:
            episode.step_sync("```repl\nx = len(context)\nprint(x)\n```")
        held = {e: e.result.isolation["ray_node"] for e in episodes}
        assert set(held.values()) == {cluster["a"], cluster["b"]}  # one per node: max_repls_per_node=1
        cluster["cluster"].remove_node(doomed)
        for episode in episodes:
            episode.step_sync("```repl\nprint(x * 2)\n```")
        lost = [e for e in episodes if held[e] == doomed.node_id]
        kept = [e for e in episodes if held[e] != doomed.node_id]
        assert len(lost) == 1 and lost[0].done and lost[0].stop_reason == "error"
        assert doomed.node_id[:12] in (lost[0].error or ""), lost[0].error
        for episode in kept:
            assert not episode.done and "REPL output" in episode.messages[-1]["content"]
            episode.step_sync("FINAL(ok)")
            assert episode.done and episode.answer == "ok"
    finally:
        env.close()
    assert env.live_repls == 0
    # Nothing left running on the nodes that stayed: their hosts hold no REPL and no context.
    facts = [ray.get(host.describe.remote()) for node_id, host in node_hosts() if node_id != doomed.node_id]
    assert len(facts) >= 1 and all(f["live_repls"] == 0 and f["contexts"] == 0 for f in facts), facts


# -- a driver through the Ray Client (`ray://`): the stream's frames relayed over actor calls ------


@pytest.fixture(scope="module")
def client(cluster: dict) -> Iterator[str]:
    """Ray's client server for the module's cluster (in a process of its own, as on a head); this
    process leaves the cluster first: the next test connects it through `ray://`, as a laptop would.
    (The module's own cluster: a second one starting beside it timed out in Ray's startup wait.)"""
    from ray._private.utils import get_ray_client_dependency_error

    if get_ray_client_dependency_error() is not None:
        pytest.skip("the Ray Client needs grpcio (ray[client], in the ray extra)")
    shutdown_hosts()
    ray.shutdown()
    # The server's "legacy" mode is itself the client's driver on the cluster. (`ray start --head`
    # runs the "proxy" mode, which starts such a server per client; on this loaded machine that
    # start failed one time in three, inside Ray.) A port outside the kernel's ephemeral range and
    # Ray's worker ports, which other processes here may hold.
    server, port, log = None, 0, tempfile.TemporaryFile()
    try:
        for _ in range(3):  # a port another process took meanwhile: the server exits, try another
            port = random.randrange(20_000, 30_000)
            server = subprocess.Popen(
                [sys.executable, "-m", "ray.util.client.server", f"--address={cluster['cluster'].address}",
                 "--host=127.0.0.1", f"--port={port}", "--mode=legacy"], stdout=subprocess.DEVNULL, stderr=log,
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


# The last tests of the module (node b is gone): this process left the cluster for the Ray Client.
# First of them: this process is not connected yet, so the command connects it through `ray://` itself.
def test_bench_through_a_ray_client(
    client: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_a_ray_client_driver_runs_repls_over_the_relay_with_sub_calls(client: str, tmp_path: Path) -> None:
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
        facts = {node: ray.get(host.describe.remote()) for node, host in node_hosts()}
        # The episode's node host carried it over a relay, and no host listened for a TCP stream.
        # (The bench rows before may have had a host on the head as well.)
        assert facts[episode.result.isolation["ray_node"]]["relays"] >= 1, facts
        assert not any(f["listening"] for f in facts.values()), facts
    finally:
        env.close()
    assert all(f["live_repls"] == 0 for f in (ray.get(h.describe.remote()) for _, h in node_hosts())), facts

    # A ray:// driver that can reach the nodes (as here) may ask for the stream itself.
    async def streamed() -> tuple[str, bool]:
        sandbox = make_sandbox("ray", resources={"cpu_repl": 0.001}, transport="stream")
        await sandbox.start(lambda name, args: asyncio.sleep(0, "from the driver"))
        try:
            said = (await sandbox.execute("print(llm_query('hi'))", 30)).stdout.strip()
            # Its node's host, while the stream is open (a host with no driver left stops listening).
            host = dict(node_hosts())[sandbox.node.node_id]  # type: ignore[attr-defined]
            return said, ray.get(host.describe.remote())["listening"]
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
