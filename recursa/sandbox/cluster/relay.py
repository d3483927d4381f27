"""A node's stream carried over Ray actor calls, for drivers that cannot reach the nodes' ports.

A driver connected through the Ray Client (`ray.init("ray://HEAD:10001")`: a laptop, a KubeRay or
Anyscale user outside the cluster's network) reaches only the client server on the head, so the TCP
stream of link.py cannot open. The relay carries the same bytes instead: the driver pushes what it
writes with an actor call (`relay_push`, numbered, since Ray does not keep an async actor's calls in
order), and keeps one call out (`relay_pull`) that the host answers as soon as it has bytes for the
driver (results, and the REPLs' call-backs) or after _POLL_S with none. Everything above the pipe
is the stream's own code on both ends, the relay standing in for the socket under each end's
channel (wire.Channel): the host's `Stream` admits the relay with a token as it admits a TCP
connection and reads the driver's frames with the stream's bounds, and the driver reads the node's
frames with a worker's bounds (a frame over 64 MiB is refused and the stream goes on, a length past
1 GiB or a malformed frame loses the node). A pull that is not bytes, or more
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
import functools
from collections.abc import Callable
from typing import Any, Final, Literal, get_args

from recursa.sandbox.cluster.link import Carrier, NodeLink, open_stream, settled
from recursa.sandbox.cluster.node import NodeHost, Stream
from recursa.sandbox.cluster.wire import Channel
from recursa.sandbox.frames import ProtocolError

Transport = Literal["auto", "stream", "relay"]
TRANSPORTS: Final = get_args(Transport)
_PULL_BYTES: Final = 8 << 20  # at most this much per pull, both the host's bound and the driver's check
_POLL_S: Final = 20.0  # a pull with nothing to carry returns empty after this long
_TRY_STREAM_S: Final = 5.0  # for a TCP connect under "auto" before the node is relayed instead


def is_ray_client(ray: Any) -> bool:
    """Whether this process reaches its cluster through the Ray Client (`ray://`)."""
    try:
        return bool(ray.util.client.ray.is_connected())
    except (AttributeError, ImportError):  # a Ray without the client
        return False


def carrier_for(ray: Any, transport: Transport, unreachable: set[str]) -> Carrier:
    """How a link opens its stream under `transport`; under "auto", a node whose stream could not
    be opened is added to `unreachable` (its pool's) and relayed from then on."""
    if transport == "relay" or (transport == "auto" and is_ray_client(ray)):
        return open_relay
    if transport == "stream":
        return open_stream
    return functools.partial(_stream_else_relay, unreachable=unreachable)


async def _stream_else_relay(link: NodeLink, token: bytes, channel: Channel, *, unreachable: set[str]) -> None:
    if link.node.node_id not in unreachable:
        try:
            return await open_stream(link, token, channel, _TRY_STREAM_S)
        except OSError:  # a firewall between the driver and the node: relay through Ray instead
            unreachable.add(link.node.node_id)
    await open_relay(link, token, channel)


# -- the driver's end ------------------------------------------------------------------------------


async def open_relay(link: NodeLink, token: bytes, channel: Channel) -> None:
    """Ask the host for a relay admitted by `token` (handed over in the call, inside Ray's channel),
    and carry `channel` over it."""
    try:
        await settled(link.host.relay_open.remote(link.client, token))
    except Exception as exc:  # RayActorError and kin (the host or its node is gone)
        raise ConnectionError(f"its REPL host did not open a relay: {type(exc).__name__}") from None
    _DriverRelay(link, channel)


class _DriverRelay:
    """The driver's channel's transport over the relay: what it writes goes in numbered pushes, and
    one pull at a time brings what the host has for it (fed to the channel as a socket's reads are)."""

    def __init__(self, link: NodeLink, channel: Channel) -> None:
        self._link = link
        self._channel = channel
        self._loop = asyncio.get_running_loop()
        self._sent = 0
        self._closed = False
        self._reading = True
        self._resumed = asyncio.Event()
        channel.connection_made(self)  # type: ignore[arg-type]
        self._puller = self._loop.create_task(self._pull())

    async def _pull(self) -> None:
        why: Exception | None = None
        try:
            while not self._closed:
                if not self._reading:
                    self._resumed.clear()
                    await self._resumed.wait()
                    continue
                try:
                    data = await settled(self._link.host.relay_pull.remote(self._link.client))
                except Exception as exc:  # the host or its node is gone
                    why = ConnectionResetError(f"a relay pull failed: {type(exc).__name__}")
                    break
                if data is None:
                    break  # the host closed the stream and this driver has had all of it
                if not isinstance(data, bytes) or len(data) > _PULL_BYTES:
                    why = ProtocolError(f"a relay pull that is not at most {_PULL_BYTES:,} bytes")
                    break
                if data:
                    self._channel.data_received(data)
        except asyncio.CancelledError:  # the loop is ending: the host closes this driver's REPLs there
            self.close()
            raise
        self.close()  # (the host reads the end of the stream, as when a socket closes)
        self._channel.connection_lost(why)

    # What a transport offers the channel.

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
            self._resumed.set()
            self._push(b"", end=True)

    abort = close

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True
        self._resumed.set()

    def is_reading(self) -> bool:
        return self._reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


# -- the host's end --------------------------------------------------------------------------------


class _HostRelay:
    """One relayed driver on the host: its `Stream`'s transport. Pushes are fed to the stream in
    their order, as a socket's reads are; what the stream writes waits for a pull."""

    def __init__(self, stream: Stream, on_done: Callable[[], None]) -> None:
        self._stream = stream
        self._on_done = on_done
        self._arrived: dict[int, tuple[bytes, bool]] = {}  # pushes ahead of a missing one
        self._next = 0
        self._held: list[tuple[bytes, bool]] = []  # pushes in order, while the stream is not reading
        self._reading = True
        self._out = bytearray()
        self._closed = False
        self._writing_paused = False
        self._changed = asyncio.Event()
        stream.connection_made(self)  # type: ignore[arg-type]

    def pushed(self, number: int, data: bytes, end: bool) -> None:
        self._arrived[number] = (data, end)
        while self._next in self._arrived:
            self._held.append(self._arrived.pop(self._next))
            self._next += 1
        self._deliver()

    def _deliver(self) -> None:
        while self._held and self._reading and not self._closed:
            data, end = self._held.pop(0)
            if data:
                self._stream.data_received(data)
            if end:
                self._end()

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
        if self._writing_paused and len(self._out) <= _PULL_BYTES:
            self._writing_paused = False
            self._stream.resume_writing()
        if self.done:
            self._on_done()
        return data

    # What a transport offers the stream.

    def write(self, data: bytes) -> None:
        if not self._closed:
            self._out += data
            self._changed.set()
            if len(self._out) > _PULL_BYTES and not self._writing_paused:
                self._writing_paused = True  # the driver has not pulled: the stream's drain waits
                self._stream.pause_writing()

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The host ends this stream: no more of it is read, the driver gets what is left."""
        self._end()

    abort = close

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._changed.set()
            self._stream.connection_lost(None)
            if self.done:
                self._on_done()

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True
        self._deliver()

    def is_reading(self) -> bool:
        return self._reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    @property
    def done(self) -> bool:
        return self._closed and not self._out


class RelayHost(NodeHost):
    """A node's REPL host that also carries streams over actor calls (the actor pool.py starts)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._relays: dict[str, _HostRelay] = {}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "relays": len(self._relays), "listening": self._server is not None}

    async def relay_open(self, client: str, token: bytes) -> None:
        """A stream for `client` over `relay_push` and `relay_pull`, admitted by `token` as a TCP
        connection is (node.Stream), which this call presents for the driver."""
        self._expected[client] = token
        stream = Stream(self)
        pipe = _HostRelay(stream, lambda: self._forget_relay(client, pipe))
        self._relays[client] = pipe
        stream.data_received(token)

    def _forget_relay(self, client: str, pipe: _HostRelay) -> None:
        if self._relays.get(client) is pipe:
            del self._relays[client]

    async def relay_push(self, client: str, number: int, data: bytes, end: bool) -> None:
        pipe = self._relays.get(client)
        if pipe is not None:
            pipe.pushed(number, data, end)

    async def relay_pull(self, client: str) -> bytes | None:
        pipe = self._relays.get(client)
        if pipe is None:
            return None
        return await pipe.pull()
