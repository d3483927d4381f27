"""`recursa serve`'s access log (a line per request, never a key or a context) and Prometheus
`/metrics` (requests, runs in flight, run latency, tokens, cost), both on by default and switchable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
import httpx
from prometheus_client.parser import text_string_to_metric_families

from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from tests.serve_helpers import install_test_root, wait_until

KEY = "observe-test-key-0123456789"
ROOT = install_test_root()
SECRET_CONTEXT = "the-context-must-not-be-logged-7731"


def _settings(tmp: Path, **kw) -> ServeSettings:
    return ServeSettings(model=ROOT, sub_model="scripted/oracle", trace_dir=tmp / "traces", api_key=KEY, **kw)


def _ask(srv: BackgroundServer, question: str = "RUN: FINAL('ok')", **extra) -> httpx.Response:
    body = {
        "model": "recursa",
        "messages": [{"role": "system", "content": SECRET_CONTEXT}, {"role": "user", "content": question}],
        **extra,
    }
    return httpx.post(
        srv.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_access_log_has_a_line_per_request_without_key_or_context(tmp_path, access_lines):
    with BackgroundServer(create_app(_settings(tmp_path))) as srv:
        ok = _ask(srv)
        streamed = _ask(srv, stream=True)
        refused = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong-key"})
        missing = httpx.get(srv.url + "/v1/nothing?token=abc")
    assert ok.status_code == 200 and streamed.status_code == 200
    assert refused.status_code == 401 and missing.status_code == 404
    # A line is written once the last byte is sent, which may be after the client already has the
    # answer and moved on: the order between requests is not fixed.
    lines = sorted(access_lines)
    assert len(lines) == 4, lines
    run_id = ok.json()["recursa"]["run_id"]
    posts = [line for line in lines if line.startswith("POST /v1/chat/completions 200 ")]
    assert len(posts) == 2 and any(line.endswith(f"run={run_id}") for line in posts)
    assert all(" run=run_" in line for line in posts)
    assert [line for line in lines if line.startswith("GET /v1/models 401 ") and "run=" not in line]
    assert [line for line in lines if line.startswith("GET /v1/nothing 404 ")]  # the path without its query
    for line in lines:
        assert KEY not in line and "wrong-key" not in line and SECRET_CONTEXT not in line
        assert "token=abc" not in line
    # Each answer's x-request-id (errors too) is in its own line, so a client's report finds it.
    ids = [r.headers.get("x-request-id") for r in (ok, streamed, refused, missing)]
    assert all(i and re.fullmatch(r"req_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 4, ids
    assert sorted(line.split(" ")[4] for line in lines) == sorted(ids)


def test_access_log_can_be_turned_off(tmp_path, access_lines):
    with BackgroundServer(create_app(_settings(tmp_path, access_log=False))) as srv:
        assert _ask(srv).status_code == 200
    assert not access_lines


def test_metrics_count_requests_runs_tokens_and_cost(tmp_path):
    with BackgroundServer(create_app(_settings(tmp_path))) as srv:
        answers = [_ask(srv).json() for _ in range(2)]
        assert _ask(srv, temperature=9).status_code == 400
        assert httpx.get(srv.url + "/metrics").status_code == 401  # the key guards it
        scraped = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    samples = _samples(scraped.text)
    chat = "/v1/chat/completions"
    assert (
        samples[("recursa_http_requests_total", (("method", "POST"), ("path", chat), ("status", "200")))] == 2
    )
    assert (
        samples[("recursa_http_requests_total", (("method", "POST"), ("path", chat), ("status", "400")))] == 1
    )
    assert samples[("recursa_runs_total", (("stop_reason", "final"),))] == 2
    assert samples[("recursa_runs_in_flight", ())] == 0
    assert samples[("recursa_run_duration_seconds_count", ())] == 2
    input_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    assert samples[("recursa_tokens_total", (("kind", "input"),))] == input_tokens > 0
    assert ("recursa_cost_usd_total", ()) in samples


def test_runs_in_flight_counts_a_running_run_and_a_cancelled_one(tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": "recursa",
        "stream": True,
        "messages": [
            {"role": "system", "content": "ctx"},
            {"role": "user", "content": "RUN: import time\nwhile True: time.sleep(0.01)"},
        ],
    }
    with BackgroundServer(create_app(_settings(tmp_path))) as srv:
        service = srv.app.state.service
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)  # the role chunk: the run is on its way
            wait_until(lambda: bool(service.active), what="the run to start")
            running = _samples(httpx.get(srv.url + "/metrics", headers=auth).text)
        # Leaving the stream disconnects: the server cancels the run.
        wait_until(lambda: not service.active, what="the run to be cancelled")
        after = _samples(httpx.get(srv.url + "/metrics", headers=auth).text)
    assert running[("recursa_runs_in_flight", ())] == 1
    assert after[("recursa_runs_in_flight", ())] == 0
    assert after[("recursa_runs_total", (("stop_reason", "cancelled"),))] == 1


def test_metrics_can_be_turned_off(tmp_path):
    with BackgroundServer(create_app(_settings(tmp_path, metrics=False))) as srv:
        r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404


def test_legacy_completions_404_says_which_apis_to_use(tmp_path):
    with BackgroundServer(create_app(_settings(tmp_path))) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={}, headers={"Authorization": f"Bearer {KEY}"})
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and "/v1/chat/completions" in message and "/v1/responses" in message


def test_hostile_requests_bound_the_metrics_and_keep_the_log_one_line_each(tmp_path, access_lines):
    """Made-up methods (any token is one) must not each add a metrics series, and a body nested
    thousands deep is the client's error; a path or method with control characters stays on its line."""
    with BackgroundServer(create_app(_settings(tmp_path))) as srv:
        with httpx.Client() as client:
            for k in range(20):
                assert client.request(f"PROBE{k}", srv.url + "/health").status_code == 405
            deep = b"[" * 100_000 + b"]" * 100_000
            reply = client.post(
                srv.url + "/v1/chat/completions", content=deep, headers={"Authorization": f"Bearer {KEY}"}
            )
            assert reply.status_code == 400 and "too deeply" in reply.json()["error"]["message"]
            client.get(srv.url + "/v1/x%1b[31m%0aPOST /forged 200 0.001s")
            scraped = client.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    series = [key for key in _samples(scraped) if key[0] == "recursa_http_requests_total"]
    assert not any("PROBE" in value for _, labels in series for _, value in labels), series
    assert (
        _samples(scraped)[
            ("recursa_http_requests_total", (("method", "other"), ("path", "/health"), ("status", "405")))
        ]
        == 20
    )
    assert not any(line.startswith("POST /forged") or "\n" in line or "\x1b" in line for line in access_lines)


def test_the_access_log_never_holds_a_session_id(tmp_path, access_lines):
    """Under a shared key a session id is the only thing guarding the session."""
    with BackgroundServer(create_app(_settings(tmp_path))) as srv:
        opened = _ask(srv, recursa={"session": "new"})
        session = opened.headers["x-recursa-session"]
        closed = httpx.delete(
            f"{srv.url}/v1/recursa/sessions/{session}", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert closed.status_code == 200
        wait_until(lambda: any(line.startswith("DELETE") for line in access_lines), what="the log line")
    assert session and not any(session in line for line in access_lines), access_lines
    assert "DELETE /v1/recursa/sessions/{id} 200" in "\n".join(access_lines)


def test_requests_past_the_run_slots_and_the_queue_get_429_at_once(tmp_path):
    """max_runs=1, max_waiting=1: one run, one request waiting for its slot, and a third request
    is refused before its body is read; once they end, the server takes requests again."""
    auth = {"Authorization": f"Bearer {KEY}"}
    forever = {
        "model": "recursa",
        "stream": True,
        "messages": [
            {"role": "system", "content": "ctx"},
            {"role": "user", "content": "RUN: import time\nwhile True: time.sleep(0.01)"},
        ],
    }
    with BackgroundServer(create_app(_settings(tmp_path, max_runs=1, max_waiting=1))) as srv:
        service = srv.app.state.service
        with (
            httpx.stream(
                "POST", srv.url + "/v1/chat/completions", json=forever, headers=auth, timeout=60
            ) as a,
            httpx.stream(
                "POST", srv.url + "/v1/chat/completions", json=forever, headers=auth, timeout=60
            ) as b,
        ):
            kept = [a.iter_lines(), b.iter_lines()]  # kept: a dropped iterator would close the stream
            next(kept[0])
            wait_until(lambda: bool(service.active), what="the first run to start")
            refused = _ask(srv)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "server_busy"
            assert refused.headers["retry-after"] == "1"
            assert len(service.active) == 1  # the second still waits for the slot
        wait_until(lambda: not service.active, what="the runs to be cancelled")
        assert _ask(srv).status_code == 200


def test_a_request_head_that_never_ends_is_cut_off(tmp_path):
    """Slow-loris: a client sends part of a request head (no key needed) and never the rest, on a
    fresh connection or after a first request on a kept-alive one. uvicorn never closed either;
    the head timer does, and other clients are served meanwhile."""
    import socket

    def closed_by_server(conn: socket.socket) -> bool:
        try:
            return conn.recv(65536) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    with BackgroundServer(create_app(_settings(tmp_path)), head_timeout_s=0.5) as srv:
        fresh = socket.create_connection((srv.host, srv.port))
        fresh.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        kept = socket.create_connection((srv.host, srv.port))
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        kept.settimeout(5)
        assert b"200 OK" in kept.recv(65536)
        kept.sendall(b"GET /health HTTP/1.1\r\n")  # the next head, never finished
        for conn in (fresh, kept):
            conn.settimeout(0.05)
            wait_until(lambda conn=conn: closed_by_server(conn), timeout_s=20, what="the slow head cut off")
            conn.close()
        assert httpx.get(srv.url + "/health").status_code == 200
