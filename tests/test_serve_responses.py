"""`recursa serve`'s Responses API (`POST /v1/responses`) driven by the clients that use it: the
`openai` SDK (create, stream, parse), the OpenAI Agents SDK with its default (Responses) model,
LangChain's ChatOpenAI(use_responses_api=True) and LiteLLM's `responses`. The run is the Chat
Completions one, so what is checked here is the wire format, the fields, sessions through
previous_response_id, and that auth, admission, the access log and metrics cover the endpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx
import openai
from pydantic import BaseModel

from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from recursa.serve.responses_request import NO_EFFECT, REFUSED
from tests.serve_helpers import CONTEXT, FOREVER, HELLO, PERSON, serve_settings, wait_until

KEY = "responses-test-key-0123456789"


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(serve_settings(tmp_path_factory.mktemp("responses"), KEY))) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def _post(srv: BackgroundServer, **body: Any) -> httpx.Response:
    body.setdefault("model", "recursa")
    body.setdefault("input", "hello")
    return httpx.post(
        srv.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


# -- the openai SDK --------------------------------------------------------------------------------


def test_create_answers_with_a_message_and_usage(client):
    r = client.responses.create(model="recursa", instructions=CONTEXT, input=HELLO, metadata={"team": "a"})
    assert r.output_text == "hello from the rlm"
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert [item.type for item in r.output] == ["message"]
    assert r.instructions == CONTEXT and r.metadata == {"team": "a"}  # echoed, as OpenAI does
    usage = r.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert r.model_extra["recursa"]["stop_reason"] == "final"
    # A document sent as instructions is the context: it is not sent back.
    long = client.responses.create(model="recursa", instructions="a long document. " * 1_000, input=HELLO)
    assert long.output_text == "hello from the rlm" and long.instructions is None


def test_input_items_become_question_and_context(client):
    """Messages with input_text parts (and a system or developer one) are read as in Chat
    Completions: the last user message is the question, the others the context."""
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "first document"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "describe it"}]},
    ]
    described = json.loads(client.responses.create(model="recursa", input=items).output_text)
    assert described["question"] == "describe it" and described["head"] == "first document"


def test_stream_sends_the_responses_event_sequence(client):
    events = list(client.responses.create(model="recursa", instructions=CONTEXT, input=HELLO, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hello from the rlm"
    final = events[-1].response
    assert (
        final.output_text == "hello from the rlm" and final.usage is not None and final.usage.total_tokens > 0
    )


def test_stream_helper_accumulates_the_same_response(client):
    # The SDK's helper checks the stream's item identities and builds the final response from it.
    with client.responses.stream(model="recursa", instructions=CONTEXT, input=HELLO) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "hello from the rlm"


def test_reasoning_summary_carries_the_runs_steps(client):
    asked = {"model": "recursa", "instructions": CONTEXT, "input": HELLO, "reasoning": {"summary": "auto"}}
    with client.responses.stream(**asked) as stream:
        steps = "".join(e.delta for e in stream if e.type == "response.reasoning_summary_text.delta")
        final = stream.get_final_response()
    assert "Starting a recursive run" in steps and "REPL" in steps
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "hello from the rlm"
    whole = client.responses.create(**asked)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert "Starting a recursive run" in whole.output[0].summary[0].text
    # Without a summary asked for, no steps are sent (as with OpenAI's reasoning models).
    plain = client.responses.create(model="recursa", instructions=CONTEXT, input=HELLO)
    assert [item.type for item in plain.output] == ["message"]


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model="recursa", instructions=CONTEXT, input=PERSON, text_format=Person)
    assert r.output_parsed == Person(name="Ada", age=36)


def test_json_object_format(client):
    r = client.responses.create(
        model="recursa", instructions=CONTEXT, input=PERSON, text={"format": {"type": "json_object"}}
    )
    assert json.loads(r.output_text) == {"name": "Ada", "age": 36}


def test_a_forced_function_is_the_answer(client):
    tool = {"type": "function", "name": "record_person", "parameters": Person.model_json_schema()}
    asked = {
        "model": "recursa",
        "instructions": CONTEXT,
        "input": PERSON,
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "record_person"},
    }
    r = client.responses.create(**asked)
    [call] = r.output
    assert call.type == "function_call" and call.name == "record_person" and call.call_id.startswith("call_")
    assert Person.model_validate_json(call.arguments) == Person(name="Ada", age=36)
    with client.responses.stream(**asked) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert Person.model_validate_json(final.output[0].arguments) == Person(name="Ada", age=36)


def test_max_output_tokens_cuts_the_answer_and_marks_it_incomplete(client):
    r = client.responses.create(
        model="recursa", instructions=CONTEXT, input="RUN: FINAL('x' * 400)", max_output_tokens=10
    )
    assert r.output_text == "x" * 40
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_a_wrong_key_is_an_authentication_error(srv):
    wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model="recursa", input=HELLO)


# -- fields ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[(name, {"id": "x"}) for name in REFUSED],
        ("background", True),
        ("top_logprobs", 3),
        ("temprature", 0.5),
        ("temperature", 5),
        ("max_output_tokens", 0),
        ("text", {"format": {"type": "yaml"}}),
        ("reasoning", {"effort": "extreme"}),
        ("include", ["message.output_text.logprobs"]),
        ("truncation", "sometimes"),
        ("tools", [{"type": "function", "name": "f", "parameters": {}}]),  # the model would choose
        ("tools", [{"type": "web_search"}]),
        ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": []}),
    ],
)
def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(srv, field, value):
    r = _post(srv, **{field: value})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"].split(".")[0].split("[")[0] == field, error


@pytest.mark.parametrize(
    ("item", "param"),
    [
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]},
            "input[0].content[0]",
        ),
        ({"role": "critic", "content": "hi"}, "input[0].role"),
        ({"type": "item_reference", "id": "msg_1"}, "input[0]"),
        ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
    ],
)
def test_a_bad_input_item_is_a_400_naming_it(srv, item, param):
    r = _post(srv, input=[item])
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tool_choice_auto_is_refused_only_with_tools_to_choose_among(srv):
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    refused = _post(srv, tools=tools, tool_choice="auto")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    assert "never hands a tool call back" in refused.json()["error"]["message"]
    assert _post(srv, instructions=CONTEXT, input=HELLO, tools=[], tool_choice="auto").status_code == 200
    assert _post(srv, instructions=CONTEXT, input=HELLO, tools=tools, tool_choice="none").status_code == 200


def test_the_sdk_raises_bad_request_for_a_refused_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="recursa", input=HELLO, background=True)
    assert "stream the response instead" in caught.value.message


def test_fields_without_effect_are_accepted(srv):
    values = {
        "store": False,
        "user": "u1",
        "safety_identifier": "s1",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "stream_options": {"include_obfuscation": False},
        "truncation": "auto",
        "context_management": [],
        "max_tool_calls": 3,
        "include": ["reasoning.encrypted_content"],
        "image": {},
        "background_options": {},
    }
    assert set(values) == set(NO_EFFECT)
    r = _post(srv, instructions=CONTEXT, input=HELLO, temperature=0.2, top_p=0.9, **values)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "hello from the rlm"


def test_stored_response_endpoints_say_nothing_is_stored(client):
    for call in (
        lambda: client.responses.retrieve("resp_1"),
        lambda: client.responses.delete("resp_1"),
        lambda: client.responses.cancel("resp_1"),
        lambda: client.responses.input_items.list("resp_1"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert "stores no responses" in caught.value.message


def test_an_unknown_previous_response_is_a_400_saying_how_to_continue(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="recursa", input=HELLO, previous_response_id="resp_nothing")
    assert caught.value.body["param"] == "previous_response_id"
    assert '"session": "new"' in caught.value.message


# -- sessions through previous_response_id ---------------------------------------------------------


def test_previous_response_id_continues_the_same_repl(client):
    first = client.responses.create(
        model="recursa",
        instructions=CONTEXT,
        input="RUN: x = 41\nFINAL('stored')",
        extra_body={"recursa": {"session": "new"}},
    )
    session = first.model_extra["recursa"]["session"]
    assert first.output_text == "stored" and session
    second = client.responses.create(
        model="recursa", input="RUN: FINAL(str(x + 1))", previous_response_id=first.id
    )
    assert second.output_text == "42"
    assert second.previous_response_id == first.id and second.model_extra["recursa"]["session"] == session
    # The chain goes on from the follow-up too, streamed or not.
    with client.responses.stream(
        model="recursa", input="RUN: FINAL(str(x + 2))", previous_response_id=second.id
    ) as s:
        assert s.get_final_response().output_text == "43"
    # Another caller (its own X-Recursa-Client secret) cannot follow a response it does not own.
    other = openai.OpenAI(
        base_url=str(client.base_url),
        api_key=KEY,
        max_retries=0,
        default_headers={"X-Recursa-Client": "z" * 24},
    )
    with pytest.raises(openai.BadRequestError):
        other.responses.create(model="recursa", input="RUN: FINAL(str(x))", previous_response_id=first.id)


# -- the frameworks --------------------------------------------------------------------------------


def _agent_run(srv: BackgroundServer, output_type: type | None, question: str, key: str = KEY):
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    # The provider's default model for a name is the Responses one (OpenAIResponsesModel).
    config = agents.RunConfig(
        tracing_disabled=True, model_provider=agents.OpenAIProvider(openai_client=client)
    )
    agent = agents.Agent(name="analyst", instructions=CONTEXT, model="recursa", output_type=output_type)
    return asyncio.run(agents.Runner.run(agent, question, run_config=config))


def _responses_posts(srv: BackgroundServer) -> float:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = 'recursa_http_requests_total{method="POST",path="/v1/responses",status="200"}'
    return next((float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)), 0.0)


def test_agents_runner_with_the_default_responses_model(srv):
    before = _responses_posts(srv)
    assert _agent_run(srv, None, HELLO).final_output == "hello from the rlm"
    assert _agent_run(srv, Person, PERSON).final_output == Person(name="Ada", age=36)
    assert _responses_posts(srv) == before + 2  # both went through /v1/responses


def test_agents_wrong_key_is_an_authentication_error(srv):
    with pytest.raises(openai.AuthenticationError):
        _agent_run(srv, None, HELLO, key="wrong-key")


def test_agents_run_streamed_with_the_default_responses_model(srv):
    agents = pytest.importorskip("agents")

    async def run() -> tuple[Any, list[str]]:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        config = agents.RunConfig(
            tracing_disabled=True, model_provider=agents.OpenAIProvider(openai_client=client)
        )
        agent = agents.Agent(name="analyst", instructions=CONTEXT, model="recursa")
        streamed = agents.Runner.run_streamed(agent, HELLO, run_config=config)
        kinds = [
            event.data.type async for event in streamed.stream_events() if event.type == "raw_response_event"
        ]
        return streamed.final_output, kinds

    final, kinds = asyncio.run(run())
    assert final == "hello from the rlm"
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"


def test_agents_with_tools_gets_a_400_that_says_why(srv):
    agents = pytest.importorskip("agents")

    @agents.function_tool
    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    config = agents.RunConfig(
        tracing_disabled=True, model_provider=agents.OpenAIProvider(openai_client=client)
    )
    agent = agents.Agent(name="a", instructions=CONTEXT, model="recursa", tools=[lookup])
    with pytest.raises(openai.BadRequestError) as caught:
        asyncio.run(agents.Runner.run(agent, HELLO, run_config=config))
    assert "never hands a tool call back" in caught.value.message


def _lc_chat(srv: BackgroundServer):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model="recursa", base_url=srv.url + "/v1", api_key=KEY, max_retries=0, use_responses_api=True
    )


def test_langchain_with_the_responses_api(srv):
    chat = _lc_chat(srv)
    before = _responses_posts(srv)
    assert chat.invoke([("system", CONTEXT), ("user", HELLO)]).text == "hello from the rlm"
    chunks = list(chat.stream([("system", CONTEXT), ("user", HELLO)]))
    assert "".join(chunk.text for chunk in chunks) == "hello from the rlm"
    assert _responses_posts(srv) == before + 2


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_with_the_responses_api(srv, method):
    structured = _lc_chat(srv).with_structured_output(Person, method=method)
    assert structured.invoke([("system", CONTEXT), ("user", PERSON)]) == Person(name="Ada", age=36)


def test_litellm_responses_and_its_stream(srv, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price map, no download
    litellm = pytest.importorskip("litellm")
    monkeypatch.setattr(litellm, "telemetry", False)
    asked = {
        "model": "openai/recursa",
        "api_base": srv.url + "/v1",
        "num_retries": 0,
        "instructions": CONTEXT,
        "input": HELLO,
    }
    r = litellm.responses(api_key=KEY, **asked)
    assert r.output[0].content[0].text == "hello from the rlm"
    events = list(litellm.responses(api_key=KEY, stream=True, **asked))
    deltas = [e.delta for e in events if getattr(e, "type", None) == "response.output_text.delta"]
    assert "".join(deltas) == "hello from the rlm"
    with pytest.raises(litellm.AuthenticationError):
        litellm.responses(api_key="wrong-key", **asked)


# -- the server around it --------------------------------------------------------------------------


def test_access_log_metrics_and_admission_cover_responses(tmp_path, access_lines):
    """A line per request with its run id, a metrics label of its own, and the same run slots and
    waiting room as chat: one run going and none allowed to wait, a second request is a 429."""
    auth = {"Authorization": f"Bearer {KEY}"}
    forever = {"model": "recursa", "instructions": CONTEXT, "input": FOREVER, "stream": True}
    with BackgroundServer(create_app(serve_settings(tmp_path, KEY, max_runs=1, max_waiting=0))) as srv:
        ok = _post(srv, instructions=CONTEXT, input=HELLO)
        service = srv.app.state.service
        with httpx.stream(
            "POST", srv.url + "/v1/responses", json=forever, headers=auth, timeout=60
        ) as running:
            lines = running.iter_lines()
            next(lines)
            wait_until(lambda: bool(service.active), what="the run to start")
            busy = _post(srv, instructions=CONTEXT, input=HELLO)
        wait_until(lambda: not service.active, what="the run to be cancelled")
        scraped = httpx.get(srv.url + "/metrics", headers=auth).text
    assert ok.status_code == 200 and busy.status_code == 429
    assert busy.json()["error"]["code"] == "server_busy"
    run_id = ok.json()["recursa"]["run_id"]
    assert any(
        line.startswith("POST /v1/responses 200 ") and line.endswith(f"run={run_id}") for line in access_lines
    )
    assert 'path="/v1/responses",status="429"' in scraped


def test_a_session_closed_under_a_streamed_response_ends_it_as_failed(srv, client):
    """DELETE of the session cancels its question: the stream ends with response.failed saying so."""
    first = client.responses.create(
        model="recursa", instructions=CONTEXT, input=HELLO, extra_body={"recursa": {"session": "new"}}
    )
    session = first.model_extra["recursa"]["session"]
    service = srv.app.state.service
    events = []
    with client.responses.create(
        model="recursa", input=FOREVER, previous_response_id=first.id, stream=True
    ) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.in_progress":
                wait_until(lambda: bool(service.active), what="the question to start")
                closed = httpx.delete(
                    f"{srv.url}/v1/recursa/sessions/{session}", headers={"Authorization": f"Bearer {KEY}"}
                )
                assert closed.status_code == 200
    assert events[-1].type == "response.failed"
    assert "was closed while this question ran" in events[-1].response.error.message
