"""The host side of the REPL's call-backs: llm_query, rlm_query and their batched forms.

Calls arrive from the sandbox as requests and run as tasks on the host's event loop, so a batch
of 500 prompts, 20 child RLMs, or llm_query from many user threads all overlap, limited only by
the tree's concurrency limiter and budget.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from recursa.context import ContextPayload, context_text
from recursa.errors import BudgetExceeded, ContextError, ContextLengthError, LMError
from recursa.lm.base import CallMeta, LMResponse, Message
from recursa.lm.images import ImageError, base64_part, bytes_part, fetched_parts, url_part
from recursa.lm.registry import parse_model
from recursa.loop.tree import CallTree
from recursa.result import RLMResult
from recursa.sandbox.base import CallbackError
from recursa.tools.calling import call_with_tools
from recursa.tools.runner import ToolFailure
from recursa.tools.spec import Tool
from recursa.usage import Usage

# Failures of the call itself (not of how it was called): what subcall_errors="return" turns into text.
_CALL_FAILURES = frozenset({"SubcallError", "BudgetExceeded"})

# What a child run is asked when rlm_query gets no separate context: the prompt is the context.
PROMPT_AS_CONTEXT_QUESTION = (
    "The context holds a complete request from a user. Carry it out and give the result as your answer."
)


class CallingRun(Protocol):
    """What a sub-call needs from the run whose code makes it (`RunEngine` is the one there is).

    A protocol rather than the engine itself, so the engine can import this module and not the
    other way round."""

    tree: CallTree
    payload: ContextPayload  # its context (a folder's images are what llm_query(images=[name]) names)
    depth: int
    run_id: str
    usage_scopes: list[Usage]

    def new_call_id(self) -> str: ...

    def tools(self) -> list[Tool]: ...

    async def spawn_child(self, question: str, context: Any) -> RLMResult: ...


class SubcallHandler:
    def __init__(self, run: CallingRun) -> None:
        self.run = run
        self.config = run.tree.config

    async def __call__(self, fn: str, args: dict[str, Any]) -> Any:
        """The value for the REPL, or a CallbackError whose message is scrubbed of keys: what the
        host says goes into the sandbox, where the code that reads it is the model's."""
        redact = self.run.tree.trace.redact
        try:
            if fn == "tool":
                return await self._tool(args)
            return await self._subcall(fn, args)
        except CallbackError as exc:
            message = redact(str(exc))
            if fn != "tool" and self.config.subcall_errors == "return" and exc.kind in _CALL_FAILURES:
                return f"[error] {exc.kind}: {message}"
            raise CallbackError(exc.kind, message) from None
        except Exception as exc:  # a host-side bug: its message is the host's too
            error = CallbackError.of(exc)
            raise CallbackError(error.kind, redact(str(error))) from None

    async def _tool(self, args: dict[str, Any]) -> Any:
        name = str(args.get("name"))
        call_args, call_kwargs = args.get("args") or [], args.get("kwargs") or {}
        if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
            raise CallbackError("TypeError", f"{name}: malformed tool call from the REPL")
        # The tree's runner holds every host tool of the tree (sub-models' too, and those a child
        # is not given): code that writes its own call frames may name only its own run's.
        own = [t.name for t in self.run.tools() if t.where == "host"]
        if name not in own:
            raise CallbackError(
                "ToolError", f"there is no host tool named {name[:200]!r} here (tools: {', '.join(own) or 'none'})."
            )
        started = time.perf_counter()
        error: str | None = None
        try:
            return await self.run.tree.tool_runner.call(name, call_args, call_kwargs)
        except ToolFailure as exc:
            error = str(exc)
            raise CallbackError("ToolError", error) from None
        finally:
            self.run.tree.trace.emit(
                "tool_call",
                run_id=self.run.run_id,
                tool=name,
                where="host",
                caller="repl",
                duration_s=round(time.perf_counter() - started, 6),
                error=error,
            )

    async def _subcall(self, fn: str, args: dict[str, Any]) -> Any:
        handlers: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]] = {
            "llm_query": self._llm_query,
            "llm_query_batched": self._llm_query_batched,
            "rlm_query": self._rlm_query,
            "rlm_query_batched": self._rlm_query_batched,
        }
        if fn not in handlers:
            raise CallbackError("SubcallError", f"unknown host function {fn!r}")
        if self.config.max_depth <= 0:
            raise CallbackError(
                "SubcallError", f"{fn} is not available: this run has max_depth=0 (code only)."
            )
        return await handlers[fn](args)

    # -- plain model calls -------------------------------------------------------------------
    async def _llm_query(self, args: dict[str, Any]) -> str:
        prompt = _text_arg(args, "prompt", "llm_query")
        (images,), held = await self._fetched([self._images(args.get("images"))], "llm_query: images")
        try:
            return await self._one_llm(prompt, args.get("model"), images)
        finally:
            self.run.tree.image_hold.give(held)

    def _images(
        self, given: Any, where: str = "llm_query: images", blobs: list[Any] | None = None
    ) -> list[dict[str, Any]]:
        """The image parts of llm_query(images=[...]) (the worker's form: recursa/sandbox/worker/images.py);
        `blobs`: a batch's distinct image bytes as base64, which its parts name by index (each read
        into a part once, on first use)."""
        if given is None:
            return []
        if not isinstance(given, list) or not all(isinstance(g, dict) for g in given):
            raise CallbackError("TypeError", f"{where}: malformed images from the REPL")
        folder = self.run.payload.images
        parts: list[dict[str, Any]] = []
        try:
            for i, item in enumerate(given):
                at = f"{where}[{i}]"
                blob = item.get("blob")
                if isinstance(item.get("data"), str):
                    parts.append(base64_part(item["data"], at))
                elif blobs is not None and isinstance(blob, int) and 0 <= blob < len(blobs):
                    if isinstance(blobs[blob], str):
                        blobs[blob] = base64_part(blobs[blob], at)
                    parts.append(blobs[blob])
                elif isinstance(item.get("url"), str):
                    parts.append(url_part(item["url"], at))
                elif isinstance(item.get("path"), str):
                    name = item["path"].removeprefix("./")
                    if name not in folder:
                        known = ", ".join(sorted(folder)[:20]) or "none: the context is not a folder with images"
                        raise ImageError(
                            f"{at}: {name[:200]!r} is not an image file of the context (its image "
                            f"files: {known}); pass the image's bytes, or an https:// URL"
                        )
                    parts.append(bytes_part(folder[name], f"{at} ({name})"))
                else:
                    raise CallbackError("TypeError", f"{at}: malformed image from the REPL")
        except ImageError as exc:
            raise CallbackError("ValueError", str(exc)) from None
        return parts

    async def _llm_query_batched(self, args: dict[str, Any]) -> list[Any]:
        prompts = _list_arg(args, "prompts", "llm_query_batched")
        model = args.get("model")
        self._resolve_model(model)  # a refused model fails the whole batch once, not every item
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise CallbackError(
                    "TypeError", f"llm_query_batched: prompts[{i}] is {type(p).__name__}, not str"
                )
        images = self._batch_images(args, len(prompts))  # a refused image fails the batch before any call
        images, held = await self._fetched(images, "llm_query_batched: images")
        try:
            calls = [self._one_llm(p, model, images[i]) for i, p in enumerate(prompts)]
            items = await _gather_items(calls, self.run.tree.trace.redact)
        finally:
            self.run.tree.image_hold.give(held)
        return self._batch_outcome(items)

    async def _fetched(
        self, groups: list[list[dict[str, Any]]], where: str
    ) -> tuple[list[list[dict[str, Any]]], int]:
        """The images' URLs fetched by recursa (lm/images.py): a provider is sent bytes, never a URL.
        The bytes they hold count against the tree's `image_hold` until the caller gives them back."""
        try:
            return await fetched_parts(groups, where, self.run.tree.image_hold)
        except ImageError as exc:
            raise CallbackError("ValueError", str(exc)) from None

    def _batch_images(self, args: dict[str, Any], count: int) -> list[list[dict[str, Any]]]:
        lists, blobs = args.get("images"), args.get("image_data") or []
        if lists is None:
            return [[] for _ in range(count)]
        if not isinstance(lists, list) or len(lists) != count or not isinstance(blobs, list):
            raise CallbackError("TypeError", "llm_query_batched: malformed images from the REPL")
        blobs = list(blobs)  # each becomes its part on first use, shared by the prompts that name it
        return [
            self._images(given, f"llm_query_batched: images[{i}]", blobs) for i, given in enumerate(lists)
        ]

    def _batch_outcome(self, items: list[Any]) -> list[Any]:
        """In "return" mode failed items are error strings already: the REPL gets a plain list."""
        if self.config.subcall_errors != "return":
            return items
        return [
            f"[error] {item['__error__']['kind']}: {item['__error__']['message']}"
            if isinstance(item, dict) and "__error__" in item
            else item
            for item in items
        ]

    async def _one_llm(self, prompt: str, model: str | None, images: list[dict[str, Any]] | None = None) -> str:
        spec = self._resolve_model(model)
        run = self.run
        content: str | list[dict[str, Any]] = [{"type": "text", "text": prompt}, *images] if images else prompt
        # A dialect may open every sub-call with a system message of its peer's (an optional member:
        # a dialect object of the user's need not have it).
        system: str | None = getattr(run.dialect, "sub_system", None)

        async def call(messages: list[Message], tools: list[dict[str, Any]] | None) -> LMResponse:
            meta = CallMeta(
                call_id=run.new_call_id(), parent_id=run.run_id, depth=run.depth + 1, purpose="sub"
            )
            return await run.tree.gateway.call(
                spec,
                [{"role": "system", "content": system}, *messages] if system else messages,
                meta=meta,
                run_id=run.run_id,
                max_output_tokens=self.config.max_output_tokens,
                usage_scopes=run.usage_scopes,
                tools=tools,
            )

        try:
            if self.config.sub_tools:
                text = await call_with_tools(
                    call,
                    content,
                    self.config.sub_tools,
                    run.tree.tool_runner,
                    rounds=self.config.sub_tool_rounds,
                    trace=run.tree.trace,
                    run_id=run.run_id,
                )
            else:
                text = (await call([{"role": "user", "content": content}], None)).text
        except BudgetExceeded as exc:
            raise CallbackError("BudgetExceeded", str(exc)) from None
        except ContextLengthError as exc:
            raise CallbackError(
                "SubcallError",
                f"the prompt ({len(prompt):,} characters) is too long for {spec}: send less text per "
                f"call, e.g. split it in halves. ({exc})",
            ) from None
        except LMError as exc:
            raise CallbackError("SubcallError", f"the call to {spec} failed: {exc}") from None
        # A server that echoes the request's headers (a debugging proxy, a gateway's error text in
        # the reply) would hand the run's key to the REPL's code: the trace's scrub, on the way in.
        return run.tree.trace.redact.bulk(text)

    def _resolve_model(self, model: Any) -> str:
        if model is None:
            return self.config.sub_model
        if not isinstance(model, str) or not model:
            raise CallbackError("TypeError", "model= must be a model name such as 'openai/gpt-5-nano'")
        spec = model if "/" in model else f"{parse_model(self.config.sub_model)[0]}/{model}"
        allowed = self.config.subcall_models()
        if spec not in allowed:
            # Generated code must not pick any model the keys can reach (cost, data routing): only
            # those the RLM was configured with.
            raise CallbackError(
                "SubcallError",
                f"model {model[:200]!r} is not available to this run; llm_query(model=...) may use: "
                f"{', '.join(allowed)} (or leave model=None for {allowed[0]}).",
            )
        try:
            provider, name = parse_model(spec)
        except ValueError as exc:
            raise CallbackError("ValueError", str(exc)) from None
        if self.config.budget.max_usd is not None and not self.run.tree.gateway.prices.known(provider, name):
            raise CallbackError(
                "ValueError",
                f"model {spec!r} has no known price, and this run has a dollar budget; use the default "
                "sub-model or one with a known price.",
            )
        return spec

    # -- child RLMs ----------------------------------------------------------------------------
    async def _rlm_query(self, args: dict[str, Any]) -> str:
        prompt = _text_arg(args, "prompt", "rlm_query")
        return await self._one_child(prompt, args.get("context"))

    async def _rlm_query_batched(self, args: dict[str, Any]) -> list[Any]:
        prompts = _list_arg(args, "prompts", "rlm_query_batched")
        contexts = args.get("contexts")
        if contexts is None:
            contexts = [None] * len(prompts)
        elif not isinstance(contexts, list) or len(contexts) != len(prompts):
            raise CallbackError(
                "ValueError",
                f"rlm_query_batched: got {len(prompts)} prompts but contexts is not a list of the same "
                "length; pass one context per prompt (or None).",
            )
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise CallbackError(
                    "TypeError", f"rlm_query_batched: prompts[{i}] is {type(p).__name__}, not str"
                )
        children = [self._one_child(p, c) for p, c in zip(prompts, contexts, strict=True)]
        return self._batch_outcome(await _gather_items(children, self.run.tree.trace.redact))

    async def _one_child(self, prompt: str, context: Any) -> str:
        run = self.run
        if run.depth + 1 >= self.config.max_depth:
            # At the last level a child would have no sub-calls of its own: a plain call does the job.
            text = prompt if context is None else f"{prompt}\n\n{context_text(context)}"
            return await self._one_llm(text, None)
        if run.tree.child_call is not None:
            return await self._handed_child(prompt, context)
        question = prompt if context is not None else PROMPT_AS_CONTEXT_QUESTION
        try:
            result = await run.spawn_child(question, context if context is not None else prompt)
        except ContextError as exc:
            raise CallbackError("ValueError", f"rlm_query: {exc}") from None
        if result.stop_reason == "final" or result.answer:
            return result.answer
        raise CallbackError(
            "BudgetExceeded" if result.stop_reason == "budget" else "SubcallError",
            f"the child RLM stopped without an answer ({result.stop_reason}): {result.error or ''}".strip(),
        )

    async def _handed_child(self, prompt: str, context: Any) -> str:
        """A child the trainer runs with its own engine and environment (recursa.env's child_call):
        its turns are the trainer's rollouts, so they are not in this tree's trace or budget."""
        run = self.run
        async with run.tree.child_slots(run.depth + 1):
            try:
                outcome = await call_trainer_fn(
                    run.tree.child_call, prompt, context, run.depth + 1, run.run_id
                )
            except Exception as exc:  # the trainer's function failed: a failed call, as a server error is
                raise CallbackError(
                    "SubcallError", f"rlm_query: the trainer's child run failed: {type(exc).__name__}: {exc}"
                ) from None
        if not isinstance(outcome, str):
            raise CallbackError(
                "SubcallError",
                f"rlm_query: the trainer's child_call returned {type(outcome).__name__}; it must return the "
                "child's answer as a str",
            )
        return outcome


def _is_async(fn: Any) -> bool:
    """An async function, or an object whose __call__ is one."""
    call = type(fn).__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) else None
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


async def call_trainer_fn(fn: Callable[..., Any], *args: Any) -> Any:
    """What a trainer's function (child_call, sub_call, a scorer) returns: an async one runs on the loop, a
    plain one on a thread. One that blocks (a call to the trainer's engine) ran on the loop and
    stalled every run on it, and every clock there: a reply's time for code, a request timeout."""
    outcome = fn(*args) if _is_async(fn) else await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(outcome):
        outcome = await outcome
    return outcome


async def _gather_items(coros: list[Awaitable[str]], redact: Callable[[str], str]) -> list[Any]:
    """Run every item; a failed item becomes an error record (its message scrubbed with `redact`)
    so paid-for answers are never lost.

    The REPL side turns the records back into exceptions when every item failed, and otherwise
    returns the answers with the failures marked.

    Items start one per turn of the event loop, so the first request is on the wire while the next
    are still being built: started all at once, a batch sends nothing until every item is built
    (docs/performance.md, "Figures behind choices in the code").
    """
    tasks: list[asyncio.Future[str]] = []
    try:
        for coro in coros:
            tasks.append(asyncio.ensure_future(coro))
            await asyncio.sleep(0)
    except BaseException:
        for task in tasks:
            task.cancel()
        for coro in coros[len(tasks) :]:
            coro.close()  # type: ignore[attr-defined]
        raise
    results = await asyncio.gather(*tasks, return_exceptions=True)
    out: list[Any] = []
    for item in results:
        if isinstance(item, CallbackError):
            out.append({"__error__": {"kind": item.kind, "message": redact(str(item))}})
        elif isinstance(item, BaseException):
            if isinstance(item, asyncio.CancelledError):
                raise item
            out.append({"__error__": {"kind": "SubcallError", "message": redact(str(item))}})
        else:
            out.append(item)
    return out


def _text_arg(args: dict[str, Any], name: str, fn: str) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise CallbackError("TypeError", f"{fn}: {name} must be a str, got {type(value).__name__}")
    return value


def _list_arg(args: dict[str, Any], name: str, fn: str) -> list[Any]:
    value = args.get(name)
    if not isinstance(value, list):
        raise CallbackError("TypeError", f"{fn}: {name} must be a list of str, got {type(value).__name__}")
    return value
