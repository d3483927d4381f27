"""Images in sub-calls: llm_query(prompt, images=[...]) with bytes, a folder context's image files
and https URLs, sent in each provider's format; traces keep references, never the bytes."""

from __future__ import annotations

import base64
import hashlib

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
for bad in ([b'not an image'], ['http://169.254.169.254/latest.png'], ['https://localhost/x.png'],
            ['https://10.0.0.1/x.png'], ['missing.png']):
    try:
        llm_query('x', images=bad)
    except Exception as e:
        print('refused:', type(e).__name__, e)
"""


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


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
    subs = [r for r in records if r.messages[0]["role"] != "system"]
    assert [r.images for r in subs] == [[sha(PNG)], [sha(GIF), URL]]
    assert subs[0].prompt_tokens > 765  # the fake bills each image, and recursa counts what it billed
    assert result.usage.input_tokens == sum(r.prompt_tokens for r in records)
    refusals = [line for line in seen.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 5
    assert "is not a PNG, JPEG, GIF or WebP image" in refusals[0]
    assert "image URLs must be https:// URLs" in refusals[1]
    assert "'localhost' is not a public host name" in refusals[2] and "'10.0.0.1'" in refusals[3]
    assert "'missing.png' is not an image file of the context (its image files: pic.png)" in refusals[4]
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
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
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
