"""verifiers adapter: a v1 harness that runs `recursa acp`, and a taskset of recursa's task families.

verifiers' v1 harnesses drive agents over the Agent Client Protocol. `RecursaHarness` starts
`recursa acp` in the rollout's runtime and points its model at the endpoint verifiers gives the
rollout (its interception server, which records every model call), through the ACP session's
`_meta` (`recursa/runtime-v1`). `RecursaTaskset` yields tasks of one `recursa.tasks` family; their
reward is that family's scorer on the agent's reply. verifiers finds plugins by a top-level module
name, so both are also exported by the module `recursa_verifiers`, plugin id `recursa-verifiers`:

    --env.taskset.id recursa-verifiers --env.agent.harness.id recursa-verifiers

Needs `pip install "recursa[verifiers]"` in an environment of its own: verifiers pins `mcp==2.0.0`
and openai 2.x (recursa's `mcp` extra accepts mcp 2.0; see docs/environments.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import Field, model_validator
from verifiers.v1.acp import ACPConfig, ACPHarness, ACPTurn
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.task import Task, TaskConfig, TaskData
from verifiers.v1.taskset import Taskset, TasksetConfig
from verifiers.v1.utils.decorators import reward

from recursa.cli_options import pairs_flags
from recursa.config import DEFAULTS as D
from recursa.config import SETTINGS, Spelling
from recursa.context import context_text
from recursa.overrides import budget_value, checked_value
from recursa.tasks import generate
from recursa.tasks.base import get

PLUGIN_ID = "recursa-verifiers"
RUNTIME_KEY = "recursa/runtime-v1"
RUN_KEY = "recursa/run-v1"
# How a recursa run that stopped early reads in a verifiers trace.
_STOPS = {"max_iterations": "max_turns", "budget": "max_total_tokens"}

__all__ = [
    "RecursaHarness",
    "RecursaHarnessConfig",
    "RecursaTask",
    "RecursaTaskData",
    "RecursaTaskset",
    "RecursaTasksetConfig",
    "session_meta",
]


class RecursaHarnessConfig(HarnessConfig):
    id: str = PLUGIN_ID
    command: list[str] = Field(default_factory=lambda: ["recursa", "acp"])
    """How the runtime starts the agent (recursa must be installed there)."""
    max_depth: int = D.max_depth
    max_iterations: int = D.max_iterations
    sub_model: str | None = None
    """The model behind llm_query; by default the rollout's own model (shared-policy training)."""
    budget: dict[str, Any] | None = None
    """`recursa.Budget` fields for each prompt, e.g. {"max_llm_calls": 200}."""
    call_headers: bool = True
    """Send X-RLM-Call-Id / -Parent-Id / -Depth with every model call."""
    dialect: str = D.dialect
    """The conversation the rollout's model sees (docs/dialects.md), e.g. "verifiers" or "tools"."""
    sandbox: str | None = None
    """Where the agent's REPLs run, a recursa sandbox kind such as "ray" (None: the command's own)."""
    sandbox_options: dict[str, Any] | None = None
    """The sandbox's options, e.g. {"resources": {"repl": 1}} for "ray" (docs/cluster.md): given to
    the command as `--sandbox-option` flags."""

    @model_validator(mode="after")
    def _checked(self) -> RecursaHarnessConfig:
        # recursa's settings checked by its schema before any rollout, named as this config's fields;
        # sandbox_options beside sandbox, whose options they are.
        spelling, done = Spelling("python", type(self).__name__), {}
        for name in ("max_depth", "max_iterations", "call_headers", "sandbox", "sandbox_options"):
            if getattr(self, name) is not None:
                done[name] = checked_value(name, getattr(self, name), spelling, beside=done)
        if self.budget is not None:
            budget_value(f"{type(self).__name__}.budget", self.budget)
        return self


def agent_command(config: RecursaHarnessConfig) -> list[str]:
    """The command that starts the agent: `config.command` and the flags of its sandbox settings (the
    operator's to choose, so flags of `recursa acp`, not the session's `_meta`)."""
    flags = [SETTINGS["sandbox"].flag or "", config.sandbox] if config.sandbox is not None else []
    return [*config.command, *flags, *pairs_flags("sandbox_options", config.sandbox_options or {})]


def session_meta(model: str, endpoint: str, secret: str, config: RecursaHarnessConfig) -> dict[str, Any]:
    """The ACP session `_meta` that points `recursa acp` at the rollout's model endpoint."""
    spec = model if model.startswith(("openai/", "anthropic/")) else f"openai/{model}"
    return {
        RUNTIME_KEY: {
            "model": spec,
            "sub_model": config.sub_model or spec,
            "base_url": endpoint,
            "api_key": secret,
            "max_depth": config.max_depth,
            "max_iterations": config.max_iterations,
            "budget": config.budget,
            "call_headers": config.call_headers,
            "dialect": config.dialect,
        }
    }


class RecursaHarness(ACPHarness[RecursaHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = False

    async def prepare_acp(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
    ) -> ACPConfig:
        _, prompt = self.resolve_prompt(data)
        return ACPConfig(
            env=dict(self.config.resolved_env),
            command=agent_command(self.config),
            prompt=prompt,
            session_meta=session_meta(ctx.model, endpoint, secret, self.config),
        )

    def acp_turn_result(self, trace: Any, result: ACPTurn) -> None:
        run = result.response_metadata.get(RUN_KEY)
        if not isinstance(run, dict):
            return
        usage = run.get("usage") or {}
        metrics = {
            "recursa_iterations": run.get("iterations"),
            "recursa_llm_calls": usage.get("llm_calls"),
            "recursa_cost_usd": usage.get("cost_usd"),
        }
        trace.record_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
        condition = _STOPS.get(str(run.get("stop_reason")))
        if condition is not None:
            trace.stop(condition)


class RecursaTaskData(TaskData):
    family: str
    size_chars: int
    seed: int
    knobs: dict[str, Any] = Field(default_factory=dict)


class RecursaTaskConfig(TaskConfig):
    pass


class RecursaTask(Task[RecursaTaskData, Any, RecursaTaskConfig]):
    @reward(weight=1.0)
    async def family_score(self, trace: Any) -> float:
        """The family's own scorer on the agent's final reply, in [0, 1]."""
        data = self.data
        task = generate(data.family, data.size_chars, data.seed, **data.knobs)
        return get(data.family).score(task, (trace.root_reply or "").strip())


class RecursaTasksetConfig(TasksetConfig):
    family: str = "niah"
    size_chars: int = 20_000
    seeds: list[int] = Field(default_factory=lambda: [0])
    knobs: dict[str, Any] = Field(default_factory=dict)
    task: RecursaTaskConfig = RecursaTaskConfig()


class RecursaTaskset(Taskset[RecursaTask, RecursaTasksetConfig]):
    """Generated tasks: the question, then the context, in one prompt (the agent reads the prompt
    as its context and carries out the request in it)."""

    def load(self) -> Iterator[RecursaTask]:
        c = self.config
        for seed in c.seeds:
            task = generate(c.family, c.size_chars, seed, **c.knobs)
            context = context_text(task.context)
            prompt = f"{task.question}\n\n{context}"
            data = RecursaTaskData(
                id=task.id, prompt=prompt, family=c.family, size_chars=c.size_chars, seed=seed, knobs=c.knobs
            )
            yield RecursaTask(data, c.task)
