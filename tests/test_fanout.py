"""Batches of sub-calls start one item per turn of the event loop (recursa.loop.subcalls), a
sub-model's client can be made ready before its first call without sending anything, and its
HTTP session reads the environment's proxy settings once, not on every call."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from yarl import URL

from recursa.lm.base import CallMeta, LMRequest
from recursa.lm.json_http import JsonPoster, shared_tls_context
from recursa.lm.openai_client import OpenAIClient
from recursa.loop.subcalls import _gather_items
from recursa.testing.fake_server import FakeServer
from recursa.trace.redact import Redactor


async def test_the_first_item_runs_before_the_later_ones_are_started_and_order_is_kept() -> None:
    seen: list[str] = []

    async def item(i: int) -> str:
        seen.append(f"start {i}")
        await asyncio.sleep(0)
        seen.append(f"after first step {i}")
        return f"a{i}"

    assert await _gather_items([item(i) for i in range(5)], Redactor()) == [f"a{i}" for i in range(5)]
    # Started all at once, every item would start before any took its second step.
    assert seen.index("after first step 0") < seen.index("start 4")


async def test_a_cancelled_batch_cancels_what_started_and_closes_the_rest() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def item(i: int) -> str:
        started.append(i)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return "never"

    coros = [item(i) for i in range(6)]
    batch = asyncio.ensure_future(_gather_items(coros, Redactor()))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    await asyncio.sleep(0)
    assert started and sorted(cancelled) == started and len(started) < 6
    assert all(c.cr_frame is None for c in coros[len(started) :])  # closed: no "never awaited" warning


async def test_warming_a_client_loads_the_trust_store_for_https_only_and_sends_nothing() -> None:
    with FakeServer(responder=lambda model, messages: "pong") as srv:
        plain = OpenAIClient("m", base_url=srv.base_url, api_key="k")
        shared_tls_context.cache_clear()
        await plain.warm()
        assert shared_tls_context.cache_info().currsize == 0  # http: no trust store to load
        # Nothing listens there: warming must not connect.
        secure = OpenAIClient("m", base_url="https://127.0.0.1:9/v1", api_key="k")
        await secure.warm()
        assert shared_tls_context.cache_info().currsize == 1
        assert srv.requests == []
        await plain.aclose()
        await secure.aclose()


async def test_a_netrc_entry_for_the_server_does_not_break_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp's trust_env=True looked ~/.netrc up for every request (in a thread) and, finding an
    # entry for the host, refused to send it beside our Authorization header.
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    with FakeServer(responder=lambda model, messages: "pong") as srv:
        client = OpenAIClient("m", base_url=srv.base_url, api_key="k")
        try:
            out = await client.complete(
                LMRequest(
                    messages=[{"role": "user", "content": "ping"}], max_output_tokens=8, meta=CallMeta("c")
                )
            )
        finally:
            await client.aclose()
    assert out.text == "pong" and srv.requests[0].headers["authorization"] == "<redacted>"


def test_proxies_come_from_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    poster = JsonPoster("http://model.internal:8000/v1", headers={}, timeout=5, connect_timeout=1)
    assert poster.proxy == URL("http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "model.internal")
    assert JsonPoster("http://model.internal:8000/v1", headers={}, timeout=5, connect_timeout=1).proxy is None


@pytest.mark.filterwarnings("ignore:sandbox=.inprocess. runs generated code")
def test_children_waiting_for_a_slot_hold_no_context_yet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Each child's context is a memfd: a cell's rlm_query_batched over 2,000 contexts encoded them
    # all before waiting for a slot, and took every file descriptor of the host process (1,024).
    import recursa.context as context_module
    from recursa import RLM

    real, open_now, peak = context_module.build_payload, [0], [0]

    def counted(context: object) -> context_module.ContextPayload:
        payload = real(context)
        open_now[0] += 1
        peak[0] = max(peak[0], open_now[0])
        close = payload.close

        def closed() -> None:
            if payload.fd >= 0:
                open_now[0] -= 1
            close()

        payload.close = closed  # type: ignore[method-assign]
        return payload

    monkeypatch.setattr(context_module, "build_payload", counted)

    def respond(model: str, messages: list[dict]) -> str:
        if "child" not in messages[1]["content"]:
            batch = "r = rlm_query_batched(['child'] * 12, contexts=[str(i) for i in range(12)])"
            return f"```repl\n{batch}\nFINAL(len(r))\n```"
        return "```repl\nFINAL('ok')\n```"

    with FakeServer(responder=respond) as server:
        rlm = RLM("openai/m", base_url=server.base_url, api_key="k" * 16, max_depth=2, sandbox="inprocess",
                  max_parallel_children=2, trace_dir=tmp_path)  # fmt: skip
        assert rlm.run("q", "the root's context").answer == "12"
    assert peak[0] <= 3, peak[0]  # the root's own and the two children running
