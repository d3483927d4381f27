"""What a scripted model is: a policy (chat messages -> reply text) made by a factory from knobs."""

from __future__ import annotations

from collections.abc import Callable

from recursa.lm.base import Message

Policy = Callable[[list[Message]], str]
# Knobs come after a colon in the model name: "gpt5-like:noise=0.1,fault=syntax" -> {"noise": "0.1", ...}.
# A factory that takes one argument receives them (and validates them); a zero-argument factory
# takes no knobs.
Knobs = dict[str, str]
PolicyFactory = Callable[..., Policy]


def parse_knobs(text: str) -> Knobs:
    """ "noise=0.1,fault=syntax" -> {"noise": "0.1", "fault": "syntax"}; a bare name means "1"."""
    knobs: Knobs = {}
    for item in text.split(","):
        if item.strip():
            key, sep, value = item.partition("=")
            knobs[key.strip()] = value.strip() if sep else "1"
    return knobs
