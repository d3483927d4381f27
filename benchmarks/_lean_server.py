"""A latency-modelled OpenAI-compatible chat server with almost no CPU per request, for benchmarks
that must measure the client rather than the server.

recursa.testing.FakeServer (FastAPI on uvicorn's h11) spends about 0.7 ms of CPU on each request.
That is nothing for a test, but a fan-out of 64 requests arriving at once then waits ~45 ms for the
server to read them all, on the same two cores the client runs on: with an ideal client (bare
aiohttp) 256 calls at 0.2 s with 64 slots took 0.91-1.0 s against FakeServer and 0.85-0.91 s
against this server (about 0.07 ms of CPU per request). A real model server runs on its own
machine; this one stands in for it.

Each POST to .../chat/completions waits FIFO for one of `slots` slots, holds it `latency` seconds and
answers with `responder(model, messages)`; usage is estimated at 4 characters per token. GET /ledger
lists every answered request's model and times (time.perf_counter(), comparable across processes on
Linux); POST /ledger/reset empties it. Only what the openai SDK and aiohttp send is understood:
HTTP/1.1 with Content-Length bodies, kept alive.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

Responder = Callable[[str, list[dict[str, Any]]], str]


class LeanServer:
    def __init__(self, responder: Responder, latency: float, slots: int) -> None:
        self.responder = responder
        self.latency = latency
        self.slots = slots
        self.ledger: list[dict[str, Any]] = []
        self._gate: asyncio.Semaphore | None = None

    async def serve(self, port: int) -> asyncio.Server:
        self._gate = asyncio.Semaphore(self.slots)  # FIFO, as a model server's queue is
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _Connection(self), "127.0.0.1", port, backlog=4096)

    async def answer(self, transport: asyncio.Transport, method: bytes, path: bytes, body: bytes) -> None:
        received = time.perf_counter()
        if method == b"GET" and path == b"/ledger":
            _write(transport, 200, json.dumps(self.ledger).encode())
            return
        if method == b"POST" and path.startswith(b"/ledger/reset"):
            self.ledger.clear()
            _write(transport, 200, b'{"status": "ok"}')
            return
        if method != b"POST" or not path.endswith(b"/chat/completions"):
            _write(transport, 404, b'{"error": {"message": "not found"}}')
            return
        request = json.loads(body)
        model, messages = request.get("model", ""), request.get("messages") or []
        assert self._gate is not None
        async with self._gate:
            started = time.perf_counter()
            await asyncio.sleep(self.latency)
        text = self.responder(model, messages)
        prompt = sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1
        reply = {
            "id": f"lean-{len(self.ledger)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": len(text) // 4 + 1,
                "total_tokens": prompt + len(text) // 4 + 1,
            },
        }
        finished = time.perf_counter()
        self.ledger.append(
            {"model": model, "received_at": received, "started_at": started, "finished_at": finished}
        )
        _write(transport, 200, json.dumps(reply).encode())


def _write(transport: asyncio.Transport, status: int, body: bytes) -> None:
    if transport.is_closing():
        return
    reason = b"OK" if status == 200 else b"Not Found"
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    transport.write(head % (status, reason, len(body)) + body)


class _Connection(asyncio.Protocol):
    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buffer[:end].split(b"\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path, _ = lines[0].split(b" ", 2)
            assert self.transport is not None
            asyncio.get_running_loop().create_task(self.server.answer(self.transport, method, path, body))
