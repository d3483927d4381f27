"""Encoding an environment's contexts: off the event loop, and once per context object kept here.

A start returns without waiting for the context's bytes: a str context (or a list or dict of str
small enough to check at once) is checked and described to the root on the caller's thread, and its
buffer is written and hashed on one of the environment's writer threads (`defer_payload`), while the
REPL process starts and the trainer generates the first reply. The episode's engine waits for the
buffer before the REPL loads it, and writes `run_start` (which records the sha256) once it is done,
before any other event of the run. Hashing and writing a 1 MB context costs 1.2-1.8 ms, more than
the rest of a start (docs/performance.md, "RL step"); both release the GIL, so a writer thread runs
beside the loop.

A trainer starts a group of episodes (samples) per task, each with the same context object: the
samples after the first reuse the buffer of the first, even while it is still being written (each
episode gets its own descriptor of it). Only immutable contexts (str, bytes) are kept, by identity,
with a reference to the object so that its id cannot be reused while it is kept; up to `MAX_BYTES`
in all, none over `MAX_ITEM_BYTES`, the least recently started first out (a buffer still being
written counts its characters, its bytes once written). A kept buffer is not freed by the worker
as it loads it (the host keeps it for a restart, as for a context read from a file), so a context
small enough to be kept is in memory twice while its episodes live: once here, once in each REPL.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from recursa.context import ContextPayload, Written, defer_payload, load_payload

MAX_ITEM_BYTES = 16 << 20
MAX_BYTES = 64 << 20
# Writer threads: two keep both CPUs of a small machine busy when a batch of episodes starts.
WRITERS = min(4, max(2, (os.cpu_count() or 1) // 2))
# How long a write waits for the loop's turn to end at most (a loop closed meanwhile never ends it).
TURN_WAIT_S = 0.05


@dataclasses.dataclass
class _Kept:
    context: Any  # the object itself: its id is not reused while it is kept
    payload: ContextPayload  # this cache's own descriptor of the buffer
    counted: int  # bytes counted against MAX_BYTES: its characters until it is written


class EncodedContexts:
    """`load(context)`: a payload of `context`, encoded once per context object kept here."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_item_bytes: int = MAX_ITEM_BYTES) -> None:
        self.max_bytes, self.max_item_bytes = max_bytes, max_item_bytes
        self._kept: collections.OrderedDict[int, _Kept] = collections.OrderedDict()  # by id(context)
        self._bytes = 0
        self._lock = threading.Lock()  # episodes of one environment may start on several loops
        self._writers: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._kept)

    async def load(self, context: Any) -> ContextPayload:
        """A payload the caller owns (and closes), as `recursa.context.load_payload` makes one; its
        bytes may still be being written (`payload.ready()` waits for them). Raises ContextError
        for a context that cannot be one, as `load_payload` does."""
        keep = isinstance(context, str | bytes) and len(context) <= self.max_item_bytes
        if keep:
            with self._lock:
                found = self._kept.get(id(context))
                if found is not None and found.context is context:
                    self._kept.move_to_end(id(context))
                    return _copy(found.payload)
        payload = defer_payload(context, _AfterThisTurn(asyncio.get_running_loop(), self._executor()))
        if payload is None:
            payload = await load_payload(context)
        if keep and payload.size_bytes <= self.max_item_bytes:
            payload.rebuild = None  # the worker must not free a buffer others load too
            self._add(context, _copy(payload))
        return payload

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(WRITERS, thread_name_prefix="recursa-context-writer")
            return self._writers

    def _add(self, context: Any, payload: ContextPayload) -> None:
        pending = payload.pending
        kept = _Kept(context, payload, payload.size_bytes if pending is None else payload.info.total_chars)
        with self._lock:
            old = self._kept.pop(id(context), None)
            if old is not None:
                self._drop(old)
            self._kept[id(context)] = kept
            self._bytes += kept.counted
            self._evict()
        if pending is not None:
            pending.add_done_callback(functools.partial(self._written, kept))

    def _written(self, kept: _Kept, pending: Future[Written]) -> None:
        """The buffer of `kept` is written (on a writer thread): count its bytes instead of its characters."""
        with self._lock:
            if self._kept.get(id(kept.context)) is not kept:
                return  # already out
            failed = pending.cancelled() or pending.exception() is not None
            size = 0 if failed else pending.result().size_bytes
            if failed or size > self.max_item_bytes:
                self._drop(self._kept.pop(id(kept.context)))  # failed, or too big to keep after all
                return
            self._bytes += size - kept.counted
            kept.counted = size
            self._evict()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and len(self._kept) > 1:
            self._drop(self._kept.popitem(last=False)[1])

    def _drop(self, kept: _Kept) -> None:
        self._bytes -= kept.counted
        kept.payload.close()

    def clear(self) -> None:
        """Forget every context (the environment is closing); episodes keep their own descriptors.
        The writer threads finish what they were given, then exit."""
        with self._lock:
            kept, self._kept, self._bytes = self._kept, collections.OrderedDict(), 0
            writers, self._writers = self._writers, None
        for entry in kept.values():
            entry.payload.close()
        if writers is not None:
            writers.shutdown(wait=False)


def _copy(payload: ContextPayload) -> ContextPayload:
    """The same buffer under a descriptor of its own, and facts the receiver may change freely; a
    buffer still being written is shared with its writer's result, which each copy takes itself."""
    payload.settle()
    info = dataclasses.replace(
        payload.info,
        chunk_lengths=list(payload.info.chunk_lengths),
        keys=list(payload.info.keys),
        skipped_files=list(payload.info.skipped_files),
    )
    fd, lengths, keys = os.dup(payload.fd), list(payload.byte_lengths), list(payload.keys)
    return ContextPayload(payload.kind, fd, payload.size_bytes, lengths, keys, info, pending=payload.pending)


class _AfterThisTurn(Executor):
    """Runs work on `inner` once the event loop's current turn is over (or after TURN_WAIT_S): a
    writer that began at once would hold the GIL while it encodes, and the start that handed it the
    work would wait for it; the write has until the REPL loads the context, tens of ms later.
    On the quiet 2-core machine a start with a new 1 MB context took 2.6-2.8 ms that way, 1.1 this."""

    def __init__(self, loop: asyncio.AbstractEventLoop, inner: Executor) -> None:
        self._loop, self._inner = loop, inner

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        turn_over = threading.Event()

        def after_the_turn() -> Any:
            turn_over.wait(TURN_WAIT_S)
            return fn(*args, **kwargs)

        future = self._inner.submit(after_the_turn)
        self._loop.call_soon(turn_over.set)
        return future
