"""`recursa acp`: recursa as an Agent Client Protocol agent over stdio (the `agent-client-protocol`
package). Editors such as Zed can use it as an agent, and verifiers' ACP harnesses can run it.

Each prompt is one RLM run. Its text is the question; embedded text resources (files the client
attaches) are the context, one entry per file, and image blocks are images of the context
(`image-<n>.<ext>`, shown to sub-models with llm_query(images=[name])). Without any, the prompt's text is the context and the
RLM carries out its request, as `RLM.completion` does. Progress arrives as thought chunks (one per
root turn and REPL cell), the answer as the agent's message, and the prompt's response `_meta`
holds `recursa/run-v1` (run id, stop reason, usage, trace path).

A client may set run options per session through the new session's `_meta` under
`recursa/runtime-v1`: "base_url", "api_key", "session_id" and the run settings clients may set
(docs/reference/settings.md: "model", "max_depth", "budget": {...}, ...), for that session only
(verifiers points the model at its own endpoint this way). What costs the operator money or capacity
can only be lowered, and a model other than the operator's needs the client's own key. The API key
it sends is used for that session's calls and never echoed back.
A `base_url` of the client's choosing gets the operator's key only if the operator allowed it
(`--allow-base-url`, besides `--base-url`); otherwise the client must send its own `api_key` with
it, or the session is refused (ServeSettings.client_upstream).

MCP servers (the client's from `session/new` and the operator's `--mcp-servers`) are connected when
the session is made, used by each of its prompts, and closed by `session/close` or when the
connection ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from acp import (
    PROTOCOL_VERSION,
    RequestError,
    run_agent,
    text_block,
    update_agent_message,
    update_agent_thought,
)
from acp.interfaces import Client
from acp.schema import (
    AgentCapabilities,
    Implementation,
    InitializeResponse,
    McpCapabilities,
    NewSessionResponse,
    PromptCapabilities,
    PromptResponse,
    SessionCapabilities,
    SessionCloseCapabilities,
)

from recursa.config import SETTINGS, Spelling
from recursa.errors import RecursaError
from recursa.lm.base import valid_unicode
from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION
from recursa.loop.tree import new_id
from recursa.overrides import check_keys, client_settings, text_value
from recursa.rlm import RLM
from recursa.serve.api_error import ApiError
from recursa.serve.images import InlineImage, base64_image, context_images
from recursa.serve.settings import ServeSettings
from recursa.tools.mcp_config import McpServerSpec, parse_mcp_servers
from recursa.tools.mcp_tools import McpServers
from recursa.trace.redact import redact
from recursa.version import __version__

RUNTIME_KEY = "recursa/runtime-v1"
RUN_KEY = "recursa/run-v1"
_STOP = {
    "final": "end_turn",
    "max_iterations": "max_turn_requests",
    "budget": "max_tokens",
    "context_window": "max_tokens",
    "cancelled": "cancelled",
}


@dataclasses.dataclass
class _Session:
    overrides: dict[str, Any]
    cwd: str
    task: asyncio.Task[Any] | None = None
    # The session's MCP servers (the operator's and the client's), connected at session/new and
    # used by each of its prompts; closed with the session or the connection.
    mcp: McpServers | None = None


class RecursaAgent:
    """The ACP agent: sessions, prompts (RLM runs) and cancellation."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self._conn: Client | None = None
        self._sessions: dict[str, _Session] = {}

    def on_connect(self, conn: Client) -> None:
        self._conn = conn

    async def initialize(self, protocol_version: int, **kwargs: Any) -> InitializeResponse:
        return InitializeResponse(
            protocol_version=PROTOCOL_VERSION,
            agent_capabilities=AgentCapabilities(
                load_session=False,
                prompt_capabilities=PromptCapabilities(embedded_context=True, image=True),
                # stdio servers are always offered; of the others, streamable HTTP only
                mcp_capabilities=McpCapabilities(http=True, sse=False),
                session_capabilities=SessionCapabilities(close=SessionCloseCapabilities()),
            ),
            agent_info=Implementation(
                name="recursa", title="recursa (Recursive Language Model)", version=__version__
            ),
        )

    async def new_session(
        self, cwd: str, mcp_servers: list[Any] | None = None, **kwargs: Any
    ) -> NewSessionResponse:
        given = kwargs.get(RUNTIME_KEY) or {}
        if not isinstance(given, dict):
            raise RequestError.invalid_params({"message": f"_meta.{RUNTIME_KEY} must be an object"})
        self._admit(None)  # a full agent refuses before it builds anything
        try:
            overrides = _checked_runtime(given, self.settings)
            servers = self._mcp_servers(mcp_servers)
            # a bad model, key, base URL, budget or MCP server entry fails here, not on the first prompt
            self._rlm(overrides, servers)
        except (RecursaError, TypeError, ValueError) as exc:
            said = _RUNTIME.told(exc)
            message = said if said.startswith(f"_meta.{RUNTIME_KEY}") else f"_meta.{RUNTIME_KEY}: {said}"
            raise RequestError.invalid_params({"message": self._redact(message, given)}) from None
        session_id = overrides.get("session_id") or new_id("acp")
        self._admit(session_id)
        try:
            mcp = await McpServers.connect(servers) if servers else None
        except RecursaError as exc:
            raise RequestError.invalid_params({"message": self._redact(str(exc), given)}) from None
        try:  # again: other sessions may have been opened while the servers connected
            self._admit(session_id)
        except RequestError:
            if mcp is not None:
                await mcp.aclose()
            raise
        self._sessions[session_id] = _Session(dict(overrides), cwd, mcp=mcp)
        return NewSessionResponse(session_id=session_id)

    def _admit(self, session_id: str | None) -> None:
        """Refuses a new session when the agent holds its most, or when `session_id` is taken."""
        if len(self._sessions) >= self.settings.max_sessions:
            # Each open session may run a prompt (a REPL, its children, model calls) at any time:
            # sessions without end were runs without end on the operator's machine and key.
            raise RequestError.invalid_request(
                {
                    "message": f"this agent holds at most {self.settings.max_sessions} sessions at once "
                    "(recursa acp --max-sessions); close one with session/close first"
                }
            )
        if session_id in self._sessions:  # a client's id must not take over a session that exists
            raise RequestError.invalid_params(
                {
                    "message": f"_meta.{RUNTIME_KEY}.session_id {session_id!r} is in use; choose another or omit it"
                }
            )

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        session = self._sessions.get(session_id)
        if session is None:
            raise RequestError.invalid_params(
                {"message": f"no session {session_id!r}; create one with session/new"}
            )
        if session.task is not None and not session.task.done():
            raise RequestError.invalid_request({"message": "a prompt is already running in this session"})
        try:
            question, context = _question_and_context(prompt, self.settings)
        except ApiError as exc:
            raise RequestError.invalid_params({"message": exc.message}) from None
        if not question and context is None:
            raise RequestError.invalid_params({"message": "the prompt has no text: send a text block"})
        if context is None:
            question, context = PROMPT_AS_CONTEXT_QUESTION, question
        elif not question:
            question = PROMPT_AS_CONTEXT_QUESTION
        session.task = asyncio.create_task(self._run(session_id, session, question, context))
        try:
            result = await session.task
        except asyncio.CancelledError:
            return PromptResponse(stop_reason="cancelled")
        except RecursaError as exc:
            raise RequestError.invalid_params(
                {"message": self._redact(str(exc), session.overrides)}
            ) from None
        except Exception as exc:  # a bug: the client gets its name, not a bare "Internal error"
            message = self._redact(f"{type(exc).__name__}: {exc}", session.overrides)
            raise RequestError.internal_error({"message": message}) from None
        finally:
            session.task = None
        text = result.answer if result.answer else f"(no answer: {result.error or result.stop_reason})"
        await self._say(session_id, text, thought=False)
        meta = {
            RUN_KEY: {
                "run_id": result.run_id,
                "stop_reason": result.stop_reason,
                "iterations": result.iterations,
                "usage": result.usage.to_dict(),
                "trace_path": str(result.trace_path) if result.trace_path else None,
                "error": result.error,
            }
        }
        return PromptResponse(stop_reason=_STOP.get(result.stop_reason, "end_turn"), field_meta=meta)

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.task is not None:
            session.task.cancel()

    async def close_session(self, session_id: str, **kwargs: Any) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            await _end(session)

    async def aclose(self) -> None:
        """The connection closed: end every session (its prompt cancelled, its MCP servers closed)."""
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(_end(s) for s in sessions))

    async def authenticate(self, method_id: str, **kwargs: Any) -> None:
        return None

    # -- inside --------------------------------------------------------------------------------
    def _redact(self, text: str, overrides: dict[str, Any]) -> str:
        """An error for the client without the operator's keys or the session's own."""
        own = overrides.get("api_key")
        return redact(self.settings.redact(text), own if isinstance(own, str) else None)

    def _mcp_servers(self, given: list[Any] | None) -> list[McpServerSpec]:
        """The operator's MCP servers (--mcp-servers) and those the client passes to session/new,
        checked: the session connects them on this host once, for all its prompts."""
        entries = [
            m.model_dump(by_alias=True, exclude_none=True) if hasattr(m, "model_dump") else m
            for m in given or []
        ]
        return [
            *self.settings.run.get("mcp_servers", []),
            *parse_mcp_servers(entries, "session/new mcpServers"),
        ]

    def _rlm(self, overrides: dict[str, Any], mcp_servers: list[Any], on_event: Any = None) -> RLM:
        s = self.settings
        base_url, api_key = s.client_upstream(
            overrides.get("base_url"), overrides.get("api_key"), f"_meta.{RUNTIME_KEY}"
        )
        options = s.run_settings() | {k: v for k, v in overrides.items() if k in _CLIENT_SETTINGS}
        options |= {"base_url": base_url, "api_key": api_key, "mcp_servers": mcp_servers}
        options["on_event"] = _both(s.run.get("on_event"), on_event)
        # What fails here is the client's (the operator's settings were checked at start-up): named
        # as the client wrote it, with the operator's flag for what only the operator sets.
        return RLM.configured(options, _RUNTIME)

    async def _run(self, session_id: str, session: _Session, question: str, context: Any) -> Any:
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Future[Any]] = set()

        def progress(event: dict[str, Any]) -> None:
            # Runs inside the run's trace writer: hand the note to the loop, never block the run.
            note = _progress_note(event)
            if note is not None:
                future = asyncio.run_coroutine_threadsafe(self._say(session_id, note, thought=True), loop)
                pending.add(future)  # type: ignore[arg-type]

        try:
            servers = [session.mcp] if session.mcp is not None else []
            rlm = self._rlm(session.overrides, servers, on_event=progress)
            result = await rlm.arun(question, context)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        # The notes go out before the answer does.
        await asyncio.gather(*(asyncio.wrap_future(f) for f in pending), return_exceptions=True)  # type: ignore[arg-type]
        return result

    async def _say(self, session_id: str, text: str, *, thought: bool) -> None:
        if self._conn is None:
            return
        text = valid_unicode(text)  # a surrogate from the context would make the message invalid JSON text
        update = update_agent_thought(text_block(text)) if thought else update_agent_message(text_block(text))
        await self._conn.session_update(session_id=session_id, update=update)


# The session options that are not run settings; the run settings a client may set come from the
# schema (recursa/config.py), checked against the operator's limits (recursa/overrides.py).
_DOOR = ("base_url", "api_key", "session_id")
_CLIENT_SETTINGS = tuple(n for n, s in SETTINGS.items() if s.client != "operator")
_RUNTIME = Spelling("dotted", f"_meta.{RUNTIME_KEY}")


def _checked_runtime(given: dict[str, Any], settings: ServeSettings) -> dict[str, Any]:
    """The session's runtime options, each checked and named as `_meta.recursa/runtime-v1.<key>`;
    an unknown key is refused, so a misspelt one never leaves the operator's default in place, and
    no option may widen what the operator pays for (docs/reference/settings.md)."""
    where = f"_meta.{RUNTIME_KEY}"
    check_keys(given, [*_DOOR, *_CLIENT_SETTINGS], lambda key: f"{where}.{key}", strict=True)
    door = {k: given[k] for k in _DOOR if given.get(k) is not None}
    for key in ("base_url", "session_id"):  # api_key: client_upstream checks it, keeping it out of messages
        if key in door:
            door[key] = text_value(f"{where}.{key}", door[key])
    asked = {k: v for k, v in given.items() if k in _CLIENT_SETTINGS}
    run = client_settings(
        asked,
        settings.run_limits(),
        _RUNTIME,
        models=settings.run_models(),
        own_key=isinstance(door.get("api_key"), str) and bool(door["api_key"]),
    )
    return {**door, **run}


async def _end(session: _Session) -> None:
    task = session.task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if session.mcp is not None:
        mcp, session.mcp = session.mcp, None
        await mcp.aclose()


def _both(first: Any, second: Any) -> Any:
    if first is None or second is None:
        return first or second

    def both(event: dict[str, Any]) -> None:
        first(event)
        second(event)

    return both


def _question_and_context(blocks: list[Any], settings: ServeSettings) -> tuple[str, Any]:
    """The prompt's text, and its context: the embedded text resources by URI and the image blocks
    by name (as `recursa serve` names a request's images: recursa.serve.images), or None."""
    texts: list[str] = []
    files: dict[str, Any] = {}
    images: list[InlineImage] = []
    size = 0  # characters of text and resources: each takes at least a byte of the context
    for i, block in enumerate(blocks):
        kind = getattr(block, "type", None)
        if kind == "text":
            texts.append(block.text)
            size += len(block.text)
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            if isinstance(text, str):
                files[str(getattr(resource, "uri", f"resource-{len(files)}"))] = text
                size += len(text)
        elif kind == "image":
            images.append(base64_image(getattr(block, "data", None), f"prompt[{i}]", ".data"))
        if size > settings.max_context_bytes:
            raise ApiError(
                413,
                f"the prompt's text and embedded resources are over {settings.max_context_bytes:,} bytes, "
                "the most this agent takes (ServeSettings.max_context_bytes); attach fewer or smaller files",
            )
    files.update({k: v for k, v in context_images(images, settings).items() if k not in files})
    question = "\n\n".join(t for t in texts if t.strip()).strip()
    return question, (files if files else None)


def _progress_note(event: dict[str, Any]) -> str | None:
    if event.get("depth", 0) != 0:
        return None
    if event["type"] == "turn":
        return f"turn {event.get('turn')}\n"
    if event["type"] == "exec":
        lines = (event.get("code") or "").strip().splitlines()
        head = lines[0][:120] if lines else ""
        status = "error" if event.get("error") else "ok"
        return f"ran a REPL cell ({len(lines)} lines, {status}): {head}\n"
    return None


async def serve_stdio(settings: ServeSettings) -> None:
    """Speak ACP on stdin/stdout until the client closes them, then end every session."""
    agent = RecursaAgent(settings)
    try:
        # session/close is routed only with the protocol's unstable methods on; the others among
        # them (fork, resume) stay unanswered (method not found), as this agent has none.
        await run_agent(agent, use_unstable_protocol=True)
    finally:
        await asyncio.shield(agent.aclose())
