"""`recursa chat` as a user runs it: questions on stdin, one session for all of them (variables and
`history` carry over), a failing question that does not end the chat, and bad input as one line.

The root model is `openai/chat-root` behind the fake server: its reply depends on which question
(a tag such as Q-SET) the run was asked, so one process can be scripted question by question. Each
chat is a process of its own, forked from a launcher that imported the CLI once (tests/cli_launcher.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_launcher import CliLauncher

ROOT = "chat-root"
KEY = "chat-test-key-0123456789"

REPLIES = {
    "Q-SET": "Storing a value.\n```repl\nsecret = 6 * 7\nFINAL('stored')\n```",
    "Q-GET": "Reading it back.\n```repl\nFINAL(f'secret={secret} context={len(context)}')\n```",
    "Q-HISTORY": "Looking at earlier questions.\n```repl\nFINAL(' | '.join(h['question'] for h in history))\n```",
}


def responder(model: str, messages: list[dict]) -> str:
    assert model == ROOT, model
    question = messages[1]["content"]  # the run's first user message holds its question
    for tag, reply in REPLIES.items():
        if tag in question:
            return reply
    return "FINAL(unknown question)"


@pytest.fixture
def chat_server(server):
    server.holder["responder"] = responder
    server.reset()
    server.latency_s = 0.0
    return server


@pytest.fixture
def context_file(tmp_path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("alpha beta gamma\n" * 10)  # 170 characters
    return path


def chat(
    launcher: CliLauncher, *args: str, stdin: str, server=None, key: bool = True, timeout: int = 60
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY") and k != "RECURSA_BASE_URL"}
    if key:
        env["OPENAI_API_KEY"] = KEY
    model = ["--model", f"openai/{ROOT}", "--base-url", server.base_url] if server is not None else []
    return launcher.run(["chat", *model, *args], cwd=Path.cwd(), env=env, stdin=stdin, timeout=timeout)


def questions_seen(server) -> list[str]:
    return [r.messages[1]["content"] for r in server.requests if len(r.messages) > 1]


def test_three_questions_share_one_session(chat_server, context_file, tmp_path, cli_launcher):
    stdin = "Q-SET remember a number\n\n   \nQ-GET what was it?\nQ-HISTORY what came before?\nexit\nQ-NEVER\n"
    out = chat(
        cli_launcher,
        "--context",
        str(context_file),
        "--json",
        "--trace-dir",
        str(tmp_path),
        stdin=stdin,
        server=chat_server,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["question"] for r in rows] == [
        "Q-SET remember a number",
        "Q-GET what was it?",
        "Q-HISTORY what came before?",
    ]
    assert [r["stop_reason"] for r in rows] == ["final"] * 3
    assert rows[0]["answer"] == "stored"
    assert rows[1]["answer"] == "secret=42 context=170"  # a variable from question 1, same REPL
    assert rows[2]["answer"] == "Q-SET remember a number | Q-GET what was it?"
    # One session, one trace; nothing after "exit" reached the model.
    assert len({r["trace_path"] for r in rows}) == 1
    trace = Path(rows[0]["trace_path"])
    assert trace.exists() and str(trace) in out.stderr
    assert not any("Q-NEVER" in q for q in questions_seen(chat_server))


def test_plain_output_answers_on_stdout_status_on_stderr(chat_server, context_file, tmp_path, cli_launcher):
    out = chat(
        cli_launcher,
        "--context",
        str(context_file),
        "--trace-dir",
        str(tmp_path),
        stdin="Q-SET\nQ-GET\n",
        server=chat_server,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["stored", "secret=42 context=170"]  # ends at end of input
    status = [line for line in out.stderr.splitlines() if line.startswith("[final]")]
    assert len(status) == 2 and all("1 turns" in s and "LM calls" in s and "tokens" in s for s in status)
    assert "after 2 questions · trace: " in out.stderr


def test_a_failing_question_is_reported_and_the_chat_goes_on(chat_server, context_file, tmp_path, cli_launcher):
    # A 1 ms budget refuses every root call: each question fails on its own, the chat goes on. (A
    # token cap below one call's reservation is refused at start instead: test_cli_options.py.)
    out = chat(
        cli_launcher,
        "--context",
        str(context_file),
        "--max-seconds",
        "0.001",
        "--trace-dir",
        str(tmp_path),
        stdin="Q-SET\nQ-GET\nquit\n",
        server=chat_server,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    early = [line for line in out.stderr.splitlines() if "this question stopped early" in line]
    assert len(early) == 2 and all("budget" in line for line in early)
    assert out.stdout == ""
    assert chat_server.requests == []  # refused before being sent


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ("missing.txt", "does not exist; check the path"),
        ("-", "reads its questions from stdin"),
        ("empty.txt", "the context is empty"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(chat_server, tmp_path, context, message, cli_launcher):
    (tmp_path / "empty.txt").write_text("")
    path = context if context == "-" else str(tmp_path / context)
    out = chat(
        cli_launcher, "--context", path, "--trace-dir", str(tmp_path), stdin="Q-SET\nQ-GET\n", server=chat_server
    )
    assert out.returncode == 2
    assert out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if line.startswith("recursa: error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr


def test_a_missing_api_key_is_one_line_before_any_question(context_file, cli_launcher):
    out = chat(
        cli_launcher, "--context", str(context_file), "--model", "openai/gpt-5-mini", stdin="hello\n", key=False
    )
    assert out.returncode == 2
    assert out.stderr.startswith("recursa: error: no OpenAI API key") and out.stderr.count("\n") == 1
