"""The conversation as one part: a `Dialect` decides everything the root sees and how what it
writes is read. The engine, the sandbox, budgets, traces and sub-calls are the same under all.

A dialect owns: the opening messages (system prompt, first user message, context metadata), a
per-turn prompt (kept in the history, or shown for one call only), the tools offered on root
requests (native tool calling), how a reply becomes cells of code, which answers end the run,
how outputs go back, and what the forced last call looks like. The engine asks it at each of
those points and does the rest (timing, budgets, answer checks, traces) the same way for all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from recursa.context import ContextInfo
from recursa.lm.base import LMResponse, Message, ToolCall
from recursa.loop.blocks import Outcome
from recursa.loop.parse import Reply
from recursa.loop.prompts import PromptSettings
from recursa.sandbox.base import ExecResult, FinalAnswer
from recursa.tools.spec import Tool

# A dialect's per-turn prompt is "kept" in the history (the official package appends it for
# good), or "transient": shown at the end of one request only and gone from the next (SkyRL pops
# it from the generator's history before the turn's messages are appended).
TurnPromptKind = Literal["kept", "transient"]


@dataclass(frozen=True)
class Opening:
    """What a dialect may say in its opening messages."""

    question: str
    info: ContextInfo
    settings: PromptSettings
    model: str
    prompt: Any  # RLM(prompt=...): a built-in template name or a file, or None
    max_iterations: int
    depth: int
    subcalls: bool  # code can call models (max_depth above this run's depth)
    tools: Sequence[Tool] = ()
    sub_tools: Sequence[Tool] = ()  # the tools sub-models call (RLM(sub_tools=...)), when code can call models
    system_prompt: str | None = None  # the caller's whole system message instead of the dialect's
    tips: str | None = None
    intro: tuple[str, ...] = ()  # extra paragraphs for the first message (a session's, a schema's)


@dataclass
class Cell:
    """Code of one reply to run: a parsed text reply (its blocks, its prose answer) or the code of
    one native tool call, whose result goes back with `call.id`."""

    parsed: Reply
    call: ToolCall | None = None
    refused: str | None = None  # why this call does not run (a wrong tool, no code): told as its result


@dataclass
class Reading:
    """A reply read: the assistant message kept in the history, and its cells in order."""

    message: Message
    cells: list[Cell]
    text: str = ""


@dataclass
class CellResult:
    """What one cell came to: an answer, or what the model is told (None: it did not run)."""

    cell: Cell
    final: FinalAnswer | None
    text: str | None


@dataclass(frozen=True)
class TurnNotes:
    """What the engine adds to a turn's feedback, for the dialect to place (or leave out)."""

    turn: int
    left: int  # code turns left after this one
    max_iterations: int
    extra: str = ""  # set-up problems of the REPL's tools; an answer that did not fit the schema
    reminder: str = ""  # the question again


class Runner(Protocol):
    """What a dialect runs a reply's cells with (loop/blocks.ReplyCode): recursa's rules for a
    parsed reply, or one raw cell for a dialect with rules of its own."""

    max_output_chars: int  # the run's cap on the output of a cell shown to the model

    async def run(self, parsed: Reply, *, retry: bool, call_id: str | None = None) -> Outcome: ...

    async def execute(self, code: str, *, call_id: str | None = None, shown: str | None = None) -> ExecResult: ...

    async def names(self) -> list[str]: ...

    async def value(self, name: str) -> FinalAnswer | None: ...


class Dialect(Protocol):
    name: str
    turn_prompt: TurnPromptKind
    final_call: bool  # out of turns, one more call asks for the answer (False: the run just stops)
    no_code: str  # what a reply with no code and no answer is told (recursa's rules)

    def tools(self) -> list[dict[str, Any]] | None:
        """Tools offered on every root request ({"name", "description", "parameters"}), or None."""
        ...

    def setup_code(self) -> str:
        """Code run once in a fresh REPL before the first reply (aliases of `context`); "" for none."""
        ...

    def opening(self, o: Opening) -> list[Message]: ...

    def prompt_for(self, turn: int, max_iterations: int) -> Message | None:
        """The prompt before the root's reply of `turn` (1-based), or None."""
        ...

    def read(self, response: LMResponse, *, unfenced_code: bool) -> Reading: ...

    async def run(self, reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]: ...

    def feedback(self, reading: Reading, results: list[CellResult], notes: TurnNotes) -> list[Message]:
        """The messages after a reply that did not end the run."""
        ...

    def last_call(self, max_iterations: int) -> Message | None:
        """A message appended before the forced last call (None: the last feedback said it)."""
        ...

    def forced_answer(self, reading: Reading) -> bool:
        """Whether the last call's whole reply is the answer, with no FINAL looked for."""
        ...


# -- shared pieces -------------------------------------------------------------------------------


def assistant_message(response: LMResponse) -> Message:
    """The reply as kept in the history: its text, and its tool calls in recursa's neutral shape
    (recursa/lm/tool_format.py), so a provider or an exporter writes them in its own format."""
    message: Message = {"role": "assistant", "content": response.text}
    if response.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in response.tool_calls
        ]
    return message


async def run_in_order(reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]:
    """Run the cells one after another with recursa's rules; an answer stops the rest (they are
    returned unrun, text None, so each tool call is still answered)."""
    results: list[CellResult] = []
    ended = False
    for cell in reading.cells:
        if ended or cell.refused is not None:
            results.append(CellResult(cell, None, cell.refused))
            continue
        call_id = cell.call.id if cell.call is not None else None
        outcome = await runner.run(cell.parsed, retry=retry, call_id=call_id)
        results.append(CellResult(cell, outcome.final, outcome.feedback))
        ended = outcome.final is not None
    return results


class PeerNames:
    """The variables a peer's REPL lists after a cell (rlms, SkyRL): its own names first (`first`),
    then the rest in the order the code made them. Those REPLs keep a cell's names only when it ran
    to the end, so after an exception the list is the one before it."""

    def __init__(self, first: Sequence[str], hidden: Sequence[str] = ()) -> None:
        self.first = tuple(first)
        self.hidden = set(hidden) | set(first)  # recursa's own names the peer's REPL does not have
        self.names: list[str] | None = None

    async def after(self, res: ExecResult, runner: Runner) -> list[str]:
        if not res.error or self.names is None:
            made = await runner.names()
            self.names = [*self.first, *(n for n in made if n not in self.hidden)]
        return self.names


def tool_schema(name: str, argument: str, description: str) -> dict[str, Any]:
    """A code tool: one required string argument holding Python."""
    return {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {argument: {"type": "string", "description": "Python code to run in the REPL."}},
            "required": [argument],
        },
    }


def call_code(call: ToolCall, name: str, argument: str) -> tuple[str | None, str | None]:
    """(code, None) for a call of the code tool, or (None, what was wrong) to tell the model."""
    if call.error:
        return None, f"The call was not run: {call.error}."
    if call.name != name:
        return None, f"There is no tool named {call.name!r}; the only tool is {name!r}."
    code = call.arguments.get(argument)
    if not isinstance(code, str):
        got = json.dumps(sorted(call.arguments))
        return None, f"The call was not run: {name} takes one string argument {argument!r} (got {got})."
    return code, None
