"""What an operator watches: an access log line per request and Prometheus metrics at `/metrics`.

The access log goes to the `recursa.serve.access` logger at INFO, one line per request:

    POST /v1/chat/completions 200 1.284s req_5f0c2a9e81d4b7c3a6e0f912 run=run_1a2b3c4d5e6f

(method, path without its query, status, duration until the last byte, the request id the answer's
`x-request-id` and `request-id` headers gave the client, and the run it started).
It never holds a header, a key, a session id, a message or a context. `recursa serve` prints it on
stderr; an application that mounts `create_app` decides where that logger goes.

The metrics live in a registry of their own per app, so several apps in one process (tests, an
embedding application) never share or clash over counters.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.result import RLMResult

access_log = logging.getLogger("recursa.serve.access")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths the metrics label as themselves; anything else is "other", so a scan of random URLs cannot
# grow the label set without bound.
KNOWN_PATHS = (
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages/count_tokens",  # before /v1/messages, which would take it as one of its own
    "/v1/messages",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/recursa/sessions",
)
# The method is client input too (any token is a valid HTTP method): label only the standard ones.
KNOWN_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))
RUN_STATE_KEY = "recursa_run"  # request.state attribute the run endpoints set to their LiveRun
REQUEST_ID_KEY = "recursa_request_id"  # request.state attribute holding the request's id
# Every answer carries one (errors and streams too), as OpenAI's and Anthropic's do, under each
# one's header name: the SDKs expose it (`.request_id`), and the access log line has it, so a
# client's report can be matched to the server's line.
REQUEST_ID_HEADERS = (b"x-request-id", b"request-id")


class Metrics:
    """The server's Prometheus metrics (prometheus_client, a registry per app)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "recursa_http_requests",
            "HTTP requests answered",
            ("method", "path", "status"),
            registry=self.registry,
        )
        self.in_flight = Gauge("recursa_runs_in_flight", "RLM runs running now", registry=self.registry)
        self.runs = Counter("recursa_runs", "RLM runs finished", ("stop_reason",), registry=self.registry)
        self.latency = Histogram(
            "recursa_run_duration_seconds",
            "Wall time of a finished RLM run",
            buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )
        self.tokens = Counter(
            "recursa_tokens",
            "Tokens used by finished runs' whole call trees",
            ("kind",),
            registry=self.registry,
        )
        self.cost = Counter("recursa_cost_usd", "US dollars spent by finished runs", registry=self.registry)

    def request(self, method: str, path: str, status: int) -> None:
        label = next((p for p in KNOWN_PATHS if path == p or path.startswith(p + "/")), "other")
        self.requests.labels(method if method in KNOWN_METHODS else "other", label, str(status)).inc()

    def run_started(self) -> None:
        self.in_flight.inc()

    def run_finished(self, result: RLMResult | None) -> None:
        """`result`: None for a run that was cancelled or raised before it had one."""
        self.in_flight.dec()
        if result is None:
            self.runs.labels("cancelled").inc()
            return
        self.runs.labels(result.stop_reason).inc()
        self.latency.observe(result.duration_s)
        usage = result.usage
        self.tokens.labels("input").inc(usage.input_tokens)
        self.tokens.labels("output").inc(usage.output_tokens)
        self.tokens.labels("cached").inc(usage.cached_tokens)
        self.cost.inc(max(usage.cost_usd, 0.0))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ObserveMiddleware:
    """A request id (the `x-request-id` and `request-id` headers), an access log line and a request count for each
    HTTP request (a plain ASGI middleware, so a streamed answer is timed to its last byte)."""

    def __init__(self, app: ASGIApp, *, log: bool, metrics: Metrics | None) -> None:
        self.app = app
        self.log = log
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        # Ours, never the client's: a client-sent id in the log would be client-written text there.
        request_id = f"req_{secrets.token_hex(12)}"
        scope.setdefault("state", {})[REQUEST_ID_KEY] = request_id  # for the Messages API's error bodies
        stamped = [(name, request_id.encode()) for name in REQUEST_ID_HEADERS]

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [*message.get("headers", ()), *stamped]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            status = status or 499  # the client left before any answer (nginx's code for it)
            method, path = scope.get("method", "?"), scope.get("path", "?")
            if self.metrics is not None:
                self.metrics.request(method, path, status)
            if self.log and access_log.isEnabledFor(logging.INFO):
                run = (scope.get("state") or {}).get(RUN_STATE_KEY)
                run_id = getattr(run, "run_id", None)
                access_log.info(
                    "%s %s %d %.3fs %s%s",
                    _printable(method),
                    _printable(_without_secrets(path)),
                    status,
                    time.perf_counter() - started,
                    request_id,
                    f" run={run_id}" if run_id else "",
                )


def _without_secrets(path: str) -> str:
    # A session id is all that guards a session under a shared key: a log reader must not get it.
    sessions = "/v1/recursa/sessions/"
    return sessions + "{id}" if path.startswith(sessions) else path


def _printable(path: str) -> str:
    # A path (and a method) is client input: keep the log one line per request, whatever it holds.
    cut = path[:300]
    return cut if cut.isprintable() else cut.encode("unicode_escape").decode("ascii")
