"""Scripted models: deterministic policies that write real REPL code, for offline runs and tests.

A policy is a plain function from the chat messages to the reply text. The same policies answer
in-process (provider `scripted`, through `ScriptedClient`) and behind the fake server, so a test can
drive the real `openai` SDK with exactly the behaviour the offline demo has.

The package sits beside `recursa.lm`: it uses the client protocol from `recursa.lm.base` and the
task families from `recursa.tasks`, and `recursa` registers it as the provider "scripted".
"""

from __future__ import annotations

from recursa.scripted.catalog import get_policy, policy_names, register
from recursa.scripted.client import ScriptedClient
from recursa.scripted.policy import Knobs, Policy, PolicyFactory, parse_knobs

__all__ = [
    "Knobs",
    "Policy",
    "PolicyFactory",
    "ScriptedClient",
    "get_policy",
    "parse_knobs",
    "policy_names",
    "register",
]
