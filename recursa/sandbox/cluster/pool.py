"""The driver side of `sandbox="ray"`: which node each REPL goes to, and the call-backs coming home.

One `NodeHost` actor per Ray node serves every REPL this process puts there (node.py). A `RayPool`
belongs to one event loop of the driver (the loop a run, a session or an `RLMEnv` lives on): it
places REPLs on nodes, ships each context into Ray's object store once (Ray moves it to a node once,
however many REPLs there load it), and talks to each node's host through exchanges: the requests
its REPLs' stand-ins make on one turn of this loop leave together in one actor call, and each call
brings back whatever is ready (requests done, call-backs asked). Call-backs are answered on this
loop, through the run's own handler: sub-calls, tools and the budget ledger never leave the
driver. While anything may still come from a node, one exchange to it stays open (that is how a
call-back or a result reaches the driver without being asked for). A node that dies fails the
REPLs it held, each with an error naming the node; REPLs elsewhere go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recursa.context import ContextPayload
from recursa.errors import ConfigError, SandboxError, SandboxLost
from recursa.sandbox.base import CallbackError, CallHandler, Sandbox
from recursa.sandbox.cluster.node import GATHER_S, Answer, Event, NodeHost, Request

_NAMESPACE = "recursa"
_SHUTDOWN_S = 10.0  # for every node host to close its REPLs before the hosts are killed
_PROBE_S = 5.0  # a TCP connect to the head before ray.init
_HOST_CONCURRENCY = 10_000  # async calls in flight on one node host (exchanges of every driver)
_NODES_TTL_S = 1.0  # how long placement trusts the node table it read from the GCS


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "«sandbox='ray'» needs Ray, which is not installed: pip install \"recursa[ray]\" "
            '(pip install -e ".[ray]" in a source checkout)'
        ) from None
    return ray


def connect(address: str | None) -> Any:
    """Ray, connected: the running connection, else `ray.init(address)` (None: a local instance)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    if address not in (None, "auto", "local"):
        _check_reachable(address)
    try:  # None: a new local instance of our own, never a cluster that happens to run on this machine
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False, configure_logging=False,
                 namespace=_NAMESPACE)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        raise ConfigError(
            f"«sandbox='ray'» could not connect to {where}: {exc}. Start the cluster (`ray start --head`) "
            'or pass «sandbox_options=»{"address": "HOST:PORT"} (or "auto" for the running one).'
        ) from None
    return ray


def _check_reachable(address: str) -> None:
    """Fail in seconds, naming the address: ray.init retries an unreachable one for minutes."""
    where = address.removeprefix("ray://").removeprefix("ray+tls://")
    host, _, port = where.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=_PROBE_S):
            return
    except ValueError:
        problem = "it is not HOST:PORT"
    except OSError as exc:
        problem = f"nothing answers there ({exc.strerror or exc})"
    raise ConfigError(
        f"«sandbox='ray'»: the Ray cluster address {address!r} cannot be reached: {problem}. "
        'Give the head node\'s GCS address (`ray start --head` prints it), "auto" for a cluster '
        "started on this machine, or None for a local instance."
    )


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


# Node-host actors are per driver process (a name of their own per node), shared by every pool of
# the process; pools are per event loop. Guarded: pools on several loops may create hosts at once.
_hosts_lock = threading.Lock()
_hosts: dict[tuple[str, str], Any] = {}  # (gcs address, node id) -> actor handle
_PROCESS_TAG = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
_host_classes: dict[type, Any] = {}  # NodeHost -> its Ray actor class (guarded by _hosts_lock)


def _host_actor(ray: Any, node: Node, make_sandbox: Callable[..., Sandbox], kind: str,
                max_repls: int | None) -> Any:  # fmt: skip
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    key = (ray.get_runtime_context().gcs_address, node.node_id)
    with _hosts_lock:
        actor = _hosts.get(key)
        if actor is None:
            remote = _host_class(ray).options(
                name=f"recursa-repls-{_PROCESS_TAG}-{node.node_id[:16]}",
                namespace=_NAMESPACE,
                num_cpus=0,
                max_concurrency=_HOST_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            )
            actor = remote.remote(make_sandbox, kind=kind, max_repls=max_repls)
            _hosts[key] = actor
        return actor


def _host_class(ray: Any) -> Any:
    """NodeHost as a Ray actor class, made once per process: Ray exports a class to the cluster
    once per actor class object (a few hundred milliseconds of the driver's time: it disassembles
    the class to name it), so one per node would pay that for every node."""
    made = _host_classes.get(NodeHost)
    if made is None:
        made = _host_classes[NodeHost] = ray.remote(NodeHost)
    return made


def node_hosts() -> list[tuple[str, Any]]:
    """(node id, host actor) for every node this process has put REPLs on."""
    with _hosts_lock:
        return [(node_id, actor) for (_, node_id), actor in _hosts.items()]


def shutdown_hosts() -> int:
    """Stop every node-host actor of this process (their REPLs with them); how many there were."""
    with _hosts_lock:
        actors = list(_hosts.values())
        _hosts.clear()
    if actors:
        ray = import_ray()
        # First an orderly close (the REPL workers and the fork server end with their host), then
        # the actors go; a host on a node that died answers neither and is killed at once.
        closing = []
        for actor in actors:
            with contextlib.suppress(Exception):
                closing.append(actor.shutdown.remote())
        with contextlib.suppress(Exception):
            ray.wait(closing, num_returns=len(closing), timeout=_SHUTDOWN_S)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
    return len(actors)


@dataclass
class _Link:
    """This pool's traffic to one node's host: requests not sent yet, exchanges in flight."""

    node: Node
    host: Any
    outgoing: list[Request] = field(default_factory=list)
    flushing: bool = False
    in_flight: int = 0
    waiting: int = 0  # requests sent and not answered yet


class RayPool:
    """The REPLs one event loop of this process runs on a Ray cluster."""

    def __init__(self, ray: Any, make_sandbox: Callable[..., Sandbox]) -> None:
        self.ray = ray
        self.make_sandbox = make_sandbox
        self.client = uuid.uuid4().hex
        self._handlers: dict[str, CallHandler] = {}  # repl -> the run's call-back handler
        self._repl_node: dict[str, Node] = {}
        self._links: dict[str, _Link] = {}  # node id -> traffic to its host
        self._pending: dict[int, tuple[_Link, asyncio.Future[Any]]] = {}  # request id -> its answer
        self._dead: dict[str, str] = {}  # node id -> why
        self._contexts: dict[str, Any] = {}  # context key -> object ref (kept while REPLs use it)
        self._context_users: dict[str, set[str]] = {}
        self._placed: dict[str, int] = {}  # node id -> REPLs this pool put there
        self._opened: dict[str, int] = {}  # node id -> REPLs this pool ever started there (ties)
        self._affinity: dict[str, str] = {}  # affinity key (a call tree's root run) -> node id
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._node_table: tuple[float, list[dict[str, Any]]] | None = None

    # -- placement ---------------------------------------------------------------------------------

    def nodes(self, resources: dict[str, float] | None, labels: dict[str, str] | None) -> list[Node]:
        """Live nodes that have every resource in `resources` and every label in `labels`."""
        found = []
        for entry in self._cluster_nodes():
            if not entry.get("Alive") or entry["NodeID"] in self._dead:
                continue
            have = entry.get("Resources", {})
            node_labels = entry.get("Labels", {}) or {}
            if any(have.get(name, 0) < amount for name, amount in (resources or {}).items()):
                continue
            if any(node_labels.get(k) != v for k, v in (labels or {}).items()):
                continue
            found.append(Node(entry["NodeID"], entry.get("NodeManagerAddress", "?"), dict(have), node_labels))
        return found

    def _cluster_nodes(self) -> list[dict[str, Any]]:
        """The cluster's node table, asked of the GCS at most every _NODES_TTL_S (REPLs start in
        bursts; a node that dies meanwhile is known from its host's failure, `_dead`)."""
        now = asyncio.get_running_loop().time()
        if self._node_table is None or now - self._node_table[0] > _NODES_TTL_S:
            self._node_table = (now, self.ray.nodes())
        return self._node_table[1]

    def _order(self, nodes: list[Node], affinity: str | None) -> list[Node]:
        """Where to try first: the node of the same call tree, then the least loaded (of equals,
        the one that has started fewer, so REPLs one at a time take turns)."""
        nodes = sorted(nodes, key=lambda n: (self._placed.get(n.node_id, 0), self._opened.get(n.node_id, 0)))
        wanted = self._affinity.get(affinity) if affinity else None
        return sorted(nodes, key=lambda n: n.node_id != wanted)

    async def open(self, repl: str, handler: CallHandler, *, options: dict[str, Any], kind: str,
                   resources: dict[str, float] | None, labels: dict[str, str] | None,
                   max_repls_per_node: int | None, affinity: str | None,
                   memory: dict[str, Any] | None, timeout: float) -> tuple[Node, dict[str, Any]]:  # fmt: skip
        """Start `repl` on a fitting node with room; waits up to `timeout` for room."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.01
        while True:
            candidates = self.nodes(resources, labels)
            if not candidates:
                raise SandboxError(
                    "no live Ray node fits this REPL's placement "
                    f"(resources={resources or {}}, labels={labels or {}}); nodes: "
                    + ", ".join(f"{n['NodeID'][:12]} {n.get('Resources', {})}" for n in self.ray.nodes())
                )
            for node in self._order(candidates, affinity):
                link = self._link(node, kind, max_repls_per_node)
                self._handlers[repl] = handler
                self._repl_node[repl] = node
                self._placed[node.node_id] = self._placed.get(node.node_id, 0) + 1  # before the await:
                try:  # REPLs placed at once must see each other
                    share = None if memory is None else {**memory, "nodes": len(candidates)}
                    reply = await self.request(link, "open", self.client, repl, options, share)
                except BaseException:
                    self._unplace(node)
                    self._forget(repl)
                    raise
                if reply.get("full"):
                    self._unplace(node)
                    self._forget(repl)
                    continue
                if affinity:
                    self._affinity.setdefault(affinity, node.node_id)
                self._opened[node.node_id] = self._opened.get(node.node_id, 0) + 1
                return node, reply
            if loop.time() >= deadline:
                raise SandboxError(
                    "no fitting Ray node has room for another REPL (max_repls_per_node="
                    f"{max_repls_per_node}, or the environment's max_memory_bytes share on each node) and "
                    f"none freed it in {timeout:g} s; close finished episodes or add nodes"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _unplace(self, node: Node) -> None:
        self._placed[node.node_id] = max(0, self._placed.get(node.node_id, 1) - 1)

    def _forget(self, repl: str) -> None:
        self._handlers.pop(repl, None)
        self._repl_node.pop(repl, None)

    async def close(self, repl: str) -> None:
        node = self._repl_node.get(repl)
        try:
            link = self._links.get(node.node_id) if node is not None else None
            if link is not None and link.node.node_id not in self._dead:
                with contextlib.suppress(NodeLost):
                    await self.request(link, "close", repl)
        finally:
            if node is not None:
                self._unplace(node)
            self._forget(repl)
            for key, users in list(self._context_users.items()):
                users.discard(repl)
                if not users:
                    self._context_users.pop(key, None)
                    self._contexts.pop(key, None)  # the ref goes; Ray frees the object

    def close_soon(self, repl: str) -> None:
        """Without awaiting (a finalizer): ask the node to close `repl`, fire and forget."""
        node = self._repl_node.get(repl)
        if node is not None and node.node_id not in self._dead:
            with contextlib.suppress(Exception):
                self.host(node).close.remote(repl)
        self._forget(repl)

    def host(self, node: Node) -> Any:
        """The host actor on `node` (this process's)."""
        return self._link(node).host

    # -- requests to a node's host ---------------------------------------------------------------

    def _link(self, node: Node, kind: str = "auto", max_repls: int | None = None) -> _Link:
        link = self._links.get(node.node_id)
        if link is None:
            host = _host_actor(self.ray, node, self.make_sandbox, kind, max_repls)
            link = self._links[node.node_id] = _Link(node, host)
        return link

    async def request(self, link: _Link, method: str, *args: Any) -> Any:
        """Ask `link`'s host to run `method`; its value, or its error raised here. A dead node
        raises NodeLost; a cancelled wait cancels the request on the node."""
        why = self._dead.get(link.node.node_id)
        if why is not None:
            raise NodeLost(link.node, why)
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (link, future)
        link.waiting += 1
        self._send(link, (request_id, method, args))
        try:
            return await future
        except asyncio.CancelledError:
            if link.node.node_id not in self._dead:
                self._send(link, (0, "cancel", (request_id,)))
            raise
        finally:
            self._pending.pop(request_id, None)
            link.waiting -= 1

    async def call(self, repl: str, method: str, *args: Any) -> Any:
        node = self._repl_node.get(repl)
        if node is None:
            raise SandboxError("this REPL is closed")
        return await self.request(self._link(node), method, repl, *args)

    def _send(self, link: _Link, request: Request) -> None:
        """Queue `request`; everything queued on this turn of the loop leaves in one exchange."""
        link.outgoing.append(request)
        if not link.flushing:
            link.flushing = True
            loop = asyncio.get_running_loop()
            if link.waiting > 1:
                loop.call_later(GATHER_S, self._flush, link)
            else:
                loop.call_soon(self._flush, link)

    def _flush(self, link: _Link) -> None:
        link.flushing = False
        batch, link.outgoing = link.outgoing, []
        if link.node.node_id in self._dead:
            return
        try:
            ref = link.host.exchange.remote(self.client, batch)
        except Exception as exc:  # the handle itself refuses (Ray shutting down)
            self._lose(link, _why(exc))
            return
        link.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._receive(link, ref))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _receive(self, link: _Link, ref: Any) -> None:
        try:
            events: list[Event] = await ref
        except self.ray.exceptions.RayActorError as exc:
            self._lose(link, _why(exc))
            return
        except self.ray.exceptions.RayError as exc:  # the exchange itself failed: its requests with it
            self._fail(link, SandboxError(f"the Ray node host {link.node.name} failed: {exc}"))
            events = []
        finally:
            link.in_flight -= 1
        for event in events:
            if event[0] == "done":
                _, request_id, ok, value = event
                entry = self._pending.get(request_id)
                if entry is not None and not entry[1].done():
                    if ok:
                        entry[1].set_result(value)
                    else:
                        entry[1].set_exception(value)
            else:
                task = asyncio.get_running_loop().create_task(self._answer(link, event))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        # One exchange stays open while anything may still come from this node: answers to
        # requests, call-backs of its REPLs' cells.
        if link.in_flight == 0 and (link.waiting or self._placed.get(link.node.node_id)):
            if not link.flushing:
                self._flush(link)

    def _lose(self, link: _Link, why: str) -> None:
        self._dead.setdefault(link.node.node_id, why)
        self._fail(link, NodeLost(link.node, self._dead[link.node.node_id]))

    def _fail(self, link: _Link, error: BaseException) -> None:
        for owner, future in list(self._pending.values()):
            if owner is link and not future.done():
                future.set_exception(error)

    async def load_context(self, repl: str, payload: ContextPayload) -> None:
        key = payload.info.sha256
        self._context_users.setdefault(key, set()).add(repl)
        ref = self._contexts.get(key)
        if ref is None:  # REPLs loading one context at once share one put: a future stands for it
            ref = asyncio.ensure_future(asyncio.to_thread(self._put, payload))
            self._contexts[key] = ref
        if isinstance(ref, asyncio.Future):
            try:
                ref = await asyncio.shield(ref)
            except BaseException:
                if self._contexts.get(key) is not None and self._contexts[key].done():
                    self._contexts.pop(key, None)
                raise
            self._contexts[key] = ref
        meta = {"kind": payload.kind, "size_bytes": payload.size_bytes, "byte_lengths": list(payload.byte_lengths),
                "keys": list(payload.keys), "info": payload.info}  # fmt: skip
        await self.call(repl, "load_context", key, meta, [ref])

    def _put(self, payload: ContextPayload) -> Any:
        """The payload's bytes into the object store, copied once (from the memfd's pages)."""
        if payload.size_bytes == 0:
            return self.ray.put(b"")
        with mmap.mmap(payload.fd, payload.size_bytes, prot=mmap.PROT_READ) as mapped:
            import numpy  # Ray depends on it; an array is stored (and read on the node) without pickling

            return self.ray.put(numpy.frombuffer(mapped, dtype=numpy.uint8).copy())

    # -- call-backs coming home --------------------------------------------------------------------

    async def _answer(self, link: _Link, call: Event) -> None:
        _, repl, call_id, function, args = call
        handler = self._handlers.get(repl)
        answer: Answer
        try:
            if handler is None:
                raise CallbackError("SandboxError", "this REPL was closed")
            answer = (call_id, True, await handler(function, args))
        except Exception as exc:  # as the local host does: the code sees the error, the run goes on
            error = CallbackError.of(exc)
            answer = (call_id, False, (error.kind, str(error)))
        if link.node.node_id not in self._dead:  # a node that died takes the cell with it
            self._send(link, (0, "answer", ([answer],)))

    async def aclose(self) -> None:
        """Close this pool's REPLs on every node; its open exchanges end with it."""
        for link in list(self._links.values()):
            if link.node.node_id not in self._dead:
                with contextlib.suppress(Exception):
                    await link.host.close_client.remote(self.client)
        for task in list(self._tasks):
            task.cancel()
        self._links.clear()
        self._handlers.clear()
        self._repl_node.clear()
        self._contexts.clear()


def _why(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():
        if "node" in line.lower() and ("died" in line.lower() or "dead" in line.lower()):
            return line.strip()
    return type(exc).__name__


# One pool per event loop (a run's, a session's, an RLMEnv's): its exchanges and handlers live on it.
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RayPool] = weakref.WeakKeyDictionary()


def pool_for_loop(address: str | None, make_sandbox: Callable[..., Sandbox]) -> RayPool:
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = RayPool(connect(address), make_sandbox)
        _pools[loop] = pool
    return pool
