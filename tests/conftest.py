"""Shared fixtures: a fake OpenAI/Anthropic-compatible server per test module, a way to script a
root model turn by turn behind it, and the lines of `recursa serve`'s access log. Also the `serial` mark: under pytest-xdist (the
pyproject's addopts run two workers), a test so marked runs while no other worker runs a test."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from recursa.testing.fake_server import FakeServer
from tests.cli_launcher import CliLauncher
from tests.helpers import CHROMIUM, CHROMIUM_ARGS

Responder = Callable[[str, list[dict]], str]


class Script:
    """Replies per model: a root gets its replies in order (by how many it already gave); a
    sub-model answers with a function of the prompt."""

    def __init__(self) -> None:
        self.roots: dict[str, list[str]] = {}
        self.subs: dict[str, Callable[[str], str]] = {}

    def root(self, model: str, *replies: str) -> Script:
        self.roots[model] = list(replies)
        return self

    def sub(self, model: str, fn: Callable[[str], str]) -> Script:
        self.subs[model] = fn
        return self

    def __call__(self, model: str, messages: list[dict]) -> str:
        is_run = len(messages) > 1 and messages[0]["role"] == "system"
        if is_run and model in self.roots:
            turn = sum(1 for m in messages if m["role"] == "assistant")
            replies = self.roots[model]
            return replies[min(turn, len(replies) - 1)]
        if model in self.subs:
            return self.subs[model](messages[-1]["content"])
        raise KeyError(f"the script has no reply for model {model!r}")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    holder: dict[str, Responder] = {}

    def respond(model: str, messages: list[dict]) -> str:
        return holder["responder"](model, messages)

    srv = FakeServer(responder=respond)
    srv.holder = holder  # type: ignore[attr-defined]
    with srv:
        yield srv


@pytest.fixture
def script(server: FakeServer) -> Script:
    s = Script()
    server.holder["responder"] = s  # type: ignore[attr-defined]
    server.reset()
    server.latency_s = 0.0
    return s


# The `serial` mark's hooks (tests/serial_mark.py), registered by being names of this module.
from tests.serial_mark import (  # noqa: E402, F401
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, one per test module; skipped with the reason where it is not installed."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium); CI installs it")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="session")
def cli_launcher() -> Iterator[CliLauncher]:
    """`recursa` commands as processes forked from one that imported the CLI (tests/cli_launcher.py)."""
    launcher = CliLauncher()
    yield launcher
    launcher.close()


@pytest.fixture
def access_lines() -> Iterator[list[str]]:
    """What the access logger emits, caught on the logger itself (whatever its propagation)."""
    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("recursa.serve.access")
    old = logger.level, logger.disabled
    logger.setLevel(logging.INFO)  # setLevel, not an attribute: it also clears isEnabledFor's cache
    # A logging.config.dictConfig call elsewhere in the test process (import-linter's, in
    # test_layout.py) disables every logger that existed then, this one included.
    logger.disabled = False
    handler = Catch()
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(old[0])
    logger.disabled = old[1]


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process of the host's own, which no sandboxed cell may get killed (the authority tests)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()
