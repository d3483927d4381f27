"""The command line with nothing hidden: help for every flag (default, choices), the flags for what
was Python-only (--prices, --api-key-env, --max-output-tokens, --prompt), errors told in flags,
`recursa models`, `recursa serve` (busy port, access log, metrics) and folder contexts that leave
binary files out. Each through the CLI as a process of its own, as a user runs it (forked from a
launcher that imported the CLI once, tests/cli_launcher.py; `run --help` from a fresh interpreter)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recursa.cli import DEMO_FAMILIES, _parser
from recursa.errors import ConfigError
from recursa.sandbox import SANDBOXES
from recursa.testing.fake_server import FakeServer
from tests.cli_launcher import CliLauncher, clean_env

REPO = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**extra)


def _cli(
    launcher: CliLauncher | None, *argv: str, cwd: Path, timeout: int = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """`recursa ARGV` in its own process: forked from `launcher`, or with None a fresh interpreter."""
    if launcher is not None:
        return launcher.run(list(argv), cwd=cwd, env=_env(**env), timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "recursa.cli", *argv],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# -- help ------------------------------------------------------------------------------------------


def _subparsers(
    parser: argparse.ArgumentParser | None = None, prefix: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every command by its full name, nested ones (`export rl`) included."""
    parser = parser if parser is not None else _parser()
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[prefix + name] = sub
                found.update(_subparsers(sub, f"{prefix}{name} "))
    return found


def test_every_flag_has_help_and_shows_its_default():
    missing, no_default = [], []
    for name, sub in _subparsers().items():
        if name == "fake-server":  # a stand-in: `recursa fake-server --help` is the fake server's own parser
            continue
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                missing.append(label)
                continue
            shown = sub.formatter_class(prog=sub.prog)._get_help_string(action)
            has_default = not any(action.default is empty for empty in (None, False, argparse.SUPPRESS))
            if action.option_strings and has_default and "default" not in shown:
                no_default.append(label)
    assert not missing, f"flags without help: {missing}"
    assert not no_default, f"flags whose help does not show the default: {no_default}"


def test_help_never_shows_a_key_taken_from_the_environment(tmp_path, cli_launcher):
    secret = "env-secret-key-4242"
    for command in ("serve", "mcp", "acp", "run"):
        out = _cli(cli_launcher, command, "--help", cwd=tmp_path, RECURSA_SERVE_API_KEY=secret)
        assert out.returncode == 0 and secret not in out.stdout, command


def test_fake_server_help_shows_defaults(tmp_path, cli_launcher):
    out = _cli(cli_launcher, "fake-server", "--help", cwd=tmp_path)
    assert out.returncode == 0 and "--port PORT" in out.stdout and "(default: 8765" in out.stdout


def test_choices_are_listed_where_there_are_some():
    subs = _subparsers()
    assert f"{{{','.join(SANDBOXES)}}}" in subs["run"].format_help()  # the registry's kinds
    assert f"{{{','.join(DEMO_FAMILIES)}}}" in subs["demo"].format_help()
    bench = subs["bench"].format_help()
    assert "codeact-bm25" in bench and "rlm-nosub" in bench  # --method takes a comma list
    assert "{local,ray}" in bench
    assert "the question to answer" in subs["run"].format_help()


def test_listed_choices_are_the_real_ones():
    from recursa.config import BUILTIN_TEMPLATES
    from recursa.tasks import families

    assert tuple(families()) == DEMO_FAMILIES
    prompt = next(a for a in _subparsers()["run"]._actions if "--prompt" in a.option_strings)
    assert all(name in (prompt.help or "") for name in BUILTIN_TEMPLATES)


def test_run_help_as_a_subprocess_shows_the_new_flags(tmp_path):
    out = _cli(None, "run", "--help", cwd=tmp_path)
    assert out.returncode == 0
    for flag in (
        "--prices FILE",
        "--api-key-env NAME",
        "--max-output-tokens",
        "--prompt",
        "(default: 16384)",
    ):
        assert flag in out.stdout


# -- errors in the interface's own terms ------------------------------------------------------------


def _missing_key() -> Exception:
    from recursa.lm.registry import make_client

    try:
        make_client("openai/gpt-5-mini", api_key=None, base_url=None)
    except ConfigError as exc:
        return exc
    raise AssertionError("no error")


def _bad_url() -> Exception:
    from recursa.lm.registry import make_client

    try:
        make_client("openai/m", api_key="k", base_url="localhost:8000/v1")
    except ConfigError as exc:
        return exc
    raise AssertionError("no error")


@pytest.mark.parametrize(
    ("error", "python", "cli"),
    [
        (
            _missing_key,
            "set OPENAI_API_KEY or pass api_key= (or pass base_url= for a local",
            "set OPENAI_API_KEY or pass --api-key-env NAME (or pass --base-url for a local",
        ),
        (
            _bad_url,
            "with its scheme, e.g. base_url='http://localhost:8000/v1'.",
            "with its scheme, e.g. --base-url http://localhost:8000/v1.",  # no stray quote
        ),
    ],
)
def test_a_lower_layers_message_names_settings_as_each_door_writes_them(monkeypatch, error, python, cli):
    """A model client cannot know who made it: its message marks the settings it names, and each
    front door names them from the schema's declaration (the flag; a client's "the operator's")."""
    from recursa.config import Spelling

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    exc = error()
    assert python in str(exc) and "«" not in str(exc)
    assert cli in Spelling("cli").told(exc)
    client = Spelling("dotted", "recursa").told(exc)
    assert "the operator's --base-url" in client and "recursa.base_url" not in client  # not a client's to set


# -- recursa models --------------------------------------------------------------------------------


def test_models_lists_providers_scripted_models_and_environment(tmp_path, cli_launcher):
    out = _cli(cli_launcher, "models", cwd=tmp_path, RECURSA_MODEL="scripted/no-subcalls")
    assert out.returncode == 0, out.stderr
    for needle in (
        "openai",
        "anthropic",
        "scripted/gpt5-like",
        "scripted/oracle",
        "--base-url",
        "vLLM",
        "Ollama",
    ):
        assert needle in out.stdout
    for var in (
        "RECURSA_MODEL",
        "RECURSA_SUB_MODEL",
        "RECURSA_BASE_URL",
        "OPENAI_API_KEY",
        "ANTHROPIC_API_KEY",
    ):
        assert var in out.stdout
    as_json = json.loads(
        _cli(
            cli_launcher,
            "models",
            "--json",
            cwd=tmp_path,
            RECURSA_MODEL="scripted/no-subcalls",
            OPENAI_API_KEY="sk-secret-value",
        ).stdout
    )
    env = {e["name"]: e["set"] for e in as_json["environment"]}
    assert (
        env["RECURSA_MODEL"] is True and env["RECURSA_SUB_MODEL"] is False and env["OPENAI_API_KEY"] is True
    )
    assert "sk-secret-value" not in json.dumps(as_json)  # whether a key is set, never its value
    assert {s["model"] for s in as_json["scripted"]} >= {"scripted/gpt5-like", "scripted/oracle"}
    assert all(s["what"] for s in as_json["scripted"])


# -- the new flags ----------------------------------------------------------------------------------


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("The launch code is 7741. Nothing else matters.\n" * 20)
    return tmp_path


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_prices_file_prices_the_run(notes, suffix, cli_launcher):
    # A model served by an OpenAI-compatible server that reports no cost: the file's price counts.
    path = notes / f"prices{suffix}"
    name = "openai/scripted/gpt5-like"
    sub = "openai/scripted/oracle"
    if suffix == ".json":
        rates = {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0}
        path.write_text(json.dumps({name: rates, sub: rates}))
    else:
        table = "input_per_mtok = 1000.0\noutput_per_mtok = 2000.0\n"
        path.write_text(f'["{name}"]\n{table}["{sub}"]\n{table}')
    with FakeServer() as srv:
        out = _cli(
            cli_launcher,
            "run",
            "What is the launch code?",
            "--context",
            "notes.txt",
            "--model",
            name,
            "--sub-model",
            "openai/scripted/oracle",
            "--base-url",
            srv.base_url,
            "--prices",
            path.name,
            "--max-usd",
            "500",
            "--json",
            "--trace-dir",
            "traces",
            cwd=notes,
        )
    assert out.returncode == 0, out.stderr
    usage = json.loads(out.stdout)["usage"]["by_model"][name]
    expected = (usage["input_tokens"] * 1000.0 + usage["output_tokens"] * 2000.0) / 1e6
    assert usage["cost_usd"] == pytest.approx(expected, rel=0.05) and expected > 0


def test_api_key_env_sends_that_key_and_max_output_tokens_reach_each_call(notes, cli_launcher):
    with FakeServer(api_key="team-key-0123456789") as srv:
        args = (
            "run",
            "What is the launch code?",
            "--context",
            "notes.txt",
            "--model",
            "openai/scripted/gpt5-like",
            "--sub-model",
            "openai/scripted/oracle",
            "--base-url",
            srv.base_url,
            "--api-key-env",
            "TEAM_KEY",
            "--max-output-tokens",
            "3000",
            "--trace-dir",
            "traces",
            "--json",
        )
        ok = _cli(cli_launcher, *args, cwd=notes, TEAM_KEY="team-key-0123456789")
        refused = _cli(cli_launcher, *args, cwd=notes, TEAM_KEY="another-key-987654321")
        sent = [r.max_tokens for r in srv.requests if r.status == 200]
    assert ok.returncode == 0, ok.stderr
    assert sent and set(sent) == {3000}
    assert refused.returncode != 0
    assert "another-key-987654321" not in refused.stdout + refused.stderr


def test_prompt_flag_picks_the_template(notes, cli_launcher):
    out = _cli(
        cli_launcher,
        "run",
        "What is the launch code?",
        "--context",
        "notes.txt",
        "--model",
        "scripted/gpt5-like",
        "--prompt",
        "answer-dict",
        "--trace-dir",
        "traces",
        "--json",
        cwd=notes,
    )
    assert out.returncode == 0, out.stderr
    trace = (notes / json.loads(out.stdout)["trace_path"]).read_text()
    assert 'answer[\\"ready\\"]' in trace or "answer['ready']" in trace or "answer dict" in trace


def test_folder_context_leaves_out_binary_files_that_decode(tmp_path, cli_launcher):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("readable text")
    (folder / "b.db").write_bytes(b"SQLite\x00\x00\x00page")  # valid UTF-8, still binary
    (folder / "c.bin").write_bytes(b"\xff\xfe\x00bad")
    args = ("run", "What is here?", "--context", "docs", "--model", "scripted/gpt5-like", "--trace-dir", "t")
    text = _cli(cli_launcher, *args, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "b.db (binary: contains NUL bytes)" in text.stderr and "c.bin (not UTF-8 text)" in text.stderr
    result = json.loads(_cli(cli_launcher, *args, "--json", cwd=tmp_path).stdout)
    assert sorted(result["skipped_files"]) == ["b.db (binary: contains NUL bytes)", "c.bin (not UTF-8 text)"]


def test_fifo_context_is_refused_at_once(tmp_path, cli_launcher):
    os.mkfifo(tmp_path / "pipe")
    out = _cli(cli_launcher, "run", "q", "--context", "pipe", "--model", "scripted/gpt5-like", cwd=tmp_path, timeout=30)
    assert out.returncode == 2 and "named pipe (FIFO)" in out.stderr


# -- fake-server and serve --------------------------------------------------------------------------


CHECKOUT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_fake_server_without_the_server_extra_prints_one_line(tmp_path, where):
    """From a source checkout the hint is the editable form (`recursa[server]` would ask an index
    for another copy): `.` in the checkout's folder, the checkout's path from anywhere else."""
    code = "import sys; sys.modules['uvicorn'] = None; from recursa.cli import main; sys.exit(main(['fake-server']))"
    cwd = CHECKOUT if where == "checkout" else tmp_path
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    hint = 'pip install -e ".[server]"' if where == "checkout" else f'pip install -e "{CHECKOUT}[server]"'
    assert out.stderr.strip() == f"recursa fake-server: needs the server extra: {hint}"


def test_an_installed_package_is_told_the_extra_by_name(monkeypatch):
    from recursa import extras

    monkeypatch.setattr(extras, "source_checkout", lambda: None)
    assert extras.install_hint("mcp") == 'pip install "recursa[mcp]"'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_announces_its_url_logs_each_request_and_serves_metrics(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    import httpx

    port = _free_port()
    _, hard_files = resource.getrlimit(resource.RLIMIT_NOFILE)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recursa.cli",
            "serve",
            "--model",
            "scripted/gpt5-like",
            "--port",
            str(port),
            "--api-key",
            "serve-key-0123456789",
            "--trace-dir",
            "traces",
        ],
        cwd=tmp_path,
        env=_env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard_files)),
    )
    try:
        assert proc.stderr is not None
        announced = proc.stderr.readline()
        assert f"at http://127.0.0.1:{port}/v1" in announced
        # Started at a soft limit of 256 descriptors (128 connections), it lifted its own.
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        files = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        soft_files = int(files.split()[3])
        assert soft_files == min(hard_files, 65_536)
        auth = {"Authorization": "Bearer serve-key-0123456789"}
        body = {"model": "recursa", "messages": [{"role": "user", "content": "the secret is 7"}]}
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=auth, timeout=60
        )
        assert answer.status_code == 200
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=auth, timeout=30)
        assert metrics.status_code == 200 and "recursa_runs_total" in metrics.text
        logged = [proc.stderr.readline() for _ in range(2)]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    run_id = answer.json()["recursa"]["run_id"]
    assert (
        logged[0].startswith("recursa serve: POST /v1/chat/completions 200 ") and f"run={run_id}" in logged[0]
    )
    assert logged[1].startswith("recursa serve: GET /metrics 200 ")
    assert "serve-key" not in "".join(logged) and "secret is 7" not in "".join(logged)


def test_a_bool_setting_is_a_flag_pair_from_the_schema() -> None:
    from recursa.cli_options import add_model_options, run_kwargs

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    on = parser.parse_args(["--model", "scripted/gpt5-like", "--cache-subcalls"])
    off = parser.parse_args(["--model", "scripted/gpt5-like", "--no-cache-subcalls"])
    default = parser.parse_args(["--model", "scripted/gpt5-like"])
    assert run_kwargs(on)["cache_subcalls"] is True
    assert run_kwargs(off)["cache_subcalls"] is False and run_kwargs(default)["cache_subcalls"] is False


class _Started(Exception):
    """Raised where a command's work would begin: its settings are all checked by then."""


@pytest.mark.parametrize("command", ["run", "chat", "bench", "openenv"])
def test_a_command_checks_its_run_settings_once_named_as_flags(monkeypatch, capsys, tmp_path, command) -> None:
    """The flags were checked by the schema (check_flags), then again as the RLM or RLMEnv was
    made, and the budget caps twice too: each is checked once now, by the door that makes the
    runs, before any work starts, and a bad one is still named as the flag typed."""
    from recursa import cli_chat, rlm
    from recursa.bench import runner
    from recursa.config import EnvConfig, RLMConfig

    from .helpers import cli_in_process

    checks: list[str] = []
    for schema in (RLMConfig, EnvConfig):
        check = schema.checked.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(schema, "checked", classmethod(lambda cls, *a, _c=check, **k: checks.append(cls.__name__) or _c(cls, *a, **k)))  # fmt: skip

    def started(*args: object, **kwargs: object) -> None:
        raise _Started

    monkeypatch.setattr(rlm.RLM, "run", started)
    monkeypatch.setattr(cli_chat.Chat, "run", started)
    monkeypatch.setattr(runner, "plan", started)
    (tmp_path / "notes.txt").write_text("the secret is 42")
    argv = {
        "run": ["run", "q", "--context", str(tmp_path / "notes.txt")],
        "chat": ["chat", "--context", str(tmp_path / "notes.txt")],
        "bench": ["bench", "niah", "--out", str(tmp_path / "out")],
        "openenv": ["openenv"],
    }[command] + ["--model", "scripted/gpt5-like", "--max-iterations", "7", "--max-llm-calls", "9"]
    code, err = cli_in_process(capsys, *argv)
    assert code in (1, 2) and ("_Started" in err or "needs the openenv extra" in err), err
    assert checks == (["EnvConfig", "RLMConfig"] if command == "openenv" else ["RLMConfig"])
    checks.clear()
    code, err = cli_in_process(capsys, *argv, "--max-iterations", "0")
    assert code == 2 and "--max-iterations 0: --max-iterations must be an int >= 1" in err, err
    code, err = cli_in_process(capsys, *argv, "--max-llm-calls", "0")
    assert code == 2 and "--max-llm-calls 0: a cap of 0 stops every run at once" in err, err
    assert "use a positive number such as --max-llm-calls 50, or leave --max-llm-calls out" in err


@pytest.mark.parametrize("command", ["run", "bench", "serve", "acp", "openenv"])
def test_sandbox_options_are_a_flag_of_every_command_that_starts_runs(capsys, tmp_path, command) -> None:
    """`sandbox_options` had no flag: `recursa openenv --sandbox ray`, and the `recursa acp` that a
    verifiers harness starts, could not choose a cluster's address, resources or labels, nor any
    sandbox's snapshots or scratch folder. Its declaration makes the flag now, its values read as
    JSON where they are JSON, each checked by the schema and named as the flag."""
    from recursa.cli import _rlm_from_args
    from recursa.cli_options import run_kwargs

    from .helpers import cli_in_process

    given = ["--sandbox-option", "start_timeout=30", "--sandbox-option", "snapshots=true",
             "--sandbox-option", f"scratch_root={tmp_path}"]  # fmt: skip
    args = _parser().parse_args(["run", "q", "--context", "x", "--model", "scripted/gpt5-like", *given])
    assert _rlm_from_args(args, print).config.sandbox_options == {
        "start_timeout": 30, "snapshots": True, "scratch_root": str(tmp_path)
    }  # fmt: skip
    # --dialect-option, its dict's sibling, is read by the same parser (it had one of its own).
    args = _parser().parse_args(["run", "q", "--context", "x", "--dialect-option", "tool_name=python",
                                 "--dialect-option", "max_output_length=40"])  # fmt: skip
    assert run_kwargs(args)["dialect_options"] == {"tool_name": "python", "max_output_length": 40}
    argv = {"run": ["run", "q", "--context", str(tmp_path)], "bench": ["bench", "niah", "--out", str(tmp_path / "out")]}
    code, err = cli_in_process(capsys, *argv.get(command, [command]), "--model", "scripted/gpt5-like",
                               "--sandbox-option", "start_timout=30")  # fmt: skip
    assert code == 2, err
    assert "--sandbox-option start_timout=30: --sandbox-option must be options sandbox 'auto' takes: it takes " \
           "no option 'start_timout' (did you mean 'start_timeout'?); its options:" in err  # fmt: skip
    assert not (tmp_path / "out").exists()
