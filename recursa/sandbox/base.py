"""The Sandbox protocol: a persistent Python REPL that runs generated code and calls back to the host."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from recursa.context import ContextPayload
from recursa.errors import ConfigError
from recursa.outcomes import AnswerProtocol, ErrorKind, error_kind

# The host side of the REPL's call-backs: (function name, JSON arguments) -> JSON result.
# Raising `CallbackError` (or any exception) sends a clear error into the REPL, where the generated
# code sees it as an exception of the same name with the same message.
CallHandler = Callable[[str, dict[str, Any]], Awaitable[Any]]

# Every function the REPL's call-backs name (user tools all go through "tool"). A call naming any
# other came from code writing to the channel itself, and is answered without reaching the handler.
HOST_FUNCTIONS = frozenset({"llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched", "tool"})

# Fork snapshots of a worker's state (worker/snapshots.py): after every cell (True), none (False), or
# after every cell the host does not follow at once ("idle", RLMEnv's default): the host gives the
# worker its word to fork only once it has sent it nothing for SNAPSHOT_IDLE_S after a cell, so a
# policy that takes longer than that (any model generating a reply) has the fork done while it
# thinks, and a cell sent sooner runs without a snapshot of the state before it, instead of waiting
# for the fork and the copy-on-write faults after it (about 3 ms here, docs/performance.md, "RL
# step"): if such a cell has to be killed, the REPL starts over and says so.
SnapshotMode = bool | Literal["idle"]
SNAPSHOT_IDLE_S = 0.005


def snapshot_mode(value: Any) -> SnapshotMode:
    """`value` as a SnapshotMode, or a ConfigError naming the choices."""
    if value is True or value is False or value == "idle":
        return value  # type: ignore[no-any-return]
    raise ConfigError(f"snapshots={value!r}: give True (a snapshot after every cell), 'idle' or False")


class CallbackError(Exception):
    """An error to raise inside the REPL, under `kind` (e.g. "BudgetExceeded")."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind

    @classmethod
    def of(cls, exc: Exception) -> CallbackError:
        """`exc` as the REPL sees it: itself when it is one; else under its class's name when that
        is an error kind, or a SubcallError whose message names the class (a host-side failure)."""
        if isinstance(exc, CallbackError):
            return exc
        name = type(exc).__name__
        kind = error_kind(name)
        return cls(kind, str(exc) if kind == name else f"{name}: {exc}")


@dataclass
class FinalAnswer:
    """An answer handed back from code: FINAL(x), FINAL_VAR(name) or answer["ready"] = True."""

    text: str  # the value rendered as str
    value: Any  # JSON-safe value when it has one, else the same as `text`
    protocol: AnswerProtocol  # from code: "FINAL", "FINAL_VAR" or "answer"
    var_name: str | None = None


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    omitted_chars: int = 0  # characters cut from the middle of stdout+stderr inside the worker
    error: str | None = None  # the exception line(s), e.g. "NameError: name 'x' is not defined"
    final: FinalAnswer | None = None
    timed_out: bool = False
    restarted: bool = False  # the process had to be replaced; say what state survived in `notes`
    restored: bool = False  # ... by a snapshot of the state before the cell (earlier variables kept)
    restored_names: list[str] = field(default_factory=list)  # reserved names the code overwrote
    notes: list[str] = field(default_factory=list)  # messages for the model (timeouts, restores...)
    duration_s: float = 0.0
    partial: str | None = None  # answer["content"] set but not marked ready (kept for early stops)


@runtime_checkable
class Sandbox(Protocol):
    """A persistent REPL for one RLM run. Every method is safe to await from one event loop."""

    name: str
    isolation: dict[str, Any]  # what is enforced, e.g. {"process": True, "seccomp": False}

    async def start(self, handler: CallHandler) -> None: ...

    async def load_context(self, payload: ContextPayload) -> None: ...

    async def define(self, entries: list[dict[str, Any]]) -> list[str]:
        """Add reserved names (user tools, engine-kept values such as a session's `history`).

        Each entry is {"name", "kind": "source" | "host" | "value", ...}; see worker.Repl.define.
        Definitions survive restarts. Returns the tools that could not be set up, as messages.
        """
        ...

    async def execute(self, code: str, timeout: float) -> ExecResult: ...

    async def get_variable(self, name: str, timeout: float | None = None) -> FinalAnswer | None:
        """The value of a REPL variable as a FinalAnswer (for a prose FINAL_VAR), None if undefined
        or unreadable. Its text comes from the value's __str__, code the model wrote: `timeout`
        bounds it (what is left of the reply's time for code; None: the sandbox's query_timeout)."""
        ...

    async def variable_names(self) -> list[str]: ...

    async def close(self) -> None: ...


async def start_loaded(
    sandbox: Sandbox, handler: CallHandler, payload: ContextPayload,
    started: Callable[[Sandbox], None] | None = None,
) -> None:  # fmt: skip
    """Start `sandbox` and load `payload` into it. A sandbox that can do both in one step (a
    `start_loaded` method of its own: a REPL on a Ray node, one request to its node instead of two)
    does, when the payload's bytes are written; otherwise the start overlaps their writing (on an
    environment's writer thread, recursa/env/contexts.py) and the load follows. `started(sandbox)` is
    called as soon as the sandbox has started."""
    both = getattr(sandbox, "start_loaded", None)
    if both is not None and payload.settle():
        await both(handler, payload)
        if started is not None:
            started(sandbox)
        return
    await sandbox.start(handler)
    if started is not None:
        started(sandbox)
    await payload.ready()
    await sandbox.load_context(payload)
