"""Answers of identical sub-calls, shared by the calls of one run, one session or one RL group.

A sub-call is identical to another when everything that shapes its answer is: the model, the
messages, the sampling options, the tools offered and the output limit. The first is sent; a
duplicate that arrives while it is in flight waits for it instead of sending its own; one that
arrives later gets the stored answer. A call that failed (or was cancelled) stores nothing: its
waiters go on to make the call themselves, one of them first again.

Answers are kept for the life of the cache's owner (a call tree, a session, an environment's
group), which is also the scope in which the same prompt recurs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from recursa.lm.base import LMResponse, Message


def call_key(
    spec: str,
    messages: list[Message],
    *,
    max_output_tokens: int,
    sampling: dict[str, Any],
    tools: list[dict[str, Any]] | None,
) -> str:
    """A digest of everything that shapes a call's answer (never the text itself: keys are small)."""
    shape = [spec, messages, max_output_tokens, sampling, tools]
    text = json.dumps(shape, ensure_ascii=False, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Cached:
    """An answer given from the cache. `waited`: the first call was still in flight."""

    response: LMResponse
    waited: bool


class CallCache:
    """Safe for the tasks of one event loop; a caller on another loop never waits on this one's
    calls (it sends its own and may store the answer)."""

    def __init__(self) -> None:
        self._answers: dict[str, LMResponse] = {}
        self._pending: dict[str, asyncio.Future[LMResponse]] = {}
        self.hits = 0

    def __len__(self) -> int:
        return len(self._answers)

    async def answer(self, key: str, send: Callable[[], Awaitable[LMResponse]]) -> LMResponse | Cached:
        """The stored (or awaited) answer for `key` as `Cached`, else what `send()` returns, stored."""
        while True:
            stored = self._answers.get(key)
            if stored is not None:
                self.hits += 1
                return Cached(stored, waited=False)
            pending = self._pending.get(key)
            if pending is None or pending.get_loop() is not asyncio.get_running_loop():
                break
            try:
                # Shielded: a waiter cancelled (its REPL cell stopped) must not cancel the first call.
                response = await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # this waiter was cancelled
                    raise
                continue  # the first call was cancelled: this one goes on its own
            except Exception:
                continue  # the first call failed: nothing is stored, so this one goes on its own
            self.hits += 1
            return Cached(response, waited=True)
        future: asyncio.Future[LMResponse] = asyncio.get_running_loop().create_future()
        mine = key not in self._pending
        if mine:
            self._pending[key] = future
        try:
            response = await send()
        except BaseException as exc:
            if mine:
                del self._pending[key]
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(exc)
                    future.exception()  # retrieved: a failure nobody waited for is not "never retrieved"
            raise
        self._answers[key] = response
        if mine:
            del self._pending[key]
            future.set_result(response)
        return response
