"""The node side of `sandbox="ray"`: one actor per Ray node holds that node's REPLs.

Each REPL here is the same local sandbox the driver would start (`"auto"`: the hardened worker,
inside bubblewrap where the node has it), so a REPL on a node has exactly the isolation it would
have on the driver's machine. The actor keeps no model, key or budget: every call-back a REPL makes
(`llm_query`, `rlm_query`, tools) goes to the driver that owns the REPL, which answers it. A context
is materialised once per node (one memfd per context key, from the object store) and every REPL on
the node maps that same buffer.

A driver's event loop talks to its host through an actor call or two when it first puts a REPL
here (`listen`, with the token its stream must show; `remember_options`) and then over its stream
(wire.py): requests come in as frames and run as tasks, results and the REPLs' call-backs go out as
frames. A stream that ends (the driver left, or its connection broke) closes that driver's REPLs.

This module imports no Ray: the driver wraps `NodeHost` with `ray.remote` (pool.py), so the class
is also testable as a plain object.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
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
from recursa.sandbox.cluster import wire
from recursa.sandbox.forkserver import ForkServer
from recursa.sandbox.pools import MemoryPool
from recursa.sandbox.proc import descendants

_MAX_UNAUTHENTICATED = 64  # connections waiting to show a token; more are closed at once
# With snapshots="idle", a REPL here forks its snapshot after a cell on its driver's word (`idle`):
# the driver's loop saw nothing follow the cell for SNAPSHOT_IDLE_S, as a local REPL's host would.
# A node's own clock cannot tell: a cell the driver sends at once arrives a hop later, and later
# still while the driver's loop is busy, so a node snapshotted cells a local REPL never does.
# Without the word, after this long.
_IDLE_WORD_S = 1.0
# How long a host whose drivers all left keeps its zygote and port for the next one: sequential
# `RLM.run`s each connect anew, and a zygote started for each cost 0.3-0.5 s a run.
_REST_AFTER_S = 10.0
# Contexts that no REPL here holds any more, kept (newest first) for the next REPL that loads one:
# the episodes of a task come in waves, and between two the node would otherwise free the buffer
# and have Ray bring it again, an actor call and a copy, with every load of it waiting.
_KEEP_IDLE_BYTES = 64 << 20


class Stream(wire.Channel):
    """One driver's connection to this host: its token first, then its frames (once the token
    matched), and its requests running. Nothing before the token is parsed."""

    def __init__(self, host: NodeHost) -> None:
        super().__init__(wire.DriverDecoder(), self._frame)  # (connection_lost closes, whatever ended it)
        self.host = host
        self.client: str | None = None
        self.running: dict[int, asyncio.Task[None]] = {}
        self._token = bytearray()
        self._waiting = False  # counted among the connections that have not shown a token
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.host._unauthenticated >= _MAX_UNAUTHENTICATED:
            transport.close()
            return
        self.host._unauthenticated += 1
        self._waiting = True
        self._timer = asyncio.get_running_loop().call_later(wire.AUTH_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.client is None:
            if not self._waiting:
                return  # refused: nothing more is read
            need = wire.TOKEN_BYTES - len(self._token)
            self._token += data[:need]
            if len(self._token) < wire.TOKEN_BYTES:
                return
            data = data[need:]
            self._stop_waiting()
            client = self.host._admit(bytes(self._token))
            if client is None or client in self.host._streams:
                assert self.transport is not None
                self.transport.close()
                return
            self.client = client
            self.host._streams[client] = self
            self.send({"op": "ready"})
            if not data:
                return
        super().data_received(data)

    def _stop_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self.host._unauthenticated -= 1
        if self._timer is not None:
            self._timer.cancel()

    def _frame(self, frame: dict[str, Any]) -> None:
        assert self.client is not None
        self.host._take(self.client, self, frame)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_waiting()
        if self.client is not None and self.host._streams.get(self.client) is self:
            self.host._spawn(self.host.close_client(self.client))  # the driver is gone: so are its REPLs here


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
        rest_after_s: float = _REST_AFTER_S,
    ) -> None:
        self._make_sandbox = make_sandbox
        self._rest_after_s = rest_after_s
        self._resting: asyncio.TimerHandle | None = None
        self.kind = kind
        self.max_repls = max_repls
        # REPLs on a node start in bursts (an environment's episodes, a batch of children): as on
        # one machine, they fork from one warm zygote rather than each start an interpreter.
        self._fork = fork
        self._fork_server: ForkServer | None = None
        self.repls: dict[str, Sandbox] = {}
        self._owner: dict[str, str] = {}  # repl -> the client (driver-side pool) it answers to
        self._contexts: dict[str, NodeContext] = {}
        self._idle: dict[str, None] = {}  # keys of the contexts no REPL holds, oldest first (kept)
        self._loading: dict[str, asyncio.Future[NodeContext]] = {}
        self._waiting: dict[int, tuple[str, asyncio.Future[Any]]] = {}  # call id -> (client, answer)
        self._expected: dict[str, bytes] = {}  # client -> the token its stream is to show
        self._streams: dict[str, Stream] = {}  # client -> its authenticated stream
        self._server: asyncio.Server | None = None
        self._unauthenticated = 0
        self._options: dict[str, dict[str, Any]] = {}  # digest -> a REPL's options (remember_options)
        self._watchers: dict[str, asyncio.Future[None]] = {}  # client -> done when it is closed
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.opened = 0  # REPLs ever started here
        self._pools: dict[str, MemoryPool] = {}  # environment -> its memory pool on this node
        self._repl_pool: dict[str, str] = {}

    # -- facts ------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Where this host runs and how full it is."""
        return {"hostname": socket.gethostname(), "pid": os.getpid(), "live_repls": len(self.repls),
                "opened": self.opened, "contexts": len(self._contexts) - len(self._idle), "kept_contexts": len(self._idle),
                "streams": len(self._streams)}  # fmt: skip

    # -- REPL life ---------------------------------------------------------------------------------

    async def open(self, client: str, repl: str, options: dict[str, Any],
                   memory: dict[str, Any] | None = None, context: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Start a REPL for `client`; its isolation report, or {"full": True} at this node's bound.

        `memory` ({"group", "bytes", "nodes"}): the environment's memory bound, of which this node's
        REPLs of that environment hold at most bytes / nodes ("auto": three quarters of this node's
        memory), enforced by the kernel over them together (sandbox/pools.py). `context`: the key of
        a context to load into the REPL once started if this node has it (`load_cached`), so that a
        start and its load are one request: the report's `loaded` (and its isolation then the one
        after the load), or its `load_error` (the REPL is open then, as after a load that failed)."""
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
        if hasattr(sandbox, "idle_now"):
            sandbox.snapshot_idle_s = _IDLE_WORD_S  # (the driver's word comes first: `idle`)
        self.opened += 1
        self.repls[repl] = sandbox
        self._owner[repl] = client
        try:
            await sandbox.start(self._handler(client, repl))
        except BaseException:
            await self._drop(repl)
            raise
        report: dict[str, Any] = {"isolation": dict(sandbox.isolation), "pid": getattr(sandbox, "pid", None)}
        if context is not None:
            try:
                after = await self.load_cached(repl, context)
            except asyncio.CancelledError:  # the driver gave up on this start: it forgets the REPL
                await self._drop(repl)
                raise
            except Exception as exc:
                report["load_error"] = wire.error_to_wire(exc)
            else:
                report["loaded"] = after is not None
                report["isolation"] = report["isolation"] if after is None else after
        return report

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
        """Close every REPL of one driver-side pool (its loop ended, or its stream); how many."""
        self._expected.pop(client, None)
        stream = self._streams.pop(client, None)
        if stream is not None:
            for task in stream.running.values():
                task.cancel()
            stream.close()
        repls = [r for r, c in self._owner.items() if c == client]
        await asyncio.gather(*(self._drop(r) for r in repls), return_exceptions=True)
        for call_id, (owner, future) in list(self._waiting.items()):
            if owner == client and not future.done():
                future.set_exception(CallbackError("SandboxError", "the driver that owned this REPL left"))
            if owner == client:
                self._waiting.pop(call_id, None)
        if not self._streams:
            self._trim_idle(0)  # no driver left to load them again
        watcher = self._watchers.pop(client, None)
        if watcher is not None and not watcher.done():
            watcher.set_result(None)
        if self._idle_host():
            if self._rest_after_s <= 0:
                await self._rest()
            else:
                if self._resting is not None:
                    self._resting.cancel()
                self._resting = asyncio.get_running_loop().call_later(
                    self._rest_after_s, lambda: self._spawn(self._rest_if_idle())
                )
        return len(repls)

    def _idle_host(self) -> bool:
        return not self._streams and not self._expected and not self.repls

    async def _rest_if_idle(self) -> None:
        if self._idle_host():
            await self._rest()

    async def _rest(self) -> None:
        """No driver is left and no REPL: the fork server's zygote and the listening socket go too,
        so that once its drivers have closed, nothing of theirs runs on the node but this idle actor
        (as nothing runs on the driver's machine after a local close). A new driver starts both again."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        fork_server, self._fork_server = self._fork_server, None
        if fork_server is not None:
            await fork_server.close()

    async def _drop(self, repl: str) -> None:
        sandbox = self.repls.pop(repl, None)
        self._owner.pop(repl, None)
        for key in [k for k, c in self._contexts.items() if repl in c.users]:
            context = self._contexts[key]
            context.users.discard(repl)
            if not context.users:
                self._idle[key] = None
        self._trim_idle(_KEEP_IDLE_BYTES)
        if sandbox is not None:
            await sandbox.close()
        group = self._repl_pool.pop(repl, None)
        if group is not None and group not in self._repl_pool.values():
            pool = self._pools.pop(group, None)  # the environment has no REPL here any more
            if pool is not None:
                pool.close()

    def _trim_idle(self, limit: int) -> None:
        """Free the contexts no REPL holds, oldest first, until the rest take at most `limit` bytes."""
        kept = sum(self._contexts[key].size_bytes for key in self._idle)
        while self._idle and kept > limit:
            key = next(iter(self._idle))
            del self._idle[key]
            context = self._contexts.pop(key)
            kept -= context.size_bytes
            os.close(context.fd)

    def _repl(self, repl: str) -> Sandbox:
        sandbox = self.repls.get(repl)
        if sandbox is None:
            raise SandboxError(f"no REPL {repl!r} on this node (it was closed)")
        return sandbox

    # -- the Sandbox protocol, per REPL ------------------------------------------------------------

    async def load_context(self, repl: str, key: str, meta: dict[str, Any], data: list[Any]) -> dict[str, Any]:
        """Load the context `key` into `repl`; `data` is [object ref] (in a list, so Ray does not
        fetch it to this node unless the context is not here yet). The REPL's isolation report
        after the load, which sets the limits that follow from the context (RLIMIT_DATA, the
        memory group's bound: hardened.py), as a local REPL's own report then shows them."""
        sandbox = self._repl(repl)
        context = await self._context(key, meta, data)
        if self.repls.get(repl) is not sandbox:
            raise SandboxError(f"no REPL {repl!r} on this node (it was closed)")
        self._idle.pop(key, None)
        context.users.add(repl)
        payload = context.payload()
        try:
            await sandbox.load_context(payload)
        finally:
            payload.close()
        return dict(sandbox.isolation)

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

    def idle(self, client: str, repl: Any) -> None:
        """`client`'s word that nothing followed `repl`'s last cell on its loop for SNAPSHOT_IDLE_S:
        with snapshots="idle", the REPL forks the snapshot of its state now (`_IDLE_WORD_S`)."""
        sandbox = self.repls.get(repl) if isinstance(repl, str) and self._owner.get(repl) == client else None
        idle_now = getattr(sandbox, "idle_now", None)
        if idle_now is not None:
            idle_now()

    async def get_variable(self, repl: str, name: str, timeout: float | None) -> FinalAnswer | None:
        return await self._repl(repl).get_variable(name, timeout)

    async def variable_names(self, repl: str) -> list[str]:
        return await self._repl(repl).variable_names()

    async def load_cached(self, repl: str, key: str) -> dict[str, Any] | None:
        """Load the context `key` into `repl` if this node has it (or is bringing it here), and
        return the REPL's isolation report as `load_context` does; None when it has not, and the
        driver then sends its object ref (`load_context`)."""
        if key not in self._contexts and key not in self._loading:
            return None
        return await self.load_context(repl, key, {}, [])

    # -- the driver's stream ------------------------------------------------------------------------

    def remember_options(self, digest: str, options: dict[str, Any]) -> None:
        """Options of REPLs to come (they may hold any picklable value, which the stream's JSON
        does not carry); a stream's `open` names them by `digest`."""
        self._options[digest] = options

    async def listen(self, client: str, address: str, token: bytes) -> int:
        """Expect one stream from `client`, which shows `token` first; the port, on `address`
        (the node's address as Ray advertises it: the host listens on no other interface)."""
        if not isinstance(token, bytes) or len(token) != wire.TOKEN_BYTES:
            raise SandboxError(f"a stream token is {wire.TOKEN_BYTES} random bytes")
        self._expected[client] = token
        if self._server is None:
            self._server = await asyncio.get_running_loop().create_server(lambda: Stream(self), address, 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def until_closed(self, client: str) -> None:
        """Returns when `client` is closed here: the driver keeps one such call out per node, so
        that Ray tells it (an actor error naming the node) when the node or this host dies."""
        watcher = self._watchers.get(client)
        if watcher is None:
            watcher = self._watchers[client] = asyncio.get_running_loop().create_future()
        await asyncio.shield(watcher)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _admit(self, token: bytes) -> str | None:
        """The client whose token this is (compared in constant time with each), used up."""
        found = None
        for client, expected in list(self._expected.items()):
            if hmac.compare_digest(expected, token) and found is None:
                found = client
        if found is not None:
            del self._expected[found]
        return found

    def _take(self, client: str, stream: Stream, frame: dict[str, Any]) -> None:
        op, request_id = frame["op"], wire.frame_id(frame)
        if op == "answer":
            self._answer(client, frame)
        elif op == "idle":
            self.idle(client, frame.get("repl"))
        elif op == "cancel":
            task = stream.running.get(request_id) if request_id is not None else None
            if task is not None:
                task.cancel()
        elif request_id is not None and request_id not in stream.running:
            stream.running[request_id] = asyncio.get_running_loop().create_task(
                self._run(client, stream, request_id, op, frame)
            )

    async def _run(self, client: str, stream: Stream, request_id: int, op: str, frame: dict[str, Any]) -> None:
        try:
            if op not in wire.METHODS:
                raise SandboxError(f"no request {op!r}")
            args = [frame.get(name) for name in wire.METHODS[op]]
            if op == "open":
                repl, digest, memory, context = args
                if digest not in self._options:
                    raise SandboxError("a REPL's options were not sent to this host (remember_options)")
                key = context if isinstance(context, str) else None
                value = await self.open(client, repl, self._options[digest], memory, key)
            else:
                value = await getattr(self, op)(*args)
            stream.send({"op": "done", "id": request_id, "value": wire.value_to_wire(value)})
        except asyncio.CancelledError:
            return  # the driver stopped waiting (a timeout, an aborted step) or left
        except Exception as exc:  # the method's error, or a value that cannot be a frame
            stream.send({"op": "failed", "id": request_id, **wire.error_to_wire(exc)})
        finally:
            stream.running.pop(request_id, None)
        await stream.drain()

    def _handler(self, client: str, repl: str) -> Callable[[str, dict[str, Any]], Any]:
        async def handle(function: str, args: dict[str, Any]) -> Any:
            stream = self._streams.get(client)
            if stream is None:
                raise CallbackError("SandboxError", "the driver that owned this REPL left")
            call_id = next(self._ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiting[call_id] = (client, future)
            stream.send({"op": "call", "id": call_id, "repl": repl, "fn": function, "args": args})
            try:
                return await future
            except asyncio.CancelledError:  # the cell ended (a timeout): the driver stops the call
                stream.send({"op": "cancel", "id": call_id})
                raise
            finally:
                self._waiting.pop(call_id, None)

        return handle

    def _answer(self, client: str, frame: dict[str, Any]) -> None:
        entry = self._waiting.get(wire.frame_id(frame) or 0)
        if entry is None or entry[0] != client or entry[1].done():
            return  # the cell that asked ended (timeout, restart) before the answer came
        if frame.get("ok") is True:
            entry[1].set_result(frame.get("value"))
        else:
            entry[1].set_exception(
                CallbackError(error_kind(str(frame.get("kind"))), str(frame.get("message")))
            )

    async def shutdown(self) -> None:
        for client in list(self._streams):
            await self.close_client(client)
        for repl in list(self.repls):
            with contextlib.suppress(Exception):
                await self._drop(repl)
        await self._rest()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._trim_idle(0)
