"""Every LM call of a call tree passes through one gateway: budget, concurrency, deadline, retries,
price, usage and trace all happen here, so no path (root turn, sub-call, child run) can skip one.

Retries live here rather than in the clients so that each attempt the provider may have billed
(recursa.lm.billing) is settled in the ledger and the next attempt reserves its own worst case,
and so that one retry budget (RLM(max_run_retries=...)) can bound the whole call tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from recursa.budget import Ledger, Reservation
from recursa.errors import BudgetExceeded, ContextLengthError, LMError
from recursa.lm.base import CallMeta, LMClient, LMRequest, LMResponse, Message, estimate_tokens_upper
from recursa.lm.billing import AttemptUsage, BilledFailure
from recursa.lm.call_cache import Cached, CallCache, call_key
from recursa.lm.images import content_text, image_refs
from recursa.lm.limiter import Limiter
from recursa.lm.prices import PriceBook
from recursa.lm.registry import make_client, parse_model
from recursa.lm.retry import RetryBudget, RetryPolicy, gave_up
from recursa.lm.windows import ContextWindows
from recursa.trace.writer import TraceWriter, fold
from recursa.usage import ModelUsage, Usage

# Sub-call prompts are usually slices of the context: folded in traces so trace size stays
# independent of context size. Root replies are the model's own code: kept in full up to this.
SUB_PROMPT_TRACE_CHARS = 4_000
REPLY_TRACE_CHARS = 100_000
RETRY_ERROR_TRACE_CHARS = 300
# The clients the gateway makes try once: the gateway's own loop retries (see the module docstring).
_ONE_ATTEMPT = RetryPolicy(max_attempts=1)
# A run without max_seconds: no asyncio.timeout (its task lookup and handle) around every call.
_NO_DEADLINE = contextlib.nullcontext()


@dataclass
class ClientSettings:
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout: float = 600.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # per call
    run_retries: RetryBudget = field(default_factory=RetryBudget)  # summed over the call tree
    call_headers: bool = False  # send X-RLM-* attribution headers with every call (opt-in)
    # Request options per role ("root": the top run's own calls, "child": child runs' own calls,
    # "sub": llm_query calls), e.g. {"root": {"temperature": 1.0, "seed": 7, "logprobs": True}}.
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)


def call_role(meta: CallMeta) -> str:
    """ "root", "child" or "sub": which sampling settings a call gets."""
    if meta.purpose == "sub":
        return "sub"
    return "root" if meta.depth == 0 else "child"


class ModelGateway:
    def __init__(
        self,
        *,
        ledger: Ledger,
        limiter: Limiter,
        prices: PriceBook,
        trace: TraceWriter,
        settings: ClientSettings,
    ) -> None:
        self.ledger = ledger
        self.limiter = limiter
        self.prices = prices
        self.trace = trace
        self.settings = settings
        self._clients: dict[str, LMClient] = {}
        self._shared: dict[str, LMClient] = {}  # owned elsewhere: used here, never closed here
        self._catch_all: LMClient | None = None
        # Identical sub-calls answered once (RLM(cache_subcalls=True)); None: every call is sent.
        self.call_cache: CallCache | None = None
        self.windows = ContextWindows()  # a call that cannot fit its model's window is not sent

    def share(self, clients: dict[str, LMClient], *, catch_all: LMClient | None = None) -> None:
        """Use clients owned elsewhere (an RL environment's, one connection pool for many trees);
        `catch_all` serves every model not named (a trainer's sub_call function)."""
        self._shared.update(clients)
        self._catch_all = catch_all

    def client(self, spec: str) -> LMClient:
        shared = self._shared.get(spec) or self._catch_all
        if shared is not None:
            return shared
        if spec not in self._clients:
            s = self.settings
            self._clients[spec] = make_client(
                spec, base_url=s.base_url, api_key=s.api_key, timeout=s.timeout, retry=_ONE_ATTEMPT
            )
        return self._clients[spec]

    async def warm(self, spec: str) -> None:
        """Make the client for `spec` ready before its first call, where the client can (nothing is
        sent). A failure here is left for that first call to report."""
        with contextlib.suppress(Exception):
            warm = getattr(self.client(spec), "warm", None)
            if warm is not None:
                await warm()

    async def aclose(self) -> None:
        # Shared clients stay open: their owner closes them once every tree is done.
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    async def call(
        self,
        spec: str,
        messages: list[Message],
        *,
        meta: CallMeta,
        run_id: str,
        max_output_tokens: int,
        usage_scopes: list[Usage],
        trace_messages: list[Message] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> LMResponse:
        """One LM call under the tree's limits. Raises BudgetExceeded (nothing sent), ContextLengthError
        (nothing sent: the prompt cannot fit the model's window) or LMError.

        With a call cache, a sub-call identical to one made before (or in flight) is answered from
        it: nothing is sent, reserved or billed, and the trace marks the hit."""
        meta = dataclasses.replace(meta, run_id=run_id, send_headers=self.settings.call_headers)
        sampling = dict(self.settings.sampling.get(call_role(meta)) or {})
        base_event: dict[str, Any] = {
            "run_id": run_id,
            "call_id": meta.call_id,
            "parent_id": meta.parent_id,
            "depth": meta.depth,
            "purpose": meta.purpose,
            "model": spec,
        }
        if trace_messages is not None:
            base_event["new_messages"] = trace_messages
        else:
            base_event["prompt"] = fold(_prompt_text(messages), SUB_PROMPT_TRACE_CHARS)
            base_event["prompt_chars"] = sum(len(content_text(m.get("content"))) for m in messages)
            images = image_refs(messages)
            if images:
                base_event["images"] = images  # references (type, size, sha256 or URL), not bytes
        if sampling:
            base_event["sampling"] = dict(sampling)
        try:
            self.windows.check(spec, messages, max_output_tokens)
        except ContextLengthError as exc:
            self.trace.emit("lm_call", **base_event, error=str(exc), refused="context_window", latency_s=0.0)
            raise

        def send() -> Awaitable[LMResponse]:
            return self._send(spec, messages, meta, sampling, max_output_tokens, usage_scopes, tools, base_event)

        cache = self.call_cache if meta.purpose == "sub" else None
        if cache is None:
            return await send()
        key = call_key(spec, messages, max_output_tokens=max_output_tokens, sampling=sampling, tools=tools)
        outcome = await cache.answer(key, send)
        if isinstance(outcome, Cached):
            self._cache_hit(spec, outcome, usage_scopes, base_event)
            return outcome.response
        return outcome

    async def _send(
        self,
        spec: str,
        messages: list[Message],
        meta: CallMeta,
        sampling: dict[str, Any],
        max_output_tokens: int,
        usage_scopes: list[Usage],
        tools: list[dict[str, Any]] | None,
        base_event: dict[str, Any],
    ) -> LMResponse:
        provider, model = parse_model(spec)
        worst_tokens = estimate_tokens_upper(messages, max_output_tokens)
        worst_usd = _worst_usd(
            self.prices, provider, model, worst_tokens - max_output_tokens, max_output_tokens
        )
        started = time.perf_counter()
        sampling = dict(sampling)
        base_event = dict(base_event)
        try:
            reservation = self.ledger.reserve(worst_tokens, worst_usd)
        except BudgetExceeded as exc:
            self.trace.emit("lm_call", **base_event, error=str(exc), refused=exc.limit, latency_s=0.0)
            raise
        temperature = sampling.pop("temperature", None)
        request = LMRequest(
            messages=messages,
            max_output_tokens=max_output_tokens,
            meta=meta,
            temperature=temperature,
            extra=sampling,
            tools=tools,
            cache_key=None if meta.purpose == "sub" else f"recursa-{meta.run_id}",
        )
        state = _CallState(spec, reservation, (worst_tokens, worst_usd), usage_scopes)
        try:
            # The deadline covers the wait for a slot too: behind a requests-per-minute pace a
            # queued call could otherwise wait far past max_seconds (tests/test_budget_property.py).
            deadline = self.ledger.remaining_seconds()
            bound = _NO_DEADLINE if deadline is None else asyncio.timeout(deadline)
            async with bound, self.limiter.slot(spec):
                # Time spent waiting for a concurrency slot: the viewer and OTel spans show a call
                # as running only from here, so a throttled batch does not look more parallel.
                base_event["queued_s"] = _since(started)
                remaining = self.ledger.remaining_seconds()
                if remaining is not None and remaining <= 0:
                    raise BudgetExceeded("max_seconds", "LM call refused: the run's time budget is used up.")
                response = await self._attempts(request, state)
        except TimeoutError:
            self._drop(state)
            error = "LM call stopped: the run's time budget ran out while it was queued or in flight."
            self.trace.emit("lm_call", **base_event, error=error, latency_s=_since(started), **state.fields())
            raise BudgetExceeded("max_seconds", error) from None
        except BaseException as exc:
            # Attempts that may have been billed are already counted (state.billed); the rest were
            # not billed. A cancelled attempt may have been, but nothing tells us what it used.
            self._drop(state)
            if isinstance(exc, (LMError, BudgetExceeded)):
                # A provider's or a client's message may echo a key (a header, a URL's ?key=): it
                # reaches the REPL, the result, a server's error body; scrubbed once, here.
                self.trace.redact.exception(exc)
                self.trace.emit(
                    "lm_call", **base_event, error=str(exc), latency_s=_since(started), **state.fields()
                )
            raise
        counted = AttemptUsage(
            input_tokens=response.input_tokens,
            output_tokens=response.output_tokens,
            cached_tokens=response.cached_tokens,
            cache_write_tokens=response.cache_write_tokens,
            provider_cost_usd=response.provider_cost_usd,
            estimated=response.usage_estimated,
        )
        usage, cost_known = self._count(state, counted)
        total = ModelUsage()
        total.add(state.billed)
        total.add(usage)
        fields = state.fields()
        fields.pop("billed_usage", None)  # folded into `usage` for a call that succeeded
        self.trace.emit(
            "lm_call",
            **base_event,
            response=fold(response.text, REPLY_TRACE_CHARS),
            usage=total.to_dict(),
            cost_known=cost_known,
            latency_s=_since(started),
            finish_reason=response.finish_reason,
            **fields,
            **_token_fields(response),
        )
        return response

    def _cache_hit(
        self, spec: str, cached: Cached, usage_scopes: list[Usage], base_event: dict[str, Any]
    ) -> None:
        """Count and trace a call answered from the call cache: no tokens, no cost, one hit, and
        what the call would have cost had it been sent (`cache_saved_usd`)."""
        provider, model = parse_model(spec)
        response = cached.response
        saved = response.provider_cost_usd
        if saved is None:
            saved = self.prices.cost(
                provider,
                model,
                response.input_tokens,
                response.output_tokens,
                response.cached_tokens,
                response.cache_write_tokens,
            )
        usage = ModelUsage(cache_hits=1, cache_saved_usd=saved or 0.0)
        for scope in usage_scopes:
            scope.record(spec, usage)
        self.trace.emit(
            "lm_call",
            **base_event,
            response=fold(response.text, REPLY_TRACE_CHARS),
            usage=usage.to_dict(),
            cache_hit="waited" if cached.waited else "stored",
            latency_s=0.0,
            finish_reason=response.finish_reason,
            attempts=0,
            **_token_fields(response),
        )

    def record(
        self,
        spec: str,
        response: LMResponse,
        *,
        meta: CallMeta,
        run_id: str,
        usage_scopes: list[Usage],
        trace_messages: list[Message],
        latency_s: float = 0.0,
    ) -> None:
        """A reply made outside the gateway (a trainer generating the root's turns with its own
        engine): counted in the ledger and usage, never refused, and traced as any lm_call is."""
        provider, model = parse_model(spec)
        usage = ModelUsage(
            input_tokens=response.input_tokens,
            output_tokens=response.output_tokens,
            cached_tokens=response.cached_tokens,
            cache_write_tokens=response.cache_write_tokens,
            cost_usd=response.provider_cost_usd
            or self.prices.cost(
                provider,
                model,
                response.input_tokens,
                response.output_tokens,
                response.cached_tokens,
                response.cache_write_tokens,
            )
            or 0.0,
            llm_calls=1,
        )
        self.ledger.charge(usage.total_tokens, usage.cost_usd)
        for scope in usage_scopes:
            scope.record(spec, usage)
        self.trace.emit(
            "lm_call",
            run_id=run_id,
            call_id=meta.call_id,
            parent_id=meta.parent_id,
            depth=meta.depth,
            purpose=meta.purpose,
            model=spec,
            new_messages=trace_messages,
            response=fold(response.text, REPLY_TRACE_CHARS),
            usage=usage.to_dict(),
            cost_known=True,
            latency_s=round(latency_s, 6),
            finish_reason=response.finish_reason,
            attempts=1,
            external=True,
            **_token_fields(response),
        )

    async def _attempts(self, request: LMRequest, state: _CallState) -> LMResponse:
        """Try until an answer, a final error, or no retries left (per call or per run)."""
        policy = self.settings.retry
        client = self.client(state.spec)
        while True:
            state.attempts += 1
            state.sending = True  # until complete() returns or raises: a cancellation now may be billed
            try:
                response = await client.complete(request)
            except LMError as err:
                state.sending = False
                if isinstance(err, BilledFailure) and err.usage is not None:
                    state.billed.add(self._count(state, err.usage)[0])
                if not err.retryable:
                    raise
                if state.attempts >= policy.max_attempts:
                    gave_up(err, state.attempts)
                    raise
                if state.reservation.settled:  # the failed attempt was billed: the retry needs its own
                    state.reservation = self._reserve_retry(state, err)
                if not self.settings.run_retries.take():
                    raise self.settings.run_retries.spent_error(err) from None
                state.errors.append(fold(str(err), RETRY_ERROR_TRACE_CHARS))
                await asyncio.sleep(policy.delay(state.attempts, err.retry_after))
                continue
            state.sending = False
            response.attempts = state.attempts
            return response

    def _count(self, state: _CallState, counted: AttemptUsage) -> tuple[ModelUsage, bool]:
        """Settle one billed attempt in the ledger and every usage scope; (its usage, price known)."""
        provider, model = parse_model(state.spec)
        cost = counted.provider_cost_usd
        if cost is None:
            cost = self.prices.cost(
                provider,
                model,
                counted.input_tokens,
                counted.output_tokens,
                counted.cached_tokens,
                counted.cache_write_tokens,
            )
        usage = ModelUsage(
            input_tokens=counted.input_tokens,
            output_tokens=counted.output_tokens,
            cached_tokens=counted.cached_tokens,
            cache_write_tokens=counted.cache_write_tokens,
            cost_usd=cost or 0.0,
            llm_calls=1,
        )
        tokens, usd = usage.total_tokens, usage.cost_usd
        if counted.estimated:
            # An estimate can fall short of the bill (a reply cut off mid-way is billed for output
            # we never saw): the budget keeps the attempt's whole reservation, so caps hold for
            # what the provider charges. Usage still reports the estimate.
            tokens = max(tokens, state.reservation.tokens)
            usd = max(usd, state.reservation.usd)
        self.ledger.settle(state.reservation, tokens, usd)
        for scope in state.scopes:
            scope.record(state.spec, usage)
        state.estimated = state.estimated or counted.estimated
        return usage, cost is not None

    def _drop(self, state: _CallState) -> None:
        """End a call that got no answer. An attempt cut off while the provider had it (the
        deadline, a cancelled REPL cell) may still be billed in full, and nothing says how much:
        the budget keeps its whole reservation, so a later call cannot spend money the provider
        may already have charged. Anything else was never sent, or was billed and counted."""
        if state.sending:
            self.ledger.settle(state.reservation, state.reservation.tokens, state.reservation.usd)
        else:
            self.ledger.release(state.reservation)

    def _reserve_retry(self, state: _CallState, err: LMError) -> Reservation:
        try:
            return self.ledger.reserve(*state.worst)
        except BudgetExceeded as exc:
            why = (
                f"{exc} (The call was to be retried after a failed attempt that may have been billed: {err})"
            )
            raise BudgetExceeded(exc.limit, why) from None


@dataclass
class _CallState:
    """One call's attempts: its live reservation, what failed attempts were billed, and why they failed."""

    spec: str
    reservation: Reservation
    worst: tuple[int, float | None]  # tokens and dollars one attempt reserves
    scopes: list[Usage]
    attempts: int = 0
    billed: ModelUsage = field(default_factory=ModelUsage)  # failed attempts that were counted
    estimated: bool = False
    errors: list[str] = field(default_factory=list)  # the failures that were retried
    sending: bool = False  # an attempt is with the provider right now

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attempts": self.attempts}
        if self.billed.llm_calls:
            out["billed_usage"] = self.billed.to_dict()
        if self.estimated:
            out["usage_estimated"] = True
        if self.errors:
            out["retry_errors"] = list(self.errors)
        return out


def _worst_usd(
    prices: PriceBook, provider: str, model: str, input_tokens: int, output_tokens: int
) -> float | None:
    """The most one call can cost: every input token at the dearest of the fresh, cached and
    cache-write rates.

    Cached reads are cheaper at every provider we know, but a price override can say otherwise,
    and a reservation that assumed "uncached" would then let a call cost more than it reserved
    (tests/test_budget_property.py found exactly that). Cache writes cost more than fresh input
    at Anthropic (1.25x), and a marked prompt may be written whole.
    """
    fresh = prices.worst_case(provider, model, input_tokens, output_tokens)
    if fresh is None or not input_tokens:
        return fresh
    cached = prices.cost(provider, model, input_tokens, output_tokens, cached_tokens=input_tokens)
    written = prices.cost(provider, model, input_tokens, output_tokens, cache_write_tokens=input_tokens)
    return max(c for c in (fresh, cached, written) if c is not None)


def _token_fields(response: LMResponse) -> dict[str, Any]:
    # Present only when the backend returned them, so ordinary traces do not grow.
    fields = {
        "logprobs": response.logprobs,
        "token_ids": response.token_ids,
        "prompt_token_ids": response.prompt_token_ids,
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in response.tool_calls]
        or None,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _prompt_text(messages: list[Message]) -> str:
    if len(messages) == 1:
        return content_text(messages[0]["content"])
    return "\n\n".join(f"[{m['role']}]\n{content_text(m.get('content')) or _calls_text(m)}" for m in messages)


def _calls_text(message: Message) -> str:
    calls = message.get("tool_calls") or []
    return "; ".join(f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)})" for c in calls)


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 6)
