"""The bound on REPL processes alive at once over every episode of an environment, and the rule
for who gets a slot.

A REPL slot is held by a run (an episode's root or one of its child RLMs) for its whole life. A
parent's code waits for its rlm_query children, so slots can be held by runs that wait for slots:
handing every slot to whoever asked first can leave all of them with parents and none for the
children they wait on. The rule, in `ReplQuota`:

1. Headroom. A run at depth d whose episode's child RLMs go `chain` levels deep (max_depth - 1;
   0 when the trainer runs the children, or max_depth <= 1) gets a slot only if
   `need = min(chain, limit - 1) - d` slots stay free after it: a start leaves room for one whole
   chain of children below it, and for the deepest chain of any episode admitted and not yet
   ended (an episode without children of its own must not take the room another's need). With `limit >= max_depth` that is enough for every admitted episode
   to run its children in turn: whenever all the runs holding slots wait for children, the deepest
   of those children fits in what the last run admitted left free.
2. Children first. A slot given back goes to a waiting child before a waiting start (the deepest
   child first, then the longest waiting); starts are served first come, first served, and none
   while a child waits. Admitted episodes finish sooner, and their slots come back sooner.
3. Bounded waits. A child waits at most `seconds` (the parent's cell time, exec_timeout: its cell
   ends the wait then anyway); a start waits `wait_for_repl`, or not at all.
4. A named refusal, never a hang. When every slot is held by a run that waits, itself or through a
   running child, for a child waiting in line, and no waiter fits, no slot can come back: the newest
   waiting child is refused with `ReplsFull` at once (its rlm_query fails saying which knob to
   raise), then the next, until that is no longer so. By rule 1 this happens only with
   `limit < max_depth`.

Episodes may run on several event loops and threads (the blocking API): the state is under a
threading lock and waiters are woken on their own loops with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

from recursa.env.shared import EnvError

# The REPLs one episode holds at once where max_repls_per_episode is not given (or max_depth, where
# that is more): room for a batch of children per level, far below the 256 the environment allows.
EPISODE_SHARE = 16


class ReplsFull(EnvError):
    """No REPL slot under `max_live_repls`: a start refused at once or whose `wait_for_repl` ran out,
    or a child RLM that waited as long as its parent's cell may, or that no slot can ever free."""


@dataclass(frozen=True)
class QuotaWords:
    """How the bound's errors name its knobs, in the words of the interface in use."""

    limit: str = "RLMEnv(max_live_repls={n})"
    knob: str = "max_live_repls"
    depth: str = "max_depth"
    close: str = "close finished episodes (await episode.close())"
    fewer: str = "run fewer episodes at once"
    wait: str = "let starts wait for a slot with RLMEnv(wait_for_repl=seconds)"
    episode_limit: str = "RLMEnv(max_repls_per_episode={n})"
    episode_knob: str = "max_repls_per_episode"

    def for_episode(self) -> QuotaWords:
        """The words of one episode's share (Prepaid): its knob, and what its code can do instead."""
        fewer = "start fewer child RLMs at once in this episode"
        return QuotaWords(self.episode_limit, self.episode_knob, self.depth, fewer, fewer, fewer)


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    need: int  # slots that must stay free after this one is granted (a start's: see _start_need)
    depth: int = 0  # 0: an episode's start
    ancestors: tuple[str, ...] = ()  # a child's parent, grandparent, ...: runs that wait for it
    state: str = "waiting"  # then "granted", "refused" (why in `reason`) or "gone" (its loop closed)
    reason: str = ""
    chain: int = 0  # a start's: the levels of child RLMs its episode runs


class ReplQuota:
    """A bound on the REPL processes alive at once across every episode of an environment; see the
    module docstring for who gets a slot. `words` name the knobs in the caller's interface."""

    def __init__(self, limit: int, words: QuotaWords | None = None) -> None:
        self.limit = limit
        self.live = 0
        self.words = words or QuotaWords()
        self._lock = threading.Lock()  # episodes on the blocking API run on another thread
        self._starts: collections.deque[_Waiter] = collections.deque()
        self._children: list[_Waiter] = []  # in order of arrival
        self._chains: collections.Counter[int] = collections.Counter()  # admitted episodes' chains

    def need(self, chain: int, depth: int) -> int:
        """The slots a run at `depth` leaves free for the child RLMs below it (rule 1)."""
        return max(0, min(chain, self.limit - 1) - depth)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._starts) + len(self._children)

    # -- starts --------------------------------------------------------------------------------
    def take(self, need: int = 0) -> None:
        """A slot that does not wait, `need` left free after it, or ReplsFull saying what to do."""
        with self._lock:
            if self._starts or self._children or not self._fits(need):
                raise ReplsFull(self._full(need))
            self.live += 1

    def take_start(self, chain: int) -> None:
        """The slot of an episode whose child RLMs go `chain` levels deep, without waiting; the
        episode counts as admitted until `end_episode(chain)`."""
        with self._lock:
            need = self._start_need(chain)
            if self._starts or self._children or not self._fits(need):
                raise ReplsFull(self._full(need))
            self.live += 1
            self._chains[chain] += 1

    async def take_waiting(self, seconds: float, chain: int = 0) -> None:
        """`take_start`, waiting up to `seconds` in line behind earlier starts and any child."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._starts and not self._children and self._fits(self._start_need(chain)):
                self.live += 1
                self._chains[chain] += 1
                return
            waiter = _Waiter(loop, loop.create_future(), 0, chain=chain)
            self._starts.append(waiter)

        def timed_out() -> str:
            return f"waited {seconds:g} s for a REPL: {self._full(self._start_need(chain))}"

        await self._wait(waiter, seconds, timed_out)

    def end_episode(self, chain: int) -> None:
        """An admitted episode is over: the room kept for its children is free for starts again."""
        with self._lock:
            self._chains[chain] -= 1
            if self._chains[chain] <= 0:
                del self._chains[chain]
            self._settle()

    # -- children ------------------------------------------------------------------------------
    async def take_child(self, seconds: float, need: int, depth: int, ancestors: tuple[str, ...]) -> None:
        """A slot for a child RLM at `depth` whose ancestors' runs wait for it: at once if one fits,
        else in line ahead of every start, for up to `seconds`; ReplsFull when none can come."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._fits(need):
                self.live += 1
                return
            waiter = _Waiter(loop, loop.create_future(), need, depth, ancestors)
            self._children.append(waiter)
            self._settle()  # this wait may be the one that leaves every slot with a waiting parent

        def timed_out() -> str:
            return (
                f"the child RLM waited {seconds:g} s for a REPL: {self.live} REPLs are alive, the most "
                f"{self._limit()} allows: {self.words.close}, {self.words.fewer}, or raise {self.words.knob}"
            )

        await self._wait(waiter, seconds, timed_out)

    # -- giving back ---------------------------------------------------------------------------
    def give(self) -> None:
        with self._lock:
            self.live = max(0, self.live - 1)
            self._settle()

    # -- inside --------------------------------------------------------------------------------
    def _fits(self, need: int) -> bool:
        return self.live + 1 + need <= self.limit

    def _start_need(self, chain: int) -> int:
        """What a start leaves free: room for its own chain and the deepest admitted episode's."""
        return self.need(max(chain, max(self._chains, default=0)), 0)

    async def _wait(self, waiter: _Waiter, seconds: float, timed_out: Callable[[], str]) -> None:
        try:
            async with asyncio.timeout(seconds):
                await waiter.future
        except BaseException as exc:
            with self._lock:
                state = waiter.state
                if state == "waiting":  # it leaves the line holding nothing
                    if waiter in self._children:
                        self._children.remove(waiter)
                    else:
                        self._starts.remove(waiter)
                    self._settle()  # its parent may wait for nothing now; starts may be served
            if state == "granted":
                if isinstance(exc, TimeoutError):
                    return  # the slot came as the time ran out: keep it
                if waiter.depth == 0:
                    self.end_episode(waiter.chain)  # a start that will not run after all
                self.give()  # cancelled after a slot was handed over: pass it on
            if state == "refused":
                raise ReplsFull(waiter.reason) from None
            if isinstance(exc, TimeoutError):
                raise ReplsFull(timed_out()) from None
            raise
        if waiter.state == "refused":
            raise ReplsFull(waiter.reason)

    def _settle(self) -> None:
        """Hand out what fits (rule 2), then refuse what can never be served (rule 4). Under the lock."""
        while True:
            # Deepest first (a sort is stable: then longest waiting).
            for waiter in sorted(self._children, key=lambda w: -w.depth):
                if self._fits(waiter.need):
                    self._children.remove(waiter)
                    self._grant(waiter)
            while not self._children and self._starts and self._fits(self._start_need(self._starts[0].chain)):
                start = self._starts.popleft()
                self._grant(start)
                if start.state == "granted":
                    self._chains[start.chain] += 1
            if not self._deadlocked():
                return
            newest = self._children.pop()
            newest.state, newest.reason = "refused", self._deadlock_message()
            _wake_on(newest)

    def _grant(self, waiter: _Waiter) -> None:
        if _wake_on(waiter):
            waiter.state = "granted"
            self.live += 1
        else:
            waiter.state = "gone"

    def _deadlocked(self) -> bool:
        """Every slot is held by a run that waits for a child in line (the children's ancestors are
        the runs that wait, each holding one slot), and none of those children fits."""
        if not self._children or self.live == 0:
            return False
        waiting_runs = {run for waiter in self._children for run in waiter.ancestors}
        return len(waiting_runs) >= self.live

    def _limit(self) -> str:
        return self.words.limit.format(n=self.limit)

    def _full(self, need: int) -> str:
        kept = f", keeping {need} free for running episodes' child RLMs" if need else ""
        return (
            f"{self.live} REPLs are alive, the most {self._limit()} allows{kept}: {self.words.close}, "
            f"{self.words.fewer}, raise {self.words.knob}, or {self.words.wait}"
        )

    def _deadlock_message(self) -> str:
        return (
            f"no REPL can start for this child RLM: all {self.live} REPLs alive ({self._limit()}) belong "
            "to runs that wait for child RLMs of their own, so none can end to free one; raise "
            f"{self.words.knob} to at least {self.words.depth} (one REPL per level of child RLMs) or "
            f"{self.words.fewer}"
        )


def _wake_on(waiter: _Waiter) -> bool:
    try:
        waiter.loop.call_soon_threadsafe(_wake, waiter.future)
    except RuntimeError:  # its loop is closed: nobody is waiting there any more
        return False
    return True


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Prepaid:
    """One episode's share of the quota. The root's slot is taken when the episode starts (its REPL
    starts in the background), so a burst of starts cannot overshoot the bound; its child RLMs
    take theirs as they open their REPLs. `chain`: the levels of child RLMs with REPLs below the
    root (rule 1).

    `share`: the most slots the episode holds at once, its root's included, so that one episode's
    fan-out of child RLMs (code the policy wrote) cannot take the slots other episodes start in.
    It is a quota of its own under the same rules (at least `chain + 1`, one whole chain): a child
    takes a slot of the episode's share first, then one of the environment's."""

    def __init__(self, quota: ReplQuota, chain: int, *, taken: bool = False, share: int | None = None) -> None:
        if not taken:
            quota.take_start(chain)  # else take_waiting(seconds, chain) gave it
        self.quota = quota
        self.own: ReplQuota | None = None
        if share is not None:
            self.own = ReplQuota(max(share, chain + 1), quota.words.for_episode())
            self.own.live = 1  # the root's
        self.chain = chain
        self._prepaid = True
        self._ended = False
        self._lock = threading.Lock()

    def _use_prepaid(self) -> bool:
        with self._lock:
            prepaid, self._prepaid = self._prepaid, False
        return prepaid

    def take(self) -> None:
        if not self._use_prepaid():
            self._take_now()

    def _take_now(self) -> None:
        if self.own is not None:
            self.own.take()
        try:
            self.quota.take()
        except BaseException:
            if self.own is not None:
                self.own.give()
            raise

    async def take_for_run(self, depth: int, ancestors: tuple[str, ...], seconds: float) -> None:
        """The slot of a run's REPL: the root's was taken at the start; a child waits for its own,
        `seconds` at most in all."""
        if depth == 0 and self._use_prepaid():
            return
        if depth == 0:
            self._take_now()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        if self.own is not None:
            await self.own.take_child(seconds, self.own.need(self.chain, depth), depth, ancestors)
        try:
            left = max(0.0, deadline - loop.time())
            await self.quota.take_child(left, self.quota.need(self.chain, depth), depth, ancestors)
        except BaseException:
            if self.own is not None:
                self.own.give()
            raise

    def give(self) -> None:
        self.quota.give()
        if self.own is not None:
            self.own.give()

    def refund(self) -> None:
        """The episode is over: hand back the slot taken for its REPL if that never started, and
        the room kept for its children. Safe to call again."""
        with self._lock:
            ended, self._ended = self._ended, True
        if self._use_prepaid():
            self.give()
        if not ended:
            self.quota.end_episode(self.chain)
