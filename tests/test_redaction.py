"""No key crosses from the host into the sandbox, a trace, a log or a server's error body
(recursa/trace/redact.py, the one scrubber, applied where a host message is made).

A host tool or a model provider that fails may say more than it should: an SDK error that quotes
the request's Authorization header, a URL with ?key=..., another service's token. What the REPL's
code, the root model, the trace file and a `recursa serve` client see is scrubbed of the run's
configured key, bearer tokens, `sk-...` keys and key-like query parameters.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from recursa import RLM, host_tool
from recursa.config import Spelling
from recursa.errors import LMError
from recursa.lm.retry import gave_up
from recursa.testing.fake_state import Fault, FaultRule, FaultSchedule
from recursa.trace.redact import REDACTED, Redactor
from tests.test_escapes import feedback_before
from tests.test_rlm_openai import SUB, code

KEY = "opkey-7f3a9c2e5b1d4086aa"  # the run's configured key: no well-known shape, found by value
BEARER = "zz-other-service-token-5150"  # another service's token in a header the tool echoes
QUERY = "AQ.qk-4471-2b9e-secret"  # a key in a URL's query string
SHAPED = "sk-proj-Zq81mNv02Lx93Kd74Hs65Jt"  # a provider key the run was never told about
# Secrets under names nobody listed, and bare random tokens: found by shape, whatever they are called.
ASSIGNED = "hunter2-q9x"  # db_pass=..., a password of no known key's shape
SIGNED = "a1b2c3d4e5f60718293a"  # a presigned URL's signature
WEBHOOK = "aB3dE5fG7hI9jK1lM3nO5pQ7"  # a Slack webhook's secret (a signed path's segment)
RANDOM = "Qm7Yt2Lp9Xc4Vb8Nw3Zr6Ks1Hd5Gf0Ja"  # a 34-character token, not labelled at all
LEAKS = (KEY, BEARER, QUERY, SHAPED, ASSIGNED, SIGNED, RANDOM)


def leaky_message() -> str:
    return (
        f"401 Unauthorized from https://api.example.com/v1/search?q=x&key={QUERY} with request headers "
        f"{{'Authorization': 'Bearer {KEY}', 'X-Other': 'Bearer {BEARER}'}}; fallback key {SHAPED}; "
        f"settings: db_pass={ASSIGNED}; mirror https://files.example.com/a.txt?X-Amz-Signature={SIGNED}; "
        f"session {RANDOM} refused"
    )


@host_tool
def search(query: str) -> str:
    """Looks something up on a service that fails."""
    raise RuntimeError(leaky_message())


def assert_clean(text: str, where: str) -> None:
    found = [leak for leak in LEAKS if leak in text]
    assert not found, f"{where} holds {found}: {text[:2000]}"


def make_rlm(server, tmp_path, **kw) -> RLM:
    kw.setdefault("sub_model", SUB)
    return RLM("openai/root-model", base_url=server.base_url, api_key=KEY, trace_dir=tmp_path, **kw)


def test_a_failing_host_tool_says_nothing_of_keys(server, script, tmp_path):
    script.root(
        "root-model",
        code(
            "try:\n    search('x')\nexcept Exception as e:\n    print('caught', type(e).__name__, e)\n    said = str(e)"
        ),
        code("FINAL(said)"),
    )
    result = make_rlm(server, tmp_path, tools=[search]).run("q", "ctx")
    told = feedback_before(server, 2)
    assert "caught ToolError" in told and "401 Unauthorized" in told and REDACTED in told, told
    assert_clean(told, "the REPL output shown to the root")
    assert result.stop_reason == "final" and REDACTED in result.answer
    assert_clean(result.answer, "the answer (a REPL variable)")
    trace = result.trace_path.read_text()
    assert '"tool_call"' in trace and REDACTED in trace
    assert_clean(trace, "the trace file")


def test_a_failing_sub_model_call_says_nothing_of_keys(server, script, tmp_path):
    script.root(
        "root-model",
        code("try:\n    llm_query('hi')\nexcept Exception as e:\n    print('caught', type(e).__name__, e)"),
        code("FINAL('done')"),
    )
    script.sub("sub-model", lambda prompt: "unused")
    server.faults = FaultSchedule(
        FaultRule(Fault(400, message=leaky_message()), model="sub-model", times=None)
    )
    try:
        result = make_rlm(server, tmp_path, max_retries=0).run("q", "ctx")
    finally:
        server.faults = None
    told = feedback_before(server, 2)
    assert "caught SubcallError" in told and REDACTED in told, told
    assert_clean(told, "the REPL output shown to the root")
    trace = result.trace_path.read_text()
    assert '"error"' in trace
    assert_clean(trace, "the trace file")


def test_a_sub_model_that_echoes_the_key_does_not_hand_it_to_the_repl(server, script, tmp_path):
    # A server that repeats the request's headers in its reply (a debugging proxy, a gateway's
    # error text as content) gave the run's key to the REPL's code through llm_query's return value.
    script.root("root-model", code("x = llm_query('hi')\nprint('KEY' if x.count('-') > 3 else 'none', x)"),
                code("FINAL('done')"))  # fmt: skip
    script.sub("sub-model", lambda prompt: f"echo: Authorization: Bearer {KEY}")
    make_rlm(server, tmp_path).run("q", "ctx")
    told = feedback_before(server, 2)
    assert f"echo: Authorization: Bearer {REDACTED}" in told, told
    assert_clean(told, "what llm_query returned")


@pytest.mark.parametrize("stream", [False, True])
def test_a_served_run_that_fails_says_nothing_of_keys(server, script, tmp_path, stream, caplog):
    pytest.importorskip("fastapi")
    from recursa.asgi.background import BackgroundServer
    from recursa.serve.openai_server import create_app
    from recursa.serve.settings import ServeSettings

    script.root("root-model", code("FINAL('never')"))
    server.faults = FaultSchedule(
        FaultRule(Fault(400, message=leaky_message()), model="root-model", times=None)
    )
    settings = ServeSettings(
        model="openai/root-model",
        sub_model=SUB,
        base_url=server.base_url,
        upstream_api_key=KEY,
        trace_dir=tmp_path,
        rlm_options={"max_retries": 0},
    )
    body = {"model": "recursa", "messages": [{"role": "user", "content": "q"}], "stream": stream}
    try:
        with caplog.at_level(logging.INFO), BackgroundServer(create_app(settings)) as srv:
            reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    finally:
        server.faults = None
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        message = next(e["error"]["message"] for e in events if "error" in e)
    else:
        assert reply.status_code == 502, reply.text
        message = reply.json()["error"]["message"]
    assert "the run failed" in message and REDACTED in message, message
    assert_clean(reply.text, "the error body")
    assert_clean(caplog.text, "the server's log")
    for trace in tmp_path.glob("*.jsonl"):
        assert_clean(trace.read_text(), "the trace file")


def test_the_scrubber_takes_every_form():
    scrub = Redactor([KEY])
    cases = {
        f"Authorization: Bearer {BEARER}": f"Authorization: Bearer {REDACTED}",
        f'{{"x-api-key": "{BEARER}"}}': f'{{"x-api-key": "{REDACTED}"}}',
        f"Authorization: Basic {BEARER}": f"Authorization: Basic {REDACTED}",
        f"GET /v1?alt=json&api_key={QUERY}&q=1": f"GET /v1?alt=json&api_key={REDACTED}&q=1",
        f"https://u:{BEARER}@host/x": f"https://u:{REDACTED}@host/x",
        f"key {SHAPED}.": f"key {REDACTED}.",
        f"configured {KEY}": f"configured {REDACTED}",
        f"PAYMENTS_SECRET = {ASSIGNED}": f"PAYMENTS_SECRET = {REDACTED}",
        f'{{"warehouse_password": "{ASSIGNED}"}}': f'{{"warehouse_password": "{REDACTED}"}}',
        f"DEPLOY_TOKEN: {ASSIGNED}": f"DEPLOY_TOKEN: {REDACTED}",
        f"https://h/x.bin?X-Goog-Signature={SIGNED}": f"https://h/x.bin?X-Goog-Signature={REDACTED}",
        f"https://h/dl/{RANDOM}/f.pdf": f"https://h/dl/{REDACTED}/f.pdf",
        f"token {RANDOM}.": f"token {REDACTED}.",
        # A webhook's secret is a signed path's last segment (24 characters), a password may come
        # without a user name, an AWS key id has a shape of its own, a cookie is a credential.
        f"posting to https://hooks.slack.com/services/T0ABCDE12/B0FGHIJ34/{WEBHOOK} failed": (
            f"posting to https://hooks.slack.com/services/T0ABCDE12/B0FGHIJ34/{REDACTED} failed"
        ),
        "redis://:s3cr3t-pw@cache:6379/0": f"redis://:{REDACTED}@cache:6379/0",
        "key id AKIAIOSFODNN7EXAMPLE denied": f"key id {REDACTED} denied",
        "Cookie: session=0123456789abcdef": f"Cookie: {REDACTED}",
    }
    for text, clean in cases.items():
        assert scrub(text) == clean
    # Code that builds a header or a URL from a variable reads the same afterwards.
    for code_line in (
        '{"Authorization": f"Bearer {token}"}',
        "url = f'{base}?key={key}'",
        "xsk-not-a-key-at-all",
        "max_tokens = 100000; monkey = bananas; key = key",
        "digest 3f786850e387550fdab836ed7e6dc881de23001b, run 123e4567-e89b-12d3-a456-426614174000",
        "see https://github.com/openai/openai-python/blob/main/src/openai/_base_client.py#L100",
    ):
        assert scrub(code_line) == code_line


def test_a_huge_message_loses_its_middle_and_every_key_it_held():
    # A cell's 10 MB exception was scrubbed whole by every pattern, on the event loop: half a
    # minute during which a served process answered nobody. Past 20,000 characters the middle goes,
    # after the known keys and the common key shapes are taken out of the whole text.
    scrub = Redactor([KEY])
    text = f"{KEY} " + "a_" * 2_000_000 + f" {SHAPED} " + "b_" * 2_000_000 + f" Bearer {BEARER}"
    out = scrub(text)
    assert len(out) < 20_100 and "characters left out" in out
    assert out.startswith(REDACTED) and out.endswith(f"Bearer {REDACTED}")
    assert KEY not in out and SHAPED not in out and BEARER not in out


@pytest.mark.parametrize("form", ["cli", "field"])
def test_a_scrubbed_error_keeps_no_key_in_the_message_a_door_renders(form):
    # Doors render an error's marked message (Spelling.told), not str(error): the scrub must reach it.
    key = "sk-proj-" + "q7" * 20
    error = LMError(f"«base_url=» answered 401 for the key {key}; check «api_key=»")
    Redactor([key]).exception(error)
    told = Spelling(form).told(error)
    assert key not in told and REDACTED in told
    assert key not in str(error)


def test_a_retried_calls_last_error_says_how_many_attempts_to_every_door():
    error = gave_up(LMError("«base_url=» is temporarily unavailable (HTTP 503)"), 3)
    assert str(error).endswith("(gave up after 3 attempts)")
    assert Spelling("cli").told(error).endswith("(gave up after 3 attempts)")
