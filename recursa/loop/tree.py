"""State shared by every run of one call tree: the ledger, the model gateway, the trace."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from recursa.budget import Ledger
from recursa.config import PYTHON, RLMConfig, Spelling
from recursa.errors import ConfigError, SandboxError
from recursa.lm.call_cache import CallCache
from recursa.lm.gateway import ClientSettings, ModelGateway
from recursa.lm.images import ImageHold
from recursa.lm.limiter import Limiter
from recursa.lm.prices import PriceBook
from recursa.lm.retry import RetryBudget, RetryPolicy
from recursa.lm.windows import ContextWindows
from recursa.sandbox import SANDBOXES, make_sandbox
from recursa.sandbox.base import Sandbox
from recursa.sandbox.forkserver import ForkServer
from recursa.tools.mcp_tools import McpServers
from recursa.tools.runner import ToolRunner
from recursa.trace.redact import Redactor
from recursa.trace.writer import TraceWriter, default_trace_dir


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


class ReplBound(Protocol):
    """A bound on live REPLs shared by several call trees (recursa.env's quota)."""

    def take(self) -> None: ...

    async def take_for_run(self, depth: int, ancestors: tuple[str, ...], seconds: float) -> None: ...

    def give(self) -> None: ...


@dataclass
class CallTree:
    config: RLMConfig
    ledger: Ledger
    gateway: ModelGateway
    trace: TraceWriter
    tool_runner: ToolRunner = field(default_factory=lambda: ToolRunner.of([]))
    live_sandboxes: set[Sandbox] = field(default_factory=set)
    _child_slots: dict[int, asyncio.Semaphore] = field(default_factory=dict)
    _closing: dict[Sandbox, asyncio.Future[None]] = field(default_factory=dict)  # closes under way
    fork_server: ForkServer | None = None  # forks the REPLs of a tree with child RLMs (new_sandbox)
    # A bound on REPLs shared with other trees (recursa.env): a slot is taken before a REPL starts
    # (take_for_run may wait for one, or raise an error that says what to do), given back once the
    # REPL is closed.
    repl_quota: ReplBound | None = None
    abandoned: bool = False  # abandon() ran: no REPL may start any more
    # recursa.env: the trainer runs rlm_query's children itself (SkyRL's subcall_fn), as
    # `async fn(prompt, context, depth, parent_id) -> str`; None: recursa child runs.
    child_call: Any = None
    mcp: McpServers | None = None  # connect_mcp(): the tree's own MCP servers, closed by aclose
    # Where this tree's REPLs gather on a cluster (sandbox="ray"): children next to their parent.
    placement: str = field(default_factory=lambda: new_id("tree"))
    spelling: Spelling = PYTHON  # how the tree's caller writes settings, for the runs' stop reasons
    # The bytes of image URLs that its calls in flight fetched and hold (lm/images.py bounds them).
    image_hold: ImageHold = field(default_factory=ImageHold)

    @classmethod
    def create(
        cls, config: RLMConfig, prices: PriceBook, root_run_id: str, spelling: Spelling = PYTHON
    ) -> CallTree:
        redactor = Redactor([config.api_key])
        path: Path | None = None
        if config.trace:
            directory = Path(config.trace_dir) if config.trace_dir else default_trace_dir()
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = directory / f"{stamp}-{root_run_id}.jsonl"
        listeners = [config.on_event] if config.on_event else []
        trace = TraceWriter(path, redactor, listeners)
        ledger = Ledger(config.budget)
        limiter = Limiter(config.max_concurrency, per_model=config.per_model_concurrency)
        settings = ClientSettings(
            base_url=config.base_url,
            api_key=config.api_key,
            timeout=config.request_timeout,
            retry=RetryPolicy(max_attempts=config.max_retries + 1),
            run_retries=RetryBudget(config.max_run_retries),  # one count for every call of the tree
            call_headers=config.call_headers,
            sampling={role: dict(opts) for role, opts in (config.sampling or {}).items()},
        )
        gateway = ModelGateway(ledger=ledger, limiter=limiter, prices=prices, trace=trace, settings=settings)
        gateway.windows = ContextWindows(config.context_windows)
        if config.cache_subcalls:
            gateway.call_cache = CallCache()
        if config.clients:
            gateway.share(config.clients)  # the user's own client objects: used, never closed here
        return cls(config, ledger, gateway, trace, _tool_runner(config, redactor), spelling=spelling)

    async def connect_mcp(self) -> None:
        """Connect the MCP servers of `config.mcp_servers` (before any run of the tree starts): their
        tools join this tree's REPL tools and sub-model tools, and aclose() closes them. Servers
        connected already (an `McpServers` in the list, e.g. an ACP session's) are used, not closed."""
        if not self.config.mcp_servers or self.mcp is not None:
            return
        shared = [g for g in self.config.mcp_servers if isinstance(g, McpServers)]
        specs = [s for s in self.config.mcp_servers if not isinstance(s, McpServers)]
        self.mcp = await McpServers.connect(specs)
        config = self.config
        taken = {t.name for t in [*config.tools, *config.sub_tools]}
        every = McpServers([*(c for g in shared for c in g.connections), *self.mcp.connections])
        repl, sub = every.tools(taken)
        self.config = config.replace(tools=[*config.tools, *repl], sub_tools=[*config.sub_tools, *sub])
        self.tool_runner = _tool_runner(self.config, self.trace.redact)

    def new_budget(self) -> None:
        """A fresh ledger (caps and deadline) and retry allowance for the next question of a session."""
        self.ledger = Ledger(self.config.budget)
        self.gateway.ledger = self.ledger
        self.gateway.settings.run_retries = RetryBudget(self.config.max_run_retries)

    def child_slots(self, depth: int) -> asyncio.Semaphore:
        """Caps child runs (each starts a REPL process) at one depth. One cap per depth, not one
        for the tree: a child waiting for its own children must not hold the slots they need."""
        if depth not in self._child_slots:
            self._child_slots[depth] = asyncio.Semaphore(self.config.max_parallel_children)
        return self._child_slots[depth]

    def show_scratch(self, sandbox: Sandbox) -> None:
        """Host messages name paths in `sandbox`'s own folder relative to it (trace/hostpaths.py)."""
        scratch = getattr(sandbox, "scratch_dir", None)
        shown = self.trace.redact.shown
        if isinstance(scratch, str) and scratch not in shown:
            shown.append(scratch)

    async def open_sandbox(self, depth: int, ancestors: tuple[str, ...]) -> Sandbox:
        """`new_sandbox` for a run at `depth` below the runs `ancestors` (its parent first), after
        its slot of a shared REPL bound: a child RLM may wait for one (as long as its parent's cell
        may run), which its ancestors' slots are reported as waiting for (recursa/env/quota.py)."""
        if self.repl_quota is None:
            return self.new_sandbox()
        await self.repl_quota.take_for_run(depth, ancestors, self.config.exec_timeout)
        return self.new_sandbox(slot_taken=True)

    def new_sandbox(self, *, slot_taken: bool = False) -> Sandbox:
        """A new REPL (not started); `slot_taken`: its slot of the REPL bound is held already."""
        if self.repl_quota is not None and not slot_taken:
            self.repl_quota.take()
        try:
            sandbox = self._make_sandbox()
        except BaseException:
            if self.repl_quota is not None:
                self.repl_quota.give()
            raise
        self.live_sandboxes.add(sandbox)
        return sandbox

    def _make_sandbox(self) -> Sandbox:
        if self.abandoned:  # a REPL that started after abandon() would have nobody to reap it
            raise SandboxError("this run was abandoned (its owner dropped it); no REPL starts for it")
        options = {"max_output_chars": self.config.max_output_chars, **(self.config.sandbox_options or {})}
        if self.config.sandbox == "ray":
            options.setdefault("affinity", self.placement)
        if (
            self.config.max_depth >= 2
            and SANDBOXES[self.config.sandbox].forks
            and "fork_server" not in options
        ):
            # Child RLMs start REPLs in bursts (rlm_query_batched): fork them from one warm zygote
            # (sandbox/forkserver.py) rather than start each anew. sandbox_options={"fork_server":
            # None} turns that off; a ForkServer of your own shares one zygote across trees.
            if self.fork_server is None:
                self.fork_server = ForkServer()
            options["fork_server"] = self.fork_server
        try:
            return make_sandbox(self.config.sandbox, **options)
        except TypeError as exc:  # an option the sandbox does not take
            raise ConfigError(
                f"«sandbox_options» does not fit sandbox {self.config.sandbox!r}: {exc}. "
                "See the sandbox's constructor (recursa.sandbox) for the options it accepts."
            ) from None

    async def release_sandbox(self, sandbox: Sandbox) -> None:
        """Close a run's REPL. The close is a task of its own: a caller cancelled while it waits
        cannot cut it short (a half-closed REPL would keep running), and aclose() waits for it."""
        closing = self._closing.get(sandbox)
        if closing is None:
            if sandbox in self.live_sandboxes and self.repl_quota is not None:
                self.repl_quota.give()
            self.live_sandboxes.discard(sandbox)
            closing = asyncio.ensure_future(sandbox.close())
            self._closing[sandbox] = closing
            closing.add_done_callback(lambda _f: self._closing.pop(sandbox, None))
        await asyncio.shield(closing)

    def abandon(self) -> None:
        """Without an event loop (the finalizer of an abandoned episode, interpreter exit): kill
        every REPL process now and close the trace. aclose() is the orderly way."""
        self.abandoned = True
        for sandbox in list(self.live_sandboxes):
            self.live_sandboxes.discard(sandbox)
            if self.repl_quota is not None:
                self.repl_quota.give()
            kill_now = getattr(sandbox, "kill_now", None)
            if kill_now is not None:
                kill_now()
        if self.mcp is not None:
            self.mcp.kill_now()
        self.trace.close()

    async def aclose(self) -> None:
        """Reap every REPL process still alive (after a cancellation), wait for closes already
        under way, then close clients and trace. The REPLs close at once, not one after another:
        a batch of stuck children costs the time of one kill, so a run ends soon after its deadline."""
        sandboxes = {*self.live_sandboxes, *self._closing}
        outcomes = await asyncio.gather(*(self.release_sandbox(s) for s in sandboxes), return_exceptions=True)
        if self.fork_server is not None:
            await self.fork_server.close()  # after the sandboxes: its workers end with it
            self.fork_server = None
        if self.mcp is not None:
            mcp, self.mcp = self.mcp, None
            await mcp.aclose()
        try:
            await self.gateway.aclose()
        finally:
            self.trace.close()  # last: children cancelled by the closes above have written run_end
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


def _tool_runner(config: RLMConfig, redactor: Redactor) -> ToolRunner:
    """One runner for the tree's host tools (a tool in both lists is one tool, with one call count)."""
    host_tools = [t for t in [*config.tools, *config.sub_tools] if t.where == "host"]
    unique = list({id(t.fn): t for t in host_tools}.values())
    return ToolRunner.of(unique, redactor)
