"""Every setting of an RLM, validated once, shared by all runs of a call tree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.budget import Budget
from recursa.errors import ConfigError
from recursa.lm.prices import ModelPrice

DEFAULT_MAX_OUTPUT_TOKENS = 16_384
SAMPLING_ROLES = ("root", "child", "sub")
# The prompt templates shipped with the loop (files in recursa/loop/prompts/): the names RLM(prompt=) takes.
# "qwen", "small" and "claude" are the default prompt with a family's advice added (loop/prompts.py).
BUILTIN_TEMPLATES = ("default", "qwen", "small", "claude", "answer-dict")


@dataclass
class RLMConfig:
    model: str
    sub_model: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_depth: int = 1
    max_iterations: int = 30
    budget: Budget = field(default_factory=Budget)
    sandbox: str = "auto"
    sandbox_options: dict[str, Any] | None = None  # passed to the sandbox's constructor
    exec_timeout: float = 120.0
    # Seconds for all the code of one reply together (loop/blocks.py); None: the same as exec_timeout.
    turn_timeout: float | None = None
    max_output_chars: int = 20_000
    max_concurrency: int = 64
    max_parallel_children: int = 32  # child runs (each with its own REPL process) at once, per depth
    per_model_concurrency: dict[str, int] | None = None
    trace_dir: Path | None = None
    trace: bool = True
    prompt: str | Path | None = None
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    sub_model_chars: int = 500_000
    prices: dict[str, ModelPrice | dict[str, float]] | None = None
    request_timeout: float = 600.0
    max_retries: int = 4
    on_event: Callable[[dict[str, Any]], None] | None = None
    call_headers: bool = False  # X-RLM-* attribution headers are opt-in (issue 7)
    sampling: dict[str, dict[str, Any]] | None = None
    # What generated code gets when a sub-call fails for good: "raise" an exception in the REPL, or
    # "return" the error as a str starting with "[error]" (issue 8).
    subcall_errors: str = "raise"
    max_run_retries: int = 200  # retries summed over every call of the tree (a per-run cap)
    # Tools (issue 9): REPL tools, tools only sub-models call, strategy tips, root-window compaction.
    tools: list[Any] = field(default_factory=list)
    tools_for_children: bool = True
    sub_tools: list[Any] = field(default_factory=list)
    sub_tool_rounds: int = 8
    # MCP servers whose tools join `tools` / `sub_tools` for each call tree (tools/mcp_config.py).
    mcp_servers: list[Any] = field(default_factory=list)
    tips: str | None = None
    root_window_tokens: int | None = None
    # Models generated code may name in llm_query(model=...), besides model and sub_model (issue 16).
    allowed_models: list[str] = field(default_factory=list)
    # LM client objects given in place of model names (lm/custom.py), by the "client/<name>" spec
    # that stands for each in model, sub_model and allowed_models.
    clients: dict[str, Any] = field(default_factory=dict, repr=False)
    # A reply with no code block whose lines are plain Python runs them (loop/unfenced.py); False only
    # tells the model that code runs from ```repl blocks.
    unfenced_code: bool = True
    # Identical sub-calls (model, messages, sampling, tools) answered once per call tree, session or
    # RLMEnv group (lm/call_cache.py).
    cache_subcalls: bool = False
    # Tokens per call by model ("provider/model" or a bare name), over genai-prices' figures (lm/windows.py).
    context_windows: dict[str, int] | None = None
    # The conversation the root sees (recursa/loop/dialects/): a registered name or a Dialect object,
    # and the options of a named one (e.g. the "tools" dialect's tool_name and tool_argument).
    dialect: Any = "recursa"
    dialect_options: dict[str, Any] | None = None

    def validate(self) -> None:
        """Raise ConfigError for the first setting that cannot work, naming it and a value that would."""

        # option -> (smallest value, a value that works); ints, except the seconds below
        minimums: dict[str, tuple[int, str]] = {
            "max_depth": (0, "1"),
            "max_iterations": (1, "30"),
            "max_output_chars": (200, "20_000"),
            "max_concurrency": (1, "64"),
            "max_parallel_children": (1, "32"),
            "max_output_tokens": (1, "16_384"),
            "sub_model_chars": (1, "500_000"),
            "max_retries": (0, "4"),
            "max_run_retries": (0, "200"),
            "sub_tool_rounds": (1, "8"),
        }
        numbers: list[tuple[str, Any, bool, str, str]] = [
            (
                name,
                getattr(self, name),
                _is_int(getattr(self, name)) and getattr(self, name) >= low,
                f"an int >= {low}",
                ex,
            )
            for name, (low, ex) in minimums.items()
        ]
        numbers += [
            (
                name,
                getattr(self, name),
                _is_number(getattr(self, name)) and getattr(self, name) > 0,
                "a number of seconds > 0",
                ex,
            )
            for name, ex in (("exec_timeout", "120"), ("request_timeout", "600"))
        ]
        turn = self.turn_timeout
        numbers.append(
            (
                "turn_timeout",
                turn,
                turn is None or (_is_number(turn) and turn > 0),
                "a number of seconds > 0 (or None: the same as exec_timeout)",
                "120",
            )
        )
        window = self.root_window_tokens
        numbers.append(
            (
                "root_window_tokens",
                window,
                window is None or (_is_int(window) and window >= 1_000),
                "None (no compaction) or an int of at least 1000",
                "None",
            )
        )
        for name, value, ok, what, example in numbers:
            if not ok:
                raise ConfigError(f"RLM({name}={value!r}): {name} must be {what}; e.g. {name}={example}.")
        if not isinstance(self.unfenced_code, bool):
            raise ConfigError(
                f"RLM(unfenced_code={self.unfenced_code!r}): unfenced_code must be True (run Python a reply "
                "writes outside a code block) or False (only tell the model to use a ```repl block)."
            )
        if not isinstance(self.cache_subcalls, bool):
            raise ConfigError(
                f"RLM(cache_subcalls={self.cache_subcalls!r}): cache_subcalls must be True (identical "
                "sub-calls are answered once) or False (every sub-call is sent)."
            )
        windows = self.context_windows
        if windows is not None and (
            not isinstance(windows, dict)
            or any(not isinstance(k, str) or not _is_int(v) or v < 1 for k, v in windows.items())
        ):
            raise ConfigError(
                f"RLM(context_windows={windows!r}): give a dict of model name to its window in tokens, "
                "an int >= 1, e.g. context_windows={'openai/my-vllm-model': 32_768}."
            )
        if self.subcall_errors not in ("raise", "return"):
            raise ConfigError(
                f"RLM(subcall_errors={self.subcall_errors!r}): subcall_errors must be 'raise' (an exception "
                "in the REPL) or 'return' (an '[error] ...' str)."
            )
        if not isinstance(self.allowed_models, list) or not all(
            isinstance(m, str) for m in self.allowed_models
        ):
            raise ConfigError(
                "RLM(allowed_models=...) takes a list of model names that generated code may pass to "
                "llm_query(model=...), e.g. allowed_models=['openai/gpt-5-nano']."
            )
        if not isinstance(self.budget, Budget):
            raise ConfigError("RLM(budget=...) takes a recursa.Budget(max_usd=..., max_tokens=..., ...).")
        sampling = self.sampling or {}
        if not isinstance(sampling, dict) or any(
            role not in SAMPLING_ROLES or not isinstance(opts, dict) for role, opts in sampling.items()
        ):
            raise ConfigError(
                "RLM(sampling=...) maps roles to request options, e.g. {'root': {'temperature': 1.0, "
                "'seed': 7, 'logprobs': True}, 'sub': {'temperature': 0.0}}; roles: "
                + ", ".join(SAMPLING_ROLES)
                + "."
            )
        limits = self.per_model_concurrency
        if limits is not None and (
            not isinstance(limits, dict)
            or any(not isinstance(k, str) or not _is_int(v) or v < 1 for k, v in limits.items())
        ):
            raise ConfigError(
                f"RLM(per_model_concurrency={limits!r}): give a dict of model name to an int >= 1, "
                "e.g. per_model_concurrency={'openai/gpt-5-mini': 16}."
            )
        for key, price in (self.prices or {}).items():
            rates = price if isinstance(price, dict) else getattr(price, "__dict__", {})
            bad = {k: v for k, v in rates.items() if v is not None and (not _is_number(v) or v < 0)}
            if bad:
                raise ConfigError(
                    f"RLM(prices=...): the price of {key!r} has {bad}; rates are USD per million tokens, "
                    "numbers >= 0, e.g. {'input_per_mtok': 0.25, 'output_per_mtok': 2.0}."
                )
        if self.on_event is not None and not callable(self.on_event):
            raise ConfigError("RLM(on_event=...) must be a function taking one event dict, or None.")
        if self.tips is not None and not isinstance(self.tips, str):
            raise ConfigError(
                f"RLM(tips={self.tips!r}): tips must be a str of advice for the model, or None."
            )
        if self.trace_dir is not None and self.trace_dir.exists() and not self.trace_dir.is_dir():
            raise ConfigError(
                f"RLM(trace_dir={str(self.trace_dir)!r}) is a file, not a folder; pass a folder for the "
                "trace files (it is created if missing), or trace=False for no trace."
            )
        if self.prompt is not None:
            name = str(self.prompt)
            if name not in BUILTIN_TEMPLATES and not Path(name).is_file():
                raise ConfigError(
                    f"RLM(prompt={name!r}) is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                    "nor an existing file; pass one of those names or the path of a template file."
                )
        options = self.sandbox_options
        if options is not None and (
            not isinstance(options, dict) or not all(isinstance(k, str) for k in options)
        ):
            raise ConfigError(
                f"RLM(sandbox_options={options!r}): give a dict of option names to values, "
                "e.g. sandbox_options={'start_timeout': 30}."
            )
        if options:
            # Checked now so that a misspelt option fails before any spend, not when the REPL starts.
            import inspect

            from recursa import sandbox as sandboxes

            classes = {
                "auto": sandboxes.SubprocessSandbox,
                "subprocess": sandboxes.SubprocessSandbox,
                "inprocess": sandboxes.InProcessSandbox,
                "docker": sandboxes.ContainerSandbox,
                "podman": sandboxes.ContainerSandbox,
                "modal": sandboxes.ModalSandbox,
                "e2b": sandboxes.E2BSandbox,
            }
            cls = classes.get(self.sandbox)
            params = inspect.signature(cls).parameters if cls is not None else {}
            if cls is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                accepted = sorted(
                    n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                )
                accepted = [n for n in accepted if n != "kind"]  # make_sandbox passes the kind itself
                unknown = sorted(set(options) - set(accepted))
                if unknown:
                    raise ConfigError(
                        f"RLM(sandbox_options=...): sandbox {self.sandbox!r} takes no option "
                        f"{', '.join(map(repr, unknown))}; its options: {', '.join(accepted)}."
                    )

    def turn_seconds(self) -> float:
        """Seconds for all the code of one reply together: turn_timeout, else exec_timeout."""
        return self.exec_timeout if self.turn_timeout is None else self.turn_timeout

    def subcall_models(self) -> list[str]:
        """The models llm_query(model=...) may use: the sub-model first, then the rest configured."""
        return list(dict.fromkeys([self.sub_model, self.model, *self.allowed_models]))

    def model_for_depth(self, depth: int) -> str:
        """The root model of a run at `depth`: the sub-model serves every call below the top."""
        return self.model if depth == 0 else self.sub_model


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # NaN is a float but no limit: it compares False with everything, so it would never refuse.
    return (_is_int(value) or isinstance(value, float)) and value == value
