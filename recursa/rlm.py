"""The public entry point: `RLM(...)`, then `run`, `arun` or `completion`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from recursa.budget import Budget
from recursa.config import DEFAULTS as D
from recursa.config import RLMConfig, Spelling
from recursa.configure import build_config, check_models
from recursa.context import load_payload
from recursa.errors import ConfigError
from recursa.lm.base import estimate_tokens_upper
from recursa.lm.prices import ModelPrice, PriceBook
from recursa.lm.registry import parse_model
from recursa.loop.answer_schema import AnswerCheck
from recursa.loop.engine import RunEngine
from recursa.loop.options import RunOptions
from recursa.loop.prompts import fixed_text, template_for
from recursa.loop.subcalls import PROMPT_AS_CONTEXT_QUESTION
from recursa.loop.tree import CallTree, new_id
from recursa.result import RLMResult
from recursa.session import Session
from recursa.sync import run_sync


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
        sandbox: where the REPL runs, a name of `recursa.sandbox.SANDBOXES` (docs/sandbox.md).
        sandbox_options: passed to the sandbox, e.g. {"hardening": Hardening(...)}.
        exec_timeout: seconds one REPL cell may run before it is interrupted.
        turn_timeout: seconds all the code of one reply may run together (default: exec_timeout);
            each block runs at most exec_timeout and what is left of this (docs/concepts.md).
        trace_dir: where JSONL traces go (default: $XDG_CACHE_HOME or ~/.cache, then recursa/traces).
        prompt: the root's prompt template: a built-in name or a file (default: by model family).
        max_output_tokens: each call's output limit, reserved in the budget before it is sent.
        prices: US dollars per million tokens per model, for models without a known price.
        on_event: called with every trace event as it happens (e.g. an OtelListener).
        tools: functions the REPL code may call (docs/tools.md).
        sub_tools: functions only sub-models call, through function calling.
        mcp_servers: MCP servers whose tools the REPL code (or sub-models) call, connected for each
            run or session: a list of entries as MCP clients configure them, a dict name -> entry,
            or a JSON config file (docs/tools.md, "MCP servers").
        tips: strategy text added to the root's prompt.
        allowed_models: further models generated code may name in `llm_query(model=...)`.
        dialect: the conversation the root sees: "recursa" (default), "tools" (native tool calls),
            "rlms", "skyrl", "verifiers", or a Dialect object (docs/dialects.md).
        **settings: any other setting of `recursa.config.RLMConfig` (trace, max_concurrency,
            sampling, subcall_errors, cache_subcalls, context_windows, dialect_options, ...): the settings page (docs/reference/settings.md) lists
            each with its default.
    """

    def __init__(
        self,
        model: str | Any,
        sub_model: str | Any | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_depth: int = D.max_depth,
        max_iterations: int = D.max_iterations,
        budget: Budget | None = None,
        sandbox: str = D.sandbox,
        sandbox_options: dict[str, Any] | None = None,
        exec_timeout: float = D.exec_timeout,
        turn_timeout: float | None = D.turn_timeout,
        trace_dir: str | Path | None = None,
        prompt: str | Path | None = None,
        max_output_tokens: int = D.max_output_tokens,
        prices: dict[str, ModelPrice | dict[str, float]] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        tools: Sequence[Callable[..., Any]] = (),
        sub_tools: Sequence[Callable[..., Any]] = (),
        mcp_servers: Any = None,
        tips: str | None = None,
        allowed_models: Sequence[str | Any] = (),
        dialect: str | Any = D.dialect,
        **settings: Any,
    ) -> None:
        given = {k: v for k, v in locals().items() if k not in ("self", "settings", "__class__")}
        self._configure(given | settings, Spelling("python", "RLM"))

    @classmethod
    def configured(cls, settings: Mapping[str, Any], spelling: Spelling) -> RLM:
        """The RLM of `settings` (by schema name) whose errors name each setting as `spelling` writes
        it: how a front door other than Python's (the CLI's flags) makes one."""
        rlm = cls.__new__(cls)
        rlm._configure(dict(settings), spelling)
        return rlm

    def _configure(self, given: dict[str, Any], spelling: Spelling) -> None:
        self.spelling = spelling  # how a stop reason names a setting: as the caller writes it
        self.config, self.prices = build_config(given, spelling)
        check_runs(self.config, self.prices, spelling)

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
        tree = CallTree.create(self.config, self.prices, run_id, self.spelling)
        try:
            await tree.connect_mcp()
            engine = RunEngine(
                tree, question=question, payload=payload, run_id=run_id, options=options
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


def check_runs(config: RLMConfig, prices: PriceBook, spelling: Spelling) -> None:
    """What RLM(...) checks of a config beyond the schema, before any run: a provider, a key and
    (with max_usd) a price for each model its runs call, and a budget that lets the root's first
    call through. A door that made the config itself calls it on that config (ServeSettings)."""
    check_models(config, prices, config.subcall_models(), spelling)
    _check_first_call(config, prices, spelling)


def _check_first_call(config: RLMConfig, prices: PriceBook, spelling: Spelling) -> None:
    """A budget too small for the root's first call would stop every run at once, with a message
    written for the model: say so now, with the numbers. The floor counts only what every first call
    holds (the system prompt's fixed text, a token per byte as reservations do, and
    max_output_tokens), so a budget refused here could never have run."""
    budget = config.budget
    if budget.max_tokens is None and budget.max_usd is None:
        return
    system = fixed_text(template_for(config.model, config.prompt))
    prompt = estimate_tokens_upper([{"role": "system", "content": system}, {"role": "user", "content": ""}])
    out, out_name = config.max_output_tokens, spelling.label("max_output_tokens")
    if budget.max_tokens is not None and budget.max_tokens < prompt + out:
        need = prompt + out
        raise ConfigError(
            f"{spelling.given('max_tokens', budget.max_tokens)} is less than the root's first call reserves "
            f"before it is sent: at least {need:,} tokens (its system prompt, {prompt:,} at a token per "
            f"byte, plus {out_name} ({out:,})), so every run would stop at once. Raise "
            f"{spelling.label('max_tokens')} well above {need:,} (a run makes several calls), or lower {out_name}."
        )
    if budget.max_usd is not None:
        provider, name = parse_model(config.model)
        cost = prices.worst_case(provider, name, prompt, out)
        if cost is not None and budget.max_usd < cost:
            raise ConfigError(
                f"{spelling.given('max_usd', budget.max_usd)} is less than the root's first call of "
                f"{config.model!r} can cost, which is reserved before it is sent: at least ${cost:.4f} "
                f"({prompt:,} prompt tokens and {out_name} ({out:,}) at its price), so every run would stop "
                f"at once. Raise {spelling.label('max_usd')} well above that (a run makes several calls), "
                f"or lower {out_name}."
            )

