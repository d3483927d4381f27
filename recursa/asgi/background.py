"""Run an ASGI app under uvicorn in a background thread on 127.0.0.1, for tests, benchmarks and
notebooks: the port is known at once and leaving the `with` block stops the server.

    with BackgroundServer(create_app(settings)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="...")
"""

from __future__ import annotations

import asyncio
import socket
import threading
from types import TracebackType
from typing import Any

import uvicorn

from recursa.asgi.slow_clients import HEAD_TIMEOUT_S, WRITE_TIMEOUT_S, head_timeout_protocol

_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 15.0


class _PromptServer(uvicorn.Server):
    """uvicorn's server, checking for shutdown every 20 ms (not 100 ms) so tests stop quickly."""

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            await asyncio.sleep(0.02)


class BackgroundServer:
    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        lifespan: str = "auto",
        access_log: bool = True,
        name: str = "recursa-server",
        head_timeout_s: float = HEAD_TIMEOUT_S,
        max_connections: int | None = None,
        max_connections_per_address: int | None = None,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.host = host
        self.requested_port = port
        self.lifespan = lifespan
        self.access_log = access_log
        self.name = name
        self.head_timeout_s = head_timeout_s
        self.caps = (max_connections, max_connections_per_address)
        self.write_timeout_s = write_timeout_s
        self.port = 0
        self._server: _PromptServer | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        # Bound here so the port is known before the thread starts and a busy port raises here.
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets, and without it
        # every streamed chunk can wait ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.requested_port))
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        protocol = head_timeout_protocol(
            self.head_timeout_s,
            max_connections=self.caps[0],
            per_address=self.caps[1],
            write_timeout_s=self.write_timeout_s,
        )
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            log_config=None,  # never reconfigure the host's logging
            access_log=self.access_log,
            lifespan=self.lifespan,
            timeout_graceful_shutdown=2,
            http=protocol,
            backlog=protocol.caps.backlog,
        )
        server = _PromptServer(config)
        self._server = server

        def serve() -> None:
            try:
                asyncio.run(server.serve(sockets=[sock]))
            except BaseException as exc:  # surfaced by start()/stop() in the caller's thread
                self._error = exc
            finally:
                sock.close()

        self._thread = threading.Thread(target=serve, name=f"{self.name}-{self.port}", daemon=True)
        self._thread.start()
        deadline = _START_TIMEOUT_S
        step = 0.01
        while not server.started and self._thread.is_alive() and deadline > 0:
            self._thread.join(step)
            deadline -= step
        if not server.started:
            self.stop()
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            if self._thread.is_alive():
                # Still busy (e.g. a run that ignores cancellation): make uvicorn give up on it.
                assert self._server is not None
                self._server.force_exit = True
                self._thread.join(_STOP_TIMEOUT_S)
        self._thread = None
        self._server = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
