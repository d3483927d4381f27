"""MCP server entries as MCP clients configure them, checked before anything connects.

Accepted shapes (each entry a dict):

- stdio: `{"command": "npx", "args": [...], "env": {...}, "cwd": "..."}`
- streamable HTTP: `{"url": "https://host/mcp", "headers": {...}}`
- a list of entries (each may carry `"name"`), a dict name -> entry (Claude's `mcpServers`), or a
  whole config file's contents `{"mcpServers": {...}}`;
- ACP's shape (`session/new`): `env` and `headers` as lists of `{"name": ..., "value": ...}`.

recursa's own keys on an entry: `use` ("repl": the REPL code calls the tools, the default;
"sub_models": only sub-models call them, through function calling; "both"), `timeout` (seconds
per call), `connect_timeout`, `max_calls` (per call tree), `max_result_chars` (each result is cut
there) and `tools` (the names to keep; default all).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from recursa.errors import ConfigError

McpUse = Literal["repl", "sub_models", "both"]
MCP_USES: tuple[McpUse, ...] = ("repl", "sub_models", "both")

_TRANSPORT_KEYS = {"command", "args", "env", "cwd", "url", "headers", "type", "transport", "name"}
_OUR_KEYS = {"use", "timeout", "connect_timeout", "max_calls", "max_result_chars", "tools"}
# Keys other clients write into the same entries (Claude, Cursor, VS Code, ACP); accepted, unused.
_IGNORED_KEYS = {"disabled", "autoApprove", "alwaysAllow", "description", "_meta", "envFile"}


@dataclass(frozen=True)
class McpServerSpec:
    """One MCP server: how to reach it and how its tools are offered."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold the server's own keys
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # often an Authorization header
    use: McpUse = "repl"
    timeout: float = 60.0
    connect_timeout: float = 30.0
    max_calls: int | None = None
    max_result_chars: int = 100_000
    tools: tuple[str, ...] | None = None

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command is not None else "http"

    def where(self) -> str:
        """The server as messages name it (never its env or headers: they may hold keys)."""
        target = self.url if self.url is not None else " ".join([str(self.command), *self.args])[:200]
        return f"MCP server {self.name!r} ({target})"


def parse_mcp_servers(value: Any, what: str = "RLM(mcp_servers=...)") -> list[McpServerSpec]:
    """Every entry of `value` checked; a mistake raises ConfigError naming the entry and the fix."""
    if value is None:
        return []
    if isinstance(value, (str, Path)):
        return parse_mcp_servers(_read_file(Path(value), what), what)
    if isinstance(value, Mapping):
        inner = value.get("mcpServers", value.get("mcp_servers"))
        if isinstance(inner, Mapping) and len(value) == 1:
            value = inner
        if _looks_like_entry(value):
            entries: list[tuple[str | None, Any]] = [(None, value)]
        else:
            entries = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        entries = [(None, v) for v in value]
    else:
        raise ConfigError(
            f"{what} takes a list of server entries or a dict name -> entry, not {type(value).__name__}; "
            'e.g. [{"command": "uvx", "args": ["mcp-server-time"]}] or '
            '{"docs": {"url": "https://example.com/mcp"}}.'
        )
    specs = [_one(key, entry, i, what) for i, (key, entry) in enumerate(entries)]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"{what}: two servers are named {spec.name!r}; give each a unique name.")
        seen.add(spec.name)
    return specs


def _read_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {str(path)!r} ({exc.strerror}); give a JSON file.") from None
    except ValueError as exc:
        raise ConfigError(f"{what}: {str(path)!r} is not valid JSON ({exc}).") from None


def _looks_like_entry(value: Mapping[str, Any]) -> bool:
    return "command" in value or "url" in value


def _one(key: str | None, entry: Any, index: int, what: str) -> McpServerSpec:
    if isinstance(entry, McpServerSpec):  # checked already (a front door parsed it)
        return entry
    label = f"{what} server {key!r}" if key is not None else f"{what} entry {index}"
    if not isinstance(entry, Mapping):
        raise ConfigError(
            f"{label} is a {type(entry).__name__}; each server is a dict with 'command' or 'url'."
        )
    unknown = set(entry) - _TRANSPORT_KEYS - _OUR_KEYS - _IGNORED_KEYS
    if unknown:
        raise ConfigError(
            f"{label}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; a server takes command/args/env/cwd "
            f"(stdio) or url/headers (streamable HTTP), and recursa's {', '.join(sorted(_OUR_KEYS))}."
        )
    name = key if key is not None else entry.get("name")
    kind = entry.get("type", entry.get("transport"))
    if kind is not None and kind not in (
        "stdio",
        "http",
        "streamable-http",
        "streamable_http",
        "streamableHttp",
    ):
        raise ConfigError(
            f"{label}: transport {kind!r} is not supported; recursa speaks stdio and streamable HTTP "
            "(an SSE-only server: put a streamable-HTTP proxy in front of it)."
        )
    command, url = entry.get("command"), entry.get("url")
    if (command is None) == (url is None):
        raise ConfigError(
            f"{label}: give exactly one of 'command' (a stdio server) or 'url' (streamable HTTP)."
        )
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise ConfigError(f"{label}: 'command' is the program to start, a non-empty str.")
    if url is not None and (not isinstance(url, str) or not re.match(r"https?://", url)):
        raise ConfigError(f"{label}: 'url' must be an http:// or https:// URL, got {url!r}.")
    if name is None:
        name = _default_name(command, url, index)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ConfigError(f"{label}: the name {name!r} must be 1-64 letters, digits, '_', '.' or '-'.")
    args = entry.get("args", [])
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{label}: 'args' is a list of str.")
    spec = McpServerSpec(
        name=name,
        command=command,
        args=tuple(args),
        env=_pairs(entry.get("env"), "env", label),
        cwd=_optional_str(entry.get("cwd"), "cwd", label),
        url=url,
        headers=_pairs(entry.get("headers"), "headers", label),
        use=_use(entry.get("use", "repl"), label),
        timeout=_seconds(entry.get("timeout", 60.0), "timeout", label),
        connect_timeout=_seconds(entry.get("connect_timeout", 30.0), "connect_timeout", label),
        max_calls=_count(entry.get("max_calls"), "max_calls", label, optional=True),
        max_result_chars=_count(entry.get("max_result_chars", 100_000), "max_result_chars", label) or 1,
        tools=_names(entry.get("tools"), label),
    )
    if command is not None and spec.headers:
        raise ConfigError(f"{label}: 'headers' belong to a url server; a stdio server takes 'env'.")
    return spec


def _default_name(command: str | None, url: str | None, index: int) -> str:
    if url is not None:
        host = re.sub(r"^https?://", "", url).split("/", 1)[0].split(":", 1)[0]
        base = host.split(".")[-2] if host.count(".") >= 1 and not host.replace(".", "").isdigit() else host
    else:
        base = Path(str(command)).name
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", base)[:48] or "mcp"
    return f"{base}{index}" if index else base


def _pairs(value: Any, key: str, label: str) -> dict[str, str]:
    """A str -> str dict, from a dict or from ACP's list of {"name", "value"}."""
    if value is None:
        return {}
    if isinstance(value, (list, tuple)):
        try:
            value = {item["name"]: item["value"] for item in value}
        except (TypeError, KeyError):
            raise ConfigError(
                f"{label}: '{key}' as a list holds {{'name': ..., 'value': ...}} items."
            ) from None
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{label}: '{key}' is a dict of str to str.")
    return dict(value)


def _optional_str(value: Any, key: str, label: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{label}: '{key}' is a str.")
    return value


def _use(value: Any, label: str) -> McpUse:
    if value not in MCP_USES:
        raise ConfigError(
            f"{label}: 'use' is one of {', '.join(MCP_USES)} (the REPL code, only sub-models, or both), "
            f"not {value!r}."
        )
    return value  # type: ignore[no-any-return]


def _seconds(value: Any, key: str, label: str) -> float:
    ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
    if not ok:
        raise ConfigError(f"{label}: '{key}' is a number of seconds > 0, not {value!r}.")
    return float(value)


def _count(value: Any, key: str, label: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{label}: '{key}' is an int >= 1, not {value!r}.")
    return value


def _names(value: Any, label: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{label}: 'tools' is a list of the tool names to keep.")
    return tuple(value)
