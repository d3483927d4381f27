"""The SkyRL-gym adapter, driven the way SkyRL's generator drives an environment."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install recursa[skyrl])")

from recursa.integrations import skyrl as adapter  # noqa: E402
from recursa.testing.fake_server import FakeServer  # noqa: E402

CONTEXT = "line one\nline two\nthe code word is heron\n"


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


async def generate(client: openai.AsyncOpenAI, chat: list[dict]) -> str:
    reply = await client.chat.completions.create(model="policy", messages=chat, max_tokens=512)
    return reply.choices[0].message.content or ""


async def rollout(server: FakeServer, extras: dict, prompt: list[dict]) -> tuple[list[dict], dict, object]:
    """SkyRL's generator loop: init, then generate -> step (in an executor) -> append, until done."""
    env = skyrl_gym.make(adapter.ENV_ID, env_config={}, extras=extras)
    loop = asyncio.get_running_loop()
    chat, _ = await loop.run_in_executor(None, env.init, prompt)
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="k")
    output: dict = {}
    for _ in range(env.max_turns):
        action = await generate(client, chat)
        output = await loop.run_in_executor(None, env.step, action)
        chat += [{"role": "assistant", "content": action}, *output["observations"]]
        if output["done"]:
            break
    await loop.run_in_executor(None, env.close)
    await client.close()
    return chat, output, env


async def test_an_episode_as_skyrls_generator_runs_it(server: FakeServer, script, tmp_path: Path) -> None:
    script.root(
        "policy", code("word = context.split()[-1]\nprint(llm_query('spell ' + word))"), "FINAL(heron)"
    )
    prompts: list[list[str]] = []

    def lm_callback(batch: list[str]) -> list[str]:
        prompts.append(batch)
        return [p.upper() for p in batch]

    extras = {
        "max_turns": 4,
        "repl_timeout": 30,
        "lm_callback": lm_callback,
        "extra_info": {"context_text": CONTEXT, "task_id": "heron-1"},
        "reward_spec": {"method": "rule", "ground_truth": "Heron"},
        "trace_dir": str(tmp_path),
    }
    chat, last, env = await rollout(server, extras, [{"role": "user", "content": "What is the code word?"}])
    assert chat[0]["role"] == "system" and "What is the code word?" in chat[1]["content"]
    assert "SPELL HERON" in chat[3]["content"]  # the REPL's output came back as an observation
    assert prompts == [["spell heron"]]
    assert last["done"] and last["reward"] == 1.0 and last["observations"] == []
    assert last["metadata"]["stop_reason"] == "final" and last["metadata"]["answer"] == "heron"
    metrics = env.get_metrics()
    assert metrics["turns_used"] == 2 and metrics["final_answer"] == "heron" and metrics["reward"] == 1.0
    rows = env.rollouts()
    assert (
        [r["step"] for r in rows] == [0, 1] and rows[-1]["reward"] == 1.0 and rows[0]["task_id"] == "heron-1"
    )
    assert await asyncio.to_thread(Path(last["metadata"]["trace_path"]).is_file)


async def test_turn_budget_and_family_reward(server: FakeServer, script, tmp_path: Path) -> None:
    script.root("policy", code("print(len(context))"))  # never answers
    extras = {
        "max_turns": 2,
        "extra_info": {"context_text": CONTEXT},
        "reward_spec": {"ground_truth": "heron"},
        "family": "niah",
        "trace_dir": str(tmp_path),
    }
    _, last, env = await rollout(server, extras, [{"role": "user", "content": "Code word?"}])
    assert last["done"] and last["metadata"]["stop_reason"] == "max_iterations"
    assert last["reward"] == 0.0 and env.get_metrics()["turns_used"] == 3  # two turns, then the answer call


def test_registered_under_the_documented_id() -> None:
    assert adapter.ENV_ID == "recursa-rlm" and adapter.ENV_ID in skyrl_gym.registry
    env = skyrl_gym.make("recursa-rlm", env_config={}, extras={"max_turns": 3})
    assert (
        isinstance(env, skyrl_gym.envs.base_text_env.BaseTextEnv) and env.max_turns == 4
    )  # 3 turns + the answer
