"""recursa's own conversation (the default dialect): code in ```repl blocks, answers by FINAL,
FINAL_VAR or the `answer` dict, feedback as one user message that ends with the question again.

A root that calls tools natively anyway (a server's tool parser turned a Hermes <tool_call> into
`tool_calls`) is not dropped: a call whose arguments hold code runs as a cell and is answered as
that call's tool result, as in the "tools" dialect.
"""

from __future__ import annotations

from typing import Any, ClassVar

from recursa.lm.base import LMResponse, Message
from recursa.loop.cleaning import CODE_ARGUMENTS
from recursa.loop.dialects.base import (
    Cell,
    CellResult,
    Opening,
    Reading,
    Runner,
    TurnNotes,
    TurnPromptKind,
    assistant_message,
    run_in_order,
)
from recursa.loop.feedback import LAST_CALL_MESSAGE, NO_CODE_MESSAGE
from recursa.loop.parse import Reply, read_reply
from recursa.loop.prompts import first_message, system_prompt, template_for
from recursa.loop.rules import DEFAULT_RULES, ReplyRules, named_rules, rules_of


class RecursaDialect:
    name: ClassVar[str] = "recursa"
    turn_prompt: TurnPromptKind = "kept"
    final_call = True
    no_code = NO_CODE_MESSAGE
    # The rules its text replies are read by (recursa/loop/rules.py): a dialect built on this one
    # chooses its own (ReplyRules().without(...), .adding(...), beside_code=...).
    rules: ReplyRules = DEFAULT_RULES

    def __init__(self, reply_rules: ReplyRules | str = "default") -> None:
        """`reply_rules`: "default", "strict" (the paper's protocol only) or a ReplyRules."""
        self.rules = named_rules(reply_rules)

    def tools(self) -> list[dict[str, Any]] | None:
        return None

    def setup_code(self) -> str:
        return ""

    def template(self, o: Opening) -> str:
        return template_for(o.model, o.prompt)

    def opening(self, o: Opening) -> list[Message]:
        """The system prompt (template, tools, tips) and the first message (question, context facts)."""
        if o.system_prompt is not None:
            system = o.system_prompt
        else:
            system = system_prompt(self.template(o), o.info, o.settings)
        if o.tips:
            system += "\n\nTips for this task:\n" + o.tips.strip()
        first = first_message(o.question, o.info)
        if o.intro:
            first += "\n\n" + "\n\n".join(o.intro)
        return [{"role": "system", "content": system}, {"role": "user", "content": first}]

    def prompt_for(self, turn: int, max_iterations: int) -> Message | None:
        return None

    def read(self, response: LMResponse, *, unfenced_code: bool) -> Reading:
        message = assistant_message(response)
        if response.tool_calls:
            return Reading(message, [self._call_cell(c) for c in response.tool_calls], response.text)
        if not response.text.strip():
            return Reading(message, [], response.text)
        rules = rules_of(self, unfenced_code=unfenced_code)
        return Reading(message, [Cell(read_reply(response.text, rules))], response.text)

    def _call_cell(self, call: Any) -> Cell:
        """A tool call as a cell: its code, or (no code in it) a cell that only says why."""
        code = next((call.arguments[k] for k in CODE_ARGUMENTS if isinstance(call.arguments.get(k), str)), None)
        if call.error or code is None:
            why = call.error or "its arguments hold no code (pass it as `code`)"
            return Cell(Reply([]), call, refused=f"Your call of {call.name!r} did not run: {why}.")
        return Cell(Reply([code]), call)

    async def run(self, reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]:
        return await run_in_order(reading, runner, retry=retry)

    def feedback(self, reading: Reading, results: list[CellResult], notes: TurnNotes) -> list[Message]:
        tail = self.tail(notes)
        if any(r.cell.call is not None for r in results):
            return self.tool_results(results, notes.extra, tail)
        if results:
            text = results[0].text or self.no_code
        else:
            text = "Your reply was empty. " + self.no_code
        if notes.extra:
            text = notes.extra + "\n\n" + text
        return [{"role": "user", "content": text + tail}]

    def tool_results(self, results: list[CellResult], extra: str, tail: str) -> list[Message]:
        """One tool message per call, in order; what the engine adds goes into the last one."""
        out: list[Message] = []
        for r in results:
            assert r.cell.call is not None
            text = r.text if r.text is not None else "(not run: an earlier call in this reply ended the turn)"
            out.append({"role": "tool", "tool_call_id": r.cell.call.id, "name": r.cell.call.name, "content": text})
        if extra:
            out[0]["content"] = extra + "\n\n" + out[0]["content"]
        out[-1]["content"] += tail
        return out

    def tail(self, notes: TurnNotes) -> str:
        """Turns left, the last call's instruction, and the question again."""
        text = ""
        if 0 < notes.left <= 3:
            text += f"\n\n[{notes.left} turn{'s' if notes.left > 1 else ''} left]"
        if notes.left == 0:  # out of turns: the next reply may only answer
            # Said in the same message: chat templates such as Gemma's refuse two user turns in a row.
            text += "\n\n" + LAST_CALL_MESSAGE.format(n=notes.max_iterations)
        return text + notes.reminder

    def last_call(self, max_iterations: int) -> Message | None:
        return None

    def forced_answer(self, reading: Reading) -> bool:
        return False
