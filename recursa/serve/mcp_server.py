"""`recursa mcp`: a Model Context Protocol server (official `mcp` package, 2.x) with one tool,
`recursa_answer`, that answers a question over a context given as a path or inline text, and
reports progress once per root turn.

    server = build_mcp_server(ServeSettings(model="openai/gpt-5-mini", context_roots=(Path.cwd(),)))
    server.run("stdio")                                  # or: recursa mcp
    app = server.streamable_http_app(streamable_http_path="/mcp")   # or: recursa mcp --http

Note: constructing the server lets the `mcp` package call `logging.basicConfig` (a no-op where
the host already configured logging).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

from recursa.asgi.body_deadline import BodyDeadline
from recursa.asgi.local_only import LocalOnly
from recursa.config import Spelling
from recursa.errors import ConfigError, RecursaError
from recursa.lm.base import valid_unicode
from recursa.overrides import client_settings
from recursa.serve.admission import AdmissionLimit, BodyLimit
from recursa.serve.callers import CLIENT_HEADER, caller_quota, identify, new_session_id, quota_of
from recursa.serve.json_limits import JSONBounds
from recursa.serve.mcp_shares import TransportSessionShares
from recursa.serve.request import ApiError, bearer_token, key_matches
from recursa.serve.runs import LiveRun, RunSpec
from recursa.serve.sessions import SessionStore
from recursa.serve.settings import ADMISSION_FLAGS, OPERATOR, ServeSettings
from recursa.serve.shares import RunShares
from recursa.serve.sources import check_path
from recursa.serve.steps import CellTally
from recursa.version import __version__

TOOL_NAME = "recursa_answer"
# An MCP transport session with no request in progress this long is closed (the SDK's default).
MCP_IDLE_S = 1800.0
TOOL_DESCRIPTION = (
    "Answer a question over a context of any size (a file, a folder of text files, or inline text) "
    "with a Recursive Language Model: the model explores the context with Python code in a sandboxed "
    "REPL and calls sub-models on pieces of it, so the context never has to fit in a model window. "
    "Give `context_path` (a file or folder on this machine) or `context_text`. `sampling`: request "
    "options per role ('root', 'child', 'sub'), e.g. {'root': {'temperature': 0.2, 'seed': 7}}; "
    "reasoning_effort no more than the server's."
)


class Answer(BaseModel):
    answer: str
    stop_reason: str
    iterations: int
    llm_calls: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    duration_s: float
    error: str | None = None
    trace_path: str | None = None
    skipped_files: list[str] = []  # files of a context folder left out, each with the reason


class SessionInfo(BaseModel):
    session: str
    idle_ttl_s: float
    trace_path: str | None = None


SESSION_OPEN_DESCRIPTION = (
    "Open a session over a context (context_path or context_text): the context is loaded once into a "
    "REPL that keeps its variables, and recursa_session_ask answers question after question over it "
    "(earlier questions and answers are in the REPL as `history`). Close it with recursa_session_close."
)


class _TurnProgress:
    """Turns the root run's events into one progress notification per turn."""

    def __init__(self, max_iterations: int) -> None:
        self.total = max_iterations
        self.root: str | None = None
        self.tally = CellTally()
        self.last_exec = ""

    def message(self, event: dict[str, Any]) -> tuple[int, str] | None:
        kind = event.get("type")
        if kind == "run_start":
            if self.root is None:
                self.root = event.get("run_id")
            else:
                self.tally.children += 1
            return None
        if event.get("run_id") != self.root:
            return None
        if kind == "lm_call" and event.get("purpose") == "sub":
            self.tally.sub_call(event)
        elif kind == "exec":
            self.last_exec = "last code: " + ", ".join(self.tally.close(event, error_chars=80))
        elif kind == "turn":
            turn = int(event.get("turn") or 0)
            text = f"turn {turn} of at most {self.total}"
            return turn, text + (f" ({self.last_exec})" if self.last_exec else "")
        return None


def build_mcp_server(settings: ServeSettings, *, name: str = "recursa") -> MCPServer:
    server: MCPServer = MCPServer(
        name=name,
        version=__version__,
        instructions=(
            "Use recursa_answer for questions over documents, logs, code bases or data too large to "
            "read directly. It may take minutes; it reports progress per turn."
        ),
        log_level="WARNING",
    )

    async def recursa_answer(
        question: str,
        ctx: Context,
        context_path: str | None = None,
        context_text: str | None = None,
        max_depth: int | None = None,
        max_iterations: int | None = None,
        max_usd: float | None = None,
        sampling: dict[str, dict[str, Any]] | None = None,
    ) -> Answer:
        """See TOOL_DESCRIPTION."""
        if not question.strip():
            raise ToolError("question is empty")
        asked = {"max_depth": max_depth, "max_iterations": max_iterations, "max_usd": max_usd, "sampling": sampling}
        spec = _spec(settings, question, context_path, context_text, asked)
        try:
            run = LiveRun(settings, spec)
        except (RecursaError, ValueError) as exc:
            raise ToolError(settings.redact(f"cannot start the run: {_ARGUMENTS.told(exc)}")) from None
        async with shares.slot(quota_of(_owner(settings, ctx))):
            return await _drive(run, ctx)

    sessions = SessionStore(settings)
    shares = RunShares(settings)  # run slots, per caller and in all, as recursa serve has them

    async def recursa_session_open(
        ctx: Context,
        context_path: str | None = None,
        context_text: str | None = None,
        max_depth: int | None = None,
        max_iterations: int | None = None,
        max_usd: float | None = None,
        sampling: dict[str, dict[str, Any]] | None = None,
    ) -> SessionInfo:
        """Load a context once into a REPL kept for several questions; returns the session id."""
        if settings.max_sessions == 0:
            raise ToolError(
                f"sessions are turned off on this server ({OPERATOR.given('max_sessions', 0)}); use recursa_answer"
            )
        asked = {"max_depth": max_depth, "max_iterations": max_iterations, "max_usd": max_usd, "sampling": sampling}
        spec = _spec(settings, "(session)", context_path, context_text, asked)
        session_id = new_session_id()
        owner = _owner(settings, ctx)
        key = ("path", str(spec.context)) if context_path is not None else ("inline", None)
        try:
            handle = sessions.create(owner, session_id, spec, key)
            await handle.session.astart()
        except ApiError as exc:
            raise ToolError(exc.message) from None
        except RecursaError as exc:
            await sessions.close(owner, session_id)
            raise ToolError(settings.redact(f"cannot open the session: {_ARGUMENTS.told(exc)}")) from None
        trace = _trace_shown(handle.session.trace_path, ctx)
        return SessionInfo(session=session_id, idle_ttl_s=settings.session_ttl_s, trace_path=trace)

    async def recursa_session_ask(session: str, question: str, ctx: Context) -> Answer:
        """Answer one more question in an open session: same REPL, variables and context as before."""
        if not question.strip():
            raise ToolError("question is empty")
        handle = sessions.find(_owner(settings, ctx), session)
        if handle is None:
            raise ToolError(
                f"no open session {session!r}: open one with recursa_session_open (sessions close after "
                f"{settings.session_ttl_s:g} s idle)"
            )
        run = LiveRun(settings, RunSpec(question, None), handle)
        handle.users += 1  # waited for: it does not expire
        await handle.lock.acquire()
        try:
            sessions.admitted(run)
        except ApiError as exc:
            raise ToolError(exc.message) from None
        try:
            async with shares.slot(quota_of(handle.owner)):
                return await _drive(run, ctx)
        finally:
            sessions.release(run)

    async def recursa_session_close(session: str, ctx: Context) -> bool:
        """Close a session and stop its REPL; False if no such session is open."""
        return await sessions.close(_owner(settings, ctx), session)

    server.add_tool(recursa_answer, name=TOOL_NAME, description=TOOL_DESCRIPTION)
    server.add_tool(recursa_session_open, name="recursa_session_open", description=SESSION_OPEN_DESCRIPTION)
    server.add_tool(recursa_session_ask, name="recursa_session_ask")
    server.add_tool(recursa_session_close, name="recursa_session_close")
    server.recursa_sessions = sessions  # type: ignore[attr-defined]  (closed by whoever runs the server)
    return server


def _owner(settings: ServeSettings, ctx: Context) -> str:
    """The caller a session belongs to: over HTTP, its key (and X-Recursa-Client secret), as for
    `recursa serve`; over stdio, the one client that started this process."""
    headers = ctx.headers
    if headers is None:
        return "local"
    try:
        return identify(settings, headers.get("authorization", ""), headers.get(CLIENT_HEADER)).owner
    except ApiError as exc:
        raise ToolError(exc.message) from None


def _trace_shown(trace: Path | None, ctx: Context) -> str | None:
    """A run's trace as the client is told it: over stdio the path (the client started this process
    on its own machine and opens the file); over HTTP the file's name only, as `recursa serve` gives
    it, since the folder is the server's (its user's home, its layout: trace/hostpaths.py)."""
    if trace is None:
        return None
    return str(trace) if ctx.headers is None else trace.name


def _spec(
    settings: ServeSettings,
    question: str,
    context_path: str | None,
    context_text: str | None,
    arguments: dict[str, Any],
) -> RunSpec:
    """A run's context and settings from tool arguments (by the schema's names), checked against the
    operator's settings."""
    if (context_path is None) == (context_text is None):
        raise ToolError("give exactly one of context_path (a file or folder) or context_text")
    context: Any = context_text
    if context_path is not None:
        try:
            context = check_path(context_path, settings.context_roots)
        except ApiError as exc:
            raise ToolError(exc.message) from None
    elif not context_text:
        raise ToolError("context_text is empty")
    asked = dict(arguments)
    try:  # the schema's policy for what a client may set, as recursa serve's requests have it
        run = client_settings(asked, settings.run_limits(), _ARGUMENTS, models=None)
    except ConfigError as exc:
        raise ToolError(_ARGUMENTS.told(exc)) from None
    return RunSpec(question, context, settings=run, spelling=_ARGUMENTS)


# A tool call's settings are its arguments: `arguments['max_depth']`, as MCP's tools/call sends them.
_ARGUMENTS = Spelling("key", "arguments")


async def _drive(run: LiveRun, ctx: Context) -> Answer:
    # The run's own config bounds its turns (the operator's, lowered by the client's arguments or
    # the session's): the progress total is that, not a second merge of the same settings.
    max_iterations = run.rlm.config.max_iterations
    progress = _TurnProgress(max_iterations)
    run.start()
    assert run.task is not None
    try:
        while (batch := await run.next_batch()) is not None:
            for event in batch:
                step = progress.message(event)
                if step is not None:
                    await ctx.report_progress(step[0], max_iterations, step[1])
        try:
            result = run.task.result()
        except RecursaError as exc:
            raise ToolError(run.settings.redact(str(exc))) from None
    finally:
        # The client cancelled the request (or the session ended): stop the run, reap its REPLs.
        if not run.task.done():
            await asyncio.shield(run.cancel())
    u = result.usage
    await ctx.report_progress(
        max_iterations,
        max_iterations,
        f"done after {result.iterations} turns: {result.stop_reason}, {u.llm_calls} LM calls, ${u.cost_usd:.4f}",
    )
    if result.stop_reason == "error" and not result.answer:
        raise ToolError(valid_unicode(f"the run failed: {result.error}"))
    # valid_unicode: the answer (and a skipped file's name) can hold surrogates, which the SDK's JSON
    # cannot encode; the call would fail ("Error executing tool") instead of returning the answer.
    fields = {
        "answer": result.answer,
        "stop_reason": result.stop_reason,
        "iterations": result.iterations,
        "llm_calls": u.llm_calls,
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cost_usd": round(u.cost_usd, 10),
        "duration_s": round(result.duration_s, 4),
        "error": result.error,
        "trace_path": _trace_shown(result.trace_path, ctx),
        "skipped_files": result.skipped_files,
    }
    return Answer.model_validate(valid_unicode(fields))


def http_app(
    server: MCPServer, settings: ServeSettings, *, path: str = "/mcp", host: str = "127.0.0.1"
) -> Any:
    """The streamable HTTP app of `recursa mcp --http`: the server's keys required, each caller's
    share of requests in progress, and no request body over `settings.max_context_bytes`, past its
    deadline or past the JSON bounds (the SDK reads a body whole, with no cap of its own)."""
    keys = [k for k in (settings.api_key, *settings.api_keys.values()) if k]
    # The SDK's own body cap (4 MiB by default) refused any larger context_text, under the 2 GiB
    # this server promises; BodyLimit below holds the operator's cap instead.
    app = server.streamable_http_app(
        streamable_http_path=path,
        host=host,
        max_request_body_size=settings.max_context_bytes,
        max_sessions=settings.max_mcp_clients,
        session_idle_timeout=MCP_IDLE_S,
    )
    app = TransportSessionShares(
        app,
        per_caller=settings.mcp_clients_per_caller,
        caller_of=lambda headers: caller_quota(settings, headers),
        idle_s=MCP_IDLE_S,
    )
    # Outside in: the key; the caller's share of requests in progress (tool calls wait for run
    # slots inside, recursa.serve.shares); the body's deadline, size and JSON bounds.
    bounded = BodyDeadline(
        BodyLimit(JSONBounds(app), max_bytes=settings.max_context_bytes), timeout_s=settings.body_timeout_s
    )
    admitted = AdmissionLimit(
        bounded,
        limit=settings.max_runs + settings.max_waiting,
        told=ADMISSION_FLAGS,
        per_caller=settings.runs_per_caller + settings.waiting_per_caller,
        caller_of=lambda headers: caller_quota(settings, headers),
        paths=frozenset((path,)),
        post_only=True,
    )
    if not keys:
        # The SDK checks Origin and Host only when `host` is a loopback name; bound to 0.0.0.0 a page
        # in the operator's browser (cross-site, or a name rebound to 127.0.0.1) reached the tools.
        admitted = LocalOnly(admitted, hint="start it with --api-key to serve others")
    return with_bearer_key(admitted, keys)


def with_bearer_key(app: Any, api_key: str | Sequence[str] | None) -> Any:
    """Wrap an ASGI app so HTTP requests need `Authorization: Bearer <key>`, for `api_key` or any
    of several keys (when one is set)."""
    keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or () if k]
    if not keys or not all(keys):
        return app

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            token = bearer_token(given)
            # Every key is compared in constant time, so the timing does not tell which one matched.
            if not [k for k in keys if key_matches(token, k)]:
                body = b'{"error": "missing or incorrect API key: send Authorization: Bearer <key>"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded
