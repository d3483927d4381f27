"""MkDocs hook: fills the reply rules page with the rules of recursa/loop/rules.py, in their order.

The page is generated from the registry at build time, so it lists exactly the rules replies are read
by, with each one's reason and example replies (`mkdocs build --strict` runs in the test suite).
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"<!--\s*reply-rules\s*-->")


def _example(text: str) -> str:
    shown = text.encode("unicode_escape").decode("ascii") if any(ord(c) < 32 and c != "\n" for c in text) else text
    return "\n".join(f"    {line}" for line in shown.split("\n"))


def _rules_markdown() -> str:
    from recursa.loop.rules import RULES, STAGES

    parts: list[str] = []
    for stage in STAGES:
        parts.append(f"## Stage `{stage}`\n")
        for rule in (r for r in RULES if r.stage == stage):
            strict = " *(the paper's protocol: kept in strict mode)*" if rule.paper else ""
            parts.append(f"### `{rule.name}`{strict}\n\n{rule.reason}\n\nRead by it:\n")
            parts.extend(f"{_example(e)}\n" for e in rule.examples)
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "reference/replies.md":
        return markdown
    return MARKER.sub(lambda _: _rules_markdown(), markdown)
