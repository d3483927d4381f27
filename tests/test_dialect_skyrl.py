"""dialect="skyrl" against SkyRL-gym's own `rlm` environment: the same actions through the same
generator loop (SkyRL's: the chat history is the list `init` returns; each step appends the action
and the observations), and the policy sees the same chat, observations, `done` and reward at every
step, while recursa runs the code in its sandbox."""

from __future__ import annotations

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="SkyRL-gym comes with the skyrl extra")
from skyrl_gym.envs.rlm.env import BaseRLMEnv  # noqa: E402

import recursa.integrations.skyrl  # noqa: E402,F401  (registers "recursa-rlm")

QUESTION = "What is the third word of the context, in capitals?"
CONTEXT = "alpha beta gamma delta epsilon"


def fence(code: str, prose: str = "Let me look.") -> str:
    return f"{prose}\n```repl\n{code}\n```"


EPISODES = {
    "final_var": [
        "I will think first, no code yet.",
        fence("words = context.split()\nprint(len(words), words[:2])"),
        fence("first = words[0]\nsecond = words[1]", prose="Two blocks; only the last runs.")
        + "\n```repl\nthird = words[2].upper()\nprint(third)\n```",
        "The output shows it.\nFINAL_VAR(third)",
    ],
    "final_beside_code": [fence("x = context[:5]\nprint(x)"), fence("y = 2") + "\nFINAL(GAMMA)"],
    "out_of_turns": [fence("print(len(context))"), "Thinking.", fence("z = 1")],
    "no_code_at_the_end": [fence("print(context[:3])"), "Still thinking.", "No code again."],
}


def _steps(env, actions: list[str]) -> list[tuple]:
    """SkyRL's generator loop: what the policy sees after init and after each step."""
    chat, _ = env.init([{"role": "user", "content": QUESTION}])
    seen = [([dict(m) for m in chat],)]
    for action in actions:
        out = env.step(action)
        chat += [{"role": "assistant", "content": action}, *out["observations"]]
        seen.append(([dict(m) for m in chat], out["observations"], out["done"], out["reward"]))
        if out["done"]:
            break
    env.close()
    return seen


@pytest.mark.parametrize("name", sorted(EPISODES))
def test_what_the_policy_sees_matches_skyrl(name, tmp_path):
    actions = EPISODES[name]
    extras = {"max_turns": 3, "extra_info": {"context_text": CONTEXT}}
    theirs = _steps(BaseRLMEnv(extras=dict(extras)), actions)
    ours_env = skyrl_gym.make(  # where traces go is the operator's (env_config), not a row's
        "recursa-rlm", env_config={"trace_dir": str(tmp_path)}, extras={**extras, "dialect": "skyrl", "max_depth": 0}
    )
    ours = _steps(ours_env, actions)
    assert len(ours) == len(theirs)
    for i, (mine, official) in enumerate(zip(ours, theirs, strict=True)):
        assert mine == official, f"after step {i}"


def test_a_refused_reply_gives_the_turn_prompt_back(tmp_path):
    extras = {"max_turns": 3, "extra_info": {"context_text": CONTEXT}, "dialect": "skyrl", "max_depth": 0}
    env = skyrl_gym.make("recursa-rlm", env_config={"trace_dir": str(tmp_path)}, extras={**extras, "max_reply_chars": 50})
    chat, _ = env.init([{"role": "user", "content": QUESTION}])
    prompt = chat[-1]
    out = env.step("x" * 60)
    chat += [{"role": "assistant", "content": "x" * 60}, *out["observations"]]
    assert out["done"] is False and chat[-1] == prompt and chat.count(prompt) == 1
    env.close()
