"""The Responses API's wire format for one RLM run: the `response` object (JSON) and its SSE event
stream. The run itself is the Chat Completions one (recursa.serve.chat: admission, cancellation,
steps, result); only what goes over the wire differs.

A stream is: response.created, response.in_progress, then (with `reasoning.summary`) a reasoning
item whose summary text is the run's steps as they happen, then the answer as a message item
(output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done) or as a function_call item when a function was forced, and last
response.completed (response.incomplete when a length or budget cap cut the answer; response.failed
when the run failed). Every event has its `sequence_number`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from recursa.result import RLMResult
from recursa.serve.bodies import sse_event
from recursa.serve.chat import (
    Emit,
    RunService,
    SSERun,
    finish_reason,
    pieces,
    run_summary,
    shaped_answer,
)
from recursa.serve.fields import AnswerShape
from recursa.serve.responses_request import ResponsesRequest
from recursa.serve.runs import LiveRun


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_object(result: RLMResult) -> dict[str, Any]:
    u = result.usage
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.input_tokens + u.output_tokens,
        "cost": round(u.cost_usd, 10),  # US dollars for the whole call tree, as in Chat Completions
    }


def response_object(
    response_id: str,
    call: ResponsesRequest,
    created_at: int,
    *,
    status: str = "in_progress",
    output: list[dict[str, Any]] | None = None,
    result: RLMResult | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": call.req.model,
        "output": output or [],
        **call.echo,
        "usage": None,
    }
    if result is not None:
        body["completed_at"] = int(time.time())
        body["usage"] = usage_object(result)
        body["recursa"] = run_summary(result, call.req.session)
    return body


def final_status(result: RLMResult, cut: bool, shape: AnswerShape) -> str:
    # Out of budget or time is the RLM's version of running out of output tokens (as in Chat Completions).
    return "incomplete" if finish_reason(result, cut, shape) == "length" else "completed"


def reasoning_item(item_id: str, steps: str, status: str = "completed") -> dict[str, Any]:
    summary = [{"type": "summary_text", "text": steps}] if steps else []
    return {"type": "reasoning", "id": item_id, "summary": summary, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_body(
    call: ResponsesRequest, response_id: str, result: RLMResult, steps: str | None
) -> dict[str, Any]:
    """The whole `response` object of a run that ended (the non-streaming answer)."""
    shape = call.req.shape
    answer, cut = shaped_answer(result, shape)
    output: list[dict[str, Any]] = []
    if steps is not None:
        output.append(reasoning_item(new_id("rs"), steps))
    if shape.kind == "tool":
        assert shape.tool_name is not None
        output.append(function_item(new_id("fc"), new_id("call"), shape.tool_name, answer))
    else:
        output.append(message_item(new_id("msg"), answer))
    status = final_status(result, cut, shape)
    return response_object(response_id, call, int(time.time()), status=status, output=output, result=result)


class ResponsesSSE(SSERun):
    """One run streamed as Responses API events (the run's life is SSERun's)."""

    def __init__(self, service: RunService, call: ResponsesRequest, run: LiveRun, response_id: str) -> None:
        super().__init__(service, call.req, run)
        self.call = call
        self.id = response_id
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items, in output_index order
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item, while steps arrive
        self.steps_text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(body, kind)

    def _response(self, **kwargs: Any) -> dict[str, Any]:
        return response_object(self.id, self.call, self.created, **kwargs)

    async def opening(self, emit: Emit) -> None:
        await emit(self._event("response.created", response=self._response()))
        await emit(self._event("response.in_progress", response=self._response()))

    async def steps(self, emit: Emit, text: str) -> None:
        if not self.call.summary:
            # As with OpenAI's reasoning models, steps are shown only when a summary is asked for.
            await self.beat_if_quiet(emit)
            return
        at = len(self.output)
        if self.reasoning is None:
            self.reasoning = reasoning_item(new_id("rs"), "", status="in_progress")
            await emit(self._event("response.output_item.added", output_index=at, item=self.reasoning))
            part = {"type": "summary_text", "text": ""}
            await emit(self._summary_event("response.reasoning_summary_part.added", part=part))
        self.steps_text.append(text)
        await emit(self._summary_event("response.reasoning_summary_text.delta", delta=text))

    def _summary_event(self, kind: str, **fields: Any) -> bytes:
        assert self.reasoning is not None
        where = {"item_id": self.reasoning["id"], "output_index": len(self.output), "summary_index": 0}
        return self._event(kind, **where, **fields)

    async def _close_reasoning(self, emit: Emit) -> None:
        if self.reasoning is None:
            return
        text = "".join(self.steps_text)
        await emit(self._summary_event("response.reasoning_summary_text.done", text=text))
        part = {"type": "summary_text", "text": text}
        await emit(self._summary_event("response.reasoning_summary_part.done", part=part))
        item = reasoning_item(self.reasoning["id"], text)
        await emit(self._event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.reasoning = None

    async def answer(self, emit: Emit, result: RLMResult) -> None:
        await self._close_reasoning(emit)
        shape = self.req.shape
        answer, cut = shaped_answer(result, shape)
        at = len(self.output)
        if shape.kind == "tool":
            assert shape.tool_name is not None
            item = function_item(new_id("fc"), new_id("call"), shape.tool_name, "", status="in_progress")
            await emit(self._event("response.output_item.added", output_index=at, item=item))
            where = {"item_id": item["id"], "output_index": at}
            for piece in pieces(answer):
                await emit(self._event("response.function_call_arguments.delta", **where, delta=piece))
            await emit(self._event("response.function_call_arguments.done", **where, arguments=answer))
            item = {**item, "arguments": answer, "status": "completed"}
        else:
            item = message_item(new_id("msg"), None, status="in_progress")
            await emit(self._event("response.output_item.added", output_index=at, item=item))
            where = {"item_id": item["id"], "output_index": at, "content_index": 0}
            await emit(self._event("response.content_part.added", **where, part=output_text("")))
            for piece in pieces(answer):
                await emit(self._event("response.output_text.delta", **where, delta=piece, logprobs=[]))
            await emit(self._event("response.output_text.done", **where, text=answer, logprobs=[]))
            await emit(self._event("response.content_part.done", **where, part=output_text(answer)))
            item = message_item(item["id"], answer)
        await emit(self._event("response.output_item.done", output_index=at, item=item))
        self.output.append(item)
        status = final_status(result, cut, shape)
        final = self._response(status=status, output=self.output, result=result)
        await emit(self._event(f"response.{status}", response=final))

    async def _error(self, emit: Emit, message: str, kind: str, code: str | None) -> None:
        await self._close_reasoning(emit)
        error = {"code": code or kind, "message": message, "type": kind}
        await emit(
            self._event(
                "response.failed", response=self._response(status="failed", output=self.output, error=error)
            )
        )

    async def closing(self, emit: Emit) -> None:
        return  # the Responses API ends a stream with its last event, without a [DONE] line
