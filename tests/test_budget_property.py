"""The budget guarantee, property-based: whatever the call tree, batch sizes, prices and failures,
spend never exceeds `max_usd`, `max_tokens` or `max_llm_calls`, and a tree with `max_seconds`
finishes within a second of it (not counting time its thread waited for a CPU).

The fast test drives the real machinery every LM call goes through (recursa.budget's Ledger and
recursa.lm.gateway's ModelGateway with its limiter, retries and billing of failed attempts) with
random concurrent call trees in asyncio, behind an in-memory model that bills random usage up to
what the call reserved, fails at random (billed or not, retryable or not), reports only an
estimate, or hangs until the deadline and may bill all the same (300 examples; see EXAMPLES). The
second runs whole RLMs (real loop, REPL and openai SDK against the fake server) with random fan-outs,
children, budgets and server faults, and holds both `result.usage` and what the server billed to
the Budget. The last is a fixed case of an overspend the first one led to.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import random
import tempfile
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from recursa import RLM, Budget
from recursa.budget import Ledger
from recursa.errors import BudgetExceeded, ConfigError, LMError
from recursa.lm.base import CallMeta, LMClient, LMRequest, LMResponse, estimate_tokens_upper
from recursa.lm.billing import AttemptUsage, BilledFailure
from recursa.lm.gateway import ClientSettings, ModelGateway
from recursa.lm.limiter import Limiter
from recursa.lm.prices import ModelPrice, PriceBook
from recursa.lm.registry import parse_model
from recursa.lm.retry import RetryBudget, RetryPolicy
from recursa.lm.windows import ContextWindows
from recursa.testing.fake_state import Fault
from recursa.trace.redact import Redactor
from recursa.trace.writer import TraceWriter
from recursa.usage import Usage

MODELS = ("openai/alpha", "openai/beta")
# 300 random trees by default, more for a deep run (RECURSA_PROPERTY_EXAMPLES=5000). The trees it once failed on are fixed examples below.
EXAMPLES = int(os.environ.get("RECURSA_PROPERTY_EXAMPLES", "300"))
# 1- to 4-byte UTF-8: a reservation must count bytes, not characters.
GLYPHS = ("a", "é", "€", "\U0001d11e")
# The ledger lets a sum of float costs land up to 1e-12 over the cap (rounding, not spending); a
# billionth of a dollar is far beyond that and far below any real overspend.
USD_SLACK = 1e-9
# The promise: a run past its deadline stops within a second of it. Measured on the event
# loop's thread, less the time that thread waited for a CPU (`waited_for_cpu_s`): on a loaded
# machine (load 10-14 on 2 cores) a tree whose post-deadline work took 0.13 s of CPU sat 1.9 s in
# the run queue, which is the machine's delay, not the deadline's.
TIME_SLACK_S = 1.0


# -- the random world -------------------------------------------------------------------------
#
# Hypothesis draws the shape of the world: budgets, prices, limits, how often each kind of failure
# happens, and the call tree (turns, batch sizes, children). The details of each call (prompt size
# and script, output cap, what each attempt does) come from a seeded generator per step: drawing
# hundreds of calls field by field through Hypothesis would cost more time than running them, and
# a seed still shrinks and replays exactly.


@dataclass(frozen=True)
class Attempt:
    """How one attempt of a call goes. Usage shares are fractions of what the call reserved."""

    kind: str  # "ok" | "error" (never billed) | "billed" (a failure the provider billed) | "hang"
    retryable: bool = True
    share_in: float = 1.0
    share_out: float = 1.0
    share_cached: float = 0.0
    provider_cost: float | None = None  # the provider reports a cost: this share of the worst case
    estimated: bool = False  # the client only learns an estimate, below the bill
    bill_if_cut: bool = False  # cancelled while in flight, the provider bills it all the same


@dataclass(frozen=True)
class Call:
    model: int
    glyph: str
    chars: int
    max_output: int
    attempts: tuple[Attempt, ...]  # attempts past the end succeed with full usage
    delay_s: float


@dataclass(frozen=True)
class Turn:
    seed: int  # the run's own model call (a root turn): refused or failed, it ends the run


@dataclass(frozen=True)
class Batch:
    size: int  # llm_query_batched: `size` sub-calls at once; failures reach the code, not the run
    seed: int


@dataclass(frozen=True)
class Children:
    runs: tuple[Run, ...]  # rlm_query_batched: child runs at once


@dataclass(frozen=True)
class Run:
    steps: tuple[Turn | Batch | Children, ...]


@dataclass(frozen=True)
class Setup:
    budget: Budget
    prices: tuple[ModelPrice, ModelPrice]
    failure_weights: tuple[float, float, float]  # of "error", "billed", "hang" against 1.0 for "ok"
    concurrency: int
    per_model: int | None
    requests_per_minute: int | None
    max_attempts: int
    run_retries: int | None


KINDS = ("ok", "error", "billed", "hang")


def make_calls(size: int, seed: int, weights: tuple[float, float, float]) -> list[Call]:
    rng = random.Random(seed)

    def attempt() -> Attempt:
        return Attempt(
            kind=rng.choices(KINDS, weights=(1.0, *weights))[0],
            retryable=rng.random() < 0.7,
            share_in=rng.random(),
            share_out=rng.random(),
            share_cached=rng.random(),
            provider_cost=rng.random() if rng.random() < 0.3 else None,
            estimated=rng.random() < 0.2,
            bill_if_cut=rng.random() < 0.5,
        )

    return [
        Call(
            model=rng.randrange(len(MODELS)),
            glyph=rng.choice(GLYPHS),
            chars=rng.randrange(1_500),
            max_output=rng.randrange(1, 2_000),
            attempts=tuple(attempt() for _ in range(rng.randrange(4))),
            delay_s=rng.choice((0.0, 0.0, 0.0005, 0.002)),
        )
        for _ in range(size)
    ]


seeds = st.integers(0, 2**32 - 1)
turns = st.builds(Turn, seeds)
batches = st.builds(Batch, st.integers(1, 30), seeds)


def _runs(children: st.SearchStrategy[Children] | None) -> st.SearchStrategy[Run]:
    step = turns | batches if children is None else turns | batches | children
    return st.builds(Run, st.lists(step, min_size=1, max_size=4).map(tuple))


trees = st.recursive(
    _runs(None),
    lambda inner: _runs(st.builds(Children, st.lists(inner, min_size=1, max_size=4).map(tuple))),
    max_leaves=8,
)
prices = st.builds(
    ModelPrice,
    input_per_mtok=st.floats(0.0, 30.0),
    output_per_mtok=st.floats(0.0, 60.0),
    # Cached input is cheaper than fresh input at every provider; drawn freely all the same.
    cached_input_per_mtok=st.none() | st.floats(0.0, 30.0),
)
setups = st.builds(
    Setup,
    budget=st.builds(
        Budget,
        # Zero is not a cap Budget takes for tokens, seconds or calls (it stops every run at once).
        max_usd=st.none() | st.floats(0.0, 0.2),
        max_tokens=st.none() | st.integers(1, 40_000),
        max_seconds=st.none() | st.floats(0.0, 0.02, exclude_min=True),
        max_llm_calls=st.none() | st.integers(1, 60),
    ),
    prices=st.tuples(prices, prices),
    failure_weights=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 0.3)),
    concurrency=st.integers(1, 64),
    per_model=st.none() | st.integers(1, 8),
    requests_per_minute=st.none() | st.sampled_from([6_000, 60_000, 600_000]),
    max_attempts=st.integers(1, 4),
    run_retries=st.none() | st.integers(0, 10),
)


# -- an in-memory model that bills honestly ---------------------------------------------------


@dataclass
class Tally:
    tokens: int = 0
    usd: float = 0.0
    calls: int = 0


@dataclass
class Provider:
    """The model provider: what it billed (the truth the caps are about) and what it told the
    client it billed (what recursa can count), independent of recursa's own accounting."""

    book: PriceBook
    weights: tuple[float, float, float]
    hang_allowed: bool
    plans: dict[str, Call] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    tries: dict[str, int] = field(default_factory=dict)
    billed: Tally = field(default_factory=Tally)
    reported: Tally = field(default_factory=Tally)
    # Set once the client was told less than the bill (an estimate, an attempt cut off in flight):
    # from then on the ledger may rightly count more than was billed, never less.
    blurred: bool = False

    def add(self, tally: Tally, spec: str, usage: AttemptUsage) -> None:
        provider, model = parse_model(spec)
        cost = usage.provider_cost_usd
        if cost is None:
            cost = self.book.cost(
                provider, model, usage.input_tokens, usage.output_tokens, usage.cached_tokens
            )
        tally.tokens += usage.input_tokens + usage.output_tokens
        tally.usd += cost or 0.0
        tally.calls += 1


class FakeClient:
    """An LMClient whose every bill stays within what the gateway reserved for the attempt."""

    def __init__(self, spec: str, world: Provider) -> None:
        self.provider, self.model = parse_model(spec)
        self.spec = spec
        self.world = world

    async def complete(self, request: LMRequest) -> LMResponse:
        world = self.world
        call_id = request.meta.call_id
        plan = world.plans[call_id]
        n = world.tries.get(call_id, 0)
        world.tries[call_id] = n + 1
        attempt = plan.attempts[n] if n < len(plan.attempts) else Attempt("ok")
        bill = self._usage(request, attempt)
        try:
            await asyncio.sleep(plan.delay_s)
            if attempt.kind == "hang" and world.hang_allowed:
                await asyncio.sleep(3_600)  # only the deadline ends this
        except asyncio.CancelledError:
            # The client gave up; the provider may still finish the reply and bill it.
            world.blurred = True
            if attempt.bill_if_cut:
                world.add(world.billed, self.spec, bill)
            raise
        if attempt.kind in ("error", "hang"):
            raise LMError(
                "the model API failed", status=503 if attempt.retryable else 400, retryable=attempt.retryable
            )
        world.add(world.billed, self.spec, bill)
        told = bill
        if attempt.estimated:
            # The answer carried no usage (or was cut off): the client can only estimate, low.
            told = AttemptUsage(bill.input_tokens // 2, 0, estimated=True)
            world.blurred = True
        world.add(world.reported, self.spec, told)
        if attempt.kind == "billed":
            raise BilledFailure("the reply was cut off mid-way", usage=told, retryable=attempt.retryable)
        return LMResponse(
            text="ok",
            input_tokens=told.input_tokens,
            output_tokens=told.output_tokens,
            cached_tokens=told.cached_tokens,
            provider_cost_usd=told.provider_cost_usd,
            usage_estimated=told.estimated,
        )

    def _usage(self, request: LMRequest, attempt: Attempt) -> AttemptUsage:
        most_in = estimate_tokens_upper(request.messages, 0)
        most_out = request.max_output_tokens
        input_tokens = int(most_in * attempt.share_in)
        output_tokens = int(most_out * attempt.share_out)
        cost = None
        if attempt.provider_cost is not None:
            worst = self.world.book.worst_case(self.provider, self.model, most_in, most_out) or 0.0
            cost = worst * attempt.provider_cost
        return AttemptUsage(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cached_tokens=int(input_tokens * attempt.share_cached),
            provider_cost_usd=cost,
        )

    async def aclose(self) -> None:
        pass


class FakeGateway(ModelGateway):
    world: Provider

    def client(self, spec: str) -> LMClient:
        return FakeClient(spec, self.world)


# -- running a tree ---------------------------------------------------------------------------


async def _play(gateway: FakeGateway, world: Provider, run: Run, depth: int, scopes: list[Usage]) -> None:
    """One run of the tree, as the engine drives it: its own turns in order (a refused or failed
    turn ends the run), sub-call batches and child runs concurrently (failures reach the code)."""
    scopes = [Usage(), *scopes]

    async def send(call: Call, purpose: str) -> None:
        call_id = f"call{next(world.ids)}"
        world.plans[call_id] = call
        await gateway.call(
            MODELS[call.model],
            [{"role": "user", "content": call.glyph * call.chars}],
            meta=CallMeta(call_id=call_id, depth=depth, purpose=purpose),
            run_id=f"run{depth}",
            max_output_tokens=call.max_output,
            usage_scopes=scopes,
        )

    for step in run.steps:
        if isinstance(step, Turn):
            try:
                await send(make_calls(1, step.seed, world.weights)[0], "root")
            except (BudgetExceeded, LMError):
                return
        elif isinstance(step, Batch):
            batch = make_calls(step.size, step.seed, world.weights)
            outcomes = await asyncio.gather(*(send(c, "sub") for c in batch), return_exceptions=True)
            _only_expected(outcomes)
        else:
            outcomes = await asyncio.gather(
                *(_play(gateway, world, child, depth + 1, scopes) for child in step.runs),
                return_exceptions=True,
            )
            _only_expected(outcomes)


def _only_expected(outcomes: list[object]) -> None:
    for item in outcomes:
        if isinstance(item, BaseException) and not isinstance(item, (BudgetExceeded, LMError)):
            raise item


@dataclass
class Played:
    ledger: Ledger
    world: Provider
    root: Usage
    elapsed_s: float  # from the ledger's start, less the time the loop's thread waited for a CPU


def waited_for_cpu_s() -> float:
    """Seconds this thread has waited for a CPU while it could run (Linux schedstat; 0 where the
    kernel does not say, leaving wall time)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


async def _play_tree(setup: Setup, tree: Run) -> Played:
    book = PriceBook({spec: price for spec, price in zip(MODELS, setup.prices, strict=True)})
    world = Provider(book, setup.failure_weights, hang_allowed=setup.budget.max_seconds is not None)
    rpm = setup.requests_per_minute if setup.budget.max_seconds is not None else None
    limiter = Limiter(
        setup.concurrency,
        per_model={MODELS[0]: setup.per_model} if setup.per_model else None,
        requests_per_minute={MODELS[1]: rpm} if rpm else None,
    )
    # The first window lookup loads genai-prices' table, once per process and synchronously: no
    # deadline can cut an import short, so it happens before the clock starts.
    for spec in MODELS:
        ContextWindows().window(spec)
    queued = waited_for_cpu_s()
    ledger = Ledger(setup.budget)
    gateway = FakeGateway(
        ledger=ledger,
        limiter=limiter,
        prices=book,
        trace=TraceWriter(None, Redactor([])),
        settings=ClientSettings(
            retry=RetryPolicy(max_attempts=setup.max_attempts, base_delay=0.0005, max_delay=0.002),
            run_retries=RetryBudget(setup.run_retries),
        ),
    )
    gateway.world = world
    root = Usage()
    # What earlier tests left in this process is no part of the tree: frozen, a full collection
    # inside the timed play does not walk it (a full suite run once saw a 1.5 s stall there).
    gc.freeze()
    try:
        await _play(gateway, world, tree, 0, [root])
    finally:
        gc.unfreeze()
    starved = waited_for_cpu_s() - queued
    return Played(ledger, world, root, time.monotonic() - ledger.started_at - starved)


# Two overspends this test found, kept as fixed examples:
# - a price override whose cached-input rate is above the fresh rate: a reservation that priced
#   every input token as uncached was smaller than what a fully cached call then cost;
# - 300 sub-calls behind a requests-per-minute pace with max_seconds=0.05: calls waiting for their
#   turn were not bound by the deadline, and the tree ended 1.5 s late.
FOUND = [
    (
        Setup(
            Budget(max_usd=0.0),
            (ModelPrice(0.0, 0.0, 1.0), ModelPrice(0.0, 0.0, 1.0)),
            (0.0, 0.0, 0.0),
            1,
            None,
            None,
            1,
            None,
        ),
        Run((Turn(0), Turn(1), Turn(2))),
    ),
    (
        Setup(
            Budget(max_seconds=0.05),
            (ModelPrice(1.0, 1.0), ModelPrice(1.0, 1.0)),
            (0.0, 0.0, 0.0),
            64,
            None,
            6_000,
            1,
            None,
        ),
        Run((Children(tuple(Run((Batch(30, seed),)) for seed in range(10))),)),
    ),
]


# Not `serial`: its one clock assertion (max_seconds) leaves out the time the loop's thread waited
# for a CPU, so another test beside it, like any other load on the machine, cannot fail it.
@pytest.mark.timeout(360)  # 1,000 trees take about 15 s of CPU, several times that on a loaded machine
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(setup=setups, tree=trees)
@example(*FOUND[0])
@example(*FOUND[1])
def test_no_call_tree_overspends(setup: Setup, tree: Run) -> None:
    played = asyncio.run(_play_tree(setup, tree))
    budget, ledger, world, root = setup.budget, played.ledger, played.world, played.root

    # The caps hold for what the provider billed, not only for what recursa thinks it spent.
    billed = world.billed
    if budget.max_tokens is not None:
        assert billed.tokens <= budget.max_tokens
    if budget.max_usd is not None:
        assert billed.usd <= budget.max_usd + USD_SLACK
    if budget.max_llm_calls is not None:
        assert billed.calls <= budget.max_llm_calls
    if budget.max_seconds is not None:
        assert played.elapsed_s <= budget.max_seconds + TIME_SLACK_S

    # The ledger never counts less than the bill; exactly the bill while the client knew it.
    assert ledger.spent_tokens >= billed.tokens and ledger.calls >= billed.calls
    assert ledger.spent_usd >= billed.usd - USD_SLACK
    if not world.blurred:
        assert (ledger.spent_tokens, ledger.calls) == (billed.tokens, billed.calls)
        assert abs(ledger.spent_usd - billed.usd) <= USD_SLACK
    # Usage reports every attempt the client heard about, once, in the root's totals.
    assert (root.total_tokens, root.llm_calls) == (world.reported.tokens, world.reported.calls)
    assert abs(root.cost_usd - world.reported.usd) <= USD_SLACK
    # Nothing is left reserved once every call is over.
    assert ledger.in_flight == 0 and ledger.reserved_tokens == 0
    assert abs(ledger.reserved_usd) <= USD_SLACK
    # No call was tried more often than the retry policy allows.
    assert all(n <= setup.max_attempts for n in world.tries.values())


# -- whole runs -------------------------------------------------------------------------------

ROOT, SUB = "openai/prop-root", "openai/prop-sub"
PRICES = {
    ROOT: {"input_per_mtok": 2.0, "output_per_mtok": 8.0},
    SUB: {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
}


@dataclass(frozen=True)
class Plan:
    fan_out: int  # prompts in one llm_query_batched
    prompt_chars: int
    children: int  # rlm_query_batched children, each with one llm_query of its own
    reply_chars: int  # how long every sub-model answer is
    max_output_tokens: int
    budget: Budget
    faults: tuple[str | None, ...]  # per request index, for the sub-model's requests
    max_retries: int


def _root_replies(plan: Plan) -> list[str]:
    batch = (
        "try:\n"
        f"    r = llm_query_batched(['q' * {plan.prompt_chars}] * {plan.fan_out})\n"
        "except Exception as e:\n"
        "    r = [str(e)]\n"
        "print(len(r))"
    )
    kids = (
        "try:\n"
        f"    k = rlm_query_batched(['go'] * {plan.children}, contexts=['c' * 50] * {plan.children})\n"
        "except Exception as e:\n"
        "    k = [str(e)]\n"
        "print(len(k))"
    )
    return [f"```repl\n{batch}\n```", f"```repl\n{kids}\n```", "FINAL(done)"]


def _child_replies() -> list[str]:
    code = "try:\n    n = llm_query('x' * 200)\nexcept Exception as e:\n    n = str(e)"
    return [f"```repl\n{code}\n```", "FINAL_VAR(n)"]


def _responder(plan: Plan):  # type: ignore[no-untyped-def]
    roots = {"prop-root": _root_replies(plan), "prop-sub": _child_replies()}

    def respond(model: str, messages: list[dict]) -> str:
        if len(messages) > 1 and messages[0]["role"] == "system":
            replies = roots[model]
            return replies[min(sum(m["role"] == "assistant" for m in messages), len(replies) - 1)]
        return "y" * plan.reply_chars

    return respond


full_plans = st.builds(
    Plan,
    fan_out=st.integers(1, 40),
    prompt_chars=st.integers(1, 3_000),
    children=st.integers(0, 3),
    reply_chars=st.integers(1, 400),
    max_output_tokens=st.integers(16, 2_000),
    # Caps around what a run wants (its root turns alone reserve a few thousand tokens each), so
    # most runs get some way and then meet a cap mid-batch.
    budget=st.builds(
        Budget,
        max_usd=st.none() | st.floats(0.005, 0.1),
        max_tokens=st.none() | st.integers(2_000, 80_000),
        max_seconds=st.none() | st.just(0.5),
        max_llm_calls=st.none() | st.integers(1, 60),
    ),
    faults=st.lists(
        st.sampled_from([None, None, None, "cut", "malformed", "no_usage", "hang", 503]), max_size=40
    ).map(tuple),
    max_retries=st.integers(0, 1),
)


def _fault_plan(plan: Plan):  # type: ignore[no-untyped-def]
    """Faults for the sub-model's requests, in the order they arrive. A request hangs only where
    a time budget will end it."""
    counter = itertools.count()

    def fault(record):  # type: ignore[no-untyped-def]
        if record.model != "prop-sub":
            return None
        n = next(counter)
        entry = plan.faults[n] if n < len(plan.faults) else None
        if entry == "hang":
            return Fault.hang(3.0) if plan.budget.max_seconds is not None else None
        return Fault(kind=entry) if isinstance(entry, str) else entry

    return fault


def _server_bill(server) -> tuple[int, float, int]:  # type: ignore[no-untyped-def]
    """(tokens, dollars, calls) the fake server billed: every request it answered with a
    generated reply, whole or cut off, at this test's prices."""
    tokens, usd, calls = 0, 0.0, 0
    for model, row in server.totals().items():
        price = PRICES[f"openai/{model}"]
        tokens += row["prompt_tokens"] + row["completion_tokens"]
        usd += (
            row["prompt_tokens"] * price["input_per_mtok"]
            + row["completion_tokens"] * price["output_per_mtok"]
        ) / 1e6
        calls += row["requests"]
    return tokens, usd, calls


def _rlm(plan: Plan, server, traces: str, on_event) -> RLM:  # type: ignore[no-untyped-def]
    return RLM(
        ROOT,
        sub_model=SUB,
        base_url=server.base_url,
        api_key="test-key-0123456789",
        trace_dir=traces,
        sandbox="inprocess",  # the REPL is not what is under test here, and this is fast
        max_depth=2,
        max_iterations=4,
        budget=plan.budget,
        prices=PRICES,
        max_output_tokens=plan.max_output_tokens,
        max_retries=plan.max_retries,
        subcall_errors="return",
        on_event=on_event,
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=full_plans)
@pytest.mark.filterwarnings('ignore:sandbox="inprocess"')
def test_whole_runs_never_overspend(server, plan: Plan) -> None:
    server.holder["responder"] = _responder(plan)
    server.latency_s = 0.0
    server.reset()
    server.faults = _fault_plan(plan)
    queued: dict[str, float] = {}

    def on_event(event: dict) -> None:  # on the loop's thread, as the root starts and ends
        if event["type"] in ("run_start", "run_end") and event["depth"] == 0:
            queued[event["type"]] = waited_for_cpu_s()

    try:
        with tempfile.TemporaryDirectory() as traces:
            try:
                rlm = _rlm(plan, server, traces, on_event)
            except ConfigError as exc:
                # A cap below what the root's first call reserves is refused before anything is sent.
                assert "the root's first call" in str(exc)
                assert server.totals() == {}
                return
            result = rlm.run("spend", "some context")
        tokens, usd, calls = _server_bill(server)
    finally:
        server.faults = None
    usage, budget = result.usage, plan.budget
    event(f"stop_reason={result.stop_reason}")
    event(f"server billed {'no' if calls == 0 else 'some' if calls < 10 else '10+'} calls")
    # What the server billed, and what recursa reports, are both within every cap.
    if budget.max_tokens is not None:
        assert tokens <= budget.max_tokens and usage.total_tokens <= budget.max_tokens
    if budget.max_usd is not None:
        assert usd <= budget.max_usd + USD_SLACK and usage.cost_usd <= budget.max_usd + USD_SLACK
    if budget.max_llm_calls is not None:
        assert calls <= budget.max_llm_calls and usage.llm_calls <= budget.max_llm_calls
    if budget.max_seconds is not None:
        starved = queued["run_end"] - queued["run_start"]
        assert result.duration_s - starved <= budget.max_seconds + TIME_SLACK_S
    assert result.stop_reason in ("final", "budget", "max_iterations", "timeout")


def test_a_sub_call_cut_off_by_a_cell_timeout_keeps_its_reservation(server) -> None:
    """Found while writing this file: the REPL gave up on an llm_query when its cell timed out,
    the gateway released the call's reservation, the provider still finished and billed the reply,
    and the next turn spent the same money again ($1.20 billed against max_usd=1.0)."""
    turns = [
        "```repl\nr = llm_query('first')\n```",  # the server sits on this one past exec_timeout
        "```repl\ntry:\n    r = llm_query('second')\nexcept BudgetExceeded as e:\n    r = str(e)\nprint(r)\n```",
        "FINAL(done)",
    ]

    def respond(model: str, messages: list[dict]) -> str:
        if model == "prop-root":
            return turns[min(sum(m["role"] == "assistant" for m in messages), len(turns) - 1)]
        return "y" * 4_000  # cut to max_output_tokens: every sub-call costs its full reservation

    server.holder["responder"] = respond
    server.latency_s = 0.0
    server.reset()
    server.faults = lambda record: Fault.hang(1.0) if record.model == "prop-sub" else None
    prices = {
        ROOT: {"input_per_mtok": 0.0, "output_per_mtok": 0.0},
        SUB: {"input_per_mtok": 0.0, "output_per_mtok": 1_000.0},
    }
    try:
        with tempfile.TemporaryDirectory() as traces:
            rlm = RLM(
                ROOT,
                sub_model=SUB,
                base_url=server.base_url,
                api_key="test-key-0123456789",
                trace_dir=traces,
                sandbox="subprocess",
                exec_timeout=0.3,
                max_output_tokens=600,  # $0.60 per sub-call: one fits in the budget, two do not
                budget=Budget(max_usd=1.0),
                prices=prices,
            )
            result = rlm.run("q", "ctx")
    finally:
        server.faults = None
    assert result.answer == "done"
    assert [r.model for r in server.requests].count("prop-sub") == 1  # the second was refused
    feedback = server.requests[-1].messages[-1]["content"]  # what the REPL printed in turn 2
    assert "LM call refused" in feedback and "only $0.4000" in feedback  # the $0.60 stayed spent
