"""SkyRL-gym's `rlm` environment's conversation, exactly (docs/dialects.md, "skyrl").

Its texts and rules come from the installed `skyrl_gym.envs.rlm` (the `skyrl` extra) at run time:
the system prompt (and its tools section), the context metadata message, the per-turn prompt that
is shown with one call only (SkyRL pops it from the generator's history before the turn's messages
are appended), the last ```repl block of a reply as the only code that runs, FINAL / FINAL_VAR
read anywhere in the reply (code and answer in one reply included) and FINAL_VAR() called in code,
and each observation, formatted by SkyRL's own `step` over the output of recursa's sandbox. Out of
turns the episode just ends. tests/test_dialect_skyrl.py steps SkyRL's environment and recursa's
`recursa-rlm` with the same actions and compares what the policy sees.
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
from recursa.sandbox.base import FinalAnswer

INSTALL = "pip install 'recursa[skyrl]'"


def load_skyrl() -> SimpleNamespace:
    try:
        from skyrl_gym.envs.rlm import env
    except ImportError as exc:
        raise ConfigError(f"the 'skyrl' dialect reads SkyRL-gym's texts, which is not installed ({exc}); {INSTALL}") from None
    return SimpleNamespace(env=env)


class SkyRLDialect:
    name: ClassVar[str] = "skyrl"
    turn_prompt: TurnPromptKind = "transient"
    final_call = False
    no_code = ""

    def __init__(self) -> None:
        self.sky = load_skyrl()
        self._names = PeerNames(("context_0", "context"), hidden=("answer",))
        self._question = ""

    def tools(self) -> list[dict[str, Any]] | None:
        return None

    def setup_code(self) -> str:
        return "context_0 = context"

    def opening(self, o: Opening) -> list[Message]:
        env = self.sky.env
        self._question = o.question
        template = o.system_prompt if o.system_prompt is not None else env.DEFAULT_RLM_SYSTEM_PROMPT
        host = SimpleNamespace(
            _get_system_prompt=lambda: template,
            # SkyRL lists the LM query tools when the generator gave the environment an lm_callback.
            lm_callback=object() if o.subcalls else None,
            _tools={t.name: {"tool": t.fn, "description": t.doc} for t in o.tools},
        )
        system = env.BaseRLMEnv._build_system_prompt(host)
        if o.tips:  # recursa's addition, off unless asked for
            system += "\n\nTips for this task:\n" + o.tips.strip()
        metadata = env._format_context_metadata(_stand_in(o))
        if o.intro:
            metadata += "\n\n" + "\n\n".join(o.intro)
        return [{"role": "system", "content": system}, {"role": "user", "content": metadata}]

    def prompt_for(self, turn: int, max_iterations: int) -> Message | None:
        return dict(self.sky.env._build_user_prompt(self._question or None, turn - 1))

    def read(self, response: LMResponse, *, unfenced_code: bool) -> Reading:
        code = self.sky.env._find_code_block(response.text)
        cells = [Cell(Reply([code]))] if code is not None else []
        return Reading({"role": "assistant", "content": response.text}, cells, response.text)

    async def run(self, reading: Reading, runner: Runner, *, retry: bool) -> list[CellResult]:
        if not reading.cells:
            return [CellResult(Cell(Reply([])), None, self._observe(reading.text, None))]
        cell = reading.cells[0]
        code = cell.parsed.code[0]
        res = await runner.execute(code)
        names = await self._names.after(res, runner)
        # FINAL_VAR() called in the code (SkyRL's REPL has no FINAL() nor answer dict), else an
        # answer written anywhere in the reply.
        final = res.final if res.final is not None and res.final.protocol == "FINAL_VAR" else None
        final = final or await self._text_final(reading.text, runner)
        if final is not None:
            return [CellResult(cell, final, None)]
        result = self.sky.env.REPLResult(
            stdout=res.stdout, stderr=res.stderr, locals=dict.fromkeys(names, ""), final_answer=None
        )
        return [CellResult(cell, None, self._observe(f"```repl\n{code}\n```", result))]

    async def _text_final(self, text: str, runner: Runner) -> FinalAnswer | None:
        """SkyRL's reading of FINAL_VAR(name) (preferred) or FINAL(text) in the reply, by its own
        patterns: the last of them; a variable that is missing or prints as nothing is no answer."""
        env = self.sky.env
        names = env._FINAL_VAR_RE.findall(text)
        if names:
            name = names[-1].strip().strip('"').strip("'")
            found = await runner.value(name)
            answer = found.text.strip() if found is not None else ""
            return FinalAnswer(answer, answer, "FINAL_VAR", name) if answer else None
        finals = env._FINAL_RE.findall(text)
        if finals:
            answer = finals[-1].strip()
            return FinalAnswer(answer, answer, "FINAL")
        return None

    def _observe(self, action: str, result: Any) -> str:
        """The observation SkyRL's own `step` makes of `action` (a reply with no code, or the code
        that ran) and the REPL's `result`: run on a stand-in that has no REPL of its own."""
        env = self.sky.env

        class Replay:
            def __init__(self) -> None:
                self.given = result

            def execute(self, code: str) -> Any:
                given, self.given = self.given, env.REPLResult(stdout="", stderr="", locals={}, final_answer=None)
                return given

        host = SimpleNamespace(
            turns=0,
            _turn_index=0,
            max_turns=float("inf"),
            _chat_history_ref=[None],
            repl=Replay(),
            _make_step_output=lambda observations, done: observations,
        )
        observations = env.BaseRLMEnv.step(host, action)
        return str(observations[0]["content"])

    def feedback(self, reading: Reading, results: list[CellResult], notes: TurnNotes) -> list[Message]:
        if notes.left == 0 and reading.cells:  # out of turns after code: SkyRL ends with no observation
            return []
        text = results[0].text if results else None
        return [{"role": "user", "content": text}] if text else []

    def last_call(self, max_iterations: int) -> Message | None:
        return None

    def forced_answer(self, reading: Reading) -> bool:
        return True


def _stand_in(o: Opening) -> Any:
    """A context of the same kind and piece lengths, for SkyRL's metadata line (which reads only
    those): the REPL holds the real one."""
    info = o.info
    if info.type_name == "list":
        return [" " * n for n in info.chunk_lengths]
    if info.type_name == "dict":
        return {k: " " * n for k, n in zip(info.keys, info.chunk_lengths, strict=True)}
    return " " * info.total_chars
