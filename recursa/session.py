"""Sessions: several questions over one context, one REPL loaded once, variables kept between questions.

Each question is its own root run (own budget, own trace events, a fresh root conversation), but
all of them share the session's call tree and REPL. Earlier questions and answers reach the model
as the REPL variable `history`, never pasted into its window.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, Protocol

from recursa.config import RLMConfig
from recursa.context import ContextPayload, load_payload
from recursa.errors import ConfigError
from recursa.lm.prices import PriceBook
from recursa.loop.engine import RunEngine
from recursa.loop.options import RunOptions
from recursa.loop.subcalls import SubcallHandler
from recursa.loop.tree import CallTree, new_id
from recursa.result import RLMResult
from recursa.sandbox.base import CallbackError, Sandbox, start_loaded
from recursa.sync import PrivateLoop


class SessionOwner(Protocol):
    """What a session needs from the `RLM` that opens it: the checked configuration, the price
    book, and the per-question checks. A protocol, so `recursa.rlm` imports this module and not
    the other way round."""

    config: RLMConfig
    prices: PriceBook

    def run_options(self, question: str, *, tips: str | None, answer_schema: Any) -> RunOptions: ...


_HISTORY_NOTE = (
    "This is question {n} of a session over the same context. The REPL is the one you used for the "
    "earlier questions: `context` is loaded and the variables you made are still defined. The {k} "
    "earlier question(s) and their answers are in the REPL variable `history`, a list of "
    "{{'question', 'answer', 'stop_reason'}} dicts; read it with code when they matter."
)


class _Relay:
    """The REPL's call-back handler for a whole session: it serves whichever question is running."""

    def __init__(self) -> None:
        self.target: SubcallHandler | None = None

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        if self.target is None:
            raise CallbackError("SubcallError", f"{fn}: no question is being answered right now")
        return await self.target(fn, args)


class Session:
    """Ask with `ask` (blocking) or `aask` (async); close with `close`/`aclose` or a `with` block.

    A blocking session runs on a private event loop in a background thread, so it also works where
    a loop is already running (notebooks). An async session runs on the caller's loop; one session
    answers one question at a time.
    """

    def __init__(self, rlm: SessionOwner, context: Any) -> None:
        self.rlm = rlm
        self.context = context
        self.session_id = new_id("session")
        self.history: list[dict[str, Any]] = []
        self.results: list[RLMResult] = []
        self._payload: ContextPayload | None = None
        self._tree: CallTree | None = None
        self._sandbox: Sandbox | None = None
        self._relay = _Relay()
        self._lock: asyncio.Lock | None = None
        self._closed = False
        self._private: PrivateLoop | None = None  # the loop of a blocking session (recursa/sync.py)
        # A session dropped without close (or open at interpreter exit): its REPL and MCP servers'
        # processes are killed without a loop.
        self._reaper: weakref.finalize[Any, Any] | None = None

    @property
    def trace_path(self) -> Any:
        return self._tree.trace.path if self._tree is not None else None

    @property
    def repl_pid(self) -> int | None:
        """The REPL worker's process id while it runs where this host can see it (None before the
        first question, or for a sandbox without a local process)."""
        pid = getattr(self._sandbox, "pid", None)
        return pid if isinstance(pid, int) else None

    # -- async ---------------------------------------------------------------------------------
    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aask(self, question: str, *, tips: str | None = None, answer_schema: Any = None) -> RLMResult:
        """Answer one more question over the session's context."""
        if self._closed:
            raise ConfigError("this session is closed; open a new one with rlm.session(context).")
        options = self.rlm.run_options(question, tips=tips, answer_schema=answer_schema)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            tree, sandbox, payload = await self._open()
            intro: tuple[str, ...] = ()
            if self.history:
                await sandbox.define([{"name": "history", "kind": "value", "value": self.history}])
                intro = (_HISTORY_NOTE.format(n=len(self.history) + 1, k=len(self.history)),)
            tree.new_budget()
            run_id = new_id("run")
            engine = RunEngine(
                tree,
                question=question,
                payload=payload,
                run_id=run_id,
                options=replace(options, sandbox=sandbox, intro=intro),
            )
            self._relay.target = SubcallHandler(engine)
            try:
                result = await engine.run()
            finally:
                self._relay.target = None
            self.results.append(result)
            self.history.append(
                {"question": question, "answer": result.answer, "stop_reason": result.stop_reason}
            )
            return result

    async def astart(self) -> None:
        """Load the context and start the REPL now (otherwise the first question does), so a bad
        context is reported before anyone types a question."""
        if self._closed:
            raise ConfigError("this session is closed; open a new one with rlm.session(context).")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self._open()

    async def _open(self) -> tuple[CallTree, Sandbox, ContextPayload]:
        """Load the context and start the REPL on the first question."""
        if self._tree is not None and self._sandbox is not None and self._payload is not None:
            return self._tree, self._sandbox, self._payload
        payload = await load_payload(self.context)
        tree = CallTree.create(self.rlm.config, self.rlm.prices, self.session_id, self.rlm.spelling)
        try:
            await tree.connect_mcp()
            sandbox = tree.new_sandbox()
            await start_loaded(sandbox, self._relay, payload)
            tools = tree.config.tools
            if tools:
                problems = await sandbox.define([t.to_worker() for t in tools])
                if problems:
                    tree.trace.emit("warning", run_id=self.session_id, message="; ".join(problems))
        except BaseException:
            # Nothing half-open is kept: the next question (or astart) tries again from the start.
            await asyncio.shield(tree.aclose())
            payload.close()
            raise
        self._payload, self._tree, self._sandbox = payload, tree, sandbox
        self._reaper = weakref.finalize(self, tree.abandon)
        return tree, sandbox, payload

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.detach()
        if self._tree is not None:
            await asyncio.shield(self._tree.aclose())  # reaps the REPL with the rest of the tree
        if self._payload is not None:
            self._payload.close()

    # -- blocking ------------------------------------------------------------------------------
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """The blocking form of `astart`."""
        self._blocking(self.astart())

    def ask(self, question: str, *, tips: str | None = None, answer_schema: Any = None) -> RLMResult:
        return self._blocking(self.aask(question, tips=tips, answer_schema=answer_schema))

    def close(self) -> None:
        if self._private is None:
            if not self._closed and self._tree is None:
                self._closed = True  # never started: nothing to reap
                return
            if self._tree is not None:
                raise ConfigError(
                    "this session runs on an event loop: close it with `await session.aclose()`."
                )
            return
        try:
            self._blocking(self.aclose())
        finally:
            # What is still scheduled there is cancelled first, so no task is destroyed while
            # pending (e.g. a sandbox's process guard).
            self._private.stop()

    def _blocking(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if self._private is None:
            if self._tree is not None:
                coro.close()
                raise ConfigError("this session was started with `await session.aask(...)`; keep using aask.")
            self._private = PrivateLoop("recursa-session")
        return self._private.run(coro)
