"""Dialects: the conversation a root model sees, by name (docs/dialects.md).

    RLM(model, dialect="tools")                          # native tool calls
    RLM(model, dialect="tools", dialect_options={"tool_name": "python", "tool_argument": "code"})
    RLM(model, dialect=MyDialect())                      # anything with the Dialect protocol

The peers' dialects ("rlms", "skyrl", "verifiers") read that peer's texts from its installed
package when they are made; a missing package is a ConfigError naming the extra to install.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from recursa.errors import ConfigError
from recursa.loop.dialects.base import Dialect
from recursa.loop.dialects.native import RecursaDialect
from recursa.loop.dialects.rlms import RlmsDialect
from recursa.loop.dialects.skyrl import SkyRLDialect
from recursa.loop.dialects.tools import ToolsDialect
from recursa.loop.dialects.verifiers import VerifiersDialect

DEFAULT_DIALECT = "recursa"
_REGISTRY: dict[str, Callable[..., Dialect]] = {
    "recursa": RecursaDialect,
    "tools": ToolsDialect,
    "rlms": RlmsDialect,
    "skyrl": SkyRLDialect,
    "verifiers": VerifiersDialect,
}


def dialect_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def register_dialect(name: str, factory: Callable[..., Dialect]) -> None:
    """Make `factory(**options)` the dialect called `name` (RLM(dialect=name, dialect_options=...))."""
    if not isinstance(name, str) or not name:
        raise ConfigError("register_dialect(name, factory): name must be a non-empty str")
    _REGISTRY[name] = factory


def make_dialect(spec: str | Dialect | None, options: Mapping[str, Any] | None = None) -> Dialect:
    """The dialect `spec` names (None: "recursa"), made with `options`; a Dialect object as it is."""
    if spec is None:
        spec = DEFAULT_DIALECT
    if not isinstance(spec, str):
        if options:
            raise ConfigError("«dialect_options=» go with a dialect given by name; this dialect is an object")
        if not all(hasattr(spec, a) for a in ("name", "opening", "read", "run", "feedback")):
            raise ConfigError(
                f"dialect={spec!r} is neither a dialect name ({', '.join(_REGISTRY)}) nor an object with "
                "the Dialect protocol (recursa.loop.dialects.base.Dialect)"
            )
        return spec
    factory = _REGISTRY.get(spec)
    if factory is None:
        raise ConfigError(f"unknown dialect {spec!r}; choose one of: {', '.join(_REGISTRY)}")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"«dialect_options={options!r}»: give a dict of option names to values")
    try:
        return factory(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"dialect {spec!r} does not take these options ({exc})") from None


__all__ = ["DEFAULT_DIALECT", "Dialect", "dialect_names", "make_dialect", "register_dialect"]
