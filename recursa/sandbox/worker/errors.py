"""The exceptions generated code can see and catch, and how an error reply from the host becomes one."""

from __future__ import annotations

# Exceptions generated code can see and catch. An error reply's kind is one of recursa.outcomes'
# ErrorKind (this process cannot import recursa; tests/test_sandbox.py holds the two together).


class SubcallError(Exception):
    """A call to the host (llm_query, rlm_query, ...) failed; the message says why."""

    kind = "SubcallError"


class BudgetExceeded(SubcallError):
    """The host refused a call because it could break a hard budget cap."""

    kind = "BudgetExceeded"


class RemoteError(Exception):
    """An error reply from the host, before it is turned into the class the REPL code sees."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class ToolError(Exception):
    """A user tool failed (raised, timed out, returned something unusable); the message says why."""

    kind = "ToolError"


_ERROR_CLASSES: dict[str, type[Exception]] = {
    "SubcallError": SubcallError,
    "BudgetExceeded": BudgetExceeded,
    "ToolError": ToolError,
}


def error_for(kind: str, message: str) -> Exception:
    """The exception to raise in the REPL for an error reply: same class name when we have one."""
    cls = _ERROR_CLASSES.get(kind, SubcallError)
    exc = cls(message)
    exc.kind = kind  # type: ignore[attr-defined]  (keeps e.g. "LMError" visible to code that looks)
    return exc
