"""`recursa serve` driven by the clients people already use (the `clients-test` extra, pinned):
LangChain's ChatOpenAI (invoke, stream with and without stream_usage, with_structured_output by
json_schema and by function calling), LiteLLM (completion and streaming, with usage), the OpenAI
SDK's stream_options and the OpenAI Agents SDK (Runner.run with an output_type). Each must also
report a wrong key as an authentication error, not a bad request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
import openai
from pydantic import BaseModel

from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from recursa.tasks import generate
from tests.serve_helpers import CONTEXT, HELLO, PERSON, serve_settings

KEY = "clients-test-key-0123456789"


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    settings = serve_settings(tmp_path_factory.mktemp("clients"), KEY)
    with BackgroundServer(create_app(settings)) as server:
        yield server


# -- LangChain -------------------------------------------------------------------------------------


def _chat(srv: BackgroundServer, key: str = KEY):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="recursa", base_url=srv.url + "/v1", api_key=key, max_retries=0)


def _lc_messages(question: str) -> list[tuple[str, str]]:
    return [("system", CONTEXT), ("user", question)]


def test_langchain_invoke_and_stream(srv):
    chat = _chat(srv)
    assert chat.invoke(_lc_messages(HELLO)).content == "hello from the rlm"
    chunks = list(chat.stream(_lc_messages(HELLO)))
    assert "".join(str(c.content) for c in chunks) == "hello from the rlm"


@pytest.mark.parametrize("stream_usage", [True, False])
def test_langchain_stream_usage_follows_stream_usage(srv, stream_usage):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        model="recursa", base_url=srv.url + "/v1", api_key=KEY, max_retries=0, stream_usage=stream_usage
    )
    chunks = list(chat.stream(_lc_messages(HELLO)))
    assert "".join(str(c.content) for c in chunks) == "hello from the rlm"
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    if stream_usage:
        usage = total.usage_metadata
        assert usage is not None and usage["input_tokens"] > 0 and usage["output_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    else:
        assert total.usage_metadata is None


# -- the OpenAI SDK's stream_options ----------------------------------------------------------------


def _openai(srv: BackgroundServer):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def test_openai_stream_with_include_usage_ends_with_a_usage_chunk(srv):
    stream = _openai(srv).chat.completions.create(
        model="recursa",
        messages=[{"role": "system", "content": CONTEXT}, {"role": "user", "content": HELLO}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.prompt_tokens > 0 and last.usage.completion_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert "cost" in (last.usage.model_extra or {})
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "hello from the rlm"


def test_openai_stream_without_include_usage_has_no_usage(srv):
    import httpx

    body = {
        "model": "recursa",
        "stream": True,
        "messages": [{"role": "system", "content": CONTEXT}, {"role": "user", "content": HELLO}],
    }
    for options in (None, {"include_usage": False}):
        sent = body if options is None else {**body, "stream_options": options}
        r = httpx.post(
            srv.url + "/v1/chat/completions", json=sent, headers={"Authorization": f"Bearer {KEY}"}
        )
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events and all("usage" not in e for e in events)
        assert all(e["choices"] for e in events)  # no usage chunk without choices
        assert events[-1]["choices"][0]["finish_reason"] == "stop" and "recursa" in events[-1]
    chunks = list(_openai(srv).chat.completions.create(**body))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"include_usage": "yes"}, "stream_options.include_usage"),
        ({"include_obfuscation": 1}, "stream_options.include_obfuscation"),
        (["include_usage"], "stream_options"),
    ],
)
def test_bad_stream_options_are_a_400_naming_the_field(srv, options, param):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as info:
        _openai(srv).chat.completions.create(
            model="recursa",
            messages=[{"role": "user", "content": HELLO}],
            stream=True,
            stream_options=options,
        )
    assert info.value.body["param"] == param


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(srv, method):
    structured = _chat(srv).with_structured_output(Person, method=method)
    assert structured.invoke(_lc_messages(PERSON)) == Person(name="Ada", age=36)


def test_langchain_wrong_key_is_an_authentication_error(srv):
    import openai

    with pytest.raises(openai.AuthenticationError):
        _chat(srv, key="wrong-key").invoke(_lc_messages(HELLO))


# -- LiteLLM ---------------------------------------------------------------------------------------


@pytest.fixture
def litellm(monkeypatch):
    # Its bundled price map, not the one it would fetch from the internet at import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    module = pytest.importorskip("litellm")
    monkeypatch.setattr(module, "telemetry", False)
    return module


def _lite_kwargs(srv: BackgroundServer, key: str = KEY) -> dict:
    return {
        "model": "openai/recursa",
        "api_base": srv.url + "/v1",
        "api_key": key,
        "num_retries": 0,
        "messages": [{"role": "system", "content": CONTEXT}, {"role": "user", "content": HELLO}],
    }


def test_litellm_completion_and_streaming(srv, litellm):
    r = litellm.completion(**_lite_kwargs(srv))
    assert r.choices[0].message.content == "hello from the rlm"
    pieces = [c.choices[0].delta.content or "" for c in litellm.completion(**_lite_kwargs(srv), stream=True)]
    assert "".join(pieces) == "hello from the rlm"


def test_litellm_streaming_with_usage(srv, litellm):
    chunks = list(
        litellm.completion(**_lite_kwargs(srv), stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello from the rlm"
    usage = next(getattr(c, "usage", None) for c in reversed(chunks) if getattr(c, "usage", None))
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_litellm_structured_output(srv, litellm):
    kwargs = _lite_kwargs(srv)
    kwargs["messages"][-1]["content"] = PERSON
    r = litellm.completion(**kwargs, response_format=Person)
    assert Person.model_validate_json(r.choices[0].message.content) == Person(name="Ada", age=36)


def test_litellm_wrong_key_is_an_authentication_error(srv, litellm):
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(**_lite_kwargs(srv, key="wrong-key"))


# -- OpenAI Agents SDK -----------------------------------------------------------------------------


def _agent_run(srv: BackgroundServer, key: str, output_type: type | None, question: str):
    agents = pytest.importorskip("agents")
    import openai

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="recursa", openai_client=client)
    agent = agents.Agent(name="analyst", instructions=CONTEXT, model=model, output_type=output_type)
    config = agents.RunConfig(tracing_disabled=True)
    return asyncio.run(agents.Runner.run(agent, question, run_config=config))


def test_agents_runner_with_output_type(srv):
    result = _agent_run(srv, KEY, Person, PERSON)
    assert result.final_output == Person(name="Ada", age=36)


def test_agents_runner_plain_text(srv):
    assert _agent_run(srv, KEY, None, HELLO).final_output == "hello from the rlm"


def test_agents_wrong_key_is_an_authentication_error(srv):
    import openai

    with pytest.raises(openai.AuthenticationError):
        _agent_run(srv, "wrong-key", None, HELLO)


def test_agents_with_tools_gets_a_400_that_says_why(srv):
    agents = pytest.importorskip("agents")
    import openai

    @agents.function_tool
    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="recursa", openai_client=client)
    agent = agents.Agent(name="a", instructions=CONTEXT, model=model, tools=[lookup])
    with pytest.raises(openai.BadRequestError) as caught:
        asyncio.run(agents.Runner.run(agent, HELLO, run_config=agents.RunConfig(tracing_disabled=True)))
    assert "never hands a tool call back" in json.dumps(caught.value.body)


# -- typed answers from the offline roots (README: "A typed answer ... from any OpenAI client") -----

TASK = generate("niah", 20_000, seed=5)  # the needle: a number the root's code finds
NEEDLE = int(TASK.gold)


class Risk(BaseModel):
    title: str
    severity: int


@pytest.fixture(scope="module")
def scripted_srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    """The README's offline pair behind the server: a scripted root over the oracle sub-model."""
    settings = serve_settings(tmp_path_factory.mktemp("typed"), KEY, model="scripted/gpt5-like")
    with BackgroundServer(create_app(settings)) as server:
        yield server


def _task_messages() -> list[dict[str, str]]:
    return [{"role": "system", "content": TASK.context}, {"role": "user", "content": TASK.question}]


def test_openai_chat_completions_parse_from_a_scripted_root(scripted_srv):
    client = openai.OpenAI(base_url=scripted_srv.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.parse(model="recursa", response_format=Risk, messages=_task_messages())
    assert reply.choices[0].message.parsed == Risk(title=TASK.gold, severity=NEEDLE)
    assert reply.choices[0].finish_reason == "stop"


def test_openai_responses_parse_from_a_scripted_root(scripted_srv):
    client = openai.OpenAI(base_url=scripted_srv.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.responses.parse(
        model="recursa", instructions=TASK.context, input=TASK.question, text_format=Risk
    )
    assert reply.output_parsed == Risk(title=TASK.gold, severity=NEEDLE)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_typed_answer_from_a_scripted_root(scripted_srv, method):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        model="recursa", base_url=scripted_srv.url + "/v1", api_key=KEY, max_retries=0
    )
    structured = chat.with_structured_output(Risk, method=method)
    assert structured.invoke([("system", TASK.context), ("user", TASK.question)]) == Risk(
        title=TASK.gold, severity=NEEDLE
    )


def test_agents_output_type_from_a_scripted_root(scripted_srv):
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=scripted_srv.url + "/v1", api_key=KEY, max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="recursa", openai_client=client)
    agent = agents.Agent(name="finder", instructions=TASK.context, model=model, output_type=Risk)
    config = agents.RunConfig(tracing_disabled=True)
    result = asyncio.run(agents.Runner.run(agent, TASK.question, run_config=config))
    assert result.final_output == Risk(title=TASK.gold, severity=NEEDLE)
