"""Function calling for the scripted models: look a question up with a search tool, then answer.

A scripted model offered tools (`LMRequest.tools`) behaves like a careful model with a search
engine. A prompt that asks a question and hands over nothing to read (a short prompt with a
question mark) is looked up: the model calls the offered search-like tool with the question's
distinctive words as the query, reads the results (the "tool" messages), and answers with its
ordinary policy from the question plus what it read. If that reading gives no answer (NONE), it
searches once more with only the names and numbers of the question and twice the hits, then
answers from everything it read. A prompt that carries its own material is answered directly, as
without tools. The model sees nothing but the messages: no hidden ground truth beyond what its
ordinary policy already knows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from recursa.lm.base import Message
from recursa.scripted.conversation import is_rlm_conversation, repl
from recursa.scripted.policy import Policy

# A prompt longer than this carries material of its own: the model reads it instead of searching.
LOOKUP_PROMPT_CHARS = 1_500
MAX_SEARCHES = 2
_STOP = frozenset(
    "a an and answer any are as at by can cannot did do does find for from has have how in is it its "
    "look name not of on only or reply that the this to up was were what when where which who whom "
    "whose with you your none exact".split()
)
_WORD = re.compile(r"[\w'’-]+")
_REPL_BLOCK = re.compile(r"^```repl[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_NAME_OR_NUMBER = re.compile(r"\b(?:[A-Z][\w'’-]*(?:\s+[A-Z][\w'’-]*)*|\d{3,})\b")


@dataclass
class ToolTurn:
    """One scripted reply: text, or calls [(tool name, arguments)] with a short text before them."""

    text: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


@dataclass(frozen=True)
class SearchTool:
    name: str
    query_arg: str
    count_arg: str | None
    default_count: int


def tool_turn(policy: Policy, messages: list[Message], tools: list[dict[str, Any]] | None) -> ToolTurn:
    """The next reply of a scripted model in a chat that may offer tools or hold tool results."""
    if is_rlm_conversation(messages):
        # A root's chat. Offered a code tool (the "tools" dialect), the root's persona calls it with
        # the code it would have fenced; otherwise tools are not part of its habits.
        tool = find_code_tool(tools or [])
        if tool is None:
            return ToolTurn(policy(messages))
        return as_calls(policy(as_fenced(messages)), tool)
    prompt = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")
    results = [_readable(str(m.get("content") or "")) for m in messages if m.get("role") == "tool"]
    searched = sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
    search = find_search_tool(tools or [])
    if searched == 0:
        if search is not None and wants_lookup(prompt):
            query = " ".join(query_words(question_of(prompt)))
            return ToolTurn(
                "I'll search the document collection for this.", [(search.name, {search.query_arg: query})]
            )
        return ToolTurn(policy(messages))
    answer = policy([{"role": "user", "content": reading(prompt, results)}])
    if _says_nothing(answer) and search is not None and searched < MAX_SEARCHES:
        names = [n for n in _NAME_OR_NUMBER.findall(question_of(prompt)) if n.lower() not in _STOP]
        args: dict[str, Any] = {
            search.query_arg: " ".join(names) or " ".join(query_words(question_of(prompt)))
        }
        if search.count_arg is not None:
            args[search.count_arg] = 2 * search.default_count
        return ToolTurn(
            "Nothing there answers it; I'll search again by the names alone.", [(search.name, args)]
        )
    return ToolTurn(answer)


def find_code_tool(tools: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(name, argument) of the first offered tool that runs code: one string argument, and a name
    or description that speaks of Python, code or a REPL."""
    for tool in tools:
        text = f"{tool.get('name', '')} {tool.get('description', '')}".lower()
        props = (tool.get("parameters") or {}).get("properties") or {}
        strings = [n for n, p in props.items() if isinstance(p, dict) and p.get("type") == "string"]
        if len(strings) == 1 and any(w in text for w in ("python", "code", "repl")):
            return str(tool["name"]), strings[0]
    return None


def as_fenced(messages: list[Message]) -> list[Message]:
    """A tool-calling root chat as the fenced one the policies read: each call's code in a ```repl
    block of its reply, and the results of one reply's calls as one user message."""
    out: list[Message] = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [repl(str(next(iter(c["arguments"].values()), ""))) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n\n".join([str(m.get("content") or ""), *blocks]).strip()})
        elif m.get("role") == "tool":
            if out and out[-1].get("role") == "user" and out[-1].get("from_tool"):
                out[-1]["content"] += "\n\n" + str(m.get("content") or "")
            else:
                out.append({"role": "user", "content": str(m.get("content") or ""), "from_tool": True})
        else:
            out.append(m)
    return out


def as_calls(reply: str, tool: tuple[str, str]) -> ToolTurn:
    """The policy's fenced reply as a tool turn: each ```repl block a call, the prose its text."""
    name, argument = tool
    blocks = _REPL_BLOCK.findall(reply)
    if not blocks:
        return ToolTurn(reply)
    return ToolTurn(_REPL_BLOCK.sub("", reply).strip(), [(name, {argument: b.strip()}) for b in blocks])


def find_search_tool(tools: list[dict[str, Any]]) -> SearchTool | None:
    """The first offered tool that searches (by its name or description) and takes a text query."""
    for tool in tools:
        text = f"{tool.get('name', '')} {tool.get('description', '')}".lower()
        if "search" not in text and "retriev" not in text:
            continue
        props = (tool.get("parameters") or {}).get("properties") or {}
        strings = [n for n, p in props.items() if isinstance(p, dict) and p.get("type") == "string"]
        if not strings:
            continue
        query = next((n for n in strings if n in ("query", "q", "text", "question")), strings[0])
        counts = [n for n, p in props.items() if isinstance(p, dict) and p.get("type") == "integer"]
        count = next((n for n in counts if n in ("k", "top_k", "n", "limit", "max_results")), None)
        default = props.get(count, {}).get("default") if count else None
        return SearchTool(
            str(tool["name"]), query, count, default if isinstance(default, int) and default > 0 else 5
        )
    return None


def wants_lookup(prompt: str) -> bool:
    return len(prompt) <= LOOKUP_PROMPT_CHARS and "?" in prompt


def question_of(prompt: str) -> str:
    """The first sentence of the prompt that ends with a question mark (else its first line)."""
    match = re.search(r"[^.?!\n]*\?", prompt)
    if match:
        return match.group(0).strip()
    return next((line.strip() for line in prompt.splitlines() if line.strip()), "")


def query_words(question: str) -> list[str]:
    """The question's words that say what it is about: no question words, no function words."""
    words = [w.strip("'’-") for w in _WORD.findall(question)]
    return [w for w in words if w and w.lower() not in _STOP]


def reading(prompt: str, results: list[str]) -> str:
    """What the model has read: the question, then the documents the searches returned."""
    return prompt + "\n\nDocuments:\n" + "\n\n".join(r for r in results if r)


def _readable(content: str) -> str:
    """A tool result as text: JSON lists of texts are read item by item; errors are skipped."""
    if content.startswith("Error:"):
        return ""
    try:
        value = json.loads(content)
    except ValueError:
        return content
    if isinstance(value, list):
        return "\n\n".join(item if isinstance(item, str) else json.dumps(item) for item in value)
    return value if isinstance(value, str) else content


def _says_nothing(answer: str) -> bool:
    text = answer.strip().upper()
    return not text or text.startswith("NONE") or text.endswith("UNKNOWN")
