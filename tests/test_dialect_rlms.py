"""dialect="rlms" against the official package itself: the same scripted root replies go through
`rlms` (its own loop, its local REPL) and through recursa with this dialect, both against one
recording fake server, and every root request's messages must be identical, turn by turn.

`rlms` pins an older tenacity than the dev environment's, so it is not in `dev`: .ci/run installs it
with recursa in a venv of its own and runs this file there (docs/dialects.md)."""

from __future__ import annotations

import pytest

rlm = pytest.importorskip(
    "rlm", reason="the official rlms package is not installed here; .ci/run runs this file in its own venv"
)

from recursa import RLM  # noqa: E402

KEY = "test-key-0123456789"
QUESTION = "What does the context say, in capitals?"
CONTEXT = "hello world, this is the context"


def code(*blocks: str, prose: str = "Next step.") -> str:
    return prose + "".join(f"\n```repl\n{b}\n```" for b in blocks)


ANSWERED = [
    code("print(len(context))\nx = context[:11]"),
    code("print('warned', file=__import__('sys').stderr)", "y = x.upper()\nprint(y)", prose="Two blocks."),
    "Thinking it over, no code this time.",
    code("print(len(x))\n1 / 0"),
    code("answer['content'] = y\nanswer['ready'] = True", prose="Done."),
]
UNANSWERED = [code("print(context[:5])"), "Still thinking.", "HELLO WORLD"]


def _root_requests(server) -> list[list[dict]]:
    return [r.messages for r in server.requests if r.model == "root"]


def _responder(replies: list[str]):
    def respond(model: str, messages: list[dict]) -> str:
        turn = sum(1 for m in messages if m["role"] == "assistant")
        return replies[min(turn, len(replies) - 1)]

    return respond


@pytest.mark.parametrize(("replies", "max_iterations"), [(ANSWERED, 8), (UNANSWERED, 2)])
def test_every_request_matches_the_official_package(server, tmp_path, replies, max_iterations):
    server.holder["responder"] = _responder(replies)
    server.reset()
    official = rlm.RLM(
        backend="openai",
        backend_kwargs={"model_name": "root", "base_url": server.base_url, "api_key": KEY},
        environment="local",
        max_iterations=max_iterations,
    )
    theirs = official.completion(CONTEXT, root_prompt=QUESTION)
    expected = _root_requests(server)
    server.reset()
    ours = RLM(
        "openai/root",
        base_url=server.base_url,
        api_key=KEY,
        dialect="rlms",
        max_iterations=max_iterations,
        trace_dir=tmp_path,
    ).run(QUESTION, CONTEXT)
    got = _root_requests(server)
    assert len(got) == len(expected)
    for turn, (mine, official_messages) in enumerate(zip(got, expected, strict=True), 1):
        assert mine == official_messages, f"request {turn} differs"
    assert ours.answer == theirs.response
    assert ours.dialect == "rlms"
