import threading

import pytest

from recursa import RLM
from recursa.budget import Budget, Ledger
from recursa.errors import BudgetExceeded, ConfigError
from recursa.lm.base import estimate_tokens_upper


def test_reservation_refuses_before_cap_is_crossed():
    ledger = Ledger(Budget(max_tokens=1_000))
    r1 = ledger.reserve(600, None)
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve(500, None)  # 600 reserved + 500 > 1000
    assert info.value.limit == "max_tokens"
    assert "1,000-token budget" in str(info.value)
    ledger.settle(r1, 100, 0.0)  # the call used far less than its worst case
    ledger.reserve(500, None)  # now it fits
    assert ledger.spent_tokens == 100


def test_dollar_cap_and_release():
    ledger = Ledger(Budget(max_usd=1.0))
    r = ledger.reserve(10, 0.9)
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve(10, 0.2)
    assert info.value.limit == "max_usd"
    ledger.release(r)  # a failed call is not billed
    ledger.reserve(10, 0.2)
    assert ledger.spent_usd == 0.0


def test_call_count_cap_counts_in_flight_calls():
    ledger = Ledger(Budget(max_llm_calls=2))
    ledger.reserve(1, None)
    ledger.reserve(1, None)
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve(1, None)
    assert info.value.limit == "max_llm_calls"


def test_time_cap():
    ledger = Ledger(Budget(max_seconds=5))
    ledger._monotonic = lambda: ledger.started_at + 5  # the deadline has come
    with pytest.raises(BudgetExceeded) as info:
        ledger.reserve(1, None)
    assert info.value.limit == "max_seconds"


def test_settle_twice_is_harmless():
    ledger = Ledger(Budget(max_tokens=100))
    r = ledger.reserve(50, None)
    ledger.settle(r, 10, 0.0)
    ledger.settle(r, 10, 0.0)
    ledger.release(r)
    assert ledger.spent_tokens == 10 and ledger.reserved_tokens == 0 and ledger.in_flight == 0


def test_concurrent_reservations_never_overshoot():
    ledger = Ledger(Budget(max_usd=1.0))
    granted = []

    def worker():
        for _ in range(200):
            try:
                r = ledger.reserve(1, 0.01)
            except BudgetExceeded:
                continue
            granted.append(r)
            ledger.settle(r, 1, 0.01)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.spent_usd <= 1.0 + 1e-9
    assert len(granted) == 100


def test_invalid_budget_values():
    with pytest.raises(ValueError, match="max_usd"):
        Budget(max_usd=-1)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"max_usd": 0}, {"max_usd": 0.0}),  # free models only
        ({"max_tokens": 5_000.0, "max_llm_calls": 3.0}, {"max_tokens": 5_000, "max_llm_calls": 3}),
        ({"max_seconds": 1}, {"max_seconds": 1.0}),
    ],
)
def test_caps_are_kept_as_plain_numbers(kwargs, expected):
    budget = Budget(**kwargs)
    for name, value in expected.items():
        assert getattr(budget, name) == value and type(getattr(budget, name)) is type(value)


def test_numpy_and_decimal_caps_are_numbers():
    np = pytest.importorskip("numpy")
    from decimal import Decimal

    budget = Budget(max_usd=Decimal("0.5"), max_tokens=np.int64(9_000), max_seconds=np.float32(2.5))
    assert (budget.max_usd, budget.max_tokens, budget.max_seconds) == (0.5, 9_000, 2.5)
    assert type(budget.max_tokens) is int


@pytest.mark.parametrize("name", ["max_tokens", "max_seconds", "max_llm_calls"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "10", [1]])
def test_every_cap_refuses_what_cannot_be_a_cap(name, value):
    with pytest.raises(ConfigError, match=rf"Budget\({name}=") as info:
        Budget(**{name: value})
    assert f"or leave {name} out for no cap" in str(info.value)


def _rlm(server, tmp_path, budget: Budget, out: int = 1_000) -> RLM:
    return RLM(
        "openai/root-model",
        base_url=server.base_url,
        api_key="test-key-0123456789",
        trace_dir=tmp_path,
        max_output_tokens=out,
        budget=budget,
    )


def test_a_token_cap_below_the_first_call_is_refused_at_construction_and_the_floor_is_sound(
    server, script, tmp_path
):
    with pytest.raises(ConfigError, match="the root's first call reserves") as info:
        _rlm(server, tmp_path, Budget(max_tokens=2_000))
    floor = int(info.value.args[0].split("at least ")[1].split(" tokens")[0].replace(",", ""))
    with pytest.raises(ConfigError):
        _rlm(server, tmp_path, Budget(max_tokens=floor - 1))
    # The real first call reserves at least the floor, so the check never refuses a budget that
    # could have run (with a one-character question and context).
    script.root("root-model", "FINAL(42)")
    assert _rlm(server, tmp_path, Budget()).run("?", "x").answer == "42"
    assert estimate_tokens_upper(server.requests[0].messages, 1_000) >= floor
    # At the floor construction passes; the run itself is then refused at its first call, as before.
    server.reset()
    result = _rlm(server, tmp_path, Budget(max_tokens=floor)).run("What is the number?", "ctx")
    assert result.stop_reason == "budget" and "token budget" in result.error
    assert server.requests == []


@pytest.mark.parametrize(("cap", "value"), [("max_tokens", 0), ("max_usd", -1), ("max_llm_calls", 2.5), ("max_seconds", "30")])
def test_a_bad_cap_reads_the_same_at_every_door_but_for_how_the_door_spells_it(cap, value) -> None:
    """Budget(...) and the doors that take caps on their own (flags, a request's fields, a row's
    extras, recursa.bench.run's keywords) word a cap's problem and its fix once (recursa/budget.py)."""
    from recursa.config import Spelling
    from recursa.overrides import budget_of

    with pytest.raises(ConfigError) as python:
        Budget(**{cap: value})
    fix = str(python.value).split("; ", 1)[1].split(" such as ")[0]
    for door, said in [(Spelling("cli"), "--"), (Spelling("key", "extras"), "extras["), (Spelling("python", "recursa.bench.run"), "recursa.bench.run(")]:
        with pytest.raises(ConfigError) as told:
            budget_of({cap: value}, door)
        assert told.value.setting == cap
        problem = door.told(python.value).split(": ", 1)[1].split(";")[0]  # the settings it names, as the door does
        assert str(told.value).startswith(said) and f": {problem}; {fix} such as " in str(told.value)
        assert "Budget(" not in str(told.value)
