"""The base-model baseline: the whole context in the prompt, one direct answer, no REPL.

It answers what a long-context model plausibly would: a needle that is in the prompt is read
exactly; OOLONG lines are labelled by the same keyword rules a no-subcalls root uses (no
per-line judgement), then counted; anything else gets the best-matching sentence. Used as an RLM
root it cannot see the context, so it answers from the preview in a prose FINAL.
"""

from __future__ import annotations

from recursa.errors import ContextLengthError
from recursa.lm.base import Message
from recursa.lm.tokens import count_message_tokens
from recursa.scripted.conversation import is_rlm_conversation
from recursa.scripted.heuristics import guess_label
from recursa.scripted.name_options import Settings
from recursa.scripted.oracle import extract_answer
from recursa.scripted.readers import direct_answer
from recursa.tasks import niah, oolong


def base_answer(prompt: str, settings: Settings | None = None) -> str:
    key = niah.parse_question(prompt)
    if key is not None:
        value = niah.find_needle(prompt, key)
        if value is None:
            return f"I could not find the special magic number for {key} in the text."
        return f"The special magic number for {key} is {value}."
    newer = direct_answer(prompt, settings or Settings())
    if newer is not None:
        return newer
    query = oolong.parse_question(prompt)
    if query is not None:
        rows = oolong.label_rows(prompt, guess_label)
        answer = oolong.answer_for(query, oolong.scoped_counts(query, rows))
        return f"I went through the {len(rows):,} questions and labelled each one.\n\n{answer}"
    return extract_answer(prompt)


def base_llm_policy(messages: list[Message], settings: Settings | None = None) -> str:
    settings = settings or Settings()
    text = "\n\n".join(m.get("content", "") for m in messages if m.get("role") in ("system", "user"))
    if is_rlm_conversation(messages):
        return "FINAL(" + base_answer(text, settings).replace("\n", " ") + ")"
    check_window(messages, settings)
    return base_answer(text, settings)


def check_window(messages: list[Message], settings: Settings) -> None:
    """A prompt longer than the model's window fails the way a provider's would."""
    tokens = count_message_tokens(messages)
    if tokens > settings.window:
        raise ContextLengthError(
            f"This model's maximum context length is {settings.window:,} tokens, but the prompt has "
            f"{tokens:,} tokens (context_length_exceeded)."
        )
