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

import numbers
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import PurePath
from typing import Any
from urllib.parse import urlsplit

from recursa.budget import CAPS, Budget, cap_message, cap_problem
from recursa.config import (
    BUDGET_CAPS,
    SAMPLING_ROLES,
    SAMPLING_SETTINGS,
    SETTINGS,
    EnvConfig,
    RLMConfig,
    SamplingOptions,
    Spelling,
    near_miss,
    setting_of,
)
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
    the limits in `limits` hold, any model goes when `models` is None, and an operator-only setting
    may repeat the operator's value (a row is data: which sandbox runs it and where its files go
    stay the operator's choice) or direct the row's own key (`_OWN_KEYS`). A budget's caps may also come one by
    one (`recursa.max_usd`): parts of `budget`, each named as given. A ConfigError's `setting` names
    the option at fault. A None is no setting: the operator's holds (a client's turn_timeout=None
    would widen the operator's to exec_timeout)."""
    given = {name: value for name, value in given.items() if value is not None}
    loose = {cap: given.pop(cap) for cap in BUDGET_CAPS if cap in given}
    if loose:
        given.setdefault("budget", None)
    out: dict[str, Any] = {}
    for name, value in given.items():
        declared = setting_of(name)
        if declared.client == "operator":
            out[name] = _operator_setting(name, value, limits, spelling, stated_only)
            continue
        if name == "budget":
            out[name] = _budget(value, loose, limits.get("budget") or Budget(), spelling, own_key)
            continue
        if name == "sampling":
            out[name] = client_sampling(value, limits.get("sampling"), spelling)
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
        if declared.client == "tighten" and declared.exceeds(value, limit):
            raise ConfigError(refused_widening(spelling.label(name), value, limit), setting=name)
        out[name] = value
    return out


def _operator_setting(
    name: str, value: Any, limits: Mapping[str, Any], spelling: Spelling, stated_only: bool
) -> Any:
    """A setting only the operator chooses (which sandbox runs the code, where files go, which
    server its key goes to), as a client's options give it: refused, but for a trainer's row that
    repeats the operator's value, or that directs only the key the row brings itself (`_OWN_KEYS`;
    the adapter holds a row's base_url to its own key)."""
    operators = limits.get(name, setting_of(name).default)
    if stated_only:
        mine = checked_value(name, value, spelling, beside=limits)
        if name in _OWN_KEYS or mine == operators:
            return mine
    secret = name in RLMConfig.model_fields and not RLMConfig.model_fields[name].repr  # a key
    shown = "" if secret else f" (the operator's: {_plain(operators)!r})"
    said = f"{spelling.label(name)}=(not shown)" if secret else spelling.given(name, _plain(value))
    repeat = "repeat the operator's setting, or " if stated_only else ""
    raise ConfigError(
        f"{said}: {spelling.label(name)} is the operator's to choose{shown}; {repeat}leave it out",
        setting=name,
    )


def _plain(value: Any) -> Any:
    """A path as the text it was written as (not PosixPath('...'))."""
    return str(value) if isinstance(value, PurePath) else value


# Operator settings a trainer's row may set for calls it pays for with its own key.
_OWN_KEYS = ("base_url", "api_key")


def client_sampling(
    given: Any,
    operator: Mapping[str, Mapping[str, Any]] | None,
    spelling: Spelling,
    at: Callable[[str], Spelling] | None = None,
) -> dict[str, dict[str, Any]]:
    """A client's sampling options (role -> options) over the operator's `operator` sampling: each
    option one a client may send (`SamplingOptions` in recursa/config.py), checked by its bounds and
    by its policy ("tighten": no more than the operator's value for that role). `at(role)`: how the
    client writes a role's options (default: inside its `sampling`, as `spelling` writes it; a
    server request's top-level fields are the root's). A ConfigError's `setting` names the option."""
    out = {role: dict(options) for role, options in (operator or {}).items()}
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{spelling.label('sampling')} is {kind(given)}; give a dict of roles to options, e.g. "
            f"{SETTINGS['sampling'].example}",
            setting="sampling",
        )
    for role, options in given.items():
        within = at(role) if at is not None else spelling.within("sampling", role)
        if role not in SAMPLING_ROLES or not isinstance(options, Mapping):
            raise ConfigError(
                f"{within.owner}: give a dict of sampling options for a role, one of "
                f"{', '.join(SAMPLING_ROLES)}; e.g. {{'temperature': 0.7}}",
                setting="sampling",
            )
        check_keys(options, SAMPLING_SETTINGS, within.label, strict=True)
        theirs = out.setdefault(role, {})
        for key, value in options.items():
            if value is None:
                continue
            value = checked_value(key, value, within)
            declared, limit = SAMPLING_SETTINGS[key], theirs.get(key)
            if declared.client == "tighten" and declared.exceeds(value, limit):
                raise ConfigError(refused_widening(within.label(key), value, limit), setting=key)
            theirs[key] = value
    return out


def checked_value(name: str, value: Any, spelling: Spelling, beside: Mapping[str, Any] | None = None) -> Any:
    """One setting's value checked by the schema, named as `spelling` writes it, beside the settings
    (by schema name) its check reads (`Schema.check_one`). A whole number written as a float (3.0,
    as JSON and trainers' configs may) counts as the int it is."""
    declared = setting_of(name)
    whole = isinstance(value, float) and value.is_integer()
    if whole and declared.annotation in (int, int | None):
        value = int(value)
    model = next(m for m in (RLMConfig, EnvConfig, SamplingOptions) if name in m.model_fields)
    return model.check_one(name, value, spelling, beside)


def _budget(value: Any, loose: Mapping[str, Any], operator: Budget, spelling: Spelling, own_key: bool) -> Budget:
    """The operator's caps with the client's own in place of those it sets, none of them higher:
    `value` (a Budget or a dict of caps) and the caps given one by one (`loose`)."""
    where = spelling.label("budget")
    try:
        whole = budget_value(where, value if value is not None else {}, left_out="the operator's cap")
    except ConfigError as exc:
        raise ConfigError(str(exc), setting="budget") from None
    asked = {cap: getattr(whole, cap) for cap in BUDGET_CAPS}
    apart = budget_of(loose, spelling, left_out="the operator's cap")
    asked |= {cap: getattr(apart, cap) for cap in loose}
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


def budget_of(
    caps: Mapping[str, Any], spelling: Spelling, *, base: Budget | None = None, left_out: str = "no cap"
) -> Budget:
    """`base` (default: no caps) with `caps` in its place, each checked once, by Budget; a bad one is
    a ConfigError (its `setting` the cap) told as `spelling` writes the cap given on its own (a flag,
    an argument, a request field), in Budget's words (`cap_message`), with what leaving it out gives
    (`left_out`)."""
    base = base or Budget()
    try:
        return replace(base, **caps)
    except ConfigError as exc:
        cap = str(exc.setting)
        value = caps[cap] if cap in caps else getattr(base, cap)
        problem = cap_problem(cap, value) or str(exc)  # the rule Budget refused it by
        # A Python door names the cap as its own argument (`recursa.bench.run(max_usd=-1)`), not Budget's.
        said = f"{spelling.owner}({cap}={value!r})" if spelling.form == "python" else spelling.given(cap, value)
        example = spelling.assign(cap, CAPS[cap].example)
        told = cap_message(cap, value, spelling.told(problem), said=said, example=example,
                           label=spelling.label(cap), left_out=left_out)  # fmt: skip
        raise ConfigError(told, setting=cap) from None


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


def text_value(name: str, value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(f"{name}: give a non-empty string, not {kind(value)}")


def function_value(name: str, value: Any, signature: str) -> Callable[..., Any]:
    if callable(value):
        return value
    raise ConfigError(f"{name} is {kind(value)}, not a function; give a function {signature}")


def budget_value(name: str, value: Any, *, left_out: str = "no cap") -> Budget:
    """A Budget, or a dict of its fields; a bad field is named as `name['field']` (`left_out`: what
    leaving a cap out gives)."""
    if isinstance(value, Budget):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name} is {kind(value)}; give a dict of Budget fields, e.g. {{'max_llm_calls': 200}}"
        )
    check_keys(value, BUDGET_LIMITS, lambda key: f"{name}[{key!r}]", strict=True)
    return budget_of(value, Spelling("key", name), left_out=left_out)


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
