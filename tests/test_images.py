"""Images in sub-calls: llm_query(prompt, images=[...]) with bytes, a folder context's image files
and https URLs, sent in each provider's format; traces keep references, never the bytes."""

from __future__ import annotations

import base64
import hashlib
import json

import anthropic
import openai
import pytest

from recursa import RLM
from recursa.testing.fake_server import FakeServer
from tests.test_escapes import feedback_before

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
GIF = b"GIF89a" + b"\x01" * 300
URL = "https://example.com/cat.png"

CODE = f"""
print(sorted(context))
print(context['pic.png'])
print(llm_query('describe the picture', images=['pic.png']))
print(llm_query('and these', images=[{GIF!r}, {URL!r}]))
g = {GIF!r}
print(llm_query_batched(['batch one', 'batch two', 'batch three', 'batch four'],
                        images=[['pic.png', {URL!r}], g, None, [g]]))
for bad in ([g], [[b'not an image'], None]):
    try:
        llm_query_batched(['x', 'y'], images=bad)
    except Exception as e:
        print('refused:', type(e).__name__, e)
for bad in ([b'not an image'], ['http://169.254.169.254/latest.png'], ['https://localhost/x.png'],
            ['https://10.0.0.1/x.png'], ['missing.png']):
    try:
        llm_query('x', images=bad)
    except Exception as e:
        print('refused:', type(e).__name__, e)
"""


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _prompt(content) -> str:
    return (
        content if isinstance(content, str) else next(p["text"] for p in content if p.get("type") == "text")
    )


def responder(model: str, messages: list[dict]) -> str:
    if messages[0]["role"] != "system":
        return f"seen: {messages[-1]['content']}"
    done = sum(1 for m in messages if m["role"] == "assistant")
    return f"```repl\n{CODE}\n```" if done == 0 else "FINAL(done)"


@pytest.mark.parametrize(("provider", "model"), [("openai", "gpt-5-mini"), ("anthropic", "claude-haiku-4-5")])
def test_images_reach_vision_models_in_each_providers_format(tmp_path, provider, model) -> None:
    folder = tmp_path / "ctx"
    folder.mkdir()
    (folder / "notes.txt").write_text("a note about the picture\n")
    (folder / "pic.png").write_bytes(PNG)
    with FakeServer(responder=responder) as srv:
        url = srv.base_url if provider == "openai" else srv.root_url
        rlm = RLM(f"{provider}/{model}", base_url=url, api_key="k", trace_dir=tmp_path / "traces")
        result = rlm.run("What is in the picture?", folder)
        records = list(srv.requests)
    assert result.answer == "done", result.error
    seen = feedback_before(srv, 2, model=model)
    assert "['notes.txt', 'pic.png']" in seen
    assert f"[image file: image/png, {len(PNG):,} bytes" in seen and "images=['pic.png']" in seen
    assert "seen: describe the picture" in seen and "seen: and these" in seen
    subs = {_prompt(r.messages[-1]["content"]): r for r in records if r.messages[0]["role"] != "system"}
    assert {p: r.images for p, r in subs.items()} == {
        "describe the picture": [sha(PNG)],
        "and these": [sha(GIF), URL],
        # llm_query_batched: images[i] goes with prompts[i], one image or a list of them
        "batch one": [sha(PNG), URL],
        "batch two": [sha(GIF)],
        "batch three": [],
        "batch four": [sha(GIF)],
    }
    assert "seen: batch two" in seen and "seen: batch three" in seen
    assert (
        subs["describe the picture"].prompt_tokens > 765
    )  # the fake bills each image, and recursa counts it
    assert result.usage.input_tokens == sum(r.prompt_tokens for r in records)
    refusals = [line for line in seen.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 7
    assert "ValueError llm_query_batched(prompts, images=[...]) takes one entry per prompt" in refusals[0]
    assert "got a list of 1 for 2 prompts" in refusals[0]
    assert "llm_query_batched: images[0][0] is not a PNG, JPEG, GIF or WebP image" in refusals[1]
    assert "is not a PNG, JPEG, GIF or WebP image" in refusals[2]
    assert "image URLs must be https:// URLs" in refusals[3]
    assert "'localhost' is not a public host name" in refusals[4] and "'10.0.0.1'" in refusals[5]
    assert "'missing.png' is not an image file of the context (its image files: pic.png)" in refusals[6]
    events = [json.loads(line) for line in result.trace_path.read_text().splitlines()]
    batch = next(e for e in events if e["type"] == "lm_call" and e.get("prompt", "").startswith("batch one"))
    assert batch["images"][1] == {"type": "image", "url": URL}, batch["images"]
    assert batch["images"][0]["sha256"] == hashlib.sha256(PNG).hexdigest()
    trace = result.trace_path.read_text()
    assert base64.b64encode(PNG).decode() not in trace and base64.b64encode(GIF).decode() not in trace
    assert hashlib.sha256(PNG).hexdigest() in trace and URL in trace


def test_the_fake_server_reads_images_as_the_sdks_send_them() -> None:
    data = base64.b64encode(PNG).decode()
    with (
        FakeServer(responder=lambda m, msgs: "ok") as srv,
        openai.OpenAI(base_url=srv.base_url, api_key="k", max_retries=0) as oai,
        anthropic.Anthropic(base_url=srv.root_url, api_key="k", max_retries=0) as ant,
    ):
        oai.chat.completions.create(
            model="m",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                    ],
                }
            ],
        )
        ant.messages.create(
            model="m",
            max_tokens=10,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": data},
                        },
                        {"type": "image", "source": {"type": "url", "url": URL}},
                        {"type": "text", "text": "look"},
                    ],
                }
            ],
        )
        with pytest.raises(openai.BadRequestError, match="not this API's image format"):
            oai.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],  # type: ignore[list-item]
            )
        records = list(srv.requests)
    assert records[0].images == [sha(PNG)] and records[1].images == [sha(PNG), URL]


def test_bytes_given_for_many_prompts_cross_the_channel_once() -> None:
    from recursa.sandbox.worker.images import batch_images_arg

    lists, blobs = batch_images_arg([GIF, [GIF, PNG], None, "pic.png"], 4)
    assert blobs == [base64.b64encode(GIF).decode(), base64.b64encode(PNG).decode()]
    assert lists == [[{"blob": 0}], [{"blob": 0}, {"blob": 1}], None, [{"path": "pic.png"}]]


def test_image_urls_whose_names_lead_inside_the_network_are_refused(monkeypatch, tmp_path) -> None:
    """An image URL's provider (a self-hosted vLLM) fetches it from inside the operator's network:
    a name that resolves to a private or loopback address, `localhost.` and dotted-hex IPv4 passed
    the name checks. Each is refused in the REPL now, before any call; a public name goes out."""
    import socket

    from tests.serve_helpers import install_test_root

    table = {
        "intranet.example.corp": "10.1.2.3",
        "rebound.example.org": "127.0.0.1",
        "cdn.example.org": "93.184.216.34",
    }
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host in table:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], 443))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    urls = [f"https://{host}/x.png" for host in (*table, "localhost.", "0x7f.0.0.1", "0177.0.0.01")]
    code = f"""out = []
for url in {urls!r}:
    try:
        llm_query('look', images=[url])
        out.append('sent ' + url)
    except Exception as e:
        out.append('refused ' + url + ': ' + type(e).__name__ + ' ' + str(e))
FINAL(chr(10).join(out))"""
    rlm = RLM(install_test_root(), sub_model="scripted/oracle", trace_dir=tmp_path)
    lines = rlm.run("RUN: " + code, context="ctx").answer.splitlines()
    policy = [line for line in lines if "must name a public host" in line]
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in policy] == [
        f"refused {url}" for url in urls if "cdn." not in url
    ], lines
    assert "10.1.2.3 (private address)" in policy[0] and "127.0.0.1 (loopback address)" in policy[1]
    # The public name passed the policy and went to the model (which takes no images).
    assert next(line for line in lines if "cdn." in line).endswith("got 'list'"), lines
