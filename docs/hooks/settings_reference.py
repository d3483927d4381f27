"""MkDocs hook: fills the settings reference page from the settings schemas (recursa/config.py for
the runs', recursa/serve/settings.py and recursa/integrations/openenv_settings.py for the servers').

Each setting's name, type, default, CLI flag, who may override it and help come from its one
declaration, so the page cannot drift from what `RLM(...)`, `RLMEnv(...)`, the servers and the CLI
take.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

MARKER = re.compile(r"<!--\s*settings-table\s*-->")

# How the page says who may override a setting (recursa.config.Override).
_OVERRIDE = {
    "operator": "operator only",
    "tighten": "lower only",
    "choose": "operator's choices (any, with the client's own key)",
    "client": "yes",
}


def _type(annotation: Any) -> str:
    """A type as a reader writes it: `dict[str, int] or None`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{'Callable' if name == 'Callable' else name}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(value: Any) -> str:
    # A value equal to its class's empty instance (Budget()) is shown as that call.
    cls = type(value)
    if dataclasses.is_dataclass(value) and value == cls():
        return f"`{cls.__name__}()`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag(s: Any) -> str:
    """The flag as a user types it, and its unit where it is not the setting's."""
    if not s.flag:
        return ""
    return f"`{s.flag.split()[0]}`" + (f" ({s.unit[0]})" if s.unit else "")


def _rows(settings: dict[str, Any], commands: dict[str, tuple[str, ...]] | None = None) -> str:
    """A table of `settings`; `commands`: the commands whose flags each one is (a server's),
    instead of who may override it (every server setting is the operator's)."""
    last = "Commands" if commands is not None else "Clients may override"
    lines = [f"| Setting | Type | Default | CLI flag | {last} | What it does |", "|---|---|---|---|---|---|"]
    for s in settings.values():
        default = "required" if s.required else _default(s.default)
        if s.env is not None:
            default += f" (RLMEnv: `{s.env[0]}={s.env[1]!r}`)"
        if commands is not None:
            who = ", ".join(f"`{c}`" for c, names in commands.items() if s.name in names)
        else:
            who = _OVERRIDE[s.client]
        lines.append(
            f"| `{s.name}` | `{_cell(_type(s.annotation))}` | {_cell(default)} | {_flag(s)} | "
            f"{who} | {_cell(s.help)} |"
        )
    return "\n".join(lines)


def table() -> str:
    from recursa.config import (
        BUDGET_CAPS,
        ENV_SETTINGS,
        METHOD_OWNED,
        METHOD_SETTINGS,
        SAMPLING_SETTINGS,
        SETTINGS,
    )
    from recursa.integrations.openenv_settings import OPENENV_FLAGS, OPENENV_SETTINGS
    from recursa.serve.settings import FLAGS, SERVER_SETTINGS

    caps = "\n".join(
        f"| `{name}` | `{cap.flag}` | lower only | {_cell(cap.help)} |" for name, cap in BUDGET_CAPS.items()
    )
    return (
        "## Run settings (`RLM`, `RLMEnv`)\n\n"
        + _rows(SETTINGS)
        + "\n\n## Budget caps (`budget=Budget(...)`)\n\n"
        + "| Cap | CLI flag | Clients may override | What it does |\n|---|---|---|---|\n"
        + caps
        + "\n\n## Settings only `RLMEnv` has\n\n"
        + _rows(ENV_SETTINGS)
        + "\n\n## Sampling options a client may send\n\n"
        + "The operator's own `sampling` may hold any request option its provider takes; a client's "
        + "(a request's `recursa.sampling` or top-level sampling fields, a tool's `sampling` argument, "
        + "an ACP session's `_meta`, a dataset row's `extras`) holds only these, merged over the "
        + "operator's for each role (`sampling={role: {...}}`).\n\n"
        + _rows(SAMPLING_SETTINGS)
        + "\n\n## Settings only the benchmark's methods have (`recursa bench`)\n\n"
        + "A benchmark's rows take every run setting above but those each method sets itself ("
        + ", ".join(f"`{name}`" for name in METHOD_OWNED)
        + "), the budget's caps one by one, and these.\n\n"
        + _rows(METHOD_SETTINGS)
        + "\n\n## Server settings (`ServeSettings`: `recursa serve`, `mcp`, `acp`)\n\n"
        + "What a server lets its clients do, the operator's alone: `ServeSettings(...)`'s keywords and, "
        + "where a command is named, its flags. `run` holds the operator's run settings (the tables "
        + "above); every run setting is also a keyword of `ServeSettings(...)` itself "
        + "(`ServeSettings(model=..., max_depth=2, budget=Budget(...))`), and the provider's key is "
        + "`upstream_api_key` there (`api_key` is the clients').\n\n"
        + _rows(SERVER_SETTINGS, dict(FLAGS))
        + "\n\n## OpenEnv server settings (`create_openenv_app`, `recursa openenv`)\n\n"
        + "Its runs' settings are the `RLMEnv`'s it serves (the tables above).\n\n"
        + _rows(OPENENV_SETTINGS, {"openenv": OPENENV_FLAGS})
        + "\n"
    )


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "reference/settings.md":
        return markdown
    return MARKER.sub(lambda _: table(), markdown)
