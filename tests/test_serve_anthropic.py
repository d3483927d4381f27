"""`recursa serve` as an Anthropic model: `POST /v1/messages` driven by the real `anthropic` SDK
(create, stream, errors, retries) and by LiteLLM's `anthropic/` provider, and raw hostile bodies,
each answered in Anthropic's error shape."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("anthropic")
import anthropic
import httpx

from recursa.asgi.background import BackgroundServer
from recursa.serve import chat
from recursa.serve.fields import AnswerShape
from recursa.serve.openai_server import create_app
from recursa.trace import load
from tests.serve_helpers import (
    CONTEXT,
    FOREVER,
    HELLO,
    descendants,
    install_test_root,
    serve_settings,
    wait_until,
)

KEY = "anthropic-test-key-0123456789"
ROOT = install_test_root()
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[BackgroundServer]:
    settings = serve_settings(tmp_path_factory.mktemp("anthropic"), KEY, max_context_bytes=200_000)
    with BackgroundServer(create_app(settings)) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv) -> Any:
    # The SDK's base URL is the server's root: it adds /v1/messages itself.
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _post(srv: BackgroundServer, body: Any, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {
        "x-api-key": KEY,
        "anthropic-version": "2023-06-01",
        "content-type": "application/json",
        **headers,
    }
    return httpx.post(srv.url + path, content=raw, headers=sent, timeout=60)


def _is_anthropic_error(response: httpx.Response) -> bool:
    body = response.json()
    error = body.get("error") or {}
    return (
        body.get("type") == "error"
        and error.get("type") == ERROR_TYPES.get(response.status_code)
        and isinstance(error.get("message"), str)
        and body.get("request_id") == response.headers["request-id"] == response.headers["x-request-id"]
        and "Traceback" not in response.text
    )


# -- the anthropic SDK ------------------------------------------------------------------------------


def test_create_with_a_system_prompt_and_a_context(client):
    raw = client.messages.with_raw_response.create(
        model="recursa", max_tokens=1000, system=CONTEXT, messages=_user("what does it say?")
    )
    message = raw.parse()
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert raw.request_id is not None and raw.request_id.startswith("req_")
    described = json.loads(message.content[0].text)
    # The system prompt is the context the RLM reads; the last user turn is the question.
    assert described["question"] == "what does it say?" and described["head"] == CONTEXT
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert message.model_extra["recursa"]["stop_reason"] == "final"

    # recursa's own options ride in extra_body, as with the openai SDK.
    pieces = client.messages.create(
        model="recursa",
        max_tokens=1000,
        system=[{"type": "text", "text": "be brief"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is there?"}]}],
        extra_body={"recursa": {"context": ["first piece", "second piece"]}},
    )
    described = json.loads(pieces.content[0].text)
    assert described["type"] == "list" and described["len"] == 2 and described["head"] == "first piece"


def test_stream_text_and_final_message(client):
    with client.messages.stream(
        model="recursa", max_tokens=1000, system=CONTEXT, messages=_user(HELLO)
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "hello from the rlm" == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0 and final.usage.input_tokens > 0


def test_stream_sends_the_messages_event_sequence(client):
    events = list(
        client.messages.create(
            model="recursa", max_tokens=1000, system=CONTEXT, messages=_user(HELLO), stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens > 0


def test_thinking_carries_the_runs_steps(client):
    asked = {"model": "recursa", "max_tokens": 1000, "system": CONTEXT, "messages": _user(HELLO)}
    with client.messages.stream(**asked, thinking={"type": "enabled", "budget_tokens": 2000}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert "FINAL('hello from the rlm')" in final.content[0].thinking  # the code the run ran
    whole = client.messages.create(**asked, thinking={"type": "adaptive"})
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.content[
        1
    ].text == "hello from the rlm"
    # The client replays the answer, thinking block and all, in its next request.
    history = [*_user("first"), {"role": "assistant", "content": [b.model_dump() for b in whole.content]}]
    again = client.messages.create(**{**asked, "messages": [*history, *_user(HELLO)]})
    assert again.content[0].text == "hello from the rlm"


def test_a_session_keeps_the_repl_between_messages(client):
    first = client.messages.with_raw_response.create(
        model="recursa",
        max_tokens=100,
        system=CONTEXT,
        messages=_user("RUN: kept = 'from the first question'\nFINAL('kept')"),
        extra_body={"recursa": {"session": "new"}},
    )
    session = first.parse().model_extra["recursa"]["session"]
    assert first.headers["x-recursa-session"] == session
    again = client.messages.create(
        model="recursa",
        max_tokens=100,
        messages=_user("RUN: FINAL(kept)"),
        extra_body={"recursa": {"session": session}},
    )
    assert again.content[0].text == "from the first question"


def test_sampling_fields_reach_the_root_models_calls(srv, client):
    message = client.messages.create(
        model="recursa",
        max_tokens=100,
        system=CONTEXT,
        messages=_user(HELLO),
        extra_body={"temperature": 0.2, "top_p": 0.8, "top_k": 5, "output_config": {"effort": "low"}},
    )
    trace = srv.app.state.service.settings.run["trace_dir"] / message.model_extra["recursa"]["trace"]
    roots = [e for e in load(trace).events if e["type"] == "lm_call" and e["purpose"] == "root"]
    want = {"temperature": 0.2, "top_p": 0.8, "top_k": 5, "reasoning_effort": "low"}
    assert roots and all(e.get("sampling") == want for e in roots)


def test_max_tokens_and_stop_sequences_cut_the_answer(client):
    long = client.messages.create(
        model="recursa", max_tokens=5, system=CONTEXT, messages=_user("RUN: FINAL('x' * 100)")
    )
    assert long.stop_reason == "max_tokens" and long.content[0].text == "x" * 20  # about 4 characters a token
    stopped = client.messages.create(
        model="recursa",
        max_tokens=100,
        system=CONTEXT,
        messages=_user(HELLO),
        stop_sequences=["zzz", "m the"],
    )
    assert stopped.content[0].text == "hello fro"
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "m the"


@pytest.mark.parametrize(
    ("stops", "answer", "expected"),
    [
        (("bcd", "c"), "abcd", ("ab", "c")),  # "c" is complete first, though "bcd" starts earlier
        (("zz", "b"), "abcb", ("a", "b")),
        (("zz",), "abc", ("abc", None)),
    ],
)
def test_the_stop_sequence_completed_first_ends_the_answer(stops, answer, expected):
    shape = AnswerShape(stop=stops)
    found = shape.first_stop(answer)
    assert (shape.cut(answer)[0], found[1] if found else None) == expected


def test_output_config_format_makes_the_answer_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    message = client.messages.create(
        model="recursa",
        max_tokens=1000,
        system=CONTEXT,
        messages=_user('RUN: person = {"name": "Ada"}\nFINAL_VAR("person")'),
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert json.loads(message.content[0].text) == {"name": "Ada"}


# -- errors ---------------------------------------------------------------------------------------


def test_a_wrong_or_missing_key_is_an_authentication_error(srv):
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="wrong-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="recursa", max_tokens=10, messages=_user("q"))
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert "wrong-key" not in str(refused.value.body)
    missing = _post(srv, {"model": "recursa", "max_tokens": 10, "messages": _user("q")}, **{"x-api-key": ""})
    assert missing.status_code == 401 and _is_anthropic_error(missing) and "x-api-key" in missing.text
    # The key in x-api-key, as Anthropic's clients send it (the SDK sends a bearer one).
    answered = _post(
        srv, {"model": "recursa", "max_tokens": 100, "system": CONTEXT, "messages": _user(HELLO)}
    )
    assert answered.status_code == 200 and answered.json()["content"][0]["text"] == "hello from the rlm"
    assert answered.headers["request-id"].startswith("req_")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"temprature": 0.5}, "temprature"),
        ({"tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}, "tools"),
        (
            {"tool_choice": {"type": "tool", "name": "f"}, "tools": [{"name": "f"}]},
            r"tools\[0\]\.input_schema",
        ),
        ({"container": "c-1"}, "container"),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
        ({"metadata": {"user_id": 7}}, "metadata.user_id"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"recursa": {"max_depht": 2}}, "max_depht"),
    ],
)
def test_a_bad_field_is_a_bad_request_naming_it(client, extra, named):
    with pytest.raises(anthropic.BadRequestError, match=named) as refused:
        client.messages.create(model="recursa", max_tokens=10, messages=_user("q"), extra_body=extra)
    assert (
        refused.value.body["type"] == "error"
        and refused.value.body["error"]["type"] == "invalid_request_error"
    )


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (
            [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}],
            "document",
        ),
        (
            [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}],
            "server_tool_use",
        ),
    ],
)
def test_blocks_an_rlm_does_not_read_are_refused_saying_why(client, content, named):
    with pytest.raises(
        anthropic.BadRequestError, match=rf"messages\[0\]\.content\[0\]: {named} blocks"
    ) as refused:
        client.messages.create(
            model="recursa", max_tokens=10, messages=[{"role": "user", "content": content}]
        )
    assert "an RLM" in str(refused.value)


def test_turns_an_rlm_cannot_answer_are_refused(client):
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client.messages.create(
            model="recursa",
            max_tokens=10,
            messages=[*_user("q"), {"role": "assistant", "content": "The answer is"}],
        )
    with pytest.raises(anthropic.BadRequestError, match="send it as `system`"):
        client.messages.create(
            model="recursa", max_tokens=10, messages=[{"role": "system", "content": "x"}, *_user("q")]
        )
    with pytest.raises(anthropic.NotFoundError, match="does not exist on this server"):
        client.messages.create(model="claude-opus-4", max_tokens=10, messages=_user("q"))


def test_a_failed_run_is_not_run_again_by_the_sdks_own_retries(tmp_path):
    class Broken:
        model = "broken"

        async def complete(self, request: Any) -> Any:
            # What an upstream error may quote: the key it was given, a file on the host.
            raise RuntimeError(f"the upstream is down (key {KEY}, log /home/alice/upstream/err.log)")

    with BackgroundServer(
        create_app(serve_settings(tmp_path, KEY, model=Broken(), upstream_api_key=KEY))
    ) as server:
        service = server.app.state.service
        sdk = anthropic.Anthropic(base_url=server.url, api_key=KEY)  # the SDK's default: 2 retries
        with pytest.raises(anthropic.InternalServerError, match="the run failed") as failed:
            sdk.messages.create(model="recursa", max_tokens=10, system=CONTEXT, messages=_user("q"))
        assert failed.value.response.headers["x-should-retry"] == "false"
        assert failed.value.body["error"]["type"] == "api_error"
        assert service.served == 1  # one run: no retry ran it again
        # Streamed, the failure comes as an error event after message_start.
        with pytest.raises(anthropic.APIStatusError, match="the run failed") as streamed:
            with sdk.messages.stream(
                model="recursa", max_tokens=10, system=CONTEXT, messages=_user("q")
            ) as s:
                s.get_final_message()
        assert streamed.value.body["error"]["type"] == "api_error"
        for error in (failed.value, streamed.value):
            said = json.dumps(error.body)
            assert "the upstream is down" in said and KEY not in said and "alice" not in said, said
        wait_until(lambda: service.served == 2, what="the streamed run to be counted")  # ends after the event


def test_models_list_and_retrieve_read_the_served_names(client):
    assert [m.id for m in client.models.list()] == ["recursa", ROOT]
    card = client.models.retrieve("recursa")
    assert card.id == "recursa" and card.type == "model" and card.display_name == "recursa"


def test_count_tokens_is_a_404_that_says_why(client):
    with pytest.raises(anthropic.NotFoundError, match="does not count tokens") as refused:
        client.messages.count_tokens(model="recursa", messages=_user("q"))
    assert refused.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"\xff\xfe{not utf-8", 400),
        (b"[" * 50_000 + b"]" * 50_000, 400),  # nested past the parser's stack
        (b'{"model": "recursa", "max_tokens": 10, "messages": "' + b"x" * 300_000 + b'"}', 413),
        (b"[1, 2, 3]", 400),
        (b"null", 400),
        (b'{"model": 7, "max_tokens": 10, "messages": []}', 400),
        (b'{"model": "recursa", "messages": [{"role": "user", "content": "q"}]}', 400),  # no max_tokens
        (b'{"model": "recursa", "max_tokens": "10", "messages": [{"role": "user", "content": "q"}]}', 400),
        (b'{"model": "recursa", "max_tokens": 10, "messages": {"role": "user"}}', 400),
        (b'{"model": "recursa", "max_tokens": 10, "messages": [{"role": "user", "content": 7}]}', 400),
        (b'{"model": "recursa", "max_tokens": 10, "messages": [["user", "q"]]}', 400),
        (
            b'{"model": "recursa", "max_tokens": 10, "system": {"a": 1}, "messages": [{"role": "user", "content": "q"}]}',
            400,
        ),
        (
            b'{"model": "recursa", "max_tokens": 10, "stream": "yes", "messages": [{"role": "user", "content": "q"}]}',
            400,
        ),
        (b'{"model": "recursa", "max_tokens": 1e309, "messages": [{"role": "user", "content": "q"}]}', 400),
    ],
)
def test_hostile_bodies_get_a_4xx_in_anthropics_shape(srv, body, status):
    answered = _post(srv, body)
    assert answered.status_code == status, answered.text
    assert _is_anthropic_error(answered), answered.text


def test_other_paths_and_methods_under_messages_answer_in_anthropics_shape(srv):
    batches = _post(srv, {"requests": []}, "/v1/messages/batches")
    assert batches.status_code == 404 and _is_anthropic_error(batches) and "batches" in batches.text
    got = httpx.get(srv.url + "/v1/messages", headers={"x-api-key": KEY})
    assert got.status_code == 405 and _is_anthropic_error(got)
    gzipped = _post(srv, b"\x1f\x8b", **{"content-encoding": "gzip"})
    assert gzipped.status_code == 415 and _is_anthropic_error(gzipped)
    # An SDK pointed at .../v1 asks for /v1/v1/messages: the 404 gives the base URL to use.
    doubled = anthropic.Anthropic(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="base URL is this server's root"):
        doubled.messages.create(model="recursa", max_tokens=10, messages=_user("q"))


# -- keep-alives, the access log and metrics --------------------------------------------------------


def test_a_stream_waiting_for_a_run_slot_gets_pings_and_a_full_server_a_429(tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "HEARTBEAT_S", 0.05)
    baseline = descendants(os.getpid())
    body = {
        "model": "recursa",
        "max_tokens": 10,
        "stream": True,
        "system": CONTEXT,
        "messages": _user(FOREVER),
    }
    with (
        BackgroundServer(create_app(serve_settings(tmp_path, KEY, max_runs=1, max_waiting=1))) as server,
        httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=20) as http,
    ):
        service = server.app.state.service
        with http.stream("POST", "/v1/messages", json=body) as holder:
            assert holder.status_code == 200
            wait_until(lambda: len(service.active) == 1, what="the first run to hold the only slot")
            with http.stream("POST", "/v1/messages", json=body) as queued:
                lines = queued.iter_lines()
                assert next(lines) == "event: message_start"
                seen: list[str] = []
                while "event: ping" not in seen:
                    seen.append(next(lines))  # without pings: a read timeout
                assert len(service.active) == 1  # still waiting: the slot is the first run's
                # One running and one waiting is this server's limit: a third is turned away at once.
                sdk = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
                with pytest.raises(anthropic.RateLimitError, match="server is busy") as busy:
                    sdk.messages.create(model="recursa", max_tokens=10, messages=_user("q"))
                assert busy.value.body["error"]["type"] == "rate_limit_error"
                assert busy.value.body["request_id"] == busy.value.request_id
        wait_until(lambda: not service.active, what="every run to be cancelled")
        wait_until(lambda: not (descendants(os.getpid()) - baseline), what="the sandboxes to be reaped")


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "recursa.serve.access"]


def test_messages_requests_are_logged_and_counted(srv, client, caplog):
    with caplog.at_level(logging.INFO, logger="recursa.serve.access"):
        client.messages.create(model="recursa", max_tokens=100, system=CONTEXT, messages=_user(HELLO))
        with pytest.raises(anthropic.NotFoundError):
            client.messages.count_tokens(model="recursa", messages=_user("q"))
        # A line is written once the last byte is sent, which the client may see first.
        wait_until(lambda: len(_access_lines(caplog)) >= 2, what="both requests' access log lines")
    lines = _access_lines(caplog)
    assert any(line.startswith("POST /v1/messages 200 ") and " run=run_" in line for line in lines), lines
    assert any(line.startswith("POST /v1/messages/count_tokens 404 ") for line in lines), lines
    assert not any(KEY in line or CONTEXT in line for line in lines)
    metrics = httpx.get(srv.url + "/metrics", headers={"x-api-key": KEY}).text
    assert 'recursa_http_requests_total{method="POST",path="/v1/messages",status="200"}' in metrics
    assert 'path="/v1/messages/count_tokens",status="404"' in metrics


# -- LiteLLM ----------------------------------------------------------------------------------------


def test_litellm_anthropic_provider_with_api_base(srv):
    litellm = pytest.importorskip("litellm")
    asked = {
        "model": "anthropic/recursa",
        "api_base": srv.url,
        "api_key": KEY,
        "num_retries": 0,
        "max_tokens": 100,
        "messages": [{"role": "system", "content": CONTEXT}, *_user(HELLO)],
    }
    answer = litellm.completion(**asked)
    assert answer.choices[0].message.content == "hello from the rlm"
    assert answer.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**asked, stream=True))
    assert streamed == "hello from the rlm"
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(**{**asked, "api_key": "wrong-key"})
