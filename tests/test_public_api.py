"""The supported API is the table of docs/reference/python.md: each package listed there exports
exactly its names, and the internal subpackages export none."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = ("recursa.asgi", "recursa.loop", "recursa.methods", "recursa.testing", "recursa.tools")


def _table() -> dict[str, set[str]]:
    page = (ROOT / "docs" / "reference" / "python.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(recursa[\w.]*)` \| (.+) \|$", page, re.M)
    return {package: set(re.findall(r"`(\w+)`", names)) for package, names in rows}


def test_each_public_package_exports_exactly_its_documented_names() -> None:
    table = _table()
    assert "recursa" in table and len(table) >= 10
    for package, names in table.items():
        module = importlib.import_module(package)
        assert set(module.__all__) == names, package
        for name in names:
            assert getattr(module, name) is not None, f"{package}.{name}"


def test_internal_subpackages_export_nothing_and_every_subpackage_is_classified() -> None:
    table = _table()
    for package in INTERNAL:
        assert not getattr(importlib.import_module(package), "__all__", []), package
    subpackages = {f"recursa.{p.parent.name}" for p in (ROOT / "recursa").glob("*/__init__.py")}
    assert subpackages <= {*table, *INTERNAL, "recursa.integrations"}, subpackages - {*table, *INTERNAL}
