"""The `serial` mark's progress line: under xdist a serial test's start is announced on the
controller (its dot comes only when it ends), with the hooks tests/conftest.py registers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_serial_test_is_announced_as_it_starts_running_alone(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.serial_mark import (  # noqa: F401\n"
        "    pytest_configure, pytest_runtest_logreport, pytest_runtest_makereport, pytest_runtest_protocol,\n"
        ")\n"
    )
    (tmp_path / "test_pair.py").write_text(
        "import pytest\n\n\ndef test_plain():\n    pass\n\n\n"
        "@pytest.mark.serial\ndef test_alone():\n    pass\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # Only xdist: the installed plugins' imports cost three processes ~14 s of CPU here.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *("-p", "xdist.plugin", "-n", "2", "-p", "no:cacheprovider"),
            *("-o", "markers=serial", "-q"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[serial, running alone] test_pair.py::test_alone" in out.stdout
    assert "test_plain" not in out.stdout  # only serial tests get a line
