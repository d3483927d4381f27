"""The limiter's slots when a call leaves early: cancelled while queued, or failing while it holds one.
(Caps, fairness and pacing are tested in test_lm.py.)"""

from __future__ import annotations

import asyncio

import pytest

from recursa.lm.limiter import Limiter


async def test_a_call_cancelled_while_queued_gives_back_its_model_slot() -> None:
    limiter = Limiter(max_concurrency=1, per_model={"openai/a": 1})
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold(key: str) -> None:
        async with limiter.slot(key):
            holding.set()
            await release.wait()

    other = asyncio.create_task(hold("openai/b"))  # takes the only global slot
    await holding.wait()
    queued = asyncio.create_task(hold("openai/a"))  # gets a's model slot, then waits for the global one
    for _ in range(5):
        await asyncio.sleep(0)
    assert not queued.done() and limiter.in_flight == 1
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    release.set()
    await other
    # a's model slot came back with the cancellation: the next call to a is not stuck behind it.
    holding.clear()
    release.set()
    await asyncio.wait_for(hold("openai/a"), timeout=5)
    assert limiter.in_flight == 0 and limiter.in_flight_for("openai/a") == 0


async def test_a_call_that_fails_inside_its_slot_frees_it() -> None:
    limiter = Limiter(max_concurrency=1, per_model={"openai/a": 1})
    for _ in range(3):
        with pytest.raises(RuntimeError):
            async with limiter.slot("openai/a"):
                raise RuntimeError("the call failed")
    assert limiter.in_flight == 0 and limiter.in_flight_for("openai/a") == 0
    async with limiter.slot("openai/a"):
        assert limiter.in_flight == 1 and limiter.in_flight_for("openai/a") == 1
    assert limiter.max_in_flight == 1
