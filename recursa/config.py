"""The run settings, each declared once: name, type, default, bounds, help, CLI flag, and whether a
client (a server request, an ACP session, a trainer's row) may override it.

`RLMConfig` is the schema and the validated value every run of a call tree reads. `RLM(...)`,
`RLMEnv(...)`, the CLI's flags (cli_options.py), the clients' overrides (`recursa.overrides`) and the
settings page of the docs (docs/hooks/settings_reference.py) are derived from it; none of them
declares a default, a bound or a check of its own. Validation is pydantic's, and its messages name the
setting the way the caller wrote it (`Spelling`): `RLM(max_depth=-1)`, `--max-depth -1`,
`extras['max_turns']=0`, `_meta.recursa/runtime-v1.max_depth=50`.

To add a setting, add one field below (`EnvConfig` for one only `RLMEnv` has):

    my_setting: int = setting(8, "what it does, for the docs and --help", ge=1, flag="--my-setting",
                              client="tighten")

That is the whole change: `RLM(my_setting=...)` and `RLMEnv(my_setting=...)` take it (through their
`**settings`), commands that start runs get `--my-setting` when `flag` is given, clients may lower it
(`client="tighten"`: it costs money or capacity) or set it (`"client"`), and the settings page lists
it. The engine reads it as `config.my_setting`.
"""

from __future__ import annotations

import ast
import difflib
import re
import reprlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Required, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, ValidationError, field_validator
from typing_extensions import TypedDict  # pydantic reads only this one's fields on Python < 3.12

from recursa.budget import CAPS, Budget, Cap
from recursa.errors import ConfigError, template_of
from recursa.lm.prices import ModelPrice
from recursa.sandbox import SANDBOXES

SamplingRole = Literal["root", "child", "sub"]
SAMPLING_ROLES: tuple[SamplingRole, ...] = get_args(SamplingRole)
SandboxName = Literal[tuple(SANDBOXES)]  # type: ignore[valid-type]  (the registry's names)
# The prompt templates shipped with the loop (files in recursa/loop/prompts/): the names RLM(prompt=) takes.
# "qwen", "small" and "claude" are the default prompt with a family's advice added (loop/prompts.py).
BUILTIN_TEMPLATES = ("default", "qwen", "small", "claude", "answer-dict")

# Who may set a setting besides the operator (the one whose credentials and machine a run uses):
# "operator": only the operator; "tighten": a client may lower it, never raise it (it costs money or
# capacity); "choose": a client may pick one of the operator's values (models), or any with its own
# key; "client": a client may set it freely.
Override = Literal["operator", "tighten", "choose", "client"]


class Invalid(ValueError):
    """A check of one setting failed: the value must be `what`; `example` is one that works."""

    def __init__(self, what: str, example: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.example = example


def setting(
    default: Any = None,
    help: str = "",
    *,
    flag: str | None = None,
    client: Override = "operator",
    what: str | None = None,
    example: str | None = None,
    factory: Callable[[], Any] | None = None,
    env: tuple[str, Any] | None = None,
    unit: tuple[str, int] | None = None,
    repr: bool = True,
    **bounds: Any,
) -> Any:
    """One setting's declaration. `flag`: its CLI flag (and metavar: `--session-ttl SECONDS`);
    `client`: see `Override`; `what`: what a valid value is, in words (derived from the type and
    bounds when not given); `example`: a value that works (the default when not given); `env`:
    RLMEnv's own name and default for it, where they differ; `unit`: the flag's unit and its size in
    the setting's, where they differ (`("MiB", 1 << 20)` for a setting in bytes); `bounds`: pydantic's
    ge/gt/le."""
    extra = {"flag": flag, "client": client, "what": what, "example": example, "env": env, "unit": unit}
    if factory is not None:
        return Field(default_factory=factory, description=help, json_schema_extra=extra, repr=repr, **bounds)
    return Field(default, description=help, json_schema_extra=extra, repr=repr, **bounds)


Seconds = float
Rate = Annotated[float, Field(ge=0)]


class PriceRates(TypedDict, total=False):
    """One model's price as a dict (`ModelPrice`'s fields): USD per million tokens."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    input_per_mtok: Required[Rate]
    output_per_mtok: Required[Rate]
    cached_input_per_mtok: Rate | None
    cache_write_per_mtok: Rate | None


class Schema(BaseModel):
    """Settings checked strictly (no "3" for 3, no NaN), each error named as the caller wrote it."""

    model_config = ConfigDict(
        strict=True, extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False, defer_build=True
    )

    @classmethod
    def checked(cls, spelling: Spelling, **values: Any) -> Any:
        """The settings of `values`, or a ConfigError naming the first bad one as `spelling` writes it."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise spelling.error(exc, cls, values) from None

    @classmethod
    def check_one(cls, name: str, value: Any, spelling: Spelling, beside: Mapping[str, Any] | None = None) -> Any:
        """One setting's value checked as `checked` checks it, alone (a client's override), or beside
        settings already checked that its check reads (`sandbox_options` are the `sandbox` kind's)."""
        blank = cls.model_construct(**{k: v for k, v in (beside or {}).items() if k in cls.model_fields and k != name})
        try:
            cls.__pydantic_validator__.validate_assignment(blank, name, value)
        except ValidationError as exc:
            raise spelling.error(exc, cls, {name: value}) from None
        return getattr(blank, name)


class RLMConfig(Schema):
    """Every setting of an RLM run, validated once, shared by all runs of a call tree."""

    model: str = setting(..., "the root model, which writes the REPL code: provider/name or a client object", flag="--model", client="choose")
    sub_model: str = setting(..., "the model behind llm_query and child runs' turns (default: model)", flag="--sub-model", client="choose")
    base_url: str | None = setting(None, "an OpenAI-compatible server for the openai provider (vLLM, Ollama, ...)", flag="--base-url")
    api_key: str | None = setting(None, "the provider key (default: OPENAI_API_KEY / ANTHROPIC_API_KEY)", flag="--api-key-env NAME", repr=False)
    max_depth: int = setting(1, "0 runs code only; 1 adds llm_query sub-calls; 2 or more, child RLMs", flag="--max-depth", client="tighten", ge=0)
    max_iterations: int = setting(30, "root turns before one last call asks for the answer", flag="--max-iterations", client="tighten", example="30", env=("max_turns", 10), ge=1)
    budget: InstanceOf[Budget] = setting(help="hard caps over the whole call tree (docs/concepts.md, \"Budgets are hard caps\")", client="tighten", factory=Budget, what="a recursa.Budget(max_usd=..., max_tokens=..., ...)", example="Budget(max_llm_calls=200)")
    sandbox: SandboxName = setting("auto", "where the REPL runs (docs/sandbox.md)", flag="--sandbox", what=f"a sandbox kind, one of: {', '.join(SANDBOXES)}")
    sandbox_options: dict[str, Any] | None = setting(None, "passed to the sandbox's constructor, e.g. {'start_timeout': 30}; a flag's VALUE is read as JSON where it is JSON (30, true, {\"repl\": 1}), else as text (docs/sandbox.md, docs/cluster.md)", flag="--sandbox-option KEY=VALUE", what="a dict of option names to values", example="{'start_timeout': 30}")
    exec_timeout: Seconds = setting(120.0, "seconds one REPL cell may run before it is interrupted (its variables are kept)", flag="--exec-timeout", client="tighten", gt=0)
    turn_timeout: Seconds | None = setting(None, "seconds all the code of one reply may run together; each block runs at most exec_timeout and what is left of this (None: exec_timeout)", flag="--turn-timeout", client="tighten", example="120", gt=0)
    max_output_chars: int = setting(20_000, "REPL output shown to the root per cell (head and tail beyond it)", client="tighten", example="20_000", ge=200)
    max_concurrency: int = setting(64, "model calls in flight at once over the whole tree", client="tighten", ge=1)
    max_parallel_children: int = setting(32, "child runs (each with its own REPL process) at once, per depth level", client="tighten", ge=1)
    per_model_concurrency: dict[str, Annotated[int, Field(ge=1)]] | None = setting(None, "a lower limit of calls in flight for named models", what="a dict of model name to an int >= 1", example="{'openai/gpt-5-mini': 16}")
    trace_dir: Annotated[Path, Field(strict=False)] | None = setting(None, "where JSONL traces go (default: $XDG_CACHE_HOME or ~/.cache, then recursa/traces)", flag="--trace-dir", example="'traces'")
    trace: bool = setting(True, "False writes no trace file")
    prompt: str | Path | None = setting(None, "the root's prompt template: a built-in name or a file (default: by model family)", flag="--prompt")
    max_output_tokens: int = setting(16_384, "each model call's output limit, reserved in the budget before it is sent", flag="--max-output-tokens", client="tighten", example="16_384", ge=1)
    sub_model_chars: int = setting(500_000, "how much text one sub-call can take, as the root's prompt states it", example="500_000", ge=1)
    prices: dict[str, InstanceOf[ModelPrice] | PriceRates] | None = setting(None, "US dollars per million tokens per model, for models without a known price", flag="--prices FILE", what="a dict of model name to its rates, USD per million tokens, numbers >= 0 (input_per_mtok and output_per_mtok; cached_input_per_mtok, cache_write_per_mtok optional)", example="{'openai/my-model': {'input_per_mtok': 0.25, 'output_per_mtok': 2.0}}")
    request_timeout: Seconds = setting(600.0, "seconds one model request may take", client="tighten", gt=0)
    max_retries: int = setting(4, "retries of one failed model call", flag="--max-retries", client="tighten", ge=0)
    on_event: Callable[[dict[str, Any]], None] | None = setting(None, "called with every trace event as it happens (e.g. an OtelListener)", what="a function taking one event dict, or None")
    call_headers: bool = setting(False, "send the X-RLM-* attribution headers with every call", client="client", env=("call_headers", True))
    sampling: dict[SamplingRole, dict[str, Any]] | None = setting(None, "request options per role, 'root', 'child' and 'sub' (docs/training.md); a client sends only those of `SamplingOptions`, each by its own policy", client="client", what=f"a dict of roles to request options (roles: {', '.join(SAMPLING_ROLES)})", example="{'root': {'temperature': 1.0, 'seed': 7}, 'sub': {'temperature': 0.0}}")
    subcall_errors: Literal["raise", "return"] = setting("raise", "a sub-call that fails for good 'raise's in the REPL or 'return's an '[error] ...' str", client="client")
    max_run_retries: int = setting(200, "model-call retries summed over the whole tree", client="tighten", ge=0)
    tools: list[Any] = setting(help="functions the REPL code may call (docs/tools.md)", factory=list)
    tools_for_children: bool = setting(True, "child runs get `tools` too")
    sub_tools: list[Any] = setting(help="functions only sub-models call, through function calling", factory=list)
    sub_tool_rounds: int = setting(8, "tool turns a sub-model may take before it must answer", client="tighten", ge=1)
    mcp_servers: list[Any] = setting(help="MCP servers whose tools join tools / sub_tools for each call tree: a list of entries as MCP clients write them, a dict name -> entry, or a JSON config file (docs/tools.md, \"MCP servers\")", flag="--mcp-servers FILE", factory=list)
    tips: str | None = setting(None, "strategy text added to the root's prompt", client="client", what="a str of advice for the model, or None")
    root_window_tokens: int | None = setting(None, "compact the root's history past 80% of this many tokens (None: no compaction)", what="None (no compaction) or an int of at least 1000", example="None", ge=1_000)
    allowed_models: list[str] = setting(help="further models generated code may name in llm_query(model=...)", factory=list, what="a list of model names", example="['openai/gpt-5-nano']")
    clients: dict[str, Any] = setting(help="LM client objects given in place of model names, by the 'client/<name>' spec that stands for each", factory=dict, repr=False)
    unfenced_code: bool = setting(True, "run Python a reply writes without a ```repl fence; False only tells the model to fence its code", client="client")
    context_windows: dict[str, Annotated[int, Field(ge=1)]] | None = setting(None, "tokens per call by model ('provider/model' or a bare name), over genai-prices' figures (docs/concepts.md, \"Context windows\")", flag="--context-window MODEL=TOKENS", what="a window in tokens, an int >= 1, per model name", example="{'openai/my-vllm-model': 32_768}")
    dialect: Any = setting("recursa", "the conversation the root sees: 'recursa', 'tools' (native tool calls), 'rlms', 'skyrl', 'verifiers', or a Dialect object (docs/dialects.md)", flag="--dialect", client="client", what="a registered dialect name or a Dialect object")
    dialect_options: dict[str, Any] | None = setting(None, "options of a named dialect, e.g. {'tool_name': 'python'} for 'tools'; a flag's VALUE is read as JSON where it is JSON, else as text", flag="--dialect-option KEY=VALUE", client="client", example="{'tool_name': 'python'}")
    cache_subcalls: bool = setting(False, "answer identical sub-calls (model, messages, sampling, tools) once per call tree, session or RLMEnv group (lm/call_cache.py)", flag="--cache-subcalls", client="client")

    @field_validator("sandbox_options")
    @classmethod
    def _sandbox_options(cls, value: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        if not value:
            return value
        # Checked now so that a misspelt option fails before any spend, not when the REPL starts.
        kind = SANDBOXES.get(info.data.get("sandbox", "auto"))
        accepted = kind.option_names() if kind is not None else None
        unknown = sorted(set(value) - set(accepted)) if accepted is not None else []
        if unknown:
            meant = f" (did you mean {close!r}?)" if (close := near_miss(unknown[0], accepted or [])) else ""
            raise Invalid(
                f"options sandbox {info.data.get('sandbox')!r} takes: it takes no option "
                f"{', '.join(map(repr, unknown))}{meant}; its options: {', '.join(accepted or [])}"
            )
        return value

    @field_validator("trace_dir")
    @classmethod
    def _trace_dir(cls, value: Path | None) -> Path | None:
        if value is not None and value.exists() and not value.is_dir():
            raise Invalid("a folder for the trace files, not a file (a missing folder is created)", "'traces'")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | Path | None) -> str | Path | None:
        if value is not None and str(value) not in BUILTIN_TEMPLATES and not Path(value).is_file():
            raise Invalid(
                f"a built-in template ({', '.join(BUILTIN_TEMPLATES)}) or the path of a template file; "
                f"{str(value)!r} is neither a built-in template nor an existing file",
                "'default'",
            )
        return value

    def turn_seconds(self) -> float:
        """Seconds for all the code of one reply together: turn_timeout, else exec_timeout."""
        return self.exec_timeout if self.turn_timeout is None else self.turn_timeout

    def subcall_models(self) -> list[str]:
        """The models llm_query(model=...) may use: the sub-model first, then the rest configured."""
        return list(dict.fromkeys([self.sub_model, self.model, *self.allowed_models]))

    def model_for_depth(self, depth: int) -> str:
        """The root model of a run at `depth`: the sub-model serves every call below the top."""
        return self.model if depth == 0 else self.sub_model

    def replace(self, **changes: Any) -> RLMConfig:
        """A copy with `changes` (values already checked, such as a tree's own event callback)."""
        return self.model_copy(update=changes)


class EnvConfig(Schema):
    """The settings only an `RLMEnv` has (its runs' settings are an RLMConfig)."""

    max_reply_chars: int = setting(100_000, "longer policy replies are refused (the trace keeps replies whole up to 100,000)", client="tighten", ge=1)
    max_live_repls: int = setting(256, "REPL processes alive at once over all episodes (children included)", flag="--max-live-repls", client="tighten", ge=1)
    max_repls_per_episode: int | None = setting(None, "REPL processes one episode may hold at once, its root's and its child RLMs' together: its share of max_live_repls, so that one episode's fan-out of child RLMs cannot take the slots other episodes start in; None: 16, or max_depth where that is more", client="tighten", what="a number of REPLs >= 1 (at least max_depth: one whole chain of child RLMs), or None", ge=1)
    wait_for_repl: Seconds = setting(0.0, "seconds start() waits in line for a REPL slot before it raises (0: raise at once)", client="tighten", what="a number of seconds >= 0 (0: do not wait)", ge=0)
    max_memory_bytes: Annotated[int, Field(ge=64 << 20)] | Literal["auto"] | None = setting("auto", "what all the environment's live REPLs (children included) may hold together, in bytes; 'auto': three quarters of the machine's memory; None: no bound but each REPL's own (subprocess sandboxes only)", what="the bytes all live REPLs may hold together, at least 64 MiB (e.g. 32 << 30), 'auto' (three quarters of the memory) or None (no bound)", example=str(32 << 30))
    fork: bool = setting(True, "fork REPLs from one warm zygote shared by the episodes (forking sandboxes only)")


class MethodConfig(Schema):
    """The settings only the benchmark's methods have (recursa/methods; their runs' settings are an
    RLMConfig's, and each method chooses its own max_depth, tools and tips)."""

    window_tokens: int | None = setting(None, "the root model's input window in tokens, to which the baselines cut a context (None: the model family's known window)", flag="--window", example="128_000", ge=1)
    base_overflow: Literal["fail", "truncate"] = setting("fail", "what the base method does with a context past the window: 'fail' cleanly, or 'truncate' it to what fits", flag="--base-overflow")
    notes_chars: int = setting(8_000, "the summary method's notes, in characters", example="8_000", ge=200)


# The run settings each benchmark method sets itself, by what it is (`rlm-nosub` is max_depth=0).
METHOD_OWNED = ("max_depth", "tools", "sub_tools", "tips")


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class SamplingOptions(Schema):
    """The request options a client may send for a role's calls (`sampling`, and a server request's
    top-level sampling fields), each with its bounds and policy. The operator's own `sampling` may
    hold any option its provider takes; a client's holds only these."""

    temperature: float | None = setting(None, "sampling temperature", client="client", what="a number from 0 to 2", example="0.7", ge=0, le=2)
    top_p: float | None = setting(None, "nucleus sampling's probability mass", client="client", what="a number from 0 to 1", example="0.9", ge=0, le=1)
    frequency_penalty: float | None = setting(None, "penalty on tokens by their count so far", client="client", what="a number from -2 to 2", example="0.5", ge=-2, le=2)
    presence_penalty: float | None = setting(None, "penalty on tokens already present", client="client", what="a number from -2 to 2", example="0.5", ge=-2, le=2)
    min_p: float | None = setting(None, "vLLM's minimum token probability, relative to the likeliest", client="client", what="a number from 0 to 1", example="0.05", ge=0, le=1)
    repetition_penalty: float | None = setting(None, "vLLM's penalty on repeated tokens", client="client", what="a number from 0 to 10", example="1.1", ge=0, le=10)
    seed: int | None = setting(None, "the sampler's seed, for repeatable calls", client="client", what="an integer", example="7")
    top_k: int | None = setting(None, "sample among the k likeliest tokens", client="client", what="an integer", example="40")
    # Ordered from least to most: reasoning tokens are billed as output, so a client may only lower it.
    reasoning_effort: ReasoningEffort | None = setting(None, "how much the model reasons before it answers (reasoning tokens are billed as output)", client="tighten", what=f"one of {', '.join(get_args(ReasoningEffort))}", example="'low'")


@dataclass(frozen=True)
class Setting:
    """One declared setting, as the front doors and the docs read it."""

    name: str
    annotation: Any
    default: Any  # PydanticUndefined-free: None for required ones and factories' empty values
    required: bool
    help: str
    flag: str | None
    client: Override
    what: str
    example: str
    env: tuple[str, Any] | None
    unit: tuple[str, int] | None  # the flag's unit and its size in the setting's (MiB of bytes)
    owner: str  # the schema that declares it: "RLMConfig", "EnvConfig", "ServeSettings", ...
    optional: bool  # None is a value of it (Python callers and dicts may pass it; flags leave it out)
    order: tuple[Any, ...] | None  # a Literal's values, least first: what "tighten" compares by

    def exceeds(self, value: Any, limit: Any) -> bool:
        """Whether `value` asks for more than `limit` (a Literal's later value is more; None is no
        value, or no limit)."""
        if value is None or limit is None:
            return False
        if self.order is not None:
            return self.order.index(value) > self.order.index(limit) if limit in self.order else False
        return value > limit


def declarations(model: type[BaseModel]) -> dict[str, Setting]:
    """The settings `model` declares (with `setting(...)`), by name."""
    out = {}
    for name, info in model.model_fields.items():
        extra: dict[str, Any] = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        default = info.get_default(call_default_factory=True) if not info.is_required() else None
        out[name] = Setting(
            name=name,
            annotation=info.annotation,
            default=default,
            required=info.is_required(),
            help=info.description or "",
            flag=extra.get("flag"),
            client=extra.get("client", "operator"),
            what=extra.get("what") or _what(info),
            example=extra.get("example") or _shown(default),
            env=extra.get("env"),
            unit=extra.get("unit"),
            owner=model.__name__,
            optional="None" in str(info.annotation),
            order=next((get_args(a) for a in (info.annotation, *get_args(info.annotation)) if get_origin(a) is Literal), None),
        )
    return out


def _what(info: Any) -> str:
    """A valid value in words, from the type and bounds."""
    low = next((m for m in info.metadata if hasattr(m, "ge") or hasattr(m, "gt")), None)
    ge, gt = getattr(low, "ge", None), getattr(low, "gt", None)
    text = str(info.annotation)
    if text.startswith(("dict", "typing.Dict")) or " dict[" in text:
        what = "a dict"
    elif text.startswith("list"):
        what = "a list"
    elif "int" in text and "Path" not in text:
        what = f"an int >= {ge}" if ge is not None else "an int"
    elif "float" in text:
        what = f"a number of seconds > {gt:g}" if gt is not None else f"a number of seconds >= {ge:g}"
    elif "bool" in text:
        what = "True or False"
    elif "Literal" in text:
        what = "one of " + ", ".join(repr(a) for a in getattr(info.annotation, "__args__", ()))
    elif "Path" in text:
        what = "a str or a Path"
    elif "str" in text:
        what = "a str"
    else:
        what = "a " + text
    return what


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"{value:_}"
    return repr(value) if isinstance(value, str) else str(value)


SETTINGS: dict[str, Setting] = declarations(RLMConfig)
ENV_SETTINGS: dict[str, Setting] = declarations(EnvConfig)
SAMPLING_SETTINGS: dict[str, Setting] = declarations(SamplingOptions)
METHOD_SETTINGS: dict[str, Setting] = declarations(MethodConfig)
# The caps of `budget` (recursa.Budget's fields), declared with Budget (recursa/budget.py, `CAPS`):
# settings of their own for the CLI and for clients, who may only lower them (each costs money or
# capacity). Budget itself checks each value.
BUDGET_CAPS: dict[str, Cap] = CAPS
# RLMEnv's own names and defaults where they differ from RLM's (`setting(env=...)`).
ENV_NAMES: dict[str, str] = {n: s.env[0] for n, s in SETTINGS.items() if s.env is not None}
ENV_DEFAULTS = SimpleNamespace(**{s.env[0]: s.env[1] for s in SETTINGS.values() if s.env is not None})
# The defaults by name, for signatures that show them (`max_depth: int = DEFAULTS.max_depth`).
DEFAULTS = SimpleNamespace(**{name: s.default for name, s in {**SETTINGS, **ENV_SETTINGS}.items()})


def setting_of(name: str) -> Setting:
    found = declared_setting(name)
    if found is None:
        raise KeyError(name)
    return found


def declared_setting(name: str) -> Setting | None:
    """The declaration of `name` in any of the schemas, or None (a budget cap, a door's own option)."""
    return SETTINGS.get(name) or ENV_SETTINGS.get(name) or SAMPLING_SETTINGS.get(name) or METHOD_SETTINGS.get(name)


@dataclass(frozen=True)
class Spelling:
    """How a caller writes settings, so that a message names a setting as the user wrote it.

    `form`: "python" (`RLM(name=value)`), "cli" (`--flag value`), "key" (`extras['name']=value`),
    "dotted" (`_meta.recursa/runtime-v1.name=value`) or "field" (a request's own field, `temperature=3`);
    `owner`: the callable ("RLM") or the container ("extras", "_meta.recursa/runtime-v1"); `names`:
    the caller's own name for a setting where it differs from the schema's (RLMEnv's max_turns is
    max_iterations; the Responses API's reasoning.effort is reasoning_effort); `defaults`: the
    caller's own default for a setting where it differs from the schema's, by schema name;
    `schema`: the declarations of a schema besides the run settings' that it names (a server's
    settings), looked up first; `operator`: a "key" or "dotted" caller that is the operator (a
    trainer's own config, SkyRL's env_config), not a client, so every setting is its to set."""

    form: Literal["python", "cli", "key", "dotted", "field"]
    owner: str = "RLM"
    names: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    schema: Mapping[str, Setting] = field(default_factory=dict)
    operator: bool = False

    def _clients(self, declared: Setting | None) -> bool:
        """Whether a client writes this way and `declared` is only the operator's to set."""
        return self.form in ("key", "dotted") and not self.operator and declared is not None and declared.client == "operator"

    def setting(self, name: str) -> Setting | None:
        """The declaration of `name` (this caller's schema's first), or None (a budget cap)."""
        return self.schema.get(name) or declared_setting(name)

    def _flag(self, name: str) -> str | None:
        """The setting's CLI flag as declared (with its metavar: `--api-key-env NAME`), or None."""
        declared = self.setting(name)
        cap = BUDGET_CAPS.get(name)
        return declared.flag if declared is not None else cap.flag if cap is not None else None

    def _scaled(self, name: str, value: Any) -> Any:
        """A value as the command line writes it: in the flag's unit (`--idle-sessions-memory 4096`,
        MiB, for 4 GiB of bytes)."""
        declared = self.setting(name)
        if self.form != "cli" or declared is None or declared.unit is None:
            return value
        if isinstance(value, str):
            value = ast.literal_eval(value)
        if not isinstance(value, int) or isinstance(value, bool):
            return value
        return value // declared.unit[1] if value % declared.unit[1] == 0 else value / declared.unit[1]

    def schema_name(self, own: str) -> str:
        """The schema's name of the setting the caller calls `own`."""
        return next((name for name, mine in self.names.items() if mine == own), own)

    def within(self, name: str, key: str) -> Spelling:
        """How this caller writes the entries of `key` in the dict setting `name` (a role's sampling
        options: `extras['sampling']['root']['temperature']`)."""
        label = self.label(name)
        return Spelling(self.form, f"{label}[{key!r}]" if self.form == "key" else f"{label}.{key}")

    def label(self, name: str) -> str:
        """The setting's name as this caller writes it: `max_depth`, `--max-depth`, `extras['max_depth']`;
        on the command line, a setting with no flag is named as the Python argument it is."""
        own = self.names.get(name, name)
        if self.form in ("python", "field"):
            return own
        if self.form == "cli":
            flag = self._flag(name)
            return flag.split()[0] if flag else f"RLM({own}=...)"
        return f"{self.owner}[{own!r}]" if self.form == "key" else f"{self.owner}.{own}"

    def told(self, message: str | BaseException) -> str:
        """A message of the layers below the schema (recursa.errors.RecursaError) with each setting
        it marks named as this caller writes it: `«name»` its label, `«name=»` how it is passed
        (`api_key=`, `--api-key-env NAME`, the operator's flag for a client), `«name=example»` it
        set to `example`."""
        text = template_of(message) if isinstance(message, BaseException) else message
        return _MARKED.sub(lambda m: self._marked(m.group(1), m.group(2), m.group(3)), text)

    def _marked(self, name: str, passed: str, example: str) -> str:
        declared = self.setting(name)
        if self._clients(declared):
            return f"the operator's {self._flag(name) or name}"  # not the client's to set
        if example:
            return self.assign(name, example)
        if not passed:
            return self.label(name)
        if self.form in ("python", "field"):
            return f"{self.label(name)}="
        return (self.form == "cli" and self._flag(name)) or self.label(name)

    def _pairs(self, name: str) -> bool:
        """The setting's flag is a repeatable KEY=VALUE (a dict setting): values are shown that way."""
        declared = self.setting(name)
        return declared is not None and "=" in (declared.flag or "")

    def given(self, name: str, value: Any) -> str:
        """The setting as the caller passed it: `RLM(max_depth=-1)`, `--max-depth -1`, ...; in Python
        a budget cap is an argument of `Budget`."""
        shown = _REPR.repr(value)
        if self.form == "python":
            return f"{'Budget' if name in BUDGET_CAPS else self.owner}({self.label(name)}={shown})"
        if self.form == "cli":
            if (self._flag(name) or "").endswith(" FILE"):  # the value is the file's content
                return f"{self.label(name)} FILE holding {shown}"
            if isinstance(value, dict) and self._pairs(name):
                return " ".join(f"{self.label(name)} {k}={v}" for k, v in value.items())
            if isinstance(value, list | tuple):  # a repeatable flag, once per value
                return " ".join(f"{self.label(name)} {v}" for v in value)
            return f"{self.label(name)} {self._scaled(name, value)}"
        return f"{self.label(name)}={shown}"

    def argument(self, name: str, *, items: bool = False) -> str:
        """The setting without its value: `RLM(tools=...)`, `--max-depth`, `extras['budget']`;
        `items`: one element of a list setting (`RLM(allowed_models=[...])`)."""
        if self.form == "python":
            return f"{self.owner}({self.label(name)}={'[...]' if items else '...'})"
        return self.label(name)

    def assign(self, name: str, example: str) -> str:
        """How this caller sets `name` to `example`; a client is pointed to the operator's flag for
        a setting only the operator sets."""
        declared = self.setting(name)
        flag = (declared.flag or "") if declared is not None else ""
        if self._clients(declared):
            return f"the operator's {flag or declared.name}"
        if self.form == "cli" and flag.endswith(" FILE"):  # the value is a file's content
            return f"{flag} (a JSON or TOML file such as {example})"
        if self.form == "cli":
            if (example.startswith("{") and self._pairs(name)) or example.startswith("["):
                return self.given(name, ast.literal_eval(example))
            return f"{self.label(name)} {str(self._scaled(name, example)).strip(chr(39))}"
        return f"{self.label(name)}={example}"

    def problem(self, name: str, value: Any, what: str, example: str | None) -> str:
        """`<as given>: <label> must be <what>; e.g. <label>=<example>.`"""
        tail = f"; e.g. {self.assign(name, example)}" if example is not None else ""
        return f"{self.given(name, value)}: {self.label(name)} must be {what}{tail}."

    def error(self, exc: ValidationError, model: type[BaseModel], values: Mapping[str, Any]) -> ConfigError:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "?"
        if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
            known = [self.names.get(n, n) for n in model.model_fields]
            close = near_miss(self.names.get(name, name), known)
            hint = f"did you mean {close!r}?" if close else "see docs/reference/settings.md for the settings"
            return ConfigError(f"{self.given(name, values.get(name))}: {name} is not a setting; {hint}", setting=name)
        declared = self.setting(name)
        assert declared is not None, name  # pydantic names only the model's fields
        if not model.model_fields[name].repr:  # a key: its value stays out of the message
            values = {**values, name: _Withheld("<not shown>")}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, Invalid):
            return ConfigError(self.problem(name, values.get(name), cause.what, cause.example), setting=name)
        example = _shown(self.defaults[name]) if name in self.defaults else declared.example
        what = declared.what
        if declared.optional and self.form in ("python", "key", "dotted") and "None" not in what:
            what += " (or None)"
        what += self._inside(name, exc.errors(), values.get(name))
        return ConfigError(self.problem(name, values.get(name), what, example), setting=name)

    def _inside(self, name: str, errors: list[Any], value: Any) -> str:
        """Where inside a dict or list setting's value it went wrong (`prices['m']['input']`: extra
        inputs are not permitted), from pydantic's deepest errors; "" for a setting's whole value."""
        deepest = max(len(e["loc"]) for e in errors)
        found = []
        for error in (e for e in errors if len(e["loc"]) == deepest > 1):
            path, at = [], value
            for i, part in enumerate(error["loc"][1:], 2):  # a union's branch names are not keys
                if (isinstance(at, Mapping) and part in at) or (isinstance(at, list) and isinstance(part, int)):
                    path.append(part)
                    at = at[part]
                elif i == deepest and isinstance(at, Mapping) and part != "[key]":  # a missing key
                    path.append(part)
            found.append(f"{self.label(name)}{''.join(f'[{p!r}]' for p in path)}: {error['msg'].lower()}")
        return f" ({'; '.join(found)})" if found else ""


class _Withheld(str):  # a secret's value as a message shows it: <not shown>
    __repr__ = str.__str__


# A setting a message of a lower layer names: «name», «name=» or «name=example» (RecursaError).
_MARKED = re.compile(r"«(\w+)(=?)([^»]*)»")
PYTHON = Spelling("python", "RLM")
# How RLMEnv's callers write settings: its own names and defaults (`setting(env=...)`).
ENV_SPELLING = Spelling("python", "RLMEnv", ENV_NAMES, {n: s.env[1] for n, s in SETTINGS.items() if s.env})

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_NEAR = 0.85  # difflib ratio: max_turn, maxturns, repl_timout match; data_source, max_tokens do not


def near_miss(key: str, known: Collection[str]) -> str | None:
    """The known name `key` is most likely a misspelling of, or None."""
    folded = {k.lower(): k for k in known}
    found = difflib.get_close_matches(key.lower().replace("-", "_"), list(folded), n=1, cutoff=_NEAR)
    return folded[found[0]] if found else None
