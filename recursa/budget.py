"""Hard budgets: one ledger per call tree that reserves a call's worst case before it is sent.

A call first reserves its worst-case tokens and dollars (every input byte as a token, plus the
full `max_output_tokens`, all at the uncached price). If the reservation would take spent plus
reserved over a cap, the call is refused before anything is sent, so no interleaving of a
1,000-prompt fan-out can overshoot. When the call returns, the reservation is replaced by what
the provider reported.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from recursa.errors import BudgetExceeded, ConfigError


@dataclass(frozen=True)
class Budget:
    """Caps for one call tree (a root run and all its sub-calls and children). None: no cap."""

    max_usd: float | None = None
    max_tokens: int | None = None
    max_seconds: float | None = None
    max_llm_calls: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_usd", "max_tokens", "max_seconds", "max_llm_calls"):
            value = getattr(self, name)
            if value is None:
                continue
            # bool is an int to Python, and NaN compares False with everything, so a NaN cap would
            # never refuse a call: both are mistakes, not limits.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
                raise ConfigError(f"Budget({name}={value!r}): use a non-negative number or None (no cap).")
            if name in _COUNTS and isinstance(value, float) and not value.is_integer():
                unit = "tokens" if name == "max_tokens" else "LM calls"
                raise ConfigError(
                    f"Budget({name}={value!r}): a count of {unit} must be a whole number (an int), "
                    "or None for no cap."
                )


_COUNTS = ("max_tokens", "max_llm_calls")


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
            refusal = None
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

    def used_up(self) -> str | None:
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
            self.spent_tokens += tokens
            self.spent_usd += usd
            self.calls += 1

    def charge(self, tokens: int, usd: float) -> None:
        """Count a call made outside the tree (a trainer's own turn): spent, never refused."""
        with self._lock:
            self.spent_tokens += tokens
            self.spent_usd += usd
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
