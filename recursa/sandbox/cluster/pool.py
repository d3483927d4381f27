"""The driver side of `sandbox="ray"`: which node each REPL goes to, and the call-backs coming home.

One `NodeHost` actor per Ray node serves every REPL this process puts there (node.py). A `RayPool`
belongs to one event loop of the driver (the loop a run, a session or an `RLMEnv` lives on): it
places REPLs on nodes, ships each context into Ray's object store once (Ray moves it to a node once,
however many REPLs there load it), and talks to each node's host over a stream of its own
(link.py; relayed over Ray actor calls where the driver cannot reach the node, relay.py):
requests out, results and call-backs in, a frame each. Call-backs are answered on this
loop, through the run's own handler: sub-calls, tools and the budget ledger never leave the
driver. A node that dies (or whose stream breaks) fails the REPLs it held, each with an error
naming the node; REPLs elsewhere go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import pickle
import socket
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from recursa.context import ContextPayload
from recursa.errors import ConfigError, SandboxError
from recursa.extras import install_hint
from recursa.sandbox.base import SNAPSHOT_IDLE_S, CallbackError, CallHandler, Sandbox
from recursa.sandbox.cluster.link import Node, NodeLink, NodeLost
from recursa.sandbox.cluster.relay import RelayHost, Transport, carrier_for
from recursa.sandbox.cluster.wire import isolation_from_wire

_NAMESPACE = "recursa"
_SHUTDOWN_S = 10.0  # for every node host to close its REPLs before the hosts are killed
_PROBE_S = 5.0  # a TCP connect to the head before ray.init
_HOST_CONCURRENCY = 10_000  # async calls in flight on one node host (exchanges of every driver)
_NODES_TTL_S = 1.0  # how long placement trusts the node table it read from the GCS
# Contexts no REPL of a pool loads any more, whose object refs it keeps (newest first) for the next
# REPL that loads one: the episodes of a task come in waves, and between two the pool would
# otherwise drop the object and put it again. (The nodes keep their copies the same way, node.py.)
_KEEP_IDLE_BYTES = 64 << 20
RAY_ADDRESS = "RAY_ADDRESS"  # Ray's own variable naming the cluster a driver joins


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(f"«sandbox='ray'» needs Ray, which is not installed: {install_hint('ray')}") from None
    return ray


def preflight(options: dict[str, Any]) -> None:
    """What a config can be checked for before any run (RLM(...), RLMEnv(...), the CLI): Ray is
    installed, and the cluster `options` name answers (unless this process is connected already)."""
    ray = import_ray()
    address = options.get("address")
    if (address is None or isinstance(address, str)) and not ray.is_initialized():
        _check_reachable(*named_address(address))


def named_address(address: str | None) -> tuple[str | None, str]:
    """The cluster a driver given `address` joins, and where that came from. None: the one Ray's own
    RAY_ADDRESS names (how a process started without recursa's options, such as `recursa acp` under
    a verifiers rollout or `recursa openenv`, is pointed at one; Ray's jobs set it too), else (None)
    a new local instance of our own, never a cluster that merely happens to run on this machine."""
    if address is None and os.environ.get(RAY_ADDRESS):
        return os.environ[RAY_ADDRESS], f" (from ${RAY_ADDRESS})"
    return address, ""


def connect(address: str | None) -> Any:
    """Ray, connected: the running connection, else `ray.init` of the cluster `address` names
    (`_named`: None is RAY_ADDRESS's, else a local instance)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    named, source = named_address(address)
    _check_reachable(named, source)
    try:
        ray.init(address=named or "local", include_dashboard=False, log_to_driver=False, configure_logging=False,
                 namespace=_NAMESPACE)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {named!r}{source}" if named else "a local Ray instance"
        raise ConfigError(
            f"«sandbox='ray'» could not connect to {where}: {exc}. Start the cluster (`ray start --head`) "
            'or pass «sandbox_options=»{"address": "HOST:PORT"} (or "auto" for the running one).'
        ) from None
    return ray


def unreachable(address: str) -> str | None:
    """Why the Ray cluster at `address` cannot be reached, found in seconds (ray.init retries an
    unreachable one for minutes); None when something answers there."""
    where = address.removeprefix("ray://").removeprefix("ray+tls://")
    host, _, port = where.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=_PROBE_S):
            return None
    except ValueError:
        return "it is not HOST:PORT"
    except OSError as exc:
        return f"nothing answers there ({exc.strerror or exc})"


def _check_reachable(address: str | None, source: str = "") -> None:
    """Fail in seconds naming `address` (and `source`, where it came from) when nothing answers
    there; None, "auto" and "local" are not probed (Ray finds or starts those itself)."""
    if address is None or address in ("auto", "local"):
        return
    problem = unreachable(address)
    if problem is None:
        return
    raise ConfigError(
        f"«sandbox='ray'»: the Ray cluster address {address!r}{source} cannot be reached: {problem}. "
        'Give the head node\'s GCS address (`ray start --head` prints it), its Ray Client address '
        '("ray://HEAD:10001") from outside the cluster, "auto" for a cluster started on this machine, '
        "or None for a local instance (with $RAY_ADDRESS unset)."
    )


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
    made = _host_classes.get(RelayHost)
    if made is None:
        made = _host_classes[RelayHost] = ray.remote(RelayHost)
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


class RayPool:
    """The REPLs one event loop of this process runs on a Ray cluster."""

    def __init__(self, ray: Any, make_sandbox: Callable[..., Sandbox]) -> None:
        self.ray = ray
        self.make_sandbox = make_sandbox
        self.client = uuid.uuid4().hex
        self._handlers: dict[str, CallHandler] = {}  # repl -> the run's call-back handler
        self._repl_node: dict[str, Node] = {}
        self._links: dict[str, asyncio.Future[NodeLink]] = {}  # node id -> its stream (once connected)
        self._unreachable: set[str] = set()  # node ids whose stream could not be opened ("auto")
        self._dead: dict[str, str] = {}  # node id -> why
        self._contexts: dict[str, Any] = {}  # context key -> object ref (while REPLs use it, then kept)
        self._context_users: dict[str, set[str]] = {}
        self._context_bytes: dict[str, int] = {}  # context key -> its size, while its ref is kept
        self._idle_contexts: dict[str, None] = {}  # keys no REPL of this pool uses, oldest first (kept)
        self._placed: dict[str, int] = {}  # node id -> REPLs this pool put there
        self._opened: dict[str, int] = {}  # node id -> REPLs this pool ever started there (ties)
        self._affinity: dict[str, str] = {}  # affinity key (a call tree's root run) -> node id
        self._words: dict[str, asyncio.TimerHandle] = {}  # repl -> its `idle_soon` word, until sent
        self._node_table: tuple[float, list[dict[str, Any]]] | None = None
        self._reading_nodes: asyncio.Future[list[dict[str, Any]]] | None = None

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
        bursts; a node that dies meanwhile is known from its host's failure, `_dead`). Asking is a
        blocking round trip to the GCS, 20-25 ms on the loaded test machine, which held every step
        of this loop once a second: once there is a table, placement uses it while a thread asks
        for the next one."""
        loop = asyncio.get_running_loop()
        if self._node_table is None:
            self._node_table = (loop.time(), self.ray.nodes())
        elif loop.time() - self._node_table[0] > _NODES_TTL_S and self._reading_nodes is None:
            self._reading_nodes = reading = loop.run_in_executor(None, self.ray.nodes)
            reading.add_done_callback(self._nodes_read)
        return self._node_table[1]

    def _nodes_read(self, reading: asyncio.Future[list[dict[str, Any]]]) -> None:
        self._reading_nodes = None
        if not reading.cancelled() and reading.exception() is None:
            self._node_table = (reading.get_loop().time(), reading.result())

    def _order(self, nodes: list[Node], affinity: str | None) -> list[Node]:
        """Where to try first: the node of the same call tree, then the least loaded (of equals,
        the one that has started fewer, so REPLs one at a time take turns)."""
        nodes = sorted(nodes, key=lambda n: (self._placed.get(n.node_id, 0), self._opened.get(n.node_id, 0)))
        wanted = self._affinity.get(affinity) if affinity else None
        return sorted(nodes, key=lambda n: n.node_id != wanted)

    async def open(self, repl: str, handler: CallHandler, *, options: dict[str, Any], kind: str,
                   resources: dict[str, float] | None, labels: dict[str, str] | None,
                   max_repls_per_node: int | None, affinity: str | None,
                   memory: dict[str, Any] | None, timeout: float,
                   transport: Transport = "auto", context: str | None = None) -> tuple[Node, dict[str, Any]]:  # fmt: skip
        """Start `repl` on a fitting node with room; waits up to `timeout` for room. `context`: the
        key of a context the node loads into the REPL in the same request if it has it (the reply's
        `loaded`, or `load_error`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.01
        while True:
            candidates = self.nodes(resources, labels)
            if not candidates:
                lost = "".join(
                    f"; {node_id[:12]} is lost to this driver: {why}" for node_id, why in self._dead.items()
                )
                raise SandboxError(
                    "no live Ray node fits this REPL's placement "
                    f"(resources={resources or {}}, labels={labels or {}}); nodes: "
                    + ", ".join(f"{n['NodeID'][:12]} {n.get('Resources', {})}" for n in self.ray.nodes())
                    + lost
                )
            for node in self._order(candidates, affinity):
                self._handlers[repl] = handler
                self._repl_node[repl] = node
                self._placed[node.node_id] = self._placed.get(node.node_id, 0) + 1  # before the await:
                try:  # REPLs placed at once must see each other
                    link = await self._link(node, kind, max_repls_per_node, transport)
                    link.repls.add(repl)
                    share = None if memory is None else {**memory, "nodes": len(candidates)}
                    digest = await self._send_options(link, options)
                    reply = await link.request("open", repl=repl, options=digest, memory=share, context=context)
                except NodeLost:  # found dead before the REPL started there: try the others
                    self._unplace(node)
                    self._forget(repl)
                    continue
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
        self._hold_word(repl)
        self._handlers.pop(repl, None)
        node = self._repl_node.pop(repl, None)
        link = self._connected(node)
        if link is not None:
            link.repls.discard(repl)

    def _connected(self, node: Node | None) -> NodeLink | None:
        made = self._links.get(node.node_id) if node is not None else None
        return made.result() if made is not None and _ready(made) else None

    async def _send_options(self, link: NodeLink, options: dict[str, Any]) -> str:
        """The digest the node knows `options` by, sent to it by an actor call the first time: they
        may hold any picklable value (a Hardening, a path), which the stream's JSON does not carry."""
        digest = hashlib.sha256(pickle.dumps(options)).hexdigest()
        if digest not in link.options_sent:
            await self._actor_call(link, link.host.remember_options.remote(digest, options))
            link.options_sent.add(digest)
        return digest

    async def _actor_call(self, link: NodeLink, ref: Any) -> Any:
        """An actor call to `link`'s host; the host or its node dead loses the node (NodeLost)."""
        try:
            return await ref
        except self.ray.exceptions.RayActorError as exc:
            link.lose(f"its REPL host died: {type(exc).__name__}")
            raise NodeLost(link.node, link.lost or "lost") from None

    async def close(self, repl: str) -> None:
        self._hold_word(repl)
        node = self._repl_node.get(repl)
        try:
            link = self._connected(node)
            if link is not None and link.lost is None:
                with contextlib.suppress(NodeLost):
                    await link.request("close", repl=repl)
        finally:
            if node is not None:
                self._unplace(node)
            self._forget(repl)
            for key, users in list(self._context_users.items()):
                users.discard(repl)
                if not users:
                    self._context_users.pop(key, None)
                    self._idle_contexts[key] = None
            self._trim_idle(_KEEP_IDLE_BYTES)

    def _trim_idle(self, limit: int) -> None:
        """Drop the refs of contexts no REPL uses, oldest first, until the rest take at most `limit`
        bytes (a dropped ref lets Ray free the object)."""
        kept = sum(self._context_bytes.get(key, 0) for key in self._idle_contexts)
        while self._idle_contexts and kept > limit:
            key = next(iter(self._idle_contexts))
            del self._idle_contexts[key]
            kept -= self._context_bytes.pop(key, 0)
            self._contexts.pop(key, None)

    def close_soon(self, repl: str) -> None:
        """Without awaiting (a finalizer): ask the node to close `repl`, fire and forget."""
        link = self._connected(self._repl_node.get(repl))
        if link is not None and link.lost is None:
            with contextlib.suppress(Exception):
                link.host.close.remote(repl)  # an actor call: the stream belongs to its loop's thread
        self._forget(repl)

    def host(self, node: Node) -> Any:
        """The host actor on `node` (this process's)."""
        return _host_actor(self.ray, node, self.make_sandbox, "auto", None)

    # -- the streams to the nodes' hosts ----------------------------------------------------------

    async def _link(self, node: Node, kind: str = "auto", max_repls: int | None = None,
                    transport: Transport = "auto") -> NodeLink:  # fmt: skip
        """This pool's stream to `node`'s host, connected on first use (REPLs placed at once share it)."""
        made = self._links.get(node.node_id)
        if made is None:
            made = self._links[node.node_id] = asyncio.ensure_future(
                self._connect(node, kind, max_repls, transport)
            )
        try:
            return await asyncio.shield(made)
        except NodeLost:
            raise
        except Exception as exc:
            self._links.pop(node.node_id, None)
            self._dead.setdefault(node.node_id, f"its REPL host could not be reached: {exc}")
            raise NodeLost(node, self._dead[node.node_id]) from None

    async def _connect(self, node: Node, kind: str, max_repls: int | None, transport: Transport) -> NodeLink:
        host = _host_actor(self.ray, node, self.make_sandbox, kind, max_repls)
        link = NodeLink(node, host, self.client, self._serve_call, self._lost)
        await link.connect(carrier_for(self.ray, transport, self._unreachable))
        return link

    def _lost(self, link: NodeLink) -> None:
        self._dead.setdefault(link.node.node_id, link.lost or "lost")

    async def call(self, repl: str, method: str, **fields: Any) -> Any:
        self._hold_word(repl)
        link = self._connected(self._repl_node.get(repl))
        if link is None:
            raise SandboxError("this REPL is closed")
        return await link.request(method, repl=repl, **fields)

    def idle_soon(self, repl: str) -> None:
        """With snapshots="idle", after a cell: `repl`'s node hears that nothing followed the cell
        once this loop has sent the REPL nothing for SNAPSHOT_IDLE_S, the policy thinking (the word
        a local REPL's host sends its worker, connection.py; NodeHost.idle)."""
        self._hold_word(repl)
        self._words[repl] = asyncio.get_running_loop().call_later(SNAPSHOT_IDLE_S, self._idle, repl)

    def _idle(self, repl: str) -> None:
        self._words.pop(repl, None)
        link = self._connected(self._repl_node.get(repl))
        if link is not None:
            link.send({"op": "idle", "repl": repl})

    def _hold_word(self, repl: str) -> None:
        word = self._words.pop(repl, None)
        if word is not None:
            word.cancel()

    def holds(self, repl: str, payload: ContextPayload) -> None:
        """`repl` has `payload` loaded: its object ref is kept while a REPL of this pool holds it."""
        key = payload.info.sha256
        self._context_users.setdefault(key, set()).add(repl)
        self._idle_contexts.pop(key, None)
        self._context_bytes[key] = payload.size_bytes

    async def load_context(self, repl: str, payload: ContextPayload, *, ask: bool = True) -> dict[str, Any]:
        """Load `payload` into `repl`; its isolation report after the load (node.py). `ask=False`:
        the node is known to lack the context (the REPL's `open` said so), which goes at once."""
        key = payload.info.sha256
        self.holds(repl, payload)
        if ask:
            isolation: dict[str, Any] | None = await self.call(repl, "load_cached", key=key)
            if isolation is not None:
                return isolation  # the node has it already (a REPL there loaded it, now or a while ago): no bytes move
        # The first REPL on the node with this context: an actor call, so that Ray brings the
        # object to the node (the ref goes in a list: the host fetches it only if still needed).
        ref = await self._ref(key, payload)
        meta = {"kind": payload.kind, "size_bytes": payload.size_bytes, "byte_lengths": list(payload.byte_lengths),
                "keys": list(payload.keys), "info": payload.info}  # fmt: skip
        link = self._connected(self._repl_node.get(repl))
        if link is None:
            raise SandboxError("this REPL is closed")
        return isolation_from_wire(await self._actor_call(link, link.host.load_context.remote(repl, key, meta, [ref])))

    async def _ref(self, key: str, payload: ContextPayload) -> Any:
        """The context's object ref, put into the object store by the first REPL that needs it
        (REPLs that need it at once share one put: a future stands for it)."""
        ref = self._contexts.get(key)
        if ref is None:
            ref = self._contexts[key] = asyncio.ensure_future(asyncio.to_thread(self._put, payload))
        if isinstance(ref, asyncio.Future):
            try:
                ref = await asyncio.shield(ref)
            except BaseException:
                if self._contexts.get(key) is not None and self._contexts[key].done():
                    self._contexts.pop(key, None)
                raise
            self._contexts[key] = ref
        return ref

    def _put(self, payload: ContextPayload) -> Any:
        """The payload's bytes into the object store, copied once (from the memfd's pages)."""
        if payload.size_bytes == 0:
            return self.ray.put(b"")
        with mmap.mmap(payload.fd, payload.size_bytes, prot=mmap.PROT_READ) as mapped:
            import numpy  # Ray depends on it; an array is stored (and read on the node) without pickling

            return self.ray.put(numpy.frombuffer(mapped, dtype=numpy.uint8).copy())

    # -- call-backs coming home --------------------------------------------------------------------

    async def _serve_call(self, link: NodeLink, call_id: int, repl: str, function: str,
                          args: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """A REPL's call-back, answered by its run's handler on this loop (the budget's ledger)."""
        handler = self._handlers.get(repl)
        try:
            if handler is None:
                raise CallbackError("SandboxError", "this REPL was closed")
            return {"ok": True, "value": await handler(function, args)}
        except Exception as exc:  # as the local host does: the code sees the error, the run goes on
            error = CallbackError.of(exc)
            return {"ok": False, "kind": error.kind, "message": str(error)}

    async def aclose(self) -> None:
        """Close this pool's REPLs on every node, and the streams."""
        links = [made.result() for made in self._links.values() if _ready(made)]
        await asyncio.gather(*(link.aclose() for link in links), return_exceptions=True)
        for made in self._links.values():
            made.cancel()
        self._links.clear()
        for word in self._words.values():
            word.cancel()
        self._words.clear()
        self._handlers.clear()
        self._repl_node.clear()
        self._contexts.clear()
        self._context_bytes.clear()
        self._idle_contexts.clear()


def _ready(made: asyncio.Future[NodeLink]) -> bool:
    """A stream that is connected (it may have been lost since)."""
    return made.done() and not made.cancelled() and made.exception() is None


# One pool per event loop (a run's, a session's, an RLMEnv's): its exchanges and handlers live on it.
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RayPool] = weakref.WeakKeyDictionary()


async def release_loop() -> None:
    """Let go of this loop's pool once it holds no REPL (an environment on the loop closed, and the
    loop goes on): its streams close, and a node no other driver uses then stops its zygote
    (node.py). The loop's next REPL connects again."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is not None and not pool._handlers:
        del _pools[loop]
        await pool.aclose()


def pool_for_loop(address: str | None, make_sandbox: Callable[..., Sandbox]) -> RayPool:
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = RayPool(connect(address), make_sandbox)
        _pools[loop] = pool
    return pool
