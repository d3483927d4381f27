"""`sandbox="ray"`: a REPL on a node of a Ray cluster, with the isolation it would have locally.

    RLM(..., sandbox="ray", sandbox_options={"address": "auto", "resources": {"repl_node": 0.001}})

The REPL is the local sandbox of the node it lands on (`"auto"`, or `kind=`), run by that node's
host actor (node.py); this object is its stand-in on the driver and speaks the same `Sandbox`
protocol, so the engine, budgets, traces and sub-calls do not change. Placement: the nodes that
have every resource in `resources` and every label in `labels`, the node of the same call tree first
(`affinity`; `placement="spread"` drops that), then the least loaded; at most `max_repls_per_node`
live REPLs on a node. `transport`: how the driver reaches each node's host (relay.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any, Literal

from recursa.context import ContextPayload
from recursa.errors import ConfigError, SandboxError
from recursa.sandbox.base import CallHandler, ExecResult, FinalAnswer, Sandbox
from recursa.sandbox.cluster.link import Node
from recursa.sandbox.cluster.pool import RayPool, import_ray, pool_for_loop
from recursa.sandbox.cluster.relay import TRANSPORTS, Transport

# Local sandboxes a node may run for a REPL: the ones that start a process on the node itself.
NODE_KINDS = ("auto", "subprocess")
_CALL_MARGIN_S = 30.0  # past a cell's own deadline (grace, restore) before the node is presumed hung


class RaySandbox:
    """A persistent REPL on a Ray node; sub-calls, tools and the budget stay on the driver."""

    name = "ray"

    def __init__(
        self,
        *,
        make_sandbox: Callable[..., Sandbox],
        address: str | None = None,
        kind: str = "auto",
        resources: dict[str, float] | None = None,
        labels: dict[str, str] | None = None,
        max_repls_per_node: int | None = None,
        affinity: str | None = None,
        placement: Literal["tree", "spread"] = "tree",
        memory_group: str | None = None,
        memory_bytes: int | str | None = None,
        start_timeout: float = 60.0,
        transport: Transport = "auto",
        **node_options: Any,
    ) -> None:
        import_ray()  # a ConfigError naming the extra, at construction
        if kind not in NODE_KINDS:
            raise ConfigError(
                f'sandbox="ray" runs a local sandbox on each node: kind={kind!r} is not one; '
                f"choose one of {', '.join(NODE_KINDS)}"
            )
        if placement not in ("tree", "spread"):
            raise ConfigError(
                f'sandbox_options placement={placement!r}: give "tree" (a call tree\'s REPLs on one node) '
                'or "spread" (each REPL on the least loaded node)'
            )
        if transport not in TRANSPORTS:
            raise ConfigError(
                f'sandbox_options transport={transport!r}: give "auto" (the relay through the Ray Client, '
                'else the stream), "stream" (TCP from this driver to each node) or "relay" (Ray actor calls)'
            )
        if max_repls_per_node is not None and max_repls_per_node < 1:
            raise ConfigError(f"sandbox_options max_repls_per_node={max_repls_per_node!r}: give an int >= 1")
        self._make_sandbox = make_sandbox
        self.address = address
        self.kind = kind
        self.resources = dict(resources or {})
        self.labels = dict(labels or {})
        self.max_repls_per_node = max_repls_per_node
        self.affinity = affinity if placement == "tree" else None
        self.start_timeout = start_timeout
        self.transport = transport
        # An environment's memory bound (RLMEnv(max_memory_bytes=)): its REPLs on each node share
        # one kernel-enforced pool there, the bound split over the nodes the placement allows.
        self.memory = {"group": memory_group, "bytes": memory_bytes} if memory_group else None
        self.node_options = node_options  # passed to the node's local sandbox
        self._idle_word = node_options.get("snapshots") == "idle"
        self.repl = uuid.uuid4().hex
        self.node: Node | None = None
        self.isolation: dict[str, Any] = {"level": "ray", "node": None}
        self._pool: RayPool | None = None

    @property
    def pool(self) -> RayPool:
        if self._pool is None:
            raise SandboxError("this Ray REPL is not started")
        return self._pool

    async def start(self, handler: CallHandler) -> None:
        await self._start(handler, None)

    async def start_loaded(self, handler: CallHandler, payload: ContextPayload) -> None:
        """`start`, then `load_context(payload)`, in one request to the node when the node has the
        context already (a REPL of the same task there loaded it): the REPL's start and its load are
        one round trip and one frame each way (recursa.sandbox.base.start_loaded)."""
        reply = await self._start(handler, payload.info.sha256)
        if reply["load_error"] is not None:
            raise reply["load_error"]
        if reply["loaded"]:
            self.pool.holds(self.repl, payload)
        else:
            self._report(await self.pool.load_context(self.repl, payload, ask=False))

    async def _start(self, handler: CallHandler, context: str | None) -> dict[str, Any]:
        self._pool = pool_for_loop(self.address, self._make_sandbox)
        self.node, reply = await self._pool.open(
            self.repl, handler, options=self.node_options, kind=self.kind, resources=self.resources,
            labels=self.labels, max_repls_per_node=self.max_repls_per_node, affinity=self.affinity,
            memory=self.memory, timeout=self.start_timeout, transport=self.transport, context=context,
        )  # fmt: skip
        self._report(reply.get("isolation", {}))
        return reply

    def _report(self, isolation: dict[str, Any]) -> None:
        """The node REPL's own isolation report, and which node it is on."""
        assert self.node is not None
        self.isolation = {**isolation, "ray_node": self.node.node_id, "ray_node_address": self.node.address}

    async def load_context(self, payload: ContextPayload) -> None:
        # A load sets the limits that follow from the context's size (hardened.py): report them.
        self._report(await self.pool.load_context(self.repl, payload))

    async def define(self, entries: list[dict[str, Any]]) -> list[str]:
        return list(await self.pool.call(self.repl, "define", entries=entries))

    async def execute(self, code: str, timeout: float) -> ExecResult:
        async with asyncio.timeout(timeout + _CALL_MARGIN_S):
            result: ExecResult = await self.pool.call(self.repl, "execute", code=code, timeout=timeout)
        if self._idle_word:  # the node's REPL snapshots on this loop's clock, as a local one does
            self.pool.idle_soon(self.repl)
        return result

    async def get_variable(self, name: str, timeout: float | None = None) -> FinalAnswer | None:
        answer: FinalAnswer | None = await self.pool.call(
            self.repl, "get_variable", name=name, timeout=timeout
        )
        return answer

    async def variable_names(self) -> list[str]:
        return list(await self.pool.call(self.repl, "variable_names"))

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close(self.repl)

    def kill_now(self) -> None:
        if self._pool is not None:
            self._pool.close_soon(self.repl)
