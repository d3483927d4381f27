"""Calling host tools: argument binding, per-call deadlines, per-tree call caps, JSON-safe results.

One runner per call tree serves both the REPL's host tools and the sub-models' tools, so their
limits (`max_calls`, `max_concurrency`) hold across every run of the tree. A tool failure never
crashes a run: it comes back as a `ToolFailure` whose message is meant for the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recursa.tools.spec import Tool
from recursa.trace.redact import Redactor

# A tool result larger than this is refused: it would flood the REPL channel or a sub-model's window.
MAX_RESULT_CHARS = 4_000_000


class ToolFailure(Exception):
    """A tool call that did not produce a usable result; the message says why and what to do."""


@dataclass
class _ToolState:
    calls: int = 0
    slots: asyncio.Semaphore | None = None


@dataclass
class ToolRunner:
    tools: dict[str, Tool]
    # What a tool's exception says goes to the REPL, a sub-model and the trace: keys scrubbed first.
    redact: Redactor = field(default_factory=Redactor)
    _state: dict[str, _ToolState] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: list[Tool], redact: Redactor | None = None) -> ToolRunner:
        runner = cls({t.name: t for t in tools}, redact or Redactor())
        for tool in tools:
            limit = tool.options.max_concurrency
            runner._state[tool.name] = _ToolState(slots=asyncio.Semaphore(limit) if limit else None)
        return runner

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    async def call(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Run tool `name` in the host and return a JSON-safe result, or raise ToolFailure."""
        tool = self.tools.get(name)
        if tool is None:
            raise ToolFailure(
                f"there is no host tool named {name!r} (tools: {', '.join(self.tools) or 'none'})."
            )
        try:
            bound = inspect.signature(tool.fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise ToolFailure(self.redact(f"{name}{tool.signature}: {exc}")) from None
        state = self._state[name]
        if tool.options.max_calls is not None and state.calls >= tool.options.max_calls:
            raise ToolFailure(
                f"{name} may be called at most {tool.options.max_calls} times in this run, and that is used "
                "up; work with the results you already have."
            )
        state.calls += 1
        if state.slots is None:
            value = await self._invoke(tool, bound)
        else:
            async with state.slots:
                value = await self._invoke(tool, bound)
        return _json_safe(name, value)

    async def _invoke(self, tool: Tool, bound: inspect.BoundArguments) -> Any:
        timeout = tool.options.timeout
        if tool.is_async:
            work = tool.fn(*bound.args, **bound.kwargs)
        else:
            work = _in_daemon_thread(functools.partial(tool.fn, *bound.args, **bound.kwargs))
        try:
            async with asyncio.timeout(timeout):
                return await work
        except TimeoutError:
            raise ToolFailure(
                f"{tool.name} did not return within {timeout:g} s and was abandoned; try a smaller request."
            ) from None
        except asyncio.CancelledError:
            raise
        except ToolFailure as exc:  # the tool's own account of what went wrong (MCP tools give one)
            raise ToolFailure(self.redact(str(exc))) from None
        except Exception as exc:
            raise ToolFailure(self.redact(f"{tool.name} raised {type(exc).__name__}: {exc}")) from None


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """Run a sync tool off the event loop in its own daemon thread.

    Not the loop's default executor: a thread cannot be killed, and `asyncio.run` waits for that
    executor's threads at exit, so one hung tool would hold `run()` open long after its timeout.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    def work() -> None:
        try:
            value, error = context.run(fn), None
        except BaseException as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed while the tool ran: nobody waits
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name="recursa-host-tool", daemon=True).start()
    return future


def _json_safe(name: str, value: Any) -> Any:
    """`value` itself once it is known to encode as JSON (the channel encodes it the same way)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ToolFailure(
            f"{name} returned a {type(value).__name__} that cannot be sent to the REPL ({exc}); tools must "
            "return JSON values: str, int, float, bool, None, lists and dicts with str keys."
        ) from None
    if len(text) > MAX_RESULT_CHARS:
        raise ToolFailure(
            f"{name} returned {len(text):,} characters, over the {MAX_RESULT_CHARS:,} limit; ask for less."
        )
    return value


def result_text(value: Any) -> str:
    """A tool result as the text a sub-model reads."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
