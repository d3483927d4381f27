"""Scripted models: deterministic policies that write real REPL code, for offline runs and tests.

A policy is a plain function from the chat messages to the reply text. The same policies answer
in-process (provider `scripted`, through `ScriptedClient`) and behind the fake server, so a test can
drive the real `openai` SDK with exactly the behaviour the offline demo has.

The package sits beside `recursa.lm`: it uses the client protocol from `recursa.lm.base` and the
task families from `recursa.tasks`, and `recursa` registers it as the provider "scripted".
"""

from __future__ import annotations

from recursa.scripted.catalog import get_policy, policy_names, register

__all__ = [
    "get_policy",
    "policy_names",
    "register",
]
