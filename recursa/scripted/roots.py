"""Scripted roots: peek, solve with real REPL code, then answer; faults first when asked for.

A root is stateless: from the messages alone it finds the step tags of its own earlier replies
and the outputs they produced, and writes the next reply. The plan is

    [fault-syntax] [fault-loop] peek solve [fallback] final

where each fault step misbehaves once and the root then carries on as if nothing happened,
`fallback` (the generic map-reduce) runs only when the solving step printed no `RESULT:` line,
and `final` answers in the persona's habit: a prose FINAL / FINAL_VAR (gpt5-like), FINAL_VAR in
code (qwen-coder-like) or the `answer` dict (no-subcalls, and any run whose system prompt allows
only that).
"""

from __future__ import annotations

import json
from typing import Any

from recursa.lm.base import Message
from recursa.scripted.answer_forms import marked_answer, marked_fields, schema_value
from recursa.scripted.conversation import Conversation, read, repl
from recursa.scripted.generic_code import GENERIC
from recursa.scripted.messy import messy_reply
from recursa.scripted.name_options import Settings
from recursa.scripted.policy import Policy
from recursa.scripted.strategies import choose

PERSONA_STYLES = {"gpt5-like": "batched", "qwen-coder-like": "per-item", "no-subcalls": "none"}

_PEEK = """print(type(context).__name__, f"{len(context):,}")
if isinstance(context, str):
    print(context[:600])
elif isinstance(context, dict):
    print(list(context)[:10])
    print(str(next(iter(context.values()), ""))[:600])
else:
    print([len(str(x)) for x in context[:10]])
    print(str(context[0])[:600] if context else "")
"""
_BROKEN_PEEK = "print(type(context).__name__, len(context)\nprint(context[:600])"
_LOOP = "# wait until the data is ready\nwhile True:\n    pass"


def make_root(persona: str, settings: Settings) -> Policy:
    if persona not in PERSONA_STYLES:
        raise ValueError(f"unknown root persona {persona!r}; known: {', '.join(PERSONA_STYLES)}")

    def policy(messages: list[Message]) -> str:
        reply = _reply(persona, settings, read(messages))
        if settings.style == "messy":
            turn = sum(1 for m in messages if m.get("role") == "assistant")
            reply = messy_reply(reply, turn, settings.seed)
        return reply

    return policy


def _style(persona: str, settings: Settings, conv: Conversation) -> str:
    if not conv.has_subcalls:
        return "none"
    style = PERSONA_STYLES[persona]
    return "recursive" if settings.recurse and style == "batched" else style


def _next_step(conv: Conversation, settings: Settings) -> str:
    plan = [f"fault-{f}" for f in ("syntax", "loop") if f in settings.faults] + ["peek", "solve"]
    for step in plan:
        if step not in conv.done:
            return step
    if conv.result_line() is None and "fallback" not in conv.done:
        return "fallback"
    return "final"


def _reply(persona: str, settings: Settings, conv: Conversation) -> str:
    question = conv.question or ""
    # An answer already given and not accepted (e.g. its variable was lost with a restarted
    # sandbox) is given again as literal text; so is every answer in the engine's last call.
    if conv.asked_to_finish or "final" in conv.done or "" in conv.steps:
        return _final(persona, conv, prose_only=True)
    step = _next_step(conv, settings)
    style = _style(persona, settings, conv)
    if step == "fault-syntax":
        return "Let me look at the context first.\n\n" + repl(f"# step: {step}\n{_BROKEN_PEEK}")
    if step == "fault-loop":
        return "I'll let the data load before looking at it.\n\n" + repl(f"# step: {step}\n{_LOOP}")
    if step == "peek":
        if "bigprint" in settings.faults:
            reply = "Let me read the whole context.\n\n" + repl("# step: peek\nprint(context)")
        else:
            reply = "I'll start by looking at the context: its type, size and first characters.\n\n"
            reply += repl("# step: peek\n" + _PEEK)
        if "wrong-final" in settings.faults:
            reply += "\n\nI expect the answer will be small.\nFINAL(0)"
        return reply
    if step == "solve":
        strategy, spec = choose(question)
        searches = any("search" in name.lower() for name in conv.sub_model_tools)
        if strategy.delegates and searches and style in ("batched", "per-item"):
            style = "delegate"  # sub-models can search for themselves: ask them, do not hand them text
        return (
            _solve_prose(strategy.name, style, settings) + "\n\n" + repl(strategy.code(spec, style, settings))
        )
    if step == "fallback":
        code = GENERIC.code(question, style, settings).replace("# step: solve", "# step: fallback", 1)
        return (
            "That did not produce an answer; I'll fall back to a plain map-reduce over the context.\n\n"
            + repl(code)
        )
    return _final(persona, conv, prose_only=False)


def _solve_prose(family: str, style: str, settings: Settings) -> str:
    if style == "delegate":
        return (
            "Sub-models can search the documents with their own tools, so I'll ask them one question "
            "at a time (the starting entity, then each hop) without handing them any text."
        )
    if family == "niah":
        how = {
            "batched": "and confirm it with one sub-call on the text around it",
            "per-item": "and also ask the sub-model about each piece in turn",
            "none": "with code alone",
            "recursive": "and let child RLMs search the pieces",
        }[style]
        return f"The needle is a fixed sentence, so I'll find it with a regex {how}."
    how = {
        "batched": f"with batched sub-calls of {settings.batch} lines (or {settings.chunk:,} characters) each",
        "per-item": "asking the sub-model about each one in turn",
        "none": "with code alone (regexes and keyword rules)",
        "recursive": "by handing parts of the context to child RLMs",
    }[style]
    if family == "oolong":
        return (
            "Each line is one instance and the labels need semantic judgement, so I'll label every "
            f"line {how}, keep the labels in a list, and count in code."
        )
    return f"I'll read the context piece by piece {how} and combine what each piece says."


def _final(persona: str, conv: Conversation, *, prose_only: bool) -> str:
    value = conv.result_line()
    solved = value is not None
    shaped = _shaped(conv, value or "unknown")
    if shaped is not None:
        return _final_shaped(persona, conv, shaped, prose_only=prose_only)
    if prose_only or not solved:
        # No code runs in an engine's last call, and without a result there is no variable to name.
        return f"Here is my answer.\n\nFINAL({value if solved else 'unknown'})"
    if persona == "no-subcalls" or conv.answer_dict_only:
        return "The result is computed; I'll hand it back.\n\n" + repl(
            '# step: final\nanswer["content"] = result\nanswer["ready"] = True'
        )
    if persona == "qwen-coder-like":
        return "The result is in `result`.\n\n" + repl('# step: final\nFINAL_VAR("result")')
    strategy, _spec = choose(conv.question or "")
    if strategy.answer_in_prose:
        return f"The output confirms it.\n\nFINAL({value})"
    return "The counts are in and the answer is in `result`.\n\nFINAL_VAR(result)"


def _shaped(conv: Conversation, found: str) -> Any | None:
    """The answer in the form the question asks for (a schema's value, marked fields), or None."""
    if conv.answer_schema is not None:
        return schema_value(conv.answer_schema, found)
    fields = marked_fields(conv.question or "")
    return marked_answer(fields, found) if fields else None


def _final_shaped(persona: str, conv: Conversation, value: Any, *, prose_only: bool) -> str:
    """Hand back a built value: as a variable (its text could hold anything a prose line breaks
    on), or as JSON text in the last call, where no code runs."""
    text = json.dumps(value, ensure_ascii=False)
    if prose_only:
        return f"Here is my answer.\n\nFINAL({text})"
    code = f"# step: final\nimport json\ntyped = json.loads({text!r})\n"
    if persona == "no-subcalls" or conv.answer_dict_only:
        return "The answer has the requested form; I'll hand it back.\n\n" + repl(
            code + 'answer["content"] = typed\nanswer["ready"] = True'
        )
    return "I'll give the answer in the requested form.\n\n" + repl(code + 'FINAL_VAR("typed")')
