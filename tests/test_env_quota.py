"""recursa.env's bound on live REPLs with child RLMs: a trainer's burst of starts must not take the
slots the children of running episodes need, and a child that can never get one is refused at
once, never left to hang. Episodes run for real (sandboxed REPLs); the children's turns come from a
scripted policy (the sub_call callback)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from recursa.env import EnvError, ReplsFull, RLMEnv
from recursa.env.quota import QuotaWords, ReplQuota

CONTEXT = "alpha line\nbeta line\n"
GUARD_S = 60  # far below the waits a hang would take (wait_for_repl, exec_timeout: 600 s)


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


async def until(condition: Callable[[], bool]) -> None:
    """Until another task has brought the quota to a state (the test's guard bounds the wait)."""
    while not condition():  # noqa: ASYNC110 - the state is the quota's counts, behind no event
        await asyncio.sleep(0.01)


def question_of(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


async def child_answers(messages: list[dict], depth: int, parent_id: str | None) -> str:
    """The policy behind the children: a child RLM answers at once (after its REPL started)."""
    return "FINAL(child ok)" if messages[0]["role"] == "system" else "plain"


def make_env(tmp_path: Path, sub_call=child_answers, **kwargs) -> RLMEnv:
    kwargs.setdefault("max_depth", 2)
    return RLMEnv(sub_call=sub_call, trace_dir=tmp_path, subcall_errors="return", exec_timeout=600, **kwargs)


async def rollout(env: RLMEnv, name: str) -> str:
    """What a trainer does per task: start, a turn that runs a child RLM, the answer, close."""
    episode = await env.start("q?", CONTEXT, task_id=name)
    try:
        obs = await episode.step(code(f"print('{name}:', rlm_query('sub question', context='ctx'))"))
        await episode.step("FINAL(done)")
        assert episode.stop_reason == "final"
        return obs[0]["content"]
    finally:
        await episode.close()


async def test_a_burst_of_starts_leaves_the_children_of_admitted_episodes_their_slots(tmp_path: Path) -> None:
    # Two slots, six rollouts started at once, each running a child RLM. Starts that took both
    # slots would leave every child the bound full (each rollout's child failing): a start now
    # leaves one slot free for children, so every child runs.
    env = make_env(tmp_path, max_live_repls=2, wait_for_repl=600)
    async with asyncio.timeout(GUARD_S):
        outputs = await asyncio.gather(*(rollout(env, f"r{i}") for i in range(6)))
    for i, output in enumerate(outputs):
        assert f"r{i}: child ok" in output, output
    assert env.live_repls == 0 and env.quota.waiting == 0  # nothing held, nobody left in line
    await env.aclose()


async def test_a_slot_given_back_goes_to_a_waiting_child_before_a_waiting_start(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def sub_call(messages: list[dict], depth: int, parent_id: str | None) -> str:
        if messages[0]["role"] == "system" and "first" in question_of(messages):
            await release.wait()  # the first child holds its slot until the test lets it answer
        return await child_answers(messages, depth, parent_id)

    env = make_env(tmp_path, sub_call=sub_call, max_live_repls=3, wait_for_repl=600)
    async with asyncio.timeout(GUARD_S):
        a = await env.start("q?", CONTEXT, task_id="a")
        b = await env.start("q?", CONTEXT, task_id="b")  # 2 alive: the third slot is kept for children
        late = asyncio.create_task(env.start("q?", CONTEXT, task_id="late"))
        await until(lambda: env.quota.waiting == 1)
        step_a = asyncio.create_task(a.step(code("print(rlm_query('first question', context='x'))")))
        await until(lambda: env.live_repls == 3)  # a's child has the kept slot
        step_b = asyncio.create_task(b.step(code("print(rlm_query('second question', context='x'))")))
        await until(lambda: env.quota.waiting == 2)  # b's child waits too, after the start
        release.set()  # a's child ends: its slot goes to b's child, not to the start in line first
        obs_a, obs_b = await step_a, await step_b
        assert "child ok" in obs_a[0]["content"] and "child ok" in obs_b[0]["content"]
        assert not late.done() and env.quota.waiting == 1
        await a.step("FINAL(a)")  # a's REPL is reaped: now the start is served
        started = await late
    for episode in (a, b, started):
        await episode.close()
    assert env.live_repls == 0 and env.quota.waiting == 0
    await env.aclose()


async def test_a_child_no_slot_can_ever_free_is_refused_at_once_naming_the_knob(tmp_path: Path) -> None:
    # max_depth 3 under two slots: the root and its child hold both, and the child's own child
    # waits for one of them. Waiting would last until the cell's exec_timeout (600 s): it is
    # refused at once, saying what to raise.
    seen: list[str] = []

    async def sub_call(messages: list[dict], depth: int, parent_id: str | None) -> str:
        if messages[0]["role"] != "system":
            return "plain"
        if "level one" not in question_of(messages):
            return "FINAL(deepest)"
        if sum(m["role"] == "assistant" for m in messages) == 0:
            return code("print(rlm_query('level two', context='y'))")
        seen.append(messages[-1]["content"])  # what the level-one child's code printed
        return "FINAL(level one done)"

    env = make_env(tmp_path, sub_call=sub_call, max_depth=3, max_live_repls=2, wait_for_repl=600)
    async with asyncio.timeout(GUARD_S):
        episode = await env.start("q?", CONTEXT)
        obs = await episode.step(code("print(rlm_query('level one', context='x'))"))
    assert "level one done" in obs[0]["content"]
    assert "no REPL can start for this child RLM" in seen[0]
    assert "raise max_live_repls to at least max_depth" in seen[0]
    assert "RLMEnv(max_live_repls=2)" in seen[0]
    await episode.close()
    assert env.live_repls == 0 and env.quota.waiting == 0
    await env.aclose()


async def test_the_start_that_would_take_the_childrens_slot_is_refused_saying_so(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_live_repls=2)
    trainers_child = {"child_call": lambda *args: "trainer's child"}
    first = await env.start("q?", CONTEXT)
    with pytest.raises(ReplsFull, match=r"1 REPLs are alive.*keeping 1 free for running episodes' child"):
        await env.start("q?", CONTEXT)
    # Nor may an episode whose children the trainer runs (child_call) take the slot first's need:
    # it was admitted, and first's rlm_query then waited exec_timeout and failed.
    with pytest.raises(ReplsFull, match=r"keeping 1 free for running episodes' child"):
        await env.start("q?", CONTEXT, **trainers_child)
    await first.close()
    # With only such episodes admitted, no slot is kept for children.
    episodes = [await env.start("q?", CONTEXT, **trainers_child) for _ in "12"]
    assert env.live_repls == 2
    for episode in episodes:
        await episode.close()
    assert env.live_repls == 0 and env.quota.waiting == 0
    await env.aclose()


async def test_a_child_that_waits_its_time_out_is_refused_naming_the_knob() -> None:
    quota = ReplQuota(1, QuotaWords(limit="extras['max_live_repls']={n}", knob="extras['max_live_repls']"))
    quota.take()
    with pytest.raises(
        ReplsFull, match=r"the child RLM waited 0.05 s for a REPL.*extras\['max_live_repls'\]"
    ):
        await quota.take_child(0.05, 0, 1, ())  # its parent is not among the holders: it may wait
    assert quota.waiting == 0 and quota.live == 1
    quota.give()
    assert quota.live == 0


def test_a_slot_given_back_on_one_thread_wakes_a_child_waiting_on_another_loop() -> None:
    quota = ReplQuota(1)
    quota.take()
    served = threading.Event()

    def wait_for_a_slot() -> None:
        asyncio.run(quota.take_child(GUARD_S, 0, 1, ()))
        served.set()

    thread = threading.Thread(target=wait_for_a_slot, daemon=True)
    thread.start()
    while quota.waiting == 0 and thread.is_alive():
        threading.Event().wait(0.01)
    quota.give()  # from this thread: the child's loop is woken with call_soon_threadsafe
    thread.join(GUARD_S)
    assert served.is_set() and quota.live == 1 and quota.waiting == 0


def test_env_close_refuses_the_start_sync_that_waits_for_a_slot(tmp_path: Path) -> None:
    # A start_sync waiting in line on the blocking API's loop when close() stopped it waited for
    # good, and the slot given back later went to it: held by nobody, for good.
    def waiting_start(env: RLMEnv) -> tuple[threading.Thread, list[object]]:
        got: list[object] = []

        def start() -> None:
            try:
                got.append(env.start_sync("q?", CONTEXT))
            except Exception as exc:
                got.append(exc)

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        while env.quota.waiting == 0 and thread.is_alive():
            threading.Event().wait(0.01)
        return thread, got

    for holder in ("outside", "episode"):  # the slot: held elsewhere, or by an episode close() ends
        env = make_env(tmp_path, max_live_repls=1, max_depth=1, wait_for_repl=GUARD_S)
        held = env.quota.take() if holder == "outside" else env.start_sync("q?", CONTEXT)
        thread, got = waiting_start(env)
        env.close()
        thread.join(GUARD_S)
        assert not thread.is_alive() and len(got) == 1 and isinstance(got[0], EnvError), (holder, got)
        assert "the environment was closed (env.close())" in str(got[0])
        assert env.quota.waiting == 0
        if held is None:
            env.quota.give()
        assert env.live_repls == 0


async def test_one_episodes_fan_out_of_children_keeps_to_its_share(tmp_path: Path) -> None:
    # A policy reply that starts twelve child RLMs at once: under a bound of 8 they would take every
    # slot (a second episode could not start). Its share is 3 (its root and two children at once):
    # the rest wait their turn inside the episode, and another episode starts beside it.
    release = asyncio.Event()

    async def sub_call(messages: list[dict], depth: int, parent_id: str | None) -> str:
        if messages[0]["role"] == "system":
            await release.wait()  # the children hold their slots until the test has looked
        return await child_answers(messages, depth, parent_id)

    env = make_env(tmp_path, sub_call=sub_call, max_live_repls=8, max_repls_per_episode=3)
    async with asyncio.timeout(GUARD_S):
        hostile = await env.start("q?", CONTEXT, task_id="hostile")
        fan_out = asyncio.create_task(
            hostile.step(code("print(rlm_query_batched(['x'] * 12, contexts=['c'] * 12))"))
        )
        await until(lambda: env.live_repls == 3)  # the root and two children; ten wait in the episode
        other = await env.start("q?", CONTEXT, task_id="other")  # room is left for other episodes
        assert env.live_repls == 4
        release.set()
        obs = await fan_out
        assert obs[0]["content"].count("child ok") == 12
        await other.close()
        await hostile.close()
    assert env.live_repls == 0 and env.quota.waiting == 0
    await env.aclose()


def test_a_share_below_max_depth_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"max_repls_per_episode=2 is below max_depth=3"):
        make_env(tmp_path, max_depth=3, max_repls_per_episode=2)
