"""Prime Intellect's RLM environment's conversation (verifiers 0.1.14, `envs/experimental/rlm_env.py`;
docs/dialects.md, "verifiers").

The root calls one tool, `call_python_repl` with a `code` argument. `extra_data` is the path of a
folder holding the input data as files, which is also the REPL's working directory (or, with
`extra_data="value"`, the context itself); sub-calls are `llm_batch(prompts)`; `answer =
{"ready": False, "content": ""}` and the rollout ends once a reply's calls have set
`answer["ready"] = True`. The instructions open the first user message inside <SCAFFOLDING>
tags. Each call's result is the cell's output as the environment formats it (stdout, stderr, then
the traceback or `Out[n]: repr` of the last expression), and `.messages` in the folder holds the
conversation so far. A reply without a tool call ends the rollout. After `max_iterations` replies
the rollout ends without running the last reply's calls, as the environment's turn limit does.

Its texts come from the installed environment when it can be read (`texts="auto"`; `"package"`
requires it), else from recursa's own words for the same conventions (verifiers_texts.py).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from recursa.errors import ConfigError
from recursa.lm.base import LMResponse, Message, ToolCall
from recursa.loop.dialects.base import (
    Cell,
    CellResult,
    Opening,
    Reading,
    Runner,
    TurnNotes,
    assistant_message,
)
from recursa.loop.dialects.tools import ToolsDialect
from recursa.loop.dialects.verifiers_repl import (
    RESULT_NAME,
    cell_code,
    read_result,
    setup_code,
    transcript_lines,
)
from recursa.loop.dialects.verifiers_texts import TOOL_ARGUMENT, TOOL_NAME, Verbosity, load_texts
from recursa.loop.finals import boxed
from recursa.loop.parse import Reply
from recursa.sandbox.base import ExecResult, FinalAnswer

MAX_OUTPUT_CHARS = 8_192  # the environment's max_output_length


class VerifiersDialect(ToolsDialect):
    name: ClassVar[str] = "verifiers"
    final_call = False

    def __init__(
        self,
        packages: str = "",
        extra_data: str = "folder",
        texts: str = "auto",
        root_prompt_verbosity: str = "light",
        max_output_length: int | str = MAX_OUTPUT_CHARS,
    ) -> None:
        """`packages`: the Python packages listed as installed (the environment's
        pip_install_packages, space-separated). `extra_data`: "folder" (the context as files in a
        folder, 0.1.14) or "value" (the context itself). `texts`: "auto", "package" or "recursa".
        `root_prompt_verbosity`: how the instructions describe llm_batch ("light", "medium",
        "heavy"). `max_output_length`: where a call's result is cut (at most the run's max_output_chars)."""
        super().__init__(TOOL_NAME, TOOL_ARGUMENT)
        if extra_data not in ("folder", "value"):
            raise ConfigError(f"dialect option extra_data={extra_data!r}: choose 'folder' or 'value'")
        if root_prompt_verbosity not in ("light", "medium", "heavy"):
            raise ConfigError(
                f"dialect option root_prompt_verbosity={root_prompt_verbosity!r}: choose 'light', 'medium' or 'heavy'"
            )
        # An int, or its digits (--dialect-option max_output_length=4096 gives a str).
        if isinstance(max_output_length, str) and max_output_length.strip().isdigit():
            max_output_length = int(max_output_length)
        if (
            isinstance(max_output_length, bool)
            or not isinstance(max_output_length, int)
            or max_output_length < 1
        ):
            raise ConfigError(f"dialect option max_output_length={max_output_length!r}: give a positive int")
        self.texts = load_texts(texts)
        self.sub_system = self.texts.sub_system()  # before every sub-call from this run's code
        self.packages = " ".join(str(packages).split())
        self.extra_data = extra_data
        self.verbosity: Verbosity = root_prompt_verbosity  # type: ignore[assignment]
        self.max_output_length = max_output_length
        self.no_code = ""  # a reply without a call ends the rollout: nothing is said to it
        self._folder_context = False
        self._seen: list[Message] = []  # the conversation so far, for the `.messages` transcript
        self._partial = ""  # answer["content"] as code last left it

    def tools(self) -> list[dict[str, Any]] | None:
        return [self.texts.repl_tool()]

    def setup_code(self) -> str:
        # opening() ran first: the engine builds the opening messages before its REPL starts.
        return setup_code(self.extra_data, self._folder_context, os.getpid())  # type: ignore[arg-type]

    def opening(self, o: Opening) -> list[Message]:
        self._folder_context = o.info.folder
        scaffold = self.texts.scaffold(o, self.packages, self.verbosity)
        question = o.question
        # recursa's own additions, there only when asked for: tips and a typed answer's instructions.
        extra = [*([o.tips.strip()] if o.tips else []), *o.intro]
        if extra:
            question += "\n\n" + "\n\n".join(extra)
        messages = self.texts.first_messages(scaffold, question)
        self._seen = [dict(m) for m in messages]  # type: ignore[misc]
        return messages

    def read(self, response: LMResponse, *, unfenced_code: bool) -> Reading:
        message = assistant_message(response)
        self._seen.append(message)
        return Reading(message, [self._call_cell(c) for c in response.tool_calls], response.text)

    def _call_cell(self, call: ToolCall) -> Cell:
        why = self.texts.refusal(call)
        code = call.arguments.get(TOOL_ARGUMENT) if why is None else None
        return Cell(Reply([code] if isinstance(code, str) else []), call, refused=why)

    async def run(self, reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]:
        if not reading.cells:  # no tool call: the rollout ends here
            return [CellResult(Cell(Reply([])), self._prose_answer(reading.text), None)]
        if not retry:  # the turn limit is reached before the environment answers this reply's calls
            return [CellResult(cell, None, None) for cell in reading.cells]
        transcript = transcript_lines(self.texts.transcript(self._seen))
        # The environment's cut, within the run's: a client's dialect option must not show the
        # model (at the operator's cost) more than max_output_chars of a cell.
        cap = min(self.max_output_length, runner.max_output_chars)
        results: list[CellResult] = []
        final: FinalAnswer | None = None
        for cell in reading.cells:  # every call runs, also after one set the answer, as there
            if cell.refused is not None:
                results.append(CellResult(cell, None, cell.refused))
                continue
            code = cell.parsed.code[0]
            call_id = cell.call.id if cell.call else None
            taken = () if final is None else (final.value,)
            res = await runner.execute(
                cell_code(code, transcript, cap + 1, *taken), call_id=call_id, shown=code
            )
            if res.partial is not None:
                self._partial = res.partial
            stderr, record = _escaped(res)
            if record is None:
                found = await runner.value(RESULT_NAME)
                record = read_result(found.value if found else None)
            text = self.texts.output(res.stdout, stderr, record, cap)
            results.append(CellResult(cell, None, _with_notes(text, res)))
            if res.final is not None and res.final.protocol == "answer":
                final = res.final
        if final is not None:  # the rollout ends after the reply's calls, with the answer they set
            results[-1].final = final
        return results

    def _prose_answer(self, text: str) -> FinalAnswer:
        """The answer of a reply that called no tool: what it put in \\boxed{...} (replies published
        from that environment answer so), else answer["content"] as code left it, else its text."""
        found = boxed(text.strip())
        answer = found if found is not None else self._partial or text.strip()
        return FinalAnswer(answer, answer, "forced")

    def feedback(self, reading: Reading, results: list[CellResult], notes: TurnNotes) -> list[Message]:
        if not results or all(r.text is None for r in results):  # nothing ran: the rollout ends here
            return []
        messages = [
            {k: v for k, v in m.items() if k != "name"} for m in self.tool_results(results, notes.extra, "")
        ]
        self._seen.extend(messages)
        return messages  # type: ignore[return-value]


def _escaped(res: ExecResult) -> tuple[str, dict[str, Any] | None]:
    """stderr, and the cell's record when what stopped it got past the helper (an interrupt at the
    time limit): recursa's traceback of it goes (its frames are the helper's), its last line stays."""
    if not res.error:
        return res.stderr, None
    trace = res.error.rstrip("\n")
    written = res.stderr.rstrip("\n")
    if written.endswith(trace):
        written = written[: len(written) - len(trace)]
    return written, {"status": "error", "result": trace.splitlines()[-1]}


def _with_notes(text: str, res: ExecResult) -> str:
    """recursa's own notes on a cell (a timeout, a restarted REPL) after the environment's output."""
    return "\n".join([text, *res.notes]) if res.notes else text
