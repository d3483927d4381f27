"""dialect="verifiers": Prime Intellect's RLM environment's conventions over the real openai SDK path,
with replies shaped like those published from runs of that environment (a tool call that sets the
answer, a prose answer in \\boxed{}), each ending where the model meant. These run with recursa's
own words for the texts (texts="recursa"); tests/test_dialect_verifiers_exact.py compares the
conversation with the environment itself where verifiers 0.1.14 is installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from recursa import RLM
from recursa.errors import ConfigError
from recursa.testing.tool_replies import ToolCallReply

KEY = "test-key-0123456789"


def call(*codes: str) -> ToolCallReply:
    return ToolCallReply([("call_python_repl", {"code": c}) for c in codes])


def responder(*replies):
    def respond(model: str, messages: list[dict]):
        if model == "sub":
            return "SUB:" + messages[-1]["content"][:5]
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return respond


def run(server, tmp_path, *replies, context="the fruit is a mango", options=None, **kw):
    server.holder["responder"] = responder(*replies)
    server.reset()
    rlm = RLM(
        "openai/root",
        sub_model="openai/sub",
        base_url=server.base_url,
        api_key=KEY,
        trace_dir=tmp_path,
        dialect="verifiers",
        dialect_options={"texts": "recursa", **(options or {})},
        **kw,
    )
    return rlm.run("Which fruit is named?", context)


def roots(server):
    return [r for r in server.requests if r.model == "root"]


def outputs(request) -> list[str]:
    return [m["content"] for m in request.messages if m["role"] == "tool"]


def test_a_call_that_sets_the_answer_ends_the_rollout(server, tmp_path):
    result = run(
        server,
        tmp_path,
        call("import os\nprint(sorted(os.listdir(extra_data)), os.getcwd() == extra_data)\nanswer"),
        call(
            "print(llm_batch(['apple', 'mango'])); import sys; print('hm', file=sys.stderr)\nlen(extra_data) > 0"
        ),
        call("answer['content'] = open('context.txt').read().split()[-1]\nanswer['ready'] = True"),
        "never asked",
        options={"packages": "numpy regex"},
    )
    assert (result.answer, result.stop_reason, result.answer_protocol) == ("mango", "final", "answer")
    requests = roots(server)
    assert len(requests) == 3 and all(r.tools == ["call_python_repl"] for r in requests)
    first = requests[0].messages
    assert [m["role"] for m in first] == ["user"]  # the instructions open the first user message
    assert first[0]["content"].startswith("<SCAFFOLDING>\n") and "extra_data" in first[0]["content"]
    assert "- `numpy`" in first[0]["content"] and "llm_batch" in first[0]["content"]
    assert first[0]["content"].endswith("</SCAFFOLDING>\n\nWhich fruit is named?")
    # extra_data is the folder of the context's files and the working directory; a cell's last
    # expression comes back as Out[n], n counting the cells run.
    assert outputs(requests[2]) == [
        "['.messages', 'context.txt'] True\nOut[1]: {'ready': False, 'content': ''}",
        "['SUB:apple', 'SUB:mango']\nstderr:\nhm\nOut[2]: True",
    ]


def test_the_context_itself_with_extra_data_value_and_a_shorter_cut(server, tmp_path):
    result = run(
        server,
        tmp_path,
        call("print('x' * 100)"),
        call("answer['content'] = extra_data.split()[-1]\nanswer['ready'] = True"),
        options={"extra_data": "value", "max_output_length": "40"},  # as --dialect-option gives it
    )
    assert (result.answer, result.stop_reason) == ("mango", "final")
    assert outputs(roots(server)[1]) == ["x" * 40 + "\n[the output was cut here]"]


def test_a_longer_cut_than_the_runs_output_cap_is_held_to_it(server, tmp_path):
    # dialect_options are a client's to send (a served request's): a cut of 10**8 showed the root a
    # 5 MB observation, at the operator's cost, where max_output_chars allowed 2,000.
    run(server, tmp_path, call("'A' * 5_000_000"), "\\boxed{done}", options={"max_output_length": 10**8},
        max_output_chars=2_000)  # fmt: skip
    (shown,) = outputs(roots(server)[1])
    assert shown.startswith("Out[1]: 'AAA") and len(shown) < 2_100, len(shown)


def test_a_folder_context_and_the_transcript_file(server, tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha")
    (folder / "sub" / "b.md").write_text("beta")
    (folder / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))  # its bytes stay on the host
    listing = "import os\nprint(sorted(os.path.relpath(os.path.join(d, f)) for d, _, fs in os.walk('.') for f in fs))"
    reading = "import json\nprint([m['role'] for m in map(json.loads, open('.messages'))])\n1 / 0"
    run(server, tmp_path, call(listing, reading), "done", context=folder)
    first, second = outputs(roots(server)[1])
    assert first == "['.messages', 'a.txt', 'sub/b.md']"
    # .messages holds the conversation up to the reply whose code runs (its own results come after).
    assert second.startswith("['user', 'assistant']\nTraceback (most recent call last):\n")
    assert second.endswith('  File "<cell>", line 3, in <module>\nZeroDivisionError: division by zero')


def test_a_prose_answer_in_boxed_ends_the_rollout(server, tmp_path):
    result = run(
        server,
        tmp_path,
        call("print(open('context.txt').read())"),
        "The data names it.\n\nFinal: \\boxed{mango}",
    )
    assert (result.answer, result.stop_reason) == ("mango", "final")
    # Without \boxed{}, a reply that calls no tool ends with answer["content"] as code left it.
    result = run(server, tmp_path, call("answer['content'] = 'mango'"), "I am done.")
    assert (result.answer, result.stop_reason) == ("mango", "final")


def test_the_turn_limit_ends_before_the_last_replys_calls_run(server, tmp_path):
    result = run(
        server,
        tmp_path,
        call("answer['content'] = 'mango?'"),
        call("answer['content'] = 'never run'\nanswer['ready'] = True"),
        max_iterations=2,
    )
    assert (result.answer, result.stop_reason, result.answer_protocol) == (
        "mango?",
        "max_iterations",
        "partial",
    )
    assert len(roots(server)) == 2  # no extra call for the answer


def test_calls_it_cannot_run_are_answered_and_every_call_runs(server, tmp_path):
    refused = ToolCallReply(
        [
            ("python", {"code": "print(1)"}),
            ("call_python_repl", {"source": "print(2)"}),
            ("call_python_repl", {"code": "print(3)"}),
        ]
    )
    answering = call("answer.update(content='mango', ready=True)", "print('after the answer')")
    result = run(server, tmp_path, refused, answering)
    assert (result.answer, result.stop_reason) == ("mango", "final")
    told = outputs(roots(server)[1])
    assert told[0].startswith("There is no tool named 'python'") and "'code'" in told[1] and told[2] == "3"
    events = [json.loads(line) for line in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    # Every call of the answering reply ran, and the trace records the model's code, not the helper.
    assert [e["code"] for e in events if e["type"] == "exec"][-2:] == [
        "answer.update(content='mango', ready=True)",
        "print('after the answer')",
    ]


def test_bad_options_are_named(server):
    def make(**options):
        RLM(
            "openai/root", base_url=server.base_url, api_key=KEY, dialect="verifiers", dialect_options=options
        )

    with pytest.raises(ConfigError, match="extra_data='files'"):
        make(extra_data="files")
    with pytest.raises(ConfigError, match="texts='exact'"):
        make(texts="exact")
    if importlib.util.find_spec("verifiers") is None:  # here verifiers 0.1.14 lives in a venv of its own
        with pytest.raises(ConfigError, match=r"pip install 'recursa\[verifiers-rlm\]'"):
            make(texts="package")


def test_a_cell_stopped_by_its_timeout_shows_no_earlier_cells_value(server, tmp_path):
    result = run(
        server,
        tmp_path,
        call("1 + 1"),
        call("import time\ntime.sleep(30)"),
        call("answer.update(content='mango', ready=True)"),
        exec_timeout=1,
    )
    assert result.answer == "mango"
    first, stopped = outputs(roots(server)[2])
    assert first == "Out[1]: 2"
    assert stopped.startswith("KeyboardInterrupt: execution was interrupted")
    assert "Out[" not in stopped and "_rlm_vf" not in stopped  # nothing of the helper it runs through


def test_the_scripted_root_speaks_it_offline():
    """`recursa demo --dialect verifiers`: the scripted root reads the <SCAFFOLDING> opening, runs
    its steps as calls of the tool and answers through the answer dict."""
    from recursa.tasks import generate

    task = generate("niah", 20_000, seed=3)
    rlm = RLM("scripted/gpt5-like", sub_model="scripted/oracle", dialect="verifiers", trace=False)
    result = rlm.run(task.question, task.context)
    assert (result.stop_reason, result.answer_protocol) == ("final", "answer")
    assert task.score(result.answer) == 1.0
