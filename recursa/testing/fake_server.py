"""A fake OpenAI- and Anthropic-compatible model server on 127.0.0.1, with a latency model.

Tests and benchmarks point the real `openai` / `anthropic` SDKs at it, so the whole client path
(HTTP, retries, streaming, usage parsing) runs offline. It models what matters for an RLM engine:
time to first token and decode speed, a fixed number of concurrency slots with a FIFO queue, 429s
with Retry-After when the queue is full, context-length errors, injectable faults, and exact token
usage (recursa.lm.tokens) recorded per request in a ledger tests can assert against.

    with FakeServer(responder=lambda model, messages: "hi", latency_s=0.2) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        anthropic.Anthropic(base_url=srv.root_url, api_key="x")
        ...
        assert srv.max_in_flight >= 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from recursa.asgi.background import BackgroundServer
from recursa.asgi.ports import port
from recursa.testing.fake_app import build_app
from recursa.testing.fake_state import (
    Fault,
    FaultEntry,
    FaultPlan,
    FaultRule,
    FaultSchedule,
    Ledger,
    RequestRecord,
    SlotGate,
    UnknownModelError,
)
from recursa.testing.host import Responder
from recursa.testing.latency import (
    PROFILES,
    LatencyProfile,
    SimRequest,
    SimResult,
    VirtualClock,
    get_profile,
    simulate,
)
from recursa.testing.marked_cache import MIN_TOKENS, MarkedCache
from recursa.testing.prefix_cache import PrefixCache
from recursa.testing.tool_replies import ToolCallReply, offered_tools

__all__ = [
    "FakeServer",
    "Fault",
    "FaultEntry",
    "FaultPlan",
    "FaultRule",
    "FaultSchedule",
    "LatencyProfile",
    "RequestRecord",
    "Responder",
    "ScriptedResponder",
    "UnknownModelError",
    "VirtualClock",
    "main",
]


class ScriptedResponder:
    """The default responder: the scripted policy named by the model ("scripted/<name>" or "<name>").

    One policy instance per model name; policies are pure functions of the messages.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._policies: dict[str, Callable[[list[dict[str, str]]], str]] = {}

    def _policy(self, model: str) -> Callable[[list[dict[str, str]]], str]:
        with self._lock:
            policy = self._policies.get(model)
            if policy is None:
                # Imported here: the policy package is optional for users of custom responders.
                from recursa.scripted import get_policy

                try:
                    policy = get_policy(model.removeprefix("scripted/"))
                except KeyError as exc:
                    raise UnknownModelError(model) from exc
                self._policies[model] = policy
            return policy

    def knows(self, model: str) -> bool:
        try:
            self._policy(model)
        except UnknownModelError:
            return False
        return True

    def model_names(self) -> list[str]:
        from recursa.scripted import policy_names

        return [f"scripted/{name}" for name in policy_names()]

    def __call__(self, model: str, messages: list[dict[str, Any]]) -> str | ToolCallReply:
        from recursa.scripted.tool_use import tool_turn

        # The same function-calling habits as the in-process scripted client, over HTTP.
        turn = tool_turn(self._policy(model), messages, offered_tools())
        return ToolCallReply(turn.calls, text=turn.text) if turn.calls else turn.text


class FakeServer:
    """An OpenAI (`/v1/chat/completions`) and Anthropic (`/v1/messages`) compatible fake server.

    Latency model (recursa.testing.latency): each request waits FIFO for one of `slots` slots, then
    its first token comes after `latency_s + uncached prompt tokens / prefill_tokens_per_s`, and each
    output token takes `per_output_token_s * (1 + contention * (slot holders - 1))` (streamed replies
    send the pieces as they are decoded). With `max_queue` set, a request that finds that many
    already waiting gets 429 with `Retry-After: retry_after_s`. `profile` (a name in
    `latency.PROFILES` or a `LatencyProfile`) gives the defaults; explicit arguments override it.

    Prefix caches: on the OpenAI API (recursa.testing.prefix_cache), with `cache_blocks` > 0
    (profiles set it), prompts are split into 16-token blocks hashed with their parent; leading
    blocks already cached are reported as `usage.prompt_tokens_details.cached_tokens` and skip
    prefill. On Anthropic's (recursa.testing.marked_cache) only prefixes the request marks with
    `cache_control` (of at least `min_cache_tokens`) are cached, as Anthropic does: written ones are
    reported as `cache_creation_input_tokens` (priced at 1.25x input), read ones as
    `cache_read_input_tokens`. `cost_usd()` prices every request; `GET /metrics` serves Prometheus text.

    With `clock=VirtualClock()` nothing sleeps: arrivals are stamped with the clock and
    `simulate()` returns the exact times the model assigns (deterministic tests).

    `models`: if given, the only model names served (others: 404) and what `/v1/models` lists;
    otherwise a responder with a `knows(model)` method decides, and any name is served if it has none.
    A responder may also raise `UnknownModelError` for a 404. Replies longer than the request's
    `max_tokens` are cut to exactly that many tokens (finish reason "length" / "max_tokens").
    """

    def __init__(
        self,
        *,
        responder: Responder | None = None,
        latency_s: float | None = None,
        per_output_token_s: float | None = None,
        slots: int | None = None,
        max_queue: int | None = None,
        retry_after_s: float = 1.0,
        max_context_tokens: int | None = None,
        faults: FaultPlan | None = None,
        port: int = 0,
        api_key: str | None = None,
        models: Sequence[str] | None = None,
        profile: LatencyProfile | str | None = None,
        prefill_tokens_per_s: float | None = None,
        contention: float | None = None,
        cache_blocks: int | None = None,
        clock: VirtualClock | None = None,
        min_cache_tokens: int = MIN_TOKENS,
    ) -> None:
        # A profile gives the defaults; explicit arguments win over it.
        base = (
            get_profile(profile) if isinstance(profile, str) else (profile or LatencyProfile(cache_blocks=0))
        )
        latency_s = base.base_s if latency_s is None else latency_s
        per_output_token_s = base.per_token_s if per_output_token_s is None else per_output_token_s
        slots = base.slots if slots is None else slots
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        max_queue = base.max_queue if max_queue is None else max_queue
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {max_queue}")
        if latency_s < 0 or per_output_token_s < 0 or retry_after_s < 0:
            raise ValueError("latency_s, per_output_token_s and retry_after_s must be >= 0")
        self.responder: Responder = responder if responder is not None else ScriptedResponder()
        # Plain attributes: a test may change them between requests while the server runs.
        self.latency_s = latency_s
        self.per_output_token_s = per_output_token_s
        self.prefill_tokens_per_s = (
            base.prefill_tokens_per_s if prefill_tokens_per_s is None else prefill_tokens_per_s
        )
        self.contention = base.contention if contention is None else contention
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.max_context_tokens = (
            base.max_context_tokens if max_context_tokens is None else max_context_tokens
        )
        self.faults = faults
        self.api_key = api_key
        self.models = list(models) if models is not None else None
        self.prices = (base.input_per_mtok, base.cached_input_per_mtok, base.output_per_mtok)
        # Virtual-clock mode: nothing sleeps; arrivals are stamped with clock.now() and simulate()
        # gives the times the latency model assigns them.
        self.clock = clock
        self.cache = PrefixCache(base.cache_blocks if cache_blocks is None else cache_blocks)
        # Anthropic's explicit cache: only prefixes the request marks with cache_control.
        self.marked_cache = MarkedCache(min_cache_tokens)
        self._slots = slots
        self._requested_port = port
        self.ledger = Ledger()
        self.gate = SlotGate(slots)
        self._port: int | None = None
        self._background: BackgroundServer | None = None

    @property
    def profile(self) -> LatencyProfile:
        """The latency model as it stands now (built from the live attributes)."""
        return LatencyProfile(
            base_s=self.latency_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            per_token_s=self.per_output_token_s,
            contention=self.contention,
            slots=self._slots,
            max_queue=self.max_queue,
            max_context_tokens=self.max_context_tokens,
            cache_blocks=self.cache.capacity_blocks,
            input_per_mtok=self.prices[0],
            cached_input_per_mtok=self.prices[1],
            output_per_mtok=self.prices[2],
        )

    @property
    def virtual(self) -> bool:
        return self.clock is not None

    def simulate(self) -> dict[int, SimResult]:
        """Virtual times of every successful request so far, by request index (virtual-clock mode)."""
        ok = [r for r in self.ledger.snapshot() if r.ok and r.virtual_arrival is not None]
        results = simulate(self.profile, [_sim_request(r) for r in ok])
        return {r.index: res for r, res in zip(ok, results, strict=True)}

    def virtual_queue_full(self, arrival: float) -> bool:
        """Would a request arriving now find `max_queue` requests already waiting (virtual mode)?"""
        if self.max_queue is None:
            return False
        ok = [r for r in self.ledger.snapshot() if r.ok and r.virtual_arrival is not None]
        times = simulate(self.profile, [_sim_request(r) for r in ok])
        waiting = sum(1 for t in times if t.arrival <= arrival < t.started)
        holding = sum(1 for t in times if t.started <= arrival < t.finished)
        return holding >= self._slots and waiting >= self.max_queue

    # -- the ledger -------------------------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """Every model request so far, in arrival order (a snapshot list; records fill in as they finish)."""
        return self.ledger.snapshot()

    @property
    def max_in_flight(self) -> int:
        """The most requests that held a slot ("generating") at the same time."""
        return self.ledger.max_in_flight

    @property
    def in_flight(self) -> int:
        return self.ledger.in_flight

    def totals(self) -> dict[str, dict[str, int]]:
        """Per model: successful `requests`, `prompt_tokens` (of which `cached_tokens` hit the prefix
        cache), `completion_tokens`, `total_tokens`, and
        `failed` (requests answered with an error, which bill nothing)."""
        out: dict[str, dict[str, int]] = {}
        for rec in self.ledger.snapshot():
            row = out.setdefault(
                rec.model,
                {
                    "requests": 0,
                    "prompt_tokens": 0,
                    "cached_tokens": 0,
                    "completion_tokens": 0,
                    "total_tokens": 0,
                    "failed": 0,
                },
            )
            if not rec.ok:
                row["failed"] += 1
                continue
            row["requests"] += 1
            row["prompt_tokens"] += rec.prompt_tokens
            row["cached_tokens"] += rec.cached_tokens
            row["completion_tokens"] += rec.completion_tokens
            row["total_tokens"] += rec.prompt_tokens + rec.completion_tokens
        return out

    def cost_usd(self) -> dict[str, float]:
        """The cost ledger: USD per model at the profile's prices (cached input at its own rate)."""
        out: dict[str, float] = {}
        for rec in self.ledger.snapshot():
            if rec.ok:
                out[rec.model] = out.get(rec.model, 0.0) + rec.cost_usd
        return out

    def reset(self, *, keep_cache: bool = False) -> None:
        """Forget the ledger (records, request indices for fault plans, max_in_flight), the prefix
        cache (unless `keep_cache`: to measure a warm server), and the counts of a `FaultSchedule`."""
        self.ledger.reset()
        if not keep_cache:
            self.cache.clear()
            self.marked_cache.clear()
        restart = getattr(self.faults, "reset", None)
        if callable(restart):
            restart()

    # -- models -----------------------------------------------------------------------------------

    def knows_model(self, model: str) -> bool:
        if self.models is not None:
            return model in self.models
        knows = getattr(self.responder, "knows", None)
        return True if knows is None else bool(knows(model))

    def model_names(self) -> list[str]:
        if self.models is not None:
            return list(self.models)
        names = getattr(self.responder, "model_names", None)
        return list(names()) if names is not None else self.ledger.models_seen()

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def running(self) -> bool:
        return self._background is not None and self._background.running

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the fake server is not started; call start() or use it as a context manager")
        return self._port

    @property
    def root_url(self) -> str:
        """http://127.0.0.1:PORT (what the Anthropic SDK takes as base_url)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT/v1 (what the OpenAI SDK takes as base_url)."""
        return f"{self.root_url}/v1"

    def start(self) -> FakeServer:
        """Serve in a daemon thread with its own event loop; returns once requests are answered."""
        if self.running:
            return self
        self.gate = SlotGate(self._slots)  # futures of a previous run's loop must not leak in
        background = BackgroundServer(
            build_app(self),
            port=self._requested_port,
            lifespan="off",
            access_log=False,
            name="recursa-fake-server",
        )
        try:
            background.start()
        except RuntimeError as exc:
            raise RuntimeError(f"the fake server did not start: {exc}") from exc
        self._background, self._port = background, background.port
        return self

    def stop(self) -> None:
        """Shut down and join the server thread. Safe to call twice or before start()."""
        background, self._background = self._background, None
        if background is not None:
            background.stop()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> FakeServer:
        # start()/stop() block briefly; keep the caller's event loop responsive meanwhile.
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        where = self.base_url if self._port is not None and self.running else "stopped"
        return f"FakeServer({where}, slots={self._slots}, latency_s={self.latency_s})"


def _sim_request(rec: RequestRecord) -> SimRequest:
    return SimRequest(
        arrival=rec.virtual_arrival or 0.0,
        uncached_tokens=rec.prompt_tokens - rec.cached_tokens,
        output_tokens=rec.completion_tokens,
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, but not `None`: those flags take the profile's value (said once, below)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> int:
    """`recursa fake-server`: serve in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="recursa fake-server",
        description="Offline OpenAI/Anthropic-compatible model server answering with scripted models "
        "(model names: scripted/gpt5-like, scripted/oracle, ... as `recursa models` lists them). "
        "A flag left out takes its --profile's value; without a profile the server answers at once, "
        "64 requests at a time, with no queue limit and no prefix cache.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--port", type=port, default=8765, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument(
        "--profile",
        default=None,
        choices=sorted(PROFILES),
        help="latency, prefill, decode, slots, cache and prices in one name; the flags below override it",
    )
    parser.add_argument("--latency", type=float, default=None, help="seconds to first token (before prefill)")
    parser.add_argument("--per-token", type=float, default=None, help="seconds per output token")
    parser.add_argument("--prefill", type=float, default=None, help="uncached prompt tokens per second")
    parser.add_argument("--contention", type=float, default=None, help="decode slowdown per extra request")
    parser.add_argument("--slots", type=int, default=None, help="requests generating at once")
    parser.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429")
    parser.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds on 429")
    parser.add_argument("--max-context-tokens", type=int, default=None, help="longer prompts get 400")
    parser.add_argument("--cache-blocks", type=int, default=None, help="prefix-cache size in 16-token blocks")
    parser.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key)")
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["--"]:  # `recursa fake-server -- --port ...` passes the separator through
        given = given[1:]
    args = parser.parse_args(given)
    srv = FakeServer(
        profile=args.profile,
        latency_s=args.latency,
        per_output_token_s=args.per_token,
        prefill_tokens_per_s=args.prefill,
        contention=args.contention,
        slots=args.slots,
        max_queue=args.max_queue,
        retry_after_s=args.retry_after,
        max_context_tokens=args.max_context_tokens,
        cache_blocks=args.cache_blocks,
        port=args.port,
        api_key=args.api_key,
    ).start()
    print(f"fake model server: OpenAI base_url {srv.base_url}, Anthropic base_url {srv.root_url}", flush=True)
    print("Ctrl-C stops it.", flush=True)
    try:
        while srv.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m recursa.testing.fake_server`
    raise SystemExit(main())
