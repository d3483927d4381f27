"""The form a question asks its answer in, and that answer built from what the root's code found.

Two forms, as a real model would read them from its first message:

- a JSON Schema (`run(..., answer_schema=...)`, a server's `response_format` or forced function):
  `schema_value` walks the schema and fills it from the found text, so the value validates
  (strings carry the text, numbers the first number in it within the schema's bounds, enums the
  member the text names, arrays and objects what their items and properties ask for);
- answer fields between markers (`[[ ## answer ## ]]`, the form DSPy's chat adapter asks for): the
  question's last paragraph names the fields, and each gets the found text, then the closing marker.

A schema this module cannot satisfy (a `pattern`, say) still gets its best value; the engine then
tells the root what failed, as it would tell a model.
"""

from __future__ import annotations

import json
import re
from typing import Any

# How the engine's first message introduces the schema (loop/answer_schema.py; read as a model reads
# it, since the offline models sit beside the loop and import nothing of it).
SCHEMA_INTRO = "must be a value matching this JSON schema"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_MARKER = re.compile(r"\[\[ ## (\w+) ## \]\]")
_CLOSING = "completed"
_YES = ("yes", "true", "correct")
# Values for string formats a validator may check; any other format takes the found text.
_FORMATS = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00Z",
    "email": "answer@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-0000-0000-000000000000",
}
_MAX_DEPTH = 12  # a recursive schema ($ref to itself) stops here with the smallest value it allows


def asked_schema(first_message: str) -> Any | None:
    """The JSON Schema the engine put in the first message, or None (none, or cut too short to read)."""
    at = first_message.find(SCHEMA_INTRO)
    if at < 0:
        return None
    start = first_message.find("\n", at)
    try:
        schema, _end = json.JSONDecoder().raw_decode(first_message[start:].strip())
    except (ValueError, IndexError):
        return None
    return schema if isinstance(schema, dict) else None


def marked_fields(question: str) -> list[str]:
    """The fields a question wants between `[[ ## name ## ]]` markers: those its last paragraph names."""
    last = question.strip().rsplit("\n\n", 1)[-1]
    names = _MARKER.findall(last)
    if _CLOSING not in names:
        return []
    return [n for n in dict.fromkeys(names) if n != _CLOSING]


def marked_answer(fields: list[str], found: str) -> str:
    return "".join(f"[[ ## {name} ## ]]\n{found}\n\n" for name in fields) + f"[[ ## {_CLOSING} ## ]]"


def schema_value(schema: dict[str, Any], found: str) -> Any:
    """A value that fits `schema`, carrying `found` where the schema leaves room for it."""
    return _Builder(schema, found).value(schema, 0)


class _Builder:
    def __init__(self, root: dict[str, Any], found: str) -> None:
        self.root = root
        self.found = found.strip() or "unknown"

    def value(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, dict):
            return self.found  # `true` or a malformed part: anything fits
        schema = self._resolved(schema)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return self._member(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                options = [o for o in schema[key] if not _is_null(self._resolved(o))] or schema[key]
                return self.value(options[0], depth + 1)
        if schema.get("allOf"):
            merged: dict[str, Any] = {}
            for part in schema["allOf"]:
                merged = _merge(merged, self._resolved(part))
            return self.value(_merge(merged, {k: v for k, v in schema.items() if k != "allOf"}), depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
        if kind is None:
            kind = _implied_type(schema)
        build = getattr(self, f"_{kind}", None)
        return build(schema, depth) if build is not None else self.found

    def _resolved(self, schema: dict[str, Any]) -> dict[str, Any]:
        seen = 0
        while isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/") and seen < _MAX_DEPTH:
            target: Any = self.root
            for part in schema["$ref"][2:].split("/"):
                target = (
                    target.get(part.replace("~1", "/").replace("~0", "~"), {})
                    if isinstance(target, dict)
                    else {}
                )
            extra = {k: v for k, v in schema.items() if k != "$ref"}
            schema = _merge(target if isinstance(target, dict) else {}, extra)
            seen += 1
        return schema

    def _member(self, members: list[Any]) -> Any:
        text = self.found.lower()
        named = [m for m in members if isinstance(m, str) and m.lower() in text]
        return max(named, key=len) if named else members[0]

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        text = _FORMATS.get(str(schema.get("format")), self.found)
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(high, int):
            text = text[:high]
        if isinstance(low, int) and len(text) < low:
            text = text + "." * (low - len(text))
        return text

    def _integer(self, schema: dict[str, Any], depth: int) -> int:
        number = _first_number(self.found)
        return int(_within(schema, int(number) if number is not None else 0, step=1))

    def _number(self, schema: dict[str, Any], depth: int) -> float:
        number = _first_number(self.found)
        return float(_within(schema, number if number is not None else 0.0, step=1e-6))

    def _boolean(self, schema: dict[str, Any], depth: int) -> bool:
        return self.found.lower().startswith(_YES)

    def _null(self, schema: dict[str, Any], depth: int) -> None:
        return None

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems") or (
            schema["items"] if isinstance(schema.get("items"), list) else []
        )
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        low = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
        high = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
        count = max(low, len(prefix), 0 if depth >= _MAX_DEPTH else 1)
        if high is not None:
            count = min(count, high)
        out = [self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(count)]
        if schema.get("uniqueItems") and len(out) > 1 and all(isinstance(v, str) for v in out):
            out = [f"{v} ({i + 1})" if i else v for i, v in enumerate(out)]
        return out

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        # Every property when there is depth to spare (a model fills the fields it is shown); only
        # the required ones below that, so a schema that refers to itself ends.
        names = list(properties) if depth < _MAX_DEPTH else [n for n in properties if n in required]
        out = {name: self.value(properties[name], depth + 1) for name in names}
        for name in required:
            out.setdefault(name, self.found)
        return out


def _is_null(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null"


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if key == "properties" and isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = {**out[key], **value}
        elif key == "required" and isinstance(out.get(key), list) and isinstance(value, list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        else:
            out[key] = value
    return out


def _implied_type(schema: dict[str, Any]) -> str:
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return "number"
    return "string"


def _first_number(text: str) -> float | None:
    match = _NUMBER.search(text.replace(",", ""))
    return float(match.group(0)) if match else None


def _within(schema: dict[str, Any], value: float, *, step: float) -> float:
    """`value` moved inside the schema's bounds (exclusive bounds by one step)."""
    low = schema.get("minimum")
    if isinstance(schema.get("exclusiveMinimum"), (int, float)):
        low = schema["exclusiveMinimum"] + step
    high = schema.get("maximum")
    if isinstance(schema.get("exclusiveMaximum"), (int, float)):
        high = schema["exclusiveMaximum"] - step
    if isinstance(low, (int, float)) and value < low:
        value = low
    if isinstance(high, (int, float)) and value > high:
        value = high
    return value
