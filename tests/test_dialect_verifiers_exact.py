"""dialect="verifiers" against Prime Intellect's RLM environment itself (verifiers 0.1.14): the same
scripted root replies go through the environment's own rollout (`RLMEnv(repl_language="python")`,
its prompt builder, tool dispatch, worker script, output formatting, `.messages` upload and stop
conditions) and through recursa with this dialect, both against one recording fake server. Every
root request's messages and offered tools must be identical, turn by turn, and the rollouts must
end at the same reply with the same answer.

What cannot run here is only the environment's transport: Prime's sandbox service (an API key and
the network) and its tunnel. The stand-ins below run the environment's own sandbox commands (the
worker start, its FIFO requests, the uploads) with bash on this machine instead, and point the
worker's llm_batch at the environment's interception server on 127.0.0.1.

verifiers 0.1.14 does not install beside the dev environment, so .ci/run installs `recursa[verifiers-rlm]`
in a venv of its own and runs this file there (docs/dialects.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

rlm_env = pytest.importorskip(
    "verifiers.envs.experimental.rlm_env",
    reason="verifiers 0.1.14 (recursa[verifiers-rlm]) is not installed here; .ci/run runs this file in its own venv",
)

from datasets import Dataset  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient  # noqa: E402
from verifiers.utils.data_utils import extract_boxed_answer  # noqa: E402

from recursa import RLM  # noqa: E402
from recursa.testing.tool_replies import ToolCallReply, offered_tools  # noqa: E402

KEY = "test-key-0123456789"
QUESTION = "Which fruit is named?"
CONTEXT = "the fruit is a mango"


class LocalExecutor(rlm_env.RLMExecutor):
    """The environment's executor with its sandbox service replaced by this machine: each sandbox
    command runs in bash here (a login shell would reset PATH, so `bash -c`), uploads are copies."""

    def init_sandbox_client(self, **kwargs) -> None:
        self.active_sandboxes = set()

    def teardown_sandbox_client(self) -> None:
        pass

    async def create_sandbox(self, state, request) -> str:
        return "local"

    async def delete_sandbox(self, sandbox_id: str) -> None:
        pass

    async def _execute_sandbox_command(self, sandbox_id, command, timeout=None, **kwargs):
        if command.startswith("bash -lc "):
            command = "bash -c " + command[len("bash -lc ") :]
        proc = await asyncio.create_subprocess_exec("bash", "-c", command, stdout=-1, stderr=-1)
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        return SimpleNamespace(stdout=out.decode(), stderr=err.decode(), exit_code=proc.returncode)

    async def _upload_file_with_retry(self, sandbox_id, remote_path, local_path, what) -> None:
        Path(remote_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(local_path, remote_path)

    async def _upload_directory(self, sandbox_id, local_dir, remote_dir) -> None:
        shutil.copytree(local_dir, remote_dir, dirs_exist_ok=True)

    async def _download_directory(self, sandbox_id, remote_dir, local_dir) -> None:
        pass


class LocalRLMEnv(rlm_env.RLMEnv):
    """The environment with the executor above, its "remote" folders under the test's tmp_path, and
    the worker reaching the interception server directly instead of through Prime's tunnel."""

    def __init__(self, root: Path, **kwargs) -> None:
        self.root = root
        self._ids = itertools.count()
        original = rlm_env.RLMExecutor
        rlm_env.RLMExecutor = LocalExecutor  # RLMEnv.__init__ builds its executor by this name
        try:
            super().__init__(**kwargs)
        finally:
            rlm_env.RLMExecutor = original

    async def setup_state(self, state, **kwargs) -> None:
        base = self.root / f"sandbox{next(self._ids)}"
        state["rlm_fs_root_remote"] = str(base / "rlm_fs")
        state["rlm_control_dir_remote"] = str(base / "rlm_control")
        await super().setup_state(state, **kwargs)

    async def _get_tunnel_url(self) -> str:
        return f"http://127.0.0.1:{self.interception_port}"


def call(*codes: str) -> ToolCallReply:
    return ToolCallReply([("call_python_repl", {"code": c}) for c in codes])


ANSWERED = [
    call("import os\nprint(sorted(os.listdir(extra_data)), os.getcwd() == extra_data)\nx = 3\nx * 2"),
    call(
        "import json, sys\nprint([m['role'] for m in map(json.loads, open('.messages'))])\n"
        "print('careful', file=sys.stderr)\n1 / 0",
        "answer['content'] = open('context.txt').read().split()[-1]\nanswer",
    ),
    call("print(llm_batch(['apple', 'mango']))"),
    ToolCallReply(
        [
            ("python", {"code": "print(1)"}),
            ("call_python_repl", {"source": "print(2)"}),
            ("call_python_repl", {"code": "print(x)\nNone"}),
        ]
    ),
    call("x = (", "print(open('.messages').read())"),
    call("answer['ready'] = True", "print(answer)\nanswer['content'] = answer['content'].upper()"),
    "never asked",
]
BOXED = [call("print(open('context.txt').read())"), "The context names it.\n\nFinal: \\boxed{mango}"]
OUT_OF_TURNS = [
    call("answer['content'] = 'mango?'"),
    call("answer['content'] = 'never run'\nanswer['ready'] = True"),
]


def responder(replies, offered):
    def respond(model: str, messages: list[dict]):
        if model == "sub":
            return "SUB:" + messages[-1]["content"]
        offered.append(offered_tools())
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return respond


# The environment's worker reports an exception with its own frames first (its script's path, which
# names the rollout, and its exec/eval line); recursa shows the model's frames only. They are taken
# out of its tool results, also where a result shows `.messages` (one JSON message per line).
_PEER_FRAME = re.compile(r'  File "(?!<cell>|<unknown>)[^"]*", line \d+, in [^\n]*\n(?:    [^\n]*\n)*')


def _line_without_peer_frames(line: str) -> str:
    try:
        message = json.loads(line)
    except ValueError:
        return line
    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
        return line
    return json.dumps({**message, "content": _PEER_FRAME.sub("", message["content"])}, ensure_ascii=False)


def _without_peer_frames(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m["role"] == "tool":
            text = _PEER_FRAME.sub("", m["content"])
            m = {**m, "content": "\n".join(_line_without_peer_frames(line) for line in text.split("\n"))}
        out.append(m)
    return out


@dataclass
class Seen:
    """What the models were sent: each root request's messages and offered tools, and the sub-calls'
    messages (in a fixed order: llm_batch sends them in parallel)."""

    roots: list[list[dict]]
    tools: list[list[dict]]
    subs: list[list[dict]]


def _seen(server, offered) -> Seen:
    roots = [r.messages for r in server.requests if r.model == "root"]
    subs = sorted((r.messages for r in server.requests if r.model == "sub"), key=json.dumps)
    return Seen(roots, list(offered), subs)


def _theirs(server, tmp_path, replies, max_turns):
    offered: list = []
    server.holder["responder"] = responder(replies, offered)
    server.reset()

    async def rollout():
        env = LocalRLMEnv(
            tmp_path,
            dataset=Dataset.from_list([{"question": QUESTION, "answer": "mango"}]),
            repl_language="python",
            sub_model="sub",
            max_turns=max_turns,
        )
        client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=server.base_url, api_key=KEY))
        task = {
            "prompt": [{"role": "user", "content": QUESTION}],
            "answer": "mango",
            "info": {"context": CONTEXT},
        }
        try:
            return await env.rollout({**task, "example_id": 0}, client, "root")
        finally:
            await client.close()

    state = asyncio.run(rollout())
    assert state.get("error") is None, state.get("error")
    return state, _seen(server, offered)


def _worker_answer(state) -> dict:
    """The answer dict as the environment's worker last saved it (its answer file)."""
    return json.loads(Path(state["rlm_control_dir_remote"], "rlm_answer.json").read_text())


def _ours(server, tmp_path, replies, max_turns):
    offered: list = []
    server.holder["responder"] = responder(replies, offered)
    server.reset()
    result = RLM(
        "openai/root",
        sub_model="openai/sub",
        base_url=server.base_url,
        api_key=KEY,
        dialect="verifiers",
        dialect_options={"texts": "package"},
        max_iterations=max_turns,
        trace_dir=tmp_path,
    ).run(QUESTION, CONTEXT)
    return result, _seen(server, offered)


def _assert_same(theirs: Seen, ours: Seen) -> None:
    assert len(ours.roots) == len(theirs.roots)
    for turn, (mine, expected) in enumerate(zip(ours.roots, theirs.roots, strict=True), 1):
        assert mine == _without_peer_frames(expected), f"request {turn} differs"
    assert ours.tools == theirs.tools
    assert ours.subs == theirs.subs


def test_a_rollout_answered_in_code_matches_the_environment(server, tmp_path):
    state, theirs = _theirs(server, tmp_path, ANSWERED, 10)
    ours, mine = _ours(server, tmp_path, ANSWERED, 10)
    _assert_same(theirs, mine)
    # llm_batch's two calls, each the environment's system message and then the prompt.
    assert len(mine.subs) == 2 and mine.subs[0][0]["role"] == "system"
    assert len(mine.roots) == 6  # the reply that set answer["ready"] ended both rollouts
    assert state["stop_condition"] == "answer_ready"
    assert (ours.answer, ours.stop_reason, ours.answer_protocol) == (state["final_answer"], "final", "answer")
    assert ours.answer == "MANGO"  # the later call of the answering reply changed it, as it may there


def test_a_prose_answer_ends_both_rollouts_at_the_same_reply(server, tmp_path):
    state, theirs = _theirs(server, tmp_path, BOXED, 10)
    ours, mine = _ours(server, tmp_path, BOXED, 10)
    _assert_same(theirs, mine)
    assert len(mine.roots) == 2 and ours.stop_reason == "final"
    assert state["stop_condition"] == "no_tools_called"
    # The environment records no answer when a rollout ends without answer["ready"] (answer["content"]
    # is still "" here) and leaves \boxed{} to the task's scorer; recursa's answer is the boxed text.
    assert "final_answer" not in state and _worker_answer(state) == {"ready": False, "content": ""}
    assert ours.answer == extract_boxed_answer(BOXED[-1]) == "mango"


def test_the_turn_limit_matches_the_environment(server, tmp_path):
    state, theirs = _theirs(server, tmp_path, OUT_OF_TURNS, 2)
    ours, mine = _ours(server, tmp_path, OUT_OF_TURNS, 2)
    _assert_same(theirs, mine)
    assert state["stop_condition"] == "max_turns_reached"
    # Neither ran the last reply's code. The environment records no answer then; recursa's is the
    # answer["content"] the worker holds (answer_protocol "partial").
    assert "final_answer" not in state
    assert (ours.answer, ours.stop_reason, ours.answer_protocol) == ("mango?", "max_iterations", "partial")
    assert _worker_answer(state) == {"ready": False, "content": "mango?"}
