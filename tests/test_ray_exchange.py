"""The node host's exchange protocol (sandbox="ray"), on the plain NodeHost object: node.py imports
no Ray, so this runs without a cluster. The cluster itself is in test_ray_sandbox.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from recursa.errors import SandboxError
from recursa.sandbox.base import CallHandler, ExecResult
from recursa.sandbox.cluster.node import NodeHost

pytestmark = pytest.mark.timeout(20)


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("not across the wire")


class Fake:
    """A REPL stand-in: runs nothing; "ask:X" asks the driver, "hang" waits, "bad" fails oddly."""

    name = "fake"

    def __init__(self, **options: Any) -> None:
        self.isolation: dict[str, Any] = {"process": False}
        self.ran: list[str] = []
        self.closed = False

    async def start(self, handler: CallHandler) -> None:
        self.handler = handler

    async def execute(self, code: str, timeout: float) -> ExecResult:
        self.ran.append(code)
        if code.startswith("ask:"):
            return ExecResult(stdout=str(await self.handler("llm_query", {"prompt": code[4:]})), stderr="")
        if code == "hang":
            await asyncio.Event().wait()
        if code == "bad":
            raise Unpicklable("a host-side failure")
        return ExecResult(stdout=code, stderr="")

    async def close(self) -> None:
        self.closed = True


async def opened() -> tuple[NodeHost, Fake]:
    made: list[Fake] = []

    def make(kind: str, **options: Any) -> Fake:
        made.append(Fake(**options))
        return made[-1]

    host = NodeHost(make, fork=False)  # type: ignore[arg-type]
    events = await host.exchange("c", [(1, "open", ("c", "r", {}, None))])
    assert events == [("done", 1, True, {"isolation": {"process": False}, "pid": None})]
    return host, made[0]


async def test_one_exchange_carries_a_turns_requests_and_brings_back_call_backs() -> None:
    host, repl = await opened()
    events = await host.exchange("c", [(2, "execute", ("r", "a", 5)), (3, "execute", ("r", "ask:hi", 5))])
    # Ready together, they come back together: a result and the other cell's call-back.
    assert [e[0] for e in events] == ["done", "call"]
    assert events[0][1:3] == (2, True) and events[0][3].stdout == "a"
    _, repl_id, call_id, function, args = events[1]
    assert (repl_id, function, args) == ("r", "llm_query", {"prompt": "hi"})
    answered = await host.exchange("c", [(0, "answer", ([(call_id, True, "from the driver")],))])
    assert [(e[0], e[1], e[3].stdout) for e in answered] == [("done", 3, "from the driver")]
    # An error the driver raised reaches the cell as the same kind.
    events = await host.exchange("c", [(4, "execute", ("r", "ask:dear", 5))])
    failed = host.exchange("c", [(0, "answer", ([(events[0][2], False, ("BudgetExceeded", "used up"))],))])
    (_, request_id, ok, error), *_ = await failed
    assert (request_id, ok, type(error).__name__, str(error)) == (4, False, "CallbackError", "used up")
    assert repl.ran == ["a", "ask:hi", "ask:dear"]


async def test_cancels_stop_requests_even_ones_not_yet_arrived() -> None:
    host, repl = await opened()
    # A cancel may overtake its request (another exchange): the request then never runs.
    early = asyncio.ensure_future(host.exchange("c", [(0, "cancel", (5,))]))
    await asyncio.sleep(0)
    later = asyncio.ensure_future(
        host.exchange("c", [(5, "execute", ("r", "x", 5)), (6, "execute", ("r", "y", 5))])
    )
    assert [e[:3] for e in await early] == [("done", 6, True)]  # the oldest waiting exchange gets it
    assert repl.ran == ["y"]
    # A running request stops when cancelled, with no event. Events go to the oldest waiting
    # exchange; a third one waiting releases the oldest, empty.
    waiting = asyncio.ensure_future(host.exchange("c", [(7, "execute", ("r", "hang", 5))]))
    await asyncio.sleep(0.01)
    assert repl.ran == ["y", "hang"] and not waiting.done()
    third = asyncio.ensure_future(host.exchange("c", [(0, "cancel", (7,)), (8, "execute", ("r", "z", 5))]))
    assert await later == []
    assert [e[:3] for e in await waiting] == [("done", 8, True)]
    assert not host._mail["c"].running
    # close_client ends the driver's waiting exchanges empty and closes its REPLs.
    assert await host.close_client("c") == 1
    assert await third == [] and repl.closed


async def test_waiting_exchanges_are_bounded_and_odd_errors_cross_as_sandbox_errors() -> None:
    host, _ = await opened()
    first = asyncio.ensure_future(host.exchange("c", []))
    second = asyncio.ensure_future(host.exchange("c", []))
    await asyncio.sleep(0)
    third = asyncio.ensure_future(host.exchange("c", [(9, "execute", ("r", "bad", 5))]))
    assert await first == []  # a third waiting exchange releases the oldest, empty
    (_, request_id, ok, error), *_ = await second
    assert (request_id, ok) == (9, False)
    assert isinstance(error, SandboxError) and "Unpicklable: a host-side failure" in str(error)
    events = await host.exchange("c", [(10, "no_such_method", ())])
    assert events[0][:3] == ("done", 10, False) and "no request 'no_such_method'" in str(events[0][3])
    await host.close_client("c")
    assert await third == []
