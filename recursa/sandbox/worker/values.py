"""Values crossing the channel: text for the model, JSON for the host, never a pickle."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_JSON_DEPTH = 20


def render(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # a broken __str__ or a 10**5000 int must not lose the answer path
        return f"<{type(value).__name__} that cannot be shown as text: {type(exc).__name__}: {exc}>"


def json_safe(value: Any, depth: int = 0) -> Any:
    """A JSON-able copy: scalars, lists (tuples become lists) and str-keyed dicts; else str(value)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value if type(value) is str else str.__str__(value)
    if isinstance(value, int):
        return int(value) if value.bit_length() < 10_000 else render(value)
    if isinstance(value, float):
        return float(value) if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if depth < _JSON_DEPTH:
        if isinstance(value, (list, tuple)):
            return [json_safe(v, depth + 1) for v in value]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {str.__str__(k): json_safe(v, depth + 1) for k, v in value.items()}
    return render(value)


def answer_text(value: Any, what: str) -> str:
    """An answer as text: str(value), else repr(value); a value that can be shown neither way is not
    an answer (its error text would be returned as if it were)."""
    try:
        return str(value)
    except Exception as exc:
        first = exc
    try:
        return repr(value)
    except Exception:
        pass
    raise TypeError(
        f"{what}: the {type(value).__name__} value cannot be turned into text (its __str__ raised "
        f"{type(first).__name__}: {first}, and so did its __repr__); answer with text built from it instead"
    )


def final_payload(value: Any, protocol: str, var_name: str | None = None) -> dict[str, Any]:
    text = answer_text(value, f"FINAL_VAR({var_name!r})" if var_name else protocol)
    out: dict[str, Any] = {"text": text, "protocol": protocol, "var_name": var_name}
    safe = json_safe(value)
    if isinstance(safe, str) and not isinstance(value, str):
        safe = text  # an object answers with the text shown for it, not a second rendering
    if isinstance(safe, str) and safe == text:
        out["value_is_text"] = True  # a long str answer crosses the channel once, not twice
    else:
        out["value"] = safe
    return out


def describe_size(value: Any) -> str:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        unit = " chars" if isinstance(value, str) else " bytes" if isinstance(value, bytes) else " items"
        return f" (len {len(value):,}{unit})"
    return ""


def render_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<{type(value).__name__} whose repr failed: {type(exc).__name__}: {exc}>"
