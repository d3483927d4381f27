"""Small web servers on loopback for the URL-fetching tests: they count their requests, and one can
speak HTTPS with a certificate from a throwaway CA that the test makes the process trust."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

Route = tuple[int, dict[str, str], str | bytes]


class Site:
    """A web server on `host` (port `port`, 0: any free one); `routes` maps a path to
    (status, headers, body)."""

    def __init__(self, host: str, routes: dict[str, Route], port: int = 0) -> None:
        self.routes = routes
        self.hits: list[str] = []
        self.names: list[str | None] = []  # TLS server names asked for
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.hits.append(self.path)
                status, headers, body = site.routes.get(self.path, (404, {}, "missing"))
                data = body if isinstance(body, bytes) else body.encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                return

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    def tls(self, ca, *names: str) -> Site:
        """Serve HTTPS with a certificate for `names` from `ca` (see `trusted_ca`)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert(*names).configure_cert(context)
        context.sni_callback = lambda _sock, asked, _ctx: self.names.append(asked)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        return self

    def start(self) -> Site:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread is not None:
            self.server.shutdown()
            self.thread.join(5)
        self.server.server_close()


def trusted_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A throwaway CA (trustme) that this process trusts for the test (SSL_CERT_FILE)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    return ca
