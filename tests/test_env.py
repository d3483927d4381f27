"""recursa.env: an RLM stepped by a trainer's replies, against the fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import errno
import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import recursa.context
from recursa import Budget
from recursa.env import EnvError, RLMEnv, group_rollouts
from recursa.env.contexts import EncodedContexts, _AfterThisTurn
from recursa.errors import ConfigError, ContextError
from recursa.tasks import generate
from recursa.tasks.base import get
from recursa.testing.fake_server import FakeServer
from recursa.trace import load

CONTEXT = "alpha line\nbeta line\nthe secret is 42\ngamma line\n"
PEEK = "Let me look.\n```repl\nprint(len(context), context.count('line'))\n```"
ANSWER = "FINAL(42)"


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


def event_types(path: Path) -> list[str]:
    return [e["type"] for e in load(path).events]


@pytest.fixture
def sub_server(server: FakeServer) -> FakeServer:
    server.reset()
    server.latency_s = 0.0
    server.holder["responder"] = lambda model, messages: f"sub:{messages[-1]['content'][:20]}"  # type: ignore[attr-defined]
    return server


def make_env(server: FakeServer, tmp_path: Path, **kwargs) -> RLMEnv:
    kwargs.setdefault("trace_dir", tmp_path)
    kwargs.setdefault("max_turns", 5)
    return RLMEnv("openai/policy", base_url=server.base_url, api_key="k", **kwargs)


async def test_episode_steps_scores_and_traces(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path)
    episode = await env.start("What is the secret?", CONTEXT, task_id="t1", scorer=lambda a: float(a == "42"))
    first = episode.messages
    assert [m["role"] for m in first] == ["system", "user"]
    assert "What is the secret?" in first[1]["content"]
    obs = await episode.step(PEEK)
    assert len(obs) == 1 and obs[0]["role"] == "user"
    assert "REPL output" in obs[0]["content"] and "49 3" in obs[0]["content"]
    assert [m["role"] for m in episode.messages] == ["system", "user", "assistant", "user"]
    assert not episode.done and episode.stop_reason is None and episode.turn == 1
    obs = await episode.step(ANSWER)
    assert obs == []
    assert episode.done and episode.stop_reason == "final" and episode.answer == "42"
    assert episode.reward == 1.0
    assert episode.usage.llm_calls == 2  # the trainer's two turns, counted like model calls
    assert env.live_repls == 0  # the REPL is reaped as soon as the episode is done
    types = event_types(episode.trace_path)
    assert types[0] == "run_start" and types[-1] == "run_end"
    calls = [e for e in load(episode.trace_path).events if e["type"] == "lm_call"]
    assert [c["response"] for c in calls] == [PEEK, ANSWER] and all(c["external"] for c in calls)
    rows = episode.rollouts()
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["prompt"] == first and rows[0]["response"] == PEEK
    assert rows[1]["reward"] == 1.0 and rows[1]["is_last_step"] and rows[0]["reward"] == 0.0
    assert {r["trajectory_id"] for r in rows} == {episode.run_id} and rows[0]["task_id"] == "t1"
    await episode.close()
    await env.aclose()


async def test_rows_have_the_shape_export_rl_writes(sub_server: FakeServer, tmp_path: Path) -> None:
    from recursa.train import export_rl

    env = make_env(sub_server, tmp_path)
    episode = await env.start("What is the secret?", CONTEXT, task_id="t1", scorer=lambda a: 1.0)
    await episode.step(PEEK)
    await episode.step(ANSWER)
    scores = tmp_path / "scores.jsonl"
    scores.write_text(json.dumps({"run_id": episode.run_id, "task_id": "t1", "score": 1.0}) + "\n")
    export_rl([episode.trace_path], tmp_path / "rows.jsonl", scores=scores)
    exported = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    ours = episode.rollouts()
    assert [set(r) for r in ours] == [set(r) for r in exported]
    for mine, theirs in zip(ours, exported, strict=True):
        assert mine["prompt"] == theirs["prompt"] and mine["response"] == theirs["response"]
        assert mine["reward"] == theirs["reward"]
    await env.aclose()


async def test_subcalls_go_to_the_policy_server_with_attribution_headers(
    sub_server: FakeServer, tmp_path: Path
) -> None:
    env = make_env(sub_server, tmp_path)
    episode = await env.start("q?", CONTEXT)
    obs = await episode.step(code("print(llm_query('hello there'))"))
    assert "sub:hello there" in obs[0]["content"]
    (request,) = sub_server.requests
    assert request.model == "policy"
    assert request.headers["x-rlm-parent-id"] == episode.run_id
    assert request.headers["x-rlm-depth"] == "1" and request.headers["x-rlm-call-id"]
    await episode.close()
    assert episode.stop_reason == "cancelled" and event_types(episode.trace_path)[-1] == "run_end"
    await env.aclose()


async def test_sub_call_callback_serves_children_and_rows_inherit(tmp_path: Path) -> None:
    seen: list[tuple[int, str | None, str]] = []

    async def sub_call(messages, depth, parent_id):
        seen.append((depth, parent_id, messages[0]["role"]))
        if messages[0]["role"] == "system":  # a child RLM's turn: answer at once
            return "FINAL(child says hi)"
        return "plain"

    env = RLMEnv(sub_call=sub_call, max_depth=2, trace_dir=tmp_path, max_turns=4)
    episodes = [await env.start("q?", CONTEXT, task_id="t") for _ in range(2)]
    for episode in episodes:
        obs = await episode.step(
            code("print(rlm_query('sub question', context='child ctx'), llm_query('x'))")
        )
        assert "child says hi plain" in obs[0]["content"]
    await episodes[0].step("FINAL(a)")
    await episodes[1].step("FINAL(b)")
    root_ids = {e.run_id for e in episodes}
    assert sorted(d for d, _, _ in seen) == [1, 1, 1, 1]
    child_parents = {p for d, p, role in seen if role == "system"}
    assert child_parents <= root_ids or all(p and p.startswith("run_") for p in child_parents)
    rows = group_rollouts(episodes, rewards=[1.0, 0.0])
    by_traj: dict[str, list[dict]] = {}
    for row in rows:
        by_traj.setdefault(row["trajectory_id"], []).append(row)
    assert set(by_traj) == root_ids
    for episode, sign in zip(episodes, (1, -1), strict=True):
        mine = by_traj[episode.run_id]
        children = [r for r in mine if r["depth"] == 1]
        assert children and all(r["parent_run_id"] == episode.run_id for r in children)
        assert {r["advantage"] for r in mine} == {mine[0]["advantage"]}  # children inherit the root's
        assert mine[0]["advantage"] * sign > 0 and mine[0]["group_size"] == 2
    await env.aclose()


async def test_a_reply_is_recorded_once_its_cell_is_sent_before_anything_the_cell_does() -> None:
    # The trainer's reply is recorded (ledger, usage, its lm_call) at the event loop's next turn,
    # while its cell runs: before the cell's own calls and events, and always before the step returns.
    order: list[str] = []

    async def sub_call(messages, depth, parent_id):
        order.append("sub_call")
        return "plain"

    env = RLMEnv(sub_call=sub_call, max_depth=1, trace=False, max_turns=5, on_event=lambda e: order.append(e["type"]))
    async with env:
        episode = await env.start("q?", CONTEXT)
        await episode.step(code("print(1)"))
        for reply, calls in ((code("print(llm_query('x'))"), 1), ("Still thinking, no code yet.", 0)):
            order.clear()
            before = episode.usage.llm_calls
            await episode.step({"content": reply, "output_tokens": 7})
            assert order[:2] == ["turn", "lm_call"] and order.count("sub_call") == calls, order
            assert order.index("sub_call") == 2 if calls else "exec" not in order
            assert episode.usage.llm_calls == before + 1 + calls  # counted by the time step() returns
        await episode.close()


async def test_bad_replies_are_refused_and_change_nothing(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path, max_reply_chars=1_000)
    episode = await env.start("q?", CONTEXT)
    for bad, words in (
        (b"FINAL(1)", "bytes"),
        (None, "NoneType"),
        (["x"], "list"),
        ("x" * 1_001, "max_reply_chars"),
    ):
        with pytest.raises(EnvError, match=words):
            await episode.step(bad)
    assert episode.turn == 0 and len(episode.messages) == 2
    obs = await episode.step("   ")
    assert "Your reply was empty" in obs[0]["content"]
    obs = await episode.step(
        {"role": "assistant", "content": PEEK, "token_ids": [1, 2, 3], "output_tokens": 3}
    )
    assert "REPL output" in obs[0]["content"]
    await episode.step(ANSWER)
    with pytest.raises(EnvError, match="after the episode is done"):
        await episode.step(ANSWER)
    row = episode.rollouts()[1]
    assert row["response"] == PEEK and row["response_token_ids"] == [1, 2, 3]
    await env.aclose()


async def test_a_second_step_while_one_runs_is_refused(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path)
    episode = await env.start("q?", CONTEXT)
    running = asyncio.create_task(episode.step(code("import time; time.sleep(0.3); print('slept')")))
    await asyncio.sleep(0)
    with pytest.raises(EnvError, match="already running"):
        await episode.step(ANSWER)
    assert "slept" in (await running)[0]["content"]
    await episode.close()
    await env.aclose()


async def test_policy_server_failing_mid_episode(sub_server: FakeServer, tmp_path: Path) -> None:
    calls = {"n": 0}

    def flaky(model, messages):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("the policy server fell over")
        return "first answer"

    sub_server.holder["responder"] = flaky  # type: ignore[attr-defined]
    env = make_env(sub_server, tmp_path, max_retries=0)
    episode = await env.start("q?", CONTEXT)
    obs = await episode.step(code("print(llm_query('a'))"))
    assert "first answer" in obs[0]["content"]
    obs = await episode.step(code("print(llm_query('b'))"))
    assert "SubcallError" in obs[0]["content"] and not episode.done
    await episode.step(ANSWER)
    assert episode.stop_reason == "final"
    trace = load(episode.trace_path)
    assert trace.complete and any(e.get("error") for e in trace.events if e["type"] == "lm_call")
    await env.aclose()


async def test_live_repl_bound_gives_a_clear_error(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path, max_live_repls=2)
    first = await env.start("q?", CONTEXT)
    second = await env.start("q?", CONTEXT)
    with pytest.raises(EnvError, match=r"max_live_repls=2.*close finished episodes"):
        await env.start("q?", CONTEXT)
    await first.step(ANSWER)  # done: its REPL is reaped at once
    third = await env.start("q?", CONTEXT)
    await second.close()
    await third.close()
    assert env.live_repls == 0
    await env.aclose()


async def test_the_repl_bound_also_holds_for_child_rlms(tmp_path: Path) -> None:
    async def sub_call(messages, depth, parent_id):
        return "FINAL(child)"

    env = RLMEnv(
        sub_call=sub_call, max_depth=2, max_live_repls=1, trace_dir=tmp_path, subcall_errors="return"
    )
    episode = await env.start("q?", CONTEXT)
    obs = await episode.step(code("print(rlm_query('sub question', context='child ctx'))"))
    assert "max_live_repls=1" in obs[0]["content"]  # the child could not start a REPL, and says why
    assert env.live_repls == 1
    await episode.close()
    assert env.live_repls == 0
    await env.aclose()


async def test_many_episodes_at_once_share_one_pool(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path)

    async def one(i: int) -> str:
        episode = await env.start(f"q{i}?", f"{CONTEXT}{i}")
        await episode.step(code(f"x = llm_query('p{i}')\nprint(x)"))
        await episode.step(f"FINAL({i})")
        return episode.answer

    answers = await asyncio.gather(*(one(i) for i in range(12)))
    assert answers == [str(i) for i in range(12)]
    resources = env._shared.here()
    assert list(resources.clients) == ["openai/policy"]  # one client, one connection pool
    assert env.live_repls == 0
    await env.aclose()


async def test_repls_keep_snapshots_taken_while_the_policy_thinks_unless_told_otherwise(
    sub_server: FakeServer, tmp_path: Path
) -> None:
    # "idle" (recursa/sandbox/base.py, SnapshotMode): a step the policy sends at once is not held
    # up by a fork; the sandbox's own default is a snapshot after every cell.
    for options, mode in ((None, "idle"), ({"snapshots": True}, True), ({"snapshots": False}, False)):
        env = make_env(sub_server, tmp_path, max_depth=0, trace=False, sandbox_options=options)
        episode = await env.start("q?", CONTEXT)
        assert "49 3" in (await episode.step(PEEK))[0]["content"]
        assert episode._engine._sandbox.snapshots == mode
        await episode.close()
        await env.aclose()


async def test_a_groups_samples_share_one_encoded_context(sub_server: FakeServer, tmp_path: Path) -> None:
    # Samples of one task start with the same context object: encoded once, and the buffer stays
    # whole for every REPL that loads it (a REPL that took it over would free it as it read).
    env = make_env(sub_server, tmp_path, max_depth=0, trace=False)
    first = await env.start("q?", CONTEXT)
    assert "49 3" in (await first.step(PEEK))[0]["content"]
    second = await env.start("q?", CONTEXT)
    await second.step(code("import os\nos._exit(3)"))  # the REPL dies: a fresh one loads it again
    assert "49 3" in (await second.step(PEEK))[0]["content"]
    other = await env.start("q?", [CONTEXT, CONTEXT])  # mutable: encoded each time, not kept
    assert len(env._contexts) == 1
    for episode in (first, second, other):
        await episode.close()
    await env.aclose()
    assert len(env._contexts) == 0


async def test_a_fresh_context_is_written_after_start_returns_and_loads_whole(
    sub_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bytes are written on a writer thread, here held until the first step waits for them.
    # Equal contexts in distinct objects, and a list changed once its start returned: each REPL
    # loads what was passed at the start, and run_start leads each trace with its bytes' sha256.
    gate, write = threading.Event(), recursa.context._write_deferred

    def held(fd: int, texts: list[str]) -> recursa.context.Written:
        gate.wait(10)
        return write(fd, texts)

    monkeypatch.setattr(recursa.context, "_write_deferred", held)
    env = make_env(sub_server, tmp_path, max_depth=0)
    text, same = CONTEXT + "!", "".join([CONTEXT, "!"])
    assert text == same and text is not same
    pieces = [CONTEXT, "tail"]
    episodes = [await env.start("q?", context) for context in (text, same, pieces)]
    pieces.append("added after the start")
    assert [e.events for e in episodes] == [[], [], []]  # run_start waits for the sha256
    asyncio.get_running_loop().call_soon(gate.set)  # once the first step waits for the bytes
    for episode, shown in zip(episodes, ("50 !", "50 !", "2 tail"), strict=True):
        assert shown in (await episode.step(code("print(len(context), context[-1])")))[0]["content"]
        await episode.close()
    first = [load(e.trace_path).events[0] for e in episodes]
    assert [e["type"] for e in first] == ["run_start"] * 3
    digest = [e["context"]["sha256"] for e in first]
    assert digest[0] == digest[1] == hashlib.sha256(text.encode()).hexdigest()
    assert digest[2] == hashlib.sha256((CONTEXT + "tail").encode()).hexdigest()
    await env.aclose()


async def test_context_errors_stop_the_start_and_a_failed_write_the_first_step(
    sub_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env(sub_server, tmp_path, max_depth=0)
    with pytest.raises(ContextError, match="element 1 is int"):
        await env.start("q?", ["ok", 3])
    assert env.live_repls == 0

    def no_space(fd: int, texts: list[str]) -> None:
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recursa.context, "_write_deferred", no_space)
    episode = await env.start("q?", CONTEXT)  # the bytes are written after the start returns
    with pytest.raises(ContextError, match=r"could not be written into its buffer: .*No space left"):
        await episode.step(PEEK)  # as a REPL that fails to start does
    assert episode.stop_reason == "error" and "No space left" in episode.error
    await episode.close()
    assert event_types(episode.trace_path)[0] == "run_start" and event_types(episode.trace_path)[-1] == "run_end"
    assert env.live_repls == 0
    await env.aclose()


async def test_kept_contexts_count_their_bytes_once_written() -> None:
    # A str is kept while its bytes are still being written, counted by its characters until then.
    kept = EncodedContexts(max_bytes=5_000, max_item_bytes=4_000)
    first = await kept.load("é" * 1_500)
    again = await kept.load(kept_text := "x" * 2_000)
    same = await kept.load(kept_text)  # a sample of the same task: the same buffer
    for payload in (first, again, same):
        await payload.ready()
    assert first.size_bytes == 3_000 and again.info.sha256 == same.info.sha256 and len(kept) == 2
    big = await kept.load("é" * 2_500)  # 2,500 characters, but 5,000 bytes: not kept once written
    await big.ready()
    assert big.size_bytes == 5_000 and len(kept) == 1  # and the first went out to make room
    for payload in (first, again, same, big):
        payload.close()
    kept.clear()


def test_a_context_is_written_once_its_loop_turn_ends_or_its_loop_is_gone() -> None:
    # The write waits for the start's turn of the loop to end (the start would otherwise wait for
    # the writer's hold on the GIL), but never on a loop that will not run again: the samples that
    # share the buffer would wait for it forever.
    text = "z" * 100_000
    kept = EncodedContexts()
    payload = asyncio.run(kept.load(text))
    shared = asyncio.run(kept.load(text))  # a later sample, on another loop, shares the buffer
    assert shared.pending is None or shared.pending.result(timeout=5).size_bytes == 100_000
    assert shared.read_bytes() == text.encode()
    gone = asyncio.new_event_loop()
    with ThreadPoolExecutor(1) as writers:
        after = _AfterThisTurn(gone, writers).submit(len, text)
        gone.close()  # its turn never ends
        assert after.result(timeout=5) == 100_000
    for each in (payload, shared):
        each.close()
    kept.clear()


async def test_dropped_episode_is_reaped_by_garbage_collection(
    sub_server: FakeServer, tmp_path: Path
) -> None:
    env = make_env(sub_server, tmp_path)
    episode = await env.start("q?", CONTEXT)
    await episode.step(PEEK)
    path = episode.trace_path
    assert env.live_repls == 1
    del episode
    gc.collect()
    assert env.live_repls == 0
    end = load(path).events[-1]
    assert end["type"] == "run_end" and end["stop_reason"] == "cancelled" and "dropped" in end["error"]
    await env.aclose()


async def test_episode_dropped_before_its_first_step_leaks_nothing(
    sub_server: FakeServer, tmp_path: Path
) -> None:
    env = make_env(sub_server, tmp_path)
    for _ in range(3):
        episode = await env.start("q?", CONTEXT)  # its REPL is still starting
        path = episode.trace_path
        del episode
        gc.collect()
        assert load(path).events[-1]["type"] == "run_end"
    for _ in range(50):  # the cancelled start-ups finish on the loop
        await asyncio.sleep(0.02)
        gc.collect()
        if env.live_repls == 0:
            break
    assert env.live_repls == 0
    await env.aclose()


def test_interpreter_exit_reaps_an_open_episode(server: FakeServer, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from recursa.env import RLMEnv
        env = RLMEnv("openai/policy", base_url={server.base_url!r}, api_key="k", trace_dir={str(tmp_path)!r})
        episode = env.start_sync("q?", "some context")
        episode.step_sync("```repl\\nprint('hi')\\n```")
        print(episode._engine._sandbox.pid, episode.trace_path, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, path = out.stdout.strip().splitlines()[-1].split()
    trace = load(path)
    assert trace.complete and trace.events[-1]["stop_reason"] == "cancelled"
    if os.path.exists(f"/proc/{pid}"):
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        assert state == "Z", f"REPL worker {pid} outlived the interpreter"


def test_blocking_api(sub_server: FakeServer, tmp_path: Path) -> None:
    with make_env(sub_server, tmp_path) as env:
        episode = env.start_sync("q?", CONTEXT)
        obs = episode.step_sync(PEEK)
        assert "REPL output" in obs[0]["content"]
        episode.step_sync(ANSWER)
        assert episode.answer == "42"
        with pytest.raises(EnvError, match="after the episode is done"):
            episode.step_sync(ANSWER)


async def test_cancelled_step_ends_the_episode(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path)
    episode = await env.start("q?", CONTEXT)
    task = asyncio.create_task(episode.step(code("import time\nwhile True: time.sleep(0.01)")))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert episode.done and episode.stop_reason == "cancelled" and env.live_repls == 0
    assert load(episode.trace_path).complete
    await env.aclose()


async def test_out_of_turns_asks_for_the_answer_once(sub_server: FakeServer, tmp_path: Path) -> None:
    env = make_env(sub_server, tmp_path, max_turns=2)
    episode = await env.start("q?", CONTEXT)
    await episode.step(PEEK)
    obs = await episode.step(PEEK)
    assert "used all 2 turns" in obs[-1]["content"]
    await episode.step("The answer is 42")
    assert episode.stop_reason == "max_iterations" and episode.answer == "The answer is 42"
    assert [r["purpose"] for r in episode.rollouts()] == ["root", "root", "final"]
    await env.aclose()


async def test_task_family_scorer_is_the_reward(tmp_path: Path) -> None:
    task = generate("niah", 3_000, seed=2)
    assert get("niah").score(task, task.gold) == 1.0
    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    episode = await env.start_task(task)
    await episode.step(f"FINAL({task.gold})")
    assert episode.reward == 1.0 and episode.rollouts()[0]["task_id"] == task.id
    await env.aclose()


def test_configuration_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="sub-calls need a model"):
        RLMEnv()
    with pytest.raises(ConfigError, match=r"RLMEnv\(max_turns=0\)"):
        RLMEnv(max_depth=0, max_turns=0)
    with pytest.raises(ConfigError, match="max_live_repls"):
        RLMEnv(max_depth=0, max_live_repls=0)
    # These failed as Python's own TypeErrors, naming no option (or RLM's instead of RLMEnv's).
    with pytest.raises(ConfigError, match=r"RLMEnv\(max_depth='2'\): max_depth must be an int >= 0"):
        RLMEnv(max_depth="2", sub_call=lambda messages, depth, parent_id: "x")
    with pytest.raises(ConfigError, match=r"RLMEnv\(trace_dir=5\): trace_dir must be a str or a Path"):
        RLMEnv(max_depth=0, trace_dir=5)
    with pytest.raises(ConfigError, match=r"RLMEnv\(tools=...\) takes functions; got int 5"):
        RLMEnv(max_depth=0, tools=[5])
    env = RLMEnv(max_depth=0, budget=Budget(max_llm_calls=5))
    with pytest.raises(EnvError, match="question is empty"):
        env.start_sync("", CONTEXT)
    with pytest.raises(EnvError, match="the question is a bytes: pass the question to answer as a str"):
        env.start_sync(b"q?", CONTEXT)
    env.close()


def test_the_root_model_name_is_checked_even_when_a_function_answers_the_calls() -> None:
    async def sub_call(messages, depth, parent_id):
        return "x"

    with pytest.raises(ConfigError, match="'nonsense' names no provider"):
        RLMEnv(model="nonsense", sub_call=sub_call)
