"""Hard budgets: one ledger per call tree that reserves a call's worst case before it is sent.

A call first reserves its worst-case tokens and dollars (every input byte as a token, plus the
full `max_output_tokens`, all at the uncached price). If the reservation would take spent plus
reserved over a cap, the call is refused before anything is sent, so no interleaving of a
1,000-prompt fan-out can overshoot. When the call returns, the reservation is replaced by what
the provider reported.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
import time
from dataclasses import dataclass

from recursa.errors import BudgetExceeded, ConfigError
from recursa.outcomes import BUDGET_LIMITS, BudgetLimit


@dataclass(frozen=True)
class Budget:
    """Caps for one call tree (a root run and all its sub-calls and children). None: no cap.

    Every cap is checked here, so a bad one fails at once with the argument and the fix named, not at
    the first model call: a number (numpy's too; counts whole), not a bool, NaN or infinity, and above
    zero. `max_usd=0` alone is allowed: it lets only free models run (local ones priced at 0).
    """

    max_usd: float | None = None
    max_tokens: int | None = None
    max_seconds: float | None = None
    max_llm_calls: int | None = None

    def __post_init__(self) -> None:
        for name in BUDGET_LIMITS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _checked(name, value))


@dataclass(frozen=True)
class Cap:
    """One cap's declaration, read by every door that takes caps (Budget's arguments, the commands'
    flags, a client's fields): its flag and help, a value that works, what a whole-number cap
    counts, and why a cap of 0 stops every run (None: 0 is a cap: `max_usd=0` runs free models)."""

    flag: str
    help: str
    example: str
    count: str | None = None
    zero: str | None = None


CAPS: dict[str, Cap] = {
    "max_usd": Cap("--max-usd", "a hard cap on US dollars for the whole run (default: none)", "1.0"),
    "max_tokens": Cap(
        "--max-tokens",
        "a hard cap on tokens (in + out) for the whole run; each call reserves its prompt plus "
        "--max-output-tokens first (default: none)",
        "200000",
        count="tokens",
        zero="the first model call reserves its prompt plus «max_output_tokens»",
    ),
    "max_seconds": Cap(
        "--max-seconds",
        "a wall-clock cap for the run (default: none)",
        "300",
        zero="the run would time out before its first model call",
    ),
    "max_llm_calls": Cap(
        "--max-llm-calls",
        "a cap on model calls over the whole run (default: none)",
        "50",
        count="LM calls",
        zero="a run needs at least one model call",
    ),
}
assert tuple(CAPS) == BUDGET_LIMITS


def cap_problem(name: str, value: object) -> str | None:
    """What is wrong with `value` as the cap `name` ("max_usd", ...), or None when it is a valid cap."""
    # Any real number: int, float, numpy's, Fraction, Decimal (registered only as a Number).
    real = isinstance(value, numbers.Real) or (
        isinstance(value, numbers.Number) and not isinstance(value, numbers.Complex)
    )
    if isinstance(value, bool) or not real:
        what = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
        return f"{what}, not a number"
    number = float(value)  # type: ignore[arg-type]
    cap = CAPS[name]
    if math.isnan(number):
        return "NaN compares false with everything, so it would never refuse a call"
    if math.isinf(number):
        return "infinity is not a cap"
    if number < 0:
        return "a cap below zero"
    if number == 0 and cap.zero is not None:
        return f"a cap of 0 stops every run at once ({cap.zero})"
    if cap.count is not None and not number.is_integer():
        return f"a count of {cap.count} must be a whole number"
    return None


def cap_message(
    name: str, value: object, problem: str, *, said: str, example: str, label: str, left_out: str = "no cap"
) -> str:
    """The one wording of a bad cap, with the cap spelt as the door it came through writes it:
    `said` as given (`Budget(max_usd=-1)`, `--max-usd -1.0`), `example` set to a value that works,
    `label` its name, and what leaving it out gives (`left_out`: no cap, or the operator's)."""
    phrase = "a positive number" if CAPS[name].zero is not None else "a non-negative number"
    fix = f"use {phrase} such as {example}, or leave {label} out for {left_out}"
    if isinstance(value, str):
        fix += " (a number read from text needs converting first: float(...) or int(...))"
    return f"{said}: {problem}; {fix}."


def _checked(name: str, value: object) -> int | float:
    """`value` as an int (counts) or a float, or a ConfigError that names the argument and the fix
    (its `setting`: the cap)."""
    problem = cap_problem(name, value)
    if problem is not None:
        said, example = f"Budget({name}={value!r})", f"{name}={CAPS[name].example}"
        raise ConfigError(cap_message(name, value, problem, said=said, example=example, label=name), setting=name)
    if CAPS[name].count is not None:
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            return int(float(value))  # type: ignore[arg-type]
    return float(value)  # type: ignore[arg-type]


@dataclass
class Reservation:
    tokens: int
    usd: float
    settled: bool = False


class Ledger:
    """Spend and reservations of one call tree. Thread-safe; every method is O(1)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._monotonic = time.monotonic
        self.started_at = self._monotonic()
        self.deadline = self.started_at + budget.max_seconds if budget.max_seconds is not None else None
        self.spent_usd = 0.0
        self.spent_tokens = 0
        self.calls = 0
        self.reserved_usd = 0.0
        self.reserved_tokens = 0
        self.in_flight = 0

    def remaining_seconds(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self._monotonic())

    def reserve(self, tokens: int, usd: float | None) -> Reservation:
        """Reserve one call's worst case or raise `BudgetExceeded` without reserving anything."""
        b = self.budget
        usd = usd or 0.0
        with self._lock:
            refusal: tuple[BudgetLimit, str] | None = None
            if self.deadline is not None and self._monotonic() >= self.deadline:
                refusal = ("max_seconds", f"the run's time budget of {b.max_seconds:g} s is used up")
            elif b.max_llm_calls is not None and self.calls + self.in_flight + 1 > b.max_llm_calls:
                refusal = ("max_llm_calls", f"the budget of {b.max_llm_calls} LM calls is used up")
            elif (
                b.max_tokens is not None and self.spent_tokens + self.reserved_tokens + tokens > b.max_tokens
            ):
                left = b.max_tokens - self.spent_tokens - self.reserved_tokens
                refusal = (
                    "max_tokens",
                    f"this call could use up to {tokens:,} tokens but only {max(left, 0):,} of the "
                    f"{b.max_tokens:,}-token budget are left",
                )
            elif b.max_usd is not None and self.spent_usd + self.reserved_usd + usd > b.max_usd + 1e-12:
                left = b.max_usd - self.spent_usd - self.reserved_usd
                refusal = (
                    "max_usd",
                    f"this call could cost up to ${usd:.4f} but only ${max(left, 0):.4f} of the "
                    f"${b.max_usd:g} budget is left",
                )
            if refusal:
                limit, why = refusal
                raise BudgetExceeded(
                    limit,
                    f"LM call refused: {why}. Send smaller or fewer prompts, or answer now with what "
                    "you have.",
                )
            self.reserved_tokens += tokens
            self.reserved_usd += usd
            self.in_flight += 1
            return Reservation(tokens, usd)

    def used_up(self) -> BudgetLimit | None:
        """Which cap is reached (so the next call would be refused whatever its size), or None."""
        b = self.budget
        with self._lock:
            if self.deadline is not None and self._monotonic() >= self.deadline:
                return "max_seconds"
            if b.max_llm_calls is not None and self.calls >= b.max_llm_calls:
                return "max_llm_calls"
            if b.max_tokens is not None and self.spent_tokens >= b.max_tokens:
                return "max_tokens"
            if b.max_usd is not None and self.spent_usd >= b.max_usd - 1e-12:
                return "max_usd"
        return None

    def settle(self, reservation: Reservation, tokens: int, usd: float) -> None:
        """Replace a reservation by what the call really cost."""
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            self._unreserve(reservation)
            self._spend(tokens, usd)

    def charge(self, tokens: int, usd: float) -> None:
        """Count a call made outside the tree (a trainer's own turn): spent, never refused."""
        with self._lock:
            self._spend(tokens, usd)

    def _spend(self, tokens: int, usd: float) -> None:
        # What a call cost is reported by a server or a trainer: nothing hands budget back.
        self.spent_tokens += max(tokens, 0)
        self.spent_usd += usd if usd > 0 else 0.0
        self.calls += 1

    def release(self, reservation: Reservation) -> None:
        """Drop a reservation for a call that was never billed (refused or failed before sending)."""
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            self._unreserve(reservation)

    def _unreserve(self, reservation: Reservation) -> None:
        self.reserved_tokens -= reservation.tokens
        self.reserved_usd -= reservation.usd
        self.in_flight -= 1
