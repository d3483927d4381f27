"""recursa's sandbox as DSPy's code interpreter, driven by the real `dspy.RLM`.

The root and sub LMs are `dspy.LM`s pointed at the fake OpenAI-compatible server, which answers
the root in DSPy's chat format with scripted code, one step per iteration.
"""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no price-table download
dspy = pytest.importorskip("dspy", reason="needs the dspy extra: pip install -e '.[dspy]'")

from dspy.primitives.code_interpreter import CodeExecutionError, CodeInterpreterError, FinalOutput  # noqa: E402

from recursa.errors import ConfigError  # noqa: E402
from recursa.integrations.dspy import RecursaInterpreter  # noqa: E402

STEPS = [
    "n = len(context)\nrole = lookup('alice')\nprint(role, n)",
    "while True:\n    pass",
    "print('after the timeout:', role, n, llm_query('ping'))",
    "SUBMIT(result=role)",  # not an output field: a recoverable error, and the run goes on
    "SUBMIT(answer=f'{role} {n}')",
]


def action(step: str) -> str:
    """A reply in DSPy's chat format for the RLM's action signature (reasoning, code)."""
    return f"[[ ## reasoning ## ]]\nNext step.\n\n[[ ## code ## ]]\n```python\n{step}\n```\n\n[[ ## completed ## ]]"


def lookup(name: str) -> str:
    """The role of a user."""
    return f"{name}=admin"


@pytest.fixture
def lms(server):
    asked: list[str] = []

    def respond(model: str, messages: list[dict]) -> str:
        text = str(messages[-1]["content"])
        if model == "sub-model":
            asked.append(text)
            return "pong"
        step = int(re.search(r"\[\[ ## iteration ## \]\]\s*(\d+)/", text).group(1))
        return action(STEPS[step - 1])

    server.holder["responder"] = respond
    server.reset()
    server.latency_s = 0.0
    kw = {"api_base": server.base_url, "api_key": "test-key-0123456789", "cache": False}
    return dspy.LM("openai/root-model", **kw), dspy.LM("openai/sub-model", **kw), asked


def test_dspy_rlm_runs_in_the_recursa_sandbox_with_a_tool_and_a_timeout_that_keeps_state(lms) -> None:
    root, sub, asked = lms
    factory = RecursaInterpreter.factory(exec_timeout=1.0)
    rlm = dspy.RLM(
        "context, query -> answer", tools=[lookup], sub_lm=sub, max_iters=6, interpreter_factory=factory
    )
    with dspy.context(lm=root):
        prediction = rlm(context="hello world", query="Who is alice, and how long is the context?")
    assert prediction.answer == "alice=admin 11"
    outputs = [step["output"] for step in prediction.trajectory]
    assert outputs[0].strip() == "alice=admin 11"
    assert "KeyboardInterrupt" in outputs[1] and "variables kept" in outputs[1]
    assert outputs[2].strip() == "after the timeout: alice=admin 11 pong"
    assert "SUBMIT takes the output fields answer" in outputs[3]
    assert asked == ["ping"]
    assert factory.last is not None and factory.last.isolation["level"].startswith("hardened")
    # DSPy shut the interpreter down: its worker is gone.
    with pytest.raises(CodeInterpreterError, match="shut down"):
        factory.last.execute("1")


def test_the_interpreter_protocol_directly() -> None:
    with RecursaInterpreter(
        tools={"lookup": lookup}, output_fields=[{"name": "answer"}, {"name": "score"}], exec_timeout=1.0
    ) as it:
        assert it.execute("x = lookup(name='bob')\nx", {"context": [1, 2]}) == "'bob=admin'"
        with pytest.raises(CodeExecutionError, match="interrupted after 1s; variables kept"):
            it.execute("import time\ntime.sleep(30)")
        assert it.execute("print(x, context)", {"context": [1, 2]}) == "bob=admin [1, 2]"
        with pytest.raises(SyntaxError):
            it.execute("def f(:")
        with pytest.raises(CodeExecutionError, match="NameError: name 'nope' is not defined"):
            it.execute("nope()")
        with pytest.raises(CodeExecutionError, match="SUBMIT takes the output fields answer, score"):
            it.execute("SUBMIT(answer=1)")
        assert it.execute("SUBMIT('a', 2)\nprint('never')") == FinalOutput({"answer": "a", "score": 2})
        assert it.execute("SUBMIT(answer=x, score=3)") == FinalOutput({"answer": "bob=admin", "score": 3})
        with pytest.raises(CodeExecutionError, match="PermissionError"):  # no network from the sandbox
            it.execute("import socket\nsocket.socket()")
        assert it.isolation["seccomp"] is True
    with pytest.raises(CodeInterpreterError, match="shut down"):
        it.execute("1")


def test_bad_options_fail_at_once() -> None:
    with pytest.raises(ConfigError, match="exec_timeout"):
        RecursaInterpreter.factory(exec_timeout=0)
    with pytest.raises(ConfigError, match="sandbox"):
        RecursaInterpreter(sandbox="nowhere")


# The same steps through DSPy's own LocalInterpreter and through RecursaInterpreter: what each step
# comes to (a value, FinalOutput, a recoverable CodeExecutionError, a SyntaxError) must agree, and so
# must printed output and submitted values. (DSPy's interpreter returns a last expression's value
# where recursa's shows its repr, as the REPL does: those steps print instead.)
DIFFERENTIAL = [
    ("x = 1\nprint(x)", None),
    ("print(context.upper(), x)", {"context": "abc"}),
    ("print(lookup('amy'))", None),
    ("nope()", None),
    ("print('a')\n1/0", None),
    ("def f(:", None),
    ("```python\nprint(2)\n```", None),  # fences are dspy.RLM's to strip: the interpreter gets code
    ("SUBMIT(answer=1)", None),
    ("SUBMIT(1, 2, 3)", None),
    ("try:\n    SUBMIT(answer=1)\nexcept TypeError:\n    print('caught')", None),
    ("print('before')\nSUBMIT(answer='a', score=2)", None),
    ("SUBMIT('b', [3, {'k': None}])", None),
    ("print(x + 1)", {"context": "changed"}),
    ("", None),
    ("lookup(1, 2)", None),
]


def _outcomes(interpreter) -> list[tuple]:
    seen: list[tuple] = []
    with interpreter:
        for code, variables in DIFFERENTIAL:
            try:
                value = interpreter.execute(code, variables)
            except (CodeExecutionError, SyntaxError) as exc:
                seen.append((type(exc).__name__,))
            else:
                seen.append(
                    ("FinalOutput", value.output) if isinstance(value, FinalOutput) else ("value", value)
                )
    return seen


def test_steps_come_to_what_dspys_own_interpreter_makes_of_them() -> None:
    local = pytest.importorskip(
        "dspy.primitives.local_interpreter", reason="this DSPy has no LocalInterpreter"
    )
    fields = [{"name": "answer"}, {"name": "score"}]
    theirs = _outcomes(local.LocalInterpreter(tools={"lookup": lookup}, output_fields=fields))
    ours = _outcomes(RecursaInterpreter(tools={"lookup": lookup}, output_fields=fields, exec_timeout=10.0))
    assert ours == theirs
    assert [o[0] for o in ours].count("CodeExecutionError") == 5 and ours[-5] == (
        "FinalOutput",
        {"answer": "a", "score": 2},
    )
