"""The public entry point: `RLM(...)`, then `run`, `arun` or `completion`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recursa.budget import Budget
from recursa.config import RLMConfig
from recursa.context import load_payload
from recursa.errors import ConfigError
from recursa.lm.base import estimate_tokens_upper
from recursa.lm.custom import ClientSet
from recursa.lm.prices import ModelPrice, PriceBook
from recursa.lm.registry import make_client, parse_model
from recursa.loop.answer_schema import AnswerCheck
from recursa.loop.dialects import checked_dialect
from recursa.loop.engine import RunEngine
from recursa.loop.options import RunOptions
from recursa.loop.prompts import fixed_text, template_for
from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION
from recursa.loop.tree import CallTree, new_id
from recursa.result import RLMResult
from recursa.sandbox import SANDBOX_KINDS
from recursa.session import Session
from recursa.sync import run_sync
from recursa.tools.mcp_config import parse_mcp_servers
from recursa.tools.spec import Tool, make_sub_tools, make_tools


class RLM:
    """A Recursive Language Model: string in, string out, over contexts of any size.

    Construction validates everything it can (model names, keys, prices for a dollar budget,
    sandbox kind) so mistakes surface before any spend.

    `model`, `sub_model` and the entries of `allowed_models` are "provider/model" names or LM client
    objects: anything with a `complete(request)` method, async or not (docs/clients.md).

    Args:
        model: the root model, which writes the REPL code.
        sub_model: the model behind `llm_query` and child runs' turns (default: `model`).
        base_url: an OpenAI-compatible server for the `openai` provider (vLLM, Ollama, ...).
        api_key: the provider key (default: OPENAI_API_KEY / ANTHROPIC_API_KEY).
        max_depth: 0 runs code only; 1 adds `llm_query` sub-calls; 2 or more, child RLMs.
        max_iterations: root turns before one last call asks for the answer.
        budget: hard caps over the whole call tree (docs/concepts.md, "Budgets are hard caps").
        sandbox: where the REPL runs: "auto", "subprocess", "inprocess", "docker", "podman",
            "modal" or "e2b" (docs/sandbox.md).
        sandbox_options: passed to the sandbox, e.g. {"hardening": Hardening(...)}.
        exec_timeout: seconds one REPL cell may run before it is interrupted.
        turn_timeout: seconds all the code of one reply may run together (default: exec_timeout);
            each block runs at most exec_timeout and what is left of this (docs/concepts.md).
        max_output_chars: REPL output shown to the root per cell (head and tail beyond it).
        max_concurrency: model calls in flight at once over the whole tree.
        max_parallel_children: child runs at once, per depth level.
        per_model_concurrency: a lower limit of calls in flight for named models.
        trace_dir: where JSONL traces go (default: $XDG_CACHE_HOME or ~/.cache, then recursa/traces).
        trace: False writes no trace file.
        prompt: the root's prompt template: a built-in name or a file (default: by model family).
        max_output_tokens: each call's output limit, reserved in the budget before it is sent.
        sub_model_chars: how much text one sub-call can take, as the root's prompt states it.
        prices: US dollars per million tokens per model, for models without a known price.
        request_timeout: seconds one model request may take.
        max_retries: retries of one failed model call.
        on_event: called with every trace event as it happens (e.g. an OtelListener).
        call_headers: send the X-RLM-* attribution headers with every call (off by default).
        sampling: request options per role, "root", "child" and "sub" (docs/training.md).
        subcall_errors: a sub-call that fails for good "raise"s in the REPL or "return"s an
            "[error] ..." string.
        max_run_retries: model-call retries summed over the whole tree.
        tools: functions the REPL code may call (docs/tools.md).
        tools_for_children: child runs get `tools` too.
        sub_tools: functions only sub-models call, through function calling.
        sub_tool_rounds: tool turns a sub-model may take before it must answer.
        mcp_servers: MCP servers whose tools the REPL code (or sub-models) call, connected for each
            run or session: a list of entries as MCP clients configure them, a dict name -> entry,
            or a JSON config file (docs/tools.md, "MCP servers").
        tips: strategy text added to the root's prompt.
        root_window_tokens: compact the root's history past 80% of this many tokens.
        allowed_models: further models generated code may name in `llm_query(model=...)`.
        unfenced_code: run Python a reply writes without a ```repl fence (docs/concepts.md, "How
            replies are read"); False only tells the model to fence its code.
        cache_subcalls: answer identical sub-calls (model, messages, sampling, tools) once per
            run or session; `result.usage.cache_hits` counts the calls answered from the cache.
        context_windows: tokens per call by model, over genai-prices' figures (docs/concepts.md,
            "Context windows").
        dialect: the conversation the root sees: "recursa" (default), "tools" (native tool calls),
            "rlms", "skyrl", "verifiers", or a Dialect object (docs/dialects.md).
        dialect_options: options of a named dialect, e.g. {"tool_name": "python"} for "tools".
    """

    def __init__(
        self,
        model: str | Any,
        sub_model: str | Any | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_depth: int = 1,
        max_iterations: int = 30,
        budget: Budget | None = None,
        sandbox: str = "auto",
        sandbox_options: dict[str, Any] | None = None,
        exec_timeout: float = 120.0,
        turn_timeout: float | None = None,
        max_output_chars: int = 20_000,
        max_concurrency: int = 64,
        max_parallel_children: int = 32,
        per_model_concurrency: dict[str, int] | None = None,
        trace_dir: str | Path | None = None,
        trace: bool = True,
        prompt: str | Path | None = None,
        max_output_tokens: int = 16_384,
        sub_model_chars: int = 500_000,
        prices: dict[str, ModelPrice | dict[str, float]] | None = None,
        request_timeout: float = 600.0,
        max_retries: int = 4,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        call_headers: bool = False,
        sampling: dict[str, dict[str, Any]] | None = None,
        subcall_errors: str = "raise",
        max_run_retries: int = 200,
        tools: Sequence[Callable[..., Any]] = (),
        tools_for_children: bool = True,
        sub_tools: Sequence[Callable[..., Any]] = (),
        sub_tool_rounds: int = 8,
        mcp_servers: Any = None,
        tips: str | None = None,
        root_window_tokens: int | None = None,
        allowed_models: Sequence[str | Any] = (),
        unfenced_code: bool = True,
        cache_subcalls: bool = False,
        context_windows: dict[str, int] | None = None,
        dialect: str | Any = "recursa",
        dialect_options: dict[str, Any] | None = None,
    ) -> None:
        # A model may be a "provider/model" name or an LM client object (docs/clients.md).
        clients = ClientSet()
        model = clients.spec(model, "RLM(model=...)")
        sub_model = (
            model if sub_model is None or sub_model == "" else clients.spec(sub_model, "RLM(sub_model=...)")
        )
        if isinstance(allowed_models, (list, tuple)):
            allowed_models = [clients.spec(m, "RLM(allowed_models=[...])") for m in allowed_models]
        self.config = RLMConfig(
            model=model,
            sub_model=sub_model,
            base_url=base_url,
            api_key=api_key,
            max_depth=max_depth,
            max_iterations=max_iterations,
            budget=budget if budget is not None else Budget(),
            sandbox=sandbox,
            sandbox_options=dict(sandbox_options) if isinstance(sandbox_options, dict) else sandbox_options,
            exec_timeout=exec_timeout,
            turn_timeout=turn_timeout,
            max_output_chars=max_output_chars,
            max_concurrency=max_concurrency,
            max_parallel_children=max_parallel_children,
            per_model_concurrency=per_model_concurrency,
            trace_dir=Path(trace_dir) if trace_dir is not None else None,
            trace=trace,
            prompt=prompt,
            max_output_tokens=max_output_tokens,
            sub_model_chars=sub_model_chars,
            prices=prices,
            request_timeout=request_timeout,
            max_retries=max_retries,
            on_event=on_event,
            call_headers=call_headers,
            sampling=sampling,
            subcall_errors=subcall_errors,
            max_run_retries=max_run_retries,
            tools=make_tools(list(tools)),
            tools_for_children=tools_for_children,
            sub_tools=make_sub_tools(list(sub_tools)),
            sub_tool_rounds=sub_tool_rounds,
            mcp_servers=parse_mcp_servers(mcp_servers),  # type: ignore[arg-type]
            tips=tips,
            root_window_tokens=root_window_tokens,
            allowed_models=allowed_models,  # type: ignore[arg-type]  (validate() names a wrong type)
            clients=dict(clients.clients),
            unfenced_code=unfenced_code,
            cache_subcalls=cache_subcalls,
            context_windows=dict(context_windows) if isinstance(context_windows, dict) else context_windows,
            dialect=dialect,
            dialect_options=dialect_options,
        )
        self.config.validate()
        checked_dialect(dialect, dialect_options, "RLM")
        _check_tool_names(self.config.tools, self.config.sub_tools)
        self.prices = PriceBook(prices)
        clients.alias_prices(self.prices)
        for spec in self.config.subcall_models():
            provider, name = parse_model(spec)
            if spec not in clients.clients:
                # Building a client checks the provider and the key now rather than mid-run.
                make_client(spec, base_url=base_url, api_key=api_key)
            if self.config.budget.max_usd is not None and not self.prices.known(provider, name):
                raise ConfigError(
                    f"max_usd is set but no price is known for {spec!r}. Give one with "
                    f'RLM(..., prices={{"{spec}": {{"input_per_mtok": 0.25, "output_per_mtok": 2.0}}}}) '
                    "(US dollars per million tokens), or drop max_usd and cap max_tokens instead."
                )
        if sandbox not in SANDBOX_KINDS:
            raise ConfigError(f"unknown sandbox {sandbox!r}; choose one of: {', '.join(SANDBOX_KINDS)}")
        _check_first_call(self.config, self.prices)

    def __repr__(self) -> str:
        c = self.config
        return f"RLM(model={c.model!r}, sub_model={c.sub_model!r}, max_depth={c.max_depth}, sandbox={c.sandbox!r})"

    async def arun(
        self, question: str, context: Any, *, tips: str | None = None, answer_schema: Any = None
    ) -> RLMResult:
        """Answer `question` over `context` (str, list[str], dict[str, str], UTF-8 bytes, a Path, or a
        ConfinedPath). A folder is read without following links out of it (`result.skipped_files`).

        `tips`: task strategy added to the root's prompt for this run (default: `RLM(tips=...)`).
        `answer_schema`: a pydantic model (or any type pydantic validates); the final value must fit
        it, the model is told what failed otherwise, and `result.value` is the validated object.
        """
        options = self.run_options(question, tips=tips, answer_schema=answer_schema)
        payload = await load_payload(context)
        run_id = new_id("run")
        tree = CallTree.create(self.config, self.prices, run_id)
        try:
            await tree.connect_mcp()
            engine = RunEngine(
                tree, self.prices, question=question, payload=payload, run_id=run_id, options=options
            )
            return await engine.run()
        finally:
            await asyncio.shield(tree.aclose())
            payload.close()

    def run(
        self, question: str, context: Any, *, tips: str | None = None, answer_schema: Any = None
    ) -> RLMResult:
        """The blocking form of `arun`. Safe to call from inside a running event loop (notebooks)."""
        return run_sync(self.arun(question, context, tips=tips, answer_schema=answer_schema))

    def run_options(self, question: str, *, tips: str | None, answer_schema: Any) -> RunOptions:
        """Check one question's per-run choices before anything starts."""
        if not isinstance(question, str) or not question.strip():
            raise ConfigError("the question is empty: pass the question to answer as a non-empty str.")
        if tips is not None and not isinstance(tips, str):
            raise ConfigError(f"tips= takes a str of strategy text, not {type(tips).__name__}.")
        check = AnswerCheck.of(answer_schema) if answer_schema is not None else None
        return RunOptions(tips=tips if tips is not None else self.config.tips, answer_check=check)

    def session(self, context: Any) -> Session:
        """Several questions over one context: one REPL, loaded once, variables kept between questions.

        `with rlm.session(ctx) as s: s.ask(q1); s.ask(q2)`, or `async with` and `await s.aask(q)`.
        """
        return Session(self, context)

    async def acompletion(self, prompt: str) -> RLMResult:
        """LLM-compatible: the whole prompt is the context, and the RLM carries out its request."""
        return await self.arun(PROMPT_AS_CONTEXT_QUESTION, prompt)

    def completion(self, prompt: str) -> RLMResult:
        return run_sync(self.acompletion(prompt))


def _check_first_call(config: RLMConfig, prices: PriceBook) -> None:
    """A budget too small for the root's first call would stop every run at once, with a message
    written for the model: say so now, with the numbers. The floor counts only what every first call
    holds (the system prompt's fixed text, a token per byte as reservations do, and
    max_output_tokens), so a budget refused here could never have run."""
    budget = config.budget
    if budget.max_tokens is None and budget.max_usd is None:
        return
    system = fixed_text(template_for(config.model, config.prompt))
    prompt = estimate_tokens_upper([{"role": "system", "content": system}, {"role": "user", "content": ""}])
    out = config.max_output_tokens
    if budget.max_tokens is not None and budget.max_tokens < prompt + out:
        need = prompt + out
        raise ConfigError(
            f"Budget(max_tokens={budget.max_tokens}) is less than the root's first call reserves before it "
            f"is sent: at least {need:,} tokens (its system prompt, {prompt:,} at a token per byte, plus "
            f"max_output_tokens ({out:,})), so every run would stop at once. Raise max_tokens well above "
            f"{need:,} (a run makes several calls), or lower max_output_tokens."
        )
    if budget.max_usd is not None:
        provider, name = parse_model(config.model)
        cost = prices.worst_case(provider, name, prompt, out)
        if cost is not None and budget.max_usd < cost:
            raise ConfigError(
                f"Budget(max_usd={budget.max_usd:g}) is less than the root's first call of {config.model!r} "
                f"can cost, which is reserved before it is sent: at least ${cost:.4f} ({prompt:,} prompt "
                f"tokens and max_output_tokens ({out:,}) at its price), so every run would stop at once. "
                "Raise max_usd well above that (a run makes several calls), or lower max_output_tokens."
            )


def _check_tool_names(tools: list[Tool], sub_tools: list[Tool]) -> None:
    for sub in sub_tools:
        for tool in tools:
            if tool.name == sub.name and tool.fn is not sub.fn:
                raise ConfigError(
                    f"RLM(tools=..., sub_tools=...): two different functions are named {tool.name!r}; "
                    "rename one (the same function may be in both lists)."
                )
