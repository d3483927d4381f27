"""recursa's sandbox as DSPy's code interpreter (`pip install "recursa[dspy]"`).

    import dspy
    from recursa.integrations.dspy import RecursaInterpreter

    rlm = dspy.RLM("context, query -> answer", tools=[lookup],
                   interpreter_factory=RecursaInterpreter.factory(exec_timeout=30))

`dspy.RLM` runs generated code in an interpreter it creates per call from `interpreter_factory`.
Its default (Pyodide under Deno) needs network access to start, and `LocalInterpreter` is not a
sandbox; neither keeps state through a timeout. `RecursaInterpreter` runs the code in recursa's
hardened worker process instead (the same one as `recursa.RLM`: Landlock, seccomp, rlimits, bwrap
namespaces where available; `isolation` says what held). A step that runs past `exec_timeout` is
interrupted and the REPL keeps every variable; one that ignores the interrupt is killed and the REPL
comes back from a snapshot of its state before the step. DSPy's host tools (`llm_query`,
`llm_query_batched`, your `tools=[...]`, the sub-agent bridge) are called over the worker's channel
and run in this process, in the caller's DSPy context (its `dspy.context(lm=...)` settings).

The interpreter is synchronous, as DSPy's protocol is: it keeps its own event loop on a thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import keyword
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dspy.primitives.code_interpreter import CodeExecutionError, CodeInterpreterError, FinalOutput

from recursa.config import DEFAULTS as D
from recursa.config import RLMConfig, Spelling
from recursa.errors import SandboxError
from recursa.sandbox import Sandbox, make_sandbox
from recursa.sandbox.base import CallbackError, ExecResult
from recursa.sync import PrivateLoop
from recursa.trace.redact import redact

T = TypeVar("T")

# The worker has functions of these names already (they call the host with a prompt or prompts);
# under DSPy they are answered by DSPy's tools of the same names.
_DSPY_LLM_TOOLS = ("llm_query", "llm_query_batched")
_RESERVED = frozenset({"SUBMIT", "__builtins__"})
_SUBMIT_SOURCE = '''
class _SubmitDone(BaseException):
    """Ends the step once SUBMIT has handed over the output (not caught by `except Exception`)."""


def SUBMIT(*args, **kwargs):
    """Submit the final output; this ends the current step."""
    names = {names!r}
    if names is None:
        if len(args) != 1 or kwargs:
            raise TypeError("SUBMIT takes one value")
        values = {{"output": args[0]}}
    else:
        if args and kwargs:
            raise TypeError("SUBMIT takes positional or keyword values, not both")
        values = dict(zip(names, args)) if args else dict(kwargs)
        if set(values) != set(names) or len(args) > len(names):
            raise TypeError("SUBMIT takes the output fields " + ", ".join(names))
    FINAL(values)
    raise _SubmitDone
'''


# A DSPy step is one short cell, not an RLM turn: its own default, the rest checked as RLM's.
_EXEC_TIMEOUT = 30.0
_SPELLING = Spelling("python", "RecursaInterpreter", defaults={"exec_timeout": _EXEC_TIMEOUT})


class RecursaInterpreter:
    """A DSPy `CodeInterpreter` backed by recursa's sandboxed REPL worker.

    `tools`: host functions callable by name from the code (DSPy fills this dict). `output_fields`:
    DSPy's output field definitions, for `SUBMIT(...)`. `exec_timeout`: seconds per step before it
    is interrupted (variables kept). `sandbox` / `sandbox_options`: as for `recursa.RLM`.
    """

    execution_instructions = (
        "Code runs in a sandboxed Python REPL (a separate locked-down process: no network, only its own "
        "scratch directory is writable). Variables, imports and functions persist across steps, also "
        "after a step is stopped for running too long: it is interrupted and the variables are kept. "
        "Host tools, llm_query, llm_query_batched and SUBMIT are global functions; their arguments "
        "and results cross to the host as JSON values."
    )

    def __init__(
        self,
        tools: dict[str, Callable[..., Any]] | None = None,
        output_fields: list[dict[str, Any]] | None = None,
        *,
        exec_timeout: float = _EXEC_TIMEOUT,
        sandbox: str = D.sandbox,
        sandbox_options: dict[str, Any] | None = None,
        max_output_chars: int = D.max_output_chars,
    ) -> None:
        given = {"exec_timeout": exec_timeout, "sandbox": sandbox, "max_output_chars": max_output_chars}
        for name, value in given.items():
            RLMConfig.check_one(name, value, _SPELLING)  # as RLM(...) checks it, named as given here
        self.tools: dict[str, Callable[..., Any]] = dict(tools or {})
        self.output_fields = output_fields
        self.exec_timeout = float(exec_timeout)
        self._kind = sandbox
        self._options = {"max_output_chars": max_output_chars, **(sandbox_options or {})}
        self.isolation: dict[str, Any] = {}  # what the worker enforces, once started (kept after shutdown)
        self._sandbox: Sandbox | None = None
        self._private: PrivateLoop | None = None  # the loop the sandbox lives on (recursa/sync.py)
        self._ended = False
        self._busy = threading.Lock()
        self._defined: dict[str, Any] = {}  # host tools set up in the worker, by name
        self._submit_names: tuple[str, ...] | bool | None = False  # False: SUBMIT not defined yet
        self._sent: dict[str, Any] = {}  # variables already in the REPL
        self._caller = contextvars.copy_context()  # the DSPy settings tools run under

    @classmethod
    def factory(cls, **options: Any) -> InterpreterFactory:
        """A zero-argument factory for `dspy.RLM(interpreter_factory=...)`; `options` as for the class."""
        cls(**options)._ended = True  # checks the options now rather than inside a run
        return InterpreterFactory(cls, options)

    # -- the CodeInterpreter protocol ----------------------------------------------------------

    def start(self) -> None:
        if self._ended:
            raise CodeInterpreterError("this RecursaInterpreter was shut down; create a new one")
        if self._sandbox is not None:
            return
        self._private = PrivateLoop("recursa-dspy")
        sandbox = make_sandbox(self._kind, **self._options)
        try:
            self._run(sandbox.start(self._serve))
        except (SandboxError, OSError) as exc:
            self._run(sandbox.close())
            self._stop_loop()
            self._ended = True
            raise CodeInterpreterError(f"the recursa sandbox did not start: {exc}") from None
        self._sandbox = sandbox
        self.isolation = dict(sandbox.isolation)

    def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        if not isinstance(code, str):
            raise CodeInterpreterError("code must be a str")
        if not self._busy.acquire(blocking=False):
            raise CodeInterpreterError("this RecursaInterpreter is already running a step")
        try:
            self.start()
            self._caller = contextvars.copy_context()
            self._define()
            self._inject(variables or {})
            assert self._sandbox is not None
            result = self._run(self._sandbox.execute(code, self.exec_timeout))
            return self._outcome(result)
        finally:
            self._busy.release()

    def shutdown(self) -> None:
        if self._ended and self._private is None:
            return
        self._ended = True
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None and self._private is not None:
            self._run(sandbox.close())
        self._stop_loop()

    def __call__(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        return self.execute(code, variables)

    def __enter__(self) -> RecursaInterpreter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- inside -----------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._private is not None
        return self._private.run(coro)

    def _stop_loop(self) -> None:
        private, self._private = self._private, None
        if private is not None:
            private.stop()

    def _define(self) -> None:
        """Set up in the worker the tools it does not have yet, and SUBMIT for the output fields."""
        entries: list[dict[str, Any]] = []
        for name, tool in self.tools.items():
            if name in _DSPY_LLM_TOOLS or self._defined.get(name) is tool:
                continue
            if (
                not isinstance(name, str)
                or not name.isidentifier()
                or keyword.iskeyword(name)
                or name in _RESERVED
            ):
                raise CodeInterpreterError(f"tool name {name!r} is not a usable Python name")
            entries.append(
                {"name": name, "kind": "host", "signature": _signature(tool), "doc": tool.__doc__ or ""}
            )
            self._defined[name] = tool
        names = tuple(str(f["name"]) for f in self.output_fields) if self.output_fields is not None else None
        if names != self._submit_names:
            entries.append({"name": "SUBMIT", "kind": "source", "source": _SUBMIT_SOURCE.format(names=names)})
            self._submit_names = names
        if entries:
            assert self._sandbox is not None
            errors = self._run(self._sandbox.define(entries))
            if errors:
                raise CodeInterpreterError("; ".join(errors))

    def _inject(self, variables: dict[str, Any]) -> None:
        """Put the step's input variables in the REPL; only new or changed ones cross again.

        They are set as the worker's engine-kept values: code that overwrites one finds it back at
        the next step, as DSPy passes the inputs again at every step (and `context` is one of the
        worker's own names, which a plain assignment would not keep).
        """
        fresh = {k: v for k, v in variables.items() if k not in self._sent or not _same(self._sent[k], v)}
        if not fresh:
            return
        bad = [
            k
            for k in fresh
            if not isinstance(k, str) or not k.isidentifier() or k in _RESERVED or k in self.tools
        ]
        if bad:
            raise CodeInterpreterError(
                f"variable names must be Python names other than tools and SUBMIT: {bad}"
            )
        try:
            json.dumps(fresh, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CodeInterpreterError(
                f"variables must be JSON values (str, numbers, lists, dicts): {exc}"
            ) from None
        assert self._sandbox is not None
        errors = self._run(
            self._sandbox.define([{"name": k, "kind": "value", "value": v} for k, v in fresh.items()])
        )
        if errors:
            raise CodeInterpreterError(f"could not put the variables in the REPL: {'; '.join(errors)}")
        self._sent.update(fresh)

    def _outcome(self, result: ExecResult) -> Any:
        if result.final is not None:
            return FinalOutput(result.final.value)
        notes = "\n".join(f"[{note}]" for note in result.notes)
        if result.restarted and not result.restored:
            # The REPL had to start over and its variables are gone: DSPy's protocol makes this terminal.
            self.shutdown()
            raise CodeInterpreterError(f"the REPL process was lost with its state. {notes}")
        output = "\n".join(
            part for part in (result.stdout.rstrip("\n"), result.stderr.rstrip("\n"), notes) if part
        )
        if result.error is not None:
            last = result.error.strip().splitlines()[-1] if result.error.strip() else ""
            if last.startswith(("SyntaxError", "IndentationError")) and "Traceback" not in result.error:
                raise SyntaxError(result.error)
            raise CodeExecutionError(output or result.error)
        return output or None

    async def _serve(self, fn: str, args: dict[str, Any]) -> Any:
        """A call from the REPL, answered by one of DSPy's tools in the caller's DSPy context."""
        if fn == "tool":
            name, call_args, call_kwargs = (
                str(args.get("name")),
                args.get("args") or [],
                args.get("kwargs") or {},
            )
        elif fn in _DSPY_LLM_TOOLS:
            if args.get("model") is not None:
                raise CallbackError(
                    "SubcallError", f"{fn}(model=...) is not supported here: DSPy's sub_lm answers"
                )
            name, call_args, call_kwargs = fn, [args.get("prompt" if fn == "llm_query" else "prompts")], {}
        else:
            raise CallbackError(
                "SubcallError", f"{fn} is not available under dspy.RLM; use llm_query or a dspy sub-agent"
            )
        tool = self.tools.get(name)
        if tool is None:
            raise CallbackError("ToolError", f"no tool named {name!r} is registered")
        try:
            kwargs = _as_keywords(tool, call_args, call_kwargs)
            context = self._caller.copy()  # one copy per call: a Context is entered by one thread at a time
            loop = asyncio.get_running_loop()
            value = await loop.run_in_executor(None, context.run, functools.partial(tool, **kwargs))
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            kind = "SubcallError" if name in _DSPY_LLM_TOOLS else "ToolError"
            # DSPy's LM and tools hold their own keys (the environment's, as a rule): their
            # messages are scrubbed before the REPL's code sees them.
            raise CallbackError(kind, redact(f"{name}: {type(exc).__name__}: {exc}")) from None
        return value


class InterpreterFactory:
    """What `RecursaInterpreter.factory(...)` returns: makes interpreters for `dspy.RLM`, and keeps
    the last one it made (`last`), so its `isolation` can be read after DSPy has shut it down."""

    def __init__(self, cls: type[RecursaInterpreter], options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = options
        self.execution_instructions = cls.execution_instructions
        self.last: RecursaInterpreter | None = None

    def __call__(self) -> RecursaInterpreter:
        self.last = self._cls(**self._options)
        return self.last


def _signature(tool: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(tool))
    except (TypeError, ValueError):
        return "(...)"


def _as_keywords(tool: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """DSPy's tools take keyword arguments; code may pass them by position too."""
    if not args:
        return dict(kwargs)
    try:
        bound = inspect.signature(tool).bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"arguments do not fit the tool's signature: {exc}") from None
    return dict(bound.arguments)


def _same(old: Any, new: Any) -> bool:
    try:
        return old is new or bool(old == new)
    except Exception:
        return False
