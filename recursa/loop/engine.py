"""One RLM run: the root model writes code, the REPL runs it, until an answer comes back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

from recursa.context import ContextPayload, load_payload
from recursa.errors import BudgetExceeded, ContextLengthError, LMError, RecursaError, SandboxLost, template_of
from recursa.lm.base import CallMeta, LMResponse, Message
from recursa.loop.blocks import ReplyCode
from recursa.loop.compaction import WindowTracker, compacted_history, split_for_compaction, summary_prompt
from recursa.loop.dialects import make_dialect
from recursa.loop.dialects.base import Opening, TurnNotes
from recursa.loop.importable import modules_line
from recursa.loop.options import RunOptions
from recursa.loop.parse import read_reply
from recursa.loop.prompts import PromptSettings, prompt_variant, tools_text
from recursa.loop.rules import ReplyRules, rules_of
from recursa.loop.subcalls import SubcallHandler
from recursa.loop.tree import CallTree, new_id
from recursa.result import RLMResult
from recursa.sandbox.base import FinalAnswer, Sandbox, start_loaded
from recursa.tools.spec import Tool
from recursa.trace.writer import TRACE_FORMAT, fold
from recursa.usage import Usage

# The question repeated in each feedback message is cut to this many characters.
_REMINDER_CHARS = 500


class RunEngine:
    def __init__(
        self,
        tree: CallTree,
        *,
        question: str,
        payload: ContextPayload,
        depth: int = 0,
        parent_scopes: list[Usage] | None = None,
        ancestors: tuple[str, ...] = (),
        run_id: str | None = None,
        options: RunOptions | None = None,
    ) -> None:
        self.tree = tree
        self.config = tree.config
        self.question = question
        self.payload = payload
        self.depth = depth
        self.ancestors = ancestors  # the run ids above this one, its parent's first
        self.parent_run_id = ancestors[0] if ancestors else None
        self.run_id = run_id or new_id("run")
        self.usage = Usage()
        self.usage_scopes = [self.usage, *(parent_scopes or [])]
        self.model = self.config.model_for_depth(depth)
        # Which built-in prompt (or template file) this run's root gets; in the result and trace.
        self.prompt_variant = prompt_variant(self.model, self.config.prompt)
        # The conversation (loop/dialects/): prompts, how code and answers arrive, how outputs return.
        self.dialect = make_dialect(self.config.dialect, self.config.dialect_options)
        self._call_ids = itertools.count(1)
        self.options = options or RunOptions()
        self._sandbox: Sandbox | None = None
        self._partial: str | None = None  # answer["content"] set by code but never marked ready
        self._window = WindowTracker.for_run(self.config, tree.gateway.windows.window(self.model))
        self._history: list[Message] = []  # every root message, also after compactions
        # The stepping state (begin, step, finish): recursa.env steps a run with a trainer's replies.
        self.messages: list[Message] = []  # what the root sees next (compaction may shorten it)
        # A dialect's per-turn prompt shown with the next call only (SkyRL's), not kept in `messages`.
        self._transient: list[Message] = []
        self.turn = 0
        self.done = False
        self.result: RLMResult = RLMResult(
            answer="",
            value=None,
            usage=self.usage,
            stop_reason="error",
            iterations=0,
            trace_path=tree.trace.path,
            run_id=self.run_id,
            skipped_files=list(payload.info.skipped_files),
            prompt_variant=self.prompt_variant,
            dialect=self.dialect.name,
        )
        self._sent = 0  # messages already stored in the trace: each is written once, not per turn
        self._started = time.perf_counter()
        self._opening: asyncio.Task[tuple[Sandbox, list[str]]] | None = None
        self._warming: asyncio.Task[None] | None = None
        self._pending: BaseException | None = None  # raised by finish(): a cancellation or a bug
        self._finished = self._announced = False  # _announced: run_start is written (begin)

    @property
    def reply_rules(self) -> ReplyRules:
        """The rules this run's replies are read by: its dialect's (recursa/loop/rules.py)."""
        return rules_of(self.dialect, unfenced_code=self.config.unfenced_code)

    def new_call_id(self) -> str:
        return f"{self.run_id}.c{next(self._call_ids)}"

    async def spawn_child(self, question: str, context: Any) -> RLMResult:
        """A child run over `context` (ContextError if it cannot be one). Its context is encoded
        once a slot is free: each holds a file descriptor, and a cell's batch of thousands of
        children, all encoded while they waited, took every descriptor of the host process."""
        async with self.tree.child_slots(self.depth + 1):
            payload = await load_payload(context)
            try:
                child = RunEngine(
                    self.tree,
                    question=question,
                    payload=payload,
                    depth=self.depth + 1,
                    parent_scopes=self.usage_scopes,
                    ancestors=(self.run_id, *self.ancestors),
                    options=self.options.for_child(),
                )
                return await child.run()
            finally:
                payload.close()

    # -- the loop: RLM.run drives it here; recursa.env steps it with a trainer's replies ---------
    async def run(self) -> RLMResult:
        self.begin()
        while not self.done:
            await self.step()
        return await self.finish()

    def begin(self) -> None:
        """Start the run: run_start in the trace, the opening messages in `messages`, and the REPL
        starting (process, hardening, context load, tools) while the first reply is generated: that
        reply needs only the context's metadata. A child among twenty starting at once, or a 1 GB
        context, no longer delays the first request."""
        self._started = time.perf_counter()
        if self.payload.pending is None:
            self._announce()
        else:  # run_start records the context's sha256: once a writer thread has it, before any other event
            self.payload.when_written(self._announce)
        self._opening = asyncio.create_task(self._open_sandbox(), name=f"recursa-open-{self.run_id}")
        # Its failure is the first step's to report: a run dropped before any step does not log it.
        self._opening.add_done_callback(lambda task: task.cancelled() or task.exception())
        if self.config.max_depth > self.depth:
            # The sub-model's client too (its TLS trust store, tens of ms of CPU in a fresh process),
            # while the first root call is out: a first batch of sub-calls would otherwise wait for it.
            self._warming = asyncio.create_task(self.tree.gateway.warm(self.config.sub_model))
        self.messages = self._opening_messages()
        self._history = list(self.messages)
        self._next_prompt(self.config.max_iterations)

    def _announce(self) -> None:
        """run_start, once (its context's sha256 is "" if the buffer could not be written)."""
        if self._announced:
            return
        self._announced = True
        self.payload.settle()
        self.tree.trace.emit(
            "run_start",
            format=TRACE_FORMAT,
            run_id=self.run_id,
            parent_run_id=self.parent_run_id,
            depth=self.depth,
            question=fold(self.question),
            model=self.model,
            sub_model=self.config.sub_model,
            prompt_variant=self.prompt_variant,
            dialect=self.dialect.name,
            context=self.payload.info.to_trace(),
            config={
                "max_depth": self.config.max_depth,
                "max_iterations": self.config.max_iterations,
                "sandbox": self.config.sandbox,
                "budget": vars(self.config.budget),
            },
        )

    async def _announced_now(self) -> None:
        """run_start before this run's next event, waiting for a context still being written."""
        if not self._announced:
            with contextlib.suppress(Exception):  # a failed write fails the REPL's start, which says why
                await self.payload.ready()
            self._announce()

    def prompt_messages(self) -> list[Message]:
        """What the root's next call is sent: the history and a transient per-turn prompt."""
        return [*self.messages, *self._transient]

    async def step(self, reply: LMResponse | None = None) -> list[Message]:
        """One turn: the root's reply (asked of the root model when `reply` is None; else the one
        given, e.g. a trainer's), its code run, the feedback appended. Returns the messages appended,
        the reply first. What stops the run (an answer, a budget, an error) sets `done`; a
        cancellation or a bug is raised again by `finish()`, once the REPL is closed."""
        if self.done:
            raise RecursaError(
                f"run {self.run_id} has ended ({self.result.stop_reason}); it takes no more turns"
            )
        before = len(self._history)
        try:
            async with asyncio.timeout_at(self.tree.ledger.deadline):
                await self._announced_now()
                if self.turn < self.config.max_iterations:
                    await self._turn(reply)
                else:
                    await self._last_call(reply)
            self.tree.trace.flush()  # the reply's record, if it is still put off (`_reply`)
            if reply is not None and not self.done:
                self._stop_if_spent()
        except (Exception, asyncio.CancelledError) as exc:
            self._fail(exc)
        return self._history[before:]

    def _stop_if_spent(self) -> None:
        """A trainer's reply is never refused, so a budget used up during its turn stops the run
        here, as the refusal of the next root call would in `run()`: the trainer generates no turn
        that could not be followed by any call."""
        limit = self.tree.ledger.used_up()
        if limit is not None:
            cap = getattr(self.config.budget, limit)
            raise BudgetExceeded(limit, f"the budget's «{limit}={cap:g}» is used up")

    def cancel(self, why: str) -> None:
        """Stop the run between turns (its owner gave up on it); `finish()` then closes it."""
        if not self.done:
            self.done = True
            self.result.stop_reason = "cancelled"
            self.result.error = why

    def _fail(self, exc: BaseException) -> None:
        """Why the run stopped; a cancellation or a bug is kept for finish() to raise again."""
        r, self.done = self.result, True
        with contextlib.suppress(Exception):
            self.tree.trace.flush()  # the reply stays recorded (and counted) before what stopped the run
        if isinstance(exc, TimeoutError):
            seconds = self.config.budget.max_seconds
            r.stop_reason, r.error = "timeout", f"the run's time budget of {seconds:g} s ran out"
        elif isinstance(exc, BudgetExceeded):
            r.stop_reason, r.error = ("timeout" if exc.limit == "max_seconds" else "budget"), template_of(exc)
        elif isinstance(exc, ContextLengthError):
            r.stop_reason = "context_window"
            r.error = (
                f"the root's next call does not fit {self.model}'s context window ({template_of(exc)}). The history "
                "could not be compacted further; lower «max_output_chars» or «max_output_tokens», or set "
                "«root_window_tokens» to compact earlier"
            )
        elif isinstance(exc, LMError):
            r.stop_reason, r.error = "error", f"the root model call failed: {template_of(exc)}"
        elif isinstance(exc, SandboxLost):
            r.stop_reason, r.error = "error", template_of(exc)
        elif isinstance(exc, asyncio.CancelledError):
            r.stop_reason, r.error, self._pending = "cancelled", "the run was cancelled", exc
        else:
            r.stop_reason, self._pending = "error", exc
            r.error = template_of(exc) if isinstance(exc, RecursaError) else f"{type(exc).__name__}: {exc}"
        if r.error:  # the settings it names as the caller of this run writes them; no secret
            r.error = self.tree.trace.redact(self.tree.spelling.told(r.error))

    async def finish(self) -> RLMResult:
        """Close the REPL and write run_end (once). Raises again what stopped the run if that was a
        cancellation or a bug: every run that started ends in the trace, whatever stopped it."""
        result = self.result
        if self._finished:
            return result
        self._finished = self.done = True
        pending = self._pending
        if self._warming is not None and not self._warming.done():
            self._warming.cancel()
        opening = self._opening
        if opening is not None:
            if not opening.done():
                opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening  # so the half-started REPL is in self._sandbox and gets closed
        if self._sandbox is not None and self.options.sandbox is None:  # a session's REPL lives on
            sandbox, self._sandbox = self._sandbox, None
            try:
                # Shielded: a second cancellation cannot leave the REPL half closed (aclose waits for it).
                await asyncio.shield(self.tree.release_sandbox(sandbox))
            except asyncio.CancelledError as exc:
                # E.g. a child that stopped on its own deadline is cancelled by its parent's close: the
                # stop reason it already has stays, and the cancellation goes on to the caller.
                pending = pending or exc
            except Exception as exc:
                pending = pending or exc
        try:
            await self._announced_now()
        except asyncio.CancelledError as exc:
            pending = pending or exc
        self._finish(result, self._started)
        if pending is not None:
            if isinstance(pending, asyncio.CancelledError):
                # Whoever cancelled arun() can still read what the run had: stop reason "cancelled",
                # usage so far, a partial answer if the code set one, the trace path.
                pending.partial_result = result  # type: ignore[attr-defined]
            raise pending
        return result

    def abandon(self, why: str) -> None:
        """End the run without an event loop (the finalizer of an episode nobody closed, or
        interpreter exit): run_end in the trace, every REPL process of the tree killed now."""
        if self._finished or self._opening is None:
            return
        if not self.done:
            self.cancel(why)
        self._finished = True
        self._announce()
        # A finalizer may run on any thread: each task is cancelled on its own loop.
        for task in (self._warming, self._opening):
            if task is not None and not task.done():
                with contextlib.suppress(RuntimeError):  # that loop may be closed already
                    task.get_loop().call_soon_threadsafe(task.cancel)
        self._finish(self.result, self._started)
        self.tree.abandon()

    def _finish(self, result: RLMResult, started: float) -> None:
        if result.stop_reason != "final" and not result.answer and self._partial:
            result.answer = result.value = self._partial
            result.answer_protocol = "partial"
        result.duration_s = time.perf_counter() - started
        self.tree.trace.emit(
            "run_end",
            run_id=self.run_id,
            depth=self.depth,
            stop_reason=result.stop_reason,
            answer=fold(result.answer, 20_000),
            answer_protocol=result.answer_protocol,
            iterations=result.iterations,
            usage=self.usage.to_dict(),
            duration_s=round(result.duration_s, 6),
            error=result.error,
            isolation=result.isolation,  # what the sandbox enforced (known once it has started)
        )

    async def _open_sandbox(self) -> tuple[Sandbox, list[str]]:
        """The run's REPL with its context and tools, and any tool set-up problems to report."""
        if self.options.sandbox is not None:  # a session's REPL: context and tools already in place
            self.tree.show_scratch(self.options.sandbox)
            await self._dialect_setup(self.options.sandbox)
            return self.options.sandbox, []
        self._sandbox = sandbox = await self.tree.open_sandbox(self.depth, self.ancestors)
        await start_loaded(sandbox, SubcallHandler(self), self.payload, self.tree.show_scratch)
        problems: list[str] = []
        tools = self.tools()
        if tools:
            problems = await sandbox.define([t.to_worker() for t in tools])
        await self._dialect_setup(sandbox)
        return sandbox, problems

    async def _dialect_setup(self, sandbox: Sandbox) -> None:
        setup = self.dialect.setup_code()
        if setup:
            await sandbox.execute(setup, timeout=self.config.exec_timeout)

    def tools(self) -> list[Tool]:
        """The REPL tools of this run: the root's, and its descendants' unless tools_for_children=False.

        A child RLM is a sub-model too, so it also gets the sub-model tools, called from its code."""
        if self.depth == 0:
            return self.config.tools
        own = self.config.tools if self.config.tools_for_children else []
        names = {t.name for t in own}
        return [*own, *(t for t in self.config.sub_tools if t.name not in names)]

    async def _repl(self) -> list[str]:
        """The REPL, once the first reply needs it; its set-up problems, to tell the model."""
        assert self._opening is not None
        sandbox, problems = await self._opening
        self._sandbox = sandbox
        self.result.isolation = dict(sandbox.isolation)
        return problems

    def _opening_messages(self) -> list[Message]:
        """The dialect's opening: system prompt (template, tools, tips), question and context facts."""
        c = self.config
        settings = PromptSettings(
            max_depth=c.max_depth - self.depth,
            max_output_chars=c.max_output_chars,
            sub_model_chars=c.sub_model_chars,
            tools_text=tools_text(self.tools(), c.sub_tools if c.max_depth > self.depth else []),
            modules=modules_line(c.sandbox, c.sandbox_options),
            models=tuple(c.subcall_models()) if c.allowed_models else (),
        )
        intro = list(self.options.intro)
        if self.options.answer_check is not None:
            intro.append(self.options.answer_check.instructions())
        return self.dialect.opening(
            Opening(
                question=self.question,
                info=self.payload.info,
                settings=settings,
                model=self.model,
                prompt=c.prompt,
                max_iterations=c.max_iterations,
                depth=self.depth,
                subcalls=c.max_depth > self.depth,
                tools=self.tools(),
                sub_tools=tuple(c.sub_tools) if c.max_depth > self.depth else (),
                system_prompt=self.options.system_prompt,
                tips=self.options.tips,
                intro=tuple(intro),
            )
        )

    def _next_prompt(self, left: int) -> None:
        """After the opening and after each turn: the dialect's prompt for the next reply (or, out of
        turns, its message before the last call), kept in the history or shown with one call only."""
        self._transient = []
        n = self.config.max_iterations
        prompt = self.dialect.prompt_for(n - left + 1, n) if left > 0 else self.dialect.last_call(n)
        if prompt is None:
            return
        if left > 0 and self.dialect.turn_prompt == "transient":
            self._transient = [prompt]
        else:
            self._remember(prompt)

    async def _turn(self, given: LMResponse | None) -> None:
        self.turn += 1
        result = self.result
        result.iterations = self.turn
        self.tree.trace.emit("turn", run_id=self.run_id, turn=self.turn)
        if given is None and self._window is not None and self._window.needs_compaction(self.messages):
            self.messages = await self._compact(self.messages, self.turn)
            self._sent = len(self.messages)
        response = await self._reply(given, "root")
        reading = self.dialect.read(response, unfenced_code=self.config.unfenced_code)
        self._remember(reading.message)
        problems = await self._repl() if self.turn == 1 else []
        code = self._code(self.turn)
        try:
            results = await self.dialect.run(reading, code, retry=self.turn < self.config.max_iterations)
        finally:  # also when the run's deadline stops a later block: the partial answer is kept
            if code.partial is not None:
                self._partial = code.partial
        for cell in results:
            if cell.final is None:
                continue
            errors = self._check_answer(result, cell.final)
            if not errors:
                self.done = True
                return
            assert self.options.answer_check is not None
            cell.final, cell.text = None, self.options.answer_check.feedback(errors)
            break
        left = self.config.max_iterations - self.turn
        notes = TurnNotes(self.turn, left, self.config.max_iterations, "\n".join(problems), self._reminder())
        for message in self.dialect.feedback(reading, results, notes):
            self._remember(message)
        if left == 0 and not self.dialect.final_call:  # the dialect stops here, with no answer
            result.stop_reason = "max_iterations"
            self.done = True
            return
        self._next_prompt(left)

    async def _reply(self, given: LMResponse | None, purpose: str) -> LMResponse:
        """The root's next reply: from the root model, or the one given (recorded as the model's)."""
        # A transient prompt is in the trace with this call only, marked so (train/source.py).
        new = [*self.messages[self._sent :], *({**m, "transient": True} for m in self._transient)]
        if given is None:
            response = await self._root_call(self.prompt_messages(), new, purpose)
        else:
            meta = CallMeta(
                call_id=self.new_call_id(), parent_id=self.parent_run_id, depth=self.depth, purpose=purpose
            )
            # Recorded at the loop's next turn: after the reply's cell is sent, while it runs.
            record = self.tree.gateway.record
            self.tree.trace.defer(lambda: record(self.model, given, meta=meta, run_id=self.run_id,
                                                 usage_scopes=self.usage_scopes, trace_messages=new))
            response = given
        self._sent = len(self.messages) + 1  # every message up to this reply is in the trace
        return response

    def _reminder(self) -> str:
        """The question again, at the end of every feedback message: after many turns of output,
        models otherwise answer a question of their own (a long question is cut)."""
        question = " ".join(self.question.split())
        if len(question) > _REMINDER_CHARS:
            question = question[: _REMINDER_CHARS - 5].rstrip() + " ..."
        return f"\n\n(The question you are answering: {question})"

    def _remember(self, message: Message) -> None:
        """Append to the live history (which compaction may shorten) and to the full one."""
        self.messages.append(message)
        self._history.append(message)

    async def _compact(self, messages: list[Message], turn: int) -> list[Message]:
        """Replace older turns with the root's own summary; the full history goes to `root_history`."""
        assert self._window is not None and self._sandbox is not None
        head, middle, kept = split_for_compaction(messages)
        prompt = summary_prompt(head, middle, budget_chars=self._window.window_tokens)
        response = await self._root_response(prompt, prompt, "compact")
        compacted = compacted_history(head, response.text, len(middle), kept)
        await self._sandbox.define([{"name": "root_history", "kind": "value", "value": self._history}])
        self.tree.trace.emit(
            "compact",
            run_id=self.run_id,
            turn=turn,
            compacted_messages=len(middle),
            summary=fold(response.text),
            messages=compacted,  # the history from here on (exporters rebuild prompts from it)
        )
        self._window.record(0, 0, 0)
        return compacted

    async def _root_call(self, messages: list[Message], new: list[Message], purpose: str) -> LMResponse:
        response = await self._root_response(messages, new, purpose, tools=self.dialect.tools())
        if self._window is not None:
            self._window.record(response.input_tokens, response.output_tokens, len(messages) + 1)
        return response

    async def _root_response(
        self,
        messages: list[Message],
        new: list[Message],
        purpose: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> LMResponse:
        meta = CallMeta(call_id=self.new_call_id(), parent_id=self.parent_run_id, depth=self.depth,
                        purpose=purpose)
        response = await self.tree.gateway.call(
            self.model,
            messages,
            meta=meta,
            run_id=self.run_id,
            max_output_tokens=self.config.max_output_tokens,
            usage_scopes=self.usage_scopes,
            trace_messages=new,
            tools=tools,
        )
        return response

    def _code(self, turn: int) -> ReplyCode:
        """What the code of the reply of `turn` runs with (loop/blocks.py)."""
        assert self._sandbox is not None
        c = self.config
        return ReplyCode(
            self._sandbox,
            self.tree.trace,
            self.run_id,
            turn,
            c.exec_timeout,
            c.turn_seconds(),
            c.max_output_chars,
            no_code=self.dialect.no_code,
            beside_code=self.reply_rules.beside_code_taken(),
        )

    async def _last_call(self, given: LMResponse | None) -> None:
        """Out of turns: one more reply, which may only answer."""
        result = self.result
        response = await self._reply(given, "final")
        reading = self.dialect.read(response, unfenced_code=False)
        self._remember(reading.message)
        if self.dialect.forced_answer(reading):  # the whole reply is the answer, as the dialect's peer takes it
            self._accept(result, FinalAnswer(text=response.text, value=response.text, protocol="forced"))
            result.stop_reason = "max_iterations"
            self.done = True
            return
        reply = response.text
        # Any answer the reply wrote counts now, also one the turn would not take ("So the answer is
        # FINAL(42)." or a fenced FINAL): its argument, rather than the whole reply.
        parsed = read_reply(reply, self.reply_rules)
        final: FinalAnswer | None = None
        if parsed.answer is not None:
            resolved = await self._code(self.turn + 1).resolve(parsed.answer.written, retry=False)
            final = resolved if isinstance(resolved, FinalAnswer) else None
        if final is None:
            text = reply.strip()
            final = FinalAnswer(text=text, value=text, protocol="forced")
        errors = self._check_answer(result, final)
        if errors:
            # Out of turns with an answer that does not fit: its text is kept for the user to see, but
            # no value, so code reading result.value never gets an unvalidated object.
            self._accept(result, final)
            result.value = None
            result.error = "the last answer does not match answer_schema: " + "; ".join(errors)
        result.stop_reason = "max_iterations"
        self.done = True

    def _check_answer(self, result: RLMResult, final: FinalAnswer) -> list[str]:
        """Accept `final` ([]), or say what does not fit the answer schema."""
        check = self.options.answer_check
        if check is None:
            self._accept(result, final)
            return []
        value, errors = check.check(final)
        if not errors:
            self._accept(result, FinalAnswer(check.render(value), value, final.protocol, final.var_name))
        return errors

    def _accept(self, result: RLMResult, final: FinalAnswer) -> None:
        result.answer = final.text
        result.value = final.value
        result.answer_protocol = final.protocol
        result.stop_reason = "final"
