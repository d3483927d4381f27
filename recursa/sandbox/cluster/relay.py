"""A node's stream carried over Ray actor calls, for drivers that cannot reach the nodes' ports.

A driver connected through the Ray Client (`ray.init("ray://HEAD:10001")`: a laptop, a KubeRay or
Anyscale user outside the cluster's network) reaches only the client server on the head, so the TCP
stream of link.py cannot open. The relay carries the same bytes instead: the driver pushes what it
writes with an actor call (`relay_push`, numbered, since Ray does not keep an async actor's calls in
order), and keeps one call out (`relay_pull`) that the host answers as soon as it has bytes for the
driver (results, and the REPLs' call-backs) or after _POLL_S with none. Everything above the pipe
is the stream's own code on both ends: the host's `_serve` admits the relay with a token as it admits
a TCP connection and reads the driver's frames with the stream's bounds, and the driver reads the
node's frames with `wire.frames` (a worker's bounds: a frame over 64 MiB is refused and the stream
goes on, a length past 1 GiB or a malformed frame loses the node). A pull that is not bytes, or more
than _PULL_BYTES, loses the node too, as does the host dying (the pull, a push or the link's own
watch fails) or a push failing.

Each step costs an actor call each way instead of a frame on a socket: through the Ray Client a
few milliseconds to tens (docs/cluster.md). Sub-calls, tools and budgets stay on the driver,
concurrent as over the stream.

`transport` ("auto", the default): the relay when this process is a Ray Client, else the stream,
falling back to the relay for a node whose stream cannot be opened (remembered per node for this
process); "stream" or "relay" forces one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any, Final, Literal, get_args

from recursa.sandbox.cluster.link import Carrier, NodeLink, Pipe, open_stream, settled
from recursa.sandbox.cluster.node import NodeHost
from recursa.sandbox.frames import ProtocolError

Transport = Literal["auto", "stream", "relay"]
TRANSPORTS: Final = get_args(Transport)
_PULL_BYTES: Final = 8 << 20  # at most this much per pull, both the host's bound and the driver's check
_POLL_S: Final = 20.0  # a pull with nothing to carry returns empty after this long
_TRY_STREAM_S: Final = 5.0  # for a TCP connect under "auto" before the node is relayed instead
_unreachable: set[str] = set()  # node ids whose stream this process could not open ("auto")


def is_ray_client(ray: Any) -> bool:
    """Whether this process reaches its cluster through the Ray Client (`ray://`)."""
    try:
        return bool(ray.util.client.ray.is_connected())
    except (AttributeError, ImportError):  # a Ray without the client
        return False


def carrier_for(ray: Any, transport: Transport) -> Carrier:
    """How a link of this process opens its stream under `transport`."""
    if transport == "relay" or (transport == "auto" and is_ray_client(ray)):
        return open_relay
    if transport == "stream":
        return open_stream
    return _stream_else_relay


async def _stream_else_relay(link: NodeLink, token: bytes) -> Pipe:
    if link.node.node_id not in _unreachable:
        try:
            return await open_stream(link, token, _TRY_STREAM_S)
        except OSError:  # a firewall between the driver and the node: relay through Ray instead
            _unreachable.add(link.node.node_id)
    return await open_relay(link, token)


# -- the driver's end ------------------------------------------------------------------------------


async def open_relay(link: NodeLink, token: bytes) -> Pipe:
    """Ask the host for a relay admitted by `token` (handed over in the call, inside Ray's channel)."""
    try:
        await settled(link.host.relay_open.remote(link.client, token))
    except Exception as exc:  # RayActorError and kin (the host or its node is gone)
        raise ConnectionError(f"its REPL host did not open a relay: {type(exc).__name__}") from None
    return _Reader(link), _Writer(link)


class _Reader:
    """What the host has for this driver, pulled one call at a time (a stream's `read`)."""

    def __init__(self, link: NodeLink) -> None:
        self._link = link
        self._data = memoryview(b"")
        self._ended = False

    async def read(self, n: int) -> bytes:
        while not self._data:
            if self._ended:
                return b""
            try:
                data = await settled(self._link.host.relay_pull.remote(self._link.client))
            except Exception as exc:  # the host or its node is gone
                raise ConnectionResetError(f"a relay pull failed: {type(exc).__name__}") from None
            if data is None:
                self._ended = True
            elif not isinstance(data, bytes) or len(data) > _PULL_BYTES:
                raise ProtocolError(f"a relay pull that is not at most {_PULL_BYTES:,} bytes")
            else:
                self._data = memoryview(data)
        taken, self._data = self._data[:n], self._data[n:]
        return bytes(taken)


class _Writer:
    """The driver's frames to the host, one numbered push per write (a stream's writer)."""

    def __init__(self, link: NodeLink) -> None:
        self._link = link
        self._loop = asyncio.get_running_loop()
        self._sent = 0
        self._closed = False

    def write(self, data: bytes) -> None:
        if not self._closed and data:
            self._push(data, end=False)

    def _push(self, data: bytes, *, end: bool) -> None:
        try:
            ref = self._link.host.relay_push.remote(self._link.client, self._sent, data, end)
        except Exception as exc:  # Ray cannot send it (the connection to the cluster is gone)
            self._closed = True
            self._link.lose(f"a relay push to its REPL host could not be sent: {type(exc).__name__}")
            return
        self._sent += 1
        loop = self._loop

        def pushed(done: concurrent.futures.Future[Any]) -> None:  # on Ray's thread
            if not done.cancelled() and done.exception() is not None:
                # A push lost leaves a hole in the stream: nothing after it can be read as frames.
                why = f"a relay push to its REPL host failed: {type(done.exception()).__name__}"
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits on the node
                    loop.call_soon_threadsafe(self._link.lose, why)

        ref.future().add_done_callback(pushed)

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The end of the stream: the host closes this driver's REPLs there, as when a socket closes."""
        if not self._closed:
            self._closed = True
            self._push(b"", end=True)

    async def drain(self) -> None:
        return None  # pushes are not held here: each is Ray's as soon as it is written

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


# -- the host's end --------------------------------------------------------------------------------


class _HostPipe:
    """One relayed driver on the host: the reader `_serve` reads its frames from, and the writer
    its frames for the driver go to until a pull takes them."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self._arrived: dict[int, tuple[bytes, bool]] = {}  # pushes ahead of a missing one
        self._next = 0
        self._out = bytearray()
        self._closed = False
        self._changed = asyncio.Event()

    def pushed(self, number: int, data: bytes, end: bool) -> None:
        self._arrived[number] = (data, end)
        while self._next in self._arrived:
            data, end = self._arrived.pop(self._next)
            self._next += 1
            if data:
                self.reader.feed_data(data)
            if end:
                self.reader.feed_eof()

    async def pull(self) -> bytes | None:
        """What is waiting for the driver (at most _PULL_BYTES); b"" after _POLL_S with nothing;
        None once the host has closed this stream and the driver has had all of it."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_POLL_S):
                while not self._out and not self._closed:
                    self._changed.clear()
                    await self._changed.wait()
        if not self._out:
            return None if self._closed else b""
        data = bytes(self._out[:_PULL_BYTES])
        del self._out[:_PULL_BYTES]
        self._changed.set()  # a writer waiting in drain
        return data

    # The writer's side, as `Stream` (an Outbox) uses an asyncio.StreamWriter.

    def write(self, data: bytes) -> None:
        if not self._closed:
            self._out += data
            self._changed.set()

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The host ends this stream: `_serve` reads no more of it, the driver gets what is left."""
        self._closed = True
        self._changed.set()
        self.reader.feed_eof()

    async def drain(self) -> None:
        """Wait while the driver has not pulled what it was sent (a socket's full buffer)."""
        while len(self._out) > _PULL_BYTES and not self._closed:
            self._changed.clear()
            await self._changed.wait()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    @property
    def done(self) -> bool:
        return self._closed and not self._out


class RelayHost(NodeHost):
    """A node's REPL host that also carries streams over actor calls (the actor pool.py starts)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._relays: dict[str, _HostPipe] = {}
        self._relay_tasks: set[asyncio.Task[None]] = set()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "relays": len(self._relays), "listening": self._server is not None}

    async def relay_open(self, client: str, token: bytes) -> None:
        """A stream for `client` over `relay_push` and `relay_pull`, admitted by `token` as a TCP
        connection is (`_serve`), which this call presents for the driver."""
        pipe = self._relays[client] = _HostPipe()
        self._expected[client] = token
        pipe.reader.feed_data(token)
        task = asyncio.get_running_loop().create_task(self._serve(pipe.reader, pipe))  # type: ignore[arg-type]
        self._relay_tasks.add(task)
        task.add_done_callback(self._relay_tasks.discard)
        task.add_done_callback(lambda _t: self._relays.pop(client, None) if pipe.done else None)

    async def relay_push(self, client: str, number: int, data: bytes, end: bool) -> None:
        pipe = self._relays.get(client)
        if pipe is not None:
            pipe.pushed(number, data, end)

    async def relay_pull(self, client: str) -> bytes | None:
        pipe = self._relays.get(client)
        if pipe is None:
            return None
        data = await pipe.pull()
        if pipe.done and self._relays.get(client) is pipe:
            del self._relays[client]
        return data
