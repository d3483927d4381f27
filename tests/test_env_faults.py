"""recursa.env as a trainer uses it: reply forms, scorers and budgets that fail, what an episode holds."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from recursa import Budget
from recursa.env import EnvError, RLMEnv, group_rollouts
from recursa.env.tokens import NONE_GIVEN, token_fields
from recursa.errors import ConfigError
from recursa.sandbox import subprocess as subprocess_sandbox
from recursa.testing.fake_server import FakeServer
from recursa.trace import load
from recursa.train import export_rl

CONTEXT = "alpha line\nbeta line\nthe secret is 42\n"


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


def parts(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


@pytest.fixture
def policy(server: FakeServer) -> FakeServer:
    server.reset()
    server.latency_s = 0.0
    server.holder["responder"] = lambda model, messages: "ok"  # type: ignore[attr-defined]
    return server


def make_env(server: FakeServer, tmp_path: Path, **kwargs) -> RLMEnv:
    kwargs.setdefault("trace_dir", tmp_path)
    return RLMEnv("openai/policy", base_url=server.base_url, api_key="k", **kwargs)


async def test_openai_content_parts_are_text_replies(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT)
    obs = await episode.step(parts(code("print('from parts')")))
    assert "from parts" in obs[0]["content"]
    reply = {"role": "assistant", "content": [*parts("```repl\nx = 6 *"), *parts(" 7\nprint(x)\n```")]}
    obs = await episode.step(reply)
    assert "42" in obs[0]["content"]
    message = SimpleNamespace(content=code("print('sdk object')"))  # e.g. choices[0].message
    obs = await episode.step(message)
    assert "sdk object" in obs[0]["content"]
    with pytest.raises(EnvError, match=r"item 1 is not a text part \('image_url'\)"):
        await episode.step([*parts("look"), {"type": "image_url", "image_url": {"url": "x"}}])
    assert episode.turn == 3
    # A message of tool calls only is a reply too; a call the model wrote wrong is answered by its id
    # with what was wrong, never dropped and never an error for the trainer.
    obs = await episode.step({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]})
    assert obs[0]["role"] == "tool" and obs[0]["tool_call_id"] == "1"
    assert "did not run: the arguments must be a JSON object" in obs[0]["content"]
    await episode.step({"role": "assistant", "content": parts("FINAL(42)")})
    assert episode.answer == "42"
    calls = [e for e in load(episode.trace_path).events if e["type"] == "lm_call"]
    assert calls[0]["response"] == code("print('from parts')")
    await env.aclose()


async def test_sub_call_may_answer_with_an_openai_message(tmp_path: Path) -> None:
    async def sub_call(messages, depth, parent_id):
        return {"role": "assistant", "content": parts("from a message")}

    env = RLMEnv(sub_call=sub_call, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT)
    obs = await episode.step(code("print(llm_query('hi'))"))
    assert "from a message" in obs[0]["content"]
    await episode.close()
    await env.aclose()


async def test_a_scorer_that_raises_fails_one_step_and_not_close(tmp_path: Path) -> None:
    calls = []

    def scorer(answer: str) -> float:
        calls.append(answer)
        raise KeyError("no gold for this task")

    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT, scorer=scorer)
    with pytest.raises(EnvError, match="the scorer raised KeyError"):
        await episode.step("FINAL(42)")
    assert episode.done and episode.answer == "42" and episode.reward is None
    await episode.close()  # the episode is over: closing it does not score (and fail) again
    assert calls == ["42"] and load(episode.trace_path).complete and env.live_repls == 0
    await env.aclose()


async def test_a_budget_used_up_during_a_step_ends_the_episode(policy: FakeServer, tmp_path: Path) -> None:
    env = make_env(policy, tmp_path, budget=Budget(max_llm_calls=3), max_retries=0)
    episode = await env.start("q?", CONTEXT, scorer=lambda a: float(a == "partial"))
    obs = await episode.step(
        code("answer['content'] = 'partial'\nfor i in range(5): print(llm_query(str(i)))")
    )
    assert "BudgetExceeded" in obs[0]["content"]
    # The trainer's turn and two sub-calls used the three calls: no turn after this one could call
    # anything, so the episode ends here, as RLM.run's refused root call would end the run.
    assert episode.done and episode.stop_reason == "budget" and "max_llm_calls=3" in (episode.error or "")
    assert episode.answer == "partial" and episode.reward == 1.0 and env.live_repls == 0
    assert load(episode.trace_path).complete
    with pytest.raises(EnvError, match="after the episode is done"):
        await episode.step("FINAL(x)")
    await env.aclose()


async def test_the_trainers_own_turns_count_against_the_budget(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, trace_dir=tmp_path, budget=Budget(max_llm_calls=2), max_turns=10)
    episode = await env.start("q?", CONTEXT)
    await episode.step(code("print(1)"))
    assert not episode.done
    await episode.step(code("print(2)"))
    assert episode.done and episode.stop_reason == "budget" and episode.usage.llm_calls == 2
    await env.aclose()


def _open_under(folder: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        except OSError:
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to count descriptors")
async def test_finished_episodes_kept_for_their_rows_hold_no_descriptors(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    kept = []
    for i in range(4):
        episode = await env.start("q?", CONTEXT)
        if i % 2:
            await episode.step(f"FINAL({i})")
        else:
            await episode.close()
        kept.append(episode)
    assert _open_under(tmp_path) == 0
    assert all(load(e.trace_path).complete for e in kept) and kept[1].rollouts()
    await env.aclose()


async def test_rows_match_export_rl_for_a_tree_with_children(tmp_path: Path) -> None:
    async def sub_call(messages, depth, parent_id):
        if messages[0]["role"] == "system":  # a child RLM's turn
            turns = sum(m["role"] == "assistant" for m in messages)
            return code("print(len(context))") if turns == 0 else "FINAL(child ok)"
        return "plain"

    env = RLMEnv(sub_call=sub_call, max_depth=2, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT, task_id="t1", scorer=lambda a: 1.0)
    await episode.step(code("print(rlm_query('sub q', context='child ctx'), llm_query('x'))"))
    await episode.step("FINAL(done)")
    scores = tmp_path / "scores.jsonl"
    scores.write_text(json.dumps({"run_id": episode.run_id, "task_id": "t1", "score": 1.0}) + "\n")
    out = tmp_path / "rows.jsonl"
    export_rl([episode.trace_path], out, scores=scores, include_subcalls=True)
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    rows = episode.rollouts(include_subcalls=True)
    assert rows == exported
    by_kind = {(r["depth"], r["purpose"]): r for r in rows}
    child = by_kind[(1, "root")]
    assert child["parent_id"] == child["parent_run_id"] == episode.run_id
    assert by_kind[(0, "root")]["parent_id"] is None
    assert by_kind[(1, "sub")]["parent_id"] == episode.run_id  # the llm_query's caller, as its header says
    await env.aclose()


async def test_the_shared_fork_server_outlives_episodes_closed_while_starting(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, trace_dir=tmp_path, max_live_repls=64)
    for _ in range(3):
        episodes = [await env.start("q?", CONTEXT) for _ in range(24)]
        for episode in episodes:
            await episode.close()
    fork_server = env._shared.here().fork_server
    assert fork_server is not None and fork_server.unavailable is None
    episode = await env.start("q?", CONTEXT)
    await episode.step(code("print('still forking')"))
    assert fork_server.unavailable is None
    await episode.close()
    await env.aclose()


async def test_an_episode_dropped_unstepped_after_its_repl_failed_to_open_logs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed: list[str] = []

    async def failing_start(self: object, handler: object) -> None:
        failed.append("start")
        raise RuntimeError("the REPL could not start")

    monkeypatch.setattr(subprocess_sandbox.SubprocessSandbox, "start", failing_start)
    reported: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
    env = RLMEnv(max_depth=0, sandbox="subprocess", trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT)
    opening = episode._engine._opening
    await asyncio.wait([opening])
    assert failed and opening.done() and not opening.cancelled()  # failed; reading it is the step's job
    del episode, opening
    gc.collect()
    await env.aclose()
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported


async def test_child_call_runs_rlm_query_children_in_the_trainer(tmp_path: Path) -> None:
    calls = []

    async def child_call(prompt, context, depth, parent_id):
        calls.append((prompt, context, depth, parent_id))
        return f"child answer for {context}"

    def peek(text: str) -> str:  # a per-episode tool: closes over the trainer's state, runs in the host
        return f"peeked {text} for {episode_name}"

    from recursa import host_tool

    episode_name = "ep-1"
    env = RLMEnv(sub_call=lambda m, d, p: "plain", max_depth=2, trace_dir=tmp_path)
    episode = await env.start(
        "q?", CONTEXT, child_call=child_call, tools=[host_tool(peek)], system_prompt="Custom system."
    )
    assert episode.messages[0] == {"role": "system", "content": "Custom system."}
    obs = await episode.step(code("print(rlm_query_batched(['a', 'b'], contexts=['x', 'y']), peek('z'))"))
    assert "['child answer for x', 'child answer for y'] peeked z for ep-1" in obs[0]["content"]
    assert sorted(calls) == [("a", "x", 1, episode.run_id), ("b", "y", 1, episode.run_id)]
    with pytest.raises(EnvError, match="peek is already one of RLMEnv"):
        RLMEnv(max_depth=0, tools=[host_tool(peek)]).start_sync("q?", CONTEXT, tools=[host_tool(peek)])
    await episode.close()
    await env.aclose()


async def test_the_conversation_alternates_roles_as_strict_chat_templates_require(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, trace_dir=tmp_path, max_turns=2)
    episode = await env.start("q?", CONTEXT)
    for reply in ("no code here", code("print(1)"), "The answer is 42"):
        obs = await episode.step(reply)
        assert len(obs) <= 1
    roles = [m["role"] for m in episode.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert "used all 2 turns" in episode.messages[-2]["content"]
    assert episode.stop_reason == "max_iterations" and episode.answer == "The answer is 42"
    await env.aclose()


async def test_a_sub_call_that_never_answers_fails_that_call_at_the_request_timeout(tmp_path: Path) -> None:
    import asyncio

    async def hung(messages, depth, parent_id):
        await asyncio.Event().wait()

    env = RLMEnv(sub_call=hung, trace_dir=tmp_path, request_timeout=0.3, max_retries=0)
    episode = await env.start("q?", CONTEXT)
    obs = await episode.step(code("print(llm_query('x'))"))
    assert "sub_call gave no answer within 0.3 s" in obs[0]["content"] and not episode.done
    await episode.close()
    await env.aclose()


async def test_env_aclose_ends_episodes_whose_step_is_still_running(tmp_path: Path) -> None:
    import asyncio

    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    idle = await env.start("q?", CONTEXT)
    busy = await env.start("q?", CONTEXT)
    stepping = asyncio.create_task(busy.step(code("import time\nwhile True: time.sleep(0.05)")))
    await asyncio.sleep(0)  # the step has begun
    with pytest.raises(EnvError, match=r"episode\.abort\(\)"):
        await busy.close()
    await env.aclose()  # a trainer shutting down: nothing may stay open, running step or not
    assert idle.done and busy.done and busy.stop_reason == "cancelled" and env.live_repls == 0
    with pytest.raises(asyncio.CancelledError):
        await stepping
    assert load(busy.trace_path).complete and load(idle.trace_path).complete


async def test_token_ids_the_trainer_gives_are_the_turns_token_counts(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, trace_dir=tmp_path, budget=Budget(max_tokens=1_000))
    episode = await env.start("q?", CONTEXT)
    await episode.step(
        {"content": code("print(1)"), "prompt_token_ids": list(range(300)), "token_ids": [7] * 20}
    )
    assert (episode.usage.input_tokens, episode.usage.output_tokens) == (300, 20)
    await episode.step({"content": "FINAL(1)", "input_tokens": 400, "token_ids": [1, 2]})
    assert (episode.usage.input_tokens, episode.usage.output_tokens) == (700, 22)
    await env.aclose()


async def test_starts_beyond_the_repl_bound_wait_their_turn_with_wait_for_repl(tmp_path: Path) -> None:
    import asyncio

    env = RLMEnv(max_depth=0, trace_dir=tmp_path, max_live_repls=2, wait_for_repl=600)
    running = [await env.start("q?", CONTEXT, task_id=f"r{i}") for i in range(2)]
    waiting = []
    for i in range(3):  # each is queued before the next one starts
        waiting.append(asyncio.create_task(env.start("q?", CONTEXT, task_id=f"w{i}")))
        await asyncio.sleep(0)  # the new task runs up to its wait
        assert env.quota.waiting == i + 1
    cancelled = waiting.pop(1)  # a waiter that gives up holds no slot
    cancelled.cancel()
    await asyncio.wait([cancelled])
    served = []
    for episode in running:
        await episode.step("FINAL(done)")  # a finished episode hands its slot to the first in line
        served.append(await waiting.pop(0))
    assert [e.task_id for e in served] == ["w0", "w2"] and env.live_repls == 2 and env.quota.waiting == 0
    # A start that cannot get a slot in time says what to do.
    impatient = RLMEnv(max_depth=0, trace_dir=tmp_path, max_live_repls=1, wait_for_repl=0.05)
    held = await impatient.start("q?", CONTEXT)
    with pytest.raises(EnvError, match=r"waited 0.05 s for a REPL: 1 REPLs are alive.*wait_for_repl"):
        await impatient.start("q?", CONTEXT)
    await held.close()
    assert impatient.live_repls == 0
    for episode in served:
        obs = await episode.step(code("print('served')"))
        assert "served" in obs[0]["content"]
        await episode.close()
    assert env.live_repls == 0
    await env.aclose()
    await impatient.aclose()
    with pytest.raises(ConfigError, match="wait_for_repl=-1"):
        RLMEnv(max_depth=0, wait_for_repl=-1)


def _utf8(value: object) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def test_what_the_trainer_gets_is_valid_unicode_when_the_context_held_undecodable_bytes(
    tmp_path: Path,
) -> None:
    # Bytes that are not UTF-8, read with surrogateescape, become lone surrogates in the REPL; the
    # REPL's output, the answer and the rows carried them on to the trainer (whose tokenizer
    # refuses them) and `recursa export rl` failed writing them.
    context = (b"name: caf\xe9 \xff\n" * 3).decode("utf-8", "surrogateescape")
    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    episode = await env.start("What is the name?", context, task_id="t1", scorer=lambda a: float("caf" in a))
    obs = await episode.step(code("name = context.split()[1] + ' ' + context.split()[2]\nprint(name)"))
    await episode.step(code("FINAL(name + ' \\ud83d\\ude00')"))  # a pair of surrogates: one character
    assert "caf\ufffd \ufffd" in obs[0]["content"] and episode.answer == "caf\ufffd \ufffd \U0001f600"
    assert episode.reward == 1.0 and _utf8(episode.messages) and _utf8(obs)
    rows = episode.rollouts()
    assert _utf8(rows)
    scores = tmp_path / "scores.jsonl"
    scores.write_text(json.dumps({"run_id": episode.run_id, "task_id": "t1", "score": 1.0}) + "\n")
    out = tmp_path / "rows.jsonl"
    export_rl([episode.trace_path], out, scores=scores)
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == rows
    await env.aclose()


@pytest.mark.parametrize(
    ("returned", "named"),
    [
        (float("nan"), "returned nan"),
        (float("inf"), "returned inf"),
        (None, "returned None (a NoneType)"),
        ("0.5", "returned '0.5' (a str)"),
    ],
)
async def test_a_reward_that_is_not_a_finite_number_is_refused(tmp_path: Path, returned, named) -> None:
    # A NaN reward made every advantage of its group NaN (and group_rollouts then failed inside
    # statistics with AttributeError); now the scorer's step says what it returned.
    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT, scorer=lambda answer: returned)
    with pytest.raises(EnvError, match=rf"the scorer {re.escape(named)}; a reward must be a finite number"):
        await episode.step("FINAL(42)")
    assert episode.done and episode.reward is None
    with pytest.raises(EnvError, match=r"group_rollouts: reward 1 is nan; a reward must be a finite number"):
        group_rollouts([episode, episode], rewards=[1.0, float("nan")])
    assert episode.rollouts(reward=True)[-1]["reward"] == 1.0
    with pytest.raises(EnvError, match=r"rollouts\(advantage=...\) is nan; an advantage must be a finite"):
        episode.rollouts(advantage=float("nan"))
    with pytest.raises(EnvError, match=r"rollouts\(group_size=0\)"):
        episode.rollouts(group_size=0)
    await env.aclose()


async def test_token_fields_as_arrays_and_tuples_reach_the_rows_and_bad_ones_are_named(
    tmp_path: Path,
) -> None:
    # An engine hands token ids over as numpy arrays (or tuples) and counts as numpy ints; every form
    # must be kept, or rows lose their token ids and usage falls back to an estimate.
    np = pytest.importorskip("numpy")

    async def sub_call(messages, depth, parent_id):
        return {"text": "sub", "token_ids": np.array([5, 6]), "logprobs": (-0.1, -0.2)}

    env = RLMEnv(sub_call=sub_call, max_depth=1, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT)
    reply = {"content": code("print(llm_query('a'))"), "token_ids": np.array([1, 2, 3]),
             "logprobs": np.array([-0.5, -0.25, -0.125]), "input_tokens": np.int64(40)}  # fmt: skip
    await episode.step(reply)
    for bad, named in (
        ({"token_ids": ["a", "b"]}, "the reply's token_ids holds 'a'; give a flat list of token ids"),
        ({"token_ids": np.array([[1, 2]])}, r"the reply's token_ids holds \[1, 2\]"),
        ({"logprobs": "-0.5"}, "the reply's logprobs is a str; give a list"),
        ({"output_tokens": -3}, "the reply's output_tokens is -3; give a whole number >= 0"),
    ):
        with pytest.raises(EnvError, match=named):
            await episode.step({"content": "FINAL(1)", **bad})
    await episode.step({"content": "FINAL(1)", "token_ids": (7, 8)})
    root, last, sub = episode.rollouts(include_subcalls=True)
    assert (root["response_token_ids"], root["response_logprobs"]) == ([1, 2, 3], [-0.5, -0.25, -0.125])
    assert last["response_token_ids"] == [7, 8]
    assert (sub["response_token_ids"], sub["response_logprobs"]) == ([5, 6], [-0.1, -0.2])
    assert episode.usage.output_tokens == 3 + 2 + 2 and episode.turn == 2
    # A str reply skips the reading of fields it cannot carry: what it stands for is what they read as.
    assert token_fields({}, "the reply") == NONE_GIVEN
    await env.aclose()


async def test_a_reply_of_many_blocks_that_never_end_costs_one_timeout(tmp_path: Path) -> None:
    # Each block may run exec_timeout: 50 blocks of `while True: pass` (a degenerate generation)
    # held one step for 50 timeouts. The blocks after one that ran out of time are not run.
    env = RLMEnv(max_depth=0, trace_dir=tmp_path, exec_timeout=0.5)
    episode = await env.start("q?", CONTEXT)
    reply = code("x = 1") + "\n" + "\n".join(code("while True:\n    x += 1") for _ in range(50))
    (said,) = await episode.step(reply)
    content = said["content"]
    assert "[block 2 of 2]" in content and "the 49 block(s) after it in your reply were not run" in content
    execs = [e for e in load(episode.trace_path).events if e["type"] == "exec"]
    assert [e["block"] for e in execs] == [1, 2] and execs[1]["timed_out"]
    (said,) = await episode.step(code("print(x > 1)"))  # the variables are kept
    assert "True" in said["content"]
    await env.aclose()


async def test_a_blocking_scorer_runs_off_the_event_loop(tmp_path: Path) -> None:
    # A judge that blocks (an HTTP call to a grader) ran on the loop and stalled every episode on
    # it, all of a SkyRL generator's included; an async scorer still runs on the loop.
    import threading

    loop_thread = threading.get_ident()
    ran_on: dict[str, int] = {}

    def judge(answer: str) -> float:
        ran_on["sync"] = threading.get_ident()
        return 1.0

    class AsyncJudge:
        async def __call__(self, answer: str) -> float:
            ran_on["async"] = threading.get_ident()
            return 0.5

    env = RLMEnv(max_depth=0, trace_dir=tmp_path)
    for scorer, reward in ((judge, 1.0), (AsyncJudge(), 0.5)):
        episode = await env.start("q?", CONTEXT, scorer=scorer)
        await episode.step("FINAL(42)")
        assert episode.reward == reward
    assert ran_on["sync"] != loop_thread and ran_on["async"] == loop_thread
    await env.aclose()


async def test_a_blocking_sub_call_or_child_call_runs_off_the_event_loop(tmp_path: Path) -> None:
    # A trainer's plain function that blocks (a call to its engine) ran on the loop: every episode
    # on it stalled, and no clock there could fire (a reply's time for code, a request timeout).
    import threading

    loop_thread = threading.get_ident()
    ran_on: dict[str, int] = {}

    def sub_call(messages: list[dict], depth: int, parent_id: str | None) -> str:
        ran_on["sub_call"] = threading.get_ident()
        return "sub answer"

    def child_call(prompt: str, context: object, depth: int, parent_id: str) -> str:
        ran_on["child_call"] = threading.get_ident()
        return "child answer"

    async def async_child_call(prompt: str, context: object, depth: int, parent_id: str) -> str:
        ran_on["async child_call"] = threading.get_ident()
        return "async child answer"

    env = RLMEnv(sub_call=sub_call, child_call=child_call, max_depth=2, trace_dir=tmp_path)
    episode = await env.start("q?", CONTEXT)
    (obs,) = await episode.step(code("print(llm_query('hi'), rlm_query('sub', context='x'))"))
    assert "sub answer child answer" in obs["content"]
    episode = await env.start("q?", CONTEXT, child_call=async_child_call)
    (obs,) = await episode.step(code("print(rlm_query('sub', context='x'))"))
    assert "async child answer" in obs["content"]
    assert ran_on["sub_call"] != loop_thread and ran_on["child_call"] != loop_thread
    assert ran_on["async child_call"] == loop_thread
    await env.aclose()
