"""The servers' settings are declared once (recursa/serve/settings.py, integrations/openenv_settings.py):
`ServeSettings(...)`, the flags of serve, mcp, acp and openenv, and their messages derive from them."""

from __future__ import annotations

import argparse

import pytest

from recursa.budget import Budget
from recursa.cli import _parser
from recursa.config import Spelling
from recursa.errors import ConfigError
from recursa.integrations import openenv_cli
from recursa.integrations.openenv_settings import OPENENV_FLAGS, OPENENV_SETTINGS
from recursa.rlm import RLM
from recursa.serve.commands import _settings
from recursa.serve.settings import FLAGS, SERVER_SETTINGS, ServeSettings

MODEL = "scripted/gpt5-like"


def _options(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


@pytest.mark.parametrize("command", ["serve", "mcp", "acp", "openenv"])
def test_each_commands_flags_are_its_settings_declarations(command: str) -> None:
    declared = OPENENV_SETTINGS if command == "openenv" else SERVER_SETTINGS
    names = OPENENV_FLAGS if command == "openenv" else FLAGS[command]  # type: ignore[index]
    assert names, command
    options = _options(command)
    for name in names:
        s = declared[name]
        action = options["api_keys_file" if name == "api_keys" else name]
        assert s.flag.split()[0] in action.option_strings
        if name not in ("api_key", "api_keys") and not isinstance(action, argparse._AppendAction):
            # the flag's default is the declaration's, in the flag's own unit (MiB of bytes)
            assert action.default == (s.default // s.unit[1] if s.unit else s.default), name
    assert options["idle_sessions_memory_bytes"].default == 4096 if command in ("serve", "mcp") else True


def test_a_flag_in_its_own_unit_reaches_the_setting_in_the_settings_unit(tmp_path) -> None:
    args = _parser().parse_args(["serve", "--model", MODEL, "--idle-sessions-memory", "3", "--max-runs", "5"])
    settings = _settings(args, "serve")
    assert (settings.idle_sessions_memory_bytes, settings.max_runs) == (3 << 20, 5)
    assert settings.run["model"] == MODEL
    args = _parser().parse_args(["mcp", "--model", MODEL, "--idle-sessions-memory", "-1"])
    with pytest.raises(ConfigError) as bad:
        _settings(args, "mcp")
    # named as the flag, its value and the example in MiB
    assert str(bad.value).startswith("--idle-sessions-memory -1: --idle-sessions-memory must be an int >= 0")
    assert "e.g. --idle-sessions-memory 4096" in str(bad.value)


def test_the_operators_run_settings_are_checked_once_at_start_up(monkeypatch) -> None:
    """check_flags, ServeSettings and the start-up model check each ran the schema over the same run
    settings; ServeSettings' check is the one, and check_models goes on from its config."""
    from recursa.config import RLMConfig

    checks: list[dict] = []
    schema_check = RLMConfig.checked.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(RLMConfig, "checked", classmethod(lambda cls, *a, **k: checks.append(k) or schema_check(cls, *a, **k)))
    args = _parser().parse_args(["serve", "--model", MODEL, "--max-iterations", "7", "--max-llm-calls", "9"])
    settings = _settings(args, "serve")
    settings.check_models()
    assert len(checks) == 1 and checks[0]["max_iterations"] == 7
    args = _parser().parse_args(["mcp", "--model", "openai/gpt-5-mini", "--base-url", "http://127.0.0.1:9/v1",
                                 "--max-tokens", "100"])  # fmt: skip
    with pytest.raises(ConfigError, match="--max-tokens 100 is less than the root's first call reserves"):
        _settings(args, "mcp").check_models()  # named as the flag, from the one check's config


@pytest.mark.parametrize(
    ("argv", "told"),
    [
        (["acp", "--max-sessions", "0"], "--max-sessions 0: an ACP agent runs every prompt in a session"),
        (["acp", "--allow-base-url", "ftp://x"], "--allow-base-url ftp://x: --allow-base-url must be a list of http(s) URLs"),
        (["serve", "--allow-path", "/no/such/folder"], "'/no/such/folder' is not a folder"),
        (["serve", "--session-ttl", "0"], "--session-ttl 0.0: --session-ttl must be a number of seconds > 0"),
        (["serve", "--max-depth", "-1"], "--max-depth -1: --max-depth must be an int >= 0"),
    ],
)
def test_a_bad_server_flag_is_named_as_the_flag(argv: list[str], told: str) -> None:
    from recursa.serve.commands import _acp, _serve

    args = _parser().parse_args([argv[0], "--model", MODEL, *argv[1:]])
    with pytest.raises(ConfigError, match=None) as bad:
        (_acp if argv[0] == "acp" else _serve)(args)
    assert told in str(bad.value)


def test_serve_settings_take_run_settings_by_name_and_name_a_bad_one_as_the_argument() -> None:
    settings = ServeSettings(model=MODEL, max_depth=4, budget=Budget(max_llm_calls=9), rlm_options={"max_retries": 0},
                             upstream_api_key="sk-upstream-1234567890")  # fmt: skip
    assert settings.run == {"max_retries": 0, "model": MODEL, "max_depth": 4, "budget": Budget(max_llm_calls=9),
                            "api_key": "sk-upstream-1234567890"}  # fmt: skip
    assert settings.max_depth_limit == 4  # at least the operator's own depth
    assert settings.run_settings()["max_iterations"] == 30  # the run schema's default, not a copy of it
    assert "sk-upstream" not in settings.redact("the key sk-upstream-1234567890 leaked")
    with pytest.raises(ConfigError, match=r"^ServeSettings\(max_runs=0\): max_runs must be an int >= 1"):
        ServeSettings(model=MODEL, max_runs=0)
    with pytest.raises(ConfigError, match=r"^ServeSettings\(max_depth=-1\): max_depth must be an int >= 0"):
        ServeSettings(model=MODEL, max_depth=-1)
    with pytest.raises(ConfigError, match="did you mean 'max_sessions'"):
        ServeSettings(model=MODEL, max_sesions=3)
    with pytest.raises(ConfigError) as twice:
        ServeSettings(model=MODEL, api_key="sk-shared-123", api_keys={"alice": "sk-shared-123"})
    assert "api_keys must be a key per client" in str(twice.value) and "sk-shared" not in str(twice.value)
    with pytest.raises(ConfigError) as typed:  # a key of the wrong type is not shown either
        RLM(MODEL, api_key=b"sk-live-0123456789")
    assert "RLM(api_key=<not shown>): api_key must be a str" in str(typed.value)


@pytest.mark.parametrize(
    ("argv", "told"),
    [
        (["--family", "nope"], "--family nope: --family must be a task family, one of"),
        (["--max-sessions-per-client", "0"], "--max-sessions-per-client 0: --max-sessions-per-client must be an int >= 1"),
        (["--session-idle-timeout", "-1"], "--session-idle-timeout -1.0: --session-idle-timeout must be a number"),
        (["--max-live-repls", "0"], "--max-live-repls 0: --max-live-repls must be an int >= 1"),
    ],
)
def test_openenv_flags_are_checked_by_their_declarations_before_the_extra_loads(argv, told) -> None:
    args = _parser().parse_args(["openenv", "--model", MODEL, *argv])
    with pytest.raises(ConfigError) as bad:
        openenv_cli.run(args)
    assert str(bad.value).startswith(told)


def test_the_signature_shows_the_run_settings_before_and_after_the_first_construction() -> None:
    """Pydantic builds a deferred schema at first use and then put its fields alone in the class's
    signature: the docs' `ServeSettings(model=..., max_depth=...)` stopped matching it, depending on
    which test ran first."""
    import inspect

    from recursa.serve.settings import ServeSettings

    before = inspect.signature(ServeSettings)
    ServeSettings(model="scripted/gpt5-like", max_depth=2)
    after = inspect.signature(ServeSettings)
    assert before == after
    assert {"spelling", "max_runs", "api_key"} <= set(after.parameters)
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in after.parameters.values())


def test_a_clients_none_is_no_setting_so_it_never_widens_the_operators() -> None:
    """Each door dropped a client's None before the policy, in a line of its own (a request's
    fields, an ACP session's _meta, an MCP tool call's arguments) and SkyRL's rows did not: a row's
    budget=None dropped the operator's caps. The policy itself reads None as no setting now; a
    turn_timeout=None would have widened the operator's 60 s to exec_timeout."""
    from recursa.overrides import client_settings

    limits = {"turn_timeout": 60.0, "exec_timeout": 120.0, "budget": Budget(max_usd=1.0)}
    given = {"turn_timeout": None, "budget": None, "max_usd": None, "max_depth": 1}
    assert client_settings(given, limits, Spelling("dotted", "recursa")) == {"max_depth": 1}
