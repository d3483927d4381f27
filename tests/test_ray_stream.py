"""The stream between a driver and a node's REPL host (sandbox="ray"), without a cluster: the
plain NodeHost (node.py imports no Ray) serves real TCP on 127.0.0.1, and the driver's NodeLink
(link.py) talks to it through a stand-in for the host's actor handle. The cluster itself, and a
node removed from it, are in test_ray_sandbox.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from recursa.errors import SandboxError
from recursa.sandbox import frames
from recursa.sandbox.base import CallbackError, CallHandler, ExecResult
from recursa.sandbox.cluster import NodeLost, wire
from recursa.sandbox.cluster.link import Node, NodeLink
from recursa.sandbox.cluster.node import NodeHost

pytestmark = pytest.mark.timeout(30)


class Fake:
    """A REPL stand-in: runs nothing; "ask:X" asks the driver ("askbig:N" N bytes), "hang" waits,
    "big:N" prints N bytes, "#..." prints its length."""

    name = "fake"
    snapshot_idle_s = 0.005  # as SubprocessSandbox's

    def __init__(self, **options: Any) -> None:
        self.isolation: dict[str, Any] = {"process": False, "options": sorted(options)}
        self.ran: list[str] = []
        self.closed = False
        self.cancelled = asyncio.Event()
        self.idle, self.idled = asyncio.Event(), 0

    def idle_now(self) -> None:
        self.idled += 1
        self.idle.set()

    async def start(self, handler: CallHandler) -> None:
        self.handler = handler

    async def execute(self, code: str, timeout: float) -> ExecResult:
        self.ran.append(code)
        if code.startswith(("ask:", "askbig:")):
            prompt = "p" * int(code[7:]) if code.startswith("askbig:") else code[4:]
            try:
                return ExecResult(stdout=str(await self.handler("llm_query", {"prompt": prompt})), stderr="")
            except CallbackError as exc:  # what the REPL's code would see
                return ExecResult(stdout="", stderr="", error=f"{exc.kind}: {exc}")
        if code == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if code.startswith("big:"):
            return ExecResult(stdout="x" * int(code[4:]), stderr="")
        if code.startswith("#"):
            return ExecResult(stdout=str(len(code)), stderr="")
        if code == "bad":
            raise SandboxError("the REPL host failed")
        return ExecResult(stdout=code, stderr="", restored=True)

    async def load_context(self, payload: Any) -> None:
        self.loaded = payload.size_bytes
        payload.close()
        if payload.kind == "broken":
            raise SandboxError("the REPL could not load it")

    async def close(self) -> None:
        self.closed = True


class Ref:
    """What `handle.method.remote(...)` gives: awaitable, and `future()` as Ray's refs have it."""

    def __init__(self, made: Any) -> None:
        async def value() -> Any:
            return await made if asyncio.iscoroutine(made) else made

        self._future = asyncio.run_coroutine_threadsafe(value(), asyncio.get_running_loop())

    def future(self) -> Any:
        return self._future

    def __await__(self) -> Any:
        return asyncio.wrap_future(self._future).__await__()


class Actor:
    """What a Ray actor handle gives the driver, over a plain object: `handle.method.remote(...)`
    (this loop runs the method)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.obj, name)  # looked up at each call, as Ray's handle does

        class Remote:
            @staticmethod
            def remote(*args: Any) -> Ref:
                return Ref(method(*args))

        return Remote()


SERVED: list[tuple[str, str]] = []  # (REPL, function) of every call-back the driver's handler served


async def answer(link: NodeLink, call_id: int, repl: str, fn: str, args: dict[str, Any]) -> dict[str, Any]:
    SERVED.append((repl, fn))
    if args.get("prompt") == "dear":
        return {"ok": False, "kind": "BudgetExceeded", "message": "used up"}
    return {"ok": True, "value": f"answered {args['prompt']}"}


@pytest.fixture
async def node() -> AsyncIterator[tuple[NodeHost, list[Fake]]]:
    made: list[Fake] = []

    def make(kind: str, **options: Any) -> Fake:
        made.append(Fake(**options))
        return made[-1]

    host = NodeHost(make, fork=False)  # type: ignore[arg-type]
    yield host, made
    await host.shutdown()


async def connect(host: NodeHost, name: str = "a", lost: list[NodeLink] | None = None) -> NodeLink:
    link = NodeLink(Node(name * 12, "127.0.0.1", {}), Actor(host), f"client-{name}", answer,
                    (lost if lost is not None else []).append)  # fmt: skip
    await link.connect()
    return link


async def opened(link: NodeLink, repl: str = "r") -> None:
    await link.host.remember_options.remote("o1", {"snapshots": False})
    link.repls.add(repl)
    reply = await link.request("open", repl=repl, options="o1", memory=None)
    assert reply == {"full": False, "isolation": {"process": False, "options": ["snapshots"]}, "pid": None,
                     "loaded": False, "load_error": None}  # fmt: skip


async def test_a_start_loads_a_context_the_node_has_in_the_same_request(
    node: tuple[NodeHost, list[Fake]],
) -> None:
    import os

    from recursa.sandbox.cluster.node import NodeContext

    host, made = node
    link = await connect(host)
    await link.host.remember_options.remote("o1", {})
    for key, kind in (("k1", "str"), ("k2", "broken")):
        host._contexts[key] = NodeContext(os.memfd_create("c"), kind, 7, [7], [], None)  # type: ignore[arg-type]
    replies = []
    for repl, key in (("r1", "k1"), ("r2", "elsewhere"), ("r3", "k2")):
        link.repls.add(repl)
        replies.append(await link.request("open", repl=repl, options="o1", memory=None, context=key))
    # Loaded where the node has it; not where it lacks it (the driver then sends it by an actor
    # call); a load that fails is named, with the REPL open, as after a load of its own.
    assert [r["loaded"] for r in replies] == [True, False, False]
    assert [getattr(f, "loaded", None) for f in made] == [7, None, 7]
    assert replies[2]["load_error"] is not None and "could not load it" in str(replies[2]["load_error"])
    assert host._contexts["k1"].users == {"r1"} and host.describe()["live_repls"] == 3
    await link.aclose()


async def test_a_stream_carries_cells_results_call_backs_and_cancels(
    node: tuple[NodeHost, list[Fake]],
) -> None:
    host, made = node
    link = await connect(host)
    await opened(link)
    first, asked = await asyncio.gather(
        link.request("execute", repl="r", code="a", timeout=5),
        link.request("execute", repl="r", code="ask:hi", timeout=5),
    )
    assert (first.stdout, first.restored, asked.stdout) == ("a", True, "answered hi")
    # An error the driver's handler gave reaches the cell as its kind; one the node raised comes
    # back as recursa's own class.
    refused = await link.request("execute", repl="r", code="ask:dear", timeout=5)
    assert refused.error == "BudgetExceeded: used up"
    with pytest.raises(SandboxError, match="the REPL host failed"):
        await link.request("execute", repl="r", code="bad", timeout=5)
    # A wait given up on the driver stops the cell's request on the node.
    waiting = asyncio.ensure_future(link.request("execute", repl="r", code="hang", timeout=5))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.wait_for(made[0].cancelled.wait(), 5)
    assert (await link.request("execute", repl="r", code="after", timeout=5)).stdout == "after"
    await link.aclose()
    assert made[0].closed and host.describe()["streams"] == 0


async def test_a_node_snapshots_on_its_drivers_clock_not_its_own(node: tuple[NodeHost, list[Fake]]) -> None:
    # With snapshots="idle" a REPL forks its snapshot once nothing has followed a cell for a few ms.
    # On a node that clock is the driver's loop (a cell sent at once comes a hop later, and later
    # still from a busy driver): the node's own wait is only a fallback, and the driver's `idle`
    # word goes once its loop has sent the REPL nothing for SNAPSHOT_IDLE_S.
    from recursa.sandbox.cluster import node as node_module
    from recursa.sandbox.cluster.pool import RayPool

    host, made = node
    link, other = await connect(host), await connect(host, "b")
    await opened(link)
    assert made[0].snapshot_idle_s == node_module._IDLE_WORD_S
    other.send({"op": "idle", "repl": "r"})  # another driver's word for a REPL not its own
    with pytest.raises(SandboxError, match="no REPL"):
        await other.request("variable_names", repl="x")
    assert made[0].idled == 0  # (the host read b's word before b's request, and ignored it)
    pool = RayPool(None, make_sandbox=None)  # type: ignore[arg-type]
    pool._links[link.node.node_id] = asyncio.get_running_loop().create_future()
    pool._links[link.node.node_id].set_result(link)
    pool._repl_node["r"] = link.node
    pool.idle_soon("r")
    await pool.call("r", "execute", code="a", timeout=5)  # a request first: no word for that cell
    assert not pool._words
    pool.idle_soon("r")
    await asyncio.wait_for(made[0].idle.wait(), 5)  # nothing follows: the word comes
    assert made[0].idled == 1 and not pool._words
    await link.aclose()
    await other.aclose()


async def test_a_real_repl_on_a_node_forks_its_snapshot_on_the_drivers_word(monkeypatch: pytest.MonkeyPatch) -> None:
    from recursa.sandbox import make_sandbox
    from recursa.sandbox.cluster import node as node_module

    monkeypatch.setattr(node_module, "_IDLE_WORD_S", 60.0)  # the node's own wait: not in this test
    host = NodeHost(make_sandbox, fork=False)
    try:
        link = await connect(host)
        await link.host.remember_options.remote("o1", {"snapshots": "idle"})
        link.repls.add("r")
        await link.request("open", repl="r", options="o1", memory=None)
        assert (await link.request("execute", repl="r", code="x = 6 * 7", timeout=30)).error is None
        worker = host.repls["r"]._worker  # type: ignore[attr-defined]
        assert not worker.word_sent
        link.send({"op": "idle", "repl": "r"})
        await asyncio.wait_for(worker.snapshot_reported.wait(), 10)
        assert worker.word_sent and worker.snapshot_sid is not None
        assert (await link.request("execute", repl="r", code="print(x)", timeout=30)).stdout == "42\n"
        await link.aclose()
    finally:
        await host.shutdown()


async def test_wrong_tokens_and_slow_or_garbage_clients_are_refused_without_disturbing_runs(
    node: tuple[NodeHost, list[Fake]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "AUTH_S", 0.3)
    host, _ = node
    link = await connect(host)
    await opened(link)
    port = await host.listen("client-b", "127.0.0.1", b"k" * wire.TOKEN_BYTES)

    async def refused(first: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(first)
        try:
            return await asyncio.wait_for(reader.read(100), 5)  # b"": closed with nothing sent
        finally:
            writer.close()

    # Nothing is served before the token: a wrong one, a frame in its place, an HTTP request, and a
    # client that sends half a token and stops are each closed with not one byte sent back.
    ask = wire.encode({"op": "open", "id": 1, "repl": "x", "options": "o1", "memory": None})
    slow = refused(b"k" * 10)
    results = await asyncio.gather(
        refused(b"w" * wire.TOKEN_BYTES), refused(ask + b"k" * wire.TOKEN_BYTES),
        refused(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), slow,
        link.request("execute", repl="r", code="still here", timeout=5),
    )  # fmt: skip
    assert results[:4] == [b""] * 4 and results[4].stdout == "still here"
    assert host.describe()["live_repls"] == 1 and set(host._streams) == {"client-a"}
    # The right token admits one stream, once.
    assert await refused(b"k" * wire.TOKEN_BYTES) == wire.encode({"op": "ready"})
    assert await refused(b"k" * wire.TOKEN_BYTES) == b""
    assert (await link.request("execute", repl="r", code="and here", timeout=5)).stdout == "and here"


async def test_frames_past_the_size_cap_fail_their_request_not_the_stream(
    node: tuple[NodeHost, list[Fake]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frames, "MAX_HOST_FRAME_BYTES", 64 << 10)
    host, _ = node
    link = await connect(host)
    await opened(link)
    with pytest.raises(SandboxError, match=r"too large to send to the driver .*limit is 65,536"):
        await link.request("execute", repl="r", code="big:100000", timeout=5)
    # The host reads its authenticated driver's frames up to the channel's limit, as a worker does.
    assert (await link.request("execute", repl="r", code="#" * 100_000, timeout=5)).stdout == "100000"
    result = await link.request("execute", repl="r", code="askbig:100000", timeout=5)
    assert result.error and "arguments are too large to send to the driver" in result.error, result
    assert (await link.request("execute", repl="r", code="fine", timeout=5)).stdout == "fine"
    assert link.lost is None
    await link.aclose()


async def driver_frames(reader: asyncio.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """What the driver sends, read as the host reads it."""
    decoder = wire.DriverDecoder()
    while data := await reader.read(65536):
        decoder.push(data)
        while (frame := decoder.next_frame()) is not None:
            yield frame


async def hostile_node(script: Any) -> tuple[NodeLink, list[NodeLink]]:
    """A 'node host' of our own making behind a real stream: `script(reader, writer)` plays it."""

    class Listener:
        async def listen(self, client: str, address: str, token: bytes) -> int:
            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                assert await reader.readexactly(wire.TOKEN_BYTES) == token
                writer.write(wire.encode({"op": "ready"}))
                with contextlib.suppress(asyncio.CancelledError):  # the test's loop ends
                    await script(reader, writer)

            self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
            return int(self.server.sockets[0].getsockname()[1])

        async def until_closed(self, client: str) -> None:
            await asyncio.Event().wait()

    lost: list[NodeLink] = []
    link = NodeLink(Node("hostile00000", "127.0.0.1", {}), Actor(Listener()), "c", answer, lost.append)
    await link.connect()
    return link, lost


async def test_a_node_is_read_like_a_local_worker_and_a_bad_stream_loses_only_it() -> None:
    answers: list[dict[str, Any]] = []
    SERVED.clear()

    async def forge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for frame in driver_frames(reader):
            if frame["op"] == "execute":  # a result with every field of the wrong kind
                writer.write(wire.encode({"op": "done", "id": frame["id"], "value": {
                    "stdout": ["x"], "omitted_chars": -5, "notes": ["n" * 10_000] * 500, "timed_out": "yes"}}))  # fmt: skip
                # A call-back for a REPL this driver did not put on this node, and one naming no function.
                writer.write(
                    wire.encode({"op": "call", "id": 7, "repl": "elsewhere", "fn": "llm_query", "args": {}})
                )
                writer.write(wire.encode({"op": "call", "id": 8, "repl": "r", "fn": "os.system", "args": {}}))
            elif frame["op"] == "answer":
                answers.append(frame)
            elif frame["op"] == "variable_names":
                writer.write(b"\xff\xff\xff\xff")  # a length past the channel's limit: not a stream any more

    link, lost = await hostile_node(forge)
    link.repls.add("r")
    result = await link.request("execute", repl="r", code="x", timeout=5)
    assert result.stdout == '["x"]' and result.omitted_chars == 0 and not result.timed_out
    assert len(result.notes) == 100 and all(len(n) == 2_000 for n in result.notes)
    for _ in range(100):  # the refusals are sent at once, on this loop
        if len(answers) == 2:
            break
        await asyncio.sleep(0.01)
    assert [(a["id"], a["ok"]) for a in answers] == [(7, False), (8, False)] and not SERVED
    assert "no such REPL" in answers[0]["message"] and "unknown host function" in answers[1]["message"]
    other, _ = await hostile_node(forge)  # a second node, which stays
    other.repls.add("r")
    with pytest.raises(NodeLost, match=r"hostile00000 \(127\.0\.0\.1\).*invalid message.*limit") as gone:
        await link.request("variable_names", repl="r")
    assert lost == [link] and "gone" in str(gone.value)
    with pytest.raises(NodeLost):
        await link.request("execute", repl="r", code="x", timeout=5)
    assert (await other.request("execute", repl="r", code="x", timeout=5)).stdout == '["x"]'
    await other.aclose()


async def test_a_node_that_floods_the_stream_is_read_no_faster_than_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The driver gives its loop back after every frame here; what the node sends meanwhile is read
    # only while little waits unread, so a flood never piles up in the driver's memory.
    monkeypatch.setattr(wire, "_SLICE_S", 0.0)
    monkeypatch.setattr(wire, "_MAX_UNREAD", 64 << 10)
    junk = wire.encode({"op": "done", "id": 999_999, "value": "x" * 4000})  # for no request: dropped

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for frame in driver_frames(reader):
            writer.write(junk * 500 + wire.encode({"op": "done", "id": frame["id"], "value": ["a"]}))

    link, _ = await hostile_node(flood)
    link.repls.add("r")
    decoder = link._out._decoder  # type: ignore[union-attr]
    most = [0]
    push = decoder.push

    def counted(data: bytes) -> None:
        push(data)
        most[0] = max(most[0], decoder.unread())

    monkeypatch.setattr(decoder, "push", counted)
    assert await link.request("variable_names", repl="r") == ["a"]
    assert 0 < most[0] <= (64 << 10) + (256 << 10) + len(junk), most  # (asyncio reads 256 KiB at most)
    await link.aclose()


async def test_a_dropped_stream_fails_that_nodes_requests_and_its_host_closes_the_repls(
    node: tuple[NodeHost, list[Fake]],
) -> None:
    host, made = node
    lost: list[NodeLink] = []
    link = await connect(host, "a", lost)
    await opened(link)
    hanging = asyncio.ensure_future(link.request("execute", repl="r", code="hang", timeout=5))
    await asyncio.sleep(0.05)
    stream = host._streams["client-a"]
    sock = stream.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    stream.transport.abort()  # the connection resets, as when a node's host is killed
    with pytest.raises(NodeLost, match=r"aaaaaaaaaaaa \(127\.0\.0\.1\)"):
        await hanging
    assert lost == [link]
    await asyncio.wait_for(made[0].cancelled.wait(), 5)
    for _ in range(100):
        if made[0].closed:
            break
        await asyncio.sleep(0.01)
    assert made[0].closed and host.describe()["live_repls"] == 0


async def test_a_host_whose_drivers_all_left_runs_nothing_but_itself() -> None:
    # After its drivers close (an RLMEnv's close() ends its loop's streams), a node runs no process
    # of theirs: the REPL workers, and also the fork server's zygote, which a driver still connected
    # keeps warm; the listening socket closes too. A new driver starts them again. (A node's host
    # waits rest_after_s first, for sequential runs' next driver: it keeps them meanwhile.)
    import os

    from recursa.sandbox import make_sandbox
    from recursa.sandbox.proc import descendants

    host = NodeHost(make_sandbox, rest_after_s=0)
    waiting = NodeHost(make_sandbox)
    try:
        late = await connect(waiting, "w")
        await late.host.remember_options.remote("o1", {"snapshots": False})
        late.repls.add("rw")
        await late.request("open", repl="rw", options="o1", memory=None)
        await late.aclose()
        assert waiting._fork_server is not None and waiting._server is not None
        before = descendants(os.getpid())  # (the waiting host's zygote among them)
        first, second = await connect(host, "a"), await connect(host, "b")
        for link in (first, second):
            await link.host.remember_options.remote("o1", {"snapshots": False})
            link.repls.add("r" + link.client)
            await link.request("open", repl="r" + link.client, options="o1", memory=None)
        assert (await first.request("execute", repl="rclient-a", code="print(6 * 7)", timeout=30)).stdout == "42\n"
        assert host._fork_server is not None and descendants(os.getpid()) - before
        await first.aclose()
        await second.request("close", repl="rclient-b")
        assert host._fork_server is not None and host._server is not None  # b is still connected
        await second.aclose()
        for _ in range(500):  # (the host reads the stream's end on this loop)
            if host._fork_server is None:
                break
            await asyncio.sleep(0.01)
        assert host._fork_server is None and host._server is None and not host.describe()["streams"]
        assert not descendants(os.getpid()) - before
        again = await connect(host, "c")  # listens again
        await again.aclose()
    finally:
        await host.shutdown()
        await waiting.shutdown()
