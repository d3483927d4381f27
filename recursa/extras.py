"""What to type to install an optional extra, in the form that works where recursa came from.

From a source checkout (an editable install, the README's `pip install -e .`), `recursa[server]`
names a package on an index, not the checkout, and pip may fetch something else or nothing: the
working form there is `pip install -e ".[server]"` from the checkout's folder. Every missing-extra
message goes through `install_hint`, so the two forms are decided in one place.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def source_checkout() -> Path | None:
    """The folder of the checkout this recursa is imported from, or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    try:
        project = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "recursa"' in project else None


def install_hint(extra: str) -> str:
    """`pip install ...` for `extra` (e.g. "server"), as the user can type it where they are."""
    root = source_checkout()
    if root is None:
        return f'pip install "recursa[{extra}]"'
    try:
        here = Path.cwd().resolve() == root
    except OSError:  # the working folder was removed
        here = False
    return f'pip install -e ".[{extra}]"' if here else f'pip install -e "{root}[{extra}]"'
