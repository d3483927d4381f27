"""Structured output through a forced tool on `POST /v1/messages`: the real `anthropic` SDK
(create, stream), LangChain's ChatAnthropic (invoke, stream, with_structured_output) and LiteLLM's
`anthropic/` provider get the answer as a `tool_use` block whose input fits the tool's schema; tools
the model could choose among are refused naming the field; a replayed tool_use and its tool_result
are read as Chat Completions reads a replayed call and tool message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("anthropic")
import anthropic
from pydantic import BaseModel

from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from tests.serve_helpers import CONTEXT, HELLO, PERSON, serve_settings

KEY = "anthropic-tools-key-0123456789"


class Person(BaseModel):
    """A person's name and age."""

    name: str
    age: int


TOOL = {"name": "record_person", "description": "Record a person", "input_schema": Person.model_json_schema()}
OTHER = {"name": "other", "input_schema": {"type": "object", "properties": {}}}
FORCED = {"type": "tool", "name": "record_person"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    settings = serve_settings(tmp_path_factory.mktemp("anthropic-tools"), KEY)
    with BackgroundServer(create_app(settings)) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _ask(client: anthropic.Anthropic, question: str = PERSON, **fields: Any) -> Any:
    asked: dict[str, Any] = {"tools": [TOOL], "tool_choice": FORCED, **fields}
    return client.messages.create(
        model="recursa", max_tokens=1000, system=CONTEXT, messages=_user(question), **asked
    )


# -- the anthropic SDK ------------------------------------------------------------------------------


def test_a_forced_tool_answers_with_a_tool_use_block(client):
    message = _ask(client)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "tool_use" and block.name == "record_person" and block.id.startswith("toolu_")
    assert Person.model_validate(block.input) == Person(name="Ada", age=36)
    assert message.model_extra["recursa"]["stop_reason"] == "final"
    # disable_parallel_tool_use asks for one call, which a forced tool gets anyway.
    once = _ask(client, tool_choice={**FORCED, "disable_parallel_tool_use": True})
    assert once.content[0].input == {"name": "Ada", "age": 36}


def test_any_with_one_tool_forces_it(client):
    message = _ask(client, tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use"
    assert message.content[0].name == "record_person" and message.content[0].input["age"] == 36


def test_a_streamed_tool_use_is_assembled_by_the_sdk(client):
    with client.messages.stream(
        model="recursa",
        max_tokens=1000,
        system=CONTEXT,
        messages=_user(PERSON),
        tools=[TOOL],
        tool_choice=FORCED,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking", "tool_use"]
    assert starts[1].input == {} and starts[1].name == "record_person"
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert pieces and json.loads("".join(pieces)) == {"name": "Ada", "age": 36}
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert Person.model_validate(final.content[1].input) == Person(name="Ada", age=36)
    assert final.content[1].id == starts[1].id


def test_an_answer_that_never_fits_the_schema_stops_at_max_tokens(client):
    # The root answers plain text every turn: the run ends out of turns without a fitting answer.
    message = _ask(client, HELLO, extra_body={"recursa": {"max_iterations": 2}})
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["text"]  # not a JSON object: no tool input to give
    assert message.model_extra["recursa"]["error"]
    with client.messages.stream(
        model="recursa",
        max_tokens=1000,
        system=CONTEXT,
        messages=_user(HELLO),
        tools=[TOOL],
        tool_choice=FORCED,
        extra_body={"recursa": {"max_iterations": 2}},
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens" and [b.type for b in streamed.content] == ["text"]


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        ({"tool_choice": None}, "`tools` are not supported"),
        ({"tool_choice": {"type": "auto"}}, 'tool_choice {"type": "auto"} is not supported'),
        (
            {"tool_choice": {"type": "any"}, "tools": [TOOL, OTHER]},
            'tool_choice {"type": "any"} with 2 tools',
        ),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice names 'nope'"),
        ({"tool_choice": {"type": "tool"}}, "must name the tool"),
        ({"tool_choice": {**FORCED, "disable_parallel_tool_use": "yes"}}, "disable_parallel_tool_use"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, r"tools\[0\] is a 'web_search"),
        (
            {"tools": [{"name": "record_person", "input_schema": {"type": "array"}}]},
            r"tools\[0\]\.input_schema",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "either output_config.format or a forced tool_choice",
        ),
    ],
)
def test_tools_that_cannot_be_honoured_are_a_400_naming_the_field(client, asked, named):
    fields = {"tools": [TOOL], "tool_choice": FORCED, **asked}
    if fields["tool_choice"] is None:
        del fields["tool_choice"]
    with pytest.raises(anthropic.BadRequestError, match=named) as refused:
        client.messages.create(model="recursa", max_tokens=10, messages=_user("q"), extra_body=fields)
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    if "tool_choice" in named or "either" in named:
        assert "tool_choice" in refused.value.body["error"]["message"]


def test_tool_choice_none_ignores_the_tools(client):
    plain = client.messages.create(
        model="recursa",
        max_tokens=100,
        system=CONTEXT,
        messages=_user(HELLO),
        tools=[TOOL],
        tool_choice={"type": "none"},
    )
    assert plain.content[0].text == "hello from the rlm" and plain.stop_reason == "end_turn"


def test_a_replayed_tool_use_and_its_result_are_read_as_chat_reads_them(client):
    first = _ask(client)
    question = "what is recorded?"
    turns = [
        *_user(PERSON),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": first.content[0].id, "content": "recorded: Ada"},
                {"type": "text", "text": question},
            ],
        },
    ]
    message = client.messages.create(model="recursa", max_tokens=1000, messages=turns)
    described = json.loads(message.content[0].text)
    # The call is not context (as a replayed tool_calls message); its result is, as a tool message.
    assert described["question"] == question and described["type"] == "list" and described["len"] == 2
    assert described["head"].startswith("[user]") and described["tail"].endswith("[tool]\nrecorded: Ada")

    # A result for a call the assistant turn before it did not make is a 400 naming it.
    turns[2]["content"][0]["tool_use_id"] = "toolu_unknown"
    with pytest.raises(anthropic.BadRequestError, match="toolu_unknown") as refused:
        client.messages.create(model="recursa", max_tokens=10, messages=turns)
    assert "messages[2].content[0]" in str(refused.value)
    turns[1]["content"].append({"type": "tool_result", "tool_use_id": first.content[0].id, "content": "x"})
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[1\]: tool_result blocks"):
        client.messages.create(model="recursa", max_tokens=10, messages=turns)


# -- LangChain's ChatAnthropic ----------------------------------------------------------------------


def _chat_anthropic(srv: BackgroundServer) -> Any:
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    return langchain_anthropic.ChatAnthropic(
        model="recursa", base_url=srv.url, api_key=KEY, max_retries=0, max_tokens=1000
    )


def test_langchain_chat_anthropic_invoke_stream_and_structured_output(srv):
    chat = _chat_anthropic(srv)
    asked = [("system", CONTEXT), ("user", HELLO)]
    assert chat.invoke(asked).content == "hello from the rlm"
    assert "".join(c.text for c in chat.stream(asked)) == "hello from the rlm"
    structured = chat.with_structured_output(Person)
    assert structured.invoke([("system", CONTEXT), ("user", PERSON)]) == Person(name="Ada", age=36)
    # Streamed, the tool's input arrives in pieces that LangChain parses as they come.
    chunks = list(structured.stream([("system", CONTEXT), ("user", PERSON)]))
    assert chunks and chunks[-1] == Person(name="Ada", age=36)


# -- LiteLLM's anthropic/ provider ------------------------------------------------------------------


def test_litellm_anthropic_provider_with_response_format_and_a_forced_tool(srv, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    monkeypatch.setattr(litellm, "telemetry", False)
    asked = {
        "model": "anthropic/recursa",
        "api_base": srv.url,
        "api_key": KEY,
        "num_retries": 0,
        "max_tokens": 1000,
        "messages": [{"role": "system", "content": CONTEXT}, *_user(PERSON)],
    }
    # LiteLLM sends response_format to an anthropic/ model as a forced tool of its own.
    answer = litellm.completion(**asked, response_format=Person)
    assert Person.model_validate_json(answer.choices[0].message.content) == Person(name="Ada", age=36)
    # An OpenAI-shaped forced function becomes the Messages API's forced tool, and comes back a call.
    function = {"name": "record_person", "parameters": Person.model_json_schema()}
    called = litellm.completion(
        **asked,
        tools=[{"type": "function", "function": function}],
        tool_choice={"type": "function", "function": {"name": "record_person"}},
    )
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "record_person" and called.choices[0].finish_reason == "tool_calls"
    assert Person.model_validate_json(call.function.arguments) == Person(name="Ada", age=36)
