"""Server sessions: several chat requests answered over one context, in one REPL that keeps its
variables between them (recursa.session.Session behind an id), each in its caller's namespace.

A client opts in with `extra_body={"recursa": {"session": "<id>"}}`:
- the first request with a new id (or "new": the server picks an unguessable one) opens the
  session, which belongs to the request's caller (recursa.serve.callers): no other caller can
  list, join or close it: its context (from the messages or a
  `recursa.context*` option) and its limits (`max_depth`, `max_iterations`, budget) are the
  session's for good; each question gets a fresh budget with those caps;
- a later request with that id is the next question: its last user message (or
  `recursa.question`) is asked over the session's context, which it need not send again. If it
  does send one, it must be the same: the same `recursa.context*` value, or messages that repeat
  the first request's context messages with only user and assistant turns around them (a chat
  client replaying its conversation). Anything else, or different limits, is a 400;
- requests on one session run one at a time, in arrival order; a session idle for
  `session_ttl_s` is closed and its REPL reaped, as are all of them at shutdown; at most
  `max_sessions` are open, and at most `sessions_per_caller` of one caller (429 past either);
  idle sessions hold at most `idle_sessions_memory_bytes` together (the least recently used
  closed past it, recursa.serve.session_memory);
  `DELETE /v1/recursa/sessions/{id}` closes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.errors import RecursaError
from recursa.result import RLMResult
from recursa.serve.callers import MIN_SHARED_SESSION_ID, new_session_id, quota_of
from recursa.serve.request import NEW_SESSION, SETTING_KEYS, ApiError, RunRequest, bad
from recursa.serve.runs import LiveRun, RunSpec, build_rlm
from recursa.serve.session_memory import over_bound
from recursa.serve.settings import OPERATOR, EventCallback, ServeSettings
from recursa.serve.sources import check_path

ContextKey = tuple[str, Any]  # ("inline", value) | ("path", resolved path) | ("url", url)
_CONVERSATION = ("user", "assistant")


class ServedSession:
    """One open session: its RLM and Session, and what its later requests are checked against."""

    def __init__(
        self,
        owner: str,
        session_id: str,
        settings: ServeSettings,
        spec: RunSpec,
        key: ContextKey,
        docs: list[tuple[str, str]] | None,
    ) -> None:
        self.owner = owner  # the caller it belongs to (recursa.serve.callers)
        self.id = session_id
        self.settings = settings
        # The run settings in force, the operator's where the first request sent none: what a later
        # request that sends settings must repeat.
        self.limits = settings.run_settings() | spec.settings
        self.sampling = dict(spec.root_sampling)  # the root model's sampling options, for good
        self.key = key
        # Fingerprints of the messages that made the context; None when a recursa option named it.
        self.docs = docs
        self._listener: EventCallback | None = None
        self.rlm = build_rlm(settings, spec, self._relay)
        self.session = self.rlm.session(spec.context)
        self.lock = asyncio.Lock()  # held by a request from admission to finish
        self.users = 0  # requests holding or waiting for the lock: a used session never expires
        self.current: LiveRun | None = None
        self.last_used = time.monotonic()
        self.closed = False
        self.broken = False

    def _relay(self, event: dict[str, Any]) -> None:
        # The session's RLM lives longer than any request: its events go to the current one.
        if self._listener is not None:
            self._listener(event)
        elif (operators := self.settings.run.get("on_event")) is not None:
            operators(event)

    async def ask(
        self, question: str, listener: EventCallback, *, tips: str | None = None, answer_schema: Any = None
    ) -> RLMResult:
        self._listener = listener
        try:
            return await self.session.aask(question, tips=tips, answer_schema=answer_schema)
        except asyncio.CancelledError:
            raise  # a cancelled question leaves the REPL as it was; the session goes on
        except Exception:
            # A question that raises instead of stopping (context that cannot load, a REPL that
            # cannot start) leaves nothing to go on with; the service closes the session.
            self.broken = True
            raise
        finally:
            self._listener = None

    def idle_s(self) -> float:
        return time.monotonic() - self.last_used

    @property
    def repl_pid(self) -> int | None:
        return self.session.repl_pid

    async def shut(self) -> None:
        """Close now: cancel a question in progress, then reap the REPL."""
        self.closed = True
        if self.current is not None:
            await self.current.cancel()
        await self.session.aclose()

    def describe(self, *, with_id: bool = True) -> dict[str, Any]:
        trace = self.session.trace_path
        return {
            "id": self.id if with_id else None,
            "object": "recursa.session",
            "questions": len(self.session.history),
            "busy": self.users > 0,
            "idle_s": round(0.0 if self.users else self.idle_s(), 3),
            "trace": trace.name if trace else None,
        }


class SessionStore:
    """The open sessions of one server, their expiry and their closing."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        # (owner, id): a caller sees only its own; two callers' equal ids are different sessions.
        self.open: dict[tuple[str, str], ServedSession] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    # -- requests ------------------------------------------------------------------------------
    async def prepare(self, req: RunRequest, resolve: Callable[[RunRequest], Awaitable[Any]]) -> LiveRun:
        """The run for a request that names a session: the session's first question or its next."""
        assert req.session is not None
        if self.settings.max_sessions == 0:
            raise ApiError(
                403,
                f"sessions are turned off on this server (its operator set {OPERATOR.given('max_sessions', 0)}); "
                "send the request without recursa.session",
                param="recursa.session",
                code="sessions_disabled",
            )
        caller = req.caller
        if req.session == NEW_SESSION:
            req.session = new_session_id()
        handle = self.find(caller.owner, req.session)
        if handle is None:
            if not caller.private and len(req.session) < MIN_SHARED_SESSION_ID:
                raise bad(
                    f"a new session's id must be hard to guess on a server whose key is shared (at least "
                    f"{MIN_SHARED_SESSION_ID} random characters, e.g. a UUID4); or send "
                    f'"session": "{NEW_SESSION}" and use the id the response returns',
                    "recursa.session",
                    "session_id_too_short",
                )
            self._check_room(caller.owner)
            context = await resolve(req)
            handle = self.find(caller.owner, req.session)  # another request may have opened it meanwhile
            if handle is None:
                handle = self._open(req, context)
                return self._run(handle, req.question, req)
        return self._run(handle, self._next_question(handle, req), req)

    def _run(self, handle: ServedSession, question: str, req: RunRequest | None = None) -> LiveRun:
        handle.last_used = time.monotonic()
        spec = RunSpec(question, None)  # its settings are the session RLM's
        if req is not None:  # the answer's shape is per question; sampling is the session's
            spec.answer_schema, spec.tips = req.shape.schema, req.shape.tips()
        return LiveRun(self.settings, spec, handle)

    def _open(self, req: RunRequest, context: Any) -> ServedSession:
        assert req.session is not None
        self._check_room(req.caller.owner)
        docs = None
        if req.explicit is None:
            made_of = list(req.docs)
            if req.completion_mode and req.asked:
                made_of.append(("user", f"[user]\n{req.asked}"))  # the request itself became the context
            docs = _fingerprints(made_of)
        spec = RunSpec(req.question, context, settings=dict(req.settings))
        spec.root_sampling = dict(req.shape.sampling)
        return self.create(req.caller.owner, req.session, spec, self._key(req), docs)

    def create(
        self,
        owner: str,
        session_id: str,
        spec: RunSpec,
        key: ContextKey,
        docs: list[tuple[str, str]] | None = None,
    ) -> ServedSession:
        """Open `owner`'s session `session_id` (the chat API and the MCP tools both come here)."""
        self._check_room(owner)
        try:
            handle = ServedSession(owner, session_id, self.settings, spec, key, docs)
        except (RecursaError, ValueError) as exc:
            raise ApiError(
                400, f"cannot start the session: {exc}", code="invalid_run_settings"
            ) from None
        self.open[(owner, session_id)] = handle
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="recursa-session-reaper")
        return handle

    def _check_room(self, owner: str) -> None:
        """429 unless the server, and `owner`'s share of it, have room for one more session."""
        self.expire()
        ways = (
            "close one (DELETE /v1/recursa/sessions/{id}, or the MCP tool recursa_session_close), wait "
            f"for idle ones to expire ({self.settings.session_ttl_s:g} s), or send the request without "
            "recursa.session"
        )
        if len(self.open) >= self.settings.max_sessions:
            raise ApiError(
                429,
                f"this server already has {len(self.open)} open sessions, its limit (--max-sessions); {ways}",
                type="rate_limit_error",
                param="recursa.session",
                code="too_many_sessions",
                retry=False,  # room comes when a session closes or expires, not in seconds
            )
        quota = quota_of(owner)
        mine = sum(1 for held, _ in self.open if quota_of(held) == quota)
        cap = self.settings.sessions_per_caller
        if mine >= cap:
            raise ApiError(
                429,
                f"you already have {mine} open sessions, the limit per caller on this server "
                f"({OPERATOR.given('max_sessions_per_caller', cap)}, ServeSettings.max_sessions_per_caller); {ways}",
                type="rate_limit_error",
                param="recursa.session",
                code="too_many_sessions_per_caller",
                retry=False,  # room comes when a session closes or expires, not in seconds
            )

    def _key(self, req: RunRequest) -> ContextKey:
        if req.explicit == "context_path":
            assert req.context_path is not None
            return ("path", str(check_path(req.context_path, self.settings.context_roots)))
        if req.explicit == "context_url":
            return ("url", req.context_url)
        return ("inline", req.context)

    def _next_question(self, handle: ServedSession, req: RunRequest) -> str:
        """A later request's question, once its context and limits are checked against the session's."""
        if not req.asked.strip():
            raise bad("the question is empty: the last user message (or recursa.question) is the question")
        if req.explicit is not None:
            same = self._key(req) == handle.key
        elif handle.docs is None or not req.docs:
            same = True  # nothing re-sent (messages beside a recursa.context* option never counted)
        else:
            same = _replays(handle.docs, _fingerprints(req.docs))
        if not same:
            raise bad(
                f"session {handle.id!r} keeps the context of its first request, and this request sends "
                "a different one. Send later questions of a session without context (or with exactly "
                "the same), or open a new session (a new id) for the new context.",
                "recursa.session",
                "session_context_mismatch",
            )
        asked = self.settings.run_settings() | req.settings
        if req.sent & SETTING_KEYS and asked != handle.limits:
            raise bad(
                f"session {handle.id!r} keeps the run settings (max_depth, max_iterations, budget, ...) "
                "of its first request; send the same values (or none), or open a new session to change them",
                "recursa.session",
                "session_settings_mismatch",
            )
        if req.shape.sampling and req.shape.sampling != handle.sampling:
            raise bad(
                f"session {handle.id!r} keeps the sampling fields of its first request "
                f"({', '.join(sorted(handle.sampling)) or 'none'}); send the same values (or none), or open "
                "a new session to change them",
                "recursa.session",
                "session_settings_mismatch",
            )
        return req.asked

    def find(self, owner: str, session_id: str) -> ServedSession | None:
        """`owner`'s open session `session_id`; another caller's is None, as if it did not exist."""
        self.expire()
        return self.open.get((owner, session_id))

    def owned_by(self, owner: str) -> list[ServedSession]:
        self.expire()
        return [h for (o, _), h in self.open.items() if o == owner]

    # -- admission (the chat service holds a session's lock around each of its runs) -----------
    def admitted(self, run: LiveRun) -> None:
        """The run holds its session's lock: it may go ahead unless the session closed meanwhile."""
        handle = run.session
        assert handle is not None
        if handle.closed:
            self.release(run)
            raise ApiError(
                404,
                f"session {handle.id!r} was closed while this request waited for it",
                param="recursa.session",
                code="session_closed",
            )
        handle.current = run

    def release(self, run: LiveRun) -> None:
        handle = run.session
        assert handle is not None
        handle.current = None
        handle.users -= 1
        handle.last_used = time.monotonic()
        handle.lock.release()
        if handle.broken and self.open.get((handle.owner, handle.id)) is handle:
            del self.open[(handle.owner, handle.id)]
            self._close_later(handle)
        self.bound_memory()

    def bound_memory(self) -> None:
        """Close the least recently used idle sessions while the idle ones hold more memory than
        `idle_sessions_memory_bytes` together (recursa.serve.session_memory)."""
        idle = {id(h): (where, h) for where, h in self.open.items() if h.users == 0 and not h.closed}
        for handle in over_bound([h for _, h in idle.values()], self.settings.idle_sessions_memory_bytes):
            where, _ = idle[id(handle)]
            del self.open[where]
            self._close_later(handle)

    # -- closing -------------------------------------------------------------------------------
    def expire(self) -> None:
        ttl = self.settings.session_ttl_s
        for where, handle in list(self.open.items()):
            if handle.users == 0 and handle.idle_s() > ttl:
                del self.open[where]
                self._close_later(handle)

    def _close_later(self, handle: ServedSession) -> None:
        handle.closed = True
        task = asyncio.create_task(handle.shut(), name=f"recursa-session-close-{handle.id}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self, owner: str, session_id: str) -> bool:
        handle = self.open.pop((owner, session_id), None)
        if handle is None:
            return False
        await handle.shut()
        return True

    async def _reap(self) -> None:
        # Checked a few times per TTL, so a session outlives its TTL by at most a quarter of it.
        interval = min(max(self.settings.session_ttl_s / 4, 0.05), 30.0)
        while self.open:
            await asyncio.sleep(interval)
            self.expire()
            self.bound_memory()

    async def aclose(self) -> None:
        """Close every session (server shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        handles, self.open = list(self.open.values()), {}
        await asyncio.gather(*(h.shut() for h in handles), *self._closing, return_exceptions=True)


def _replays(session_docs: list[tuple[str, str]], docs: list[tuple[str, str]]) -> bool:
    """True when `docs` hold the session's documents in order, with nothing around them but user
    and assistant turns (a chat client sending its conversation so far)."""
    matched = 0
    for doc in docs:
        if matched < len(session_docs) and doc == session_docs[matched]:
            matched += 1
        elif doc[0] not in _CONVERSATION:
            return False
    return matched == len(session_docs)


def _fingerprints(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    # A session keeps digests, not a second copy of every document it was opened with.
    return [(kind, hashlib.blake2b(text.encode("utf-8", "surrogatepass")).hexdigest()) for kind, text in docs]
