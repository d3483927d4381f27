"""The README and the documentation site say what the code does.

`mkdocs build --strict` fails on a broken link, a missing page or a reference to a renamed Python
name; the other checks hold the README to its promises and the examples to the real signatures:
the keywords of documented calls, the flags of `recursa` commands and benchmark scripts, the
Python names and file paths a page mentions, and the environment variables it names.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import recursa
from recursa import RLM
from recursa.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted([README, *DOCS.rglob("*.md"), *(ROOT / "examples").rglob("*.md")])
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


def _documented_callables() -> dict[str, Callable[..., Any]]:
    """What the pages call with keywords, by the name they call it by (imported here, not at the
    top: `recursa.serve` needs the `server` extra, which `dev` installs)."""
    import recursa.bench
    from recursa import Budget, ConfinedPath, Session, host_tool
    from recursa.env import Episode, RLMEnv, group_rollouts
    from recursa.lm import LMResponse
    from recursa.sandbox import ForkServer, Hardening
    from recursa.serve import ServeSettings
    from recursa.testing.fake_server import FakeServer
    from recursa.trace.otel import OtelListener
    from recursa.train import export_rl, export_sft, rl_rows, sft_rows

    named: list[Callable[..., Any]] = [
        *(RLM, Budget, ConfinedPath, host_tool, Hardening, ForkServer, RLMEnv, group_rollouts),
        *(ServeSettings, OtelListener, FakeServer, LMResponse, export_sft, export_rl, sft_rows, rl_rows),
    ]
    table: dict[str, Callable[..., Any]] = {fn.__name__: fn for fn in named}
    # Methods, by the variable names the pages give their objects.
    table |= {
        "rlm.run": RLM.run,
        "rlm.arun": RLM.arun,
        "s.ask": Session.ask,
        "recursa.bench.run": recursa.bench.run,
    }
    table |= {"env.start": RLMEnv.start, "episode.rollouts": Episode.rollouts}
    return table


def _call_pattern(name: str) -> re.Pattern[str]:
    # `RLM(` but not `dspy.RLM(` or `RLMEnv(`; arguments up to the matching parenthesis, one level deep
    return re.compile(rf"(?<![\w.]){re.escape(name)}\(([^()]*(?:\([^()]*\)[^()]*)*)\)", re.DOTALL)


_SETTINGS_TAKERS = ("RLM", "RLMEnv")


def test_keywords_of_documented_calls_exist() -> None:
    unknown: set[tuple[str, str, str]] = set()
    for name, fn in _documented_callables().items():
        params: Any = inspect.signature(fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            if name not in _SETTINGS_TAKERS:
                continue
            # RLM and RLMEnv take every setting of the schema through **settings.
            from recursa.config import ENV_NAMES, ENV_SETTINGS, SETTINGS

            params = {*params, *SETTINGS, *ENV_SETTINGS, *ENV_NAMES.values()}
        for page in PAGES:
            for call in _call_pattern(name).findall(page.read_text()):
                top_level = re.sub(r"\([^()]*\)|\{[^{}]*\}|\[[^\[\]]*\]", "", call)
                unknown |= {
                    (page.name, name, kw)
                    for kw in re.findall(r"(?:^|[,(]\s*)(\w+)=", top_level)
                    if kw not in params
                }
    assert not unknown, f"calls in the docs with arguments the code does not take: {sorted(unknown)}"


def test_rlm_keywords_are_checked_where_the_docs_use_them() -> None:
    # The check above finds what it is given: RLM(...) calls are the bulk of them.
    assert len(_call_pattern("RLM").findall((DOCS / "concepts.md").read_text())) >= 3


PYTHON_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)


def test_python_examples_in_the_docs_are_python() -> None:
    broken = []
    for page in PAGES:
        for _, block in PYTHON_BLOCK.findall(page.read_text()):
            try:  # top-level `await` as in a notebook; `...` stands for the reader's own code
                compile(
                    textwrap.dedent(block),
                    page.name,
                    "exec",
                    ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                )
            except SyntaxError as exc:
                broken.append(f"{page.relative_to(ROOT)}: {exc.msg} in\n{block}")
    assert not broken, "\n\n".join(broken)


def _resolve(dotted: str) -> object | None:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("recursa"):
                return None  # an adapter whose extra is not installed here (verifiers): unverifiable
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


IMPORTS = re.compile(r"^\s*from (recursa[\w.]*) import ([\w, ]+)$", re.MULTILINE)
DOTTED = re.compile(r"(?<![\w/.-])(recursa(?:\.[A-Za-z_]\w*)+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_names_in_the_docs_exist(page: Path) -> None:
    """`from recursa.x import Y` and `recursa.x.Y` in a page name something real (modules move)."""
    text = page.read_text()
    names = {
        f"{module}.{name.strip()}" for module, names in IMPORTS.findall(text) for name in names.split(",")
    }
    code = "\n".join(p.read_text() for p in (ROOT / "recursa").rglob("*.py"))
    for dotted in DOTTED.findall(text):
        first = dotted.split(".")[1]
        is_module = (ROOT / "recursa" / f"{first}.py").exists() or (ROOT / "recursa" / first).is_dir()
        # `recursa.stop_reason` is a field of the servers' `recursa` object, not a Python name;
        # a module path or a public name of the package is.
        if (is_module or first[0].isupper() or first in dir(recursa)) and f'"{dotted}"' not in code:
            names.add(dotted)  # (a string in the code, e.g. a logger's name, is real too)
    missing = []
    for dotted in sorted(names):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{dotted} ({exc})")
    assert not missing, f"{page.relative_to(ROOT)} names what the code does not have: {missing}"


def _help(command: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli_main([*command, "--help"])
    return capsys.readouterr().out


# A command at the start of a line (a shell block), or in a code span in the text: `recursa view --port 8050`.
COMMAND_LINE = re.compile(r"^\s*recursa ([^\n#|]+)|`recursa ([^`\n]+)`", re.MULTILINE)


def test_cli_flags_in_the_docs_exist(capsys: pytest.CaptureFixture[str]) -> None:
    known = set(re.findall(r"\{([\w,-]+)\}", _help([], capsys))[0].split(","))
    wrong: list[str] = []
    helps: dict[tuple[str, ...], str] = {}  # each command's help, built once (the docs name a few commands many times)
    for page in PAGES:
        for line in ("".join(found) for found in COMMAND_LINE.findall(page.read_text())):
            words = shlex.split(line.replace("\\", ""), posix=True) if line.count('"') % 2 == 0 else []
            if not words or words[0] not in known:
                continue
            command = tuple(words[:2] if words[0] == "export" and len(words) > 1 else words[:1])
            if command not in helps:
                helps[command] = _help(list(command), capsys)
            help_text = helps[command]
            for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                if flag not in help_text:
                    wrong.append(f"{page.name}: recursa {' '.join(command)} {flag}")
    assert not wrong, f"flags the CLI does not have: {wrong}"


# `python benchmarks/fanout.py --repeat 5`, or in the text `fanout.py --sizes 256` (a script under
# benchmarks/ or examples/): each flag must be one the script (or a module beside it) defines.
SCRIPT_CALL = re.compile(r"(?<![\w/.-])((?:benchmarks/|examples/)?[\w/]*\w\.py)((?:[ \t]+[^\s`|#][^\s`|]*)*)")


def _script(named: str) -> Path | None:
    for base in (ROOT, ROOT / "benchmarks", ROOT / "examples"):
        path = (base / named).resolve()
        if path.is_file() and path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in SCRIPT_DIRS:
            return path
    return None


SCRIPT_DIRS = ("benchmarks", "examples")


def test_script_flags_in_the_docs_exist() -> None:
    wrong, checked = [], 0
    for page in PAGES:
        for named, args in SCRIPT_CALL.findall(page.read_text()):
            flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args)
            script = _script(named) if flags else None
            if script is None:
                continue
            source = "\n".join(p.read_text() for p in script.parent.glob("*.py"))
            checked += 1
            wrong += [f"{page.name}: {named} {flag}" for flag in flags if f'"{flag}"' not in source]
    assert checked >= 10, "the docs name benchmark flags; this test stopped finding them"
    assert not wrong, f"flags the scripts do not define: {wrong}"


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
