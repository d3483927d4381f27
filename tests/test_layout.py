"""The shape of the package stays as docs/architecture.md draws it: no import cycles (type-only
ones included), imports point down, and no module over 600 lines.

The rules live in pyproject.toml ([tool.importlinter]) so `lint-imports` checks the same thing by
hand; this test runs them and adds what import-linter does not check directly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter (dev extra) checks the import rules")
importlinter_config = pytest.importorskip(
    "importlinter.configuration", reason="import-linter is in the dev extra"
)
from importlinter.application import use_cases  # noqa: E402  (after the importorskip above)

importlinter_config.configure()

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "recursa"
MAX_LINES = 600


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # Imports inside functions and under TYPE_CHECKING are part of the graph: neither hides a cycle.
    return grimp.build_graph("recursa", cache_dir=None)


def test_the_package_under_test_is_this_checkout(graph: grimp.ImportGraph) -> None:
    import recursa

    # grimp finds the package the way `import` does; a stale install elsewhere would check the wrong tree.
    assert Path(recursa.__file__).resolve().parent == PACKAGE
    assert "recursa.rlm" in graph.modules


def test_import_contracts_in_pyproject_hold(capsys: pytest.CaptureFixture[str]) -> None:
    # The use case, not importlinter.cli.lint_imports: the CLI entry point calls logging's dictConfig,
    # which disables every logger that exists (recursa.serve.access's lines vanished from the tests
    # that ran after this one), and puts the working directory on sys.path.
    existing = logging.getLogger("recursa.layout_probe")
    passed = use_cases.lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None)
    report = capsys.readouterr().out
    assert passed, f"an import contract is broken (see docs/architecture.md):\n{report}"
    assert not existing.disabled, "linting reconfigured the process's logging"
    assert "0 broken" in report and "2 kept" in report


def test_no_module_imports_its_way_back_to_itself(graph: grimp.ImportGraph) -> None:
    # acyclic_siblings compares the children of each package; this also catches a module that
    # cycles through its own package's __init__ (recursa.x.y -> recursa.x -> recursa.x.y).
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.append(" -> ".join((importer, *back)))
    assert not cycles, "import cycles (cut them by moving the shared piece down):\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        # The model clients depend on nothing above them: not the offline models, task families,
        # baselines, fakes, loop or servers.
        *[("recursa.lm", up) for up in ("recursa.scripted", "recursa.tasks", "recursa.methods")],
        *[("recursa.lm", up) for up in ("recursa.testing", "recursa.loop", "recursa.serve", "recursa.rlm")],
        # The offline models sit beside the clients and reach lm only through its provider registry.
        ("recursa.scripted", "recursa.testing"),
        ("recursa.scripted", "recursa.loop"),
        # The fake model server stands beside the product's server, not on top of it.
        ("recursa.testing", "recursa.serve"),
        ("recursa.serve", "recursa.testing"),
    ],
)
def test_layer_rule(graph: grimp.ImportGraph, lower: str, upper: str) -> None:
    chain = graph.find_shortest_chain(importer=lower, imported=upper, as_packages=True)
    assert chain is None, f"{lower} must not import {upper}: {' -> '.join(chain or ())}"


def test_the_layer_rules_can_fail(graph: grimp.ImportGraph) -> None:
    # The checks above pass on an empty answer; make sure they see a real upward import.
    assert graph.find_shortest_chain(importer="recursa.scripted", imported="recursa.lm", as_packages=True)
    assert graph.find_shortest_chain(importer="recursa.testing", imported="recursa.asgi", as_packages=True)


def test_no_module_is_over_600_lines() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 50
    too_long = {path: n for path, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines (split them by idea): {too_long}"


# The set-up code every run pays for reading: the front doors' constructors, the schema's own
# checks and the shared set-up (recursa/config.py, configure.py). The settings are declared once, so
# this stays at most half of the 389 lines it was when each door declared and checked its own.
SET_UP = {
    "recursa/rlm.py": ["RLM.__init__", "RLM.configured", "RLM._configure", "check_runs"],
    "recursa/env/env.py": ["RLMEnv.__init__", "RLMEnv.configured", "RLMEnv._configure"],
    "recursa/configure.py": ["build_config", "check_models"],
    "recursa/config.py": ["RLMConfig.*validators", "EnvConfig.*validators"],
}
MAX_SET_UP_LINES = 389 // 2


def _set_up_lines() -> dict[str, int]:
    import ast

    found: dict[str, int] = {}
    for path, names in SET_UP.items():
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            for child in getattr(node, "body", []) if isinstance(node, ast.ClassDef | ast.Module) else []:
                if not isinstance(child, ast.FunctionDef):
                    continue
                owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                validator = any("validator" in ast.unparse(d) for d in child.decorator_list)
                if f"{owner}{child.name}" in names or (validator and f"{owner}*validators" in names):
                    start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    found[f"{path}:{owner}{child.name}"] = (child.end_lineno or start) - start + 1
    return found


def test_the_set_up_code_is_at_most_half_of_what_it_was() -> None:
    lines = _set_up_lines()
    assert {"recursa/rlm.py:RLM.__init__", "recursa/env/env.py:RLMEnv.__init__", "recursa/configure.py:build_config"} <= set(lines)
    assert sum(lines.values()) <= MAX_SET_UP_LINES, lines
