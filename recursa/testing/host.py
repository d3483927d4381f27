"""What the fake server's HTTP app and metrics read from the server that runs them.

`fake_server.FakeServer` is the one implementation. The app (`fake_app`) and `metrics` take this
protocol instead of the class, so they sit below `fake_server` and it alone imports them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from recursa.testing.fake_state import FaultPlan, Ledger, SlotGate
from recursa.testing.latency import LatencyProfile, VirtualClock
from recursa.testing.marked_cache import MarkedCache
from recursa.testing.prefix_cache import PrefixCache
from recursa.testing.tool_replies import ToolCallReply

# A reply is text, or a ToolCallReply for function calling (see recursa/testing/tool_replies.py).
Responder = Callable[[str, list[dict[str, Any]]], str | ToolCallReply | Awaitable[str | ToolCallReply]]


class FakeHost(Protocol):
    responder: Responder
    api_key: str | None
    faults: FaultPlan | None
    max_context_tokens: int | None
    max_queue: int | None
    retry_after_s: float
    clock: VirtualClock | None
    cache: PrefixCache
    marked_cache: MarkedCache
    ledger: Ledger
    gate: SlotGate

    @property
    def profile(self) -> LatencyProfile: ...

    @property
    def virtual(self) -> bool: ...

    @property
    def slots(self) -> int: ...

    def virtual_queue_full(self, arrival: float) -> bool: ...

    def knows_model(self, model: str) -> bool: ...

    def model_names(self) -> list[str]: ...

    def reset(self, *, keep_cache: bool = False) -> None: ...
