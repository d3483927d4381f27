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

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from recursa.asgi.body_deadline import BodyDeadline
from recursa.asgi.local_only import LocalOnly
from recursa.errors import ConfigError
from recursa.extras import install_hint
from recursa.serve.admission import AdmissionLimit
from recursa.serve.bodies import JSONBody
from recursa.serve.callers import caller_quota
from recursa.serve.chat import RunService
from recursa.serve.error_handlers import install_error_handlers
from recursa.serve.observe import Metrics, ObserveMiddleware
from recursa.serve.routes_anthropic import anthropic_routes
from recursa.serve.routes_openai import openai_routes
from recursa.serve.routes_recursa import recursa_routes
from recursa.serve.settings import ADMISSION_FLAGS, ServeSettings


def create_app(settings: ServeSettings) -> FastAPI:
    """The app: one router per API (OpenAI's, Anthropic's, recursa's own), the error handlers, and
    the middleware that bounds what a request may take (recursa.serve.admission, recursa.asgi)."""
    metrics = _metrics(settings)
    service = RunService(settings, metrics)

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
        told=ADMISSION_FLAGS,
        per_caller=settings.runs_per_caller + settings.waiting_per_caller,
        caller_of=lambda headers: caller_quota(settings, headers),
    )
    if not settings.api_key and not settings.api_keys:
        app.add_middleware(LocalOnly, hint="start it with --api-key (ServeSettings.api_key) to serve others")
    app.add_middleware(ObserveMiddleware, log=settings.access_log, metrics=metrics)
    install_error_handlers(app, settings)
    app.include_router(recursa_routes(settings, service, metrics))
    app.include_router(openai_routes(settings, service, int(time.time())))
    app.include_router(anthropic_routes(settings, service))
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
