"""All the code of one reply runs under one clock, `turn_timeout` (by default exec_timeout).

Each block ran with exec_timeout and only a block that ran out of it stopped the rest, so a reply
of many blocks that each end just short of exec_timeout held one turn that many timeouts over. Here
every reply's blocks sleep 0.6 of the reply's time: the first runs whole, the second is cut by the
reply's clock (it had 0.4 of the time left), and the rest never start, whatever exec_timeout is.
What ran is read from the variables each block sets and from the trace's exec events.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import pytest

from recursa import RLM
from recursa.cli import _parser, _rlm_from_args
from recursa.env import RLMEnv
from recursa.errors import ConfigError
from recursa.lm.base import LMRequest
from recursa.methods.base import MethodSettings, get_method
from recursa.tasks import generate
from recursa.trace import load

CAP = 1.0  # the reply's time for code in these tests; exec_timeout is far above it unless said
NAMES = ("b1", "b2", "b3", "b4")
# The variables the blocks set that exist, as the answer of a later reply.
WHICH_RAN = "FINAL(str([n for n in " + repr(NAMES) + " if n in globals()]))"
CUT_NOTE = (
    f"The time for all the code of one reply ({CAP:g} s for its blocks together) ran out during this block"
)


def code(src: str) -> str:
    return f"```repl\n{src}\n```"


def slow_blocks(seconds: float = 0.6 * CAP) -> str:
    """A reply of four blocks, each sleeping `seconds` and then setting b1, b2, ... ."""
    return "\n".join(code(f"import time\ntime.sleep({seconds})\n{name} = 1") for name in NAMES)


class Replies:
    """A root model (an LM client object) that answers with `replies` in turn."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.model = "turns"
        self.prompts: list[list[dict]] = []

    async def complete(self, request: LMRequest) -> str:
        self.prompts.append(list(request.messages))  # as sent: the run goes on appending to its list
        turn = sum(1 for m in request.messages if m["role"] == "assistant")
        return self.replies[min(turn, len(self.replies) - 1)]

    def told(self, turn: int) -> str:
        """What the model was told after its reply of `turn` (the last message of the next request)."""
        return str(self.prompts[turn][-1]["content"])


def execs(trace_path: str | Path) -> list[dict]:
    return [e for e in load(trace_path).events if e["type"] == "exec"]


def check_cut_after_the_first_block(events: list[dict], told: str) -> None:
    """The first block ran whole, the second was cut by the reply's clock, the others never ran."""
    first, second = events[:2]
    assert [e["block"] for e in events[:2]] == [1, 2] and not first["timed_out"] and second["timed_out"]
    assert second["timeout_s"] < CAP and any(CUT_NOTE in note for note in second["notes"])
    assert "the 2 block(s) after it in your reply were not run" in told and CUT_NOTE in told


def test_a_run_stops_the_blocks_of_a_reply_when_its_time_is_used(tmp_path: Path) -> None:
    root = Replies(slow_blocks(), code(WHICH_RAN))
    rlm = RLM(root, max_depth=0, exec_timeout=30, turn_timeout=CAP, trace_dir=tmp_path)
    result = rlm.run("q", "ctx")
    assert result.answer == "['b1']", result.error
    check_cut_after_the_first_block(execs(result.trace_path)[:2], root.told(1))
    assert [e["turn"] for e in execs(result.trace_path)] == [1, 1, 2]


def test_by_default_a_reply_has_exec_timeout_for_all_its_code(tmp_path: Path) -> None:
    root = Replies(slow_blocks(), code(WHICH_RAN))
    rlm = RLM(root, max_depth=0, exec_timeout=CAP, trace_dir=tmp_path)
    assert rlm.config.turn_timeout is None and rlm.config.turn_seconds() == CAP
    result = rlm.run("q", "ctx")
    assert result.answer == "['b1']", result.error
    check_cut_after_the_first_block(execs(result.trace_path)[:2], root.told(1))


def test_code_written_without_a_fence_shares_the_reply_s_clock(tmp_path: Path) -> None:
    # Three runs of plain Python between sentences: each runs as a block of the same reply.
    parts = [f"import time\ntime.sleep({0.6 * CAP})\n{name} = 1" for name in NAMES[:3]]
    reply = "First:\n\n" + "\n\nThen:\n\n".join(parts) + "\n"
    root = Replies(reply, code(WHICH_RAN))
    result = RLM(root, max_depth=0, exec_timeout=30, turn_timeout=CAP, trace_dir=tmp_path).run("q", "ctx")
    assert result.answer == "['b1']", result.error
    events = execs(result.trace_path)
    assert [e["block"] for e in events[:2]] == [1, 2] and events[1]["timed_out"]
    assert "the 1 block(s) after it in your reply were not run" in root.told(1)


def test_the_expression_of_a_prose_final_runs_under_the_reply_s_clock(tmp_path: Path) -> None:
    # FINAL(slow()) is Python over the REPL's variables, so it is evaluated: with exec_timeout alone
    # it ran 3 s and its value was taken; cut by the reply's clock, the model is told it failed.
    slow = code("def slow():\n    import time\n    time.sleep(3)\n    return 'late'")
    root = Replies(slow, "FINAL(slow())", "FINAL(in time)")
    result = RLM(root, max_depth=0, exec_timeout=30, turn_timeout=0.5, trace_dir=tmp_path).run("q", "ctx")
    assert result.answer == "in time", result.error
    evaluated = execs(result.trace_path)[1]
    assert evaluated["code"] == "FINAL(slow())" and evaluated["timed_out"] and evaluated["timeout_s"] == 0.5
    assert "(0.5 s for its blocks together) ran out during this block" in root.told(2)


def test_the_variable_a_prose_final_var_names_is_read_under_the_reply_s_clock(tmp_path: Path) -> None:
    # FINAL_VAR(x)'s text is x's __str__, which the model wrote: read under the sandbox's own 30 s
    # query timeout it ran whole and its value was taken; cut by the reply's clock, the model is told.
    slow = code("class Slow:\n    def __str__(self):\n        import time\n        time.sleep(3)\n"
                "        return 'late'\nx = Slow()")  # fmt: skip
    root = Replies(slow, "FINAL_VAR(x)", "FINAL(in time)")
    rlm = RLM(root, max_depth=0, exec_timeout=30, turn_timeout=0.5, trace_dir=tmp_path,
              sandbox_options={"grace_s": 0.2})  # fmt: skip
    result = rlm.run("q", "ctx")
    assert result.answer == "in time", result.error
    assert "`x` exists, but its value could not be turned into text" in root.told(2)
    assert "ran past the reply's time for code" in root.told(2)


async def test_an_episode_step_stops_the_blocks_of_a_reply_when_its_time_is_used(tmp_path: Path) -> None:
    env = RLMEnv(max_depth=0, exec_timeout=30, turn_timeout=CAP, trace_dir=tmp_path)
    episode = await env.start("q?", "ctx")
    (said,) = await episode.step(slow_blocks())
    check_cut_after_the_first_block(execs(episode.trace_path), said["content"])
    await episode.step(code(WHICH_RAN))
    assert episode.answer == "['b1']"
    await env.aclose()


def test_a_skyrl_step_stops_the_blocks_of_a_reply_when_its_time_is_used(tmp_path: Path) -> None:
    skyrl_gym = pytest.importorskip(
        "skyrl_gym", reason="skyrl-gym is not installed (pip install recursa[skyrl])"
    )
    from recursa.integrations import skyrl as adapter

    extras = {"repl_timeout": 30, "turn_timeout": CAP, "extra_info": {"context_text": "ctx"}}
    env = skyrl_gym.make(adapter.ENV_ID, env_config={"trace_dir": str(tmp_path)}, extras=extras)
    env.init([{"role": "user", "content": "q?"}])
    out = env.step(slow_blocks())
    (said,) = out["observations"]
    check_cut_after_the_first_block(execs(env.episode.trace_path), said["content"])
    assert env.step(code(WHICH_RAN))["metadata"]["answer"] == "['b1']"
    env.close()


def test_a_codeact_step_stops_its_blocks_when_the_step_s_time_is_used(server, script, tmp_path: Path) -> None:
    script.root("policy", slow_blocks(), code(WHICH_RAN))
    settings = MethodSettings(
        model="openai/policy",
        sub_model="openai/policy",
        base_url=server.base_url,
        api_key="k",
        exec_timeout=30,
        turn_timeout=CAP,
        trace_dir=tmp_path,
    )
    result = asyncio.run(get_method("codeact").run(generate("niah", 2_000, seed=1), settings))
    assert result.answer == "['b1']", result.error
    events = execs(result.trace_path)
    assert [e["block"] for e in events] == [1, 2, 1] and events[1]["timed_out"]
    assert any(CUT_NOTE in note for note in events[1]["notes"])


# -- the setting, in each interface's terms -----------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "10", True])
def test_a_bad_turn_timeout_is_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(
        ConfigError, match=r"RLM\(turn_timeout=.*\): turn_timeout must be a number of seconds > 0"
    ):
        RLM("scripted/oracle", turn_timeout=bad, trace=False)
    with pytest.raises(ConfigError, match=r"RLMEnv\(turn_timeout=.*\): turn_timeout must be"):
        RLMEnv(max_depth=0, turn_timeout=bad, trace=False)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("fast", "extras['turn_timeout']='fast': extras['turn_timeout'] must be a number of seconds > 0"),
        (0, "extras['turn_timeout']=0: extras['turn_timeout'] must be a number of seconds > 0"),
        (math.inf, "extras['turn_timeout']=inf: extras['turn_timeout'] must be a number of seconds > 0"),
    ],
)
def test_a_bad_skyrl_turn_timeout_is_refused_naming_its_key(value: object, named: str) -> None:
    pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install recursa[skyrl])")
    from recursa.integrations import skyrl as adapter

    with pytest.raises(ConfigError) as refused:
        adapter.checked_extras({"turn_timeout": value})
    assert named in str(refused.value)
    with pytest.raises(ConfigError, match="did you mean 'turn_timeout'"):
        adapter.checked_extras({"turn_timout": 3})


def test_the_flags_reach_the_rlm_and_the_server(tmp_path: Path) -> None:
    from recursa.serve.commands import _settings

    base = ["--model", "scripted/oracle", "--trace-dir", str(tmp_path)]
    args = _parser().parse_args(["run", "q", "--context", __file__, *base, "--exec-timeout", "9"])
    config = _rlm_from_args(args, lambda e: None).config
    assert (config.exec_timeout, config.turn_timeout, config.turn_seconds()) == (9, None, 9)
    args = _parser().parse_args(["run", "q", "--context", __file__, *base, "--turn-timeout", "30"])
    assert _rlm_from_args(args, lambda e: None).config.turn_seconds() == 30
    args = _parser().parse_args(["serve", *base, "--turn-timeout", "30", "--exec-timeout", "5"])
    options = _settings(args, "serve").run  # what every served run's RLM(...) gets
    assert (options["exec_timeout"], options["turn_timeout"]) == (5, 30)


@pytest.mark.parametrize(
    ("flag", "value"), [("--turn-timeout", "0.0"), ("--turn-timeout", "nan"), ("--exec-timeout", "-2.0")]
)
def test_a_bad_timeout_flag_is_told_as_a_flag(tmp_path: Path, flag: str, value: str) -> None:
    context = tmp_path / "ctx.txt"
    context.write_text("ctx")
    out = subprocess.run(
        [sys.executable, "-m", "recursa.cli", "run", "q", "--context", str(context), "--model",
         "scripted/oracle", "--trace-dir", str(tmp_path), flag, value],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{flag} {value}" in out.stderr and f"{flag} must be a number of seconds > 0" in out.stderr


@pytest.mark.parametrize("flag", ["--turn-timeout", "--exec-timeout"])
def test_a_bad_timeout_flag_stops_the_acp_agent_at_start(
    flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `recursa acp` does not check the model at start (a session may name its own), so a bad run
    # option reached every session's RLM(...) as a Python error instead of stopping the agent.
    pytest.importorskip("acp", reason="the acp extra is not installed (pip install recursa[acp])")
    from recursa.cli import main
    from recursa.serve import acp_agent

    served: list[object] = []

    async def serve_stdio(settings: object) -> None:  # the agent, had it started: nothing to read here
        served.append(settings)

    monkeypatch.setattr(acp_agent, "serve_stdio", serve_stdio)
    assert main(["acp", "--model", "scripted/oracle", flag, "0"]) == 2 and not served
    assert f"{flag} 0.0: {flag} must be a number of seconds > 0" in capsys.readouterr().err
