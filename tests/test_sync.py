"""The one sync-over-async bridge (recursa/sync.py): with and without a running loop in the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from recursa.sync import BlockingCallOnLoop, LoopStopped, PrivateLoop, run_sync


async def _thread_name() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def test_run_sync_runs_here_without_a_loop_and_on_a_thread_under_one():
    assert run_sync(_thread_name()) == threading.current_thread().name

    async def inside() -> str:
        return run_sync(_thread_name())  # a notebook cell or an async server calling a sync API

    assert asyncio.run(inside()).startswith("recursa-sync")


def test_a_private_loop_keeps_its_state_across_calls_and_refuses_a_call_from_itself():
    private = PrivateLoop("test-private")

    async def loop_id() -> int:
        return id(asyncio.get_running_loop())

    first = private.run(loop_id())
    assert private.run(loop_id()) == first and private.run(_thread_name()) == "test-private"

    async def blocking_from_inside() -> None:
        private.run(loop_id())

    with pytest.raises(BlockingCallOnLoop):
        private.run(blocking_from_inside())
    private.stop()
    assert not private.started


def test_stop_cancels_what_still_runs_and_the_waiting_caller_is_told():
    private = PrivateLoop("test-stop")
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    errors: list[BaseException] = []

    def caller() -> None:
        try:
            private.run(forever())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    assert started.wait(5)
    private.stop()
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], LoopStopped)
