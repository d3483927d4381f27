"""Running the async core from synchronous callers: the one bridge every sync API goes through.

- `run_sync(coro)`: a one-off call (`RLM.run`). With no event loop running on this thread it runs
  here (`asyncio.run`: Ctrl-C reaches it as usual); under a running loop (Jupyter, an async server)
  blocking that loop would deadlock, so it runs on a fresh loop on a thread of its own.
- `PrivateLoop`: for objects whose sync methods share async state across calls (a session's REPL,
  an environment's episodes, the DSPy interpreter's sandbox): one loop on a daemon thread, started
  on first use, that every call of the object runs on. It works with or without a running loop in
  the caller's thread, refuses a blocking call made from its own loop (that call would wait for
  itself), cancels the call when the caller is interrupted, and `stop()` cancels what still runs
  on it, waiting a bounded time, before the loop stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# How long stop() waits for what it cancelled: a task that ignores cancellation must not hold up close.
_STOP_S = 5.0


class BlockingCallOnLoop(RuntimeError):
    """A blocking call was made from the private loop it would block on."""


class LoopStopped(RuntimeError):
    """The private loop was stopped while a blocking call waited on it."""


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end from synchronous code, whether or not a loop runs on this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recursa-sync") as pool:
        return pool.submit(asyncio.run, coro).result()


class PrivateLoop:
    """An event loop on a daemon thread, started on first use; `run` blocks until a coroutine ends there."""

    def __init__(self, name: str = "recursa") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
            return self._loop

    @property
    def started(self) -> bool:
        return self._loop is not None and not self._loop.is_closed()

    def owns(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        return loop is not None and loop is self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the private loop and wait for its result (its exception is raised here)."""
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise BlockingCallOnLoop(f"a blocking call was made from {self.name}'s own event loop; await it")
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise
        except concurrent.futures.CancelledError:
            if self._loop is not loop:  # stop() cancelled it
                raise LoopStopped(f"{self.name}'s event loop was stopped while the call waited") from None
            raise

    def stop(self) -> None:
        """Cancel what still runs on the loop (a bounded wait), stop it, and close it once its
        thread has ended. Called on the loop itself, it only stops it (it cannot wait for itself)."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.call_soon(loop.stop)
            return
        # A thread no longer alive (interpreter exit ends daemon threads) runs nothing: waiting on
        # its loop would never end.
        if thread is not None and thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            if thread is not threading.current_thread():
                thread.join(timeout=_STOP_S)
        if not loop.is_running():
            loop.close()


async def _cancel_the_rest() -> None:
    here = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not here]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=_STOP_S)
