"""The token fields a trainer sends with a reply (its own, or a `sub_call`'s): token ids, logprobs,
counts. A trainer's engine hands them over as lists, tuples, numpy arrays or torch tensors, with
numpy integers for counts; each becomes a plain list or int here, and anything else is an error
naming the field, where before a form other than a list was dropped without a word (the rows then
had no token ids and the usage was estimated from characters).
"""

from __future__ import annotations

import numbers
from typing import Any

from recursa.env.shared import EnvError

ID_FIELDS = ("token_ids", "prompt_token_ids")
COUNT_FIELDS = ("input_tokens", "output_tokens")
# What `token_fields` gives for a reply that carries none (read only).
NONE_GIVEN: dict[str, Any] = dict.fromkeys((*ID_FIELDS, "logprobs", *COUNT_FIELDS))


def token_fields(extra: dict[str, Any], what: str) -> dict[str, Any]:
    """`token_ids`, `prompt_token_ids`, `logprobs` as lists and `input_tokens`, `output_tokens` as
    ints (absent or None: None), or EnvError naming `what`'s field."""
    found: dict[str, Any] = {}
    for name in (*ID_FIELDS, "logprobs"):
        found[name] = _sequence(extra.get(name), f"{what}'s {name}", ids=name != "logprobs")
    for name in COUNT_FIELDS:
        value = extra.get(name)
        if value is not None and not (
            isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0
        ):
            raise EnvError(f"{what}'s {name} is {value!r}; give a whole number >= 0 (or leave it out)")
        found[name] = None if value is None else int(value)
    return found


def given_count(count: int | None, token_ids: list[int] | None) -> int | None:
    """The count given, else the length of the token ids given, else None (then estimated)."""
    if count is not None:
        return count
    return len(token_ids) if token_ids is not None else None


def _sequence(value: Any, name: str, *, ids: bool) -> list[Any] | None:
    if value is None:
        return None
    listed = value.tolist() if callable(getattr(value, "tolist", None)) else value  # numpy, torch
    if not isinstance(listed, list | tuple):
        raise EnvError(f"{name} is a {type(value).__name__}; give a list (or a 1-D array) of numbers")
    kind = numbers.Integral if ids else numbers.Real
    for item in listed:
        if not isinstance(item, kind) or isinstance(item, bool):
            what = "token ids (whole numbers)" if ids else "logprobs (numbers)"
            raise EnvError(f"{name} holds {item!r}; give a flat list of {what}")
    return [int(v) for v in listed] if ids else [float(v) for v in listed]
