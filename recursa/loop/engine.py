"""One RLM run: the root model writes code, the REPL runs it, until an answer comes back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass

from recursa.context import ContextPayload
from recursa.errors import BudgetExceeded, LMError, RecursaError
from recursa.lm.base import CallMeta, LMResponse, Message
from recursa.lm.prices import PriceBook
from recursa.loop.compaction import WindowTracker, compacted_history, split_for_compaction, summary_prompt
from recursa.loop.options import RunOptions
from recursa.loop.output import render_turn
from recursa.loop.parse import ParsedReply, is_identifier, parse_reply
from recursa.loop.prompts import PromptSettings, first_message, system_prompt, template_for, tools_text
from recursa.loop.subcalls import SubcallHandler
from recursa.loop.tree import CallTree, new_id
from recursa.result import RLMResult
from recursa.sandbox.base import ExecResult, FinalAnswer, Sandbox
from recursa.tools.spec import Tool
from recursa.trace.writer import TRACE_FORMAT, fold
from recursa.usage import Usage

# Outputs shown in the trace are folded: the root saw at most max_output_chars of them anyway.
_TRACE_OUTPUT_CHARS = 20_000

NO_CODE_MESSAGE = (
    "Your reply had no ```repl code block and no final answer, so nothing ran. Write code in a "
    "block that starts with ```repl and ends with ``` on a line of its own. When you have the answer, "
    "write it on a line of its own as FINAL(your answer), with the parentheses, or FINAL_VAR(name) "
    "for a variable you already assigned in the REPL."
)
LAST_CALL_MESSAGE = (
    "You have used all {n} turns. No more code will run. Reply now with your final answer on a line "
    "of its own: FINAL(your answer), or FINAL_VAR(variable_name) for a value already in the REPL."
)


@dataclass
class _Outcome:
    final: FinalAnswer | None
    feedback: str | None


class RunEngine:
    def __init__(
        self,
        tree: CallTree,
        prices: PriceBook,
        *,
        question: str,
        payload: ContextPayload,
        depth: int = 0,
        parent_run_id: str | None = None,
        parent_scopes: list[Usage] | None = None,
        run_id: str | None = None,
        options: RunOptions | None = None,
    ) -> None:
        self.tree = tree
        self.prices = prices
        self.config = tree.config
        self.question = question
        self.payload = payload
        self.depth = depth
        self.parent_run_id = parent_run_id
        self.run_id = run_id or new_id("run")
        self.usage = Usage()
        self.usage_scopes = [self.usage, *(parent_scopes or [])]
        self.model = self.config.model_for_depth(depth)
        self._call_ids = itertools.count(1)
        self.options = options or RunOptions()
        self._sandbox: Sandbox | None = None
        self._partial: str | None = None  # answer["content"] set by code but never marked ready
        self._window = (
            WindowTracker(self.config.root_window_tokens) if self.config.root_window_tokens else None
        )
        self._history: list[Message] = []  # every root message, also after compactions

    def new_call_id(self) -> str:
        return f"{self.run_id}.c{next(self._call_ids)}"

    async def spawn_child(self, question: str, payload: ContextPayload) -> RLMResult:
        child = RunEngine(
            self.tree,
            self.prices,
            question=question,
            payload=payload,
            depth=self.depth + 1,
            parent_run_id=self.run_id,
            parent_scopes=self.usage_scopes,
            options=self.options.for_child(),
        )
        try:
            async with self.tree.child_slots(child.depth):
                return await child.run()
        finally:
            payload.close()

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> RLMResult:
        started = time.perf_counter()
        trace = self.tree.trace
        trace.emit(
            "run_start",
            format=TRACE_FORMAT,
            run_id=self.run_id,
            parent_run_id=self.parent_run_id,
            depth=self.depth,
            question=fold(self.question),
            model=self.model,
            sub_model=self.config.sub_model,
            context=self.payload.info.to_trace(),
            config={
                "max_depth": self.config.max_depth,
                "max_iterations": self.config.max_iterations,
                "sandbox": self.config.sandbox,
                "budget": vars(self.config.budget),
            },
        )
        result = RLMResult(
            answer="",
            value=None,
            usage=self.usage,
            stop_reason="error",
            iterations=0,
            trace_path=trace.path,
            run_id=self.run_id,
            skipped_files=list(self.payload.info.skipped_files),
        )
        # Raised again once the REPL is closed and run_end is written: every run that started ends
        # in the trace, whether it was cancelled, hit a bug, or is cancelled while closing.
        pending: BaseException | None = None
        try:
            deadline = self.tree.ledger.deadline
            async with asyncio.timeout_at(deadline):
                await self._loop(result)
        except TimeoutError:
            result.stop_reason = "timeout"
            result.error = f"the run's time budget of {self.config.budget.max_seconds:g} s ran out"
        except BudgetExceeded as exc:
            result.stop_reason = "timeout" if exc.limit == "max_seconds" else "budget"
            result.error = str(exc)
        except LMError as exc:
            result.stop_reason = "error"
            result.error = f"the root model call failed: {exc}"
        except asyncio.CancelledError as exc:
            result.stop_reason = "cancelled"
            result.error = "the run was cancelled"
            pending = exc
        except Exception as exc:  # a sandbox that cannot start, a bug: still a complete trace
            result.stop_reason = "error"
            result.error = str(exc) if isinstance(exc, RecursaError) else f"{type(exc).__name__}: {exc}"
            pending = exc
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
        self._finish(result, started)
        if pending is not None:
            if isinstance(pending, asyncio.CancelledError):
                # Whoever cancelled arun() can still read what the run had: stop reason "cancelled",
                # usage so far, a partial answer if the code set one, the trace path.
                pending.partial_result = result  # type: ignore[attr-defined]
            raise pending
        return result

    def _finish(self, result: RLMResult, started: float) -> None:
        if result.stop_reason not in ("final", "max_iterations") and not result.answer and self._partial:
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
            return self.options.sandbox, []
        sandbox = self.tree.new_sandbox()
        self._sandbox = sandbox
        await sandbox.start(SubcallHandler(self))
        await sandbox.load_context(self.payload)
        problems: list[str] = []
        tools = self.tools()
        if tools:
            problems = await sandbox.define([t.to_worker() for t in tools])
        return sandbox, problems

    def tools(self) -> list[Tool]:
        """The REPL tools of this run: the root's, and its descendants' unless tools_for_children=False.

        A child RLM is a sub-model too, so it also gets the sub-model tools, called from its code."""
        if self.depth == 0:
            return self.config.tools
        own = self.config.tools if self.config.tools_for_children else []
        names = {t.name for t in own}
        return [*own, *(t for t in self.config.sub_tools if t.name not in names)]

    async def _loop(self, result: RLMResult) -> None:
        # The REPL starts (process, hardening, context load, tools) while the first model call is in
        # flight: that call needs only the context's metadata. A child RLM among twenty starting at
        # once, or a 1 GB context, no longer delays the first request.
        opening = asyncio.create_task(self._open_sandbox(), name=f"recursa-open-{self.run_id}")
        # The sub-model's client too (SDK and HTTP imports, ~0.1 s in a fresh process): a first
        # batch of sub-calls would otherwise pay for it inside its first requests.
        warming = None
        if self.config.max_depth > self.depth:
            warming = asyncio.create_task(self.tree.gateway.warm(self.config.sub_model))
        try:
            await self._turns(result, opening)
        finally:
            if warming is not None and not warming.done():
                warming.cancel()
            if not opening.done():
                opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening  # so run() finds the half-started REPL in self._sandbox and closes it

    async def _repl(self, result: RLMResult, opening: asyncio.Task[tuple[Sandbox, list[str]]]) -> list[str]:
        """The REPL, once the first reply needs it; its set-up problems, to tell the model."""
        sandbox, problems = await opening
        self._sandbox = sandbox
        result.isolation = dict(sandbox.isolation)
        return problems

    def _opening_messages(self) -> list[Message]:
        """The system prompt (template, tools, tips) and the first message (question, context facts)."""
        settings = PromptSettings(
            max_depth=self.config.max_depth - self.depth,
            max_output_chars=self.config.max_output_chars,
            sub_model_chars=self.config.sub_model_chars,
            tools_text=tools_text(
                self.tools(), self.config.sub_tools if self.config.max_depth > self.depth else []
            ),
        )
        template = template_for(self.model, self.config.prompt)
        system = system_prompt(template, self.payload.info, settings)
        if self.options.tips:
            system += "\n\nTips for this task:\n" + self.options.tips.strip()
        first = first_message(self.question, self.payload.info)
        extra = list(self.options.intro)
        if self.options.answer_check is not None:
            extra.append(self.options.answer_check.instructions())
        if extra:
            first += "\n\n" + "\n\n".join(extra)
        return [{"role": "system", "content": system}, {"role": "user", "content": first}]

    async def _turns(self, result: RLMResult, opening: asyncio.Task[tuple[Sandbox, list[str]]]) -> None:
        messages = self._opening_messages()
        self._history = list(messages)
        sent = 0  # messages already stored in the trace: each is written once, not per turn
        for turn in range(1, self.config.max_iterations + 1):
            result.iterations = turn
            self.tree.trace.emit("turn", run_id=self.run_id, turn=turn)
            if self._window is not None and self._window.needs_compaction(messages):
                messages = await self._compact(messages, turn)
                sent = len(messages)
            reply = await self._root_call(messages, messages[sent:], "root")
            sent = len(messages) + 1
            self._remember({"role": "assistant", "content": reply}, messages)
            problems = await self._repl(result, opening) if turn == 1 else []
            outcome = await self._act(parse_reply(reply), turn)
            if problems:
                outcome.feedback = "\n".join(problems) + "\n\n" + (outcome.feedback or NO_CODE_MESSAGE)
            if outcome.final is not None:
                errors = self._check_answer(result, outcome.final)
                if not errors:
                    return
                assert self.options.answer_check is not None
                outcome.feedback = self.options.answer_check.feedback(errors)
            feedback = outcome.feedback or NO_CODE_MESSAGE
            left = self.config.max_iterations - turn
            if 0 < left <= 3:
                feedback += f"\n\n[{left} turn{'s' if left > 1 else ''} left]"
            self._remember({"role": "user", "content": feedback}, messages)
        await self._last_call(result, messages, sent)

    def _remember(self, message: Message, messages: list[Message]) -> None:
        """Append to the live history (which compaction may shorten) and to the full one."""
        messages.append(message)
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

    async def _root_call(self, messages: list[Message], new: list[Message], purpose: str) -> str:
        response = await self._root_response(messages, new, purpose)
        if self._window is not None:
            self._window.record(response.input_tokens, response.output_tokens, len(messages) + 1)
        return response.text

    async def _root_response(self, messages: list[Message], new: list[Message], purpose: str) -> LMResponse:
        meta = CallMeta(
            call_id=self.new_call_id(),
            parent_id=self.parent_run_id,
            depth=self.depth,
            purpose=purpose,
        )
        response = await self.tree.gateway.call(
            self.model,
            messages,
            meta=meta,
            run_id=self.run_id,
            max_output_tokens=self.config.max_output_tokens,
            usage_scopes=self.usage_scopes,
            trace_messages=new,
        )
        return response

    async def _last_call(self, result: RLMResult, messages: list[Message], sent: int) -> None:
        """Out of turns: one more call that may only answer."""
        self._remember(
            {"role": "user", "content": LAST_CALL_MESSAGE.format(n=self.config.max_iterations)}, messages
        )
        reply = await self._root_call(messages, messages[sent:], "final")
        parsed = parse_reply(reply)
        final: FinalAnswer | None = None
        if parsed.prose_final is not None:
            final = await self._resolve_prose_final(parsed)
        if final is None:
            text = reply.strip()
            final = FinalAnswer(text=text, value=text, protocol="forced")
        errors = self._check_answer(result, final)
        if errors:  # out of turns: hand back what came, and say it does not fit
            self._accept(result, final)
            result.error = "the last answer does not match answer_schema: " + errors[0]
        result.stop_reason = "max_iterations"

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

    # -- one reply -----------------------------------------------------------------------------
    async def _act(self, parsed: ParsedReply, turn: int) -> _Outcome:
        outcome = await self._run_reply(parsed, turn)
        if parsed.notes and outcome.final is None:
            outcome.feedback = (outcome.feedback or NO_CODE_MESSAGE) + "".join(
                f"\n\n[note] {note}" for note in parsed.notes
            )
        return outcome

    async def _run_reply(self, parsed: ParsedReply, turn: int) -> _Outcome:
        if not parsed.code_blocks:
            if parsed.prose_final is None:
                return _Outcome(None, NO_CODE_MESSAGE + _fence_hint(parsed))
            final = await self._resolve_prose_final(parsed)
            if final is not None:
                return _Outcome(final, None)
            return _Outcome(None, await self._missing_variable_message(parsed.prose_final.text))
        assert self._sandbox is not None
        results: list[ExecResult] = []
        for index, code in enumerate(parsed.code_blocks, 1):
            res = await self._sandbox.execute(code, timeout=self.config.exec_timeout)
            self.tree.trace.emit(
                "exec",
                run_id=self.run_id,
                turn=turn,
                block=index,
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
            )
            results.append(res)
            if res.partial is not None:
                self._partial = res.partial
            if res.final is not None:
                return _Outcome(res.final, None)
        feedback = "REPL output:\n" + render_turn(results, self.config.max_output_chars)
        if parsed.prose_final is not None:
            feedback += (
                f"\n\n[note] Your reply also wrote {parsed.prose_final.protocol}(...) next to code whose "
                "output you had not seen, so it was not accepted. If the output above confirms it, "
                "give the answer again in your next reply, with no code beside it."
            )
        return _Outcome(None, feedback)

    async def _resolve_prose_final(self, parsed: ParsedReply) -> FinalAnswer | None:
        prose = parsed.prose_final
        assert prose is not None
        assert self._sandbox is not None
        if prose.protocol == "FINAL":
            # "FINAL result" (no parentheses) naming a variable the code made means that variable.
            if prose.loose and is_identifier(prose.text):
                found = await self._sandbox.get_variable(prose.text)
                if found is not None:
                    found.protocol, found.var_name = "FINAL_VAR", prose.text
                    return found
            return FinalAnswer(text=prose.text, value=prose.text, protocol="FINAL")
        if not is_identifier(prose.text):
            return None
        final = await self._sandbox.get_variable(prose.text)
        if final is not None:
            final.protocol, final.var_name = "FINAL_VAR", prose.text
        return final

    async def _missing_variable_message(self, name: str) -> str:
        assert self._sandbox is not None
        if not is_identifier(name):
            return (
                f"FINAL_VAR({name}) is not an answer: FINAL_VAR takes the name of a variable, not an "
                f"expression. Assign the value to a variable in a ```repl block first (answer_text = "
                f"{name}), then write FINAL_VAR(answer_text) in your next reply."
            )
        names = await self._sandbox.variable_names()
        listed = ", ".join(names[:30]) if names else "none yet"
        return (
            f"FINAL_VAR({name}) names no variable in the REPL (defined: {listed}). Assign the answer "
            f"to a variable in a ```repl block first, or write FINAL(your answer) for literal text."
        )


def _fence_hint(parsed: ParsedReply) -> str:
    """Why fenced code in the reply did not run, when it had some."""
    if not parsed.unlabeled_blocks:
        return ""
    tags = sorted({f"```{t}" for t in parsed.other_tags if t})
    bare = sum(1 for t in parsed.other_tags if not t)
    kinds = ", ".join([*tags, *(["a bare ```"] if bare else [])])
    return (
        f" (Your reply had {parsed.unlabeled_blocks} fenced block(s) ({kinds}) that did not run: only "
        "blocks opened with ```repl or ```python run.)"
    )
