"""`ScriptedClient`: the scripted policies behind the LMClient protocol (provider "scripted")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from recursa.errors import ConfigError, LMError
from recursa.lm.base import LMRequest, LMResponse, Message, ToolCall
from recursa.lm.tokens import count_message_tokens, count_tokens
from recursa.lm.tool_format import has_tool_messages
from recursa.scripted.catalog import get_policy
from recursa.scripted.policy import parse_knobs
from recursa.scripted.tool_use import ToolTurn, tool_turn

# Above this many prompt characters a policy's regex and labelling work would stall the event loop
# (base-llm reads a whole 10 MB context): run it on a worker thread instead.
THREAD_THRESHOLD_CHARS = 200_000

T = TypeVar("T")


class ScriptedClient:
    """An offline model: `model` is a policy name with optional knobs, e.g. "gpt5-like:fault=loop".

    Free (provider cost 0.0) and deterministic; usage follows `recursa.lm.tokens`, the same
    count the fake server reports. Offered tools, a model may call a search tool before answering
    (see `recursa.scripted.tool_use`). `latency_s` (or the knob `latency=` in the model name) adds a fixed
    delay per call without blocking the event loop.
    """

    provider = "scripted"

    def __init__(self, model: str, *, latency_s: float = 0.0, timeout: float | None = None) -> None:
        self.model = model.removeprefix("scripted/")
        self.latency_s = latency_s
        self.timeout = timeout  # RLM(request_timeout=...): a slower scripted reply times out like a real one
        name, _, knob_text = self.model.partition(":")
        knobs = parse_knobs(knob_text)
        if "latency" in knobs:
            # A client-level knob, so "scripted/oracle:latency=0.2" models a slow sub-model anywhere
            # a model name is accepted; the policy never sees it.
            try:
                self.latency_s = float(knobs.pop("latency"))
            except ValueError:
                raise ConfigError(f"latency must be a number of seconds in {model!r}") from None
        policy_name = name + (":" + ",".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "")
        try:
            self._policy = get_policy(policy_name)
        except KeyError as exc:
            raise ConfigError(str(exc.args[0]) if exc.args else str(exc)) from None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    async def complete(self, request: LMRequest) -> LMResponse:
        messages: list[Message] = request.messages
        if self.timeout is not None and self.latency_s > self.timeout:
            await asyncio.sleep(self.timeout)
            raise LMError(
                f"scripted/{self.model} timed out waiting for the answer after {self.timeout:g} s; raise "
                "RLM(request_timeout=...) for slow models",
                retryable=True,
            )
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        size = sum(len(m.get("content") or "") for m in messages)
        # Offered tools, or reading tool results: the tool-using habits wrap the policy.
        uses_tools = bool(request.tools) or has_tool_messages(messages)
        try:
            if uses_tools:
                turn = await self._maybe_threaded(size, tool_turn, self._policy, messages, request.tools)
            else:
                turn = ToolTurn(await self._maybe_threaded(size, self._policy, messages))
        except LMError:
            raise  # e.g. ContextLengthError: a policy's simulated window, reported as a provider would
        except Exception as exc:  # a policy bug must surface as a model failure, not crash the loop
            raise LMError(f"scripted model {self.model!r} failed: {type(exc).__name__}: {exc}") from exc
        if turn.calls:
            # Ids unique within the chat: the number of this tool turn, then the call's place in it.
            turn_no = 1 + sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
            calls = [ToolCall(f"call_{turn_no}_{i}", name, args) for i, (name, args) in enumerate(turn.calls)]
            wire = json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])
            return LMResponse(
                text=turn.text,
                input_tokens=_input_tokens(messages),
                output_tokens=count_tokens(turn.text) + count_tokens(wire),
                cached_tokens=0,
                provider_cost_usd=0.0,
                model=self.model,
                finish_reason="tool_calls",
                tool_calls=calls,
            )
        text = turn.text
        finish = "stop"
        limit = request.max_output_tokens
        if limit and count_tokens(text) > limit:
            # A real model stops at its output limit; so does this one, or budget caps would not hold.
            text = text[: limit * 4]
            finish = "length"
        return LMResponse(
            text=text,
            input_tokens=_input_tokens(messages),
            output_tokens=count_tokens(text),
            cached_tokens=0,
            provider_cost_usd=0.0,
            model=self.model,
            finish_reason=finish,
        )

    async def _maybe_threaded(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size > THREAD_THRESHOLD_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def aclose(self) -> None:
        return None


def _input_tokens(messages: list[Message]) -> int:
    """The prompt's tokens, counting the tool calls of earlier turns as a provider would."""
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    return count_message_tokens(messages) + sum(
        count_tokens(json.dumps(c, ensure_ascii=False)) for c in calls
    )


def scripted_provider(
    model: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout: float | None = None,
    retry: object = None,
) -> ScriptedClient:
    """The provider "scripted" as `recursa.lm.register_provider` calls it: an offline model needs no
    server, key or retries, so those arguments are accepted and unused."""
    return ScriptedClient(model, timeout=timeout)
