"""`POST /v1/messages`: Anthropic's Messages API, answered by the same runs as Chat Completions.

The request is parsed by recursa.serve.messages_request, run by recursa.serve.chat's RunService
(admission, sessions, cancellation), and answered here in the Messages shape: a `message` object,
or its SSE stream: message_start, then (with `thinking`) a thinking block whose text is the run's
steps as they happen, then the answer as a text block (content_block_start, content_block_delta
text_delta..., content_block_stop) or, for a forced tool, a tool_use block (its input's JSON in
input_json_delta pieces), message_delta (stop_reason, usage) and message_stop; `ping`
events keep an idle stream open, and a run that fails ends the stream with an `error` event.
Errors before the stream are Anthropic's error objects (recursa.serve.api_error).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.responses import Response

from recursa.result import RLMResult
from recursa.serve.api_error import ApiError, anthropic_type
from recursa.serve.bodies import JSONBody, sse_event
from recursa.serve.chat import SESSION_HEADER, Emit, RunService, SSERun, finish_reason, pieces, run_summary
from recursa.serve.messages_request import MessagesRequest, parse_messages_request
from recursa.serve.messages_tools import new_tool_use_id, tool_input, tool_use_block
from recursa.serve.observe import RUN_STATE_KEY
from recursa.serve.request import Caller
from recursa.serve.runs import LiveRun
from recursa.serve.steps import all_steps

PING = sse_event({"type": "ping"}, "ping")
# Why POST /v1/messages/count_tokens is a 404 here (docs/serving.md says the same).
NO_TOKEN_COUNT = (
    "this server does not count tokens: a run's usage is the sum of every model call it makes (the "
    "root model's turns, its sub-calls and child runs), which only the run decides, and the messages "
    "never enter one model's window whole, so no count made before the run would be true. Each "
    "message's `usage` gives what its run used; to bound it, send recursa.max_tokens or max_usd "
    '(extra_body={"recursa": {...}})'
)


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


async def create_message(service: RunService, request: Request, caller: Caller, body: Any) -> Response:
    call = parse_messages_request(body, service.settings)
    req = call.req
    req.caller = caller
    run = await service.prepare(req)
    setattr(request.state, RUN_STATE_KEY, run)  # the access log names its run
    if req.stream:
        return MessagesSSE(service, call, run)
    result = await service.outcome(run, request.receive)
    steps = all_steps(run.events_so_far()) if call.thinking else None
    headers = {SESSION_HEADER: req.session} if req.session else None
    return JSONBody(message_body(call, new_message_id(), result, steps), headers=headers)


def usage_object(result: RLMResult) -> dict[str, Any]:
    """The whole call tree's usage, counted as Anthropic counts: `input_tokens` without the tokens
    read from a prompt cache, which are `cache_read_input_tokens` (recursa's input count has both)."""
    u = result.usage
    return {
        "input_tokens": max(0, u.input_tokens - u.cached_tokens),
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": u.cached_tokens,
    }


@dataclass
class Answer:
    """The answer as the client gets it: its text (for a tool, the input's JSON), how it stopped."""

    text: str
    stop_reason: str
    stop_sequence: str | None = None
    tool_input: dict[str, Any] | None = None  # a forced tool's input: the answer is a tool_use block


def final_answer(call: MessagesRequest, result: RLMResult) -> Answer:
    shape = call.req.shape
    stop = shape.first_stop(result.answer)
    text, cut = shape.cut(result.answer)
    # An answer that is not a JSON object (cut short, or never fitting the schema) cannot be a
    # tool's input: it comes back as text, with the stop_reason that says why.
    value = tool_input(text) if shape.kind == "tool" else None
    # Out of budget or time (or out of turns without an answer the schema takes) is the RLM's
    # version of running out of output tokens, as finish_reason "length" in Chat Completions.
    if finish_reason(result, cut, shape) == "length":
        return Answer(text, "max_tokens", None, value)
    if stop is not None:
        return Answer(text, "stop_sequence", stop[1], value)
    return Answer(text, "end_turn" if value is None else "tool_use", None, value)


def thinking_block(steps: str) -> dict[str, Any]:
    # The steps are recursa's own account of the run, not a model's signed reasoning: no signature.
    return {"type": "thinking", "thinking": steps, "signature": ""}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def message_object(
    call: MessagesRequest, message_id: str, content: list[dict[str, Any]], **fields: Any
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": call.req.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
        **fields,
    }


def message_body(
    call: MessagesRequest, message_id: str, result: RLMResult, steps: str | None
) -> dict[str, Any]:
    """The whole `message` object of a run that ended (the non-streaming answer)."""
    answer = final_answer(call, result)
    content = [thinking_block(steps)] if steps is not None else []
    if answer.tool_input is not None:
        content.append(tool_use_block(new_tool_use_id(), call.req.shape.tool_name, answer.tool_input))
    else:
        content.append(text_block(answer.text))
    return message_object(
        call,
        message_id,
        content,
        stop_reason=answer.stop_reason,
        stop_sequence=answer.stop_sequence,
        usage=usage_object(result),
        recursa=run_summary(result, call.req.session),
    )


class MessagesSSE(SSERun):
    """One run streamed as Messages API events (the run's life is SSERun's)."""

    keep_alive = PING

    def __init__(self, service: RunService, call: MessagesRequest, run: LiveRun) -> None:
        super().__init__(service, call.req, run)
        self.call = call
        self.id = new_message_id()
        self.blocks = 0  # content blocks opened so far: the next one's index
        self.thinking_open = False

    async def opening(self, emit: Emit) -> None:
        message = message_object(self.call, self.id, [])
        await emit(sse_event({"type": "message_start", "message": message}, "message_start"))

    async def _start_block(self, emit: Emit, block: dict[str, Any]) -> None:
        event = {"type": "content_block_start", "index": self.blocks, "content_block": block}
        await emit(sse_event(event, "content_block_start"))

    async def _delta(self, emit: Emit, delta: dict[str, Any]) -> None:
        event = {"type": "content_block_delta", "index": self.blocks, "delta": delta}
        await emit(sse_event(event, "content_block_delta"))

    async def _stop_block(self, emit: Emit) -> None:
        await emit(sse_event({"type": "content_block_stop", "index": self.blocks}, "content_block_stop"))
        self.blocks += 1

    async def steps(self, emit: Emit, text: str) -> None:
        if not self.call.thinking:
            await self.beat_if_quiet(emit)  # steps are shown only when thinking is asked for
            return
        if not self.thinking_open:
            self.thinking_open = True
            await self._start_block(emit, thinking_block(""))
        await self._delta(emit, {"type": "thinking_delta", "thinking": text})

    async def _close_thinking(self, emit: Emit) -> None:
        if self.thinking_open:
            self.thinking_open = False
            await self._stop_block(emit)

    async def answer(self, emit: Emit, result: RLMResult) -> None:
        await self._close_thinking(emit)
        answer = final_answer(self.call, result)
        if answer.tool_input is not None:
            # As Anthropic streams a tool call: the block with an empty input, then the input's JSON.
            await self._start_block(emit, tool_use_block(new_tool_use_id(), self.req.shape.tool_name, {}))
            for piece in pieces(answer.text):
                await self._delta(emit, {"type": "input_json_delta", "partial_json": piece})
        else:
            await self._start_block(emit, text_block(""))
            for piece in pieces(answer.text):
                await self._delta(emit, {"type": "text_delta", "text": piece})
        await self._stop_block(emit)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": answer.stop_reason, "stop_sequence": answer.stop_sequence},
            "usage": usage_object(result),
            "recursa": run_summary(result, self.req.session),
        }
        await emit(sse_event(delta, "message_delta"))
        await emit(sse_event({"type": "message_stop"}, "message_stop"))

    async def _error(self, emit: Emit, message: str, kind: str, code: str | None) -> None:
        await self._close_thinking(emit)
        # The run's failure (a 502 before the stream began) or its session closed under it (409).
        status = 409 if code == "session_closed" else 400 if kind == "invalid_request_error" else 502
        error = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
        await emit(sse_event(error, "error"))

    async def closing(self, emit: Emit) -> None:
        return  # the Messages API ends a stream with message_stop (or error), without a [DONE] line


def no_token_count() -> ApiError:
    return ApiError(404, NO_TOKEN_COUNT, code="token_counting_not_supported")
