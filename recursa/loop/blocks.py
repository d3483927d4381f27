"""Runs the code of one reply: its ```repl blocks in order (or the Python it wrote without a fence),
or the expression a prose FINAL stands for (or reads the variable a FINAL_VAR names, whose text is
its __str__: model code too), and says what the model is told about it.

All the code of one reply runs under one clock, `turn_timeout` seconds (by default exec_timeout):
each block gets exec_timeout or what is left of the reply's time, whichever is less. Without it a
reply of many blocks that each stop just short of exec_timeout (a degenerate or hostile generation)
held the turn that many timeouts over: a `run()`, a trainer's step, a served request. A block cut by
the reply's clock is a timed-out block like any other (the REPL keeps or restores its state), and no
block starts once the reply's time is used up.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

from recursa.loop.answers import (
    CodeRun,
    answer_beside_code,
    empty_answer,
    missing_variable_message,
    resolve_prose_final,
)
from recursa.loop.feedback import NO_CODE_MESSAGE, fence_hint, why_stop_after
from recursa.loop.finals import ProseFinal
from recursa.loop.output import render_turn
from recursa.loop.parse import Reply
from recursa.loop.rules import BesideCode
from recursa.sandbox.base import ExecResult, FinalAnswer, Sandbox
from recursa.trace.writer import TraceWriter, fold

# Outputs shown in the trace are folded: the root saw at most max_output_chars of them anyway.
_TRACE_OUTPUT_CHARS = 20_000
# Less than this left of a reply's time starts no further block: interrupting it would cost more.
_MIN_BLOCK_S = 0.01
# Lists the variables of plain types in the order they were made; leaves nothing behind.
_NAMES_CODE = (
    "print(__import__('json').dumps([_n for _n, _v in globals().items() if type(_n) is str and not "
    "_n.startswith('_') and isinstance(_v, (str, int, float, bool, list, dict, tuple))]))"
)


@dataclass
class Outcome:
    """What one reply came to: an answer, or the feedback for the model's next turn."""

    final: FinalAnswer | None
    feedback: str | None


class ReplyClock:
    """The time left for the code of one reply; it starts with the reply's first block."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._ends: float | None = None

    def timeout(self, exec_timeout: float) -> float:
        """The next block's timeout: exec_timeout, or the reply's time left when that is less."""
        now = time.monotonic()
        if self._ends is None:
            self._ends = now + self.seconds
        return min(exec_timeout, self._ends - now)

    def out_of_time(self, res: ExecResult, timeout: float, exec_timeout: float) -> float | None:
        """The reply's seconds when its time ran out during the block `res` reports (run with
        `timeout`) or left no time worth starting another; else None (what why_stop_after takes)."""
        assert self._ends is not None
        if res.timed_out:
            cut = timeout < exec_timeout  # the reply's clock, not the cell's limit, stopped it
        else:
            cut = self._ends - time.monotonic() < _MIN_BLOCK_S
        return self.seconds if cut else None


@dataclass
class ReplyCode:
    """What the code of one reply (of turn `turn`) runs with, and where it is recorded.

    `partial`: answer["content"] that the reply's code set without marking it ready."""

    sandbox: Sandbox
    trace: TraceWriter
    run_id: str
    turn: int
    exec_timeout: float
    turn_timeout: float
    max_output_chars: int
    beside_code: BesideCode = "confirmed"  # an answer written beside code (rules.py, answer_beside_code)
    partial: str | None = None
    # What the model is told when a reply held no code and no answer (each dialect says how code
    # is written in it).
    no_code: str = NO_CODE_MESSAGE
    # The tool call whose code runs (recorded with each exec): a reply of several calls runs them
    # one after another under the reply's one clock.
    call_id: str | None = None
    _clock: ReplyClock | None = None
    _blocks: int = 0  # cells run through execute(), numbered in the trace

    @property
    def clock(self) -> ReplyClock:
        if self._clock is None:
            self._clock = ReplyClock(self.turn_timeout)
        return self._clock

    async def run(self, parsed: Reply, *, retry: bool, call_id: str | None = None) -> Outcome:
        """Run the reply's code, or resolve its answer. `retry`: turns are left to fix a prose
        FINAL whose expression failed."""
        self.call_id = call_id
        outcome = await self._run(parsed, retry)
        if parsed.notes and outcome.final is None:
            outcome.feedback = (outcome.feedback or self.no_code) + "".join(
                f"\n\n[note] {note}" for note in parsed.notes
            )
        return outcome

    async def execute(self, code: str, *, call_id: str | None = None, shown: str | None = None) -> ExecResult:
        """One cell, run and recorded as it is: for dialects whose replies are read by a peer's
        own rules (loop/dialects/). `shown`: the model's code, recorded in place of `code` when a
        dialect runs it through code of its own."""
        self.call_id = call_id
        timeout = self.clock.timeout(self.exec_timeout)
        res = await self.sandbox.execute(code, timeout=timeout)
        if res.partial is not None:
            self.partial = res.partial
        self._blocks += 1
        self._record(code if shown is None else shown, self._blocks, res, timeout)
        return res

    async def names(self) -> list[str]:
        """The REPL's variables of plain types (str, numbers, bools, lists, dicts, tuples), in the
        order they were made: what the peers' REPLs list after each cell. Not recorded."""
        res = await self.sandbox.execute(_NAMES_CODE, timeout=self.exec_timeout)
        try:
            names = json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return []
        return [n for n in names if isinstance(n, str)]

    async def value(self, name: str) -> FinalAnswer | None:
        """A variable's value as an answer (its __str__, model code, under the reply's clock)."""
        return await self.sandbox.get_variable(name, timeout=self.clock.timeout(self.exec_timeout))

    async def resolve(self, prose: ProseFinal, *, retry: bool) -> FinalAnswer | str | None:
        """The answer a prose FINAL / FINAL_VAR stands for (answers.resolve_prose_final); an
        expression it evaluates runs as the reply's code, under the reply's clock."""
        clock = self.clock
        return await resolve_prose_final(
            prose,
            self.sandbox,
            lambda code: self._evaluate(code, clock),
            lambda name: self.sandbox.get_variable(name, timeout=clock.timeout(self.exec_timeout)),
            retry=retry,
            max_output_chars=self.max_output_chars,
        )

    async def _run(self, parsed: Reply, retry: bool) -> Outcome:
        if parsed.outcome == "answer":
            assert parsed.answer is not None
            written = parsed.answer.written
            final = await self.resolve(written, retry=retry)
            if isinstance(final, str):  # an expression that failed when evaluated: why
                return Outcome(None, final)
            if final is not None:
                empty = empty_answer(final)
                return Outcome(None, empty) if empty else Outcome(final, None)
            return Outcome(None, await missing_variable_message(self.sandbox, written.text))
        if parsed.outcome == "nothing":
            return Outcome(None, self.no_code + fence_hint(parsed))
        clock = self.clock
        results: list[ExecResult] = []
        blocks = parsed.code
        unfenced = parsed.code_outside_fences
        for index, code in enumerate(blocks, 1):
            timeout = clock.timeout(self.exec_timeout)
            res = await self.sandbox.execute(code, timeout=timeout)
            results.append(res)
            if res.partial is not None:
                self.partial = res.partial
            if res.final is not None and not unfenced:
                stop = empty_answer(res.final)  # an answer that holds nothing is not taken
                if stop is None:
                    self._record(code, index, res, timeout)
                    return Outcome(res.final, None)
            else:
                ran_out = clock.out_of_time(res, timeout, self.exec_timeout)
                stop = why_stop_after(res, unfenced, len(blocks) - index, out_of_reply_time=ran_out)
            if stop is not None:
                res.notes.append(stop)  # before the record: the trace shows why the rest did not run
            self._record(code, index, res, timeout)
            if stop is not None:
                break
        written = parsed.turn_answer
        if written is not None:
            ran = CodeRun(blocks, results, all_ran=len(results) == len(blocks))
            resolve = functools.partial(self.resolve, retry=retry)
            taken = await answer_beside_code(written, ran, self.beside_code, self.sandbox, resolve)
            if taken is not None:
                return Outcome(taken, None)
        feedback = "REPL output:\n" + render_turn(results, self.max_output_chars)
        if written is not None:
            feedback += (
                f"\n\n[note] Your reply also wrote {written.protocol}(...) next to code whose "
                "output you had not seen, so it was not accepted. If the output above confirms it, "
                "give the answer again in your next reply, with no code beside it."
            )
        return Outcome(None, feedback)

    async def _evaluate(self, code: str, clock: ReplyClock) -> ExecResult:
        """The one block a prose FINAL's expression runs as."""
        timeout = clock.timeout(self.exec_timeout)
        res = await self.sandbox.execute(code, timeout=timeout)
        ran_out = clock.out_of_time(res, timeout, self.exec_timeout)
        if (stop := why_stop_after(res, False, 0, out_of_reply_time=ran_out)) is not None:
            res.notes.append(stop)
        self._record(code, 1, res, timeout)
        return res

    def _record(self, code: str, index: int, res: ExecResult, timeout: float) -> None:
        self.trace.emit(
            "exec",
            run_id=self.run_id,
            turn=self.turn,
            block=index,
            **({"call_id": self.call_id} if self.call_id else {}),
            code=code,
            stdout=fold(res.stdout, _TRACE_OUTPUT_CHARS),
            stderr=fold(res.stderr, _TRACE_OUTPUT_CHARS),
            omitted_chars=res.omitted_chars,
            error=res.error,
            timed_out=res.timed_out,
            restarted=res.restarted,
            restored_names=res.restored_names,
            notes=res.notes,
            final=None
            if res.final is None
            else {"protocol": res.final.protocol, "text": fold(res.final.text)},
            duration_s=round(res.duration_s, 6),
            timeout_s=round(timeout, 6),  # exec_timeout, or less when the reply's time was running out
        )
