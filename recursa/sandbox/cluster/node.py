"""The node side of `sandbox="ray"`: one actor per Ray node holds that node's REPLs.

Each REPL here is the same local sandbox the driver would start (`"auto"`: the hardened worker,
inside bubblewrap where the node has it), so a REPL on a node has exactly the isolation it would
have on the driver's machine. The actor keeps no model, key or budget: every call-back a REPL makes
(`llm_query`, `rlm_query`, tools) goes to the driver that owns the REPL, which answers it. A context
is materialised once per node (one memfd per context key, from the object store) and every REPL on
the node maps that same buffer.

A driver talks to its host through `exchange` alone: each call carries every request the driver
made since its last call (cells of many REPLs, answers to call-backs, cancellations) and returns
every event ready for that driver (requests done, call-backs asked), waiting for one when none is.
So a step costs one actor call, and a busy driver's steps share calls: the per-call work of Ray
(two processes' task machinery on every node's cores) is paid per batch, not per cell.

This module imports no Ray: the driver wraps `NodeHost` with `ray.remote` (pool.py), so the class
is also testable as a plain object.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from recursa.context import ContextInfo, ContextPayload
from recursa.errors import SandboxError
from recursa.outcomes import error_kind
from recursa.sandbox.base import CallbackError, ExecResult, FinalAnswer, Sandbox
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.pools import MemoryPool
from recursa.sandbox.proc import descendants

# A request from the driver: (request id, method, arguments). Methods: REQUESTS, and "answer"
# (arguments: a list of Answer) and "cancel" (arguments: the request id), which have no reply.
Request = tuple[int, str, tuple[Any, ...]]
# An event for the driver: ("done", request id, True, value) / ("done", request id, False, exception)
# or a call-back, ("call", repl, call id, function, arguments).
Event = tuple[Any, ...]
# An answer to a call-back: (call id, True, value) or (call id, False, (error kind, message)).
Answer = tuple[int, bool, Any]

REQUESTS: Final = frozenset(
    {"open", "close", "load_context", "define", "execute", "get_variable", "variable_names"}
)
_MAX_BATCH = 512  # events handed to the driver per exchange; more go with the next one
# Exchanges of one driver held open waiting for events: one is the driver's standing ear; a second
# is the exchange that carried the latest requests. A third releases the oldest, empty.
_MAX_WAITERS = 2
# While other requests run, a new event waits this long for company before it is delivered, and
# the driver holds a new request as long while others of its are out: busy traffic shares calls.
GATHER_S = 0.002


@dataclass
class Mailbox:
    """One driver's traffic on this host: its requests running, its events, its waiting exchanges."""

    events: list[Event] = field(default_factory=list)
    waiters: deque[asyncio.Future[list[Event]]] = field(default_factory=deque)
    running: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    latest: int = 0  # the highest request id seen: a cancel past it arrived first
    cancelled: set[int] = field(default_factory=set)
    delivering: bool = False

    def take(self) -> list[Event]:
        batch, self.events = self.events[:_MAX_BATCH], self.events[_MAX_BATCH:]
        return batch


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


def _portable(exc: Exception) -> Exception:
    """`exc` as it can cross to the driver: itself when it pickles, else a SandboxError naming it."""
    try:
        pickle.dumps(exc)
    except Exception:
        return SandboxError(f"{type(exc).__name__}: {exc}")
    return exc


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it (its REPL workers), from /proc: a scan
    of every process of the machine, tens of milliseconds with a few hundred (ask rarely)."""
    total = 0
    for pid in {root, *descendants(root)}:
        with contextlib.suppress(OSError, ValueError, IndexError):
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
        self._mail: dict[str, Mailbox] = {}  # client -> its traffic
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
        self._mail.setdefault(client, Mailbox())
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
        box = self._mail.pop(client, None)
        if box is not None:
            for task in box.running.values():
                task.cancel()
            for waiter in box.waiters:
                if not waiter.done():
                    waiter.set_result([])
        repls = [r for r, c in self._owner.items() if c == client]
        await asyncio.gather(*(self._drop(r) for r in repls), return_exceptions=True)
        for call_id, (owner, future) in list(self._waiting.items()):
            if owner == client and not future.done():
                future.set_exception(CallbackError("SandboxError", "the driver that owned this REPL left"))
            if owner == client:
                self._waiting.pop(call_id, None)
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

    # -- the driver's traffic -----------------------------------------------------------------------

    async def exchange(self, client: str, requests: list[Request]) -> list[Event]:
        """Start `requests` (in order), then return the events ready for `client`, waiting for one
        when there is none (or for `close_client`, which returns [])."""
        box = self._mail.setdefault(client, Mailbox())
        for request_id, method, args in requests:
            if method == "answer":
                self.answer(args[0])
            elif method == "cancel":
                task = box.running.get(args[0])
                if task is not None:
                    task.cancel()
                elif args[0] > box.latest:
                    box.cancelled.add(args[0])  # its request comes in a later exchange
            elif method in REQUESTS:
                box.latest = max(box.latest, request_id)
                if request_id in box.cancelled:
                    box.cancelled.discard(request_id)
                    continue
                box.running[request_id] = asyncio.get_running_loop().create_task(
                    self._run(box, request_id, method, args)
                )
            else:
                self._post(box, ("done", request_id, False, SandboxError(f"no request {method!r}")))
        if box.events:
            return box.take()
        if len(box.waiters) >= _MAX_WAITERS:
            oldest = box.waiters.popleft()
            if not oldest.done():
                oldest.set_result([])
        waiter: asyncio.Future[list[Event]] = asyncio.get_running_loop().create_future()
        box.waiters.append(waiter)
        try:
            return await waiter
        finally:
            with contextlib.suppress(ValueError):
                box.waiters.remove(waiter)

    async def _run(self, box: Mailbox, request_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            event: Event = ("done", request_id, True, await getattr(self, method)(*args))
        except asyncio.CancelledError:
            return  # the driver stopped waiting (a timeout, an aborted step) or left
        except Exception as exc:
            event = ("done", request_id, False, _portable(exc))
        finally:
            box.running.pop(request_id, None)
        self._post(box, event)

    def _post(self, box: Mailbox, event: Event) -> None:
        box.events.append(event)
        if box.waiters and not box.delivering:
            # Delivered on the loop's next turn, so events that come ready together travel together.
            box.delivering = True
            if len(box.running) > 1:
                asyncio.get_running_loop().call_later(GATHER_S, self._deliver, box)
            else:
                asyncio.get_running_loop().call_soon(self._deliver, box)

    @staticmethod
    def _deliver(box: Mailbox) -> None:
        box.delivering = False
        while box.events and box.waiters:
            waiter = box.waiters.popleft()
            if not waiter.done():
                waiter.set_result(box.take())

    def _handler(self, client: str, repl: str) -> Callable[[str, dict[str, Any]], Any]:
        async def handle(function: str, args: dict[str, Any]) -> Any:
            box = self._mail.get(client)
            if box is None:
                raise CallbackError("SandboxError", "the driver that owned this REPL left")
            call_id = next(self._ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiting[call_id] = (client, future)
            self._post(box, ("call", repl, call_id, function, args))
            try:
                return await future
            finally:
                self._waiting.pop(call_id, None)

        return handle

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
