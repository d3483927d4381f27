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
    tips: str | None = None
    root_window_tokens: int | None = None

    def validate(self) -> None:
        checks = [
            (isinstance(self.max_depth, int) and self.max_depth >= 0, "max_depth must be an int >= 0"),
            (
                isinstance(self.max_iterations, int) and self.max_iterations >= 1,
                "max_iterations must be >= 1",
            ),
            (self.exec_timeout > 0, "exec_timeout must be > 0 seconds"),
            (self.max_output_chars >= 200, "max_output_chars must be >= 200"),
            (self.max_concurrency >= 1, "max_concurrency must be >= 1"),
            (self.max_parallel_children >= 1, "max_parallel_children must be >= 1"),
            (self.max_output_tokens >= 1, "max_output_tokens must be >= 1"),
            (self.max_retries >= 0, "max_retries must be >= 0"),
            (self.max_run_retries >= 0, "max_run_retries must be >= 0"),
            (
                self.subcall_errors in ("raise", "return"),
                "subcall_errors must be 'raise' (an exception in the REPL) or 'return' (an '[error] ...' str)",
            ),
            (self.sub_tool_rounds >= 1, "sub_tool_rounds must be >= 1"),
            (
                self.root_window_tokens is None or self.root_window_tokens >= 1_000,
                "root_window_tokens must be None (no compaction) or at least 1000",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"RLM(...): {message}.")
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

    def model_for_depth(self, depth: int) -> str:
        """The root model of a run at `depth`: the sub-model serves every call below the top."""
        return self.model if depth == 0 else self.sub_model
