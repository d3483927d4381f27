"""MkDocs hook: fills the CLI reference page with each command's own `--help` text.

The page is generated from the argument parser at build time, so the reference cannot drift from
the flags the CLI really has (`mkdocs build --strict` runs in the test suite).
"""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

MARKER = re.compile(r"<!--\s*cli-help\s*-->")


def _help_text(command: str) -> str:
    from recursa.cli import main

    argv = [*command.split(), "--help"] if command else ["--help"]
    out = io.StringIO()
    # argparse prints help and exits; the build only needs the text.
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    text = out.getvalue().strip()
    if not text:
        raise RuntimeError(f"`recursa {command} --help` printed nothing")
    return text


SUBCOMMANDS = re.compile(r"^\s*\{([\w,-]+)\}", re.MULTILINE)


def _all_commands(command: str = "") -> list[str]:
    """`command` and every subcommand under it, read from the help texts themselves."""
    found = [command]
    listed = SUBCOMMANDS.search(_help_text(command))
    for name in listed.group(1).split(",") if listed else []:
        found += _all_commands(f"{command} {name}".strip())
    return found


def _section(command: str) -> str:
    title = f"## `recursa {command}`" if command else "## `recursa`"
    return f"{title}\n\n```text\n{_help_text(command)}\n```\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "reference/cli.md":
        return markdown
    return MARKER.sub(lambda _: "\n".join(_section(c) for c in _all_commands()), markdown)
