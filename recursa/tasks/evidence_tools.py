"""The REPL tools the evidence-spans family ships: `list_papers`, `search`, `extract_section`,
`get_paper_abstract`.

They are sandbox tools for `RLM(tools=...)`: each is self-contained (its imports and constants at
module level, no calls to the others), so recursa ships its source into the REPL, where it reads
the REPL's `context` (a dict of paper id -> paper text). The module-level `context` below is only
a placeholder for running them outside a REPL; recursa never ships it (the name is reserved).
"""

from __future__ import annotations

import re

context: dict[str, str] = {}

# A section starts at a line "## Name"; re.split with this keeps the names between the bodies.
SECTION_HEADING = r"(?m)^## (.+)$"
SENTENCE_END = r"(?<=[.!?])\s+"
WORD = r"[\w.-]+"


def list_papers() -> list[tuple[str, str]]:
    """(paper_id, title) for every paper in the context."""
    return [(pid, text.split("\n", 1)[0].removeprefix("Title: ")) for pid, text in context.items()]


def extract_section(paper_id: str, section: str) -> str:
    """The text of one section of a paper: "Abstract", "Introduction", "Methods", "Results" or
    "Discussion" ("" when the paper has no such section)."""
    parts = re.split(SECTION_HEADING, context[paper_id])
    for i in range(1, len(parts) - 1, 2):
        if parts[i].strip() == section:
            return parts[i + 1].strip()
    return ""


def get_paper_abstract(paper_id: str) -> str:
    """The abstract of a paper."""
    parts = re.split(SECTION_HEADING, context[paper_id])
    for i in range(1, len(parts) - 1, 2):
        if parts[i].strip() == "Abstract":
            return parts[i + 1].strip()
    return ""


def search(query: str, k: int = 10) -> list[tuple[str, str, str]]:
    """The k sentences sharing the most words with `query`, best first, as
    (paper_id, section, sentence); the title counts as section "Title"."""
    asked = {w.lower() for w in re.findall(WORD, query)}
    scored = []
    for pid, text in context.items():
        parts = re.split(SECTION_HEADING, text)
        sections = [("Title", parts[0])] + [
            (parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2)
        ]
        for section, body in sections:
            for sentence in re.split(SENTENCE_END, body.strip()):
                shared = len(asked & {w.lower() for w in re.findall(WORD, sentence)})
                if shared:
                    scored.append((-shared, pid, section, sentence.strip()))
    scored.sort()
    return [(pid, section, sentence) for _, pid, section, sentence in scored[: max(0, int(k))]]


TOOLS = (list_papers, search, extract_section, get_paper_abstract)
