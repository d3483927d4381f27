"""recursa.asgi.client_shares on its own, driven through ASGI: the share an address gets when the
operator gives none (the servers' tests drive it over real sockets, which come from loopback)."""

from __future__ import annotations

import asyncio

from recursa.asgi.client_shares import ClientShares

FLAGS = {"flag": "--max-sessions-per-client", "idle_flag": "--session-idle-timeout"}  # as messages name them


async def test_a_remote_address_gets_a_quarter_and_this_machines_programs_the_whole() -> None:
    release = asyncio.Event()

    async def app(scope, receive, send) -> None:  # holds its request until released
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    shares = ClientShares(app, total=8, per_client=None, idle_timeout_s=60, paths=frozenset({"/reset"}), **FLAGS)

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


async def test_a_session_gives_its_share_back_when_its_client_leaves_and_before_an_idle_close() -> None:
    """A client that closed its session and reconnected at once was refused (1013) while the server
    was still cleaning up after it; an idle-closed client read the close before its episode was
    released. The share now comes back when the app reads the client leaving, and the idle close
    frame is sent after the app has let go of everything."""
    cleanup = asyncio.Event()
    at_close: list[dict] = []

    async def app(scope, receive, send) -> None:  # an OpenEnv-like session: read until the client leaves
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass
        at_close.append(dict(shares.held))
        await cleanup.wait()  # the server's own clean-up, after its client has gone
        await send({"type": "websocket.close", "code": 1000})

    shares = ClientShares(app, total=4, per_client=1, idle_timeout_s=0.2, **FLAGS)
    scope = {"type": "websocket", "path": "/ws", "client": ("203.0.113.9", 5000), "headers": []}
    incoming: asyncio.Queue[dict] = asyncio.Queue()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message | {"held": dict(shares.held)})

    await incoming.put({"type": "websocket.connect"})
    leaving = asyncio.create_task(shares(scope, incoming.get, send))
    await incoming.put({"type": "websocket.disconnect", "code": 1000})
    await asyncio.sleep(0.05)
    assert at_close == [{}] and not leaving.done()  # still cleaning up, and the share is already back
    cleanup.set()
    await leaving

    sent.clear()
    await incoming.put({"type": "websocket.connect"})
    await asyncio.wait_for(shares(scope, incoming.get, send), 5)  # sends nothing: closed when idle
    closes = [m for m in sent if m["type"] == "websocket.close"]
    assert closes == [{"type": "websocket.close", "code": 4408, "held": {}, "reason": closes[0]["reason"]}]
    assert "idle for 0.2 s" in closes[0]["reason"]
