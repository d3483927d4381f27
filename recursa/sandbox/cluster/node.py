"""The node side of `sandbox="ray"`: one actor per Ray node holds that node's REPLs.

Each REPL here is the same local sandbox the driver would start (`"auto"`: the hardened worker,
inside bubblewrap where the node has it), so a REPL on a node has exactly the isolation it would
have on the driver's machine. The actor keeps no model, key or budget: every call-back a REPL makes
(`llm_query`, `rlm_query`, tools) is queued for the driver that owns the REPL, which fetches the
queue with `next_calls` and answers with `answer`. A context is materialised once per node (one
memfd per context key, from the object store) and every REPL on the node maps that same buffer.

This module imports no Ray: the driver wraps `NodeHost` with `ray.remote` (pool.py), so the class
is also testable as a plain object.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recursa.context import ContextInfo, ContextPayload
from recursa.errors import SandboxError
from recursa.outcomes import error_kind
from recursa.sandbox.base import CallbackError, ExecResult, FinalAnswer, Sandbox
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.pools import MemoryPool

# A call-back as it crosses to the driver: (client, repl, call id, function, arguments).
Call = tuple[str, str, int, str, dict[str, Any]]
# An answer as it comes back: (call id, True, value) or (call id, False, (error kind, message)).
Answer = tuple[int, bool, Any]

_MAX_BATCH = 512  # call-backs handed to the driver per fetch; more wait for the next one


@dataclass
class NodeContext:
    """A context's bytes in a memfd on this node, shared by every REPL here that loads it."""

    fd: int
    kind: str
    size_bytes: int
    byte_lengths: list[int]
    keys: list[str]
    info: ContextInfo
    users: set[str] = field(default_factory=set)

    def payload(self) -> ContextPayload:
        """A payload over a descriptor of its own (the sandbox closes or keeps it as it likes)."""
        return ContextPayload(
            self.kind, os.dup(self.fd), self.size_bytes, list(self.byte_lengths), list(self.keys), self.info
        )


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it (its REPL workers), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(b")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    total = 0
    for pid in tree:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/statm", "rb") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


class NodeHost:
    """Every REPL of this process's drivers on one node, behind a handful of async methods."""

    def __init__(
        self,
        make_sandbox: Callable[..., Sandbox],
        *,
        kind: str = "auto",
        max_repls: int | None = None,
        fork: bool = True,
    ) -> None:
        self._make_sandbox = make_sandbox
        self.kind = kind
        self.max_repls = max_repls
        # REPLs on a node start in bursts (an environment's episodes, a batch of children): as on
        # one machine, they fork from one warm zygote rather than each start an interpreter.
        self._fork = fork
        self._fork_server: ForkServer | None = None
        self.repls: dict[str, Sandbox] = {}
        self._owner: dict[str, str] = {}  # repl -> the client (driver-side pool) it answers to
        self._contexts: dict[str, NodeContext] = {}
        self._loading: dict[str, asyncio.Future[NodeContext]] = {}
        self._outbox: dict[str, asyncio.Queue[Call]] = {}
        self._waiting: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._ids = itertools.count(1)
        self.opened = 0  # REPLs ever started here
        self._pools: dict[str, MemoryPool] = {}  # environment -> its memory pool on this node
        self._repl_pool: dict[str, str] = {}

    # -- facts ------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Where this host runs and how full it is."""
        return {"hostname": socket.gethostname(), "pid": os.getpid(), "live_repls": len(self.repls),
                "opened": self.opened, "contexts": len(self._contexts), "rss_bytes": tree_rss(os.getpid())}  # fmt: skip

    # -- REPL life ---------------------------------------------------------------------------------

    async def open(self, client: str, repl: str, options: dict[str, Any],
                   memory: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """Start a REPL for `client`; its isolation report, or {"full": True} at this node's bound.

        `memory` ({"group", "bytes", "nodes"}): the environment's memory bound, of which this node's
        REPLs of that environment hold at most bytes / nodes ("auto": three quarters of this node's
        memory), enforced by the kernel over them together (sandbox/pools.py)."""
        if self.max_repls is not None and len(self.repls) >= self.max_repls:
            return {"full": True}
        if memory is not None:
            pool = self._memory_pool(memory)
            if pool.full():
                return {"full": True}
            options = {**options, "memory_pool": pool}
            self._repl_pool[repl] = memory["group"]
        if self._fork and "fork_server" not in options:
            if self._fork_server is None:
                self._fork_server = ForkServer()
            options = {**options, "fork_server": self._fork_server}
        sandbox = self._make_sandbox(self.kind, **options)
        self.opened += 1
        self.repls[repl] = sandbox
        self._owner[repl] = client
        self._outbox.setdefault(client, asyncio.Queue())
        try:
            await sandbox.start(self._handler(client, repl))
        except BaseException:
            await self._drop(repl)
            raise
        return {"isolation": dict(sandbox.isolation), "pid": getattr(sandbox, "pid", None)}

    def _memory_pool(self, memory: dict[str, Any]) -> MemoryPool:
        pool = self._pools.get(memory["group"])
        if pool is None:
            total = memory["bytes"]
            if total == "auto":
                share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4
            else:
                share = max(64 << 20, int(total) // max(1, int(memory.get("nodes", 1))))
            pool = self._pools[memory["group"]] = MemoryPool(share)
        return pool

    async def close(self, repl: str) -> None:
        await self._drop(repl)

    async def close_client(self, client: str) -> int:
        """Close every REPL of one driver-side pool (its loop ended); how many there were."""
        repls = [r for r, c in self._owner.items() if c == client]
        await asyncio.gather(*(self._drop(r) for r in repls), return_exceptions=True)
        for call_id, (owner, future) in list(self._waiting.items()):
            if owner == client and not future.done():
                future.set_exception(CallbackError("SandboxError", "the driver that owned this REPL left"))
            if owner == client:
                self._waiting.pop(call_id, None)
        self._outbox.pop(client, None)
        return len(repls)

    async def _drop(self, repl: str) -> None:
        sandbox = self.repls.pop(repl, None)
        self._owner.pop(repl, None)
        for key in [k for k, c in self._contexts.items() if repl in c.users]:
            context = self._contexts[key]
            context.users.discard(repl)
            if not context.users:
                del self._contexts[key]
                os.close(context.fd)
        if sandbox is not None:
            await sandbox.close()
        group = self._repl_pool.pop(repl, None)
        if group is not None and group not in self._repl_pool.values():
            pool = self._pools.pop(group, None)  # the environment has no REPL here any more
            if pool is not None:
                pool.close()

    def _repl(self, repl: str) -> Sandbox:
        sandbox = self.repls.get(repl)
        if sandbox is None:
            raise SandboxError(f"no REPL {repl!r} on this node (it was closed)")
        return sandbox

    # -- the Sandbox protocol, per REPL ------------------------------------------------------------

    async def load_context(self, repl: str, key: str, meta: dict[str, Any], data: list[Any]) -> None:
        """Load the context `key` into `repl`; `data` is [object ref] (in a list, so Ray does not
        fetch it to this node unless the context is not here yet)."""
        sandbox = self._repl(repl)
        context = await self._context(key, meta, data)
        context.users.add(repl)
        payload = context.payload()
        try:
            await sandbox.load_context(payload)
        finally:
            payload.close()

    async def _context(self, key: str, meta: dict[str, Any], data: list[Any]) -> NodeContext:
        if key in self._contexts:
            return self._contexts[key]
        loading = self._loading.get(key)
        if loading is None:
            loading = asyncio.get_running_loop().create_future()
            self._loading[key] = loading
            try:
                loading.set_result(await self._materialise(meta, data[0]))
            except BaseException as exc:
                loading.set_exception(exc)
                loading.exception()  # retrieved here: concurrent loaders re-raise it themselves
            finally:
                self._loading.pop(key, None)
        context = await asyncio.shield(loading)
        self._contexts.setdefault(key, context)
        return self._contexts[key]

    @staticmethod
    async def _materialise(meta: dict[str, Any], ref: Any) -> NodeContext:
        buffer = await ref  # from this node's object store: the bytes crossed the network once
        fd = os.memfd_create("recursa-context", os.MFD_CLOEXEC)
        try:
            view = memoryview(buffer).cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        except BaseException:
            os.close(fd)
            raise
        return NodeContext(fd, meta["kind"], meta["size_bytes"], meta["byte_lengths"], meta["keys"],
                           meta["info"])  # fmt: skip

    async def define(self, repl: str, entries: list[dict[str, Any]]) -> list[str]:
        return await self._repl(repl).define(entries)

    async def execute(self, repl: str, code: str, timeout: float) -> ExecResult:
        return await self._repl(repl).execute(code, timeout)

    async def get_variable(self, repl: str, name: str, timeout: float | None) -> FinalAnswer | None:
        return await self._repl(repl).get_variable(name, timeout)

    async def variable_names(self, repl: str) -> list[str]:
        return await self._repl(repl).variable_names()

    # -- call-backs to the driver ------------------------------------------------------------------

    def _handler(self, client: str, repl: str) -> Callable[[str, dict[str, Any]], Any]:
        async def handle(function: str, args: dict[str, Any]) -> Any:
            call_id = next(self._ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiting[call_id] = (client, future)
            queue = self._outbox.get(client)
            if queue is None:
                raise CallbackError("SandboxError", "the driver that owned this REPL left")
            queue.put_nowait((client, repl, call_id, function, args))
            try:
                return await future
            finally:
                self._waiting.pop(call_id, None)

        return handle

    async def next_calls(self, client: str) -> list[Call]:
        """The call-backs waiting for `client`'s answers: at least one (this waits for it)."""
        queue = self._outbox.setdefault(client, asyncio.Queue())
        batch = [await queue.get()]
        while len(batch) < _MAX_BATCH and not queue.empty():
            batch.append(queue.get_nowait())
        return batch

    def answer(self, answers: list[Answer]) -> None:
        for call_id, ok, value in answers:
            entry = self._waiting.get(call_id)
            if entry is None or entry[1].done():
                continue  # the cell that asked ended (timeout, restart) before the answer came
            if ok:
                entry[1].set_result(value)
            else:
                kind, message = value
                entry[1].set_exception(CallbackError(error_kind(str(kind)), str(message)))

    async def shutdown(self) -> None:
        for repl in list(self.repls):
            with contextlib.suppress(Exception):
                await self._drop(repl)
        if self._fork_server is not None:
            await self._fork_server.close()
            self._fork_server = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
