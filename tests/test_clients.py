"""RLM(model=client): any object with a `complete` method drives an RLM."""

from __future__ import annotations

import asyncio
import threading

import pytest

from examples.function_client import FunctionClient, root_model, vowel_counter
from recursa import RLM, Budget
from recursa.errors import ConfigError
from recursa.lm import LMRequest, LMResponse


def repl_reply(src: str) -> str:
    return f"```repl\n{src}\n```"


class Scripted:
    """An async client that answers the root with `replies` in turn and sub-calls with `sub(prompt)`."""

    def __init__(self, *replies: str, name: str = "scripted-root", cost: float | None = None) -> None:
        self.replies = list(replies)
        self.model = name
        self.cost = cost
        self.closed = False
        self.requests: list[LMRequest] = []

    async def complete(self, request: LMRequest) -> str | LMResponse:
        self.requests.append(request)
        turn = sum(1 for m in request.messages if m["role"] == "assistant")
        text = self.replies[min(turn, len(self.replies) - 1)]
        if self.cost is None:
            return text
        return LMResponse(text=text, input_tokens=100, output_tokens=10, provider_cost_usd=self.cost)

    async def aclose(self) -> None:
        self.closed = True


def test_the_worked_example_wraps_plain_functions(tmp_path) -> None:
    rlm = RLM(
        FunctionClient(root_model, "my-root"), FunctionClient(vowel_counter, "my-counter"), trace_dir=tmp_path
    )
    result = rlm.run("How many vowels?", "An RLM reads\nlong contexts\nin code")
    assert result.answer == "9", result.error
    root, counter = result.usage.by_model["client/my-root"], result.usage.by_model["client/my-counter"]
    assert (root.llm_calls, counter.llm_calls) == (1, 3)
    assert counter.input_tokens == sum(
        len(f"How many vowels are in: {line}".split())
        for line in ["An RLM reads", "long contexts", "in code"]
    )


def test_an_async_client_returning_text_has_its_usage_estimated_and_is_not_closed(tmp_path) -> None:
    root = Scripted(repl_reply("FINAL(llm_query('ping'))"))
    sub = Scripted("pong", name="scripted-sub", cost=0.25)
    result = RLM(root, sub, trace_dir=tmp_path).run("q", "ctx")
    assert result.answer == "pong", result.error
    assert result.usage.by_model["client/scripted-root"].input_tokens > 0  # estimated from the prompt
    assert result.usage.by_model["client/scripted-sub"].cost_usd == pytest.approx(0.25)
    assert result.usage.by_model["client/scripted-sub"].input_tokens == 100  # as the client reported
    assert not root.closed and not sub.closed  # its owner closes it, not recursa


def test_a_sync_client_runs_off_the_event_loop(tmp_path) -> None:
    threads: list[str] = []

    class Blocking:
        model = "blocking"

        def complete(self, request: LMRequest) -> str:
            threads.append(threading.current_thread().name)
            return "FINAL('ok')"

    assert RLM(Blocking(), trace_dir=tmp_path).run("q", "ctx").answer == "ok"
    assert threads and all(name.startswith("recursa-client") for name in threads)


@pytest.mark.parametrize(
    ("kwargs", "argument", "what"),
    [
        ({"model": object()}, "RLM(model=...)", "has no `complete` method"),
        ({"model": "openai/x", "sub_model": 42}, "RLM(sub_model=...)", "model 42 names no provider"),
        (
            {"model": "openai/x", "allowed_models": [type("C", (), {"complete": 3})()]},
            "RLM(allowed_models=[...])",
            "not callable",
        ),
    ],
)
def test_an_object_that_is_not_a_client_is_refused_naming_what_is_missing(kwargs, argument, what) -> None:
    with pytest.raises(ConfigError) as err:
        RLM(api_key="k", **kwargs)
    assert argument in str(err.value) and what in str(err.value) and "client" in str(err.value)


def test_a_client_name_is_not_a_model_name() -> None:
    with pytest.raises(ConfigError, match="pass the object itself"):
        RLM("client/my-model")


def test_failures_and_bad_replies_reach_the_repl_as_subcall_errors(tmp_path) -> None:
    class Broken:
        model = "broken"

        async def complete(self, request: LMRequest) -> object:
            if "boom" in request.messages[-1]["content"]:
                raise RuntimeError("backend down")
            return 42

    code = (
        "out = []\n"
        "for p in ('boom', 'odd'):\n"
        "    try:\n"
        "        llm_query(p)\n"
        "    except SubcallError as e:\n"
        "        out.append(str(e))\n"
        "FINAL(' | '.join(out))"
    )
    result = RLM(Scripted(repl_reply(code)), Broken(), trace_dir=tmp_path).run("q", "ctx")
    assert "the client raised RuntimeError: backend down" in result.answer, result.answer
    assert "complete() returned int; return the reply as a str, or an LMResponse" in result.answer


def test_a_client_naming_a_known_model_is_priced_and_can_run_under_a_dollar_budget(tmp_path) -> None:
    root = Scripted("FINAL('cheap')", name="gpt-5-mini")
    root.provider = "openai"  # type: ignore[attr-defined]
    result = RLM(root, budget=Budget(max_usd=1.0), trace_dir=tmp_path).run("q", "ctx")
    assert result.answer == "cheap" and result.usage.cost_usd > 0
    unknown = Scripted("FINAL('x')", name="mystery")
    with pytest.raises(ConfigError, match="no price is known for 'client/mystery'"):
        RLM(unknown, budget=Budget(max_usd=1.0))


def test_clients_in_allowed_models_and_two_clients_with_one_name(tmp_path) -> None:
    other = Scripted("from other", name="same")
    sub = Scripted("from sub", name="same")
    root = Scripted(repl_reply("FINAL(llm_query('a') + ' / ' + llm_query('b', model='client/same-2'))"))
    result = RLM(root, sub, allowed_models=[other], trace_dir=tmp_path).run("q", "ctx")
    assert result.answer == "from sub / from other", result.error


async def test_arun_with_clients_shares_nothing_between_runs(tmp_path) -> None:
    rlm = RLM(Scripted("FINAL('one')"), trace_dir=tmp_path)
    results = await asyncio.gather(rlm.arun("q", "a"), rlm.arun("q", "b"))
    assert [r.answer for r in results] == ["one", "one"]
