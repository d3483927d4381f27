"""`recursa serve` as outside testers drive it with real clients (openai, litellm, anthropic, dspy),
where they found it differing from the model server those clients expect: what the SDKs' own
retries do to a failed run, a streamed request that waits for a run slot behind a proxy, request
ids, a base URL without `/v1` or pointed at an API not served, fields that ask for nothing,
stored-completion calls, an answer that never fit the schema, answers holding surrogates."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
import httpx
import openai
from pydantic import BaseModel

from recursa.asgi.background import BackgroundServer
from recursa.scripted import policy_names, register
from recursa.scripted.conversation import is_rlm_conversation
from recursa.serve import chat
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from tests.serve_helpers import descendants, install_test_root, wait_until

KEY = "dropin-test-key-0123456789"
ROOT = install_test_root()
HELLO = [{"role": "system", "content": "ctx"}, {"role": "user", "content": "RUN: FINAL('hello')"}]
SLEEPER = [
    {"role": "system", "content": "ctx"},
    {"role": "user", "content": "RUN: import time\ntime.sleep(60)"},
]


def _settings(tmp_path, **overrides: Any) -> ServeSettings:
    values: dict[str, Any] = {
        "model": ROOT,
        "sub_model": "scripted/oracle",
        "trace_dir": tmp_path / "traces",
        "api_key": KEY,
    }
    return ServeSettings(**{**values, **overrides})


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(_settings(tmp_path_factory.mktemp("dropin")))) as server:
        yield server


class Person(BaseModel):
    name: str


class _Counting(httpx.Client):
    """An httpx client for the SDK that counts the requests it sends (retries included)."""

    def __init__(self) -> None:
        super().__init__(event_hooks={"request": [self._count]})
        self.sent = 0

    def _count(self, _: httpx.Request) -> None:
        self.sent += 1


class _Broken:
    """A root model whose every call fails: the run fails after recursa's own retries."""

    model = "broken"

    async def complete(self, request: Any) -> Any:
        raise RuntimeError("the upstream is down")


# -- the SDKs' retries ----------------------------------------------------------------------------


def test_a_failed_run_is_not_run_again_by_the_sdks_own_retries(tmp_path):
    # The openai SDK (and LangChain and the Agents SDK through it) retries a 5xx twice by default:
    # each retry was a whole new run, with its own model calls, after the run had retried them.
    with BackgroundServer(create_app(_settings(tmp_path, model=_Broken()))) as server, _Counting() as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, http_client=http)  # retries on
        with pytest.raises(openai.InternalServerError, match="the run failed") as failed:
            client.chat.completions.create(model="recursa", messages=HELLO)
        assert failed.value.response.headers["x-should-retry"] == "false"
        with pytest.raises(openai.InternalServerError, match="the run failed"):
            client.responses.create(model="recursa", instructions="ctx", input="q")
        assert http.sent == 2
        assert server.app.state.service.served == 2  # one run each


def test_a_full_session_cap_is_not_retried_in_vain(tmp_path):
    with BackgroundServer(create_app(_settings(tmp_path, max_sessions=1))) as server, _Counting() as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, http_client=http)
        client.chat.completions.create(
            model="recursa", messages=HELLO, extra_body={"recursa": {"session": "new"}}
        )
        with pytest.raises(openai.RateLimitError, match="open sessions") as full:
            client.chat.completions.create(
                model="recursa", messages=HELLO, extra_body={"recursa": {"session": "new"}}
            )
        assert full.value.response.headers["x-should-retry"] == "false"
        assert http.sent == 2


# -- streams wait with keep-alives ----------------------------------------------------------------


def test_a_stream_waiting_for_a_run_slot_gets_keep_alives(tmp_path, monkeypatch):
    # A proxy closes a stream that sends nothing for a minute or so; the wait for a slot can be longer.
    monkeypatch.setattr(chat, "HEARTBEAT_S", 0.05)
    baseline = descendants(os.getpid())
    with (
        BackgroundServer(create_app(_settings(tmp_path, max_runs=1))) as server,
        httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=20) as http,
    ):
        service = server.app.state.service
        body = {"model": "recursa", "stream": True, "messages": SLEEPER}
        with http.stream("POST", "/v1/chat/completions", json=body) as holder:
            assert holder.status_code == 200
            wait_until(lambda: len(service.active) == 1, what="the first run to hold the only slot")
            for path, waiting in (
                ("/v1/chat/completions", body),
                ("/v1/responses", {"model": "recursa", "stream": True, "input": SLEEPER}),
            ):
                with http.stream("POST", path, json=waiting) as queued:
                    lines = queued.iter_lines()
                    seen = []
                    while not any(line.startswith(": keep-alive") for line in seen):
                        seen.append(next(lines))  # without keep-alives: a read timeout
                    assert len(service.active) == 1  # still waiting: the slot is the first run's
                    assert not any('"delta": {"reasoning_content"' in line for line in seen)
        wait_until(lambda: not service.active, what="every run to be cancelled")
        wait_until(lambda: not (descendants(os.getpid()) - baseline), what="the sandboxes to be reaped")


# -- request ids ----------------------------------------------------------------------------------


def test_answers_and_errors_carry_a_request_id_the_sdk_exposes(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="recursa", messages=HELLO)
    assert raw.parse().choices[0].message.content == "hello"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="recursa", messages=HELLO, n=2)
    with client.chat.completions.with_streaming_response.create(
        model="recursa", messages=HELLO, stream=True
    ) as streamed:
        ids = [raw.request_id, refused.value.request_id, streamed.request_id]
    assert all(i is not None and i.startswith("req_") for i in ids) and len(set(ids)) == 3, ids


# -- clients pointed at the wrong place -----------------------------------------------------------


def test_a_base_url_without_v1_gets_a_404_that_says_to_add_it(srv):
    client = openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match=r"/v1") as missing:
        client.chat.completions.create(model="recursa", messages=HELLO)
    assert f"{srv.url}/v1" in str(missing.value)
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.NotFoundError, match=r"/v1"):
        litellm.completion(model="openai/recursa", api_base=srv.url, api_key=KEY, messages=HELLO)


def test_a_client_of_a_legacy_api_is_told_which_apis_are_served(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="Chat Completions API") as missing:
        client.completions.create(model="recursa", prompt="q")
    assert "Messages API (POST /v1/messages)" in str(missing.value)


# -- values that ask for nothing ------------------------------------------------------------------


def test_fields_that_ask_for_nothing_are_accepted_as_absent(srv):
    # Clients fill fields in with their empty values; the Responses endpoint took these already.
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    for fields in (
        {"tools": []},
        {"tool_choice": "auto"},
        {"tools": [], "tool_choice": "auto"},
        {"top_logprobs": 0},
        {"function_call": "none", "functions": []},
    ):
        r = client.chat.completions.create(model="recursa", messages=HELLO, **fields)
        assert r.choices[0].message.content == "hello" and not r.choices[0].message.tool_calls, fields
    r = client.responses.create(
        model="recursa", instructions="ctx", input="RUN: FINAL('hello')", top_logprobs=0
    )
    assert r.output_text == "hello"


def test_an_assistant_refusal_part_in_the_history_is_read_as_its_text(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    messages: list[Any] = [
        {"role": "user", "content": "the document"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I will not summarise it"}]},
        {"role": "user", "content": "describe"},
    ]
    r = client.chat.completions.create(model="recursa", messages=messages)
    seen = json.loads(r.choices[0].message.content or "")
    assert seen["tail"].endswith("[assistant]\nI will not summarise it"), seen


# -- a typed answer the run could not give --------------------------------------------------------


def test_an_answer_that_never_fit_the_schema_is_cut_short_not_stop(srv):
    # Out of turns with answers that do not match: finish_reason "stop" made every SDK report that
    # the server sent invalid JSON; "length" is what they report as "a limit was reached".
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "system", "content": "ctx"}, {"role": "user", "content": "RUN: FINAL('not json')"}]
    once = {"recursa": {"max_iterations": 1}}
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        client.chat.completions.parse(
            model="recursa", messages=messages, response_format=Person, extra_body=once
        )
    assert "does not match answer_schema" in cut.value.completion.model_extra["recursa"]["error"]
    r = client.responses.create(
        model="recursa",
        input=messages,
        text={"format": {"type": "json_schema", "name": "Person", "schema": Person.model_json_schema()}},
        extra_body=once,
    )
    assert r.status == "incomplete" and r.incomplete_details is not None
    plain = client.chat.completions.create(model="recursa", messages=messages, extra_body=once)
    assert plain.choices[0].finish_reason == "stop"  # without a schema, the last answer is the answer


def test_stored_completion_and_conversation_endpoints_say_nothing_is_stored(srv):
    # `store: true` is accepted (and keeps nothing): the SDK calls that read stored completions back
    # get a 404 that says so, as the Responses API's do, not a bare 404 or 405.
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    calls = (
        lambda: client.chat.completions.list(),
        lambda: client.chat.completions.retrieve("chatcmpl-1"),
        lambda: client.chat.completions.update("chatcmpl-1", metadata={"k": "v"}),
        lambda: client.chat.completions.delete("chatcmpl-1"),
        lambda: client.chat.completions.messages.list("chatcmpl-1"),
    )
    for call in calls:
        with pytest.raises(openai.NotFoundError, match="stores no chat completions") as missing:
            call()
        assert missing.value.code == "completion_not_found"
    with pytest.raises(openai.NotFoundError, match="keeps no conversations"):
        client.conversations.create()


# -- answers holding surrogates -------------------------------------------------------------------

# A str in the REPL can hold surrogates (bytes decoded with surrogateescape, a string cut inside a
# UTF-16 pair); they have no UTF-8 form.
SURROGATES = [
    {"role": "system", "content": "ctx"},
    {"role": "user", "content": "RUN: FINAL('lone \\udc80 pair \\ud83d\\ude00 end')"},
]
CLEANED = "lone \ufffd pair \U0001f600 end"


def test_an_answer_holding_surrogates_reaches_every_client_as_valid_utf8(srv):
    # It was a 500 after the run had finished (which the SDKs retried: the run again, the same 500)
    # and a stream cut off before its end.
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="recursa", messages=SURROGATES)
    assert r.choices[0].message.content == CLEANED
    chunks = list(client.chat.completions.create(model="recursa", messages=SURROGATES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == CLEANED
    assert client.responses.create(model="recursa", input=SURROGATES).output_text == CLEANED
    events = list(client.responses.create(model="recursa", input=SURROGATES, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == CLEANED


def test_an_internal_error_is_not_retried_by_the_sdks(srv, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a fault of the server's")

    monkeypatch.setattr(chat, "completion_body", broken)
    with _Counting() as http:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, http_client=http)  # retries on
        with pytest.raises(openai.InternalServerError, match="internal server error") as failed:
            client.chat.completions.create(model="recursa", messages=HELLO)
    assert failed.value.response.headers["x-should-retry"] == "false" and http.sent == 1


# -- DSPy -----------------------------------------------------------------------------------------

DSPY_ROOT = "dropin-dspy"
# What a model answers in DSPy's chat format: each output field under its marker, then `completed`.
DSPY_REPLY = "[[ ## reasoning ## ]]\\ntwo and two\\n\\n[[ ## answer ## ]]\\n4\\n\\n[[ ## completed ## ]]"


def _dspy_policy(messages: list[Any]) -> str:
    if not is_rlm_conversation(messages):
        return "sub-answer"
    return f'Answering in the format asked for.\n```repl\nFINAL("{DSPY_REPLY}")\n```'


def test_dspy_predict_and_chain_of_thought_through_the_server(tmp_path):
    dspy = pytest.importorskip("dspy")
    if DSPY_ROOT not in policy_names():
        register(DSPY_ROOT)(lambda: _dspy_policy)
    settings = _settings(tmp_path, model=f"scripted/{DSPY_ROOT}")
    with BackgroundServer(create_app(settings)) as server:
        # num_retries=0: LiteLLM, under dspy.LM, retries every error itself (3 times by default),
        # whatever the server says; a failed run would run four times (docs/clients.md).
        lm = dspy.LM("openai/recursa", api_base=server.url + "/v1", api_key=KEY, cache=False, num_retries=0)
        with dspy.context(lm=lm):
            assert dspy.Predict("question -> answer")(question="What is 2 + 2?").answer == "4"
            thought = dspy.ChainOfThought("question -> answer")(question="What is 2 + 2?")
        assert thought.answer == "4" and thought.reasoning == "two and two"
        assert server.app.state.service.served == 2


def test_dspy_predict_and_chain_of_thought_over_a_scripted_root(tmp_path):
    """DSPy's chat adapter asks for fields between markers; the root answers in them, so no
    AdapterParseError and no fallback to the JSON adapter (the last reply is the marked form)."""
    dspy = pytest.importorskip("dspy")
    with BackgroundServer(create_app(_settings(tmp_path, model="scripted/gpt5-like"))) as server:
        lm = dspy.LM("openai/recursa", api_base=server.url + "/v1", api_key=KEY, cache=False, num_retries=0)
        with dspy.context(lm=lm):
            predicted = dspy.Predict("question -> answer")(question="What is the secret number?")
            thought = dspy.ChainOfThought("question -> answer")(question="What is the secret number?")
    assert predicted.answer.strip() and thought.answer.strip() and thought.reasoning.strip()
    last = lm.history[-1]["outputs"][0]
    assert last.startswith("[[ ## reasoning ## ]]") and last.endswith("[[ ## completed ## ]]")


def test_a_compressed_body_is_refused_naming_the_header_and_a_byte_order_mark_is_read(srv):
    body = json.dumps({"model": "recursa", "messages": HELLO}).encode()
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    url = srv.url + "/v1/chat/completions"
    zipped = httpx.post(url, content=gzip.compress(body), headers={**headers, "content-encoding": "gzip"})
    assert zipped.status_code == 415, zipped.text  # it was a 400 "the request body is not valid JSON"
    assert "Content-Encoding 'gzip'" in zipped.json()["error"]["message"]
    marked = httpx.post(url, content=b"\xef\xbb\xbf" + body, headers=headers, timeout=60)
    assert marked.status_code == 200 and marked.json()["choices"][0]["message"]["content"] == "hello"
