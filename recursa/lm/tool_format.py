"""Function calling on the wire: our neutral tool messages in OpenAI's and Anthropic's formats.

Inside recursa a tool conversation is plain dicts: an assistant message may carry
`tool_calls: [{"id", "name", "arguments": dict}]`, and each result is a message
`{"role": "tool", "tool_call_id", "name", "content": str}`. A tool offered to a model is
`{"name", "description", "parameters": JSON schema}`.
"""

from __future__ import annotations

import json
from typing import Any

from recursa.lm.base import Message, ToolCall
from recursa.lm.images import anthropic_content, openai_content


def has_tool_messages(messages: list[Message]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


# -- OpenAI ------------------------------------------------------------------------------------


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]},
        }
        for t in tools
    ]


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["name"],
                        "arguments": json.dumps(c["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": m.get("content") or None, "tool_calls": calls})
        elif m.get("role") == "tool":
            out.append({"role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]})
        else:
            out.append({**m, "content": openai_content(m.get("content"))})
    return out


def openai_tool_calls(message: Any) -> list[ToolCall]:
    """The tool calls of a chat-completions message; arguments that are not a JSON object become
    a call with `error` set, so the model hears what was wrong instead of the run failing."""
    raw = message.get("tool_calls") if isinstance(message, dict) else None
    calls: list[ToolCall] = []
    for i, item in enumerate(raw if isinstance(raw, list) else []):
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict):
            continue
        call_id = str(item.get("id") or f"call_{i}")
        name = str(fn.get("name") or "")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError, RecursionError) as exc:
            calls.append(ToolCall(call_id, name, {}, error=f"the arguments were not valid JSON ({exc})"))
            continue
        if not isinstance(args, dict):
            calls.append(ToolCall(call_id, name, {}, error="the arguments must be a JSON object"))
            continue
        calls.append(ToolCall(call_id, name, args))
    return calls


# -- Anthropic ---------------------------------------------------------------------------------


def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tools
    ]


def anthropic_tool_choice(choice: Any) -> Any:
    """A tool_choice given in OpenAI's words ("auto", "required", "none", or a named function) in
    Anthropic's; one already in Anthropic's shape passes as it is. Sampling settings are written
    once for every provider (RLM(sampling={"root": {"tool_choice": "required"}}))."""
    words = {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}
    if isinstance(choice, str) and choice in words:
        return words[choice]
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return {"type": "tool", "name": fn["name"]}
    return choice


def anthropic_messages(messages: list[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """(system, messages) with tool calls as `tool_use` blocks and results as `tool_result` blocks.

    Consecutive blocks of one role are merged into one message: the API wants strict alternation,
    and every result of one assistant turn must come back in the next user message.
    """
    system: list[str] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for m in messages:
        role, content = m.get("role", "user"), m.get("content") or ""
        if role == "system":
            system.append(content)
        elif role == "tool":
            add(
                "user",
                [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": content or "(empty)"}],
            )
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content.strip() else []
            blocks += [
                {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
                for c in m.get("tool_calls") or []
            ]
            add("assistant", blocks or [{"type": "text", "text": "(empty)"}])
        elif isinstance(content, list):  # content parts with images (recursa/lm/images.py)
            add("user", anthropic_content(content))
        else:
            add("user", [{"type": "text", "text": content or "(empty)"}])
    return ("\n\n".join(system) if system else None), out


def anthropic_tool_calls(blocks: list[dict[str, Any]]) -> list[ToolCall]:
    """The tool_use blocks of a Messages API answer's content."""
    calls = []
    for block in blocks:
        if block.get("type") != "tool_use":
            continue
        args = block.get("input")
        call_id, name = str(block.get("id", "")), str(block.get("name", ""))
        if isinstance(args, dict):
            calls.append(ToolCall(call_id, name, args))
        else:
            calls.append(ToolCall(call_id, name, {}, error="the input must be a JSON object"))
    return calls
