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


# Keywords a model may name the one argument with (FINAL(answer=42), FINAL_VAR(name="x")): one of
# these alone is unambiguous. Any other keyword (FINAL(x=5)) could be text ("x = 5") or a value.
_VALUE_KEYWORDS = frozenset({"value", "answer", "result", "text", "content", "final_answer"})
_NAME_KEYWORDS = frozenset({"name", "var", "var_name", "variable", "variable_name"})


def one_answer(fn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The single argument of FINAL / FINAL_VAR, or a TypeError that says how to answer.

    FINAL(x, y) raises rather than answering with the tuple: FINAL's value becomes result.value
    (what answer_schema validates and code reads), and nothing tells whether the model meant a tuple,
    a list, or text ("x, y", or print-like "The answer is 42"). Guessing would hand the user a value
    the model never chose; the error costs one turn and names the fix. FINAL_VAR and the `answer`
    dict take one value the same way, so all three hold several values the same way: in one value."""
    keywords = _NAME_KEYWORDS if fn == "FINAL_VAR" else _VALUE_KEYWORDS
    if len(args) == 1 and not kwargs:
        return args[0]
    if not args and len(kwargs) == 1 and next(iter(kwargs)) in keywords:
        return next(iter(kwargs.values()))
    if not args and len(kwargs) == 1:
        key = next(iter(kwargs))
        raise TypeError(
            f"{fn} takes its one {'variable name' if fn == 'FINAL_VAR' else 'value'} without a keyword, "
            f"got {key}=...: write {fn}(...) with the value alone."
        )
    given = [*(type(a).__name__ for a in args), *(f"{k}=" for k in kwargs)]
    got = f"{len(given)} arguments ({', '.join(given[:6])})" if given else "no argument"
    if fn == "FINAL_VAR":
        raise TypeError(
            f"FINAL_VAR takes the name of one variable, got {got}. To answer with several values, put "
            'them in one variable first (result = [a, b]) and write FINAL_VAR("result").'
        )
    raise TypeError(
        f"FINAL takes one value, the whole answer, got {got}. To answer with several values, pass "
        'them as one: FINAL([a, b]) for a list, FINAL({"a": a, "b": b}) for a dict, or '
        'FINAL(f"{a}, {b}") for text.'
    )
