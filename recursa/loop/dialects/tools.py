"""Native tool calling: the root runs code by calling one tool (OpenAI / Anthropic `tools`).

Each call in a reply runs as a cell, in order, and its output goes back as that call's tool result
(`role: tool` with its id; Anthropic's `tool_result`). A reply with text and no call is read by
recursa's rules (fenced code, FINAL, boxed answers, the `answer` dict). The defaults, the tool
`call_python_repl` with a `code` argument, are what RL-trained roots saw most (Prime Intellect's
RLM environment).
"""

from __future__ import annotations

import re
from importlib import resources
from string import Template
from typing import Any, ClassVar

from recursa.errors import ConfigError
from recursa.lm.base import ToolCall
from recursa.loop.dialects.base import Cell, Opening, call_code, tool_schema
from recursa.loop.dialects.native import RecursaDialect
from recursa.loop.parse import Reply
from recursa.loop.rules import ReplyRules

DEFAULT_TOOL = "call_python_repl"
DEFAULT_ARGUMENT = "code"
# What OpenAI and Anthropic accept as a function or property name.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolsDialect(RecursaDialect):
    name: ClassVar[str] = "tools"

    def __init__(
        self,
        tool_name: str = DEFAULT_TOOL,
        tool_argument: str = DEFAULT_ARGUMENT,
        reply_rules: ReplyRules | str = "default",
    ) -> None:
        super().__init__(reply_rules)  # the rules a text reply (no tool call) is read by
        for what, value in (("tool_name", tool_name), ("tool_argument", tool_argument)):
            if not isinstance(value, str) or not _NAME.match(value):
                raise ConfigError(
                    f"dialect option {what}={value!r}: give 1-64 letters, digits, '_' or '-' "
                    f"(e.g. {what}={DEFAULT_TOOL if what == 'tool_name' else DEFAULT_ARGUMENT!r})"
                )
        self.tool_name = tool_name
        self.tool_argument = tool_argument
        self.no_code = (
            f"Your reply had no call of `{tool_name}` and no final answer, so nothing ran. Call "
            f"`{tool_name}` with your Python as its `{tool_argument}` argument, or, once you have the "
            "answer, reply without a tool call and write FINAL(your answer) on a line of its own (or "
            "FINAL_VAR(name) for a variable you already assigned)."
        )

    def tools(self) -> list[dict[str, Any]] | None:
        return [
            tool_schema(
                self.tool_name,
                self.tool_argument,
                "Run Python code in the persistent REPL that holds the context; returns what the code printed.",
            )
        ]

    def template(self, o: Opening) -> str:
        if o.prompt is not None:
            text = super().template(o)
        else:
            text = resources.files("recursa.loop").joinpath("prompts", "tools.md").read_text(encoding="utf-8")
        return Template(text).safe_substitute(tool_name=self.tool_name, tool_argument=self.tool_argument)

    def _call_cell(self, call: ToolCall) -> Cell:
        code, why = call_code(call, self.tool_name, self.tool_argument)
        return Cell(Reply([code] if code is not None else []), call, refused=why)
