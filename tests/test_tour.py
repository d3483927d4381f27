"""docs/tour.md runs as written: each of its shell blocks, in order, in one fresh folder, with the
page's ports swapped for free ones. A block ending in `&` is a server: it is started, and the next
block waits until its port accepts connections (bounded). The others must exit 0, and what the page
says they print is checked."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tour.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
PORT = re.compile(r"--port (\d+)")
NEEDLE = "6813264"  # the answer the page says the run and the client print


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited: {proc.communicate()[1]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def test_the_tour_runs_as_written(tmp_path: Path) -> None:
    blocks = BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    assert len(blocks) >= 7, "docs/tour.md lost its commands"
    text = "\n".join(blocks)
    ports = {p: str(_free_port()) for p in set(PORT.findall(text))}
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY") and not k.startswith("RECURSA_")}
    servers: list[subprocess.Popen[str]] = []
    outputs: list[str] = []
    try:
        for block in blocks:
            for page_port, port in ports.items():
                block = block.replace(f":{page_port}", f":{port}").replace(
                    f"--port {page_port}", f"--port {port}"
                )
            command = block.strip()
            if command.endswith("&"):
                proc = subprocess.Popen(
                    ["bash", "-c", "exec " + command.removesuffix("&").strip()],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                servers.append(proc)
                port_flag = PORT.search(command)
                assert port_flag is not None, f"a server in the tour without --port: {command}"
                _wait_for(int(port_flag.group(1)), proc)
                continue
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert out.returncode == 0, f"{command}\nstdout: {out.stdout}\nstderr: {out.stderr}"
            outputs.append(out.stdout)
        viewer = PORT.search(servers[-1].args[-1])  # the last server the page starts: the viewer
        assert viewer is not None
        assert httpx.get(f"http://127.0.0.1:{viewer.group(1)}/", timeout=30).status_code == 200
    finally:
        for proc in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # its own session: the pid is the group
            proc.wait(timeout=30)
    run_out, client_out = outputs[1], outputs[2]
    assert NEEDLE in run_out  # recursa run's answer
    assert client_out.strip() == f"number={NEEDLE}"  # the typed answer, parsed by the client
    html = (tmp_path / "run.html").read_text(encoding="utf-8")
    assert "<html" in html.lower() and len(list((tmp_path / "traces").glob("*.jsonl"))) >= 2
