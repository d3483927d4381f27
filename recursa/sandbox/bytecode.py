"""The worker's program files as cached bytecode, so a REPL process does not compile them at start.

Compiling the worker's modules would be a large share of a worker's start, paid again by every
child RLM (docs/performance.md, "Figures behind choices in the code"). The host writes each file's .pyc next to it once (the usual __pycache__ place) and starts
the worker from it: the entry script's .pyc is run as the script, and the worker's imports find the
others' like any import does. Python runs a .pyc given as the script without checking it against its
source, so freshness is checked here, against the header the compiler wrote.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import py_compile
from pathlib import Path

from recursa.sandbox.protocol import WORKER_DIR, WORKER_PATH

_HEADER = 16  # magic, flags, source mtime, source size


def cached_bytecode(source: Path) -> str | None:
    """A fresh .pyc of `source` (written now if missing or stale), or None where it cannot be."""
    cached = importlib.util.cache_from_source(str(source))
    if not _fresh(source, cached):
        with contextlib.suppress(OSError, py_compile.PyCompileError):
            py_compile.compile(str(source), cfile=cached, doraise=True)
    return cached if _fresh(source, cached) else None


def worker_entry() -> str:
    """What the worker's command line runs: its fresh bytecode, else its source. Every module of
    the worker gets its bytecode cached on the way, so its imports do not compile either."""
    for source in _worker_sources():
        if source != WORKER_PATH:
            cached_bytecode(source)
    return cached_bytecode(WORKER_PATH) or os.fspath(WORKER_PATH)


def worker_files() -> list[str]:
    """What a bwrap namespace must show a worker to start: the worker's folder, bytecode included."""
    return [os.fspath(WORKER_DIR)]


@functools.cache
def _worker_sources() -> tuple[Path, ...]:
    return tuple(sorted(WORKER_DIR.glob("*.py")))


def _fresh(source: Path, cached: str) -> bool:
    try:
        with open(cached, "rb") as f:
            header = f.read(_HEADER)
        st = os.stat(source)
    except OSError:
        return False
    if len(header) < _HEADER or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags != 0:  # hash-based pycs: let the compiler decide; we only write timestamp ones
        return False
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    return mtime == (int(st.st_mtime) & 0xFFFFFFFF) and size == (st.st_size & 0xFFFFFFFF)
