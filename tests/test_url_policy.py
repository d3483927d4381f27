"""`recursa serve --allow-urls` fetches only public addresses: a client cannot make the server read
its own loopback services, the metadata endpoint or private ranges, not by naming them in any
numeric form, not through a redirect, and not by a name that resolves differently on the second
look. `--allow-private-urls` (ServeSettings.allow_private_urls) is the operator's way out."""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx
from fastapi.testclient import TestClient

from recursa import public_fetch
from recursa.serve import urls
from recursa.serve.api_error import ApiError
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from tests.helpers import serve_process
from tests.serve_helpers import install_test_root
from tests.web_sites import Site, trusted_ca

INTERNAL = "INTERNAL-ADMIN-ANSWER"
PUBLIC_TEXT = "public document text"
ROOT_MODEL = install_test_root()
# Loopback, but the tests below let 127.0.0.2 count as a public address: the stand-in for a web
# server on the internet that the client controls.
PUBLIC_IP = "127.0.0.2"


@pytest.fixture
def internal() -> Iterator[Site]:
    site = Site("127.0.0.1", {"/admin": (200, {}, INTERNAL)}).start()
    yield site
    site.close()


@pytest.fixture
def public(internal: Site, monkeypatch) -> Iterator[Site]:
    admin = f"http://127.0.0.1:{internal.port}/admin"
    routes = {
        "/doc": (200, {}, PUBLIC_TEXT),
        "/to-admin": (302, {"Location": admin}, ""),
        "/to-admin-decimal": (307, {"Location": f"http://2130706433:{internal.port}/admin"}, ""),
        "/to-mapped": (301, {"Location": f"http://[::ffff:127.0.0.1]:{internal.port}/admin"}, ""),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, ""),
        "/relative": (302, {"Location": "/doc"}, ""),
    }
    for k in range(7):
        routes[f"/loop{k}"] = (302, {"Location": f"/loop{k + 1}"}, "")
    site = Site(PUBLIC_IP, routes).start()
    real = public_fetch.address_problem
    monkeypatch.setattr(public_fetch, "address_problem", lambda ip: None if str(ip) == PUBLIC_IP else real(ip))
    yield site
    site.close()


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    settings = ServeSettings(
        model=ROOT_MODEL, sub_model="scripted/oracle", trace_dir=tmp_path / "t", allow_context_urls=True
    )
    with TestClient(create_app(settings)) as client:
        yield client


def _ask(http: TestClient, url: str) -> httpx.Response:
    body = {
        "model": "recursa",
        "messages": [{"role": "user", "content": "RUN: FINAL(context)"}],
        "recursa": {"context_url": url},
    }
    return http.post("/v1/chat/completions", json=body)


def _refused(reply: httpx.Response, code: str = "context_url_not_allowed") -> None:
    assert reply.status_code in (400, 403), reply.text
    assert reply.json()["error"]["code"] == code, reply.text
    assert INTERNAL not in reply.text


@pytest.mark.parametrize(
    "form",
    [
        "127.0.0.1",
        "localhost",
        "2130706433",  # decimal
        "0x7f.0.0.1",  # hex
        "127.1",  # short form
        "[::ffff:127.0.0.1]",  # IPv4-mapped IPv6
        "[::1]",
        "0.0.0.0",
    ],
)
def test_loopback_in_any_form_is_refused_and_never_contacted(http, internal, form) -> None:
    _refused(_ask(http, f"http://{form}:{internal.port}/admin"))
    assert internal.hits == []
    body = {"model": "recursa", "messages": [{"role": "user", "content": "RUN: FINAL(context)"}]}
    body["recursa"] = {"context": "inline text"}  # the server goes on answering
    assert (
        http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        == "inline text"
    )


# Checked without sending anything: these tests must never make traffic to such addresses, even
# against a broken build, so only the classification is exercised (the HTTP tests use loopback).
@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("192.168.1.1", "private"),
        ("172.16.0.1", "private"),
        ("100.64.0.1", "non-public"),  # carrier-grade NAT
        ("fd12:3456::1", "private"),  # unique-local
        ("224.0.0.251", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::ffff:10.0.0.1", "private"),  # IPv4-mapped
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("240.0.0.1", "private"),
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
        ("::ffff:8.8.8.8", None),
    ],
)
def test_address_classification(address: str, kind: str | None) -> None:
    assert public_fetch.address_problem(ipaddress.ip_address(address)) == kind


def test_redirects_are_checked_at_every_hop(http, internal, public) -> None:
    base = f"http://{PUBLIC_IP}:{public.port}"
    reply = _ask(http, base + "/doc")
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == PUBLIC_TEXT
    assert _ask(http, base + "/relative").json()["choices"][0]["message"]["content"] == PUBLIC_TEXT
    for path in ("/to-admin", "/to-admin-decimal", "/to-mapped"):
        reply = _ask(http, base + path)
        _refused(reply)
        assert "redirected to" in reply.json()["error"]["message"]
    assert internal.hits == []
    _refused(_ask(http, base + "/to-file"), code=None)
    reply = _ask(http, base + "/loop0")
    _refused(reply, code="context_fetch_failed")
    assert "more than 5" in reply.json()["error"]["message"]
    assert public.hits.count("/loop5") == 1 and "/loop6" not in public.hits


def test_the_connection_goes_to_the_address_that_was_checked(http, internal, public, monkeypatch) -> None:
    """DNS rebinding: the name is public when checked and loopback when looked up again."""
    answers = iter([PUBLIC_IP])
    real = public_fetch.resolve

    async def rebinding(host: str, port: int):
        if host == "rebind.example":
            return [ipaddress.ip_address(next(answers, "127.0.0.1"))]
        return await real(host, port)

    monkeypatch.setattr(public_fetch, "resolve", rebinding)
    reply = _ask(http, f"http://rebind.example:{public.port}/doc")
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == PUBLIC_TEXT
    assert internal.hits == [] and public.hits == ["/doc"]


def test_the_operator_can_allow_private_addresses(tmp_path: Path, internal) -> None:
    settings = ServeSettings(
        model=ROOT_MODEL,
        sub_model="scripted/oracle",
        trace_dir=tmp_path,
        allow_context_urls=True,
        allow_private_urls=True,
    )
    with TestClient(create_app(settings)) as http:
        reply = _ask(http, f"http://localhost:{internal.port}/admin")
    assert reply.json()["choices"][0]["message"]["content"] == INTERNAL


@pytest.mark.parametrize("flags", [[], ["--allow-private-urls"]], ids=["default", "allow-private"])
def test_recursa_serve_command_line(tmp_path: Path, internal, flags: list[str]) -> None:
    with serve_process(tmp_path, "--sub-model", "scripted/oracle", "--allow-urls", *flags) as base:
        reply = httpx.post(
            base + "/v1/chat/completions",
            json={
                "model": "recursa",
                "messages": [{"role": "user", "content": "What does it say?"}],
                "recursa": {"context_url": f"http://127.0.0.1:{internal.port}/admin", "max_iterations": 2},
            },
            timeout=60,
        )
    if flags:
        assert reply.status_code == 200 and internal.hits == ["/admin"]
    else:
        _refused(reply)
        assert internal.hits == []


def test_https_goes_to_the_checked_address_and_verifies_the_name(http, monkeypatch, tmp_path) -> None:
    """Pinned to an address, the request still sends the name as TLS server name and Host, and the
    certificate is checked against that name."""
    site = Site(PUBLIC_IP, {"/doc": (200, {}, PUBLIC_TEXT)}).tls(trusted_ca(tmp_path, monkeypatch), "docs.example").start()
    real_problem, real_resolve = public_fetch.address_problem, public_fetch.resolve

    async def resolve(host: str, port: int):
        return [ipaddress.ip_address(PUBLIC_IP)] if host == "docs.example" else await real_resolve(host, port)

    monkeypatch.setattr(public_fetch, "resolve", resolve)
    monkeypatch.setattr(
        public_fetch, "address_problem", lambda ip: None if str(ip) == PUBLIC_IP else real_problem(ip)
    )
    try:
        reply = _ask(http, f"https://docs.example:{site.port}/doc")
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == PUBLIC_TEXT
        assert site.names[0] == "docs.example" and site.hits == ["/doc"]
        # The certificate names docs.example, not the address: asked by address, it does not verify.
        _refused(_ask(http, f"https://{PUBLIC_IP}:{site.port}/doc"), code="context_fetch_failed")
    finally:
        site.close()


def _gzip_of_zeros(n: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    return b"".join(packer.compress(block) for _ in range(n >> 20)) + packer.flush()


def test_compressed_bodies_are_capped_on_their_decoded_size(http, public, monkeypatch) -> None:
    """A gzip bomb: 64 MiB of zeros sent as 64 KiB of gzip, or nested gzip of a few hundred bytes.
    The cap counts decoded bytes as they are inflated, so neither is ever held in memory."""
    bomb = _gzip_of_zeros(64 << 20)
    public_routes = {
        "/bomb": (200, {"Content-Encoding": "gzip"}, bomb),
        "/nested": (200, {"Content-Encoding": "gzip, gzip"}, gzip.compress(bomb)),
        "/brotli": (200, {"Content-Encoding": "br"}, b"\x00" * 64),
        "/small": (200, {"Content-Encoding": "gzip"}, gzip.compress(PUBLIC_TEXT.encode())),
        "/broken": (200, {"Content-Encoding": "gzip"}, gzip.compress(PUBLIC_TEXT.encode())[:-12]),
    }
    site = Site(PUBLIC_IP, public_routes).start()
    base = f"http://{PUBLIC_IP}:{site.port}"

    async def fetch(path: str) -> bytes:
        return await urls.fetch_url(base + path, max_bytes=1 << 20, timeout_s=30)

    try:
        assert asyncio.run(fetch("/small")) == PUBLIC_TEXT.encode()
        tracemalloc.start()
        try:
            with pytest.raises(ApiError) as refused:
                asyncio.run(fetch("/bomb"))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert refused.value.status == 413 and refused.value.code == "context_too_large"
        assert peak < 16 << 20, f"{peak:,} bytes held while refusing a 1 MiB cap"
        for path, words in (
            ("/nested", "Content-Encoding"),
            ("/brotli", "Content-Encoding"),
            ("/broken", "ended"),
        ):
            with pytest.raises(ApiError) as refused:
                asyncio.run(fetch(path))
            assert refused.value.code == "context_fetch_failed" and words in refused.value.message, path
        # Through the server: the client gets the refusal, and the server goes on.
        reply = _ask(http, base + "/nested")
        _refused(reply, code="context_fetch_failed")
        assert _ask(http, base + "/small").json()["choices"][0]["message"]["content"] == PUBLIC_TEXT
    finally:
        site.close()


# Run in a network namespace of its own, where 8.8.8.8 (a public address) is one of the host's own,
# as a server's public address is: the service bound to 0.0.0.0 answers on it.
_OWN_PUBLIC_ADDRESS = """
import asyncio, subprocess, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", "8.8.8.8/32", "dev", "lo"], check=True)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "8")
        self.end_headers()
        self.wfile.write(b"INTERNAL")

    def log_message(self, *args):
        return

site = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
threading.Thread(target=site.serve_forever, daemon=True).start()
from recursa.serve.api_error import ApiError
from recursa.serve.urls import fetch_url
try:
    url = f"http://8.8.8.8:{site.server_address[1]}/"
    print("FETCHED", asyncio.run(fetch_url(url, max_bytes=1000, timeout_s=10)))
except ApiError as exc:
    print("REFUSED", exc.status, exc.message)
"""


def test_the_servers_own_public_address_is_not_public() -> None:
    import os
    import shutil
    import subprocess
    import sys

    probe = ["unshare", "-rn", "ip", "link", "set", "lo", "up"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("needs unshare -rn and ip (a network namespace in which this host's address is public)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", _OWN_PUBLIC_ADDRESS],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("REFUSED 403"), done.stdout
    assert "one of this server's own addresses" in done.stdout and "INTERNAL" not in done.stdout


def test_own_addresses_are_read_from_the_host() -> None:
    from recursa.addresses import own_addresses

    own = own_addresses()
    assert ipaddress.ip_address("127.0.0.1") in own and ipaddress.ip_address("::1") in own
    assert public_fetch.address_problem(ipaddress.ip_address("8.8.8.8")) is None  # not this host's
