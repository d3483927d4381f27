"""The SkyRL-gym adapter, driven the way SkyRL's generator drives an environment."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install recursa[skyrl])")

from recursa import Budget  # noqa: E402
from recursa.env import ReplsFull  # noqa: E402
from recursa.integrations import skyrl as adapter  # noqa: E402
from recursa.testing.fake_server import FakeServer  # noqa: E402

CONTEXT = "line one\nline two\nthe code word is heron\n"


def code(text: str) -> str:
    return f"```repl\n{text}\n```"


async def generate(client: openai.AsyncOpenAI, chat: list[dict]) -> str:
    reply = await client.chat.completions.create(model="policy", messages=chat, max_tokens=512)
    return reply.choices[0].message.content or ""


async def rollout(
    server: FakeServer, extras: dict, prompt: list[dict], env_config: dict | None = None
) -> tuple[list[dict], dict, object]:
    """SkyRL's generator loop: init, then generate -> step (in an executor) -> append, until done."""
    env = skyrl_gym.make(adapter.ENV_ID, env_config=env_config or {}, extras=extras)
    loop = asyncio.get_running_loop()
    chat, _ = await loop.run_in_executor(None, env.init, prompt)
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="k")
    output: dict = {}
    for _ in range(env.max_turns):
        action = await generate(client, chat)
        output = await loop.run_in_executor(None, env.step, action)
        chat += [{"role": "assistant", "content": action}, *output["observations"]]
        if output["done"]:
            break
    await loop.run_in_executor(None, env.close)
    await client.close()
    return chat, output, env


async def test_an_episode_as_skyrls_generator_runs_it(server: FakeServer, script, tmp_path: Path) -> None:
    script.root(
        "policy", code("word = context.split()[-1]\nprint(llm_query('spell ' + word))"), "FINAL(heron)"
    )
    prompts: list[list[str]] = []

    def lm_callback(batch: list[str]) -> list[str]:
        prompts.append(batch)
        return [p.upper() for p in batch]

    extras = {
        "max_turns": 4,
        "repl_timeout": 30,
        "lm_callback": lm_callback,
        "extra_info": {"context_text": CONTEXT, "task_id": "heron-1"},
        "reward_spec": {"method": "rule", "ground_truth": "Heron"},
    }
    prompt = [{"role": "user", "content": "What is the code word?"}]
    chat, last, env = await rollout(server, extras, prompt, {"trace_dir": str(tmp_path)})
    assert chat[0]["role"] == "system" and "What is the code word?" in chat[1]["content"]
    assert "SPELL HERON" in chat[3]["content"]  # the REPL's output came back as an observation
    assert prompts == [["spell heron"]]
    assert last["done"] and last["reward"] == 1.0 and last["observations"] == []
    assert last["metadata"]["stop_reason"] == "final" and last["metadata"]["answer"] == "heron"
    metrics = env.get_metrics()
    assert metrics["turns_used"] == 2 and metrics["final_answer"] == "heron" and metrics["reward"] == 1.0
    rows = env.rollouts()
    assert (
        [r["step"] for r in rows] == [0, 1] and rows[-1]["reward"] == 1.0 and rows[0]["task_id"] == "heron-1"
    )
    assert await asyncio.to_thread(Path(last["metadata"]["trace_path"]).is_file)


async def test_turn_budget_and_family_reward(server: FakeServer, script, tmp_path: Path) -> None:
    script.root("policy", code("print(len(context))"))  # never answers
    extras = {
        "max_turns": 2,
        "extra_info": {"context_text": CONTEXT},
        "reward_spec": {"ground_truth": "heron"},
        "family": "niah",
    }
    _, last, env = await rollout(server, extras, [{"role": "user", "content": "Code word?"}], {"trace_dir": str(tmp_path)})
    assert last["done"] and last["metadata"]["stop_reason"] == "max_iterations"
    assert last["reward"] == 0.0 and env.get_metrics()["turns_used"] == 3  # two turns, then the answer call


def test_registered_under_the_documented_id() -> None:
    assert adapter.ENV_ID == "recursa-rlm" and adapter.ENV_ID in skyrl_gym.registry
    env = skyrl_gym.make("recursa-rlm", env_config={}, extras={"max_turns": 3})
    assert (
        isinstance(env, skyrl_gym.envs.base_text_env.BaseTextEnv) and env.max_turns == 4
    )  # 3 turns + the answer


@pytest.mark.parametrize(
    ("extras", "named"),
    [
        ({"max_turns": "ten"}, "extras['max_turns']='ten': extras['max_turns'] must be an int >= 1"),
        ({"max_turns": True}, "extras['max_turns']=True"),
        ({"max_turns": 2.5}, "extras['max_turns']=2.5"),
        ({"repl_timeout": "fast"}, "extras['repl_timeout']='fast': extras['repl_timeout'] must be a number of seconds > 0"),
        ({"max_turn": 3}, "extras['max_turn'] is not an option; did you mean 'max_turns'?"),
        ({"repl_timout": 3}, "did you mean 'repl_timeout'?"),
        ({"budget": {"max_calls": 3}}, "extras['budget']['max_calls'] is not an option"),
        ({"budget": {"max_llm_calls": "3"}}, "extras['budget']['max_llm_calls']='3': a str, not a number"),
        ({"lm_callback": "http://engine"}, "extras['lm_callback'] is a str, not a function"),
        ({"judge_reward_fn": 1.0}, "extras['judge_reward_fn'] is a float, not a function"),
        ({"reward_spec": {"ground_truth": "x", "reward_fn": "exact"}}, "extras['reward_spec']['reward_fn']"),
        ({"reward_spec": "heron"}, "extras['reward_spec'] is a str; give a dict"),
        ({"extra_info": "ctx"}, "extras['extra_info'] is a str; give a dict"),
        ({"family": "oolongg"}, "extras['family']: unknown task family 'oolongg'"),
        ({"custom_system_prompt": 5}, "extras['custom_system_prompt']: give a non-empty string, not an int"),
    ],
)
def test_a_bad_extra_is_refused_naming_its_key(extras: dict, named: str) -> None:
    # Before, these fell back to defaults without a word (a typo, a non-function callback or reward
    # function, a reward_spec that is not a dict), or failed as int()'s ValueError naming nothing.
    with pytest.raises(adapter.ConfigError) as refused:
        skyrl_gym.make(adapter.ENV_ID, env_config={"sandbox": "inprocess"}, extras=extras)
    assert named in str(refused.value)


def test_a_datasets_own_keys_pass_and_init_again_ends_the_previous_episode(tmp_path: Path) -> None:
    extras = {"data_source": "x", "uid": 3, "max_tokens": 10, "env_class": adapter.ENV_ID,
              "extra_info": {"context_text": CONTEXT}, "max_turns": 3.0}  # fmt: skip
    config = {"trace_dir": str(tmp_path)}
    env = skyrl_gym.make(adapter.ENV_ID, env_config=config, extras=extras)
    assert env.max_turns == 4
    prompt = [{"role": "user", "content": "What is the code word?"}]
    env.init(prompt)
    first = env.episode
    env.init(prompt)  # a generator reusing the object: the first episode is closed, not leaked
    assert first.stop_reason == "cancelled" and env._env.live_repls == 1
    # Rows whose other settings differ (max_turns here) make an RLMEnv each, under one bound.
    one, two = (
        skyrl_gym.make(adapter.ENV_ID, env_config=config, extras={**extras, "max_live_repls": 1, "max_turns": n})
        for n in (3, 4)
    )
    assert one._env is not two._env
    # ... and one memory bound: the REPLs of both count against the same pool.
    assert one._env.memory_pool is not None and one._env.memory_pool is two._env.memory_pool
    one.init(prompt)
    with pytest.raises(ReplsFull, match=r"extras\['max_live_repls'\]=1 allows.*extras\['wait_for_repl'\]"):
        two.init(prompt)  # the bound's error in this API's knobs, not RLMEnv's
    one.close()
    two.init(prompt)  # the slot one gave back
    two.close()
    assert one._env.live_repls == two._env.live_repls == 0
    assert env.step("FINAL(heron)")["done"]
    with pytest.raises(adapter.ConfigError, match=r"step\(\) after the episode is done.*call init\(prompt\)"):
        env.step("FINAL(heron)")
    env.close()
    assert env._env.live_repls == 0


def test_close_while_a_step_runs_on_another_thread_ends_it(tmp_path: Path) -> None:
    # A generator that gives up on a rollout (a timeout around the executor) closes the environment
    # while its step still runs on a worker thread; close() must end that step, not raise.
    import concurrent.futures
    import threading

    running = threading.Event()
    extras = {"extra_info": {"context_text": CONTEXT}, "custom_tools": {"started": lambda: running.set()}}
    env = skyrl_gym.make(adapter.ENV_ID, env_config={"trace_dir": str(tmp_path)}, extras=extras)
    env.init([{"role": "user", "content": "What is the code word?"}])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(env.step, code("started()\nimport time\ntime.sleep(300)"))
        running.wait()
        env.close()
        with pytest.raises(concurrent.futures.CancelledError):
            step.result()
    env.close()  # again: nothing to do
    assert env.episode.stop_reason == "cancelled" and env._env.live_repls == 0


def test_an_over_long_generation_is_told_to_the_policy_not_raised_at_the_trainer(tmp_path: Path) -> None:
    # A policy stuck repeating itself up to the length cap is ordinary in RL: SkyRL's own
    # environment runs any str, so a refused reply must not stop the generator with EnvError.
    extras = {"extra_info": {"context_text": CONTEXT}, "reward_spec": {"ground_truth": "heron"},
              "max_reply_chars": 2_000}  # fmt: skip
    env = skyrl_gym.make(adapter.ENV_ID, env_config={"trace_dir": str(tmp_path)}, extras=extras)
    env.init([{"role": "user", "content": "What is the code word?"}])
    out = env.step(code("print('again ' * 1000)") + " again" * 1000)
    assert not out["done"] and out["reward"] == 0.0
    (said,) = out["observations"]
    assert said["role"] == "user" and "had 6,034 characters, more than the 2,000 allowed" in said["content"]
    assert "max_reply_chars=2,000" in out["metadata"]["refused"] and env.episode.turn == 0
    out = env.step("FINAL(heron)")
    assert out["done"] and out["reward"] == 1.0 and env.get_metrics()["turns_used"] == 2
    env.close()


def test_an_lm_callback_that_breaks_skyrls_contract_fails_the_call_saying_so(tmp_path: Path) -> None:
    # [None] must not reach the REPL as the model's reply "None", which looks like an answer.
    extras = {"lm_callback": lambda prompts: [None], "extra_info": {"context_text": CONTEXT}}
    env = skyrl_gym.make(adapter.ENV_ID, env_config={"trace_dir": str(tmp_path)}, extras=extras)
    env.init([{"role": "user", "content": "What is the code word?"}])
    out = env.step(
        code("try:\n    print(repr(llm_query('hi')))\nexcept Exception as e:\n    print('failed:', e)")
    )
    said = out["observations"][0]["content"]
    assert "failed:" in said and "extras['lm_callback'] returned a list of 1 whose first item is None" in said
    assert "one str per prompt" in said
    env.close()


def test_env_config_gives_defaults_that_a_rows_extras_override() -> None:
    # SkyRL passes its config for the environment id as env_config; it was ignored without a word.
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create(
        {"max_turns": 4, "budget": {"max_llm_calls": 50}, "sandbox": "inprocess"}
    )
    env = skyrl_gym.make(adapter.ENV_ID, env_config=config, extras={"data_source": "x"})
    assert env.max_turns == 5 and env._env.config.budget.max_llm_calls == 50
    env = skyrl_gym.make(adapter.ENV_ID, env_config=config, extras={"max_turns": 2})
    assert env.max_turns == 3
    with pytest.raises(
        adapter.ConfigError, match=r"env_config\['data_source'\] is not an option; the options are"
    ):
        skyrl_gym.make(adapter.ENV_ID, env_config={"data_source": "x"}, extras={})
    with pytest.raises(adapter.ConfigError, match=r"env_config\['max_turns'\]='4'"):
        skyrl_gym.make(adapter.ENV_ID, env_config={"max_turns": "4"}, extras={})


def test_a_row_never_widens_what_the_config_limits() -> None:
    # env_config is the operator's: a dataset row may lower what it sets for a setting that costs
    # money or capacity, never raise it, and may name another sub_model only with its own key.
    from recursa.errors import ConfigError

    refusals = (
        ({"max_turns": 5}, {"max_turns": 50}, r"extras\['max_turns'\]=50 is more than the operator allows \(at most 5\)"),
        ({"budget": {"max_usd": 1.0}}, {"budget": {"max_usd": 9.0}}, r"extras\['budget'\]\['max_usd'\]=9.0 .*at most 1.0"),
        ({"sub_model": "openai/policy"}, {"sub_model": "openai/other"}, r"extras\['sub_model'\]='openai/other'"),
        # What the config leaves out is the environment's default, not no limit at all: a row of
        # a dataset under env_config={} took max_depth=50, 100,000 REPLs or a model of its choice.
        ({}, {"max_depth": 50}, r"extras\['max_depth'\]=50 is more than the operator allows \(at most 0\)"),
        ({}, {"max_live_repls": 10**5}, r"extras\['max_live_repls'\]=100000 .*\(at most 256\)"),
        ({}, {"repl_timeout": 10**6}, r"extras\['repl_timeout'\]=1000000.0 .*\(at most 180.0\)"),
        ({}, {"sub_model": "openai/gpt-5"}, r"pays for no model a client names"),
        ({"sampling": {"root": {"reasoning_effort": "low"}}}, {"sampling": {"root": {"reasoning_effort": "high"}}},
         r"extras\['sampling'\]\['root'\]\['reasoning_effort'\]='high' is more than the operator allows"),
    )  # fmt: skip
    for config, row, said in refusals:
        with pytest.raises(ConfigError, match=said):
            adapter.RecursaRLMEnv(env_config=config, extras=row)
    env = adapter.RecursaRLMEnv(env_config={"max_turns": 5}, extras={"max_turns": 2})  # lowering is fine
    assert env.max_turns == 3
    # A row's sampling is merged over the config's: what it leaves out of a role stays the config's.
    config = {"sampling": {"root": {"reasoning_effort": "low", "temperature": 0.5}}}
    env = adapter.RecursaRLMEnv(env_config=config, extras={"sampling": {"root": {"temperature": 1.0}}})
    assert env._env.config.sampling == {"root": {"reasoning_effort": "low", "temperature": 1.0}}
    # So is its budget: a row's cap on calls dropped the config's dollar cap (the row's Budget went in
    # whole, though each of its caps had been checked against the config's).
    env = adapter.RecursaRLMEnv(env_config={"budget": {"max_usd": 1.0}}, extras={"budget": {"max_llm_calls": 5}})
    assert env._env.config.budget == Budget(max_usd=1.0, max_llm_calls=5)
    # A row's None is no setting of its own: it dropped the config's budget and max_turns.
    env = adapter.RecursaRLMEnv(env_config={"budget": {"max_usd": 1.0}, "max_turns": 3}, extras={"budget": None, "max_turns": None})
    assert (env._env.config.budget, env.max_turns) == (Budget(max_usd=1.0), 4)


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"sandbox": "inprocess"}, r"extras\['sandbox'\]='inprocess': extras\['sandbox'\] is the operator's to choose \(the operator's: 'subprocess'\)"),
        ({"trace_dir": "/etc/cron.d"}, r"extras\['trace_dir'\]='/etc/cron.d': .* \(the operator's: None\)"),
    ],
)
def test_a_row_never_chooses_the_sandbox_or_where_files_go(row: dict, said: str) -> None:
    """A dataset row is data: its extras chose the sandbox (sandbox="inprocess" ran the policy's code
    in the trainer's own process) and the directory traces are written to. Both are the operator's
    (env_config's) choices now; a row may only repeat them."""
    from recursa.errors import ConfigError

    with pytest.raises(ConfigError, match=said):
        adapter.RecursaRLMEnv(env_config={"sandbox": "subprocess"}, extras=row)
    # Nor the bound on live REPLs: a row above it had a bound, and a memory bound, of its own.
    with pytest.raises(ConfigError, match=r"extras\['max_live_repls'\]=1000 is more .* \(at most 256\)"):
        adapter.RecursaRLMEnv(env_config={}, extras={"max_live_repls": 1000})
    same = adapter.RecursaRLMEnv(env_config={"sandbox": "subprocess"}, extras={"sandbox": "subprocess"})
    assert same._env.config.sandbox == "subprocess"
    same.close()


def test_a_row_cannot_send_the_environments_key_elsewhere() -> None:
    """A dataset row's `base_url` took the key the environment calls with (env_config's, or the
    provider's variable) to whatever server the row named: a dataset could collect it."""
    from recursa.errors import ConfigError

    config = {"sub_model": "openai/policy", "base_url": "http://127.0.0.1:8000/v1", "api_key": "operator-key"}
    with pytest.raises(
        ConfigError, match=r"extras\['base_url'\]='https://collector.example/v1' is not env_config's"
    ):
        adapter.RecursaRLMEnv(env_config=config, extras={"base_url": "https://collector.example/v1"})
    with pytest.raises(ConfigError, match="send the row's own key"):
        adapter.RecursaRLMEnv(
            env_config={"sub_model": "openai/policy"}, extras={"base_url": "https://x.example/v1"}
        )
    # The config's own server (spelt with a trailing /), or a key of the row's own, is fine.
    adapter.RecursaRLMEnv(env_config=config, extras={"base_url": "http://127.0.0.1:8000/v1/"}).close()
    own = {"base_url": "https://mine.example/v1", "api_key": "row-key"}
    adapter.RecursaRLMEnv(env_config=config, extras=own).close()


def test_env_config_carries_sandbox_options_checked_as_the_run_settings_are(tmp_path: Path) -> None:
    """A trainer had no way to pass sandbox options (a Ray cluster's address, resources or labels,
    snapshots, where scratch folders go): env_config's sandbox_options reach the REPL now, checked
    by the schema beside env_config's sandbox and named as its key; a row may only repeat them."""
    from recursa.errors import ConfigError

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    config = {"sandbox": "subprocess", "sandbox_options": {"scratch_root": str(scratch)}, "max_turns": 2,
              "trace_dir": str(tmp_path)}  # fmt: skip
    env = skyrl_gym.make(adapter.ENV_ID, env_config=config, extras={"extra_info": {"context_text": CONTEXT}})
    env.init([{"role": "user", "content": "where am I?"}])
    out = env.step(code("import os\nprint(os.getcwd())"))
    assert str(scratch) in out["observations"][0]["content"]
    env.close()
    same = adapter.RecursaRLMEnv(env_config=config, extras={"sandbox_options": {"scratch_root": str(scratch)}})
    assert same._env.config.sandbox_options == {"scratch_root": str(scratch)}
    refusals = [
        ({"sandbox": "subprocess", "sandbox_options": {"start_timout": 30}}, {},
         r"^env_config\['sandbox_options'\]=\{'start_timout': 30\}: env_config\['sandbox_options'\] must be options "
         r"sandbox 'subprocess' takes: it takes no option 'start_timout'"),
        ({"sandbox_options": ["start_timeout", 30]}, {}, r"^env_config\['sandbox_options'\]=\[.*must be a dict"),
        (config, {"sandbox_options": {"scratch_root": "/tmp"}},
         r"^extras\['sandbox_options'\]=\{'scratch_root': '/tmp'\}: extras\['sandbox_options'\] is the operator's to choose"),
        # What the settings say together is named as env_config's keys too.
        ({"max_depth": 3, "max_repls_per_episode": 2, "sub_model": "scripted/oracle"}, {},
         r"^env_config\['max_repls_per_episode'\]=2 is below env_config\['max_depth'\]=3"),
        # Ray's options are checked as RLM(...) checks them: the cluster they name must answer.
        ({"sandbox": "ray", "sandbox_options": {"address": "127.0.0.1:1", "resources": {"repl": 1}}}, {},
         r"^env_config\['sandbox'\]='ray': the Ray cluster address '127.0.0.1:1' cannot be reached"),
    ]  # fmt: skip
    for config, row, said in refusals:
        with pytest.raises(ConfigError, match=said):
            adapter.RecursaRLMEnv(env_config=config, extras=row)
