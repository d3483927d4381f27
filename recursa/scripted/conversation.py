"""Reading a chat from the messages alone, as a stateless policy must.

A scripted root tags each code reply with a comment `# step: <name>`. The history is append-only,
so the tags of its own earlier replies tell it where it is; the user message after each reply is
that step's output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from recursa.lm.base import Message
from recursa.scripted.answer_forms import asked_schema

_QUESTION_RE = re.compile(r"<question>[ \t]*\n(.*?)\n[ \t]*</question>", re.DOTALL)
# dialect="verifiers": no system message; the instructions open the first user message inside
# these tags, and the question follows them.
_SCAFFOLD_RE = re.compile(r"\A<SCAFFOLDING>\n(.*?)\n</SCAFFOLDING>\n\n(.*)\Z", re.DOTALL)
_STEP_RE = re.compile(r"^[ \t]*# step: ([\w-]+)", re.MULTILINE)  # indented: code in a markdown list
_RESULT_RE = re.compile(r"^RESULT: (.*)$", re.MULTILINE)
# The engine's last call after the final turn ("... No more code will run ..."), or any nudge like it.
SOLVING_STEPS = ("solve", "fallback")
# The system prompt's line about tools that only sub-models call, and the names in it.
_SUB_TOOLS_RE = re.compile(r"can use these tools themselves: (.+)")
_TOOL_NAME_RE = re.compile(r"`(\w+)\(")
_LAST_CALL_RE = re.compile(r"no more code will run|reply now with your final answer", re.IGNORECASE)


@dataclass
class Conversation:
    system: str
    question: str | None  # from the <question> block of the first user message
    steps: list[str]  # the step tag of each earlier reply of ours ("" for an untagged reply)
    outputs: list[str]  # what came back after each earlier reply (aligned with `steps`)
    last_user: str
    answer_schema: dict[str, Any] | None = None  # the JSON Schema the first message asks the answer in
    scaffolded: bool = False  # the instructions came in a <SCAFFOLDING> block (read as `system`)

    @property
    def done(self) -> set[str]:
        return {s for s in self.steps if s}

    def result_line(self) -> str | None:
        """The value the last solving step printed as `RESULT: ...`, if one did."""
        for tag, out in zip(reversed(self.steps), reversed(self.outputs), strict=True):
            found = _RESULT_RE.findall(out) if tag in SOLVING_STEPS else []
            if found:
                return found[-1].strip()
        return None

    @property
    def asked_to_finish(self) -> bool:
        return bool(self.steps) and bool(_LAST_CALL_RE.search(self.last_user[-1500:]))

    # What the system prompt says about this run.
    @property
    def has_subcalls(self) -> bool:
        if self.scaffolded:
            return "llm_batch" in self.system
        return "No model calls are available" not in self.system

    @property
    def sub_model_tools(self) -> list[str]:
        """Names of the tools sub-models may call (RLM(sub_tools=...)), as the system prompt lists them."""
        line = _SUB_TOOLS_RE.search(self.system)
        return _TOOL_NAME_RE.findall(line.group(1)) if line else []

    @property
    def answer_dict_only(self) -> bool:
        if self.scaffolded:
            return 'answer["ready"] = True' in self.system
        return "The only way to answer" in self.system and "FINAL(" not in self.system


def is_rlm_conversation(messages: list[Message]) -> bool:
    """True when the messages are an RLM root's chat (a question about a context in a REPL)."""
    return any(
        m.get("role") == "user"
        and (_QUESTION_RE.search(m.get("content", "")) or _SCAFFOLD_RE.match(m.get("content", "")))
        for m in messages[:2]
    )


def read(messages: list[Message]) -> Conversation:
    system = next((m.get("content", "") for m in messages if m.get("role") == "system"), "")
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    question = schema = None
    scaffold = None
    if first_user is not None:
        opening = messages[first_user].get("content", "")
        match = _QUESTION_RE.search(opening)
        question = match.group(1).strip() if match else None
        scaffold = _SCAFFOLD_RE.match(opening) if match is None and not system else None
        if scaffold is not None:
            system, question = scaffold.group(1), scaffold.group(2).strip()
        schema = asked_schema(opening)
    steps: list[str] = []
    outputs: list[str] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        tag = _STEP_RE.search(m.get("content", ""))
        steps.append(tag.group(1) if tag else "")
        following = next((n for n in messages[i + 1 :] if n.get("role") == "user"), None)
        outputs.append(following.get("content", "") if following else "")
    last_user = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
    return Conversation(system, question, steps, outputs, last_user, schema, scaffold is not None)


def prompt_text(messages: list[Message]) -> str:
    """A sub-model's prompt: its last user message."""
    return next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")


def repl(code: str) -> str:
    return f"```repl\n{code.strip()}\n```"


def fill(template: str, **values: object) -> str:
    """Put Python literals into code: `__NAME__` becomes repr(value)."""
    for name, value in values.items():
        template = template.replace(f"__{name.upper()}__", repr(value))
    return template
