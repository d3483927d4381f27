"""The README and the documentation site say what the code does.

`mkdocs build --strict` fails on a broken link, a missing page or a reference to a renamed Python
name; the other checks hold the README to its promises and the examples to the real signatures.
"""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from recursa import RLM
from recursa.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted([README, *DOCS.rglob("*.md")])
SETUP = ["pip install -e . && recursa demo", 'pip install -e ".[dev]" && python -m pytest -q']


def test_readme_is_one_screen_and_starts_with_the_two_setup_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; details belong in docs/"
    fence = lines.index("```bash")
    assert lines[fence + 1 : fence + 3] == SETUP
    assert not any(line.startswith("## ") for line in lines[:fence]), "the commands come first"
    ci = (ROOT / ".ci" / "run").read_text()
    for command in SETUP:
        assert command in ci, f".ci/run must run the README's command: {command}"


LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+?)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(page: Path) -> None:
    missing = [t for t in LINK.findall(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert not [p for p in pages if p not in nav], "add new pages to mkdocs.yml's nav"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stdout + build.stderr
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "recursa run" in cli_page and "--max-depth" in cli_page


RLM_KEYWORDS = re.compile(r"(?<!\.)\bRLM\(([^()]*(?:\([^()]*\)[^()]*)*)\)", re.DOTALL)  # not dspy.RLM(...)


def test_rlm_keywords_in_the_docs_exist() -> None:
    accepted = set(inspect.signature(RLM).parameters)
    unknown: set[tuple[str, str]] = set()
    for page in PAGES:
        for call in RLM_KEYWORDS.findall(page.read_text()):
            top_level = re.sub(r"\([^()]*\)|\{[^{}]*\}|\[[^\[\]]*\]", "", call)
            for name in re.findall(r"(?:^|[,(]\s*)(\w+)=", top_level):
                if name not in accepted:
                    unknown.add((page.name, name))
    assert not unknown, f"RLM(...) has no such arguments: {sorted(unknown)}"


def _help(command: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli_main([*command, "--help"])
    return capsys.readouterr().out


def test_cli_flags_in_the_docs_exist(capsys: pytest.CaptureFixture[str]) -> None:
    known = set(re.findall(r"\{([\w,-]+)\}", _help([], capsys))[0].split(","))
    wrong: list[str] = []
    for page in PAGES:
        for line in re.findall(r"^\s*recursa ([^\n#|]+)", page.read_text(), re.MULTILINE):
            words = shlex.split(line.replace("\\", ""), posix=True) if line.count('"') % 2 == 0 else []
            if not words or words[0] not in known:
                continue
            command = words[:2] if words[0] == "export" and len(words) > 1 else words[:1]
            help_text = _help(command, capsys)
            for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                if flag not in help_text:
                    wrong.append(f"{page.name}: recursa {' '.join(command)} {flag}")
    assert not wrong, f"flags the CLI does not have: {wrong}"


# A file path a page names (`recursa/sandbox/cgroups.py`, `python benchmarks/memory.py`, or one
# relative to the package such as `sandbox/worker/zygote.py`) must still be there: files move.
FILE_PATH = re.compile(
    r"(?<![\w./~:-])((?:recursa|benchmarks|examples|tests|docs|sandbox|loop|serve|lm|trace|scripted|env"
    r"|tasks|testing|asgi|bench|train|tools|integrations)/[\w./-]*\w\.(?:py|md|toml|json|jsonl|yml|txt))\b"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_file_paths_named_in_the_docs_exist(page: Path) -> None:
    named = FILE_PATH.findall(page.read_text())
    gone = [p for p in named if not (ROOT / p).exists() and not (ROOT / "recursa" / p).exists()]
    assert not gone, f"{page.relative_to(ROOT)} names files that are not there: {gone}"


def test_the_architecture_diagram_names_every_layer() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    layers = re.search(r'containers = \["recursa"\]\n.*?layers = \[(.*?)\]', pyproject, re.DOTALL)
    assert layers is not None, "pyproject.toml's layers contract moved; update this test"
    names = set(re.findall(r"\w+", layers.group(1)))
    diagram = (DOCS / "architecture.md").read_text().split("## The layers", 1)[1].split("```")[1]
    # The layer names are the diagram's left column; the right one describes them.
    drawn = set(re.findall(r"\w+", "\n".join(line[:45] for line in diagram.splitlines())))
    assert not names - drawn, f"docs/architecture.md's layer diagram leaves out {sorted(names - drawn)}"


def test_environment_variables_named_in_the_docs_are_read_by_the_code() -> None:
    code = "\n".join(p.read_text() for p in (ROOT / "recursa").rglob("*.py"))
    named = {v for page in PAGES for v in re.findall(r"\bRECURSA_[A-Z_]+\b", page.read_text())}
    assert named, "the docs name no RECURSA_* variable: this test lost its subject"
    unread = sorted(v for v in named if v not in code)
    assert not unread, f"the docs name environment variables no code reads: {unread}"
