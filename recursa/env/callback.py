"""A trainer's own function as the model behind sub-calls and child RLMs' turns.

`RLMEnv(sub_call=fn)` routes every call below the root through `await fn(messages, depth, parent_id)`,
so a trainer can generate the children's turns with its own inference engine and keep them as
rollouts too. The function returns the reply text, or a dict with `text` and, when it knows them,
`input_tokens`, `output_tokens`, `token_ids`, `logprobs` (kept in the trace for the exporters).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from recursa.env.episode import reply_text
from recursa.env.shared import EnvError
from recursa.env.tokens import given_count, token_fields
from recursa.errors import LMError
from recursa.lm.base import LMRequest, LMResponse, Message
from recursa.loop.subcalls import call_trainer_fn

SubCall = Callable[[list[Message], int, str | None], Awaitable[Any]]
# rlm_query's children run by the trainer: (prompt, context, depth, parent_id) -> the child's answer.
ChildCall = Callable[[str, Any, int, str], Awaitable[str] | str]

# Without counts from the trainer, usage is estimated at about four characters per token.
_CHARS_PER_TOKEN = 4


class CallbackClient:
    """The LMClient protocol over a trainer's async function."""

    provider = "callback"

    def __init__(self, fn: SubCall, model: str = "sub_call", timeout: float | None = None) -> None:
        self.fn = fn
        self.model = model
        self.timeout = timeout  # as a server's request timeout: a hung engine fails the call, not the run

    async def complete(self, request: LMRequest) -> LMResponse:
        meta = request.meta
        messages = [dict(m) for m in request.messages]  # the trainer may keep or change its copy
        try:
            async with asyncio.timeout(self.timeout):
                outcome = await call_trainer_fn(self.fn, messages, meta.depth, meta.parent_id)
        except TimeoutError:
            raise LMError(
                f"sub_call gave no answer within {self.timeout:g} s; raise RLMEnv(request_timeout=...) if "
                "the trainer's engine needs longer"
            ) from None
        except LMError:
            raise
        except Exception as exc:  # the trainer's function failed: a failed call, as a server error is
            raise LMError(f"sub_call raised {type(exc).__name__}: {exc}") from None
        return _response(outcome, messages)

    async def aclose(self) -> None:
        return None


def _response(outcome: Any, messages: list[Message]) -> LMResponse:
    if isinstance(outcome, dict) and "text" in outcome and "content" not in outcome:
        outcome = {**outcome, "content": outcome["text"]}
    try:
        outcome, extra = reply_text(outcome, "sub_call's reply")
        tokens = token_fields(extra, "sub_call's reply")
    except EnvError as exc:
        raise LMError(
            f"{exc} (sub_call returns the reply as a str, or a dict with it under 'text')"
        ) from None
    prompt_chars = sum(len(m.get("content") or "") for m in messages)
    given_out = given_count(tokens["output_tokens"], tokens["token_ids"])
    return LMResponse(
        text=outcome,
        input_tokens=_count(given_count(tokens["input_tokens"], tokens["prompt_token_ids"]), prompt_chars),
        output_tokens=_count(given_out, len(outcome)),
        usage_estimated=given_out is None,  # as for the trainer's own turns: the trace marks it
        token_ids=tokens["token_ids"],
        prompt_token_ids=tokens["prompt_token_ids"],
        logprobs=tokens["logprobs"],
        model=str(extra.get("model")) if extra.get("model") else None,
    )


def _count(given: Any, chars: int) -> int:
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    return max(1, chars // _CHARS_PER_TOKEN)
