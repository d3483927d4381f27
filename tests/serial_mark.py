"""The `serial` mark: under pytest-xdist (the pyproject's addopts run two workers), a test so
marked runs while no other worker runs a test, and the run says when one starts.

Tests whose assertions depend on how fast things happen side by side (requests overlapping, a
bound of calls in flight being reached) run alone: every test holds a shared lock on a file in the
run's temporary folder, a serial one holds it exclusively. Every test first passes a turnstile (a
second lock), so a serial test that waits is not starved by the other worker taking shared turns
one after another.

Progress: xdist prints a test's dot only when it ends, and serial tests are among the slowest, so a
run could sit silent (often at 100%, its last line of dots) for a minute. The worker marks a
serial test's setup report, which reaches the controller as the test starts running alone, and the
controller prints a line naming it.

tests/conftest.py registers these hooks by importing them.
"""

from __future__ import annotations

import fcntl
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

SERIAL = "serial"  # the user property a serial test's setup report carries to the controller

_locks: tuple[IO[bytes], IO[bytes]] | None = None
_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _locks, _config
    _config = config
    if not hasattr(config, "workerinput"):
        return  # not an xdist worker: one process runs every test in turn already
    # Each worker's basetemp is a folder in the controller's, which every worker shares.
    shared = Path(config.option.basetemp).parent
    _locks = ((shared / "serial.turnstile").open("ab"), (shared / "serial.lock").open("ab"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, object]:
    if _locks is None:
        return (yield)
    turnstile, lock = _locks
    serial = item.get_closest_marker("serial") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    finally:
        if not serial:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        return (yield)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        if serial:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, object, object]:
    report = yield
    if _locks is not None and call.when == "setup" and item.get_closest_marker("serial") is not None:
        report.user_properties.append((SERIAL, "runs alone"))  # type: ignore[attr-defined]
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller: a line as a serial test starts (its setup report came from a worker)."""
    if report.when != "setup" or not report.passed or _config is None or hasattr(_config, "workerinput"):
        return
    if not any(prop[0] == SERIAL for prop in report.user_properties):
        return
    terminal = _config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line(f"[serial, running alone] {report.nodeid}")
