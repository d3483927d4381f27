"""`codeact`, `codeact-bm25`, `codeact-subcalls`: a ReAct loop that runs Python code.

Unlike an RLM, CodeAct keeps the context in its prompt (cut to the model's window, with a note)
and its code environment does not hold it. `codeact-bm25` adds `search(query, k)` over the whole
context, answered on the host by a BM25 index (`bm25s`); `codeact-subcalls` adds `llm_query` and
`llm_query_batched` to the code. The REPL is the same hardened sandbox an RLM uses; `search` is a
host tool (`recursa.host_tool`) the REPL calls over the request channel, as in an RLM.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from recursa.context import build_payload, context_text
from recursa.errors import BudgetExceeded, LMError
from recursa.lm.base import Message
from recursa.loop.blocks import ReplyClock
from recursa.loop.feedback import why_stop_after
from recursa.loop.output import render_turn
from recursa.loop.parse import read_reply
from recursa.loop.rules import rules_of
from recursa.methods.base import MethodResult, MethodSettings
from recursa.methods.base_model import fit_to_window
from recursa.methods.prompts import (
    CODEACT_SYSTEM,
    TOOL_PYTHON,
    TOOL_SEARCH,
    TOOL_SUBCALLS,
    context_block,
    task_block,
)
from recursa.methods.search import passage_search
from recursa.methods.session import BaselineRun
from recursa.sandbox.base import CallbackError, ExecResult, Sandbox, start_loaded
from recursa.tasks.base import Task
from recursa.tools.runner import ToolFailure

# The baseline as published reads fenced code only.
_FENCED_ONLY = rules_of(None, unfenced_code=False)
_PLACEHOLDER = "(CodeAct keeps the text in its prompt; the code environment does not have it.)"
_NO_CODE = (
    "Your reply had no ```repl code block and no final answer. Write code in a ```repl block, or "
    "answer with FINAL(your answer)."
)


@dataclass
class CodeAct:
    name: str = "codeact"
    search: bool = False
    subcalls: bool = False

    async def run(self, task: Task, settings: MethodSettings) -> MethodResult:
        # Indexing a large context takes a while: off the event loop, so other rows run on.
        host_tools = [await asyncio.to_thread(passage_search, task.context)] if self.search else []
        text, _cut = fit_to_window(context_text(task.context), settings.window(), reserve=40_000)
        tools = (
            [TOOL_PYTHON]
            + ([TOOL_SEARCH] if self.search else [])
            + ([TOOL_SUBCALLS] if self.subcalls else [])
        )
        messages: list[Message] = [
            {"role": "system", "content": CODEACT_SYSTEM.format(tools="\n".join(tools))},
            {"role": "user", "content": context_block(text) + "\n\n" + task_block(task.question)},
        ]
        async with BaselineRun(settings, self.name, task.question, tools=host_tools) as run:
            assert run.tree is not None
            sandbox = run.tree.new_sandbox()
            try:
                payload = build_payload(_PLACEHOLDER)
                try:
                    await start_loaded(sandbox, self._handler(run), payload)
                finally:
                    payload.close()
                if run.config.tools:
                    await sandbox.define([t.to_worker() for t in run.config.tools])
                return await self._loop(run, sandbox, messages)
            except (BudgetExceeded, LMError) as exc:
                return run.call_failed(exc, "the prompt")
            finally:
                await run.tree.release_sandbox(sandbox)

    async def _loop(self, run: BaselineRun, sandbox: Sandbox, messages: list[Message]) -> MethodResult:
        sent = 0
        for turn in range(1, run.config.max_iterations + 1):
            reply = await run.call(messages, new=messages[sent:])
            sent = len(messages) + 1
            messages.append({"role": "assistant", "content": reply})
            parsed = read_reply(reply, _FENCED_ONLY)
            if not parsed.code:
                final = parsed.turn_answer
                if final is not None and final.protocol == "FINAL":
                    return run.result(final.text)
                if final is not None:
                    # Its text is the value's __str__, model code: the step's time for code bounds it.
                    seconds = min(run.config.exec_timeout, run.config.turn_seconds())
                    found = await sandbox.get_variable(final.text, timeout=seconds)
                    if found is not None:
                        return run.result(found.text)
                messages.append({"role": "user", "content": _NO_CODE})
                continue
            results: list[ExecResult] = []
            # One clock for the step's blocks, as for an RLM's reply (recursa/loop/blocks.py).
            clock = ReplyClock(run.config.turn_seconds())
            exec_timeout = run.config.exec_timeout
            for index, code in enumerate(parsed.code, 1):
                timeout = clock.timeout(exec_timeout)
                res = await sandbox.execute(code, timeout=timeout)
                ran_out = clock.out_of_time(res, timeout, exec_timeout)
                left = len(parsed.code) - index
                stop = why_stop_after(res, False, left, out_of_reply_time=ran_out)
                if stop is not None:
                    res.notes.append(stop)
                run.emit(
                    "exec",
                    turn=turn,
                    block=index,
                    code=code,
                    stdout=res.stdout[:20_000],
                    error=res.error,
                    timed_out=res.timed_out,
                    notes=res.notes,
                )
                results.append(res)
                if res.final is not None:
                    return run.result(res.final.text)
                if stop is not None:
                    break
            messages.append({"role": "user", "content": "Output:\n" + render_turn(results, 20_000)})
        return run.result(
            "", stop_reason="max_iterations", error=f"no answer after {run.config.max_iterations} steps"
        )

    def _handler(self, run: BaselineRun) -> Any:
        subcalls = self.subcalls

        async def handle(fn: str, args: dict[str, Any]) -> Any:
            if fn == "tool":
                return await _host_tool(run, args)
            if not subcalls or fn not in ("llm_query", "llm_query_batched"):
                raise CallbackError("SubcallError", f"{fn} is not available to this agent")
            prompts = [args.get("prompt")] if fn == "llm_query" else list(args.get("prompts") or [])
            if not all(isinstance(p, str) for p in prompts):
                raise CallbackError("TypeError", f"{fn} takes str prompts")

            async def one(prompt: str) -> str:
                try:
                    return await run.call([{"role": "user", "content": prompt}], sub=True)
                except BudgetExceeded as exc:
                    raise CallbackError("BudgetExceeded", str(exc)) from None
                except LMError as exc:
                    raise CallbackError("SubcallError", str(exc)) from None

            answers = await asyncio.gather(*(one(p) for p in prompts))
            return answers[0] if fn == "llm_query" else list(answers)

        return handle


async def _host_tool(run: BaselineRun, args: dict[str, Any]) -> Any:
    """A REPL call of a host tool (`search`), on the run's tool runner; failures reach the code."""
    assert run.tree is not None
    name = str(args.get("name"))
    call_args, call_kwargs = args.get("args") or [], args.get("kwargs") or {}
    if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
        raise CallbackError("TypeError", f"{name}: malformed tool call from the REPL")
    started = time.perf_counter()
    try:
        value = await run.tree.tool_runner.call(name, call_args, call_kwargs)
    except ToolFailure as exc:
        run.emit("tool_call", tool=name, where="host", caller="repl", error=str(exc))
        raise CallbackError("ToolError", str(exc)) from None
    hits = len(value) if isinstance(value, list) else None
    duration = round(time.perf_counter() - started, 6)
    run.emit("tool_call", tool=name, where="host", caller="repl", hits=hits, duration_s=duration, error=None)
    return value
