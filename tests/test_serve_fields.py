"""`recursa serve` and the standard Chat Completions fields (recursa.serve.fields): response_format
and a forced function become the answer's JSON Schema, sampling fields reach the root model's calls,
stop and max_completion_tokens shape the answer, and every field an RLM cannot honour is a 400
naming it. Driven through raw HTTP and the official `openai` SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx
import openai
from pydantic import BaseModel

from recursa import Budget
from recursa.asgi.background import BackgroundServer
from recursa.serve.fields import NO_EFFECT, REFUSED
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from recursa.trace import load
from tests.serve_helpers import install_test_root

KEY = "fields-test-key-0123456789"
ROOT = install_test_root()
PERSON = 'RUN: person = {"name": "Ada", "age": 36}\nFINAL_VAR("person")'
# The first answer misses `age`: the model is told what failed and answers again.
PERSON_SECOND_TRY = 'RUN: nobody = {"name": "Ada"}\nFINAL_VAR("nobody") ||| ' + PERSON.removeprefix("RUN: ")


def ask(question: str) -> list[dict[str, str]]:
    """A question beside a context message (alone, a message would become the context itself)."""
    return [{"role": "system", "content": "the context"}, {"role": "user", "content": question}]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    tmp = tmp_path_factory.mktemp("fields")
    settings = ServeSettings(
        model=ROOT,
        sub_model="scripted/oracle",
        trace_dir=tmp / "traces",
        api_key=KEY,
        budget=Budget(max_llm_calls=30),
    )
    with BackgroundServer(create_app(settings)) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def _post(srv: BackgroundServer, **body: Any) -> httpx.Response:
    body.setdefault("model", "recursa")
    body.setdefault("messages", [{"role": "user", "content": "hello"}])
    return httpx.post(
        srv.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )


def _trace(srv: BackgroundServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    folder = srv.app.state.service.settings.run["trace_dir"]
    return load(folder / body["recursa"]["trace"]).events


def _schema_format(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": model.__name__, "schema": model.model_json_schema()},
    }


# -- response_format -------------------------------------------------------------------------------


def test_json_schema_answer_is_the_json_text_and_the_model_is_told_the_schema(srv, client):
    r = client.chat.completions.create(
        model="recursa",
        messages=ask(PERSON_SECOND_TRY),
        response_format=_schema_format(Person),
    )
    assert json.loads(r.choices[0].message.content) == {"name": "Ada", "age": 36}
    assert r.choices[0].finish_reason == "stop"
    body = r.model_dump()
    assert body["recursa"]["iterations"] == 2  # the first answer (no age) was sent back
    events = _trace(srv, body)
    first = next(e for e in events if e["type"] == "lm_call" and e.get("purpose") == "root")
    shown = json.dumps(first["new_messages"])
    assert "JSON schema" in shown and "age" in shown
    second = [e for e in events if e["type"] == "lm_call" and e.get("purpose") == "root"][1]
    assert "does not match the required schema" in json.dumps(second["new_messages"])


def test_sdk_parse_gives_the_pydantic_object(client):
    r = client.chat.completions.parse(model="recursa", messages=ask(PERSON), response_format=Person)
    assert r.choices[0].message.parsed == Person(name="Ada", age=36)


def test_json_schema_streams_the_json_text(client):
    stream = client.chat.completions.create(
        model="recursa",
        messages=ask(PERSON),
        response_format=_schema_format(Person),
        stream=True,
    )
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert json.loads(text) == {"name": "Ada", "age": 36}


def test_json_object_requires_an_object(srv):
    listed = _post(
        srv,
        messages=ask('RUN: x = [1, 2]\nFINAL_VAR("x") ||| y = {"n": 2}\nFINAL_VAR("y")'),
        response_format={"type": "json_object"},
    )
    assert listed.status_code == 200, listed.text
    body = listed.json()
    assert json.loads(body["choices"][0]["message"]["content"]) == {"n": 2}
    assert body["recursa"]["iterations"] == 2  # the list was refused


def test_invalid_json_schema_is_a_400_naming_response_format(srv):
    r = _post(
        srv,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    )
    assert r.status_code == 400
    assert "not a valid JSON Schema" in r.json()["error"]["message"]
    r = _post(srv, response_format={"type": "xml"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# -- a forced function -----------------------------------------------------------------------------

_TOOL = {
    "type": "function",
    "function": {"name": "Person", "description": "a person", "parameters": Person.model_json_schema()},
}


def test_forced_function_returns_a_tool_call_with_the_answer_as_arguments(srv):
    r = _post(
        srv,
        messages=ask(PERSON),
        tools=[_TOOL],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        parallel_tool_calls=False,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "Person"
    assert json.loads(call["function"]["arguments"]) == {"name": "Ada", "age": 36}


def test_forced_function_streams_as_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="recursa",
        messages=ask(PERSON),
        tools=[_TOOL],
        tool_choice="required",
        stream=True,
    )
    args, names, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            names += [call.function.name] if call.function and call.function.name else []
            args += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["Person"] and json.loads(args) == {"name": "Ada", "age": 36}
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [_TOOL]}, "tools"),
        ({"tools": [_TOOL], "tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": [_TOOL, {**_TOOL, "function": {"name": "Other"}}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "Missing"}}},
            "tool_choice",
        ),
    ],
)
def test_tools_the_model_would_choose_among_are_refused(srv, fields, param):
    r = _post(srv, **fields)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert "tool" in error["message"]


def test_tool_choice_none_ignores_the_tools(srv):
    r = _post(srv, messages=ask("RUN: FINAL('plain')"), tools=[_TOOL], tool_choice="none")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "plain"


# -- sampling, stop, answer length -----------------------------------------------------------------


def test_sampling_fields_reach_the_root_model_calls_only(srv):
    r = _post(
        srv,
        messages=ask("RUN: print(llm_query('hi')) ||| FINAL('done')"),
        temperature=0.3,
        top_p=0.9,
        seed=11,
        reasoning_effort="low",
        frequency_penalty=0.5,
    )
    assert r.status_code == 200, r.text
    calls = [e for e in _trace(srv, r.json()) if e["type"] == "lm_call"]
    roots = [e for e in calls if e["purpose"] == "root"]
    subs = [e for e in calls if e["purpose"] == "sub"]
    assert roots and subs
    want = {"temperature": 0.3, "top_p": 0.9, "seed": 11, "reasoning_effort": "low", "frequency_penalty": 0.5}
    assert all(e.get("sampling") == want for e in roots)
    assert all("sampling" not in e for e in subs)


def test_stop_cuts_the_answer_at_the_first_stop_sequence(srv):
    r = _post(srv, messages=ask("RUN: FINAL('alpha END beta')"), stop=["END", "zzz"])
    assert r.json()["choices"][0]["message"]["content"] == "alpha "
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_max_completion_tokens_cuts_the_answer_and_tells_the_model(srv, client):
    r = client.chat.completions.create(
        model="recursa",
        messages=ask('RUN: x = "y" * 500\nFINAL_VAR("x")'),
        max_completion_tokens=10,
    )
    assert r.choices[0].message.content == "y" * 40  # 4 characters per token
    assert r.choices[0].finish_reason == "length"
    events = _trace(srv, r.model_dump())
    start = next(e for e in events if e["type"] == "lm_call")
    assert "at most 10 tokens" in json.dumps(start["new_messages"])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": "high"}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": "10"}, "max_completion_tokens"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"user": 7}, "user"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(srv, fields, param):
    r = _post(srv, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_fields_an_rlm_cannot_honour_are_refused_with_the_reason(srv, name):
    value: Any = {
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {"50256": -100},
        "audio": {"voice": "x"},
    }.get(name, {"type": "content", "content": "x"} if name == "prediction" else {"x": 1})
    if name == "function_call":
        value = "auto"
    r = _post(srv, **{name: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert REFUSED[name].split(";")[0][:40] in error["message"]


def test_n_above_one_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="one answer"):
        client.chat.completions.create(model="recursa", messages=ask("q"), n=2)


def test_fields_without_effect_are_accepted(srv):
    values = {
        "user": "u-1",
        "safety_identifier": "s-1",
        "metadata": {"team": "a"},
        "store": False,
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "verbosity": "low",
        "parallel_tool_calls": True,
        "modalities": ["text"],
        "prompt_cache_retention": "24h",
    }
    assert set(values) == set(NO_EFFECT)
    r = _post(srv, messages=ask("RUN: FINAL('ok')"), **values)
    assert r.status_code == 200, r.text


def test_unknown_fields_are_a_400_that_points_at_extra_body(srv):
    r = _post(srv, temprature=0.2)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "temprature" and "extra_body" in error["message"]


def test_anthropic_root_refuses_sampling_its_api_does_not_take(tmp_path):
    from recursa.serve.fields import parse_shape
    from recursa.serve.request import ApiError

    with pytest.raises(ApiError, match="takes only temperature, top_k, top_p"):
        parse_shape({"seed": 3}, "anthropic")
    assert parse_shape({"temperature": 0.5, "top_k": 4}, "anthropic").sampling == {
        "temperature": 0.5,
        "top_k": 4,
    }


def test_a_session_keeps_its_sampling_but_takes_a_schema_per_question(srv):
    sid = "fields-session-1"
    first = _post(
        srv,
        messages=ask("RUN: FINAL('one')"),
        temperature=0.2,
        recursa={"session": sid, "context": "ctx"},
    )
    assert first.status_code == 200, first.text
    changed = _post(
        srv,
        messages=ask("RUN: FINAL('two')"),
        temperature=0.9,
        recursa={"session": sid},
    )
    assert changed.status_code == 400 and "sampling" in changed.json()["error"]["message"]
    typed = _post(
        srv,
        messages=ask(PERSON),
        response_format=_schema_format(Person),
        recursa={"session": sid},
    )
    assert typed.status_code == 200, typed.text
    assert json.loads(typed.json()["choices"][0]["message"]["content"]) == {"name": "Ada", "age": 36}


def test_fields_table_in_the_docs_names_every_standard_field():
    from recursa.serve.fields import STANDARD

    page = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text(encoding="utf-8")
    missing = [f for f in sorted(STANDARD) if f"`{f}`" not in page]
    assert not missing


def test_run_settings_errors_name_what_the_client_can_send(tmp_path):
    # A dollar cap for a model with no known price: the fix is a request field (or the operator's
    # flag), never a Python argument.
    settings = ServeSettings(model="openai/my-model", base_url="http://127.0.0.1:9/v1", trace_dir=tmp_path)
    with BackgroundServer(create_app(settings)) as server:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "recursa", "messages": ask("q"), "recursa": {"max_usd": 1.0}},
            timeout=30,
        )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "drop recursa.max_usd and cap recursa.max_tokens" in message and "operator's --prices FILE" in message
    assert "RLM(" not in message


def test_a_request_may_not_ask_for_more_reasoning_effort_than_the_operator_gives(tmp_path):
    """Reasoning tokens are billed as output: the operator's sampling gives the root "low", and a
    request's "xhigh" (any API's spelling) ran on the operator's key at that effort."""
    from recursa.serve.api_error import ApiError
    from recursa.serve.messages_request import parse_messages_request
    from recursa.serve.request import parse_chat_request
    from recursa.serve.responses_request import parse_responses_request

    settings = ServeSettings(
        model=ROOT, rlm_options={"sampling": {"root": {"reasoning_effort": "low", "temperature": 0.5}}}
    )
    messages = ask("RUN: FINAL('x')")
    lower = parse_chat_request(
        {"model": "recursa", "messages": messages, "reasoning_effort": "minimal"}, settings
    )
    assert lower.shape.sampling["reasoning_effort"] == "minimal"
    bodies = [
        (parse_chat_request, {"messages": messages, "reasoning_effort": "xhigh"}),
        (parse_responses_request, {"input": "q", "reasoning": {"effort": "high"}}),
        (parse_messages_request, {"messages": [{"role": "user", "content": "q"}], "max_tokens": 50,
                                  "output_config": {"effort": "medium"}}),
    ]  # fmt: skip
    for parse, body in bodies:
        with pytest.raises(ApiError) as refused:
            parse({"model": "recursa", **body}, settings)
        assert refused.value.status == 400
        assert "at most 'low'" in str(refused.value.message), refused.value.message


def test_every_door_takes_the_schemas_sampling_policy(tmp_path):
    """One declaration (SamplingOptions in recursa/config.py) decides what a client may send for a
    role's calls: a request's `recursa.sampling`, an MCP tool's arguments and an ACP session's
    `_meta` alike may lower reasoning_effort, never raise it, and send only declared options; what a
    client leaves out of a role stays the operator's."""
    from recursa.errors import ConfigError
    from recursa.serve.acp_agent import _checked_runtime
    from recursa.serve.api_error import ApiError
    from recursa.serve.mcp_server import _spec
    from recursa.serve.request import parse_chat_request

    settings = ServeSettings(
        model=ROOT, rlm_options={"sampling": {"root": {"reasoning_effort": "low", "temperature": 0.5}}}
    )

    def chat(sampling):
        body = {"model": "recursa", "messages": ask("q"), "recursa": {"sampling": sampling}}
        return parse_chat_request(body, settings).settings["sampling"]

    doors = [
        (chat, ApiError, "recursa.sampling.root.reasoning_effort"),
        (lambda s: _spec(settings, "q", None, "ctx", {"sampling": s}).settings["sampling"], Exception,
         "arguments['sampling']['root']['reasoning_effort']"),
        (lambda s: _checked_runtime({"sampling": s}, settings)["sampling"], ConfigError,
         "_meta.recursa/runtime-v1.sampling.root.reasoning_effort"),
    ]  # fmt: skip
    for read, refusal, label in doors:
        lowered = read({"root": {"reasoning_effort": "minimal"}, "sub": {"seed": 3}})
        assert lowered == {"root": {"reasoning_effort": "minimal", "temperature": 0.5}, "sub": {"seed": 3}}
        with pytest.raises(refusal) as raised:
            read({"root": {"reasoning_effort": "high"}})
        assert f"{label}='high' is more than the operator allows (at most 'low')" in str(raised.value)
        with pytest.raises(refusal, match=r"logprobs.* is not an option"):
            read({"root": {"logprobs": True}})  # the operator's own sampling may hold it; a client's not
        with pytest.raises(refusal, match=r"temperature.* must be a number from 0 to 2"):
            read({"child": {"temperature": 9}})
