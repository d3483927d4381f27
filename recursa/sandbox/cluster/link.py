"""The driver's end of one node's stream (`sandbox="ray"`): requests out, results and call-backs in.

A `NodeLink` belongs to one event loop's pool (pool.py) and one node. It asks the node's host actor
to expect it (`listen`, with a fresh token), connects to the node's Ray-advertised address, and
from then on sends each request as one frame and reads the host's frames as they come (wire.py):
results resolve their request, call-backs go to the pool, which answers them on this loop. Every
frame from the node is checked as a local worker's are; one that cannot be read, a stream that
ends, or the host actor dying (Ray reports it on a call kept out for that, `until_closed`) loses
the node: every request waiting on it fails with `NodeLost`, which names the node.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from recursa.errors import SandboxError, SandboxLost
from recursa.sandbox.base import HOST_FUNCTIONS
from recursa.sandbox.cluster import wire
from recursa.sandbox.connection import MAX_CALLS_IN_FLIGHT
from recursa.sandbox.frames import FrameDecoder, ProtocolError, RefusedFrame

_CONNECT_S = 30.0  # for the host to answer `listen` and the stream to open
# TCP keepalive on the stream: a node that vanishes without closing it (a cut cable) is noticed in
# about a minute even when Ray's own health checks have not yet declared it dead.
_KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


@dataclass
class Node:
    """A Ray node as placement sees it."""

    node_id: str
    address: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.node_id[:12]} ({self.address})"


class NodeLost(SandboxLost):
    """The Ray node that held a REPL died or left the cluster."""

    def __init__(self, node: Node, why: str) -> None:
        super().__init__(f"the Ray node {node.name} that held this REPL is gone ({why})")
        self.node = node


# A call-back from the node: (link, call id, REPL, function, arguments) -> its answer frame's fields.
CallServer = Callable[["NodeLink", int, str, str, dict[str, Any]], Awaitable[dict[str, Any]]]
# Connects a link's channel to its host (the channel's `connection_made` with a transport: asyncio's
# own for TCP, a stand-in over actor calls in relay.py) and presents the link's token first (the host
# serves nothing before it matches); OSError when it cannot.
Carrier = Callable[["NodeLink", bytes, wire.Channel], Awaitable[None]]


class NodeLink:
    """One pool's stream to one node's REPL host."""

    def __init__(self, node: Node, host: Any, client: str, serve_call: CallServer,
                 on_lost: Callable[[NodeLink], None]) -> None:  # fmt: skip
        self.node = node
        self.host = host  # the Ray actor
        self.client = client
        self._serve_call = serve_call
        self._on_lost = on_lost
        self.lost: str | None = None  # why, once lost
        self.closing = False
        self.repls: set[str] = set()  # this pool's REPLs on the node: the only ones it may speak for
        self.options_sent: set[str] = set()  # digests of REPL options the host holds (remember_options)
        self._out: wire.Channel | None = None
        self._ready: asyncio.Future[Any]  # the host's first frame (connect)
        self._pending: dict[int, tuple[str, asyncio.Future[Any]]] = {}  # id -> (method, answer)
        self._calls: dict[int, asyncio.Task[None]] = {}  # call-backs being served
        self._stalled: dict[str, Any] | None = None  # a call-back waiting for room (the stream is held)
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def connect(self, carrier: Carrier | None = None) -> None:
        """Have the host expect this stream, open it (over `carrier`: by default TCP to the node,
        `open_stream`), and read it from now on."""
        token = secrets.token_bytes(wire.TOKEN_BYTES)
        self._ready = asyncio.get_running_loop().create_future()
        channel = wire.Channel(FrameDecoder(), self._frame, self._ended)
        try:
            async with asyncio.timeout(_CONNECT_S):
                await (carrier or open_stream)(self, token, channel)
                first = await self._ready
        except (OSError, TimeoutError) as exc:
            channel.close()
            raise SandboxError(
                f"this driver could not open its stream to the REPL host on {self.node.name}: "
                f"{exc or type(exc).__name__}. The driver must reach every REPL node's address, as a "
                "driver inside the cluster does; from outside it, give «sandbox_options=»"
                '{"transport": "relay"} (the frames then ride Ray actor calls)'
            ) from None
        if not isinstance(first, dict) or first.get("op") != "ready":
            channel.close()
            raise SandboxError(f"the Ray node host {self.node.name} refused this driver's stream")
        self._out = channel
        self._spawn(self._watch())

    def _spawn(self, *coroutines: Any) -> None:
        for coroutine in coroutines:
            task = asyncio.get_running_loop().create_task(coroutine)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- requests ---------------------------------------------------------------------------------

    async def request(self, method: str, **fields: Any) -> Any:
        """Run `method` on the host; its value, or its error raised here. A lost node raises
        NodeLost; a cancelled wait cancels the request on the node."""
        if self.lost is not None:
            raise NodeLost(self.node, self.lost)
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (method, future)
        try:
            self.send({"op": method, "id": request_id, **fields})
            return await future
        except asyncio.CancelledError:
            if self.lost is None:
                self.send({"op": "cancel", "id": request_id})
            raise
        finally:
            self._pending.pop(request_id, None)

    def send(self, frame: dict[str, Any]) -> None:
        if self._out is not None and self.lost is None:
            self._out.send(frame)

    # -- what the node sends ----------------------------------------------------------------------

    def _frame(self, frame: dict[str, Any] | RefusedFrame) -> None:
        """A frame from the node, in the turn of the loop that read it."""
        if not self._ready.done():
            self._ready.set_result(frame)
        elif isinstance(frame, RefusedFrame):
            self._refused(frame)
        elif frame["op"] in ("done", "failed"):
            self._resolve(frame)
        elif frame["op"] == "call":
            if len(self._calls) >= MAX_CALLS_IN_FLIGHT * max(1, len(self.repls)):
                self._stalled = frame  # nothing more is read until a call ends: the node waits on its socket
                if self._out is not None:
                    self._out.hold()
                return
            self._take_call(frame)
        elif frame["op"] == "cancel":
            task = self._calls.get(wire.frame_id(frame) or 0)
            if task is not None:
                task.cancel()

    def _ended(self, why: Exception | None) -> None:
        """The stream ended (the channel's `on_end`): before the host's first frame, `connect` fails."""
        if not self._ready.done():
            self._ready.set_exception(
                why if isinstance(why, OSError) else ConnectionResetError(str(why or "the host closed it"))
            )
        elif isinstance(why, ProtocolError):
            self.lose(f"its REPL host sent an invalid message ({why})")
        elif why is not None:
            self.lose(f"the stream to its REPL host failed ({why})")
        else:
            self.lose("its REPL host closed the stream to this driver")

    def _resolve(self, frame: dict[str, Any]) -> None:
        entry = self._pending.get(wire.frame_id(frame) or 0)
        if entry is None or entry[1].done():
            return  # a request this side stopped waiting for
        method, future = entry
        if frame["op"] == "failed":
            future.set_exception(wire.error_from_wire(frame))
            return
        try:
            future.set_result(wire.value_from_wire(method, frame.get("value")))
        except ProtocolError as exc:
            future.set_exception(
                SandboxError(f"the Ray node {self.node.name} answered {method} wrongly: {exc}")
            )

    def _refused(self, frame: RefusedFrame) -> None:
        """A frame too large to parse: its request fails, or its call-back is answered, naming why."""
        if frame.id is None:
            return
        if frame.op in ("done", "failed"):
            entry = self._pending.get(frame.id)
            if entry is not None and not entry[1].done():
                entry[1].set_exception(SandboxError(
                    f"the REPL's answer was too large to send to the driver ({frame.reason}); keep it in a "
                    "variable and answer with something smaller"))  # fmt: skip
        elif frame.op == "call":
            self.send({"op": "answer", "id": frame.id, "ok": False, "kind": "SubcallError",
                       "message": f"the call's arguments are too large to send to the driver ({frame.reason})"})  # fmt: skip

    def _take_call(self, frame: dict[str, Any]) -> None:
        call_id, repl, fn, args = wire.frame_id(frame), frame.get("repl"), frame.get("fn"), frame.get("args")
        if call_id is None or call_id in self._calls:
            return  # nothing to answer to, or the id of a call still being served
        if not isinstance(repl, str) or repl not in self.repls:
            # A REPL this pool did not put on this node: a node does not speak for others' REPLs.
            self.send({"op": "answer", "id": call_id, "ok": False, "kind": "SubcallError",
                       "message": "no such REPL on this node"})  # fmt: skip
            return
        if fn not in HOST_FUNCTIONS or not isinstance(args, dict):
            what = f"unknown host function {fn!r}" if fn not in HOST_FUNCTIONS else "malformed call"
            self.send({"op": "answer", "id": call_id, "ok": False, "kind": "SubcallError",
                       "message": f"{what} from the REPL"})  # fmt: skip
            return
        task = asyncio.get_running_loop().create_task(self._answer(call_id, repl, fn, args))
        self._calls[call_id] = task
        task.add_done_callback(lambda _t, i=call_id: self._call_done(i))

    async def _answer(self, call_id: int, repl: str, fn: str, args: dict[str, Any]) -> None:
        answer = await self._serve_call(self, call_id, repl, fn, args)
        try:
            self.send({"op": "answer", "id": call_id, **answer})
        except (TypeError, ValueError) as exc:  # not JSON, or past the channel's limit
            self.send({"op": "answer", "id": call_id, "ok": False, "kind": "SubcallError",
                       "message": f"the answer cannot be sent to the REPL: {exc}"})  # fmt: skip

    def _call_done(self, call_id: int) -> None:
        self._calls.pop(call_id, None)
        stalled, self._stalled = self._stalled, None
        if stalled is not None and self.lost is None:
            self._take_call(stalled)
            if self._out is not None:
                self._out.release()

    async def _watch(self) -> None:
        """Ray's word on the host: the call returns when this client is closed there, and fails
        with an actor error when the host or its node dies."""
        try:
            await settled(self.host.until_closed.remote(self.client))
        except asyncio.CancelledError:  # this loop is ending: the host closes this pool's REPLs
            if self._out is not None:
                self._out.close()
            raise
        except Exception as exc:  # RayActorError and kin (Ray is not imported here)
            self.lose(_why(exc))

    # -- loss and close ---------------------------------------------------------------------------

    def lose(self, why: str) -> None:
        """The node is gone for this pool: fail what waits on it (once), stop reading it."""
        if self.lost is not None or self.closing:
            return
        self.lost = why
        error = NodeLost(self.node, why)
        for _, future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)
        for task in list(self._calls.values()):
            task.cancel()  # a node that died takes the cells that asked with it
        if self._out is not None:
            self._out.abort()  # what is queued for a lost node goes nowhere
        self._on_lost(self)

    async def aclose(self) -> None:
        """Close this pool's REPLs on the node and the stream."""
        self.closing = True
        if self.lost is None:
            with contextlib.suppress(Exception):
                await self.host.close_client.remote(self.client)
        if self._out is not None:
            self._out.close()
        for task in [*self._tasks, *self._calls.values()]:
            task.cancel()


async def open_stream(
    link: NodeLink, token: bytes, channel: wire.Channel, timeout: float | None = None
) -> None:
    """The default carrier: the host listens on the node's Ray address for the stream that shows
    `token` first, and this driver connects `channel` there (within `timeout` seconds, if given)."""
    port = await link.host.listen.remote(link.client, link.node.address, token)
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await asyncio.get_running_loop().create_connection(
                lambda: channel, link.node.address, port
            )
    except OSError as exc:  # (TimeoutError is one)
        raise OSError(f"{link.node.address}:{port}: {exc or type(exc).__name__}") from None
    _tune(transport)
    transport.write(token)


async def settled(ref: Any) -> Any:
    """What an actor call returned, awaited through a waiter of this loop's own: a wait cancelled
    here (a loop that ends with a pull out) leaves Ray's future alone, which the Ray Client's thread
    later settles (it fails on one that was cancelled under it)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def settle(done: concurrent.futures.Future[Any]) -> None:  # on Ray's thread
        with contextlib.suppress(RuntimeError):  # this loop closed meanwhile
            loop.call_soon_threadsafe(_copy, done, waiter)

    ref.future().add_done_callback(settle)
    return await waiter


def _copy(done: concurrent.futures.Future[Any], waiter: asyncio.Future[Any]) -> None:
    if waiter.done():
        return
    if done.cancelled():
        waiter.cancel()
    elif done.exception() is not None:
        waiter.set_exception(done.exception())  # type: ignore[arg-type]
    else:
        waiter.set_result(done.result())


def _tune(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):  # (asyncio sets TCP_NODELAY itself)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _why(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():
        if "node" in line.lower() and ("died" in line.lower() or "dead" in line.lower()):
            return line.strip()
    return type(exc).__name__
