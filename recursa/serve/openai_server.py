"""An RLM as an OpenAI-compatible model: `POST /v1/chat/completions` and `POST /v1/responses` (JSON
or SSE), `GET /v1/models`, `GET /health`, and sessions (`GET /v1/recursa/sessions`, `DELETE /v1/recursa/sessions/{id}`);
and as an Anthropic model: `POST /v1/messages` (recursa.serve.messages_api).

    app = create_app(ServeSettings(model="openai/gpt-5-mini", sub_model="openai/gpt-5-nano"))
    uvicorn.run(app, host="127.0.0.1", port=8000)     # or: recursa serve --model ...

Every error, including unknown routes and bodies that are not JSON, is answered in OpenAI's error
format (Anthropic's under /v1/messages), so SDKs raise their usual exceptions; the server keeps
serving after any of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from recursa.asgi.body_deadline import BodyDeadline
from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.serve.admission import AdmissionLimit
from recursa.serve.bodies import JSONBody
from recursa.serve.callers import CLIENT_HEADER, caller_quota, identify
from recursa.serve.chat import SESSION_HEADER, ClientGone, RunService
from recursa.serve.json_limits import MAX_NESTING, TooDeepJSON, TooMuchJSON, loads_bounded, shape_problem
from recursa.serve.messages_api import create_message, no_token_count
from recursa.serve.observe import REQUEST_ID_KEY, RUN_STATE_KEY, Metrics, ObserveMiddleware
from recursa.serve.request import ApiError, Caller, bad, parse_chat_request, read_capped
from recursa.serve.responses_api import ResponseChain, create_response
from recursa.serve.settings import ServeSettings

log = logging.getLogger("recursa.serve")

# APIs that an RLM does not answer (OpenAI's legacy ones), and what a client should use instead.
_OTHER_APIS = ("/v1/completions", "/v1/embeddings")
_OTHER_API_HELP = (
    "this server answers OpenAI's Chat Completions API (POST /v1/chat/completions) and Responses API "
    "(POST /v1/responses), and Anthropic's Messages API (POST /v1/messages); point the client at one of them"
)
_NO_BATCHES = (
    "this server runs no message batches (nothing is stored to poll); send each request to POST /v1/messages"
)
# Paths a client reaches when its base URL lacks the /v1 that OpenAI-compatible servers expect.
_UNDER_V1 = ("/chat/completions", "/responses", "/models", "/completions", "/embeddings")

_NOT_STORED = (
    "this server stores no responses (store is accepted and keeps nothing), so none can be retrieved, "
    "listed, cancelled or deleted; a response of a session can be continued with previous_response_id"
)

_NO_COMPLETIONS_STORED = (
    "this server stores no chat completions (store is accepted and keeps nothing), so none can be "
    "listed, retrieved, updated or deleted; each run's trace stays on the server, and a conversation "
    'can go on in a session (extra_body={"recursa": {"session": "new"}})'
)
_NO_CONVERSATIONS = (
    "this server keeps no conversations; send the whole conversation with each request, or go on in a "
    'session (extra_body={"recursa": {"session": "new"}}, then previous_response_id or the session id)'
)


def _about_stored_completions(status: int, method: str, path: str) -> bool:
    """GET /v1/chat/completions (the list) and anything under /v1/chat/completions/{id}: the stored
    completions API, which `store` would feed on OpenAI's servers."""
    if path.startswith("/v1/chat/completions/"):
        return status in (404, 405)
    return status == 405 and method == "GET" and path.rstrip("/") == "/v1/chat/completions"


# Bodies above this size are parsed on a worker thread so other requests keep being served.
_PARSE_IN_THREAD_BYTES = 1_000_000


def create_app(settings: ServeSettings) -> FastAPI:
    metrics = _metrics(settings)
    service = RunService(settings, metrics)
    chain = ResponseChain()  # which session each response ran in, for previous_response_id

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await service.aclose()  # open sessions hold REPL processes: reap them on the way out

    app = FastAPI(
        title="recursa",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
        default_response_class=JSONBody,
    )
    app.state.service = service
    # Added first, so they run inside the access log and metrics: a 408 or 429 is logged and counted.
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    app.add_middleware(
        AdmissionLimit,
        limit=settings.max_runs + settings.max_waiting,
        per_caller=settings.runs_per_caller + settings.waiting_per_caller,
        caller_of=lambda headers: caller_quota(settings, headers),
    )
    app.add_middleware(ObserveMiddleware, log=settings.access_log, metrics=metrics)
    started = int(time.time())

    def answer(request: Request, error: ApiError) -> JSONBody:
        """`error` in the shape of the API the request spoke."""
        request_id = getattr(request.state, REQUEST_ID_KEY, None)
        body = error.body_for(request.url.path, request_id)
        return JSONBody(body, status_code=error.status, headers=error.headers())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONBody:
        exc.message = settings.redact(exc.message)  # may quote a failed run's error
        return answer(request, exc)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's code for "client closed"

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONBody:
        message = {404: "no such endpoint", 405: "method not allowed here"}.get(
            exc.status_code, str(exc.detail)
        )
        path = request.url.path
        if exc.status_code == 404 and path.rstrip("/") in _OTHER_APIS:
            message = _OTHER_API_HELP
        elif exc.status_code == 404 and path.startswith("/v1/messages/batches"):
            message = _NO_BATCHES
        elif exc.status_code == 404 and (path.startswith("/v1/v1/") or path.rstrip("/") == "/messages"):
            # Anthropic's clients add /v1/messages to their base URL themselves.
            base = str(request.base_url).rstrip("/")
            message = f"no such endpoint: an Anthropic client's base URL is this server's root, {base}"
        elif exc.status_code == 404 and any(path == p or path.startswith(p + "/") for p in _UNDER_V1):
            base = str(request.base_url).rstrip("/")
            message = (
                f"no such endpoint: this server's API is under /v1; set the client's base URL to {base}/v1"
            )
        elif exc.status_code in (404, 405) and path.startswith("/v1/responses/"):
            # retrieve, delete, cancel, input_items: all about stored responses, which there are none of
            return answer(request, ApiError(404, _NOT_STORED, code="response_not_found"))
        elif _about_stored_completions(exc.status_code, request.method, path):
            return answer(request, ApiError(404, _NO_COMPLETIONS_STORED, code="completion_not_found"))
        elif exc.status_code == 404 and path.startswith("/v1/conversations"):
            return answer(request, ApiError(404, _NO_CONVERSATIONS, code="conversation_not_found"))
        return answer(request, ApiError(exc.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONBody:
        return answer(request, bad(f"invalid request: {exc.errors()[:3]}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONBody:
        # The traceback's text, scrubbed: an exception's message may carry a key.
        trace = "".join(traceback.format_exception(exc))
        log.error("internal error while serving a request\n%s", settings.redact(trace.rstrip(), log=True))
        # A fault of ours does not heal in the second an SDK waits, and here it may come after a whole
        # run: the SDKs' retries would run the question again, for the same fault.
        error = ApiError(
            500, f"internal server error ({type(exc).__name__})", type="server_error", retry=False
        )
        return answer(request, error)

    def authorize(request: Request) -> Caller:
        headers = request.headers
        return identify(
            settings, headers.get("authorization", ""), headers.get(CLIENT_HEADER), headers.get("x-api-key")
        )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": settings.served_model_name,
            "active_runs": len(service.active),
            "served": service.served,
            "cancelled": service.cancelled,
            "sessions": len(service.sessions.open),
        }

    since = datetime.fromtimestamp(started, UTC).isoformat().replace("+00:00", "Z")

    def model_card(name: str) -> dict[str, Any]:
        # OpenAI's fields and Anthropic's side by side: each SDK reads its own and ignores the others.
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "recursa",
            "type": "model",
            "display_name": name,
            "created_at": since,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        names = settings.model_names
        cards = [model_card(n) for n in names]
        return {
            "object": "list",
            "data": cards,
            "has_more": False,
            "first_id": names[0],
            "last_id": names[-1],
        }

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request) -> dict[str, Any]:
        authorize(request)
        if name not in settings.model_names:
            raise ApiError(404, f"The model {name!r} does not exist on this server", code="model_not_found")
        return model_card(name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        caller = authorize(request)
        body = await _read_json(request, settings.max_context_bytes)
        req = parse_chat_request(body, settings)
        req.caller = caller
        run = await service.prepare(req)
        setattr(request.state, RUN_STATE_KEY, run)  # the access log names its run
        if req.stream:
            return service.stream(req, run)
        headers = {SESSION_HEADER: req.session} if req.session else None
        return JSONBody(await service.complete(req, run, request.receive), headers=headers)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        caller = authorize(request)
        body = await _read_json(request, settings.max_context_bytes)
        return await create_response(service, chain, request, caller, body)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        caller = authorize(request)
        body = await _read_json(request, settings.max_context_bytes)
        return await create_message(service, request, caller, body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        authorize(request)
        raise no_token_count()

    if metrics is not None:

        @app.get("/metrics")
        async def prometheus(request: Request) -> Response:
            authorize(request)  # runs, tokens and spend are the operator's business
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

    @app.get("/v1/recursa/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        caller = authorize(request)
        # Under a key several people may share, an id is the only thing that guards a session.
        owned = service.sessions.owned_by(caller.owner)
        return {"object": "list", "data": [h.describe(with_id=caller.private) for h in owned]}

    @app.delete("/v1/recursa/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> dict[str, Any]:
        caller = authorize(request)
        if not await service.sessions.close(caller.owner, session_id):
            raise ApiError(
                404, f"no open session {session_id!r} (it may have expired)", code="session_not_found"
            )
        return {"id": session_id, "object": "recursa.session", "deleted": True}

    return app


def _metrics(settings: ServeSettings) -> Metrics | None:
    if not settings.metrics:
        return None
    try:
        return Metrics()
    except ImportError:
        raise ConfigError(
            f"the /metrics endpoint needs prometheus-client: {install_hint('server')}, "
            "or pass ServeSettings(metrics=False)"
        ) from None


async def _read_json(request: Request, max_bytes: int) -> Any:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # Read as it came, a compressed body was "not valid JSON", which sent its sender looking in
        # the wrong place; inflating it would need a cap on what it inflates to as well.
        raise ApiError(
            415,
            f"request bodies with Content-Encoding {encoding!r} are not accepted here; send the JSON "
            "uncompressed",
            code="unsupported_content_encoding",
        )
    try:
        raw = await read_capped(
            request.headers.get("content-length"), request.stream(), max_bytes, _too_large(max_bytes)
        )
    except ClientDisconnect:  # it left mid-body, or took longer than the body deadline
        raise ClientGone from None
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, which JSON readers may ignore
    try:
        if len(raw) > _PARSE_IN_THREAD_BYTES:
            body = await asyncio.to_thread(loads_bounded, raw)
        else:
            body = loads_bounded(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None
    except TooMuchJSON as exc:
        raise ApiError(
            413,
            f"the request body holds {exc}, past what a request may hold; send fewer messages, or a large "
            "context as one string (recursa.context) or a file part",
            code="request_too_large",
        ) from None
    except (TooDeepJSON, RecursionError):
        raise bad(
            f"the request body nests JSON arrays or objects too deeply (at most {MAX_NESTING} levels)"
        ) from None
    problem = shape_problem(body)
    if problem is not None:
        field, what = problem
        raise ApiError(
            413,
            f"`{field}` holds {what}; send a large context as one string (recursa.context) or a file part",
            param=field,
            code="request_too_large",
        )
    return body


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {max_bytes:,} bytes")
