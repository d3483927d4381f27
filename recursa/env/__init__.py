"""An RLM as a reinforcement-learning environment: the trainer generates the root's turns.

    from recursa.env import RLMEnv
    env = RLMEnv(sub_model="openai/policy", base_url=POLICY_URL, max_depth=2, max_turns=10)
    episode = await env.start(question, context, task_id="t1", scorer=task.score)
    while not episode.done:
        obs = await episode.step(my_trainer_generate(episode.messages))
    rows = episode.rollouts()
    await episode.close()

Adapters for trainers live in recursa.integrations (SkyRL-gym, verifiers). See docs/environments.md.
"""

from recursa.env.callback import CallbackClient, ChildCall, SubCall
from recursa.env.env import RLMEnv
from recursa.env.episode import Episode, Scorer
from recursa.env.quota import ReplsFull
from recursa.env.rollouts import group_rollouts
from recursa.env.shared import EnvError, ReplyRefused

__all__ = [
    "CallbackClient",
    "ChildCall",
    "EnvError",
    "Episode",
    "RLMEnv",
    "ReplsFull",
    "ReplyRefused",
    "Scorer",
    "SubCall",
    "group_rollouts",
]
