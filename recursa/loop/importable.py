"""Which modules generated code can import, in one line for the root's prompt.

Models lose turns on `import numpy` in a REPL that only reads the standard library, so the prompt
says what is there: the standard library always; third-party packages only where the sandbox lets
code read them (`Hardening(allow_site_packages=True)`, a plain or in-process REPL), and then which
of the packages commonly used for data work are installed.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any

from recursa.sandbox import SANDBOXES

# Packages models reach for on text and data tasks, in the order they are listed.
_COMMON = (
    "numpy",
    "pandas",
    "scipy",
    "sklearn",
    "regex",
    "rapidfuzz",
    "networkx",
    "bs4",
    "lxml",
    "yaml",
    "dateutil",
    "sympy",
    "polars",
    "pyarrow",
    "nltk",
)
_STDLIB = "the standard library (re, json, collections, itertools, math, statistics, datetime, difflib, ...)"


def modules_line(sandbox: str, options: dict[str, Any] | None) -> str:
    """What the REPL can import, for the prompt's list of what it gives."""
    options = options or {}
    kind = SANDBOXES.get(sandbox)
    if kind is not None and kind.image:
        return (
            f"Imports: {_STDLIB}; third-party packages only if the {sandbox} image installs them "
            "(try one import before relying on it)."
        )
    if not _site_packages_readable(sandbox, options):
        return (
            f"Imports: {_STDLIB} only. Third-party packages (numpy, pandas, ...) are not available "
            "here: do not import them."
        )
    python = options.get("python")
    if python not in (None, sys.executable):
        return f"Imports: {_STDLIB}, and the packages installed for {python}."
    found = installed_common()
    if not found:
        return f"Imports: {_STDLIB}, and installed third-party packages (none of numpy, pandas, ... is)."
    return f"Imports: {_STDLIB}, and installed third-party packages, among them {', '.join(found)}."


def _site_packages_readable(sandbox: str, options: dict[str, Any]) -> bool:
    if sandbox == "inprocess":
        return True
    hardening = options.get("hardening", True)
    if hardening is False or hardening is None:
        return True  # a plain process: the interpreter reads its site-packages as usual
    if hardening is True:
        return False
    return bool(getattr(hardening, "allow_site_packages", False))


@functools.cache
def installed_common() -> tuple[str, ...]:
    """The common data packages this interpreter can import (looked up once per process)."""
    return tuple(name for name in _COMMON if importlib.util.find_spec(name) is not None)
