"""User tools end to end through the real loop and the real openai/anthropic clients: sandbox tools
shipped as source, host tools over the request channel, sub-model tools through function calling,
and the bad cases (a tool that raises, hangs, returns junk, or takes a reserved name)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from recursa import RLM
from recursa.errors import ConfigError
from recursa.testing.tool_replies import ToolCallReply, offered_tools
from recursa.tools.spec import host_tool
from recursa.trace import load

from .test_rlm_openai import code, make_rlm

GREETING = "hello"
LIMITS = {"short": 3}


def count_words(text: str, minimum: int = 1) -> int:
    """Count the words of `text` that have at least `minimum` letters."""
    return sum(1 for w in re.findall(r"\w+", text) if len(w) >= minimum) + len(GREETING) - 5


def shout(text: str) -> str:
    """Upper-case `text` (calls another tool to show tools see each other)."""
    return text.upper() + "!" * count_words(text, LIMITS["short"])


DATABASE = {"alice": 41, "bob": 7}


@host_tool(timeout=5)
def lookup(name: str) -> dict:
    """Look a user up in the host's database (the sandbox cannot reach it)."""
    return {"name": name, "age": DATABASE[name]}


@host_tool
async def slow_lookup(name: str) -> int:
    """An async host tool."""
    await asyncio.sleep(0.01)
    return DATABASE[name] * 2


@host_tool(timeout=0.3)
def hangs() -> str:
    """Never returns in time."""
    time.sleep(3)
    return "late"


@host_tool
def raises(x: int) -> int:
    """Always fails."""
    raise RuntimeError(f"database down for {x}")


@host_tool
def junk() -> object:
    """Returns something that is not JSON."""
    return {1, 2, 3}


@host_tool(max_calls=2)
def limited() -> str:
    """Two calls per run."""
    return "ok"


def root_turns(server, model="root-model"):
    return [r for r in server.requests if r.model == model]


def use(server, *replies, sub=None):
    """Script the root (by turn) and, optionally, the sub-model as fn(messages) -> reply."""
    server.reset()

    def respond(model, messages):
        if model == "root-model":
            turn = sum(1 for m in messages if m["role"] == "assistant")
            return replies[min(turn, len(replies) - 1)]
        return sub(messages)

    server.holder["responder"] = respond


# -- REPL tools -------------------------------------------------------------------------------


def test_sandbox_and_host_tools_are_called_from_code_and_described_in_the_prompt(server, tmp_path):
    use(
        server,
        code("n = count_words(context)\nloud = shout('ab cde')\nrow = lookup('alice')\nprint(n, loud, row)"),
        code("twice = slow_lookup('bob')\nFINAL(f'{n}|{loud}|{row[\"age\"]}|{twice}')"),
    )
    rlm = make_rlm(server, tmp_path, tools=[count_words, shout, lookup, slow_lookup])
    result = rlm.run("q", "one two three four")
    assert result.answer == "4|AB CDE!|41|14", result
    system = root_turns(server)[0].messages[0]["content"]
    assert "`count_words(text: str, minimum: int = 1) -> int`" in system
    assert "Count the words of `text`" in system
    assert "`lookup(name: str) -> dict` (runs outside the sandbox)" in system
    # the host tool's call is in the trace; the sandbox tool never left the sandbox
    calls = [e for e in load(result.trace_path).events if e["type"] == "tool_call"]
    assert sorted(e["tool"] for e in calls) == ["lookup", "slow_lookup"]


@pytest.mark.serial  # asserts calls overlap or finish in time: not beside another test
def test_tool_failures_reach_the_code_as_tool_error_and_the_run_goes_on(server, tmp_path):
    probe = (
        "out = []\n"
        "for f, args in [(raises, (3,)), (hangs, ()), (junk, ()), (lookup, ('carol',)), (lookup, (1, 2))]:\n"
        "    try:\n"
        "        f(*args)\n"
        "    except ToolError as e:\n"
        "        out.append(str(e))\n"
        "print(len(out))\n"
        "for line in out: print(line)"
    )
    use(server, code(probe), "FINAL(survived)")
    started = time.perf_counter()
    result = make_rlm(server, tmp_path, tools=[raises, hangs, junk, lookup]).run("q", "ctx")
    assert result.answer == "survived"
    assert time.perf_counter() - started < 3  # the hung tool was abandoned at its 0.3 s timeout
    shown = root_turns(server)[1].messages[-1]["content"]
    assert "5\n" in shown
    assert "raises raised RuntimeError: database down for 3" in shown
    assert "hangs did not return within 0.3 s" in shown
    assert "junk returned a set that cannot be sent to the REPL" in shown
    assert "lookup raised KeyError: 'carol'" in shown
    assert "lookup(name: str) -> dict: too many positional arguments" in shown


def test_call_caps_and_unsendable_arguments_are_explained(server, tmp_path):
    use(
        server,
        code(
            "limited(); limited()\ntry:\n    limited()\nexcept ToolError as e:\n    print('CAP', e)\n"
            "try:\n    lookup({1, 2})\nexcept TypeError as e:\n    print('ARGS', e)"
        ),
        "FINAL(ok)",
    )
    make_rlm(server, tmp_path, tools=[limited, lookup]).run("q", "ctx")
    shown = root_turns(server)[1].messages[-1]["content"]
    assert "CAP limited may be called at most 2 times" in shown
    assert "ARGS lookup: its arguments go to the host as JSON" in shown


def test_an_overwritten_tool_is_restored(server, tmp_path):
    use(server, code("count_words = 5"), code("FINAL(count_words('a b c'))"))
    result = make_rlm(server, tmp_path, tools=[count_words]).run("q", "ctx")
    assert result.answer == "3"
    assert "count_words" in root_turns(server)[1].messages[-1]["content"]  # the restore note


def test_tools_survive_a_restart_of_the_repl_process(server, tmp_path):
    use(server, code("import os\nos._exit(3)"), code("FINAL(count_words('x y') + lookup('bob')['age'])"))
    rlm = make_rlm(server, tmp_path, tools=[count_words, lookup], sandbox_options={"snapshots": False})
    result = rlm.run("q", "ctx")
    assert result.answer == "9", result
    assert "restarted" in root_turns(server)[1].messages[-1]["content"]


@pytest.mark.parametrize("inherit", [True, False])
def test_children_inherit_tools_unless_told_not_to(server, tmp_path, inherit):
    def respond(model, messages):
        first = messages[1]["content"] if len(messages) > 1 else ""
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if model == "sub-model" and "child question" in first:  # the child's root
            body = "try:\n    r = lookup('alice')['age']\nexcept NameError:\n    r = 'no tool'\nFINAL(r)"
            return code(body)
        if model == "root-model":
            return [code("print(rlm_query('child question', context='data'))"), "FINAL(done)"][min(turn, 1)]
        raise AssertionError(model)

    server.reset()
    server.holder["responder"] = respond
    rlm = make_rlm(server, tmp_path, tools=[lookup], max_depth=2, tools_for_children=inherit)
    rlm.run("q", "ctx")
    shown = root_turns(server)[1].messages[-1]["content"]
    assert ("41" in shown) if inherit else ("no tool" in shown), shown


def bad_closure_tool():
    secret = 3

    def uses_secret() -> int:
        return secret

    return uses_secret


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([lambda x: x], "no usable name"),
        ([bad_closure_tool()], "closes over host variables (secret)"),
        ([42], "takes functions"),
        ([count_words, count_words], "two tools are named 'count_words'"),
    ],
)
def test_bad_tools_are_refused_at_construction(server, tmp_path, tools, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_rlm(server, tmp_path, tools=tools)


def test_reserved_and_builtin_names_are_refused(server, tmp_path):
    def llm_query(prompt: str) -> str:
        return prompt

    def len(x: str) -> int:
        return 0

    with pytest.raises(ConfigError, match="reserved in the REPL; rename"):
        make_rlm(server, tmp_path, tools=[llm_query])
    with pytest.raises(ConfigError, match="hide Python's builtin len"):
        make_rlm(server, tmp_path, tools=[len])


def test_a_tool_using_an_unshippable_global_must_be_a_host_tool(server, tmp_path):
    with pytest.raises(ConfigError, match=r"uses the global 'DATABASE_CONN'.*mark it @recursa.host_tool"):
        make_rlm(server, tmp_path, tools=[uses_connection])


class _Conn:
    pass


DATABASE_CONN = _Conn()


def uses_connection() -> str:
    return repr(DATABASE_CONN)


# -- sub-model tools ----------------------------------------------------------------------------

PASSAGES = {"capital": "Paris is the capital of France.", "river": "The Seine runs through Paris."}
searches: list[str] = []


def search(query: str, k: int = 1) -> list[str]:
    """Search the document collection; returns up to k passages."""
    searches.append(query)
    return [text for key, text in PASSAGES.items() if key in query][:k]


def tool_using_sub(messages):
    """A sub-model that searches once, then answers from what the tool returned."""
    if messages[-1]["role"] == "tool":
        return "From the search: " + json.loads(messages[-1]["content"])[0]
    assert [t["name"] for t in offered_tools()] == ["search"]
    assert offered_tools()[0]["parameters"]["required"] == ["query"]
    return ToolCallReply([("search", {"query": messages[-1]["content"], "k": 1})], text="Let me look.")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_sub_models_call_tools_and_the_root_sees_only_their_answer(server, tmp_path, provider):
    searches.clear()
    use(server, code("a = llm_query('capital')\nprint(a)"), "FINAL(done)", sub=tool_using_sub)
    base = server.base_url if provider == "openai" else server.base_url.removesuffix("/v1")
    rlm = RLM(
        f"{provider}/root-model",
        sub_model=f"{provider}/sub-model",
        base_url=base,
        api_key="test-key-0123456789",
        trace_dir=tmp_path,
        sub_tools=[search],
    )
    result = rlm.run("q", "ctx")
    assert result.stop_reason == "final"
    assert searches == ["capital"]
    second_sub = [r for r in server.requests if r.model == "sub-model"][1]
    assert [m["role"] for m in second_sub.messages] == ["user", "assistant", "tool"]
    assert second_sub.messages[1]["tool_calls"][0]["name"] == "search"
    root_view = root_turns(server)[1].messages[-1]["content"]
    assert "From the search: Paris is the capital of France." in root_view
    assert (
        "Seine" not in root_view
        and "`search(query: str, k: int = 1) -> list[str]`" in (root_turns(server)[0].messages[0]["content"])
    )
    events = load(result.trace_path).events
    assert [e["caller"] for e in events if e["type"] == "tool_call"] == ["sub-model"]
    assert result.usage.llm_calls == 4  # two root turns, the sub-model's two turns


def test_a_failing_sub_tool_is_reported_to_the_sub_model_and_rounds_are_capped(server, tmp_path):
    seen: list[str] = []

    @host_tool
    def broken(query: str) -> str:
        """Fails."""
        raise ValueError("index missing")

    def stubborn_sub(messages):
        if offered_tools():
            return ToolCallReply([("broken", {"query": "x"})])
        seen.extend(m["content"] for m in messages if m["role"] == "tool")
        return f"gave up after {len(seen)} tries"

    use(server, code("print(llm_query('find it'))"), "FINAL(done)", sub=stubborn_sub)
    make_rlm(server, tmp_path, sub_tools=[broken], sub_tool_rounds=2).run("q", "ctx")
    assert seen == ["Error: broken raised ValueError: index missing"] * 2
    assert "gave up after 2 tries" in root_turns(server)[1].messages[-1]["content"]


def test_code_cannot_call_a_host_tool_its_run_was_not_given(server, tmp_path):
    # The tree's runner holds the sub-models' tools too: a call frame the code writes itself named one.
    from tests.test_host_backpressure import RAW_WRITER

    ran: list[str] = []

    @host_tool
    def search(query: str) -> str:
        """For sub-models only."""
        ran.append(query)
        return "results"

    call = {"op": "call", "id": 10**9, "fn": "tool", "args": {"name": "search", "args": ["x"], "kwargs": {}}}
    use(server, code(RAW_WRITER + f"write_all(frame({call!r}))\nprint(len(llm_query('q')))"), "FINAL(done)",
        sub=lambda messages: "answer")  # fmt: skip
    result = make_rlm(server, tmp_path, sub_tools=[search]).run("q", "ctx")
    assert result.answer == "done" and ran == []


# -- error mode, tips, typed answers, partial answers ------------------------------------------


def test_subcall_errors_return_mode_hands_back_error_strings(server, tmp_path):
    def failing_sub(messages):
        raise RuntimeError("boom")  # the fake server answers 500

    use(server, code("r = llm_query('x')\nprint(r)"), "FINAL(done)", sub=failing_sub)
    rlm = make_rlm(server, tmp_path, subcall_errors="return", max_retries=0)
    result = rlm.run("q", "ctx")
    assert result.answer == "done"
    assert (
        "[error] SubcallError: the call to openai/sub-model failed"
        in root_turns(server)[1].messages[-1]["content"]
    )


def test_tips_are_added_to_the_root_prompt(server, tmp_path):
    use(server, "FINAL(x)")
    rlm = make_rlm(server, tmp_path, tips="Count in code, classify with batches.")
    rlm.run("q", "ctx")
    rlm.run("q", "ctx", tips="Per-run tip wins.")
    first, second = (r.messages[0]["content"] for r in root_turns(server))
    assert "Tips for this task:\nCount in code, classify with batches." in first
    assert "Per-run tip wins." in second and "Count in code" not in second


def test_answer_schema_rejects_a_bad_answer_then_returns_the_validated_object(server, tmp_path):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    use(
        server,
        code("FINAL({'name': 'alice'})"),
        code("p = {'name': 'alice', 'age': 41}\nFINAL_VAR('p')"),
    )
    result = make_rlm(server, tmp_path).run("q", "ctx", answer_schema=Person)
    assert result.stop_reason == "final" and result.iterations == 2
    assert result.value == Person(name="alice", age=41)
    assert json.loads(result.answer) == {"name": "alice", "age": 41}
    turns = root_turns(server)
    assert '"age"' in turns[0].messages[1]["content"]  # the schema is in the first message
    assert "age: Field required" in turns[1].messages[-1]["content"]


def test_answer_schema_that_pydantic_cannot_use_is_refused(server, tmp_path):
    with pytest.raises(ConfigError, match="not a type pydantic can validate"):
        make_rlm(server, tmp_path).run("q", "ctx", answer_schema=object())


def test_a_run_stopped_early_returns_its_partial_answer(server, tmp_path):
    from recursa import Budget

    use(server, code("answer['content'] = 'half done'"), code("x = 1"))
    rlm = make_rlm(server, tmp_path, budget=Budget(max_llm_calls=1))
    result = rlm.run("q", "ctx")
    assert result.stop_reason == "budget"
    assert result.answer == "half done" and result.answer_protocol == "partial"


def test_sub_tools_with_star_args_are_refused(server, tmp_path):
    def anything(*args: str) -> str:
        return ""

    with pytest.raises(ConfigError, match="takes \\*args"):
        make_rlm(server, tmp_path, sub_tools=[anything])


def test_the_same_function_may_be_a_repl_tool_and_a_sub_tool_but_names_must_not_clash(server, tmp_path):
    make_rlm(server, tmp_path, tools=[lookup], sub_tools=[lookup])

    def lookup_other(name: str) -> str:
        return name

    lookup_other.__name__ = "lookup"
    with pytest.raises(ConfigError, match="two different functions are named 'lookup'"):
        make_rlm(server, tmp_path, tools=[lookup], sub_tools=[lookup_other])


def test_the_trace_viewer_shows_tool_calls_under_the_cell_that_made_them(server, tmp_path):
    from recursa.trace.viewer import build_view

    use(server, code("row = lookup('alice')\nprint(row)"), "FINAL(done)")
    result = make_rlm(server, tmp_path, tools=[lookup]).run("q", "ctx")
    view = build_view(result.trace_path)
    nodes = view["nodes"]
    tools = [n for n in nodes if n["k"] == "tool"]
    assert [n["l"] for n in tools] == ["tool lookup · from repl"]
    assert nodes[tools[0]["p"]]["k"] == "exec"
    assert not any("unknown types" in w for w in view["warnings"])


async def test_a_cancelled_run_hands_its_partial_result_to_whoever_cancelled_it(server, tmp_path):
    use(server, code("answer['content'] = 'so far: 3'"), code("import time\ntime.sleep(30)"))
    first_cell_done = asyncio.Event()

    def on_event(event: dict) -> None:
        if event["type"] == "exec":
            first_cell_done.set()

    rlm = make_rlm(server, tmp_path, on_event=on_event)
    task = asyncio.create_task(rlm.arun("q", "ctx"))
    await asyncio.wait_for(first_cell_done.wait(), 30)
    await asyncio.sleep(0.2)  # turn 2's cell is sleeping now
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    partial = caught.value.partial_result
    assert partial.stop_reason == "cancelled"
    assert partial.answer == "so far: 3" and partial.answer_protocol == "partial"
    assert partial.usage.llm_calls == 2 and partial.trace_path is not None


def test_host_tool_calls_become_execute_tool_spans(server, tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from recursa.trace.otel import OtelListener

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    use(server, code("lookup('alice')\ntry:\n    raises(1)\nexcept ToolError:\n    pass"), "FINAL(done)")
    listener = OtelListener(tracer_provider=provider)
    make_rlm(server, tmp_path, tools=[lookup, raises], on_event=listener).run("q", "ctx")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    ok, failed = spans["execute_tool lookup"], spans["execute_tool raises"]
    assert ok.attributes["gen_ai.tool.name"] == "lookup" and ok.attributes["recursa.tool.caller"] == "repl"
    assert failed.status.status_code == StatusCode.ERROR
    run_span = next(s for s in spans.values() if s.attributes.get("gen_ai.operation.name") == "invoke_agent")
    assert ok.parent.span_id == run_span.context.span_id


def test_an_answer_that_never_fits_the_schema_ends_with_the_reason(server, tmp_path):
    from pydantic import BaseModel

    class Count(BaseModel):
        n: int

    use(server, code("FINAL({'n': 'many'})"), "FINAL(still many)")
    result = make_rlm(server, tmp_path, max_iterations=1).run("q", "ctx", answer_schema=Count)
    assert result.stop_reason == "max_iterations"
    assert result.answer == "still many"
    assert result.error is not None
    assert result.error.startswith(
        "the last answer does not match answer_schema: (the value): Input should be"
    )
    assert result.value is None


def test_an_answer_that_never_fits_has_no_value_and_the_error_names_every_failed_field(server, tmp_path):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    use(server, code("p = {'name': 5}"), "FINAL_VAR(p)")
    result = make_rlm(server, tmp_path, max_iterations=1).run("q", "ctx", answer_schema=Person)
    assert result.stop_reason == "max_iterations"
    assert result.value is None
    assert result.answer == "{'name': 5}"
    assert "name: Input should be a valid string" in result.error
    assert "age: Field required" in result.error


# A module-level key and a config holding one, read by functions that would otherwise ship as source.
WEATHER_API_KEY = "wx-8c1f30aa92d54e7b"
SERVICE = {"url": "https://weather.example.com", "access_token": "tok-5be0c4a1d9e2"}


def forecast(city: str) -> str:
    return f"{city}: key {WEATHER_API_KEY[:2]}"


def forecast_config(city: str) -> str:
    return f"{city} via {SERVICE['url']}"


def forecast_default(city: str, units: str = "metric", key: str = WEATHER_API_KEY) -> str:
    return f"{city}: {units} {key[:2]}"


def forecast_literal(city: str) -> str:
    return fetch(city, token="tok-5be0c4a1d9e2")  # noqa: F821 (defined in the REPL)


def test_a_sandbox_tool_never_carries_a_secret_into_the_repl(server, script, tmp_path):
    # Shipped, the constant was a REPL variable and in the tool's __globals__: the code could read it.
    for tool, name in ((forecast, "WEATHER_API_KEY"), (forecast_config, "SERVICE"), (forecast_default, "WEATHER_API_KEY")):
        with pytest.raises(ConfigError, match=rf"reads the global '{name}'.*looks like a secret.*host_tool"):
            make_rlm(server, tmp_path, tools=[tool])
    # A key written out in the tool's own source went in with it (a default named by a global was
    # not even checked: the def line names it, its body does not).
    with pytest.raises(ConfigError, match=r"'forecast_literal' holds what looks like a secret.*\(token\)"):
        make_rlm(server, tmp_path, tools=[forecast_literal])
    # As a host tool it runs where the key is, and the REPL sees only its answers.
    script.root("root-model", code("FINAL(forecast('Oslo') + '|' + str('wx-8c1' in repr(globals())))"))
    result = make_rlm(server, tmp_path, tools=[host_tool(forecast)]).run("q", "ctx")
    assert result.answer == "Oslo: key wx|False", result.answer
