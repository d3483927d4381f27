"""`RLMEnv`: an RLM as a reinforcement-learning environment. The trainer writes the root's turns.

    env = RLMEnv(sub_model="openai/policy", base_url=POLICY_URL, max_depth=2, max_turns=10)
    episode = await env.start(question, context, task_id="t1", scorer=task.score)
    while not episode.done:
        reply = my_trainer_generate(episode.messages)
        obs = await episode.step(reply)
    episode.answer, episode.reward, episode.rollouts()
    await episode.close()

Each episode is one root run of the engine `RLM.run` drives (recursa.loop.engine), stepped from
outside: its own call tree, budget, sandbox and trace. What the episodes of one environment share
is listed in shared.py.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from recursa.budget import Budget
from recursa.config import DEFAULTS as D
from recursa.config import ENV_DEFAULTS, ENV_SETTINGS, ENV_SPELLING, EnvConfig, RLMConfig, Spelling
from recursa.configure import build_config, check_models
from recursa.env.callback import CallbackClient, ChildCall, SubCall
from recursa.env.contexts import EncodedContexts
from recursa.env.episode import Episode, Scorer
from recursa.env.quota import EPISODE_SHARE, Prepaid, ReplQuota, ReplsFull
from recursa.env.shared import EnvError, EpisodeHost, PerLoop, PrivateLoop
from recursa.errors import ConfigError
from recursa.lm.base import LMClient
from recursa.lm.call_cache import CallCache
from recursa.lm.registry import make_client
from recursa.lm.retry import RetryPolicy
from recursa.loop.dialects import make_dialect
from recursa.loop.engine import RunEngine
from recursa.loop.options import RunOptions
from recursa.loop.tree import CallTree, new_id
from recursa.sandbox import SANDBOXES
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.pools import MemoryPool
from recursa.tools.spec import Tool, make_tools

DEFAULT_POLICY = "openai/policy"


class RLMEnv:
    """Episodes of an RLM whose root turns a trainer generates; see the module docstring.

    `sub_model` (with `base_url`, `api_key`): the OpenAI-compatible server behind `llm_query` and
    child RLMs' turns, e.g. the policy's own server in shared-policy training; every call carries the
    X-RLM-Call-Id / -Parent-Id / -Depth / -Run-Id headers. `sub_call`: instead, an async function
    `fn(messages, depth, parent_id) -> str` the trainer answers those calls with. `child_call`: an
    async `fn(prompt, context, depth, parent_id) -> str` that runs each rlm_query child as the
    trainer's own rollout (needs max_depth >= 2; SkyRL's subcall_fn). `model`: the root's
    model name (chooses the prompt template; recorded in traces and rows), by default `sub_model`.
    `max_turns`: code turns before the root is asked once more, for its answer only.
    `max_reply_chars`: longer replies are refused (the trace keeps replies whole up to 100,000).
    `max_live_repls`: REPL processes alive at once over all episodes (children included). With
    child RLMs (max_depth >= 2, no `child_call`) a start leaves max_depth - 1 slots free for them
    (any start does, while such an episode is open), so an admitted episode can always run its
    children; a slot given back goes to a waiting child
    before a waiting start. A child waits for a slot at most as long as its parent's cell may run
    (`exec_timeout`), and is refused at once (`ReplsFull`) when every slot belongs to a run waiting
    for children, which needs `max_live_repls < max_depth` (rules: recursa/env/quota.py).
    `wait_for_repl`: seconds `start` waits for a slot, in line, before it raises (0: raise at once).
    `fork`: fork REPLs from one warm zygote shared by the episodes (subprocess sandboxes only).
    Local REPLs (a Ray node's too) keep their state through a cell that has to be killed by forking
    a snapshot after each cell while the policy generates its next reply; a step sent within 5 ms
    of the last one's end (an instant policy) runs without one rather than wait for the fork, and
    if it is killed the REPL starts over, as the cell's note says (`sandbox_options={"snapshots":
    True}`: a snapshot after every cell, at about 3 ms a step back to back;
    recursa/sandbox/base.py, SnapshotMode).
    `max_memory_bytes`: what all the environment's live REPLs (children included) may hold
    together; "auto": three quarters of the machine's memory; None: no bound but each REPL's own.
    Where the host may make memory control groups the kernel enforces it (recursa/sandbox/pools.py):
    at the bound it kills the largest of their processes, and that REPL's cell says why (the
    episode goes on from the REPL's snapshot); elsewhere, and in any case, a start is refused
    (`ReplsFull`) while the live REPLs hold the bound. Subprocess sandboxes only.
    `dialect`: the conversation the policy was trained on (docs/dialects.md); under "tools" a step
    takes an assistant message with `tool_calls`, and `messages` carry them in OpenAI's format.
    `cache_subcalls`: identical sub-calls are answered once per episode, and once across the
    episodes of one `task_id` that are alive together (a group of samples of one task).
    `**settings`: any other setting of `recursa.config.RLMConfig` or `EnvConfig` (`max_reply_chars`,
    `wait_for_repl`, `fork`, `max_memory_bytes`, `prompt`, `sub_tools`, `mcp_servers`, ...): the
    settings page of the docs lists each with its default.
    """

    def __init__(
        self,
        sub_model: str | None = None,
        *,
        model: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        sub_call: SubCall | None = None,
        child_call: ChildCall | None = None,
        max_depth: int = D.max_depth,
        budget: Budget | None = None,
        max_turns: int = ENV_DEFAULTS.max_turns,
        tools: Sequence[Callable[..., Any]] = (),
        tips: str | None = None,
        sandbox: str = D.sandbox,
        exec_timeout: float = D.exec_timeout,
        max_live_repls: int = D.max_live_repls,
        **settings: Any,
    ) -> None:
        given = {k: v for k, v in locals().items() if k not in ("self", "settings", "__class__")}
        self._configure(given | settings, ENV_SPELLING)

    @classmethod
    def configured(cls, settings: Mapping[str, Any], spelling: Spelling) -> RLMEnv:
        """The environment of `settings` (RLMEnv's keywords) whose errors name each setting as `spelling`
        writes it: how a door other than Python's (`recursa openenv`'s flags, SkyRL's keys) makes one."""
        env = cls.__new__(cls)
        env._configure(dict(settings), spelling)
        return env

    def _configure(self, given: dict[str, Any], spelling: Spelling) -> None:
        sub_call, child_call = given.pop("sub_call", None), given.pop("child_call", None)
        sub_model, model = given.pop("sub_model", None), given.pop("model", None)
        own = EnvConfig.checked(spelling, **{k: given.pop(k) for k in ENV_SETTINGS if k in given})
        sub = sub_model or DEFAULT_POLICY
        self.config, self.prices = build_config(given | {"model": model or sub, "sub_model": sub}, spelling)
        self.sub_call, self.child_call = _checked_call(sub_call, "sub_call"), _checked_call(child_call, "child_call")
        if sub_model is None and sub_call is None and self.config.max_depth > 0:
            raise ConfigError(
                "RLMEnv: sub-calls need a model: pass sub_model='openai/<served name>' with base_url=..., "
                "or sub_call=<async fn(messages, depth, parent_id) -> str>, or max_depth=0 (code only)."
            )
        paid = [sub] if sub_call is None and self.config.max_depth > 0 else []
        check_models(self.config, self.prices, paid, spelling)
        self.dialect = make_dialect(self.config.dialect, self.config.dialect_options)  # checked above
        self.max_reply_chars, self.wait_for_repl = own.max_reply_chars, own.wait_for_repl
        kind, options = SANDBOXES[self.config.sandbox], self.config.sandbox_options or {}
        self.fork = own.fork and kind.forks and "fork_server" not in options
        self.quota = ReplQuota(own.max_live_repls)
        self.max_repls_per_episode = own.max_repls_per_episode or max(EPISODE_SHARE, self.config.max_depth)
        if self.max_repls_per_episode < self.config.max_depth:
            raise ConfigError(  # marked: each door names them its own way (SkyRL's keys)
                f"«max_repls_per_episode={self.max_repls_per_episode}» is below «max_depth={self.config.max_depth}»: "
                "an episode needs a REPL per level of child RLMs at once; raise «max_repls_per_episode» to «max_depth» or more"
            )
        self.max_memory_bytes = own.max_memory_bytes
        self.memory_pool = _memory_pool(own.max_memory_bytes, kind.forks, options)
        self._owns_memory_pool = True
        # On a cluster each node's kernel bounds its share of the REPLs (cluster/node.py).
        self._cluster_memory = (
            {"memory_group": new_id("env"), "memory_bytes": own.max_memory_bytes}
            if self.config.sandbox == "ray" and own.max_memory_bytes is not None
            else {}
        )
        self._shared = PerLoop()
        self._contexts = EncodedContexts()  # a group's samples share one encoded context
        self._private = PrivateLoop()
        self._closing = False  # close() is closing the blocking API's episodes and loop
        # The call caches of the groups (episodes of one task_id) with an episode alive.
        self._group_caches: weakref.WeakValueDictionary[str, CallCache] = weakref.WeakValueDictionary()
        # Open episodes, for aclose(); weak, so that a dropped episode is reaped by its finalizer.
        self._episodes: weakref.WeakSet[Episode] = weakref.WeakSet()

    def __repr__(self) -> str:
        c = self.config
        return f"RLMEnv(model={c.model!r}, sub_model={c.sub_model!r}, max_depth={c.max_depth})"

    @property
    def live_repls(self) -> int:
        return self.quota.live

    # -- episodes ------------------------------------------------------------------------------
    async def start(
        self,
        question: str,
        context: Any,
        *,
        task_id: str | None = None,
        scorer: Scorer | None = None,
        tips: str | None = None,
        sub_call: SubCall | None = None,
        child_call: ChildCall | None = None,
        tools: Sequence[Callable[..., Any]] = (),
        system_prompt: str | None = None,
    ) -> Episode:
        """A new episode: `episode.messages` is what the policy continues. The REPL starts (and the
        context loads) while the trainer generates the first reply. `scorer(answer) -> float` gives
        `episode.reward`; `sub_call` serves this episode's sub-calls instead of the environment's;
        `child_call` runs its rlm_query children instead (see RLMEnv); `tools` are added to the
        environment's for this episode (e.g. closures over its context); `system_prompt` replaces
        the template's system message."""
        try:
            sub_call, child_call = _checked_call(sub_call, "sub_call"), _checked_call(child_call, "child_call")
        except ConfigError as exc:
            raise EnvError(str(exc)) from None
        child_call = child_call or self.child_call
        if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
            raise EnvError("system_prompt= takes the system message as a non-empty str (or None for ours).")
        own_tools = _episode_tools(self.config.tools, tools)
        if not isinstance(question, str):
            raise EnvError(
                f"the question is a {type(question).__name__}: pass the question to answer as a str."
            )
        if not question.strip():
            raise EnvError("the question is empty: pass the question to answer as a non-empty str.")
        if scorer is not None and not callable(scorer):
            raise EnvError("scorer= takes a function answer -> float (e.g. task.score).")
        pool = self.memory_pool
        if pool is not None and pool.full():
            raise ReplsFull(
                f"RLMEnv(max_memory_bytes={pool.limit_bytes}): the live REPLs hold {pool.used() >> 20} MiB "
                f"of the {pool.limit_bytes >> 20} MiB bound; close finished episodes, or raise max_memory_bytes"
            )
        # The levels of child RLMs with REPLs of their own below the root: a start leaves slots free
        # for one such chain (quota.py), so that an admitted episode can always run its children.
        chain = self.config.max_depth - 1 if child_call is None and self.config.max_depth >= 2 else 0
        if self.wait_for_repl > 0:
            await self.quota.take_waiting(self.wait_for_repl, chain)
            quota = Prepaid(self.quota, chain, taken=True, share=self.max_repls_per_episode)
        else:
            quota = Prepaid(self.quota, chain, share=self.max_repls_per_episode)  # raises the error that says what to do when none is left
        if self._closing and self._private.owns(asyncio.get_running_loop()):
            # A start_sync that got its slot from an episode close() just closed: its loop stops next.
            quota.refund()
            raise EnvError("the environment was closed (env.close()) while this start waited for a REPL slot")
        try:
            payload = await self._contexts.load(context)
        except BaseException:
            quota.refund()
            raise
        run_id = new_id("run")
        events: list[dict[str, Any]] = []
        config = self._episode_config(events, own_tools)
        tree = CallTree.create(config, self.prices, run_id)
        tree.repl_quota = quota
        tree.child_call = child_call
        if tree.gateway.call_cache is not None and task_id is not None:
            # A group's episodes (samples of one task) answer their identical sub-calls once.
            tree.gateway.call_cache = self._group_caches.setdefault(task_id, tree.gateway.call_cache)
        try:
            await tree.connect_mcp()
            self._share(tree, sub_call)
            options = RunOptions(
                tips=tips if tips is not None else self.config.tips, system_prompt=system_prompt
            )
            engine = RunEngine(
                tree, question=question, payload=payload, run_id=run_id, options=options
            )
            engine.begin()
        except BaseException:
            await tree.aclose()
            payload.close()
            quota.refund()
            raise
        host = EpisodeHost(self._private, self.max_reply_chars, self._forget)
        episode = Episode(host, engine, payload, quota, events, task_id=task_id, scorer=scorer)
        self._episodes.add(episode)
        return episode

    def start_sync(self, question: str, context: Any, **kwargs: Any) -> Episode:
        """The blocking form of `start`: the episode runs on the environment's private event loop;
        step it with `step_sync` and close it with `close_sync`."""
        return self._private.run(self.start(question, context, **kwargs))

    async def start_task(self, task: Any, **kwargs: Any) -> Episode:
        """An episode of a generated task (`recursa.tasks.generate(...)`), scored by its family."""
        kwargs.setdefault("task_id", task.id)
        kwargs.setdefault("scorer", task.score)
        return await self.start(task.question, task.context, **kwargs)

    def _episode_config(self, events: list[dict[str, Any]], tools: list[Tool]) -> RLMConfig:
        user = self.config.on_event

        def collect(event: dict[str, Any]) -> None:
            events.append(event)
            if user is not None:
                user(event)

        options = {**self._cluster_memory, **(self.config.sandbox_options or {})}
        if SANDBOXES[self.config.sandbox].snapshots:
            options.setdefault("snapshots", "idle")  # see the class doc
        if self.memory_pool is not None:
            options["memory_pool"] = self.memory_pool
        resources = self._shared.here()
        if self.fork:
            if resources.fork_server is None:
                resources.fork_server = ForkServer()
            options["fork_server"] = resources.fork_server
        return self.config.replace(on_event=collect, sandbox_options=options or None, tools=tools)

    def _share(self, tree: CallTree, sub_call: SubCall | None) -> None:
        """One client per model for every episode on this loop: one connection pool."""
        resources = self._shared.here()
        if sub_call is not None:
            tree.gateway.share({}, catch_all=CallbackClient(sub_call, timeout=self.config.request_timeout))
            return
        if self.sub_call is not None:
            client = resources.clients.get("sub_call")
            if client is None:
                client = resources.clients["sub_call"] = CallbackClient(
                    self.sub_call, timeout=self.config.request_timeout
                )
            tree.gateway.share({}, catch_all=client)
            return
        spec = self.config.sub_model
        if spec not in resources.clients and self.config.max_depth > 0:
            c = self.config
            resources.clients[spec] = make_client(
                spec, base_url=c.base_url, api_key=c.api_key, timeout=c.request_timeout, retry=_ONE_ATTEMPT
            )
        shared: dict[str, LMClient] = {k: v for k, v in resources.clients.items() if k == spec}
        tree.gateway.share(shared)

    def _forget(self, episode: Episode) -> None:
        self._episodes.discard(episode)

    def share_bounds(self, other: RLMEnv) -> None:
        """Count this environment's REPLs against `other`'s bounds (its live REPLs, and the memory
        they all hold, on this machine or per node of a cluster) instead of bounds of its own:
        environments made for one trainer keep one bound, however many settings their rows use.
        Call it before the first episode starts. The memory bound is shared between environments
        of the same sandbox kind only (a pool on this machine, or a group per node of a cluster)."""
        self.quota = other.quota
        if other.config.sandbox == self.config.sandbox:
            self.memory_pool, self._owns_memory_pool = other.memory_pool, False
            self._cluster_memory = other._cluster_memory

    # -- closing -------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close every open episode on this event loop (a step still running is cancelled), then the
        clients and fork server they shared."""
        failure: BaseException | None = None
        try:
            for episode in [e for e in self._episodes if e.loop_is_current()]:
                try:
                    await episode.abort()
                except Exception as exc:  # e.g. a scorer that raised: the other episodes still close
                    failure = failure or exc
        finally:
            self._contexts.clear()
            await self._shared.aclose_here()
            release = SANDBOXES[self.config.sandbox].release
            if release is not None:
                await release()
            if self.memory_pool is not None and self._owns_memory_pool:
                self.memory_pool.close()  # once its REPLs' groups are gone; else swept later
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Close the episodes on the private loop (the blocking API) and stop that loop; a start_sync
        still waiting for a REPL slot on another thread raises EnvError."""
        self._closing = True
        try:
            if self._private.started:
                self._private.run(self.aclose())
            self._private.stop()
        finally:
            self._closing = False

    async def __aenter__(self) -> RLMEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> RLMEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _memory_pool(limit: int | str | None, forks: bool, options: dict[str, Any]) -> MemoryPool | None:
    """The bound over the environment's REPLs ("auto": three quarters of the machine's memory), for
    the local worker processes (the kinds that fork) only."""
    if limit is None or not forks or "memory_pool" in options:
        return None
    if limit == "auto":
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4
    return MemoryPool(int(limit))


_CALL_SIGNATURES = {"sub_call": "(messages, depth, parent_id)", "child_call": "(prompt, context, depth, parent_id)"}


def _checked_call(fn: Any, name: str) -> Any:
    if fn is not None and not callable(fn):
        raise ConfigError(f"{name}= takes an async function {_CALL_SIGNATURES[name]} -> str.")
    return fn


def _episode_tools(shared: list[Tool], extra: Sequence[Callable[..., Any]]) -> list[Tool]:
    """The environment's tools and an episode's own; a clash of names is an error naming it."""
    if not extra:
        return shared
    try:
        own = make_tools(list(extra), where="start(tools=...)")
    except ConfigError as exc:
        raise EnvError(str(exc)) from None
    clash = {t.name for t in own} & {t.name for t in shared}
    if clash:
        raise EnvError(
            f"start(tools=...): {', '.join(sorted(clash))} is already one of RLMEnv(tools=...); rename it"
        )
    return [*shared, *own]


# The gateway retries; its clients try once (as ModelGateway.client makes them).
_ONE_ATTEMPT = RetryPolicy(max_attempts=1)
