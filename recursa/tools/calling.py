"""A sub-model call with function calling: the model asks for tools, the host runs them, the model
answers. Only the final text goes back to the REPL; tool output never reaches the root's window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.lm.base import LMResponse, Message, ToolCall
from recursa.tools.runner import ToolFailure, ToolRunner, result_text
from recursa.tools.spec import Tool
from recursa.trace.writer import TraceWriter, fold

# One model call: (messages, tools offered or None) -> response. The caller binds model, meta, budget.
ModelCall = Callable[[list[Message], list[dict[str, Any]] | None], Awaitable[LMResponse]]

# Each tool result a sub-model reads is cut here, so one huge page cannot overflow its window.
TOOL_RESULT_CHARS = 50_000

LAST_ROUND_NOTE = (
    "You have used all your tool calls for this request. Answer now from what you have, without tools."
)


async def call_with_tools(
    call: ModelCall,
    prompt: str | list[dict[str, Any]],  # text, or content parts with images (lm/images.py)
    tools: list[Tool],
    runner: ToolRunner,
    *,
    rounds: int,
    trace: TraceWriter,
    run_id: str,
) -> str:
    """Up to `rounds` model turns that may call tools, then one last turn that may not."""
    offered = [t.to_function() for t in tools]
    messages: list[Message] = [{"role": "user", "content": prompt}]
    for _ in range(rounds):
        response = await call(messages, offered)
        if not response.tool_calls:
            return response.text
        messages.append(
            {"role": "assistant", "content": response.text, "tool_calls": _wire(response.tool_calls)}
        )
        results = await asyncio.gather(*(_run_one(c, runner, trace, run_id) for c in response.tool_calls))
        messages += [
            {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": text}
            for c, text in zip(response.tool_calls, results, strict=True)
        ]
    messages.append({"role": "user", "content": LAST_ROUND_NOTE})
    return (await call(messages, None)).text


def _wire(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


async def _run_one(call: ToolCall, runner: ToolRunner, trace: TraceWriter, run_id: str) -> str:
    """The text the model reads for one call: the result, or what went wrong and how to fix it."""
    started = time.perf_counter()
    error = call.error
    text = ""
    if error is None:
        try:
            text = result_text(await runner.call(call.name, [], call.arguments))
        except ToolFailure as exc:
            error = str(exc)
    if error is not None:
        text = f"Error: {error}"
    elif len(text) > TOOL_RESULT_CHARS:
        text = text[:TOOL_RESULT_CHARS] + f"\n[... {len(text) - TOOL_RESULT_CHARS:,} more characters cut]"
    trace.emit(
        "tool_call",
        run_id=run_id,
        tool=call.name,
        where="host",
        caller="sub-model",
        arguments=fold(str(call.arguments), 2_000),
        result=fold(text, 2_000),
        duration_s=round(time.perf_counter() - started, 6),
        error=error,
    )
    return text
