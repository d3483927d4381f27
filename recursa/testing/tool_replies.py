"""Function calling in the fake model server: tool-call replies, and tool messages in requests.

A responder asks for tools by returning `ToolCallReply`; it reads the tools a request offered with
`offered_tools()` (set for the duration of the responder call). Requests' tool messages reach the
responder in recursa's neutral shape (see recursa/lm/tool_format.py), from either API.
"""

from __future__ import annotations

import contextvars
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

_OFFERED: contextvars.ContextVar[tuple[dict[str, Any], ...]] = contextvars.ContextVar(
    "offered_tools", default=()
)


@dataclass
class ToolCallReply:
    """A reply that calls tools: [(name, arguments)], with optional text before the calls."""

    calls: list[tuple[str, dict[str, Any]]]
    text: str = ""
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = [f"call_{uuid.uuid4().hex[:12]}" for _ in self.calls]


def offered_tools() -> list[dict[str, Any]]:
    """The tools of the request being answered: [{"name", "description", "parameters"}]."""
    return list(_OFFERED.get())


def set_offered(body: Any) -> None:
    """Called once per request, in the request's own task (so its context), before the responder."""
    _OFFERED.set(tuple(parse_tools(body)) if isinstance(body, dict) else ())


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if t.get("type") == "function" else t  # OpenAI nests, Anthropic does not
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            schema = fn.get("parameters", fn.get("input_schema", {}))
            out.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": schema})
    return out


def tool_messages(raw: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """One request message in the neutral shape: tool calls and results kept, text flattened."""
    role = str(raw.get("role", "user"))
    content = raw.get("content")
    if role == "tool":
        return [{"role": "tool", "tool_call_id": str(raw.get("tool_call_id", "")), "content": text}]
    calls = []
    for c in raw.get("tool_calls") or []:  # OpenAI
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {"__unparsed__": fn.get("arguments")}
        calls.append({"id": c.get("id"), "name": fn.get("name"), "arguments": args})
    results = []
    if isinstance(content, list):  # Anthropic blocks
        for block in content:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                calls.append(
                    {"id": block.get("id"), "name": block.get("name"), "arguments": block.get("input")}
                )
            elif block.get("type") == "tool_result":
                inner = block.get("content")
                body = inner if isinstance(inner, str) else "".join(b.get("text", "") for b in inner or [])
                results.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": body}
                )
    if results:
        return results
    message: dict[str, Any] = {"role": role, "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def openai_message(reply: ToolCallReply) -> dict[str, Any]:
    calls = [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in zip(reply.ids, reply.calls, strict=True)
    ]
    return {"role": "assistant", "content": reply.text or None, "tool_calls": calls}


def anthropic_content(reply: ToolCallReply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
    blocks += [
        {"type": "tool_use", "id": i, "name": n, "input": a}
        for i, (n, a) in zip(reply.ids, reply.calls, strict=True)
    ]
    return blocks


def reply_text(reply: ToolCallReply) -> str:
    """What the ledger counts as the reply: the text and the calls, as the model would write them."""
    return reply.text + "".join(f"{n}({json.dumps(a)})" for n, a in reply.calls)
