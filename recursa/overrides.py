"""Run options a client sends as a dict, checked: a server request's `recursa` options, an ACP
session's `_meta`, a trainer row's `extras`.

Python catches a misspelt keyword and a type checker a wrong type; a dict gets neither, so a typo
would fall back to the default without a word, and `int("ten")` would fail without naming the option.
`client_settings` checks each run setting by the schema (recursa/config.py) and against the
operator's limits: a client may lower what costs the operator money or capacity, never raise it
(`Override` of the setting), and picks models only among the operator's unless it brings its own
key. The readers below check the options that are not run settings (functions, a task family).
Every message names the option as the client wrote it (`extras['max_turns']`), with the fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Mapping
from typing import Any
from urllib.parse import urlsplit

from recursa.budget import Budget, cap_problem, positive_phrase
from recursa.config import BUDGET_CAPS, EnvConfig, RLMConfig, Spelling, near_miss, setting_of
from recursa.errors import ConfigError
from recursa.outcomes import BUDGET_LIMITS

# Caps that bound only what the client's own key pays for; max_seconds also holds the operator's
# machine (a sandbox, a run slot), so it can only be lowered whoever pays for the calls.
_MONEY_CAPS = ("max_usd", "max_tokens", "max_llm_calls")


def client_settings(
    given: Mapping[str, Any],
    limits: Mapping[str, Any],
    spelling: Spelling,
    *,
    models: Collection[str] | None = (),
    own_key: bool = False,
    stated_only: bool = False,
) -> dict[str, Any]:
    """The run settings among `given` (schema names), each checked, and each within the operator's
    `limits` (setting name -> the operator's value; a missing one: the schema's default). A setting
    only the operator sets, a value above the operator's for one that costs money or capacity, or
    a model that is not one of `models` while the operator's key pays, is a ConfigError naming the
    option and the operator's limit. `stated_only` (a trainer's rows under its own config): only
    the limits in `limits` hold, any model goes when `models` is None, and the operator-only
    settings are the row's to set too (the trainer runs both). A budget's caps may also come one by
    one (`recursa.max_usd`): parts of `budget`, each named as given. A ConfigError's `setting` names
    the option at fault."""
    given = dict(given)
    loose = {cap: given.pop(cap) for cap in BUDGET_CAPS if cap in given}
    if loose:
        given.setdefault("budget", None)
    out: dict[str, Any] = {}
    for name, value in given.items():
        declared = setting_of(name)
        if declared.client == "operator" and stated_only:
            out[name] = value if name == "budget" else checked_value(name, value, spelling)
            continue
        if declared.client == "operator":
            raise ConfigError(
                f"{spelling.given(name, value)}: {spelling.label(name)} is set by the operator only; leave it out",
                setting=name,
            )
        if name == "budget":
            out[name] = _budget(value, loose, limits.get("budget") or Budget(), spelling, own_key)
            continue
        value = checked_value(name, value, spelling)
        if declared.client == "choose" and not own_key and models is not None and value not in models:
            pays = "for no model a client names; leave it out"
            if models:
                pays = f"only for {', '.join(map(repr, models))}; choose one of those"
            raise ConfigError(
                f"{spelling.given(name, value)}: runs here use the operator's key, which pays {pays}, "
                "or send your own API key with it"
            )
        limit = limits.get(name) if stated_only else limits.get(name, declared.default)
        if declared.client == "tighten" and limit is not None and value is not None and value > limit:
            raise ConfigError(refused_widening(spelling.label(name), value, limit), setting=name)
        out[name] = value
    return out


def checked_value(name: str, value: Any, spelling: Spelling) -> Any:
    """One setting's value checked by the schema, named as `spelling` writes it. A whole number
    written as a float (3.0, as JSON and trainers' configs may) counts as the int it is."""
    declared = setting_of(name)
    whole = isinstance(value, float) and value.is_integer()
    if whole and declared.annotation in (int, int | None):
        value = int(value)
    model = RLMConfig if name in RLMConfig.model_fields else EnvConfig
    return model.check_one(name, value, spelling)


def _budget(value: Any, loose: Mapping[str, Any], operator: Budget, spelling: Spelling, own_key: bool) -> Budget:
    """The operator's caps with the client's own in place of those it sets, none of them higher:
    `value` (a Budget or a dict of caps) and the caps given one by one (`loose`)."""
    where = spelling.label("budget")
    try:
        whole = budget_value(where, value if value is not None else {})
    except ConfigError as exc:
        raise ConfigError(str(exc), setting="budget") from None
    asked = {cap: getattr(whole, cap) for cap in BUDGET_CAPS}
    for cap, mine in loose.items():
        if (problem := cap_problem(cap, mine)) is not None:
            raise ConfigError(
                f"{spelling.given(cap, mine)}: {problem}; send {positive_phrase(cap)}, or leave it out for "
                "the operator's cap",
                setting=cap,
            )
        asked[cap] = mine
    caps = {cap: getattr(operator, cap) for cap in BUDGET_CAPS}
    for cap, mine in asked.items():
        theirs = caps[cap]
        if mine is None:
            continue
        if theirs is not None and mine > theirs and not (own_key and cap in _MONEY_CAPS):
            label = f"{where}[{cap!r}]" if spelling.form == "key" else f"{where}.{cap}"
            label = spelling.label(cap) if cap in loose else label
            raise ConfigError(refused_widening(label, mine, theirs), setting=cap if cap in loose else "budget")
        caps[cap] = mine
    return Budget(**caps)


def refused_widening(label: str, value: Any, limit: Any) -> str:
    """The error for a client's option above the operator's limit, naming both."""
    return (
        f"{label}={value!r} is more than the operator allows (at most {limit!r}): a client may only "
        f"lower it; ask for {limit!r} or less, or leave it out"
    )


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
    check_keys(value, BUDGET_LIMITS, lambda key: f"{name}[{key!r}]", strict=True)
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


def same_url(a: str, b: str) -> bool:
    """Whether two base URLs name the same endpoint (scheme and host in any case, a trailing /)."""
    x, y = urlsplit(a.strip()), urlsplit(b.strip())
    return (x.scheme.lower(), x.netloc.lower(), x.path.rstrip("/"), x.query) == (
        y.scheme.lower(),
        y.netloc.lower(),
        y.path.rstrip("/"),
        y.query,
    )
