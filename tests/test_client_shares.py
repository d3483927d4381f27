"""recursa.asgi.client_shares on its own, driven through ASGI: the share an address gets when the
operator gives none (the servers' tests drive it over real sockets, which come from loopback)."""

from __future__ import annotations

import asyncio

from recursa.asgi.client_shares import ClientShares


async def test_a_remote_address_gets_a_quarter_and_this_machines_programs_the_whole() -> None:
    release = asyncio.Event()

    async def app(scope, receive, send) -> None:  # holds its request until released
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    shares = ClientShares(app, total=8, per_client=None, idle_timeout_s=60, paths=frozenset({"/reset"}))

    async def post(address: str) -> int:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/reset", "client": (address, 5000), "headers": []}
        await shares(scope, receive, send)
        return sent[0]["status"]

    remote = [asyncio.create_task(post("203.0.113.9")) for _ in range(3)]
    local = [asyncio.create_task(post("127.0.0.1")) for _ in range(6)]
    done, _ = await asyncio.wait(remote + local, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert [t.result() for t in done] == [429]  # the third remote request: past 8 // 4 = 2
    assert shares.held == {"203.0.113.9": 2, "127.0.0.1": 6}
    release.set()
    assert sorted(await asyncio.gather(*remote, *local)) == [200] * 8 + [429]
    assert not shares.held
