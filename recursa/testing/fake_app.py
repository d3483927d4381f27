"""The HTTP side of the fake model server: OpenAI and Anthropic endpoints over one latency model.

`fake_server.FakeServer` owns the configuration and the thread; this module owns what happens to one
request: authentication, parsing, the fault plan, the context limit, the queue of concurrency slots,
the reply and its token accounting, and the response in either API's JSON (or SSE) shape.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from recursa.lm.tokens import count_message_tokens, count_tokens, tokens_for_chars
from recursa.testing.asgi_responses import Dropped, SlotStream, one_part
from recursa.testing.fake_images import IMAGE_TOKENS, images_of
from recursa.testing.fake_state import Fault, RequestRecord, UnknownModelError, key_digest, resolve_fault
from recursa.testing.host import FakeHost
from recursa.testing.metrics import render_metrics
from recursa.testing.tool_replies import (
    ToolCallReply,
    anthropic_content,
    offered_tools,
    openai_message,
    reply_text,
    set_offered,
    tool_messages,
)

Api = Literal["openai", "anthropic"]
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"
_PIECE_CHARS = 16
_STEP_TOKENS = 16  # characters per streamed delta: about 4 tokens, like a real decoder's small bursts
_SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})


class _BadRequest(ValueError):
    pass


# (OpenAI error type, OpenAI error code, Anthropic error type) per status.
_KINDS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "invalid_request_error"),
    401: ("invalid_request_error", "invalid_api_key", "authentication_error"),
    404: ("invalid_request_error", "model_not_found", "not_found_error"),
    429: ("requests", "rate_limit_exceeded", "rate_limit_error"),
    500: ("server_error", None, "api_error"),
    503: ("server_error", None, "overloaded_error"),
    529: ("server_error", None, "overloaded_error"),
}


def _error(
    api: Api, status: int, message: str, *, code: str | None = None, retry_after_s: float | None = None
) -> JSONResponse:
    oa_type, oa_code, an_type = _KINDS.get(status, _KINDS[500] if status >= 500 else _KINDS[400])
    if api == "openai":
        body: dict[str, Any] = {
            "error": {"message": message, "type": oa_type, "param": None, "code": code or oa_code}
        }
    else:
        body = {"type": "error", "error": {"type": an_type, "message": message}}
    headers = {}
    if retry_after_s is not None:
        # Both SDKs read retry-after-ms first; retry-after carries the same in (possibly fractional) seconds.
        headers = {"retry-after": f"{retry_after_s:g}", "retry-after-ms": str(round(retry_after_s * 1000))}
    return JSONResponse(body, status_code=status, headers=headers)


def _reject(rec: RequestRecord, response: JSONResponse, message: str) -> JSONResponse:
    rec.status = response.status_code
    rec.error = message
    rec.finished_at = time.perf_counter()
    rec.started_at = rec.started_at or rec.finished_at
    return response


def _text_of(content: Any) -> str:
    """Flattens a message content (string, or a list of text blocks/parts) to one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, dict) and block.get("type") == "tool_result":
                parts.append(_text_of(block.get("content")))
        # Joined without separators: a client that split one text into blocks (for cache markers)
        # must be billed and answered exactly as if it had sent the text whole.
        return "".join(parts)
    raise _BadRequest("message content must be a string or a list of text blocks")


def _parse(
    api: Api, body: Any
) -> tuple[str, list[dict[str, str]], bool, int | None, bool, list[int], list[str]]:
    """(model, flattened messages, stream, max output tokens, include usage in stream, indices of
    the flattened messages that carry an Anthropic `cache_control` mark, the images sent)."""
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    model = body.get("model")
    raw = body.get("messages")
    if not isinstance(model, str) or not model:
        raise _BadRequest("`model` is required")
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise _BadRequest("`messages` must be a list of message objects")
    messages: list[dict[str, str]] = []
    marks: list[int] = []
    if api == "anthropic" and body.get("system"):
        messages.append({"role": "system", "content": _text_of(body["system"])})
        if _marked(body["system"]):
            marks.append(0)
    images: list[str] = []
    for m in raw:
        messages += tool_messages(m, _text_of(m.get("content")))
        images += images_of(api, m.get("content"))
        if api == "anthropic" and _marked(m.get("content")):
            marks.append(len(messages) - 1)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    max_tokens = limit if isinstance(limit, int) and limit > 0 else None
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return model, messages, bool(body.get("stream")), max_tokens, include_usage, marks, images


def _marked(content: Any) -> bool:
    """Whether a system or message content carries a `cache_control` breakpoint on any block."""
    return isinstance(content, list) and any(
        isinstance(block, dict) and isinstance(block.get("cache_control"), dict) for block in content
    )


def _given_key(request: Request) -> str:
    bearer = request.headers.get("authorization", "")
    return bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")


def _authorised(request: Request, key: str) -> bool:
    return hmac.compare_digest(_given_key(request).encode(), key.encode())


def _safe_headers(request: Request) -> dict[str, str]:
    # Keys never reach a record: tests see that the header was sent, not its value.
    return {k: ("<redacted>" if k in _SECRET_HEADERS else v) for k, v in request.headers.items()}


def _openai_usage(rec: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "total_tokens": rec.prompt_tokens + rec.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": rec.cached_tokens},
    }


def _anthropic_usage(rec: RequestRecord) -> dict[str, int]:
    return {
        # Anthropic counts cache reads and writes apart from input_tokens.
        "input_tokens": rec.prompt_tokens - rec.cached_tokens - rec.cache_write_tokens,
        "output_tokens": rec.completion_tokens,
        "cache_read_input_tokens": rec.cached_tokens,
        "cache_creation_input_tokens": rec.cache_write_tokens,
    }


def _openai_body(rec: RequestRecord, cid: str, truncated: bool) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": rec.model,
        "system_fingerprint": "recursa-fake",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": rec.reply},
                "finish_reason": "length" if truncated else "stop",
                "logprobs": None,
            }
        ],
        "usage": _openai_usage(rec),
    }


def _anthropic_message(rec: RequestRecord, mid: str, content: list[Any], stop: str | None) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": rec.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": _anthropic_usage(rec),
    }


def _shaped(api: Api, rec: RequestRecord, body: dict[str, Any], fault: Fault | None) -> Response:
    """A JSON reply, or the broken form of it a body fault asks for."""
    kind = fault.kind if fault is not None else None
    if kind == "no_usage":
        body.pop("usage", None)
    elif kind == "no_choices":
        body["choices" if api == "openai" else "content"] = []
    if kind in ("no_usage", "no_choices"):
        rec.error = f"injected fault: {kind}"
    if fault is None or kind not in ("malformed", "cut"):
        return JSONResponse(body)
    raw = json.dumps(body).encode()
    if kind == "malformed":
        rec.error = "injected fault: malformed JSON body"
        return Response(raw[: len(raw) // 2], media_type="application/json")
    after = min(fault.after_bytes, len(raw) - 1)  # never the whole body: then nothing would be cut
    rec.error = f"injected fault: connection closed after {after} of {len(raw)} body bytes"
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    return Dropped(one_part(raw), headers=head, after_bytes=after)


def _context_message(api: Api, tokens: int, limit: int) -> str:
    if api == "openai":
        return (
            f"This model's maximum context length is {limit} tokens. However, your messages "
            f"resulted in {tokens} tokens. Please reduce the length of the messages."
        )
    return f"prompt is too long: {tokens} tokens > {limit} maximum"


async def _pause(server: FakeHost, seconds: float) -> None:
    # Virtual-clock servers never sleep: simulate() assigns the times afterwards.
    if seconds > 0 and not server.virtual:
        await asyncio.sleep(seconds)


async def _first_token(server: FakeHost, rec: RequestRecord) -> None:
    await _pause(server, server.profile.ttft(rec.prompt_tokens - rec.cached_tokens))
    rec.first_token_at = time.perf_counter()


async def _decode(server: FakeHost, reply: str) -> AsyncIterator[str]:
    """The reply in small pieces, each after the decode time of the tokens it completes."""
    profile = server.profile
    done = 0
    for start in range(0, len(reply), _PIECE_CHARS):
        end = min(start + _PIECE_CHARS, len(reply))
        tokens = tokens_for_chars(end)
        # Decode slows down with the number of requests holding a slot (batched decode).
        delay = (tokens - done) * profile.token_s(server.ledger.in_flight)
        done = tokens
        await _pause(server, delay)
        yield reply[start:end]


def _sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


async def _openai_stream(
    server: FakeHost, rec: RequestRecord, truncated: bool, include_usage: bool, calls: ToolCallReply | None
) -> AsyncIterator[bytes]:
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": rec.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if include_usage:
            payload["usage"] = None  # as OpenAI does: only the extra last chunk carries usage
        return _sse(payload)

    await _first_token(server, rec)
    yield chunk({"role": "assistant", "content": ""})
    async for piece in _decode(server, rec.reply if calls is None else calls.text):
        yield chunk({"content": piece})
    # Tool calls as vLLM and OpenAI stream them: the id and name first, then the arguments' JSON
    # in pieces, each delta naming its call by index.
    for index, (call_id, (name, args)) in enumerate(zip(calls.ids, calls.calls, strict=True) if calls else ()):
        head = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        yield chunk({"tool_calls": [head]})
        async for piece in _decode(server, json.dumps(args)):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    rec.finished_at = time.perf_counter()
    yield chunk({}, "length" if truncated else "stop" if calls is None else "tool_calls")
    if include_usage:
        last = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": rec.model}
        yield _sse({**last, "choices": [], "usage": _openai_usage(rec)})
    yield b"data: [DONE]\n\n"


async def _anthropic_stream(
    server: FakeHost, rec: RequestRecord, truncated: bool, calls: ToolCallReply | None
) -> AsyncIterator[bytes]:
    start = _anthropic_message(rec, f"msg_{uuid.uuid4().hex[:24]}", [], None)
    start["usage"] = {**start["usage"], "output_tokens": 0}
    await _first_token(server, rec)
    yield _sse({"type": "message_start", "message": start}, "message_start")
    text = rec.reply if calls is None else calls.text
    index = 0
    if text or calls is None:
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        yield _sse(block, "content_block_start")
        async for piece in _decode(server, text or ""):
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
            yield _sse(delta, "content_block_delta")
        yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        index = 1
    # Each tool_use block opens with an empty input; its JSON follows as input_json_delta pieces.
    for offset, (call_id, (name, args)) in enumerate(zip(calls.ids, calls.calls, strict=True) if calls else ()):
        at = index + offset
        use = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        yield _sse({"type": "content_block_start", "index": at, "content_block": use}, "content_block_start")
        async for piece in _decode(server, json.dumps(args)):
            delta = {"type": "content_block_delta", "index": at, "delta": {"type": "input_json_delta", "partial_json": piece}}
            yield _sse(delta, "content_block_delta")
        yield _sse({"type": "content_block_stop", "index": at}, "content_block_stop")
    rec.finished_at = time.perf_counter()
    stop = "max_tokens" if truncated else "end_turn" if calls is None else "tool_use"
    end = {"stop_reason": stop, "stop_sequence": None}
    yield _sse({"type": "message_delta", "delta": end, "usage": _anthropic_usage(rec)}, "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")


async def _reply(server: FakeHost, model: str, messages: list[dict[str, Any]]) -> str | ToolCallReply:
    out = server.responder(model, messages)
    if inspect.isawaitable(out):
        out = await out
    if not isinstance(out, str | ToolCallReply):
        raise TypeError(f"the responder returned {type(out).__name__}, expected str or ToolCallReply")
    return out


async def handle(server: FakeHost, request: Request, api: Api) -> Response:
    """One model request, start to finish; every outcome lands in the ledger."""
    rec = server.ledger.open(request.url.path, _safe_headers(request))
    given = _given_key(request)
    rec.key_digest = key_digest(given) if given else None
    try:
        return await _handle(server, request, api, rec)
    except Exception as exc:  # a responder bug must reach the test as a readable 500, not a hang
        message = f"fake server error: {type(exc).__name__}: {exc}"
        return _reject(rec, _error(api, 500, message), message)


async def _handle(server: FakeHost, request: Request, api: Api, rec: RequestRecord) -> Response:
    raw = await request.body()
    if server.api_key is not None and not _authorised(request, server.api_key):
        message = "Incorrect API key provided." if api == "openai" else "invalid x-api-key"
        return _reject(rec, _error(api, 401, message), message)
    try:
        body = json.loads(raw or b"null")
        model, messages, stream, max_tokens, include_usage, marks, images = _parse(api, body)
        set_offered(body)
    except ValueError as exc:  # also json.JSONDecodeError
        return _reject(rec, _error(api, 400, str(exc)), str(exc))
    rec.model, rec.messages, rec.stream, rec.max_tokens = model, messages, stream, max_tokens
    rec.tools = [t["name"] for t in offered_tools()]
    rec.tool_choice = body.get("tool_choice")
    rec.images = images
    rec.prompt_tokens = count_message_tokens(messages) + IMAGE_TOKENS * len(images)

    unknown = f"The model `{model}` does not exist or you do not have access to it."
    if not server.knows_model(model):
        return _reject(rec, _error(api, 404, unknown), unknown)
    fault = resolve_fault(server.faults, rec)
    if fault is not None:
        rec.fault = fault.kind
        if fault.delay_s > 0:  # for "hang" that is the whole fault: the request then goes on as usual
            await asyncio.sleep(fault.delay_s)
        if fault.kind == "http":
            message = fault.message or f"injected fault: HTTP {fault.status}"
            error = _error(api, fault.status, message, retry_after_s=fault.retry_after_s)
            return _reject(rec, error, message)
        if fault.kind == "context_length":
            shown = server.max_context_tokens or max(1, rec.prompt_tokens - 1)
            message = fault.message or _context_message(api, rec.prompt_tokens, shown)
            return _reject(rec, _error(api, 400, message, code="context_length_exceeded"), message)
        if fault.kind == "reset":
            rec.error = "injected fault: connection reset before the response"
            rec.started_at = rec.finished_at = time.perf_counter()
            return Dropped(None)
    limit = server.max_context_tokens
    if limit is not None and rec.prompt_tokens > limit:
        message = _context_message(api, rec.prompt_tokens, limit)
        return _reject(rec, _error(api, 400, message, code="context_length_exceeded"), message)
    gate = server.gate
    if server.clock is not None:
        rec.virtual_arrival = server.clock.now()
        full = server.virtual_queue_full(rec.virtual_arrival)
    else:
        full = server.max_queue is not None and not gate.can_enter_now() and gate.waiting >= server.max_queue
    if full:
        message = "Rate limit reached: the request queue is full. Please retry later."
        return _reject(rec, _error(api, 429, message, retry_after_s=server.retry_after_s), message)
    if api == "anthropic":  # Anthropic caches only what the request marks, and bills writes
        rec.cached_tokens, rec.cache_write_tokens = server.marked_cache.lookup_and_store(messages, marks)
    else:  # OpenAI and vLLM-style servers cache every prefix on their own
        rec.cached_tokens, _ = server.cache.lookup_and_store(messages)

    if not server.virtual:  # in virtual time the simulation owns queueing
        await gate.acquire()
    rec.started_at = time.perf_counter()
    server.ledger.enter()
    released = handed_off = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            server.ledger.leave()
            if not server.virtual:
                gate.release()
            rec.finished_at = rec.finished_at or time.perf_counter()

    try:
        try:
            # A copy: a responder that edits its messages must not rewrite the ledger.
            reply = await _reply(server, model, [dict(m) for m in messages])
        except UnknownModelError:
            return _reject(rec, _error(api, 404, unknown), unknown)
        calls = reply if isinstance(reply, ToolCallReply) else None
        if calls is not None:
            reply = reply_text(calls)
        truncated = max_tokens is not None and count_tokens(reply) > max_tokens
        if truncated:
            reply = reply[: max_tokens * 4]  # type: ignore[operator]  # 4 chars/token: exactly max_tokens
        rec.reply, rec.completion_tokens, rec.status = reply, count_tokens(reply), 200
        server.cache.store_generated(messages, reply)
        rec.cost_usd = server.profile.cost(
            rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens, rec.cache_write_tokens
        )
        if stream:
            if fault is not None and fault.kind == "no_usage":
                include_usage = False
            if api == "openai":
                body = _openai_stream(server, rec, truncated, include_usage, calls)
            else:
                body = _anthropic_stream(server, rec, truncated, calls)
            response: Response
            if fault is not None and fault.kind == "cut":
                rec.error = f"injected fault: stream closed after {fault.after_bytes} bytes"
                head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
                response = Dropped(body, headers=head, after_bytes=fault.after_bytes, release=release)
            else:
                response = SlotStream(body, release)
            handed_off = True  # the stream owns the slot now and gives it back when it ends
            return response
        await _first_token(server, rec)
        profile = server.profile
        if profile.contention == 0:
            await _pause(server, rec.completion_tokens * profile.per_token_s)
        else:  # decode in 16-token steps, each priced at the slot holders of that moment
            for left in range(rec.completion_tokens, 0, -_STEP_TOKENS):
                await _pause(server, min(left, _STEP_TOKENS) * profile.token_s(server.ledger.in_flight))
        rec.finished_at = time.perf_counter()
        if api == "openai":
            data = _openai_body(rec, f"chatcmpl-{uuid.uuid4().hex[:24]}", truncated)
            if calls is not None:
                data["choices"][0].update(message=openai_message(calls), finish_reason="tool_calls")
        else:
            content = [{"type": "text", "text": reply}] if calls is None else anthropic_content(calls)
            stop = "max_tokens" if truncated else "end_turn" if calls is None else "tool_use"
            data = _anthropic_message(rec, f"msg_{uuid.uuid4().hex[:24]}", content, stop)
        return _shaped(api, rec, data, fault)
    finally:
        if not handed_off:
            release()


def _models_body(server: FakeHost) -> dict[str, Any]:
    # One listing both SDKs can read: OpenAI's {object, data[id, object, owned_by]} and
    # Anthropic's {data[type, id, display_name, created_at], has_more, first_id, last_id}.
    names = server.model_names()
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "recursa-fake",
            "type": "model",
            "display_name": name,
            "created_at": "2025-01-01T00:00:00Z",
        }
        for name in names
    ]
    first, last = (names[0], names[-1]) if names else (None, None)
    return {"object": "list", "data": data, "has_more": False, "first_id": first, "last_id": last}


def _record_json(rec: RequestRecord) -> dict[str, Any]:
    return {
        "index": rec.index,
        "model": rec.model,
        "status": rec.status,
        "stream": rec.stream,
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "completion_tokens": rec.completion_tokens,
        "cost_usd": rec.cost_usd,
        "received_at": rec.received_at,
        "started_at": rec.started_at,
        "first_token_at": rec.first_token_at,
        "finished_at": rec.finished_at,
    }


def build_app(server: FakeHost) -> FastAPI:
    app = FastAPI(title="recursa fake model server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await handle(server, request, "openai")

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        return await handle(server, request, "anthropic")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if server.api_key is not None and not _authorised(request, server.api_key):
            return _error("openai", 401, "Incorrect API key provided.")
        return JSONResponse(_models_body(server))

    @app.get("/ledger")
    async def ledger() -> Response:
        # For benchmarks that run the server in another process: every record without its messages
        # and reply (times are time.perf_counter() values, comparable across processes on Linux).
        return JSONResponse([_record_json(r) for r in server.ledger.snapshot()])

    @app.post("/ledger/reset")
    async def ledger_reset(keep_cache: bool = False) -> Response:
        server.reset(keep_cache=keep_cache)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(server), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
