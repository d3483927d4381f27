"""The SkyRL adapter under SkyRL's own RLM generator's extras: `subcall_fn` (children as the
generator's rollouts), `custom_tools`, `custom_system_prompt`, `judge_reward_fn`, `reward_fn`."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install recursa[skyrl])")

from recursa.integrations import skyrl as adapter  # noqa: E402

CHILD_PROMPT = "You are a worker RLM. Write ```repl blocks; answer with FINAL(...)."


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


def policy(chat: list[dict[str, Any]]) -> str:
    """One shared policy for parent and children, as in SkyRL's shared-policy training."""
    turns = sum(m["role"] == "assistant" for m in chat)
    if chat[0]["content"] == CHILD_PROMPT:
        return [code("word = context.split()[-1]\nprint(word)"), "FINAL_VAR(word)"][turns]
    return [
        code("r = rlm_query('Which word?', context='the word is heron')\nprint(r, shout(r))"),
        "FINAL_VAR(r)",
    ][turns]


class Generator:
    """What SkyRL's RLMGymGenerator does around an environment: injects lm_callback / subcall_fn /
    judge_reward_fn into the extras, runs init and step in an executor, and runs each rlm_query
    child as an agent loop of its own whose rollout it keeps."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.children: list[dict[str, Any]] = []
        self.sub_prompts: list[str] = []

    async def agent_loop(self, prompt: list[dict[str, Any]], extras: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        extras = {**extras, "max_turns": 4}
        if "lm_callback" not in extras:
            extras["lm_callback"] = self.lm_callback
            extras["subcall_fn"] = self.subcall_fn(loop, extras)
        env = skyrl_gym.make(adapter.ENV_ID, env_config={"trace_dir": str(self.tmp_path)}, extras=extras)
        chat, _ = await loop.run_in_executor(None, env.init, copy.deepcopy(prompt))
        out: dict[str, Any] = {}
        while True:
            action = policy(chat)
            out = await loop.run_in_executor(None, env.step, action)
            chat += [{"role": "assistant", "content": action}, *out["observations"]]
            if out["done"]:
                break
        metrics = env.get_metrics()
        await loop.run_in_executor(None, env.close)
        return {"chat": chat, "last": out, "metrics": metrics}

    def lm_callback(self, prompts: list[str]) -> list[str]:
        self.sub_prompts.extend(prompts)
        return [p.upper() for p in prompts]

    def subcall_fn(self, loop: asyncio.AbstractEventLoop, parent: dict[str, Any]):
        def run_child(prompt: str, context: Any = None) -> str:
            extras = {
                k: v for k, v in parent.items() if k not in ("lm_callback", "subcall_fn", "custom_tools")
            }
            extras["lm_callback"] = self.lm_callback
            extras["custom_system_prompt"] = CHILD_PROMPT
            extras["extra_info"] = {"context_text": context}
            extras["reward_spec"] = {"ground_truth": None}
            extras.pop("judge_reward_fn", None)
            coro = self.agent_loop([{"role": "user", "content": prompt}], extras)
            child = asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)
            self.children.append(child)
            return child["metrics"]["final_answer"] or ""

        return run_child


async def test_children_are_the_generators_rollouts_with_its_tools_prompt_and_judge(tmp_path: Path) -> None:
    generator = Generator(tmp_path)
    seen: list[str] = []

    def shout(text: str) -> str:  # a closure over the rollout, as SkyRL's custom tools may be
        seen.append(text)
        return text.upper() + "!"

    extras = {
        "extra_info": {"context_text": "a haystack with no word in it", "task_id": "w1"},
        "custom_tools": {"shout": {"tool": shout, "description": "Shout the text."}},
        "judge_reward_fn": lambda answer: float(answer == "heron"),
        "reward_spec": {"ground_truth": "something else"},  # the judge takes precedence, as in SkyRL
        "depth": 0,
        "step_wise": False,
    }
    root = await generator.agent_loop([{"role": "user", "content": "Which word?"}], extras)
    assert "heron HERON!" in root["chat"][3]["content"] and seen == ["heron"]
    assert "shout" in root["chat"][0]["content"] and "Shout the text." in root["chat"][0]["content"]
    assert root["last"]["done"] and root["last"]["reward"] == 1.0
    assert root["metrics"]["final_answer"] == "heron"
    (child,) = generator.children  # the child ran as the generator's own rollout, with its prompt
    assert child["chat"][0] == {"role": "system", "content": CHILD_PROMPT}
    assert child["last"]["metadata"]["stop_reason"] == "final" and child["metrics"]["final_answer"] == "heron"


async def test_reward_fn_in_the_reward_spec_scores_the_answer(tmp_path: Path) -> None:
    env = skyrl_gym.make(
        adapter.ENV_ID,
        env_config={"trace_dir": str(tmp_path)},
        extras={
            "extra_info": {"context_text": "ctx"},
            "reward_spec": {"ground_truth": "x", "reward_fn": lambda answer: 0.25},
        },
    )
    await asyncio.to_thread(env.init, [{"role": "user", "content": "q?"}])
    out = await asyncio.to_thread(env.step, "FINAL(y)")
    assert out["done"] and out["reward"] == 0.25
    await asyncio.to_thread(env.close)


def test_a_custom_tool_that_is_not_a_function_is_named() -> None:
    env = skyrl_gym.make(adapter.ENV_ID, env_config={}, extras={"custom_tools": {"table": [1, 2]}})
    with pytest.raises(Exception, match=r"custom_tools'\]\['table'\] is a list, not a function"):
        env.init([{"role": "user", "content": "q?"}])
