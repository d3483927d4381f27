"""The verifiers adapter: plugin loading, the family reward, and verifiers' own ACP session code
driving `recursa acp` against the fake server.

verifiers pins mcp==2.0.0 and openai 2.x, so these tests run in their own environment
(.ci/run makes it); elsewhere they skip. What is not run here: a whole `Env.run_episode`, which
puts verifiers' interception server between the agent and the model (it records the model calls a
rollout must commit) and installs its ACP runner with uv; the runner itself is run below, once with
local REPLs and once with the agent's REPL on a Ray cluster (simulated here; .ci/run installs the
ray extra in this venv too).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed here (pip install recursa[verifiers])")
pytest.importorskip("acp", reason="agent-client-protocol is not installed (pip install recursa[acp])")

from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.utils.loaders import harness_class, taskset_class

from recursa.integrations import verifiers as adapter
from recursa.tasks import generate
from recursa.testing.fake_server import FakeServer

ROOT = Path(__file__).resolve().parents[1]


class LocalRuntime(SubprocessRuntime):
    """verifiers' subprocess runtime, with its ACP runner run by this interpreter (which has the
    runner's two dependencies) instead of a uv environment made from the network."""

    async def prepare_uv_script(self, script, env=None, *, activate=True):
        path = Path(self.workdir) / "acp_runner.py"
        path.write_text(script if isinstance(script, str) else script.decode())
        return [sys.executable, str(path)]


def traced(folder: Path) -> list[dict]:
    """Every event of the traces under `folder`."""
    return [json.loads(line) for f in folder.glob("**/*.jsonl") for line in f.read_text().splitlines()]


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


def test_plugin_ids_resolve_to_the_harness_and_taskset() -> None:
    assert harness_class(adapter.PLUGIN_ID) is adapter.RecursaHarness
    assert taskset_class(adapter.PLUGIN_ID) is adapter.RecursaTaskset
    taskset = adapter.RecursaTaskset(
        adapter.RecursaTasksetConfig(id=adapter.PLUGIN_ID, seeds=[1, 2], size_chars=3_000)
    )
    tasks = list(taskset)
    assert [t.data.seed for t in tasks] == [1, 2] and all(t.data.family == "niah" for t in tasks)
    assert generate("niah", 3_000, 1).question in tasks[0].data.prompt


async def test_family_scorer_is_the_reward() -> None:
    task = next(
        iter(adapter.RecursaTaskset(adapter.RecursaTasksetConfig(id=adapter.PLUGIN_ID, size_chars=3_000)))
    )
    gold = generate("niah", 3_000, 0).gold
    assert await task.family_score(SimpleNamespace(root_reply=f" {gold} ")) == 1.0
    assert await task.family_score(SimpleNamespace(root_reply="no idea")) == 0.0


async def rollout(server: FakeServer, tmp_path: Path, *options: str, **env: str) -> Trace:
    """One rollout of verifiers' ACP session driving `recursa acp options...` with the task below,
    its model reached directly (the session says so once the turn has completed)."""
    config = adapter.RecursaHarnessConfig(
        command=[sys.executable, "-m", "recursa.cli", "acp", "--trace-dir", str(tmp_path), *options],
        env={"PYTHONPATH": str(ROOT), **env},
        max_iterations=5,
    )
    harness = adapter.RecursaHarness(config)
    runtime = LocalRuntime(SubprocessConfig(), name=f"recursa-{os.getpid()}-{tmp_path.name}")
    await runtime.start()
    data = adapter.RecursaTaskData(
        prompt="What is the password? It is swordfish.", family="niah", size_chars=1, seed=0
    )
    trace = Trace(task=TraceTask(type="RecursaTask", data=data), agent=AgentInfo(config=AgentConfig()))
    ctx = SimpleNamespace(model="policy")
    acp_config = await harness.prepare_acp(ctx, trace, runtime, server.base_url, "rollout-secret", {}, data)
    meta = acp_config.session_meta[adapter.RUNTIME_KEY]
    assert meta["model"] == "openai/policy" and meta["base_url"] == server.base_url
    session = await harness.session(ctx, trace, runtime, server.base_url, "rollout-secret", {}, data)
    try:
        # The rollout must commit model calls through verifiers' interception server; here the
        # model is reached directly, so the session says so after the turn has completed.
        with pytest.raises(RuntimeError, match="without committing a model turn"):
            await session._run(None)
    finally:
        await session.close()
    return trace


async def test_verifiers_acp_session_runs_recursa_acp(server: FakeServer, script, tmp_path: Path) -> None:
    script.root("policy", code("print(len(context))"), "FINAL(swordfish)")
    trace = await rollout(server, tmp_path)
    assert trace.root_reply == "swordfish"
    assert trace.metrics["recursa_iterations"] == 2.0 and trace.metrics["recursa_llm_calls"] == 2.0
    first = server.requests[0]
    assert first.model == "policy" and first.headers["x-rlm-depth"] == "0"
    assert first.headers["authorization"] == "<redacted>"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster (Ray's own test utility), which this process does not join: the
    agent the harness starts does."""
    pytest.importorskip("ray", reason="Ray is not installed here (recursa[ray]; .ci/run adds it here)")
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        yield made.address
    finally:
        made.shutdown()


async def test_a_rollout_runs_its_repl_on_a_ray_cluster(
    server: FakeServer, script, tmp_path: Path, ray_cluster: str
) -> None:
    # The operator's command asks for sandbox="ray"; Ray's own RAY_ADDRESS in the harness's env names
    # the cluster. The REPL's sub-call comes back to the agent and goes to the rollout's endpoint.
    script.root("policy", code("print('sub:', llm_query('say hi'))"), "FINAL(swordfish)")
    script.sub("policy", lambda prompt: f"hi back to {prompt!r}")
    trace = await rollout(server, tmp_path, "--sandbox", "ray", RAY_ADDRESS=ray_cluster)
    assert trace.root_reply == "swordfish"
    assert trace.metrics["recursa_llm_calls"] == 3.0  # two root turns and the REPL's sub-call
    sub = [r for r in server.requests if r.headers["x-rlm-depth"] == "1"]
    assert len(sub) == 1 and sub[0].headers["authorization"] == "<redacted>"
    ends = [e for e in traced(tmp_path) if e.get("type") == "run_end"]
    assert len(ends) == 1 and ends[0]["isolation"].get("ray_node"), ends
    assert ends[0]["isolation"]["process"] is True


def test_the_harness_config_carries_sandbox_settings_checked_as_recursas() -> None:
    """A verifiers config could not choose the agent's sandbox options (a Ray cluster's address,
    resources, labels; snapshots) but by writing `recursa acp`'s flags into `command` by hand; now
    its fields carry them to the command as the flags recursa's parser reads back, and they, as
    recursa's other settings there, are checked by recursa's schema when the config is made."""
    from pydantic import ValidationError

    from recursa.cli import _parser
    from recursa.cli_options import run_kwargs

    options = {"address": "ray://head:10001", "resources": {"repl": 1}, "labels": {"pool": "cpu"}, "snapshots": True}
    config = adapter.RecursaHarnessConfig(sandbox="ray", sandbox_options=options)
    command = adapter.agent_command(config)
    assert command[:2] == ["recursa", "acp"]
    args = _parser().parse_args([*command[1:], "--model", "scripted/gpt5-like"])
    assert (args.sandbox, run_kwargs(args)["sandbox_options"]) == ("ray", options)
    assert adapter.agent_command(adapter.RecursaHarnessConfig()) == ["recursa", "acp"]
    for given, said in [
        ({"sandbox_options": {"start_timout": 30}}, r"RecursaHarnessConfig\(sandbox_options=\{'start_timout': 30\}\): "
         r"sandbox_options must be options sandbox 'auto' takes: it takes no option 'start_timout' \(did you mean"),
        ({"sandbox": "vm"}, r"RecursaHarnessConfig\(sandbox='vm'\): sandbox must be a sandbox kind"),
        ({"max_depth": -1}, r"RecursaHarnessConfig\(max_depth=-1\): max_depth must be an int >= 0"),
        ({"budget": {"max_usd": -1}}, r"RecursaHarnessConfig.budget\['max_usd'\]=-1: a cap below zero"),
    ]:  # fmt: skip
        with pytest.raises(ValidationError, match=said):
            adapter.RecursaHarnessConfig(**given)
