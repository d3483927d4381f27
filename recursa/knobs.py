"""Options that arrive as a dict, not as keyword arguments: a SkyRL row's `extras`, an ACP session's
`_meta`. Python catches a misspelt keyword and a type checker a wrong type; a dict gets neither, so a
typo would fall back to the default without a word, and `int("ten")` would fail without naming the
option. Each reader here checks one value and names it the way the caller wrote it
(`extras['max_turns']`), with the fix.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Collection, Mapping
from typing import Any

from recursa.budget import Budget, cap_problem, positive_phrase
from recursa.errors import ConfigError

_NEAR = 0.85  # difflib ratio: max_turn, maxturns, repl_timout match; data_source, max_tokens do not


def near_miss(key: str, known: Collection[str]) -> str | None:
    """The known option `key` is most likely a misspelling of, or None."""
    folded = {k.lower(): k for k in known}
    found = difflib.get_close_matches(key.lower().replace("-", "_"), list(folded), n=1, cutoff=_NEAR)
    return folded[found[0]] if found else None


def check_keys(given: Mapping[Any, Any], known: Collection[str], where: Callable[[str], str], *,
               strict: bool) -> None:  # fmt: skip
    """Refuse a key that is a near miss of a known option (always) or unknown at all (`strict`):
    loose dicts such as a dataset row's extras carry other keys of their own."""
    for key in given:
        if not isinstance(key, str):
            raise ConfigError(f"{where(repr(key))}: option names are strings")
        if key in known:
            continue
        close = near_miss(key, known)
        if close is not None:
            raise ConfigError(f"{where(key)} is not an option; did you mean {close!r}?")
        if strict:
            raise ConfigError(f"{where(key)} is not an option; the options are: {', '.join(sorted(known))}")


def int_value(name: str, value: Any, low: int) -> int:
    """A whole number >= low (an integral float such as 3.0 too); never a bool or a numeric string."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        if int(value) >= low:
            return int(value)
    raise ConfigError(f"{name}={value!r}: give a whole number >= {low}{_text_hint(value)}")


def seconds_value(name: str, value: Any) -> float:
    """A finite number of seconds > 0."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number > 0:
            return number
    raise ConfigError(f"{name}={value!r}: give a number of seconds > 0{_text_hint(value)}")


def wait_value(name: str, value: Any) -> float:
    """A finite number of seconds >= 0 (0: do not wait)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number >= 0:
            return number
    raise ConfigError(f"{name}={value!r}: give a number of seconds >= 0 (0: do not wait){_text_hint(value)}")


def text_value(name: str, value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(f"{name}: give a non-empty string, not {kind(value)}")


def flag_value(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{name}={value!r}: give true or false")


def function_value(name: str, value: Any, signature: str) -> Callable[..., Any]:
    if callable(value):
        return value
    raise ConfigError(f"{name} is {kind(value)}, not a function; give a function {signature}")


def budget_value(name: str, value: Any) -> Budget:
    """A Budget, or a dict of its fields; a bad field is named as `name['field']`."""
    if isinstance(value, Budget):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name} is {kind(value)}; give a dict of Budget fields, e.g. {{'max_llm_calls': 200}}"
        )
    fields = ("max_usd", "max_tokens", "max_seconds", "max_llm_calls")
    check_keys(value, fields, lambda key: f"{name}[{key!r}]", strict=True)
    for field, cap in value.items():
        if cap is not None and (problem := cap_problem(field, cap)) is not None:
            raise ConfigError(
                f"{name}[{field!r}]={cap!r}: {problem}; give {positive_phrase(field)} or None (no cap)"
            )
    return Budget(**value)


def kind(value: Any) -> str:
    """What a value is, for a message: "a str", "an int", "None"."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def _text_hint(value: Any) -> str:
    return " (a number, not text)" if isinstance(value, str) else ""
