"""SkyRL-gym adapter: recursa's RLM as a `BaseTextEnv`, registered as "recursa-rlm".

    import recursa.integrations.skyrl  # registers the id with skyrl_gym
    env = skyrl_gym.make("recursa-rlm", env_config={}, extras=row_extras)
    chat, metadata = env.init(prompt)          # system prompt, question and context facts
    out = env.step(policy_output)              # {"observations", "reward", "done", "metadata"}
    env.close()

A drop-in replacement for SkyRL's own RLM environment: it takes the same knobs from `extras`
(`max_turns`, `repl_timeout`, `lm_callback`, `subcall_fn`, `custom_tools`, `custom_system_prompt`,
`judge_reward_fn`, `depth`, the context under `extra_info.context_text`, `reward_spec` with
`ground_truth` or `reward_fn`) and adds a sandboxed REPL, budgets, traces and child RLMs. Extras
of its own: `max_depth`, `sub_model` / `base_url` / `api_key` (an OpenAI-compatible server for the
sub-calls), `sub_call` (an async function, as for `RLMEnv`), `budget` (a dict of `Budget` fields),
`family` (a `recursa.tasks` family whose scorer gives the reward), `scorer` (answer -> float),
`turn_timeout` (seconds for all the code of one step together; default: `repl_timeout`),
`sandbox`, `sandbox_options` and `trace_dir` (env_config's: a row may only repeat them), `max_live_repls`, `wait_for_repl`, `dialect` (the conversation: "skyrl"
for SkyRL's own, exactly; see docs/dialects.md) and `dialect_options`. Every knob is checked when the
environment is made (`checked_extras`): a wrong kind or a misspelt name is refused naming the key.
With `subcall_fn`, `rlm_query` children are the generator's own rollouts (as in SkyRL); without
it, recursa child RLMs whose turns go where the other sub-calls go.

The same knobs in `env_config` (SkyRL's config for this environment id) are defaults that a
row's extras override, within the config's limits (`_within`).

Episodes of environments with the same settings share one `RLMEnv` (its event loop thread, fork
server and connection pool), so a generator's hundreds of environments cost one of each.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from skyrl_gym import register as _register
from skyrl_gym import registry as _registry
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from recursa.config import ENV_SPELLING, Spelling, setting_of
from recursa.env import ChildCall, Episode, ReplyRefused, RLMEnv, SubCall
from recursa.env.quota import EPISODE_SHARE, QuotaWords, ReplQuota
from recursa.errors import ConfigError
from recursa.lm.base import Message
from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION
from recursa.overrides import (
    budget_value,
    check_keys,
    checked_value,
    client_settings,
    function_value,
    int_value,
    kind,
    same_url,
    text_value,
)
from recursa.tasks import Task
from recursa.tasks.base import get
from recursa.tools.spec import host_tool

ENV_ID = "recursa-rlm"
# The extras that are run settings: SkyRL's name (its own environment's) -> the schema's
# (recursa/config.py), which checks them; RLMEnv takes them by its own names (`_ENV_KEYWORDS`).
_RUN_EXTRAS = {"max_turns": "max_iterations", "repl_timeout": "exec_timeout", "turn_timeout": "turn_timeout",
               "max_depth": "max_depth", "sub_model": "sub_model", "base_url": "base_url", "api_key": "api_key",
               "budget": "budget", "sandbox": "sandbox", "sandbox_options": "sandbox_options", "trace_dir": "trace_dir", "max_live_repls": "max_live_repls",
               "max_repls_per_episode": "max_repls_per_episode", "max_output_chars": "max_output_chars", "wait_for_repl": "wait_for_repl",
               "max_reply_chars": "max_reply_chars", "dialect": "dialect",
               "dialect_options": "dialect_options", "sampling": "sampling"}  # fmt: skip
_SPELLED = {schema: extra for extra, schema in _RUN_EXTRAS.items()}
# The settings as env_config, the operator's config, holds them, with RLMEnv's defaults.
_CONFIG_SPELLING = Spelling("key", "env_config", _SPELLED, ENV_SPELLING.defaults, operator=True)
# SkyRL's own environment gives a cell this long; a drop-in keeps its default.
SKYRL_REPL_TIMEOUT = 180.0

SKYRL_WORDS = QuotaWords(
    limit="extras['max_live_repls']={n}",
    knob="extras['max_live_repls']",
    depth="extras['max_depth']",
    close="close finished environments (env.close())",
    fewer="run fewer rollouts at once",
    wait="let init wait for a slot with extras['wait_for_repl'] (seconds)",
    episode_limit="extras['max_repls_per_episode']={n}",
    episode_knob="extras['max_repls_per_episode']",
)

_envs: dict[str, RLMEnv] = {}
# One set of bounds (live REPLs, the memory they hold) per max_live_repls, max_memory_bytes and sandbox,
# shared by the environments of rows whose other settings differ (a per-row budget, max_turns or
# max_output_chars makes an RLMEnv each): with bounds per RLMEnv, N such groups could keep N times
# max_live_repls REPLs alive, holding N times the memory bound.
_bounds: dict[tuple[int, Any, str], RLMEnv] = {}
_envs_lock = threading.Lock()


class RecursaRLMEnv(BaseTextEnv):
    """One RLM episode per instance, as SkyRL's generator uses environments."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        # SkyRL hands over its config for this environment id (`env_config`) and the dataset row's
        # `extras`: the config's knobs are the defaults, a row's override them.
        # A row may lower what the config's limits cost, never raise them (recursa/overrides.py).
        operator = checked_extras(env_config or None, "env_config", strict=True)
        row = _within(checked_extras(extras, run_settings=False), operator)
        self.extras = {**operator, **row}
        self.env_config = env_config
        self._env = shared_env(self.extras)
        # The generator's cap on steps: max_turns code turns, then the one reply that may only
        # answer (none under SkyRL's own dialect, whose episode ends after max_turns).
        self.max_turns = self._env.config.max_iterations + (1 if self._env.dialect.final_call else 0)
        self.episode: Episode | None = None
        self._reward = 0.0
        self._scored = False  # a scorer was given (else, under SkyRL's dialect, its default reward)
        # The generator's own chat history (the list init returns): under a dialect whose per-turn
        # prompt is transient, step() pops the stale one off it first, as SkyRL's environment does.
        self._chat: ConversationType | None = None

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            raise ConfigError(
                "RecursaRLMEnv.init(prompt): prompt must be a list of {'role', 'content'} messages"
            )
        if self.episode is not None:  # init again: the generator reuses the object for a new rollout
            self.episode.abort_sync()
        text = "\n".join(str(m.get("content") or "") for m in prompt if m.get("content"))
        context = _context(self.extras)
        question = text if context is not None else PROMPT_AS_CONTEXT_QUESTION
        system = self.extras.get("custom_system_prompt")
        scorer = _scorer(self.extras, question, context)
        self._scored = scorer is not None
        self.episode = self._env.start_sync(
            question,
            context if context is not None else text,
            task_id=_task_id(self.extras),
            scorer=scorer,
            sub_call=_sub_call(self.extras),
            child_call=_child_call(self.extras),
            tools=_custom_tools(self.extras.get("custom_tools")),
            system_prompt=system if isinstance(system, str) and system.strip() else None,
        )
        self._chat = self.episode.messages
        return self._chat, {"run_id": self.episode.run_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        episode = self._live("step")
        if episode.done:  # in this API's words, not RLMEnv's
            raise ConfigError(
                f"RecursaRLMEnv.step() after the episode is done (stop_reason={episode.stop_reason!r}); "
                "call init(prompt) to start the next one"
            )
        self.turns += 1
        if self._env.dialect.turn_prompt == "transient" and self._chat:
            self._chat.pop()  # step() runs before the generator appends this turn's messages
        try:
            observations = episode.step_sync(action)
        except ReplyRefused as exc:
            # What the policy generates is hostile input: one over-long generation (a repetition
            # loop up to the length cap) must not stop the trainer. SkyRL's own environment runs
            # any str; here nothing runs, the policy is told, and the step counts toward max_turns.
            return self._refused(episode, exc)
        done = episode.done
        if done:
            self._reward = float(episode.reward or 0.0)
            if not self._scored and self._env.dialect.name == "skyrl":
                # SkyRL's own default: 1.0 for an episode that gave an answer, else 0.0.
                self._reward = 1.0 if episode.stop_reason == "final" and episode.answer else 0.0
        return BaseTextEnvStepOutput(
            observations=observations,
            reward=self._reward if done else 0.0,
            done=done,
            metadata={
                "run_id": episode.run_id,
                "turn": episode.turn,
                "stop_reason": episode.stop_reason,
                "answer": episode.answer if done else None,
                "trace_path": str(episode.trace_path) if episode.trace_path else None,
            },
            postprocessed_action=None,
        )

    def _refused(self, episode: Episode, exc: ReplyRefused) -> BaseTextEnvStepOutput:
        if exc.too_long is not None:
            said = (
                f"Your reply had {exc.too_long:,} characters, more than the "
                f"{self._env.max_reply_chars:,} allowed, so nothing in it ran. Reply again, shorter: "
                "one ```repl block of code, or FINAL(your answer)."
            )
        else:
            said = "Your reply was not text, so nothing in it ran. Reply with text."
        return BaseTextEnvStepOutput(
            # Under a transient per-turn prompt (popped at the start of this step), it comes again.
            observations=[{"role": "user", "content": said}, *self._transient_prompt(episode)],
            reward=0.0,
            done=False,
            metadata={
                "run_id": episode.run_id,
                "turn": episode.turn,
                "stop_reason": None,
                "answer": None,
                "trace_path": str(episode.trace_path) if episode.trace_path else None,
                "refused": str(exc),
            },
            postprocessed_action=None,
        )

    def _transient_prompt(self, episode: Episode) -> list[Message]:
        if self._env.dialect.turn_prompt != "transient":
            return []
        return episode.messages[-1:]

    def close(self) -> None:
        """End the episode, also while a step of it runs on another thread (a generator that gave
        up on a rollout): that step is cancelled. Calling it again does nothing, as skyrl_gym's
        `Env.close` promises."""
        if self.episode is not None:
            self.episode.abort_sync()

    def get_metrics(self) -> dict[str, Any]:
        episode = self.episode
        done = episode is not None and episode.done
        return {
            "turns_used": self.turns,
            "final_value_set": bool(done and episode.answer and episode.stop_reason == "final"),
            "final_answer": episode.answer if done else None,
            "reward": self._reward,
            "llm_calls": episode.usage.llm_calls if episode is not None else 0,
        }

    def rollouts(self, **kwargs: Any) -> list[dict[str, Any]]:
        """The episode's rows (the root's and every child's turns), as `Episode.rollouts`."""
        return self._live("rollouts").rollouts(**kwargs)

    def _live(self, what: str) -> Episode:
        if self.episode is None:
            raise ConfigError(f"RecursaRLMEnv.{what}() before init(prompt): call init first")
        return self.episode


def shared_env(extras: dict[str, Any]) -> RLMEnv:
    """The `RLMEnv` for these settings, made once per process."""
    settings: dict[str, Any] = {k: extras.get(k) for k in _RUN_EXTRAS}
    settings["delegated"] = [
        k for k in ("lm_callback", "sub_call", "subcall_fn") if extras.get(k) is not None
    ]
    key = json.dumps(settings, sort_keys=True, default=str)
    with _envs_lock:
        env = _envs.get(key)
        if env is None:
            env = _envs[key] = _make_env(extras)
        return env


def _default_depth(extras: dict[str, Any]) -> int:
    # SkyRL's subcall_fn runs rlm_query's children in the trainer: that takes a depth of 2.
    if extras.get("subcall_fn") is not None:
        return 2
    delegated = extras.get("lm_callback") is not None or extras.get("sub_call") is not None
    return 1 if delegated or extras.get("sub_model") else 0


def _make_env(extras: dict[str, Any]) -> RLMEnv:
    delegated = extras.get("lm_callback") is not None or extras.get("sub_call") is not None
    given = {schema: extras[k] for k, schema in _RUN_EXTRAS.items() if extras.get(k) is not None}
    given.setdefault("max_depth", _default_depth(extras))
    given.setdefault("exec_timeout", SKYRL_REPL_TIMEOUT)
    given["sub_call"] = _no_sub_call if delegated and not extras.get("sub_model") else None
    try:  # what the settings say together (a Ray cluster that does not answer), in this API's keys
        env = RLMEnv.configured(given, _CONFIG_SPELLING)
    except ConfigError as exc:
        raise ConfigError(_CONFIG_SPELLING.told(exc), setting=exc.setting) from None
    key = (env.quota.limit, env.max_memory_bytes, env.config.sandbox)
    holder = _bounds.get(key)  # shared_env holds _envs_lock
    if holder is None:
        # The bound's errors, a child's too, in this API's knobs.
        env.quota = ReplQuota(env.quota.limit, SKYRL_WORDS)
        _bounds[key] = env
    else:
        env.share_bounds(holder)
    return env


# What each extra must be, and the reader that checks it (and makes it what RLMEnv takes).
def _fn(signature: str) -> Callable[[str, Any], Any]:
    return lambda name, value: function_value(name, value, signature)


_EXTRAS: dict[str, Callable[[str, Any], Any]] = {
    "depth": lambda n, v: int_value(n, v, 0),
    "custom_system_prompt": text_value,
    "family": lambda n, v: get(text_value(n, v)).name,
    "lm_callback": _fn("(prompts: list[str]) -> list[str]"),
    "subcall_fn": _fn("(prompt, context=None) -> str"),
    "sub_call": _fn("async (messages, depth, parent_id) -> str"),
    "judge_reward_fn": _fn("(answer) -> float"),
    "scorer": _fn("(answer) -> float"),
    "extra_info": lambda n, v: _dict_value(n, v),
    "reward_spec": lambda n, v: _dict_value(n, v),
}
_PASSED = ("custom_tools", "context", "task_id")  # checked where they are used


def _within(row: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The row, whose run settings may lower, never raise, what the config sets for them (or, where
    it sets nothing, what the environment takes by default), repeat and never change its sandbox and
    trace_dir, and name a model or server other than the config's only with its own `api_key`; its
    `sampling` is merged over the config's (a role's options the row leaves out stay the config's),
    and so is its `budget` (a cap the row leaves out stays the config's). The row's run settings are
    checked here, once, as `client_settings` checks a client's."""
    given = {_RUN_EXTRAS[k]: v for k, v in row.items() if k in _RUN_EXTRAS}
    limits = _operator_limits(config, row)
    url, mine = given.get("base_url"), given.get("api_key")
    if url is not None and not mine and not same_url(url, limits.get("base_url") or ""):
        # The key this environment calls with (env_config's, or the provider's variable) would go
        # to a server the row chose: a dataset could collect it.
        raise ConfigError(
            f"extras['base_url']={url[:200]!r} is not env_config's base_url, and the key this "
            "environment calls with goes only there; send the row's own key in extras['api_key'], "
            "set base_url in env_config, or leave it out of the row"
        )
    run = client_settings(
        given,
        limits,
        Spelling("key", "extras", _SPELLED),
        models=[limits["sub_model"]] if "sub_model" in limits else [],
        own_key=bool(row.get("api_key")),
        stated_only=True,
    )
    # A run setting the row leaves None is not set: the config's holds (a None budget dropped its caps).
    kept = {k: v for k, v in row.items() if k not in _RUN_EXTRAS or v is not None}
    return kept | {_SPELLED[name]: value for name, value in run.items()}


def _operator_limits(config: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The config's run settings, and for a setting that costs money or capacity and that it leaves
    out, the value the environment takes when no row sets it: a dataset's row (env_config={}, as
    most trainers configure it) asked for max_depth=50 or max_live_repls=100000 on the operator's
    key and machine."""
    limits = {_RUN_EXTRAS[k]: v for k, v in config.items() if k in _RUN_EXTRAS and v is not None}
    depth = limits.get("max_depth", _default_depth({**config, **row}))
    implied = {"max_depth": depth, "exec_timeout": SKYRL_REPL_TIMEOUT,
               "max_repls_per_episode": max(EPISODE_SHARE, depth)}  # fmt: skip
    for schema in _RUN_EXTRAS.values():
        declared = setting_of(schema)
        if schema not in limits and declared.client == "tighten":
            limits[schema] = implied.get(schema, declared.env[1] if declared.env else declared.default)
    return limits


def checked_extras(
    extras: Any, name: str = "extras", *, strict: bool = False, run_settings: bool = True
) -> dict[str, Any]:
    """The extras with every knob checked: a wrong type, or a near miss of a knob's name
    (`max_turn`), is a ConfigError naming `extras[key]`. Other keys (a dataset row's own, such as
    `data_source`) pass through untouched, as SkyRL hands the whole row over; with `strict` (the
    environment's own `env_config`) they are refused too. `run_settings=False`: the run settings
    are left to the caller's check (a row's, within the config's limits: `_within`)."""
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        raise ConfigError(f"{name} is {kind(extras)}; give a dict")
    check_keys(extras, [*_EXTRAS, *_RUN_EXTRAS, *_PASSED], lambda key: f"{name}[{key!r}]", strict=strict)
    checked = dict(extras)
    spelling = _CONFIG_SPELLING if name == "env_config" else Spelling("key", name, _SPELLED)
    done: dict[str, Any] = {}  # the run settings checked so far, by the schema's names
    for key, schema in _RUN_EXTRAS.items() if run_settings else ():
        if extras.get(key) is not None:
            value = extras[key]
            reading = budget_value(f"{name}[{key!r}]", value) if key == "budget" else None
            checked[key] = done[schema] = reading or checked_value(schema, value, spelling, beside=done)
    for key, read in _EXTRAS.items():
        if extras.get(key) is not None:
            try:
                checked[key] = read(f"{name}[{key!r}]", extras[key])
            except ConfigError:
                raise
            except ValueError as exc:  # e.g. an unknown task family
                raise ConfigError(f"{name}[{key!r}]: {exc}") from None
    spec = checked.get("reward_spec") or {}
    if spec.get("reward_fn") is not None:
        function_value(f"{name}['reward_spec']['reward_fn']", spec["reward_fn"], "(answer) -> float")
    if spec.get("family") is not None:
        where = f"{name}['reward_spec']['family']"
        try:
            get(text_value(where, spec["family"]))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return checked


def _dict_value(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):  # a dict, or OmegaConf's DictConfig from a trainer's config
        return dict(value)
    raise ConfigError(f"{name} is {kind(value)}; give a dict")


async def _no_sub_call(messages: list[Message], depth: int, parent_id: str | None) -> str:
    raise RuntimeError("this episode has no lm_callback / sub_call in its extras to answer sub-calls")


def _sub_call(extras: dict[str, Any]) -> SubCall | None:
    """The episode's sub-calls: `sub_call` as given, or SkyRL's `lm_callback(prompts) -> replies`
    (blocking, so it runs on a thread; a child RLM's turn reaches it as one transcript)."""
    if extras.get("sub_call") is not None:
        return extras["sub_call"]
    callback: Callable[[list[str]], list[str]] | None = extras.get("lm_callback")
    if callback is None:
        return None

    async def via_lm_callback(messages: list[Message], depth: int, parent_id: str | None) -> str:
        replies = await asyncio.to_thread(callback, [_transcript(messages)])
        # SkyRL's contract: one reply (a str) per prompt. str(None) or a list's repr as the
        # model's reply would look like an answer; the failed call says what came back instead.
        if not isinstance(replies, list | tuple) or len(replies) != 1 or not isinstance(replies[0], str):
            got = (
                f"a {type(replies).__name__} of {len(replies)}"
                if isinstance(replies, list | tuple)
                else kind(replies)
            )
            first = (
                f" whose first item is {kind(replies[0])}"
                if isinstance(replies, list | tuple) and replies
                else ""
            )
            raise TypeError(
                f"extras['lm_callback'] returned {got}{first}; it must return a list with one str per prompt"
            )
        return replies[0]

    return via_lm_callback


def _child_call(extras: dict[str, Any]) -> ChildCall | None:
    """SkyRL's `subcall_fn(prompt, context=...) -> answer`: the generator runs rlm_query's child as
    a rollout of its own (blocking, so it runs on a thread)."""
    subcall_fn = extras.get("subcall_fn")
    if subcall_fn is None:
        return None
    if not callable(subcall_fn):
        raise ConfigError("extras['subcall_fn'] takes a function (prompt, context=None) -> str")

    async def via_subcall_fn(prompt: str, context: Any, depth: int, parent_id: str) -> str:
        answer = await asyncio.to_thread(subcall_fn, prompt, context=context)
        return "" if answer is None else str(answer)

    return via_subcall_fn


def _custom_tools(tools: Any) -> list[Callable[..., Any]]:
    """SkyRL's `custom_tools` ({name: fn} or {name: {"tool": fn, "description": ...}}) as host tools:
    they ran in the trainer's process there (closures over the rollout's context included), and do
    here, called from the sandboxed REPL."""
    if not tools:
        return []
    if not isinstance(tools, dict):
        raise ConfigError("extras['custom_tools'] takes a dict {name: function}")
    made: list[Callable[..., Any]] = []
    for name, entry in tools.items():
        fn, doc = (entry.get("tool"), entry.get("description")) if isinstance(entry, dict) else (entry, None)
        if not callable(fn):
            raise ConfigError(
                f"extras['custom_tools'][{name!r}] is a {type(fn).__name__}, not a function: recursa's REPL "
                "takes functions (put data in the context, or give a function that returns it)"
            )
        made.append(_host_function(str(name), fn, doc if isinstance(doc, str) else None))
    return made


def _host_function(name: str, fn: Callable[..., Any], doc: str | None) -> Callable[..., Any]:
    @functools.wraps(fn)
    def tool(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    tool.__name__ = tool.__qualname__ = name
    if doc:
        tool.__doc__ = doc
    return host_tool(tool)


def _transcript(messages: list[Message]) -> str:
    if len(messages) == 1:
        return str(messages[0].get("content") or "")
    return "\n\n".join(f"[{m.get('role')}]\n{m.get('content') or ''}" for m in messages)


def _context(extras: dict[str, Any]) -> Any:
    """SkyRL's place for the context (extra_info.context_text; a JSON object becomes a dict), or ours."""
    info = extras.get("extra_info") or {}
    context = extras.get("context", info.get("context_text") if isinstance(info, dict) else None)
    if isinstance(context, str) and context.lstrip().startswith("{"):
        try:
            decoded = json.loads(context)
        except ValueError:
            return context
        return decoded if isinstance(decoded, dict) else context
    return context


def _task_id(extras: dict[str, Any]) -> str | None:
    info = extras.get("extra_info") or {}
    found = extras.get("task_id") or (info.get("task_id") if isinstance(info, dict) else None)
    return str(found) if found is not None else None


def _scorer(extras: dict[str, Any], question: str, context: Any) -> Callable[[str], float] | None:
    """The reward: extras['scorer'] (or SkyRL's `judge_reward_fn`, or `reward_spec.reward_fn`), else
    a task family's scorer against reward_spec's ground truth, else an exact match with it
    (whitespace and case aside)."""
    spec = extras.get("reward_spec") or {}
    for given in (extras.get("scorer"), extras.get("judge_reward_fn"), _get(spec, "reward_fn")):
        if callable(given):
            return given
    truth = spec.get("ground_truth") if isinstance(spec, dict) else None
    if truth is None:
        return None
    family = extras.get("family") or (spec.get("family") if isinstance(spec, dict) else None)
    if family:
        fam = get(str(family))
        task = Task(id=_task_id(extras) or "skyrl", family=fam.name, question=question, context=context or "",
                    gold=str(truth))  # fmt: skip
        return lambda answer: fam.score(task, answer)
    gold = str(truth).strip().casefold()
    return lambda answer: float(answer.strip().casefold() == gold)


def _get(spec: Any, key: str) -> Any:
    return spec.get(key) if isinstance(spec, dict) else None


def register(env_id: str = ENV_ID) -> None:
    """Register the environment with skyrl_gym under `env_id` (done once on import)."""
    if env_id not in _registry:
        _register(id=env_id, entry_point=f"{__name__}:RecursaRLMEnv")


register()
