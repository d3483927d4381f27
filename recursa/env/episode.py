"""One episode: a root run whose replies come from the trainer, one `step` per reply.

An episode that is dropped without `close()` is reaped by a finalizer, on garbage collection or at
interpreter exit: its REPL processes are killed, its trace gets its `run_end`, its context buffer is
freed. `close()` is still the way: it waits for the REPL to exit and keeps the trace in order.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from recursa.context import ContextPayload
from recursa.env.quota import Prepaid
from recursa.env.rollouts import Rollouts, checked_reward, episode_rows
from recursa.env.shared import EnvError, EpisodeHost, ReplyRefused
from recursa.env.tokens import NONE_GIVEN, given_count, token_fields
from recursa.lm.base import LMResponse, Message, ToolCall, valid_unicode
from recursa.lm.tool_format import openai_messages, openai_tool_calls
from recursa.loop.engine import RunEngine
from recursa.loop.subcalls import call_trainer_fn
from recursa.result import RLMResult
from recursa.usage import Usage

Scorer = Callable[[str], float | Awaitable[float]]
_TOKEN_FIELDS = ("token_ids", "logprobs", "prompt_token_ids")
_CHARS_PER_TOKEN = 4  # the estimate when the trainer gives no token counts


class Episode:
    """`messages`, `step(reply)` until `done`, then `answer`, `reward`, `rollouts()`; `close()`."""

    def __init__(
        self,
        host: EpisodeHost,
        engine: RunEngine,
        payload: ContextPayload,
        quota: Prepaid,
        events: list[dict[str, Any]],
        *,
        task_id: str | None,
        scorer: Scorer | None,
    ) -> None:
        self._host = host
        self.task_id = task_id
        self.reward: float | None = None
        self.step_times: list[float] = []  # the engine's time per step (code run included), seconds
        self._engine = engine
        self._events = events
        self._scorer = scorer
        self._loop = asyncio.get_running_loop()
        self._stepping = False
        self._closed = False
        self._scored = False
        self._step_task: asyncio.Task[Any] | None = None
        self._quota = quota
        self._reaper = weakref.finalize(self, _reap, engine, payload, quota)

    def __repr__(self) -> str:
        state = f"done, {self.stop_reason}" if self.done else f"turn {self._engine.turn}"
        return f"<Episode {self.run_id} ({state})>"

    # -- what the trainer reads ----------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        """The conversation so far, OpenAI format: what the policy continues (a copy, valid Unicode:
        see `valid_unicode`)."""
        return [valid_unicode(dict(m)) for m in openai_messages(self._engine.prompt_messages())]

    @property
    def done(self) -> bool:
        return self._engine.done

    @property
    def result(self) -> RLMResult:
        return self._engine.result

    @property
    def run_id(self) -> str:
        return self._engine.run_id

    @property
    def answer(self) -> str:
        """The answer as text (valid Unicode, as the scorer gets it; `value` is the value itself)."""
        return valid_unicode(self.result.answer)

    @property
    def value(self) -> Any:
        return self.result.value

    @property
    def stop_reason(self) -> str | None:
        """None while running; then "final", "max_iterations", "budget", "timeout", "error", "cancelled"."""
        return self.result.stop_reason if self.done else None

    @property
    def error(self) -> str | None:
        return self.result.error

    @property
    def usage(self) -> Usage:
        return self.result.usage

    @property
    def turn(self) -> int:
        return self._engine.turn

    @property
    def trace_path(self) -> Path | None:
        return self.result.trace_path

    @property
    def events(self) -> list[dict[str, Any]]:
        """The episode's trace events so far (the root's and every descendant's)."""
        return list(self._events)

    # -- stepping ------------------------------------------------------------------------------
    async def step(self, reply: Any) -> list[Message]:
        """Run the trainer's reply (a str, or a message dict with `content` and optionally
        `token_ids`, `logprobs`, `prompt_token_ids`, `input_tokens`, `output_tokens`); returns the
        messages to append after it (the REPL's feedback; none once the episode is done)."""
        self._check_usable("step")
        response = self._response(reply)
        self._stepping = True
        self._step_task = asyncio.current_task()
        started = time.perf_counter()
        try:
            appended = await self._engine.step(response)
            self.step_times.append(time.perf_counter() - started)
            if self._engine.done:
                await self._end()
        finally:
            self._stepping = False
            self._step_task = None
        # Under a dialect with a transient per-turn prompt (SkyRL's), the next one comes last: the
        # trainer drops the previous one from its history before appending these (as SkyRL does).
        transient = self._engine.prompt_messages()[len(self._engine.messages) :] if not self.done else []
        return [valid_unicode(dict(m)) for m in openai_messages([*appended[1:], *transient])]

    def step_sync(self, reply: Any) -> list[Message]:
        """The blocking form of `step`, for episodes from `env.start_sync`."""
        return self._host.private.run(self._on_private("step_sync", self.step(reply)))

    async def close(self) -> None:
        """End the episode: an unfinished one stops as "cancelled"; the REPL is reaped, the trace
        gets its run_end. Safe to call twice."""
        if self._closed:
            return
        if asyncio.get_running_loop() is not self._loop:
            raise EnvError(self._wrong_loop("close"))
        if self._stepping:
            raise EnvError(
                "close() while a step is running: await the step first, or end both with episode.abort()"
            )
        self._closed = True
        try:
            if not self._engine.done:
                self._engine.cancel("the episode was closed before it finished")
            await self._end()
        finally:
            self._host.forget(self)
            self._reaper()  # the context buffer; the engine is finished, so nothing else is left

    async def abort(self) -> None:
        """End the episode now, even while a step of it runs: that step's task is cancelled (its
        awaiter gets CancelledError) and waited for, then the episode is closed. How
        `env.aclose()` ends the episodes a trainer left running."""
        task = self._step_task
        if self._stepping and task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait([task])  # its outcome is its awaiter's to read
        await self.close()

    def close_sync(self) -> None:
        self._host.private.run(self._on_private("close_sync", self.close()))

    def abort_sync(self) -> None:
        """The blocking form of `abort`: a `step_sync` running on another thread is cancelled (it
        raises `concurrent.futures.CancelledError` there) and the episode closed."""
        self._host.private.run(self._on_private("abort_sync", self.abort()))

    async def __aenter__(self) -> Episode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def loop_is_current(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    # -- rows for the trainer ------------------------------------------------------------------
    def rollouts(
        self,
        *,
        reward: float | None = None,
        advantage: float = 0.0,
        group_id: str | None = None,
        group_size: int = 1,
        child_weight: str = "inherit",
        include_subcalls: bool = False,
    ) -> list[dict[str, Any]]:
        """The root's and every descendant's turns as rows in the shape `recursa export rl` writes
        (`trajectory_id`, `run_id`, `parent_run_id`, `depth`, `prompt`, `response`, `reward`,
        `advantage`, ...). Every row carries `advantage`; `reward` (default: the scorer's) sits on
        the root's last step. `recursa.env.group_rollouts` fills in group-relative advantages."""
        if not self.done:
            raise EnvError("rollouts() of an episode that is still running: step it until episode.done")
        value = (
            checked_reward(reward, "rollouts(reward=...) is") if reward is not None else (self.reward or 0.0)
        )
        advantage = checked_reward(advantage, "rollouts(advantage=...) is", "an advantage")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise EnvError(
                f"rollouts(group_size={group_size!r}): give the number of episodes in the group, >= 1"
            )
        spec = Rollouts(value, advantage, group_id or self.task_id or "all", group_size, self.task_id)
        return episode_rows(self._events, self.run_id, spec, child_weight, include_subcalls)

    # -- inside --------------------------------------------------------------------------------
    def _check_usable(self, what: str) -> None:
        if asyncio.get_running_loop() is not self._loop:
            raise EnvError(self._wrong_loop(what))
        if self._closed:
            raise EnvError(f"{what}() on a closed episode; start a new one with env.start(...)")
        if self._engine.done:
            raise EnvError(
                f"{what}() after the episode is done (stop_reason={self.stop_reason!r}); read episode.answer "
                "and episode.reward, then start a new one with env.start(...)"
            )
        if self._stepping:
            raise EnvError("a step of this episode is already running: await it before the next one")

    def _wrong_loop(self, what: str) -> str:
        if self._host.private.owns(self._loop):
            return f"this episode came from env.start_sync(...): use episode.{what}_sync(...)"
        return f"this episode belongs to another event loop: call {what}() from the loop that started it"

    async def _on_private(self, what: str, coro: Awaitable[Any]) -> Any:
        if not self._host.private.owns(self._loop):
            if inspect.iscoroutine(coro):
                coro.close()
            raise EnvError(
                f"this episode came from `await env.start(...)`: use `await episode.{what[:-5]}(...)`"
            )
        return await coro

    def _response(self, reply: Any) -> LMResponse:
        """The trainer's reply as the engine takes it, or EnvError (the episode is unchanged)."""
        try:
            reply, extra = reply_text(reply, "the reply")
        except EnvError as exc:
            raise ReplyRefused(str(exc)) from None
        calls = reply_calls(extra) if extra else []  # a str reply (the usual form) carries nothing else
        limit = self._host.max_reply_chars
        if len(reply) + sum(len(json.dumps(c.arguments)) for c in calls) > limit:
            raise ReplyRefused(
                f"the reply has {len(reply):,} characters, over RLMEnv(max_reply_chars={limit:,}); cap the "
                "policy's generation length or raise max_reply_chars. Nothing ran; step again.",
                too_long=len(reply),
            )
        try:
            tokens = token_fields(extra, "the reply") if extra else NONE_GIVEN
        except EnvError as exc:
            raise ReplyRefused(str(exc)) from None
        prompt_chars = sum(len(m.get("content") or "") for m in self._engine.messages)
        # Counts the trainer gives, else the length of the token ids it gives, else an estimate.
        given_in = given_count(tokens["input_tokens"], tokens["prompt_token_ids"])
        given_out = given_count(tokens["output_tokens"], tokens["token_ids"])
        response = LMResponse(
            text=reply,
            input_tokens=_count(given_in, prompt_chars),
            output_tokens=_count(given_out, len(reply)),
            usage_estimated=given_out is None,
            finish_reason=extra.get("finish_reason") if isinstance(extra.get("finish_reason"), str) else None,
            tool_calls=calls,
        )
        for name in _TOKEN_FIELDS:
            if tokens[name] is not None:
                setattr(response, name, tokens[name])
        return response

    async def _end(self) -> None:
        """Close the REPL and write run_end (once), then score the answer."""
        try:
            try:
                await self._engine.finish()
            finally:
                # The tree's trace file and anything of it still open: a trainer keeps finished
                # episodes for their rows, and each would otherwise hold a descriptor.
                await asyncio.shield(self._engine.tree.aclose())
        finally:
            self._quota.refund()  # when the REPL never started
            self._host.forget(self)
        if self._scorer is not None and not self._scored:
            self._scored = True  # once: a scorer that raised is not called again by close()
            self.reward = await self._score()

    async def _score(self) -> float:
        if not self.answer:
            return 0.0  # no answer to score (an error, a budget stop without a partial answer)
        assert self._scorer is not None
        try:
            # A plain scorer runs off the loop: a judge that blocks (an HTTP call to a grader) would
            # otherwise stall every episode on this loop, a SkyRL generator's included.
            value = await call_trainer_fn(self._scorer, self.answer)
        except Exception as exc:
            raise EnvError(f"the scorer raised {type(exc).__name__}: {exc}") from exc
        return checked_reward(value, "the scorer returned")


def reply_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of a trainer's assistant message, in OpenAI's shape (`function.arguments` a
    JSON str) or recursa's neutral one (`arguments` a dict); arguments that are not a JSON object
    make a call the model is told about."""
    raw = message.get("tool_calls")
    if not isinstance(raw, list):
        return []
    calls: list[ToolCall] = []
    for i, c in enumerate(raw):
        if not isinstance(c, dict):
            continue
        if "function" in c:
            calls += openai_tool_calls({"tool_calls": [{"id": f"call_{i}", **c}]})
            continue
        args = c.get("arguments")
        call_id, name = str(c.get("id") or f"call_{i}"), str(c.get("name") or "")
        if isinstance(args, dict):
            calls.append(ToolCall(call_id, name, args))
        else:
            calls.append(ToolCall(call_id, name, {}, error="the arguments must be a JSON object"))
    return calls


def reply_text(reply: Any, what: str) -> tuple[str, dict[str, Any]]:
    """The text of a reply in any form an OpenAI-style trainer has it: a str, a message dict (or an
    SDK message object) whose `content` is a str or a list of content parts, or a list of parts.
    Also the dict's other fields (token ids, counts). Anything else is an EnvError naming the fix."""
    if isinstance(reply, str):
        return reply, {}  # the usual form, at once: the checks below cost ~10 µs a step
    extra: dict[str, Any] = {}
    if not isinstance(reply, str | dict | list | bytes | bytearray) and hasattr(reply, "content"):
        dump = getattr(reply, "model_dump", None)  # an OpenAI SDK ChatCompletionMessage
        reply = dump() if callable(dump) else {"content": reply.content}
    if isinstance(reply, dict):
        extra = reply
        reply = reply["content"] if "content" in reply else reply.get("text")
        what += "'s content"
        if reply is None and extra.get("tool_calls"):
            reply = ""  # a message of tool calls only (the "tools" dialect)
    if isinstance(reply, list):
        reply = _parts_text(reply, what)
    if isinstance(reply, bytes | bytearray):
        raise EnvError(f"{what} is bytes; pass the decoded text (reply.decode('utf-8'))")
    if not isinstance(reply, str):
        raise EnvError(
            f"{what} is {type(reply).__name__}; pass the policy's reply text as a str, a message dict with "
            "the text under 'content', or a list of OpenAI text parts [{'type': 'text', 'text': ...}]"
        )
    return reply, extra


def _parts_text(parts: list[Any], what: str) -> str:
    """OpenAI content parts, joined: text parts only (a root's turn is text; an image cannot run)."""
    texts: list[str] = []
    for index, part in enumerate(parts):
        if (
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise EnvError(
                f"{what} is a list whose item {index} is not a text part ({kind!r}); pass text parts "
                "{'type': 'text', 'text': ...} only"
            )
    return "".join(texts)


def _count(given: Any, chars: int) -> int:
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    return max(1, chars // _CHARS_PER_TOKEN)


def _reap(engine: RunEngine, payload: ContextPayload, quota: Prepaid) -> None:
    """The finalizer of an episode (also at interpreter exit): stop what is still running."""
    engine.abandon("the episode was dropped without close(): reaped by its finalizer")
    quota.refund()
    payload.close()
