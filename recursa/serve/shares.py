"""Run slots shared fairly: `max_runs` for the whole server, `runs_per_caller` of them for any one
caller (recursa.serve.callers.quota_of), so a caller with many requests waits for its own slots
while everyone else's runs go ahead. Both servers (HTTP and MCP) take their slots here.

A caller's entry lives while it holds or waits for a slot, so the table is as large as the set of
callers with something in flight (and `quota_of` folds client secrets into their key: a caller
cannot grow it by minting labels).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from recursa.serve.settings import ServeSettings


@dataclass
class _Share:
    slots: asyncio.Semaphore
    users: int = 0  # holding or waiting for one of `slots`
    running: int = 0  # holding one


@dataclass
class RunShares:
    settings: ServeSettings
    _callers: dict[str, _Share] = field(default_factory=dict)
    _total: asyncio.Semaphore | None = None

    @property
    def total(self) -> asyncio.Semaphore:
        # Made on first use, inside the server's loop.
        if self._total is None:
            self._total = asyncio.Semaphore(self.settings.max_runs)
        return self._total

    async def acquire(self, quota: str) -> None:
        """Wait for one of `quota`'s slots, then for one of the server's."""
        share = self._callers.get(quota)
        if share is None:
            share = self._callers[quota] = _Share(asyncio.Semaphore(self.settings.runs_per_caller))
        share.users += 1
        try:
            await share.slots.acquire()
            try:
                await self.total.acquire()
            except BaseException:
                share.slots.release()
                raise
        except BaseException:
            self._leave(quota, share)
            raise
        share.running += 1

    def release(self, quota: str) -> None:
        share = self._callers[quota]
        share.running -= 1
        self.total.release()
        share.slots.release()
        self._leave(quota, share)

    def running(self, quota: str) -> int:
        share = self._callers.get(quota)
        return share.running if share is not None else 0

    def _leave(self, quota: str, share: _Share) -> None:
        share.users -= 1
        if share.users == 0:
            del self._callers[quota]

    @contextlib.asynccontextmanager
    async def slot(self, quota: str) -> AsyncIterator[None]:
        await self.acquire(quota)
        try:
            yield
        finally:
            self.release(quota)
