"""The command line's model options (shared by run, chat, serve and mcp) and their checks.

Everything an `RLM(...)` argument can do that a CLI user needs has a flag here, made from the
setting's declaration (recursa/config.py). The CLI's RLM is made with the schema's CLI spelling
(`RLM.configured(..., Spelling("cli"))`), so a bad setting is named as the flag the user typed, and
so are the settings a lower layer's message or a run's stop reason names (`Spelling.told`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from recursa.config import BUDGET_CAPS, BUILTIN_TEMPLATES, SETTINGS, Setting, setting_of
from recursa.errors import ConfigError
from recursa.loop.dialects import dialect_names

DEFAULT_MODEL = "openai/gpt-5-mini"
# The environment variables the command line reads, and what for (`recursa models` lists them).
ENV_VARS = {
    "RECURSA_MODEL": "default for --model",
    "RECURSA_SUB_MODEL": "default for --sub-model",
    "RECURSA_BASE_URL": "default for --base-url",
    "OPENAI_API_KEY": "key for openai/... models (unless --api-key-env names another variable)",
    "OPENAI_BASE_URL": "the openai SDK's own default base URL",
    "ANTHROPIC_API_KEY": "key for anthropic/... models (unless --api-key-env names another variable)",
    "RECURSA_SERVE_API_KEY": "default for serve/mcp --api-key (the key clients must send)",
    "RECURSA_DEBUG": "set to 1 to see tracebacks of internal errors",
}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (unless it already names one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or "key" in action.dest  # a default read from the environment may be a secret
            or any(default is empty for empty in (None, False, argparse.SUPPRESS))  # 0 is a default
            or not action.option_strings
            or isinstance(action, argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


def add_model_names(
    p: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL, default_sub_model: str = "--model"
) -> None:
    """--model, --sub-model and --base-url, each defaulting to its RECURSA_* variable."""
    p.add_argument(
        "--model",
        default=os.environ.get("RECURSA_MODEL", default_model),
        help="root model as provider/name: openai/..., anthropic/..., scripted/... (offline); "
        f"`recursa models` lists them (default: $RECURSA_MODEL, else {default_model})",
    )
    p.add_argument(
        "--sub-model",
        default=os.environ.get("RECURSA_SUB_MODEL"),
        help=f"model behind llm_query in the REPL (default: $RECURSA_SUB_MODEL, else {default_sub_model})",
    )
    p.add_argument(
        "--base-url",
        default=os.environ.get("RECURSA_BASE_URL"),
        help="any OpenAI-compatible server (vLLM, SGLang, Ollama, llama.cpp), e.g. "
        "http://localhost:8000/v1 (default: $RECURSA_BASE_URL, else the provider's own API)",
    )


def add_model_options(
    p: argparse.ArgumentParser,
    default_model: str = DEFAULT_MODEL,
    default_sub_model: str = "--model",
    leave_out: tuple[str, ...] = (),
) -> None:
    """Every run setting's flag but those in `leave_out` (a command that sets them itself)."""
    p.formatter_class = HelpFormatter
    add_model_names(p, default_model, default_sub_model)
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        default=None,
        help="read the model API key from this environment variable instead of OPENAI_API_KEY / "
        "ANTHROPIC_API_KEY (the key itself never goes on the command line)",
    )
    for cap in BUDGET_CAPS.values():
        p.add_argument(cap.flag, type=float if cap.count is None else int, default=None, help=cap.help)
    p.add_argument(
        "--prices",
        metavar="FILE",
        default=None,
        help='per-model prices in USD per million tokens, a JSON or TOML file such as {"openai/my-model": '
        '{"input_per_mtok": 0.25, "output_per_mtok": 2.0}}; needed with --max-usd for models with no known '
        "price (default: built-in prices)",
    )
    p.add_argument(
        "--mcp-servers",
        metavar="FILE",
        default=None,
        help='MCP servers whose tools the REPL code calls: a JSON file as MCP clients write it, e.g. '
        '{"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time"]}}} (docs/tools.md)',
    )
    for name in FLAGGED:
        if name not in leave_out:
            add_setting_flag(p, name)


# Settings whose flags this module writes by hand: their defaults come from the environment or a file.
_OWN_FLAGS = ("model", "sub_model", "base_url", "api_key", "prices", "mcp_servers")
# The settings every command that starts runs takes as a flag: those the schema gives one.
FLAGGED = tuple(n for n, s in SETTINGS.items() if s.flag and n not in _OWN_FLAGS)


def add_setting_flag(p: argparse.ArgumentParser, name: str | Setting) -> None:
    """The flag of one setting (a run setting's name, or any schema's declaration: a server's), its
    type, default, choices and help all from the schema; a flag in a unit of its own (MiB of a
    setting in bytes) takes and shows its values in that unit."""
    s = setting_of(name) if isinstance(name, str) else name
    name = s.name
    flag, _, metavar = (s.flag or "").partition(" ")
    text = str(s.annotation)
    if "=" in metavar or "tuple[" in text:  # a dict (one KEY=VALUE per use) or a list of values
        p.add_argument(flag, dest=name, metavar=metavar, action="append", default=None, help=f"{s.help} (repeatable)")
        return
    if s.annotation is bool:  # --name and --no-name, so a default of either value can be turned
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=s.default, help=s.help)
        return
    kind: Any = int if s.annotation in (int, int | None) else float if "float" in text else str
    default = s.default // s.unit[1] if s.unit is not None and s.default is not None else s.default
    options: dict[str, Any] = {"dest": name, "type": kind, "default": default, "help": s.help}
    if s.order is not None:  # a Literal: the sandbox kinds' registry, the base method's overflow
        options["choices"] = s.order
    elif name == "dialect":
        options["choices"] = dialect_names()
    elif name == "prompt":
        options["metavar"] = "NAME_OR_FILE"
        options["help"] += f"; built-in names: {', '.join(BUILTIN_TEMPLATES)}"
    elif metavar:
        options["metavar"] = metavar
    elif "Path" in text:
        options["metavar"] = "DIR"
    elif kind is float:
        options["metavar"] = "SECONDS"
    else:  # as argparse names it when the flag is the setting's name
        options["metavar"] = flag.lstrip("-").replace("-", "_").upper()
    p.add_argument(flag, **options)


def setting_values(args: argparse.Namespace, settings: Iterable[Setting]) -> dict[str, Any]:
    """The values the flags of `settings` (made by add_setting_flag) hold, each in its setting's own
    unit (bytes of a flag in MiB); a flag left out with no default is left out."""
    out = {}
    for s in settings:
        value = getattr(args, s.name, None)
        if value is not None:
            out[s.name] = value * s.unit[1] if s.unit is not None else value
    return out


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings' flags as the schema takes them: a repeated KEY=VALUE flag made a dict."""
    values = {name: getattr(args, name) for name in FLAGGED if hasattr(args, name)}
    for name, value in values.items():
        if value is not None and _pairs(name):
            values[name] = _pairs_value(name, value)
    return values


def _pairs(name: str) -> bool:
    return "=" in (setting_of(name).flag or "")


def _pairs_value(name: str, given: list[str]) -> dict[str, Any]:
    """`["a=1", "b=2"]` as `{"a": 1, "b": 2}`: numbers where the setting's values are ints, JSON
    where they may be anything and the text is JSON (`snapshots=true`, `resources={"repl": 1}`;
    `address=ray://head:10001` stays text); the schema then checks the values and names a bad one
    as the flag it came from."""
    from recursa.config import Spelling

    s = SETTINGS[name]
    flag, metavar = (s.flag or "").split()
    numbers = "int" in str(s.annotation)
    anything = "Any" in str(s.annotation)
    out: dict[str, Any] = {}
    for pair in given:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            example = Spelling("cli").assign(name, s.example)
            raise ConfigError(f"{flag} {pair!r}: write {metavar}, e.g. {example}")
        value = value.strip()
        if numbers and re.fullmatch(r"-?\d[\d_]*", value):
            out[key.strip()] = int(value)
        elif anything:
            out[key.strip()] = _json_or_text(value)
        else:
            out[key.strip()] = value
    return out


def pairs_flags(name: str, value: dict[str, Any]) -> list[str]:
    """The command line that gives the dict setting `name` the value `value` (`--sandbox-option
    resources={"repl": 1}` per entry): what `_pairs_value` reads back, each value as JSON."""
    flag = (SETTINGS[name].flag or "").split()[0]
    return [part for key, item in value.items() for part in (flag, f"{key}={json.dumps(item)}")]


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def run_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The RLM(...) keywords of the options of `add_model_options`, but `model`: read from the
    files and variables they name, and left to the one check of the door that makes runs of them
    (`RLM.configured`, `ServeSettings`, `RLMEnv.configured`, with the CLI's spelling), which names
    a bad one as its flag before any work starts. The budget's caps are checked here, as they
    become a Budget, and named as flags the same way."""
    from recursa.config import Spelling
    from recursa.overrides import budget_of

    kwargs: dict[str, Any] = flag_values(args)
    kwargs["sub_model"], kwargs["base_url"] = args.sub_model, args.base_url
    caps = {name: getattr(args, name) for name in BUDGET_CAPS if getattr(args, name, None) is not None}
    kwargs["budget"] = budget_of(caps, Spelling("cli"))
    if args.api_key_env:
        kwargs["api_key"] = api_key_from_env(args.api_key_env)
    if args.prices:
        kwargs["prices"] = load_prices(args.prices)
    if getattr(args, "mcp_servers", None):
        from recursa.tools.mcp_config import parse_mcp_servers

        kwargs["mcp_servers"] = parse_mcp_servers(args.mcp_servers, "--mcp-servers")
    return kwargs


def api_key_from_env(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(
            f"--api-key-env takes the NAME of an environment variable (such as MY_KEY), not {_shown(name)}; "
            "export MY_KEY=... and pass --api-key-env MY_KEY"
        )
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(
            f"--api-key-env {name}: the environment variable {name} is not set (or empty); "
            f"export {name}=<your key> first"
        )
    return value


def _shown(text: str) -> str:
    # It may be a key pasted by mistake: show only its start.
    return repr(text[:4] + "...") if len(text) > 8 else repr(text)


def load_prices(path: str) -> Any:
    """--prices FILE read: {"provider/model": {"input_per_mtok": ..., "output_per_mtok": ..., ...}},
    which the schema checks (the `prices` setting) as it checks `RLM(prices=...)`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"--prices {path!r}: no such file; give a JSON or TOML file of per-model prices")
    text = file.read_text(encoding="utf-8", errors="replace")
    try:
        data = tomllib.loads(text) if file.suffix.lower() == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        kind = "TOML" if file.suffix.lower() == ".toml" else "JSON (name it .toml for TOML)"
        raise ConfigError(f"--prices {path!r} is not valid {kind}: {exc}") from None
    return data


def check_context(value: str) -> Path:
    """--context PATH: a regular file or a folder, refused at once otherwise (a FIFO would block)."""
    path = Path(value).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"context path {value!r} does not exist; check the path") from None
    except OSError as exc:
        raise ConfigError(f"--context {value!r} cannot be read ({exc.strerror}); check the path") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        if stat.S_ISFIFO(mode):
            kind = "a named pipe (FIFO)"
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            kind = "a device"
        else:
            kind = "a socket or other special file"
        raise ConfigError(
            f"--context {value!r} is {kind}, not a text file; save its text to a file first, or pipe it "
            "in: --context - reads standard input"
        )
    return path
