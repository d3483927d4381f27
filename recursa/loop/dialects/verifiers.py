"""Prime Intellect's RLM environment's conventions (verifiers 0.1.14, `envs/experimental/rlm_env.py`),
in recursa's own words (docs/dialects.md, "verifiers").

The root calls one tool, `call_python_repl` with a `code` argument; the input data is the REPL
variable `extra_data`; sub-calls are `llm_batch(prompts)`; `answer = {"content": "", "ready":
False}` and the rollout ends as soon as code sets `answer["ready"] = True`. The instructions open
the first user message inside <SCAFFOLDING> tags (there is no system prompt), with sections for
the installed packages, the REPL's tools and the tools only sub-models use. A reply without a tool
call ends the rollout, as there: its answer is what it put in \\boxed{...}, else its text. Out of
turns it just ends. Each call's result is the cell's stdout, then "stderr:" and what went there,
cut at 8,192 characters.
"""

from __future__ import annotations

from typing import ClassVar

from recursa.lm.base import LMResponse, Message
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
from recursa.loop.finals import boxed
from recursa.loop.parse import Reply
from recursa.sandbox.base import ExecResult, FinalAnswer

MAX_OUTPUT_CHARS = 8_192  # the environment's max_output_length


class VerifiersDialect(ToolsDialect):
    name: ClassVar[str] = "verifiers"
    context_name = "extra_data"
    final_call = False

    def __init__(self, packages: str = "") -> None:
        super().__init__()
        # The packages the sandbox's code can import, listed as the environment lists its
        # pip_install_packages (a space-separated str).
        self.packages = [p for p in str(packages).split() if p]

    def setup_code(self) -> str:
        return "extra_data = context"

    def opening(self, o: Opening) -> list[Message]:
        info = o.info
        lines = [
            f"You have the `{self.tool_name}` tool: it runs Python in a persistent REPL.",
            "",
            f"The input data is in the REPL variable `extra_data` ({info.type_name}, {info.total_chars:,} "
            "characters). There exists an `answer` variable, which is a dict: put your answer in "
            '`answer["content"]`, and when it is final, set `answer["ready"] = True`.',
        ]
        if self.packages:
            lines += ["", "## Installed Packages", "", "These Python packages can be imported in the REPL:"]
            lines += [f"- `{p}`" for p in self.packages]
        if o.subcalls:
            lines += ["", "Use `llm_batch(prompts)` (a list of str) for semantic work; it runs them in parallel."]
        if o.settings.tools_text:
            lines += ["", "## REPL Tools", o.settings.tools_text.strip()]
        if o.tips:
            lines += ["", o.tips.strip()]
        scaffold = "<SCAFFOLDING>\n" + "\n".join(lines) + "\n</SCAFFOLDING>\n\n"
        if o.system_prompt is not None:
            scaffold = o.system_prompt
        question = o.question + ("\n\n" + "\n\n".join(o.intro) if o.intro else "")
        return [{"role": "user", "content": scaffold + question}]

    def prompt_for(self, turn: int, max_iterations: int) -> Message | None:
        return None

    def read(self, response: LMResponse, *, unfenced_code: bool) -> Reading:
        message = assistant_message(response)
        return Reading(message, [self._call_cell(c) for c in response.tool_calls], response.text)

    async def run(self, reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]:
        if not reading.cells:  # no tool call: the rollout ends here, with what the reply says
            text = reading.text.strip()
            found = boxed(text)
            answer = found if found is not None else text
            return [CellResult(Cell(Reply([])), FinalAnswer(answer, answer, "forced"), None)]
        results: list[CellResult] = []
        for cell in reading.cells:
            if cell.refused is not None or (results and results[-1].final is not None):
                results.append(CellResult(cell, None, cell.refused or "(not run)"))
                continue
            res = await runner.execute(cell.parsed.code[0], call_id=cell.call.id if cell.call else None)
            final = res.final if res.final is not None and res.final.protocol == "answer" else None
            results.append(CellResult(cell, final, _output(res)))
        return results

    def feedback(self, reading: Reading, results: list[CellResult], notes: TurnNotes) -> list[Message]:
        return self.tool_results(results, notes.extra, "")


def _output(res: ExecResult) -> str:
    parts = []
    if res.stdout.rstrip():
        parts.append(res.stdout.rstrip())
    if res.stderr.rstrip():
        parts.append("stderr:\n" + res.stderr.rstrip())
    parts += res.notes
    text = "\n".join(parts) if parts else "(no output)"
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + "\n... [output truncated]"
    return text
