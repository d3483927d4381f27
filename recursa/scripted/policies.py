"""The built-in scripted models.

Roots (`gpt5-like`, `qwen-coder-like`, `no-subcalls`) write REPL code; `oracle` is the sub-model
that knows the generated tasks' hidden labels; `base-llm` is the no-REPL baseline. Every policy
answers both kinds of chat it can meet behind one model name: an RLM root's chat (a `<question>`
block in the first user message) and a plain sub-model prompt. So `sub_model` may default to the
root's own name, and the oracle can be the root of a child RLM.

Knobs (after a colon: "gpt5-like:fault=syntax+loop,noise=0.1"):
- roots: fault=syntax|loop|bigprint|wrong-final (join several with +), batch=<lines per
  sub-prompt>, chunk=<characters per sub-prompt>, recurse=1 (child RLMs instead of sub-calls),
  style=messy (replies in the forms real models write: ```Python fences, fences in lists,
  hallucinated output, <think> drafts, `FINAL 345`; see messy.py), and noise/seed for their
  answers as a sub-model;
- oracle: noise=<fraction of labels flipped>, seed=<int>;
- all: window=<prompt tokens accepted, e.g. 272k> (longer prompts fail with a context-length
  error, as a provider's would), and for roots and base-llm attention=<tokens read without loss>.
"""

from __future__ import annotations

from recursa.lm.base import Message
from recursa.scripted.agents import agent_reply
from recursa.scripted.base_llm import base_llm_policy, check_window
from recursa.scripted.conversation import is_rlm_conversation, prompt_text
from recursa.scripted.name_options import BASE_KNOBS, ORACLE_KNOBS, ROOT_KNOBS, Settings, parse_settings
from recursa.scripted.oracle import answer_prompt
from recursa.scripted.policy import Knobs, Policy, PolicyFactory
from recursa.scripted.roots import make_root


def _dual(root: Policy, settings: Settings) -> Policy:
    """A root behaviour for RLM chats, a baseline agent's for baseline chats (a system prompt with
    the context in the window), the oracle's answers for plain prompts (sub-calls)."""

    def policy(messages: list[Message]) -> str:
        if is_rlm_conversation(messages):
            return root(messages)
        reply = agent_reply(messages, settings)
        if reply is not None:
            return reply
        check_window(messages, settings)
        return answer_prompt(prompt_text(messages), settings)

    return policy


def _root_factory(persona: str) -> PolicyFactory:
    def factory(knobs: Knobs) -> Policy:
        settings = parse_settings(knobs, ROOT_KNOBS, persona)
        return _dual(make_root(persona, settings), settings)

    return factory


def oracle(knobs: Knobs) -> Policy:
    settings = parse_settings(knobs, ORACLE_KNOBS, "oracle")
    # A child RLM run by the oracle solves like gpt5-like; its own sub-calls carry the noise.
    return _dual(make_root("gpt5-like", Settings(seed=settings.seed)), settings)


def base_llm(knobs: Knobs) -> Policy:
    settings = parse_settings(knobs, BASE_KNOBS, "base-llm")

    def policy(messages: list[Message]) -> str:
        reply = None if is_rlm_conversation(messages) else agent_reply(messages, settings)
        return reply if reply is not None else base_llm_policy(messages, settings)

    return policy


# The built-in models by name (the part after "scripted/"); `recursa.scripted.register` adds more.
BUILTIN: dict[str, PolicyFactory] = {
    **{persona: _root_factory(persona) for persona in ("gpt5-like", "qwen-coder-like", "no-subcalls")},
    "oracle": oracle,
    "base-llm": base_llm,
}
