"""Tools in Anthropic's Messages API, read as Chat Completions reads functions (recursa.serve.fields).

- A forced tool (`tool_choice` `{"type": "tool", "name": N}`, or `{"type": "any"}` with one tool)
  is a typed answer: the tool's `input_schema` is the run's answer schema, and the answer comes back
  as a `tool_use` block whose `input` is the JSON (structured output as the Anthropic SDK's users and
  LangChain's `ChatAnthropic.with_structured_output` ask for it). `force_function` is shared with
  the two OpenAI APIs.
- Tools the model could choose among (no `tool_choice`, `auto`, `any` with several) are refused, as
  in Chat Completions: an RLM runs its own code and never calls the client's tools.
- A replayed conversation may hold the `tool_use` block this server returned and the client's
  `tool_result` for it: the call is left out (as a replayed `tool_calls` message in Chat
  Completions) and the result is read as a tool message (as Chat Completions reads one).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from recursa.serve.api_error import bad
from recursa.serve.fields import AnswerShape, force_function

TOOLS_WHY = (
    "an RLM runs its own code (with the tools its server gives it) and never calls the client's "
    'tools; for a typed answer force one tool (tool_choice {"type": "tool", "name": ...}, or '
    '{"type": "any"} with one tool) or send output_config.format {"type": "json_schema", "schema": '
    '{...}}; tool_choice {"type": "none"} is accepted'
)
CHOICE_TYPES = ("none", "auto", "any", "tool")
_CHOICE_KEYS = frozenset(("type", "name", "disable_parallel_tool_use"))
_CUSTOM = (None, "custom")  # a tool the client defines (Anthropic's other types are its own hosted tools)


def parse_tools(tools: Any, choice: Any, shape: AnswerShape) -> None:
    """Check `tools` and `tool_choice`; a forced tool becomes the answer's shape."""
    kind = _choice_kind(choice)
    if kind == "none" or (not tools and kind in (None, "auto")):
        return  # no tool to call, or none allowed: the RLM calls none of the client's, as always
    if kind is None:
        raise bad(f"`tools` are not supported here: {TOOLS_WHY}", "tools", "unsupported_parameter")
    spelled = json.dumps({"type": kind})
    if kind == "auto":
        force_function(None, "auto", shape, TOOLS_WHY, spelled=spelled)
    schemas = _custom_tools(tools)
    if kind == "any":
        force_function(schemas, "required", shape, TOOLS_WHY, "output_config.format", spelled)
        return
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise bad(
            '`tool_choice` {"type": "tool"} must name the tool: {"type": "tool", "name": ...}', "tool_choice"
        )
    force_function(schemas, name, shape, TOOLS_WHY, "output_config.format")


def _choice_kind(choice: Any) -> str | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in CHOICE_TYPES or set(choice) - _CHOICE_KEYS:
        raise bad(
            '`tool_choice` must be {"type": "none"}, {"type": "auto"}, {"type": "any"} or {"type": "tool", '
            '"name": ...}, each optionally with "disable_parallel_tool_use"',
            "tool_choice",
        )
    # One forced tool is called once whatever it says, and no tool otherwise: checked, no effect.
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(
            "`tool_choice.disable_parallel_tool_use` must be true or false",
            "tool_choice.disable_parallel_tool_use",
        )
    return str(kind)


def _custom_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """Tool name -> its input's JSON Schema."""
    if not isinstance(tools, list) or not tools:
        raise bad("`tools` must be a non-empty list of tool definitions when tool_choice forces one", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(tool, dict) and kind not in _CUSTOM:
            raise bad(
                f"{at} is a {kind!r} tool: this server runs none of Anthropic's own tools; only tools you "
                "define (name, input_schema) are taken, and only to force one as the answer's shape",
                at,
                "unsupported_parameter",
            )
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not name:
            raise bad(f'{at} must be {{"name": ..., "input_schema": {{"type": "object", ...}}}}', at)
        schema = tool.get("input_schema")
        # A tool_use block's input is an object, so the schema must describe one (Anthropic's rule too).
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad(
                f'{at}.input_schema must be a JSON Schema object with "type": "object"', f"{at}.input_schema"
            )
        out[name] = schema
    return out


# -- the answer as a tool_use block ---------------------------------------------------------------


def new_tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def tool_input(answer: str) -> dict[str, Any] | None:
    """The answer as a tool_use block's `input`: None when it is not a JSON object (an answer cut
    short, or one that never fitted the schema), which then comes back as text."""
    try:
        value = json.loads(answer)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def tool_use_block(tool_id: str, name: str | None, value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": value}


# -- a replayed conversation's tool blocks --------------------------------------------------------


class ToolReplay:
    """The tool_use blocks of each assistant turn, so that the next user turn's tool_result blocks
    can be checked against them (as Anthropic's API checks them)."""

    def __init__(self) -> None:
        self.offered: set[str] = set()  # tool_use ids of the assistant turn just read
        self.last_role: str | None = None

    def begin(self, role: str) -> None:
        """A turn starts: a tool_result answers only the assistant turn just before its own."""
        if not (role == "user" and self.last_role == "assistant"):
            self.offered = set()
        self.last_role = role

    def call(self, block: dict[str, Any], role: str, at: str) -> None:
        """A replayed tool_use block: checked, kept for its result, and not context."""
        if role != "assistant":
            raise bad(f"{at}: tool_use blocks come from the assistant; send them in an assistant turn", at)
        tool_id = block.get("id")
        if not isinstance(tool_id, str) or not tool_id or not isinstance(block.get("input"), dict):
            raise bad(f'{at} must be {{"type": "tool_use", "id": ..., "name": ..., "input": {{...}}}}', at)
        self.offered.add(tool_id)

    def result(self, block: dict[str, Any], role: str, at: str) -> None:
        """A replayed tool_result block, checked (its content is read by the caller)."""
        if role != "user":
            raise bad(f"{at}: tool_result blocks answer a tool_use; send them in the user turn after it", at)
        tool_id = block.get("tool_use_id")
        if not isinstance(tool_id, str) or tool_id not in self.offered:
            raise bad(
                f"{at}: a tool_result answers a tool_use block of the assistant turn just before it, and "
                f"tool_use_id {tool_id!r} names none of them; replay that assistant turn (with the "
                "tool_use block this server returned) before it, or send the result as a text block",
                f"{at}.tool_use_id",
            )
        error = block.get("is_error")
        if error is not None and not isinstance(error, bool):
            raise bad(f"{at}.is_error must be true or false", f"{at}.is_error")
