"""The in-process sandbox: the worker's REPL in a thread of the host. For debugging only.

Nothing is isolated: generated code runs with the host's privileges, environment, working directory
and builtins. It exists so a debugger can step into generated code. Limitations, by design:

- Output: the host's sys.stdout is never swapped (other runs share it), so the namespace gets its
  own `print` writing to the capture. `sys.stdout.write(...)` and output from imported modules go
  to the host's real stdout instead of the REPL output.
- Timeouts are best effort: a KeyboardInterrupt is raised asynchronously in the REPL thread, which
  stops pure-Python loops but not C code or blocking calls. A cell that still does not stop is
  abandoned (a thread cannot be killed): it keeps running in the background and a fresh REPL, with
  no variables, takes over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from recursa.context import ContextPayload
from recursa.errors import SandboxError
from recursa.sandbox.base import CallbackError, CallHandler, ExecResult, FinalAnswer
from recursa.sandbox.protocol import exec_result_from_wire, final_from_wire
from recursa.sandbox.worker.context import ContextSource
from recursa.sandbox.worker.errors import RemoteError
from recursa.sandbox.worker.repl import Repl
from recursa.trace.hostpaths import scrub_paths


class _ReplThread:
    """One daemon thread that runs every request for one Repl, in order."""

    def __init__(self, repl: Repl) -> None:
        self.repl = repl
        self._inbox: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="recursa-inprocess-repl", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put((fut, fn))
        return asyncio.wrap_future(fut)

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # includes a late asynchronous KeyboardInterrupt
                fut.set_exception(exc)

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the thread if it is running user code (best effort)."""
        ident = self._thread.ident
        if ident is not None and self.repl.interruptible:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt)
            )

    def stop(self) -> None:
        self._inbox.put(None)


class InProcessSandbox:
    """The REPL in a host thread: no isolation at all. Ask for it by name, for debugging."""

    name = "inprocess"

    def __init__(
        self, *, max_output_chars: int = 20_000, grace_s: float = 2.0, query_timeout: float = 30.0
    ) -> None:
        self.max_output_chars = max_output_chars
        self.grace_s = grace_s
        self.query_timeout = query_timeout
        self.isolation: dict[str, Any] = {
            "level": "none",
            "process": False,
            "landlock": False,
            "seccomp": False,
            "namespaces": [],
            "rlimits": {},
            "env_scrubbed": False,
            "warnings": ["in-process REPL: generated code runs inside this process with no isolation"],
        }
        self._handler: CallHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: _ReplThread | None = None
        self._context: ContextPayload | None = None
        self._context_fd = -1
        self._definitions: dict[str, dict[str, Any]] = {}  # replayed into a fresh REPL
        self._lock = asyncio.Lock()
        self._carry_notes: list[str] = []
        self._closed = False

    async def start(self, handler: CallHandler) -> None:
        if self._closed:
            raise SandboxError("this sandbox was closed; create a new one")
        if self._thread is not None:
            raise SandboxError("the sandbox is already started")
        self._handler = handler
        self._loop = asyncio.get_running_loop()
        self._thread = _ReplThread(Repl(self._call, own_print=True))

    def _call(self, fn: str, args: dict[str, Any]) -> Any:
        """Runs in the REPL thread (or a user thread): hand the call to the host loop and wait."""
        assert self._handler is not None and self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._handler(fn, args), self._loop)
        try:
            # Through JSON like the worker channel, so both sandboxes hand the code the same values.
            return json.loads(json.dumps(fut.result()))
        except Exception as exc:
            error = CallbackError.of(exc)
            raise RemoteError(error.kind, scrub_paths(str(error))) from None
        except BaseException:
            fut.cancel()  # interrupted while waiting: stop the host-side work too
            raise

    def _live(self) -> _ReplThread:
        if self._closed:
            raise SandboxError("this sandbox was closed; create a new one")
        if self._thread is None:
            raise SandboxError("the sandbox is not started; await start(handler) first")
        return self._thread

    async def load_context(self, payload: ContextPayload) -> None:
        if payload.fd < 0 or payload.released:
            raise SandboxError("the context payload is closed or was released into a REPL; build it again")
        async with self._lock:
            thread = self._live()
            if self._context_fd >= 0:
                os.close(self._context_fd)
            self._context_fd = os.dup(payload.fd)
            self._context = payload
            await thread.submit(self._loader(thread.repl))

    def _loader(self, repl: Repl) -> Callable[[], Any]:
        assert self._context is not None
        ctx, fd = self._context, self._context_fd

        def load() -> Any:
            source = ContextSource(fd=os.dup(fd))
            try:
                return repl.load_context(
                    ctx.kind, source, list(ctx.byte_lengths), list(ctx.info.chunk_lengths), list(ctx.keys)
                )
            finally:
                source.close()

        return load

    async def execute(self, code: str, timeout: float, *, max_output_chars: int | None = None) -> ExecResult:
        limit = self.max_output_chars if max_output_chars is None else max_output_chars
        async with self._lock:
            thread = self._live()
            notes, self._carry_notes = self._carry_notes, []
            started = time.perf_counter()
            fut = thread.submit(lambda: thread.repl.execute(code, limit))
            timed_out = False
            try:
                try:
                    async with asyncio.timeout(timeout):
                        raw = await asyncio.shield(fut)
                except TimeoutError:
                    timed_out = True
                    thread.interrupt()
                    async with asyncio.timeout(self.grace_s):
                        raw = await asyncio.shield(fut)
            except TimeoutError:
                await self._abandon(thread)
                return ExecResult(
                    stdout="",
                    stderr="",
                    error=f"TimeoutError: the cell ran past {timeout:g}s and could not be interrupted",
                    timed_out=True,
                    restarted=True,
                    notes=[
                        *notes,
                        f"interrupted after {timeout:g}s but the code did not stop; a fresh REPL took over "
                        "and all variables were lost (the old code may still be running: in-process mode "
                        "cannot kill it)",
                    ],
                    duration_s=time.perf_counter() - started,
                )
            except KeyboardInterrupt:  # the interrupt landed just after the cell finished
                raw = {"stdout": "", "stderr": "", "error": "KeyboardInterrupt: execution was interrupted"}
            result = exec_result_from_wire(raw)
            result.notes[:0] = notes
            if timed_out:
                result.timed_out = True
                result.notes.append(f"interrupted after {timeout:g}s; variables kept")
            return result

    async def _abandon(self, thread: _ReplThread) -> None:
        thread.stop()
        self._thread = _ReplThread(Repl(self._call, own_print=True))
        if self._context is not None:
            await self._thread.submit(self._loader(self._thread.repl))
        if self._definitions:
            fresh, entries = self._thread.repl, list(self._definitions.values())
            await self._thread.submit(lambda: fresh.define(entries))

    async def define(self, entries: list[dict[str, Any]]) -> list[str]:
        async with self._lock:
            thread = self._live()
            for entry in entries:
                self._definitions[str(entry["name"])] = entry
            reply = await thread.submit(lambda: thread.repl.define(entries))
            return list(reply.get("errors", []))

    async def _ask(self, fn: Callable[[Repl], Any], timeout: float | None = None) -> Any:
        async with self._lock:
            thread = self._live()
            fut = thread.submit(lambda: fn(thread.repl))
            try:
                async with asyncio.timeout(self.query_timeout if timeout is None else timeout):
                    return await asyncio.shield(fut)
            except (TimeoutError, KeyboardInterrupt):
                await self._abandon(thread)
                self._carry_notes.append(
                    "Reading a REPL variable hung, so a fresh REPL took over: variables lost."
                )
                return None

    async def get_variable(self, name: str, timeout: float | None = None) -> FinalAnswer | None:
        reply = await self._ask(lambda repl: repl.get_var(name), timeout)
        if not reply or not reply.get("found"):
            return None
        return final_from_wire(reply.get("final"))

    async def variable_names(self) -> list[str]:
        names = await self._ask(lambda repl: repl.user_variables())
        return list(names or [])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self._context_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._context_fd)
            self._context_fd = -1
        self._context = None
