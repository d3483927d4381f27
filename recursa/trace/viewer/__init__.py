"""A trace viewer in the browser: `recursa view TRACE [--port N]` or `recursa view TRACE --html out.html`.

One static page (assets/: HTML, CSS, JS; no dependencies, no network) renders the view built by
`build_view`, read within fixed bounds whatever the file holds (reading.py: a trace beyond them is
shown in part, and the page says so). `export_html` embeds the data in a standalone file;
`ViewerServer` serves the page and re-reads the trace when it changed, so a run that is still going
can be watched live.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any

from recursa.addresses import is_loopback_name
from recursa.trace.viewer.connections import ConnectionGate
from recursa.trace.viewer.model import TraceFormatError, build_view

__all__ = ["TraceFormatError", "ViewerServer", "build_view", "export_html", "render_html"]


def _asset(name: str) -> str:
    return resources.files("recursa.trace.viewer").joinpath("assets", name).read_text(encoding="utf-8")


# JSON written into a <script> element: "</script" would end the element and "<!--<script" would
# make the parser swallow the viewer's own script after it, so no "<" (nor ">" or "&") is left;
# "\u003c" is the same JSON string.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def content_security_policy(js: str) -> str:
    """Only the viewer's own script may run (by its hash): markup that ever got into the page from
    a trace could not run script, load anything or send anything anywhere."""
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    return (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'"
    )


def render_html(view: dict[str, Any] | None) -> str:
    """The viewer page; with `view`, the data is embedded and the page works offline from a file."""
    page = _asset("viewer.html")
    data = ""
    if view is not None:
        data = json.dumps(view, ensure_ascii=False, separators=(",", ":")).translate(_SCRIPT_SAFE)
    js = _asset("viewer.js")
    parts = {"CSS": _asset("viewer.css"), "JS": js, "DATA": data, "CSP": content_security_policy(js)}
    # One pass over the template only: text inside the parts is never taken for a placeholder.
    return re.sub(r"/\*__(CSS|JS|DATA|CSP)__\*/", lambda m: parts[m.group(1)], page)


def export_html(trace: str | Path, out: str | Path) -> Path:
    """Write a standalone HTML view of `trace` to `out`. Raises TraceFormatError for a non-trace."""
    out = Path(out)
    html = render_html(build_view(trace))
    out.write_text(html, encoding="utf-8")
    return out


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def setup(self) -> None:
        # A connection that sends nothing for this long is closed: each holds a thread of its own,
        # and half-sent requests held them for good.
        self.timeout = self.server.idle_timeout_s
        super().setup()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.gate.head_done(self.connection)  # read whole (or refused): no longer waiting
        return parsed

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self.server.host_allowed(self.headers.get("Host", ""), self.connection.getsockname()[0]):
            # DNS rebinding: a web page whose own name now points at 127.0.0.1 sends that name.
            self._send(403, "text/plain; charset=utf-8", b"this viewer answers only to its own address")
        elif path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", self.server.page)
        elif path == "/trace.json":
            try:
                body = self.server.view_json()
            except (TraceFormatError, OSError) as exc:
                self._send(500, "text/plain; charset=utf-8", str(exc).encode())
                return
            self._send(200, "application/json", body)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", self.server.csp + "; frame-ancestors 'none'")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the CLI prints the URL once
        return


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], trace: Path, idle_timeout_s: float, max_connections: int) -> None:
        super().__init__(address, _Handler)
        self.trace = trace
        self.idle_timeout_s = idle_timeout_s
        self.gate = ConnectionGate(max_connections, head_timeout_s=idle_timeout_s)
        self.page = render_html(None).encode()
        self.csp = content_security_policy(_asset("viewer.js"))
        port = self.server_address[1]
        # Reached on a loopback address, only the loopback names are this server (whatever address
        # it is bound to: bound to 0.0.0.0 it answers on 127.0.0.1 too, where a page of a name
        # rebound to 127.0.0.1 would read the trace); reached on another address, the viewer is
        # reachable by whatever names point there, so the Host is not checked.
        self.hosts = {f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")}
        self._cache: tuple[tuple[int, int], bytes] | None = None
        self._lock = threading.Lock()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        address = str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""
        return self.gate.admit(request, address)

    def shutdown_request(self, request: Any) -> None:
        self.gate.leave(request)
        super().shutdown_request(request)

    def host_allowed(self, host: str, local_address: str) -> bool:
        return not is_loopback_name(local_address) or host.lower() in self.hosts

    def view_json(self) -> bytes:
        """The view, rebuilt only when the file changed (a live run appends to it). One view is held
        and one built at a time, each within the reading's bounds (reading.py), so what the server
        holds is bounded whatever the trace is and however many requests come at once."""
        stat = self.trace.stat()
        key = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if self._cache is None or self._cache[0] != key:
                view = build_view(self.trace)
                self._cache = (key, json.dumps(view, ensure_ascii=False, separators=(",", ":")).encode())
            return self._cache[1]


class ViewerServer:
    """Serve the viewer for one trace on 127.0.0.1 (port 0: any free port) in a background thread.

    with ViewerServer("run.jsonl") as viewer:
        print(viewer.url)
    """

    def __init__(
        self,
        trace: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        self.trace = Path(trace)
        # A connection silent for idle_timeout_s, or whose request head took longer, is closed, and
        # at most max_connections are open (recursa/trace/viewer/connections.py).
        self._server = _Server((host, port), self.trace, idle_timeout_s, max_connections)
        try:
            self._server.view_json()  # fail now, with a clear message, if it is not a trace (kept for the first request)
        except BaseException:
            self._server.server_close()
            raise
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> ViewerServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
