"""Chat completions answered by RLM runs: the JSON response, the SSE stream, and cancellation when
the client goes away. A request that names a session waits for that session to be free, then for
a run slot (recursa.serve.sessions)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from recursa.errors import RecursaError
from recursa.result import RLMResult
from recursa.serve.bodies import sse_event
from recursa.serve.callers import quota_of
from recursa.serve.fields import AnswerShape
from recursa.serve.observe import Metrics
from recursa.serve.request import ApiError, RunRequest
from recursa.serve.runs import LiveRun, RunSpec
from recursa.serve.sessions import SessionStore
from recursa.serve.settings import ServeSettings
from recursa.serve.shares import RunShares
from recursa.serve.sources import check_path
from recursa.serve.steps import StepRenderer
from recursa.serve.urls import fetch_url

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Emit = Callable[[bytes], Awaitable[None]]

SESSION_HEADER = "x-recursa-session"
HEARTBEAT_S = 10.0  # an SSE comment this often keeps proxies from closing an idle stream
KEEP_ALIVE = b": keep-alive\n\n"
CONTENT_PIECE = 64_000  # a FINAL_VAR answer of many MB goes out in pieces of this many characters


def pieces(text: str) -> list[str]:
    """`text` in the pieces a stream sends it in (none for an empty text)."""
    return [text[start : start + CONTENT_PIECE] for start in range(0, len(text), CONTENT_PIECE)]


class ClientGone(Exception):
    """The HTTP client disconnected."""


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects. Call only after the request body has been read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class RunService:
    """Runs for the HTTP server, whichever wire API asked: their context, run slots (per caller and
    in all), sessions, and the result or the stream."""

    def __init__(self, settings: ServeSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.shares = RunShares(settings)
        self.active: dict[int, LiveRun] = {}
        self.served = 0
        self.cancelled = 0
        self.sessions = SessionStore(settings)

    # -- setting a run up ----------------------------------------------------------------------
    async def prepare(self, req: RunRequest) -> LiveRun:
        """Resolve the context and build the run; every problem here is an HTTP error."""
        run = await self._prepare(req)
        run.quota = quota_of(req.caller.owner)  # whose share of the run slots it takes
        return run

    async def _prepare(self, req: RunRequest) -> LiveRun:
        if req.session is not None:
            return await self.sessions.prepare(req, self.resolve_context)
        context = await self.resolve_context(req)
        spec = RunSpec(req.question, context, settings=dict(req.settings))
        spec.answer_schema, spec.tips = req.shape.schema, req.shape.tips()
        spec.root_sampling = dict(req.shape.sampling)
        try:
            return LiveRun(self.settings, spec)
        except (RecursaError, ValueError) as exc:
            said = spec.spelling.told(exc)
            raise ApiError(400, f"cannot start the run: {said}", code="invalid_run_settings") from None

    async def resolve_context(self, req: RunRequest) -> Any:
        """The request's context, with a server path checked and a URL fetched."""
        context: Any = req.context
        if req.context_path is not None:
            context = check_path(req.context_path, self.settings.context_roots)
        elif req.context_url is not None:
            if not self.settings.allow_context_urls:
                raise ApiError(
                    403,
                    "context URLs are turned off on this server; its operator can allow them with --allow-urls",
                    param="recursa.context_url",
                    code="context_url_not_allowed",
                )
            context = await fetch_url(
                req.context_url,
                max_bytes=self.settings.max_context_bytes,
                timeout_s=self.settings.url_timeout_s,
                allow_private=self.settings.allow_private_urls,
            )
        return context

    async def acquire(self, run: LiveRun, gone: asyncio.Future[None]) -> None:
        """Wait for the run's session to be free (if it has one), then for a run slot of its
        caller's share and of the server's, unless the client leaves first. The session comes first
        so queued questions hold no run slot."""
        handle = run.session
        if handle is not None:
            handle.users += 1  # a session somebody waits for does not expire
            try:
                await _race(handle.lock.acquire(), handle.lock.release, gone)
            except BaseException:
                handle.users -= 1
                raise
            self.sessions.admitted(run)
        try:
            await _race(self.shares.acquire(run.quota), lambda: self.shares.release(run.quota), gone)
        except BaseException:
            if handle is not None:
                self.sessions.release(run)
            raise

    def track(self, run: LiveRun) -> None:
        self.active[id(run)] = run
        if self.metrics is not None:
            self.metrics.run_started()

    async def finish(self, run: LiveRun, cancelled: bool) -> None:
        if cancelled:
            self.cancelled += 1
            await run.cancel()
        if self.active.pop(id(run), None) is not None and self.metrics is not None:
            task = run.task
            ok = task is not None and task.done() and not task.cancelled() and task.exception() is None
            self.metrics.run_finished(task.result() if ok and task is not None else None)
        self.shares.release(run.quota)
        if run.session is not None:
            self.sessions.release(run)
        self.served += 1

    async def aclose(self) -> None:
        """Server shutdown: close every session (reaping their REPLs)."""
        await self.sessions.aclose()

    # -- non-streaming -------------------------------------------------------------------------
    async def complete(self, req: RunRequest, run: LiveRun, receive: Receive) -> dict[str, Any]:
        result = await self.outcome(run, receive)
        return completion_body(_new_id(), req.model, result, req.session, req.shape)

    async def outcome(self, run: LiveRun, receive: Receive) -> RLMResult:
        """Run to the end and return its result (whichever API's body it then becomes), or raise
        the ApiError a client gets; the run is cancelled if the client leaves first."""
        gone = asyncio.ensure_future(wait_disconnect(receive))
        acquired = False
        try:
            await self.acquire(run, gone)
            acquired = True
            self.track(run)
            run.start()
            assert run.task is not None
            done, _ = await asyncio.wait({run.task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if run.task not in done:
                raise ClientGone
        finally:
            gone.cancel()
            if acquired:
                await self.finish(run, cancelled=run.task is not None and not run.task.done())
        if run.task.cancelled():
            raise _closed_under(run)
        try:
            result = run.task.result()
        except RecursaError as exc:
            raise ApiError(
                400, f"the run could not start: {_session_note(run, exc)}", code="run_failed"
            ) from None
        if result.stop_reason == "error" and not result.answer:
            # The run retried its own model calls already: a client's retry would repeat it whole.
            raise ApiError(
                502, f"the run failed: {result.error}", type="server_error", code="run_failed", retry=False
            )
        return result

    # -- streaming -----------------------------------------------------------------------------
    def stream(self, req: RunRequest, run: LiveRun) -> SSERun:
        return SSERun(self, req, run)


def usage_body(result: RLMResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "cost": round(u.cost_usd, 10),  # US dollars for the whole call tree (OpenRouter's field name)
    }


async def _race(acquire: Awaitable[Any], release: Callable[[], None], gone: asyncio.Future[None]) -> None:
    """Await `acquire` unless the client leaves first (`gone`): then raise ClientGone, giving back
    (with `release`) whatever was acquired in the same instant."""
    task = asyncio.ensure_future(acquire)
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        release()
    raise ClientGone


async def _keep_alive(beat: Callable[[], Awaitable[None]]) -> None:
    """A keep-alive (`beat`) every HEARTBEAT_S until cancelled, or until the client is gone."""
    try:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await beat()
    except ClientGone:
        return  # whoever waits on the same client sees it too, and ends the stream


def _closed_under(run: LiveRun) -> ApiError:
    # Only a session's run is cancelled while its client still waits: DELETE closed the session.
    name = run.session.id if run.session is not None else "?"
    return ApiError(
        409, f"session {name!r} was closed while this question ran", code="session_closed", retry=False
    )


def _session_note(run: LiveRun, exc: Exception) -> str:
    if run.session is None:
        return str(exc)
    return f"{exc} (session {run.session.id!r} is closed; open a new one)"


def run_summary(result: RLMResult, session: str | None = None) -> dict[str, Any]:
    return {
        "run_id": result.run_id,
        "stop_reason": result.stop_reason,
        "iterations": result.iterations,
        "llm_calls": result.usage.llm_calls,
        "cost_usd": round(result.usage.cost_usd, 10),
        "duration_s": round(result.duration_s, 4),
        "answer_protocol": result.answer_protocol,
        "error": result.error,
        "trace": result.trace_path.name if result.trace_path else None,
        **({"skipped_files": result.skipped_files} if result.skipped_files else {}),
        **({"session": session} if session is not None else {}),
    }


def finish_reason(result: RLMResult, cut: bool = False, shape: AnswerShape | None = None) -> str:
    # Out of budget, time or window is the RLM's version of running out of output tokens.
    if cut or result.stop_reason in ("budget", "timeout", "context_window") or _unfit(result, shape):
        return "length"
    return "tool_calls" if shape is not None and shape.kind == "tool" else "stop"


def _unfit(result: RLMResult, shape: AnswerShape | None) -> bool:
    """The run ran out of turns with an answer the requested schema refuses (its `error` says how).
    Cut short like a budget stop, so the SDKs' parse helpers say a limit was reached rather than
    that the server sent invalid JSON with finish_reason "stop"."""
    return (
        shape is not None and shape.schema is not None and result.value is None and result.error is not None
    )


def shaped_answer(result: RLMResult, shape: AnswerShape) -> tuple[str, bool]:
    """The answer as the request asked for it (stop sequences, length limit), and whether the
    length limit cut it."""
    return shape.cut(result.answer)


def tool_call(shape: AnswerShape, arguments: str) -> dict[str, Any]:
    """A forced function's call: the RLM's answer is its arguments."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": shape.tool_name, "arguments": arguments},
    }


def completion_body(
    completion_id: str,
    model: str,
    result: RLMResult,
    session: str | None = None,
    shape: AnswerShape | None = None,
) -> dict[str, Any]:
    shape = shape or AnswerShape()
    answer, cut = shaped_answer(result, shape)
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if shape.kind == "tool":
        message = {"role": "assistant", "content": None, "tool_calls": [tool_call(shape, answer)]}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(result, cut, shape),
                "logprobs": None,
            }
        ],
        "usage": usage_body(result),
        "recursa": run_summary(result, session),
    }


def _new_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


class SSERun(Response):
    """An ASGI response that streams one run as chat.completion.chunk events. The run's life
    (admission, steps, result, cancellation) is here; the wire format is in the hooks `opening`,
    `steps`, `answer`, `_error` and `closing`, which recursa.serve.responses_stream overrides for
    the Responses API.

    It watches the connection itself (uvicorn drops writes to a closed socket silently, so a
    long REPL execution would otherwise never notice the client left) and cancels the run, which
    reaps its sandboxes, as soon as the client disconnects.
    """

    def __init__(self, service: RunService, req: RunRequest, run: LiveRun) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.service = service
        self.req = req
        self.run = run
        self.id = _new_id()
        self.created = int(time.time())
        self.renderer = StepRenderer()
        self.last_beat = time.monotonic()

    # What keeps an idle stream open: an SSE comment here; the Messages API sends its ping event.
    keep_alive = KEEP_ALIVE

    async def beat(self, emit: Emit) -> None:
        self.last_beat = time.monotonic()
        await emit(self.keep_alive)

    async def beat_if_quiet(self, emit: Emit) -> None:
        """A keep-alive when none went out for HEARTBEAT_S: for APIs that show the run's steps only
        when asked, so a stream whose steps are not sent still shows proxies it is alive."""
        if time.monotonic() - self.last_beat >= HEARTBEAT_S:
            await self.beat(emit)

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
        """One chunk; `delta` None makes the usage chunk (no choices). Asked for usage, every chunk
        has a `usage` field, null until that last one, as OpenAI's stream does."""
        choices = (
            [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        )
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            **({"usage": None} if self.req.shape.include_usage else {}),
            **extra,
        }
        return sse_event(body)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(wait_disconnect(receive))

        async def emit(data: bytes) -> None:
            if gone.done():
                raise ClientGone
            try:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            except OSError:
                raise ClientGone from None

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    *([(SESSION_HEADER.encode(), self.req.session.encode())] if self.req.session else []),
                ],
            }
        )
        acquired = False
        try:
            await self.opening(emit)
            # Waiting for the session or a run slot can take minutes: keep-alive comments meanwhile,
            # as while the run goes on, or a proxy closes the stream before the run even starts.
            beat = asyncio.ensure_future(_keep_alive(lambda: self.beat(emit)))
            refused: ApiError | None = None
            try:
                await self.service.acquire(self.run, gone)
                acquired = True
            except ApiError as exc:  # the session closed while this request waited for it
                refused = exc
            finally:
                beat.cancel()
                await asyncio.wait({beat})
            if refused is not None:
                await self._error(emit, refused.message, refused.type, refused.code)
            else:
                self.service.track(self.run)
                self.run.start()
                await self._pump(emit, gone)
                await self._result(emit)
            await self.closing(emit)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            pass
        finally:
            gone.cancel()
            if acquired:
                left = self.run.task is not None and not self.run.task.done()
                await self.service.finish(self.run, cancelled=left)

    async def _pump(self, emit: Emit, gone: asyncio.Future[None]) -> None:
        pending: asyncio.Future[list[dict[str, Any]] | None] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(self.run.next_batch())
                done, _ = await asyncio.wait(
                    {pending, gone}, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED
                )
                if gone in done:
                    raise ClientGone
                if not done:
                    await self.beat(emit)
                    continue
                batch = pending.result()
                pending = None
                if batch is None:
                    return
                text = "".join(self.renderer.render(e) for e in batch)
                if text:
                    await self.steps(emit, text)
        finally:
            if pending is not None:
                pending.cancel()

    async def _result(self, emit: Emit) -> None:
        assert self.run.task is not None
        if self.run.task.cancelled():
            closed = _closed_under(self.run)
            await self._error(emit, closed.message, closed.type, closed.code)
            return
        try:
            result = self.run.task.result()
        except (RecursaError, ValueError) as exc:
            message = f"the run could not start: {_session_note(self.run, exc)}"
            await self._error(
                emit, self.service.settings.redact(message), "invalid_request_error", "run_failed"
            )
            return
        except Exception as exc:
            await self._error(emit, f"the run failed: {type(exc).__name__}", "server_error", "run_failed")
            return
        if result.stop_reason == "error" and not result.answer:
            message = self.service.settings.redact(f"the run failed: {result.error}")
            await self._error(emit, message, "server_error", "run_failed")
            return
        await self.answer(emit, result)

    # -- the Chat Completions wire format ------------------------------------------------------
    async def opening(self, emit: Emit) -> None:
        await emit(self._chunk({"role": "assistant", "content": ""}))

    async def steps(self, emit: Emit, text: str) -> None:
        await emit(self._chunk({"reasoning_content": text}))

    async def closing(self, emit: Emit) -> None:
        await emit(b"data: [DONE]\n\n")

    async def answer(self, emit: Emit, result: RLMResult) -> None:
        shape = self.req.shape
        answer, cut = shaped_answer(result, shape)
        if shape.kind == "tool":
            call = tool_call(shape, "")
            await emit(self._chunk({"tool_calls": [{"index": 0, **call}]}))
        for piece in pieces(answer):
            if shape.kind == "tool":
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                await emit(self._chunk(delta))
            else:
                await emit(self._chunk({"content": piece}))
        await emit(
            self._chunk({}, finish_reason(result, cut, shape), recursa=run_summary(result, self.req.session))
        )
        if shape.include_usage:
            await emit(self._chunk(None, usage=usage_body(result)))

    async def _error(self, emit: Emit, message: str, kind: str, code: str | None) -> None:
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        await emit(sse_event(body))
