"""The scripted models by name: the built-in table plus any a caller registers."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from recursa.scripted.policies import BUILTIN
from recursa.scripted.policy import Policy, PolicyFactory, parse_knobs

_POLICIES: dict[str, PolicyFactory] = dict(BUILTIN)


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Register a policy factory under `name` (the part after `scripted/`)."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        _POLICIES[name] = factory
        return factory

    return deco


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> Policy:
    """A fresh policy instance. Raises KeyError naming the known policies, ValueError for bad knobs."""
    base, _, knob_text = name.partition(":")
    if base not in _POLICIES:
        raise KeyError(f"unknown scripted model {name!r}; known: {', '.join(sorted(_POLICIES))}")
    factory = _POLICIES[base]
    knobs = parse_knobs(knob_text)
    if _takes_knobs(factory):
        return factory(knobs)
    if knobs:
        raise ValueError(f"scripted model {base!r} takes no knobs, got {knob_text!r}")
    return factory()


def _takes_knobs(factory: PolicyFactory) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
