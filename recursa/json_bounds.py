"""How many values a JSON text holds and how deep it nests, told before anything is built from it.

A JSON text can become many times its size once parsed (`[{},{},...]`: 3 bytes a dict of some 64),
and json.loads builds every value before a caller can count them. `check_bounds` counts them in
the text instead, with the C loops of `bytes`' methods: escapes are dropped (`\\\\` and `\\"`
left to right, as JSON pairs them), the text is split at the quotes left, which are the strings'
ends, and only what lies outside strings is counted (a comma or a bracket inside one is no value):

    values = 1 + commas + opening brackets - empty pairs (`[]`, `{}`)

(every value is the whole text, or the first item of a non-empty list or object, or follows a
comma), the nesting the highest running sum of opening minus closing brackets. For a text json.loads
accepts both are exact (but for an empty pair split between two pieces, counted as a value); for
any other, json.loads builds no more values before it fails than the count (its prefix is counted
alike). The text is read in pieces of `_PIECE` bytes, carrying whether a string is open, and the
first piece past a bound ends the count: a flood costs work for the bytes up to the bound only.
"""

from __future__ import annotations

import re
from itertools import accumulate

_SPACE = b" \t\r\n"
_BACKSLASHES = re.compile(rb"\\*")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _open in b"[{":
    _STEP[_open] = 1
for _close in b"]}":
    _STEP[_close] = -1
_PIECE = 1 << 18  # what one piece's split holds stays a few MB, whatever the text


class TooMuchJSON(ValueError):
    """The text holds more values than allowed."""


class TooDeepJSON(ValueError):
    """The text nests arrays and objects deeper than allowed."""


def check_bounds(raw: bytes, max_values: int, max_nesting: int) -> int:
    """TooMuchJSON when `raw` holds more than `max_values` values (every object, array and member
    counts), TooDeepJSON when it nests deeper than `max_nesting`; otherwise the most values it can
    hold (whether it is JSON at all is json.loads' to say)."""
    opening = raw.count(b"[") + raw.count(b"{")
    if (most := 1 + opening + raw.count(b",")) <= max_values and opening <= max_nesting:
        return most  # even counting the brackets and commas inside strings, it is within both bounds
    values, depth, inside, at, size = 1, 0, False, 0, len(raw)
    while at < size:
        end = min(size, at + _PIECE)
        if raw[end - 1] == 0x5C:  # a run of backslashes, and what its last one escapes, in one piece
            end = min(size, _BACKSLASHES.match(raw, end).end() + 1)  # type: ignore[union-attr]
        if inside and raw.find(b'"', at, end) < 0:  # the piece is all one string's text
            at = end
            continue
        parts = raw[at:end].replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')
        # A string left as one byte of its own: `["x"]` is no empty pair.
        dense = b"s".join(parts[1 if inside else 0 :: 2]).translate(None, _SPACE)
        inside ^= len(parts) % 2 == 0  # an odd number of quotes opened (or closed) a string
        opened = dense.count(b"[") + dense.count(b"{")
        values += dense.count(b",") + opened - dense.count(b"[]") - dense.count(b"{}")
        if values > max_values:
            raise TooMuchJSON(f"more than {max_values:,} JSON values")
        steps = map(_STEP.__getitem__, dense.translate(None, _NOT_BRACKET))
        if opened and max(accumulate(steps, initial=depth)) > max_nesting:
            raise TooDeepJSON(f"JSON nested more than {max_nesting} deep")
        depth += opened - dense.count(b"]") - dense.count(b"}")
        at = end
    return values
