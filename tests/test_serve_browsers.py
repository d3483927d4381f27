"""A server without keys on 127.0.0.1 serves the programs of its machine, not the web pages its
browser shows: a cross-site page's "simple" POST (no preflight) started runs on the operator's key,
and a page whose name was rebound to 127.0.0.1 read the answers too. Each test fails without the
guard (recursa.asgi.local_only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx

from recursa.addresses import is_loopback_name
from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from tests.serve_helpers import HELLO, serve_settings

_CHAT = json.dumps({"model": "recursa", "messages": [{"role": "user", "content": HELLO}]})


def _traces(root: Path) -> list[Path]:
    return list((root / "traces").rglob("*.jsonl")) if (root / "traces").exists() else []


def test_an_open_server_refuses_web_pages_and_rebound_names(tmp_path: Path) -> None:
    with (
        BackgroundServer(create_app(serve_settings(tmp_path, None))) as srv,
        httpx.Client(timeout=60) as http,
    ):
        url = srv.url + "/v1/chat/completions"
        # What a page on another site sends with fetch(url, {method: "POST", mode: "no-cors", body}).
        csrf = http.post(
            url, content=_CHAT, headers={"Content-Type": "text/plain", "Origin": "https://evil.example"}
        )
        assert csrf.status_code == 403, csrf.text
        assert (
            csrf.json()["error"]["code"] == "origin_not_allowed"
            and "--api-key" in csrf.json()["error"]["message"]
        )
        # DNS rebinding: the page's own name now resolves to 127.0.0.1; same-origin GETs carry no Origin.
        rebound = f"evil.example:{srv.port}"
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", _CHAT)):
            answer = http.request(method, srv.url + path, content=body, headers={"Host": rebound})
            assert answer.status_code == 403, (path, answer.text)
        assert http.get(srv.url + "/v1/models", headers={"Origin": "null"}).status_code == 403
        assert _traces(tmp_path) == []  # nothing ran
        # Programs on this machine (no Origin; a page served from localhost) go ahead.
        assert http.post(url, content=_CHAT, headers={"Content-Type": "application/json"}).status_code == 200
        local = http.post(
            url, content=_CHAT, headers={"Origin": "http://localhost:3000", "Host": f"localhost:{srv.port}"}
        )
        assert local.status_code == 200, local.text


def test_a_server_with_a_key_is_not_limited_to_its_machine(tmp_path: Path) -> None:
    """With a key the guard is off: a page can send no key it does not know (and no key header at
    all without a preflight), and a reverse proxy's Host reaches the server unchanged."""
    key = "k-0123456789abcdef"
    with BackgroundServer(create_app(serve_settings(tmp_path, key))) as srv:
        models = httpx.get(
            srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}", "Host": "api.example.org"}
        )
        assert models.status_code == 200, models.text


def test_loopback_names() -> None:
    for name in ("localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]", "LOCALHOST."):
        assert is_loopback_name(name), name
    for name in ("localhost.evil.example", "evil.example", "0.0.0.0", "::ffff:8.8.8.8", "", None):
        assert not is_loopback_name(name), name
