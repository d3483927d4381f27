"""The `recursa` command as a user runs it: JSON output, exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from recursa.tasks import generate
from tests.cli_launcher import CliLauncher


@pytest.fixture
def recursa(cli_launcher: CliLauncher) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`recursa ARGS` in a process of its own (forked from a launcher that imported the CLI once:
    tests/cli_launcher.py), with no provider keys in its environment but those `env` gives.
    `test_run_reads_stdin` starts a fresh `python -m recursa.cli` instead."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
        full_env.update(env or {})
        return cli_launcher.run(list(args), cwd=Path.cwd(), env=full_env, timeout=timeout)

    return run


def test_demo_json(tmp_path, recursa):
    out = recursa("demo", "--json", "--size", "300000", "--trace-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"answer", "expected", "score", "iterations", "llm_calls", "trace_path"} <= data.keys()
    assert data["score"] == 1.0 and data["llm_calls"] > 2
    assert Path(data["trace_path"]).exists()


def test_demo_human_output(tmp_path, recursa):
    out = recursa("demo", "--size", "100000", "--family", "niah", "--trace-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "score:     1.000" in out.stdout and "expected:" in out.stdout


def test_run_json_over_a_file_with_a_scripted_model(tmp_path, recursa):
    task = generate("niah", 200_000, seed=3)
    ctx = tmp_path / "haystack.txt"
    ctx.write_text(task.context)
    out = recursa(
        "run",
        task.question,
        "--context",
        str(ctx),
        "--model",
        "scripted/gpt5-like",
        "--sub-model",
        "scripted/oracle",
        "--json",
        "--trace-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert task.score(data["answer"]) == 1.0
    assert data["stop_reason"] == "final" and data["usage"]["llm_calls"] >= 2


def test_run_reads_stdin(tmp_path):
    task = generate("niah", 50_000, seed=4)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recursa.cli",
            "run",
            task.question,
            "--context",
            "-",
            "--model",
            "scripted/gpt5-like",
            "--json",
            "--trace-dir",
            str(tmp_path),
        ],
        input=task.context,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert task.score(json.loads(out.stdout)["answer"]) == 1.0


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--context", "/no/such/file.txt", "--model", "scripted/gpt5-like"], {}, "does not exist"),
        (["--context", "{ctx}", "--model", "mystery/model"], {}, "provider"),
        (["--context", "{ctx}", "--model", "openai/gpt-5-mini"], {}, "OPENAI_API_KEY"),
        (["--context", "{empty}", "--model", "scripted/gpt5-like"], {}, "empty"),
        (["--context", "{binary}", "--model", "scripted/gpt5-like"], {}, "UTF-8"),
        (
            [
                "--context",
                "{ctx}",
                "--model",
                "scripted/gpt5-like",
                "--max-usd",
                "1",
                "--sub-model",
                "openai/x",
                "--base-url",
                "http://127.0.0.1:9/v1",
            ],
            {},
            "no price is known",
        ),
    ],
)
def test_bad_input_is_one_clear_line_and_a_nonzero_exit(tmp_path, args, env, needle, recursa):
    (tmp_path / "ctx.txt").write_text("some text")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\xfa")
    args = [
        a.format(ctx=tmp_path / "ctx.txt", empty=tmp_path / "empty.txt", binary=tmp_path / "bin.dat")
        for a in args
    ]
    out = recursa("run", "question?", *args, "--trace-dir", str(tmp_path), env=env)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("recursa: error:")


def test_unreachable_server_ends_with_an_error_status_not_a_traceback(tmp_path, recursa):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "ctx.txt").write_text("some text")
    out = recursa(
        "run",
        "q",
        "--context",
        str(tmp_path / "ctx.txt"),
        "--model",
        "openai/m",
        "--base-url",
        f"http://127.0.0.1:{port}/v1",
        "--max-seconds",
        "30",
        "--trace-dir",
        str(tmp_path),
    )
    assert out.returncode == 3
    assert f"cannot connect to 127.0.0.1:{port} (connection refused)" in out.stderr
    assert "Traceback" not in out.stderr and "event loop" not in out.stderr


def test_an_early_stop_is_told_in_flags_not_python_arguments(tmp_path, recursa):
    """A rejected key stops the run; the reason the CLI prints names --api-key-env, not api_key=."""
    from recursa.testing.fake_server import FakeServer

    (tmp_path / "ctx.txt").write_text("some text")
    with FakeServer(api_key="the-right-key") as srv:
        out = recursa(
            *("run", "q", "--context", str(tmp_path / "ctx.txt"), "--model", "openai/scripted/gpt5-like"),
            *("--base-url", srv.base_url, "--trace-dir", str(tmp_path)),
            env={"OPENAI_API_KEY": "a-wrong-key-0123456789"},
        )
    assert out.returncode == 3
    assert "rejected the API key (HTTP 401)" in out.stderr
    assert "--api-key-env NAME" in out.stderr and "api_key=" not in out.stderr
    assert "a-wrong-key-0123456789" not in out.stderr


@pytest.mark.parametrize("command", [["serve"], ["mcp", "--http"]])
def test_a_server_on_a_non_loopback_name_without_a_key_warns(tmp_path, command):
    # 127.0.0.2 is a loopback address under another name: the test binds nothing outside the machine.
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    flags = [
        "--model",
        "scripted/gpt5-like",
        "--host",
        "127.0.0.2",
        "--port",
        "0",
        "--trace-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "recursa.cli", *command, *flags],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "http://" in line:  # the announcement comes after the warning
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert any("warning: listening on 127.0.0.2 without --api-key" in line for line in lines), lines


def test_an_answer_printed_on_a_terminal_cannot_drive_it(tmp_path):
    # The answer is the model's: its escape sequences (here a window title, a colour, a carriage
    # return that overwrites the line) reached the user's terminal as they were. Piped, it is data.
    import io
    import pty

    from recursa.terminal import for_terminal
    from recursa.testing.fake_server import FakeServer

    hostile = "ok\x1b]0;pwned\x07 \x1b[31mred\x1b[0m\rX\x9b2J"
    reply = f"```repl\nFINAL({hostile!r})\n```"
    (tmp_path / "ctx.txt").write_text("text")
    with FakeServer(responder=lambda model, messages: reply) as server:
        base = ["run", "q", "--context", str(tmp_path / "ctx.txt"), "--model", "openai/m", "--base-url",
                server.base_url, "--trace-dir", str(tmp_path)]  # fmt: skip
        main, side = pty.openpty()
        try:
            done = subprocess.run([sys.executable, "-m", "recursa.cli", *base], stdout=side,
                                  stderr=subprocess.PIPE, timeout=120)  # fmt: skip
            os.close(side)
            shown = b""
            while True:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the terminal's other end is closed: all was read
                    break
                if not chunk:
                    break
                shown += chunk
        finally:
            os.close(main)
    assert done.returncode == 0, done.stderr
    text = shown.decode("utf-8", "replace")
    assert "\x1b" not in text and "\x9b" not in text and "\r" not in text.replace("\r\n", "\n")
    assert r"ok\x1b]0;pwned\x07 \x1b[31mred\x1b[0m\x0dX\x9b2J" in text
    assert for_terminal(hostile, io.StringIO()) == hostile  # piped or redirected, it is data
