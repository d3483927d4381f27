"""The official `rlms` package's conversation, exactly (docs/dialects.md, "rlms").

Every text comes from the installed package at run time (`pip install 'recursa[rlms]'`; recursa
ships no copy): its system prompt and orchestrator addendum, the context metadata message, the
"Turn i/N" prompt before each reply, the formatting of code outputs (its `format_iteration`, with
the REPL's variables listed), the ```repl fence rule, and the message before the last call. The
answer protocol is the package's: `answer["content"]` and `answer["ready"] = True` in code; out of
turns, the last reply is the answer as it is. tests/test_dialect_rlms.py runs the same replies
through the package itself and through recursa and compares every request.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

from recursa.errors import ConfigError
from recursa.lm.base import LMResponse, Message
from recursa.loop.dialects.base import (
    Cell,
    CellResult,
    Opening,
    PeerNames,
    Reading,
    Runner,
    TurnNotes,
    TurnPromptKind,
)
from recursa.loop.parse import Reply
from recursa.sandbox.base import ExecResult

INSTALL = "pip install 'recursa[rlms]' (the official package, rlms==0.1.3)"


def load_rlms() -> SimpleNamespace:
    """The official package's prompt and parsing modules, or a ConfigError naming the extra."""
    try:
        from rlm.core import types
        from rlm.core.rlm import RLM
        from rlm.utils import parsing, prompts
    except ImportError as exc:
        raise ConfigError(f"the 'rlms' dialect reads the official package's texts, which is not installed ({exc}); {INSTALL}") from None
    return SimpleNamespace(types=types, parsing=parsing, prompts=prompts, RLM=RLM)


class RlmsDialect:
    name: ClassVar[str] = "rlms"
    turn_prompt: TurnPromptKind = "kept"
    final_call = True
    no_code = ""  # the package says nothing after a reply without code: the next turn's prompt follows

    def __init__(self, orchestrator: bool = True) -> None:
        self.rlm = load_rlms()
        self.orchestrator = bool(orchestrator)
        self._last_call = _default_answer_message(self.rlm)
        self._names = PeerNames(("answer", "context_0", "context"))

    def tools(self) -> list[dict[str, Any]] | None:
        return None

    def setup_code(self) -> str:
        return "context_0 = context"  # the package's REPL holds the context under both names

    def opening(self, o: Opening) -> list[Message]:
        info = o.info
        metadata = SimpleNamespace(
            context_type=info.type_name,
            context_total_length=info.total_chars,
            context_lengths=list(info.chunk_lengths) or [info.total_chars],
        )
        tools = {t.name: {"tool": t.fn, "description": t.doc} for t in o.tools} or None
        template = o.system_prompt if o.system_prompt is not None else self.rlm.prompts.RLM_SYSTEM_PROMPT
        messages: list[Message] = self.rlm.prompts.build_rlm_system_prompt(
            system_prompt=template,
            query_metadata=metadata,
            custom_tools=tools,
            root_prompt=o.question,
            orchestrator=self.orchestrator,
        )
        # recursa's own additions, off unless asked for: tips and a typed answer's instructions.
        if o.tips:
            messages[0]["content"] += "\n\nTips for this task:\n" + o.tips.strip()
        if o.intro:
            messages[1]["content"] += "\n\n" + "\n\n".join(o.intro)
        return messages

    def prompt_for(self, turn: int, max_iterations: int) -> Message | None:
        return dict(self.rlm.prompts.build_user_prompt(None, turn - 1, max_iterations=max_iterations))

    def read(self, response: LMResponse, *, unfenced_code: bool) -> Reading:
        blocks = self.rlm.parsing.find_code_blocks(response.text)
        cells = [Cell(Reply(blocks))] if blocks else []
        return Reading({"role": "assistant", "content": response.text}, cells, response.text)

    async def run(self, reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]:
        """Every block in order, each output formatted by the package; the first block that set
        `answer["ready"]` answers (recursa's FINAL functions are not the package's protocol)."""
        if not reading.cells:
            return []
        types = self.rlm.types
        blocks = []
        for code in reading.cells[0].parsed.code:
            res = await runner.execute(code)
            names = await self._names.after(res, runner)
            result = types.REPLResult(stdout=res.stdout, stderr=_stderr(res), locals=dict.fromkeys(names, ""))
            blocks.append(types.CodeBlock(code=code, result=result))
            if res.final is not None and res.final.protocol == "answer":
                return [CellResult(reading.cells[0], res.final, None)]
        iteration = types.RLMIteration(prompt=None, response=reading.text, code_blocks=blocks)
        said = self.rlm.parsing.format_iteration(iteration)[1:]
        return [CellResult(reading.cells[0], None, said[0]["content"] if said else None)]

    def feedback(self, reading: Reading, results: list[CellResult], notes: TurnNotes) -> list[Message]:
        text = results[0].text if results else None
        return [{"role": "user", "content": text}] if text else []

    def last_call(self, max_iterations: int) -> Message | None:
        return dict(self._last_call)

    def forced_answer(self, reading: Reading) -> bool:
        return True


def _stderr(res: ExecResult) -> str:
    """stderr as the package's REPL shows it: what the code wrote, then the exception's one line
    (`ZeroDivisionError: division by zero`) where recursa's worker has the whole traceback."""
    if not res.error:
        return res.stderr
    trace = res.error.rstrip("\n")
    written = res.stderr.rstrip("\n")
    if written.endswith(trace):
        written = written[: len(written) - len(trace)]
    return written + "\n" + trace.splitlines()[-1]


def _default_answer_message(rlm: SimpleNamespace) -> Message:
    """The message the package adds before its last call, read by running its own method against a
    stand-in that records the prompt instead of calling a model."""
    asked: list[list[Message]] = []

    class Recorder:
        def completion(self, prompt: list[Message]) -> str:
            asked.append(prompt)
            return ""

    rlm.RLM._default_answer(SimpleNamespace(logger=None), [], Recorder())
    return dict(asked[0][-1])
