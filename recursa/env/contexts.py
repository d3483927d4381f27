"""Contexts an environment has encoded lately, so that the episodes of one task share one buffer.

A trainer starts a group of episodes (samples) per task, each with the same context object.
Encoding a context (hashing it and writing it into a memfd, recursa/context.py) took about 1.3 ms
of a 1 MB episode's start (docs/performance.md, "RL step"); the samples after the first reuse the
buffer of the first: each episode gets its own descriptor of it.

Only immutable contexts (str, bytes) are kept, by identity, with a reference to the object so
that its id cannot be reused while it is kept; up to `MAX_BYTES` in all, none over `MAX_ITEM_BYTES`,
the least recently started first out. A kept buffer is not freed by the worker as it loads it
(the host keeps it for a restart, as for a context read from a file), so a context small enough to
be kept is in memory twice while its episodes live: once here, once in each REPL.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any

from recursa.context import ContextPayload, load_payload

MAX_ITEM_BYTES = 16 << 20
MAX_BYTES = 64 << 20


class EncodedContexts:
    """`load(context)`: a payload of `context`, encoded once per context object kept here."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_item_bytes: int = MAX_ITEM_BYTES) -> None:
        self.max_bytes, self.max_item_bytes = max_bytes, max_item_bytes
        # id(context) -> (the context itself, the payload whose descriptor is kept here)
        self._kept: collections.OrderedDict[int, tuple[Any, ContextPayload]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # episodes of one environment may start on several loops

    def __len__(self) -> int:
        return len(self._kept)

    async def load(self, context: Any) -> ContextPayload:
        """A payload the caller owns (and closes), as `recursa.context.load_payload` makes one."""
        keep = isinstance(context, str | bytes) and len(context) <= self.max_item_bytes
        if keep:
            with self._lock:
                found = self._kept.get(id(context))
                if found is not None and found[0] is context:
                    self._kept.move_to_end(id(context))
                    return _copy(found[1])
        payload = await load_payload(context)
        if keep and payload.size_bytes <= self.max_item_bytes:
            payload.rebuild = None  # the worker must not free a buffer others load too
            self._add(context, _copy(payload))
        return payload

    def _add(self, context: Any, payload: ContextPayload) -> None:
        with self._lock:
            old = self._kept.pop(id(context), None)
            if old is not None:
                self._drop(old[1])
            self._kept[id(context)] = (context, payload)
            self._bytes += payload.size_bytes
            while self._bytes > self.max_bytes and len(self._kept) > 1:
                self._drop(self._kept.popitem(last=False)[1][1])

    def _drop(self, payload: ContextPayload) -> None:
        self._bytes -= payload.size_bytes
        payload.close()

    def clear(self) -> None:
        """Forget every context (the environment is closing); episodes keep their own descriptors."""
        with self._lock:
            kept, self._kept, self._bytes = self._kept, collections.OrderedDict(), 0
        for _context, payload in kept.values():
            payload.close()


def _copy(payload: ContextPayload) -> ContextPayload:
    """The same buffer under a descriptor of its own, and facts the receiver may change freely."""
    info = dataclasses.replace(
        payload.info,
        chunk_lengths=list(payload.info.chunk_lengths),
        keys=list(payload.info.keys),
        skipped_files=list(payload.info.skipped_files),
    )
    return ContextPayload(
        payload.kind, os.dup(payload.fd), payload.size_bytes, list(payload.byte_lengths), list(payload.keys), info
    )
