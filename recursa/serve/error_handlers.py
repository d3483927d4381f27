"""How the HTTP server answers what goes wrong: every error in the shape of the API the request
spoke (OpenAI's, or Anthropic's under /v1/messages), with help for the paths clients get wrong
(OpenAI's legacy APIs, a base URL without /v1, stored responses and completions), so SDKs raise
their usual exceptions; a client that left gets nothing; a fault of the server's is logged, scrubbed,
and answered 500 without a retry."""

from __future__ import annotations

import logging
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from recursa.serve.api_error import ApiError, bad
from recursa.serve.bodies import JSONBody
from recursa.serve.chat import ClientGone
from recursa.serve.observe import REQUEST_ID_KEY
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


def answer(request: Request, error: ApiError) -> JSONBody:
    """`error` in the shape of the API the request spoke."""
    request_id = getattr(request.state, REQUEST_ID_KEY, None)
    body = error.body_for(request.url.path, request_id)
    return JSONBody(body, status_code=error.status, headers=error.headers())


def install_error_handlers(app: FastAPI, settings: ServeSettings) -> None:
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
