"""What dialect="verifiers" says, from one of two sources with the same interface:

- `PackageTexts`: Prime Intellect's RLM environment itself (`verifiers==0.1.14`, the
  `verifiers-rlm` extra), read at run time: its prompt builder (the <SCAFFOLDING> block and how it
  goes into the first user message), the REPL tool's schema as the environment derives it, its
  formatting of a cell's output, the errors its tool dispatch gives a call it cannot run, and its
  serialization of the `.messages` transcript. recursa ships none of that text.
- `OwnTexts`: the same conventions in recursa's own words, for when the package is not installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, Literal, Protocol

from recursa.errors import ConfigError
from recursa.lm.base import Message, ToolCall
from recursa.loop.dialects.base import Opening, call_code, tool_schema
from recursa.tools.spec import Tool

INSTALL = "pip install 'recursa[verifiers-rlm]' (Prime Intellect's RLM environment, verifiers==0.1.14)"
TOOL_NAME = "call_python_repl"
TOOL_ARGUMENT = "code"
Verbosity = Literal["light", "medium", "heavy"]


class VerifiersTexts(Protocol):
    source: str  # what the texts came from, e.g. "verifiers 0.1.14" or "recursa"

    def scaffold(self, o: Opening, packages: str, verbosity: Verbosity) -> str:
        """The instructions block the first user message starts with."""
        ...

    def first_messages(self, scaffold: str, question: str) -> list[Message]: ...

    def sub_system(self) -> str | None:
        """The system message before every llm_batch prompt (None: the prompt alone)."""
        ...

    def repl_tool(self) -> dict[str, Any]:
        """The one tool on root requests ({"name", "description", "parameters"})."""
        ...

    def refusal(self, call: ToolCall) -> str | None:
        """What a call that cannot run is answered with (None: it runs)."""
        ...

    def output(self, stdout: str, stderr: str, cell: dict[str, Any], max_chars: int) -> str:
        """A cell's tool result: its output, then its error or the repr of its last expression."""
        ...

    def transcript(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """The conversation as the `.messages` file holds it, one dict per message."""
        ...


def load_texts(texts: str) -> VerifiersTexts:
    """ "package": the installed environment's (a ConfigError naming the extra when it is missing);
    "recursa": recursa's own words; "auto": the package's when installed, else recursa's."""
    if texts not in ("auto", "package", "recursa"):
        raise ConfigError(f"dialect option texts={texts!r}: choose 'auto', 'package' or 'recursa'")
    if texts == "recursa":
        return OwnTexts()
    try:
        return PackageTexts()
    except ImportError as exc:
        if texts == "package":
            raise ConfigError(
                f"texts='package' reads Prime Intellect's RLM environment, which is not installed ({exc}); {INSTALL}"
            ) from None
        return OwnTexts()


def neutral_to_raw(message: Message) -> dict[str, Any]:
    """A history message in the OpenAI shape the environment keeps (arguments as a JSON string;
    an assistant message that only calls tools has no content, as a server's null content)."""
    role = message.get("role")
    out: dict[str, Any] = {"role": role, "content": message.get("content")}
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        out["tool_calls"] = [
            {"id": c["id"], "name": c["name"], "arguments": json.dumps(c.get("arguments") or {})}
            for c in calls
        ]
        if not out["content"]:
            out["content"] = None
    return out


class PackageTexts:
    """The environment's own code, called with stand-ins for the parts that need a live rollout."""

    def __init__(self) -> None:
        from verifiers import __version__
        from verifiers.envs.experimental import rlm_env
        from verifiers.envs.stateful_tool_env import StatefulToolEnv
        from verifiers.utils.message_utils import from_raw_message
        from verifiers.utils.tool_utils import convert_func_to_tool_def

        self.source = f"verifiers {__version__}"
        self._env = rlm_env
        self._from_raw = from_raw_message
        self._tool_def = convert_func_to_tool_def
        self._repl = self._repl_tool(StatefulToolEnv)

    def _repl_tool(self, stateful: Any) -> dict[str, Any]:
        # The environment adds the tool with its `state` argument hidden (StatefulToolEnv.add_tool):
        # run that on a stand-in that only collects the definition.
        holder = SimpleNamespace(
            tools=[],
            tool_defs=[],
            tool_map={},
            skipped_args={},
            tool_monitor_rubric=SimpleNamespace(add_tool_metric=lambda name: None),
        )
        stateful.add_tool(holder, self._env.RLMEnv.call_python_repl, args_to_skip=["state"])
        d = holder.tool_defs[0]
        return {"name": d.name, "description": d.description, "parameters": d.parameters}

    def _defs(self, tools: Sequence[Tool]) -> list[Any]:
        out = []
        for t in tools:
            try:
                out.append(self._tool_def(t.fn))
            except Exception:  # a signature its schema builder cannot read: recursa's name and doc
                out.append(SimpleNamespace(name=t.name, description=t.doc, parameters=t.parameters))
        return out

    def scaffold(self, o: Opening, packages: str, verbosity: Verbosity) -> str:
        return str(
            self._builder(
                o.subcalls, o.tools, o.sub_tools, o.system_prompt, packages, verbosity
            ).build_system_prompt()
        )

    def sub_system(self) -> str | None:
        return str(self._builder(True, (), (), None, "", "light").build_sub_llm_system_prompt())

    def _builder(
        self,
        subcalls: bool,
        tools: Sequence[Tool],
        sub_tools: Sequence[Tool],
        system_prompt: str | None,
        packages: str,
        verbosity: Verbosity,
    ) -> Any:
        """The environment's prompt builder, set up as RLMEnv sets it up (its defaults otherwise)."""
        root_defs = []
        if subcalls:  # llm_batch, described by the environment's own function
            stand_in = SimpleNamespace(enable_sub_llms=True, _root_tool_context_var=None)
            root_defs = [self._tool_def(f) for f in self._env.RLMEnv._build_fixed_root_tools(stand_in)]
        return self._env.RLMPromptBuilder(
            repl_language="python",
            root_prompt_verbosity=verbosity,
            sub_prompt_verbosity="light",
            custom_system_prompt=system_prompt,
            pip_install_packages=packages,
            root_max_completion_tokens=None,
            sub_max_completion_tokens=None,
            sub_llm_max_turns=5,
            root_tool_defs=[*root_defs, *self._defs(tools)],
            sub_tool_defs=self._defs(sub_tools) if subcalls else [],
            enable_sub_llms=subcalls,
        )

    def first_messages(self, scaffold: str, question: str) -> list[Message]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        self._env.RLMPromptBuilder.inject_scaffolding_into_messages(messages, scaffold)
        return [dict(m) for m in messages]  # type: ignore[misc]

    def repl_tool(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._repl))

    def refusal(self, call: ToolCall) -> str | None:
        if call.error:  # unparsable arguments: recursa keeps no raw text to show the parser's message
            return f"The call was not run: {call.error}."
        if call.name != TOOL_NAME:
            return str(KeyError(call.name))  # the environment's tool lookup, as its error formatter shows it
        try:  # the environment calls the tool with the arguments as given: Python's own error for a mismatch
            pending = self._env.RLMEnv.call_python_repl(None, **{**call.arguments, "state": None})
        except TypeError as exc:
            return str(exc)
        pending.close()
        if not isinstance(call.arguments.get(TOOL_ARGUMENT), str):
            return f"The call was not run: {TOOL_NAME} takes one string argument {TOOL_ARGUMENT!r}."
        return None

    def output(self, stdout: str, stderr: str, cell: dict[str, Any], max_chars: int) -> str:
        stand_in = SimpleNamespace(repl_language="python", max_output_length=max_chars)
        return str(
            self._env.RLMEnv._format_execution_output(stand_in, {**cell, "stdout": stdout, "stderr": stderr})
        )

    def transcript(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        return [self._from_raw(neutral_to_raw(m)).model_dump(exclude_none=True) for m in messages]


class OwnTexts:
    """The environment's conventions, described and formatted in recursa's words."""

    source = "recursa"

    def scaffold(self, o: Opening, packages: str, verbosity: Verbosity) -> str:
        lines = [
            f"You have the `{TOOL_NAME}` tool: it runs Python in a persistent REPL. The input data is in "
            "files in your working directory, whose path is the REPL variable `extra_data`.",
            "",
            'There exists an `answer` variable, which is a dict: put your answer in `answer["content"]`, '
            'and when it is final, set `answer["ready"] = True`.',
        ]
        if o.system_prompt:
            lines = [o.system_prompt.strip()]
        listed = [p for p in packages.split() if p]
        if listed:
            lines += ["", "## Installed Packages", "", "These Python packages can be imported in the REPL:"]
            lines += [f"- `{p}`" for p in listed]
        if o.subcalls:
            lines += [
                "",
                "Use `llm_batch(prompts)` (a list of str) for semantic work; it runs them in parallel.",
            ]
        own = [t.describe() for t in o.tools]
        if own:
            lines += ["", "## REPL Tools", "", "These functions exist only inside the REPL:", *own]
        if o.subcalls and o.sub_tools:
            names = ", ".join(f"`{t.name}`" for t in o.sub_tools)
            lines += [
                "",
                "## llm_batch Tools",
                "",
                f"The models `llm_batch` calls can use these tools themselves: {names}.",
            ]
        lines += [
            "",
            "The file `.messages` in your working directory holds this conversation so far (JSONL, one "
            "message per line), rewritten before each call of the tool.",
        ]
        return "<SCAFFOLDING>\n" + "\n".join(lines) + "\n</SCAFFOLDING>\n\n"

    def first_messages(self, scaffold: str, question: str) -> list[Message]:
        return [{"role": "user", "content": scaffold + question}]

    def sub_system(self) -> str | None:
        return None

    def repl_tool(self) -> dict[str, Any]:
        return tool_schema(TOOL_NAME, TOOL_ARGUMENT, "Run Python code in the persistent REPL.")

    def refusal(self, call: ToolCall) -> str | None:
        return call_code(call, TOOL_NAME, TOOL_ARGUMENT)[1]

    def output(self, stdout: str, stderr: str, cell: dict[str, Any], max_chars: int) -> str:
        parts = [p for p in (stdout.rstrip(), "stderr:\n" + stderr.rstrip() if stderr.rstrip() else "") if p]
        result = cell.get("result")
        if cell.get("status") == "error" and result:
            parts.append(str(result).rstrip())
        elif result is not None:
            parts.append(f"Out[{cell.get('execution_count', 0)}]: {result}")
        text = "\n".join(parts) if parts else "(no output)"
        if len(text) > max_chars:
            text = text[:max_chars] + "\n[the output was cut here]"
        return text

    def transcript(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        return [{k: v for k, v in neutral_to_raw(m).items() if v is not None} for m in messages]
