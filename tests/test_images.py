"""Images in sub-calls: llm_query(prompt, images=[...]) with bytes, a folder context's image files
and https URLs, sent in each provider's format; traces keep references, never the bytes. recursa
fetches image URLs itself, from the address it checked, and sends providers bytes only."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
from collections.abc import Iterator

import anthropic
import openai
import pytest

from recursa import RLM, public_fetch
from recursa.testing.fake_server import FakeServer
from tests.test_escapes import feedback_before
from tests.web_sites import Site, trusted_ca

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
GIF = b"GIF89a" + b"\x01" * 300
CAT = b"GIF87a" + b"cat" * 100  # what the image URL serves
SECRET = b"GIF87a" + b"SECRET" * 50  # what a service inside the network would serve at the same URL
NAME = "images.example"
OTHER = "www.images.example"  # the same site under a name that never rebinds
# Loopback, but the tests let 127.0.0.2 count as a public address: a web server on the internet.
PUBLIC_IP = "127.0.0.2"


class ImageSite:
    """An HTTPS image site at https://images.example:<port>/ (and www.images.example) on PUBLIC_IP,
    and an internal one on 127.0.0.1 at the same port that serves other bytes at the same paths. The
    resolver answers by `names`; with `rebind`, images.example leads to PUBLIC_IP on its first
    lookup and to 127.0.0.1 on every later one."""

    def __init__(self, tmp_path, monkeypatch) -> None:
        self.public = Site(
            PUBLIC_IP,
            {
                "/cat.png": (200, {"Content-Type": "image/gif"}, CAT),
                "/page": (200, {"Content-Type": "text/html"}, "<html>not an image</html>"),
            },
        )
        port = self.public.port
        self.public.routes["/to-inside"] = (302, {"Location": f"https://inside.example:{port}/cat.png"}, "")
        self.internal = Site("127.0.0.1", {"/cat.png": (200, {"Content-Type": "image/gif"}, SECRET)}, port=port)
        ca = trusted_ca(tmp_path, monkeypatch)
        for site in (self.public, self.internal):
            site.tls(ca, NAME, OTHER).start()
        self.base = f"https://{NAME}:{port}"
        self.other = f"https://{OTHER}:{port}"
        self.names = {NAME: PUBLIC_IP, OTHER: PUBLIC_IP, "inside.example": "127.0.0.1"}
        self.rebind = False
        self.lookups: list[str] = []
        real_lookup, real_problem = socket.getaddrinfo, public_fetch.address_problem

        def lookup(host, port, *args, **kwargs):
            if host not in self.names:
                return real_lookup(host, port, *args, **kwargs)
            self.lookups.append(host)
            ip = self.names[host]
            if host == NAME and self.rebind and self.lookups.count(NAME) > 1:
                ip = "127.0.0.1"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

        monkeypatch.setattr(socket, "getaddrinfo", lookup)
        monkeypatch.setattr(
            public_fetch, "address_problem", lambda ip: None if str(ip) == PUBLIC_IP else real_problem(ip)
        )

    def close(self) -> None:
        self.public.close()
        self.internal.close()


@pytest.fixture
def image_site(tmp_path, monkeypatch) -> Iterator[ImageSite]:
    site = ImageSite(tmp_path, monkeypatch)
    try:
        yield site
    finally:
        site.close()
    assert site.internal.hits == [], "a fetch reached the service inside the network"


CODE = """
print(sorted(context))
print(context['pic.png'])
print(llm_query('describe the picture', images=['pic.png']))
print(llm_query('and these', images=[GIF, URL]))
g = GIF
print(llm_query_batched(['batch one', 'batch two', 'batch three', 'batch four'],
                        images=[['pic.png', URL], g, None, [g]]))
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


def responder(url: str):
    code = f"GIF = {GIF!r}\nURL = {url!r}\n{CODE}"

    def reply(model: str, messages: list[dict]) -> str:
        if messages[0]["role"] != "system":
            return f"seen: {messages[-1]['content']}"
        done = sum(1 for m in messages if m["role"] == "assistant")
        return f"```repl\n{code}\n```" if done == 0 else "FINAL(done)"

    return reply


@pytest.mark.parametrize(("provider", "model"), [("openai", "gpt-5-mini"), ("anthropic", "claude-haiku-4-5")])
def test_images_reach_vision_models_in_each_providers_format(tmp_path, image_site, provider, model) -> None:
    """An image URL is fetched once per call, from the address that was checked when the name was
    looked up (the fixture's resolver answers 127.0.0.1 after that), and the provider gets bytes."""
    folder = tmp_path / "ctx"
    folder.mkdir()
    (folder / "notes.txt").write_text("a note about the picture\n")
    (folder / "pic.png").write_bytes(PNG)
    url = image_site.base + "/cat.png"
    with FakeServer(responder=responder(url)) as srv:
        base = srv.base_url if provider == "openai" else srv.root_url
        rlm = RLM(f"{provider}/{model}", base_url=base, api_key="k", trace_dir=tmp_path / "traces")
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
        "and these": [sha(GIF), sha(CAT)],
        # llm_query_batched: images[i] goes with prompts[i], one image or a list of them
        "batch one": [sha(PNG), sha(CAT)],
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
    assert batch["images"][1] == {
        "type": "image",
        "url": url,
        "media_type": "image/gif",
        "sha256": hashlib.sha256(CAT).hexdigest(),
        "bytes": len(CAT),
    }, batch["images"]
    assert batch["images"][0]["sha256"] == hashlib.sha256(PNG).hexdigest()
    trace = result.trace_path.read_text()
    assert base64.b64encode(PNG).decode() not in trace and base64.b64encode(GIF).decode() not in trace
    assert hashlib.sha256(PNG).hexdigest() in trace and url in trace


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
                        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
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
    assert records[0].images == [sha(PNG)] and records[1].images == [sha(PNG), "https://example.com/cat.png"]


def test_bytes_given_for_many_prompts_cross_the_channel_once() -> None:
    from recursa.sandbox.worker.images import batch_images_arg

    lists, blobs = batch_images_arg([GIF, [GIF, PNG], None, "pic.png"], 4)
    assert blobs == [base64.b64encode(GIF).decode(), base64.b64encode(PNG).decode()]
    assert lists == [[{"blob": 0}], [{"blob": 0}, {"blob": 1}], None, [{"path": "pic.png"}]]


def test_image_urls_are_fetched_by_recursa_from_the_address_it_checked(tmp_path, image_site) -> None:
    """A provider that fetches an image URL itself (a self-hosted vLLM inside the operator's network)
    resolves the name again: a name that leads to a public address when checked and to 127.0.0.1 a
    moment later reached the internal service. recursa fetches the image, from the address it
    checked, and sends the bytes; names that lead inside, `localhost.`, numeric forms, a redirect
    inside and a page that is not an image are refused in the REPL before any call."""
    image_site.names |= {"intranet.example.corp": "10.1.2.3", "rebound.example.org": "127.0.0.1"}
    image_site.rebind = True
    cat = image_site.base + "/cat.png"
    refused = [
        "https://intranet.example.corp/x.png",
        "https://rebound.example.org/x.png",
        "https://localhost./x.png",
        "https://0x7f.0.0.1/x.png",
        "https://0177.0.0.01/x.png",
        image_site.other + "/to-inside",
        image_site.other + "/page",
        cat,  # looked up again for this call: it leads to 127.0.0.1 now
    ]
    code = f"""out = [llm_query('look', images=[{cat!r}])]
for url in {refused!r}:
    try:
        llm_query('look', images=[url])
        out.append('sent ' + url)
    except Exception as e:
        out.append('refused ' + type(e).__name__ + ' ' + str(e))
FINAL(chr(10).join(out))"""

    def reply(model: str, messages: list[dict]) -> str:
        if messages[0]["role"] != "system":
            return "a cat"
        return f"```repl\n{code}\n```"

    with FakeServer(responder=reply) as srv:
        rlm = RLM("openai/root", sub_model="openai/vision", base_url=srv.base_url, api_key="k", trace_dir=tmp_path)
        result = rlm.run("look", context="ctx")
        subs = [r for r in srv.requests if r.model == "vision"]
    lines = result.answer.splitlines()
    assert lines[0] == "a cat", result.answer
    # One sub-call went out, with the bytes that the checked address served, never the URL.
    assert [r.images for r in subs] == [[sha(CAT)]]
    assert image_site.public.hits == ["/cat.png", "/to-inside", "/page"]
    assert image_site.public.names == [NAME, OTHER, OTHER]
    lines = lines[1:]
    assert len(lines) == len(refused) and all(line.startswith("refused") for line in lines), lines
    assert "'intranet.example.corp', which resolves to a private address" in lines[0]
    assert "'rebound.example.org', which resolves to a loopback address" in lines[1]
    assert all("image URLs must name a public host" in line for line in lines[2:5]), lines
    assert "redirected to the host 'inside.example', which resolves to a loopback address" in lines[5]
    assert "'text/html', not one of image/" in lines[6]
    assert f"'{NAME}', which resolves to a loopback address" in lines[7]


def test_fetched_images_held_by_a_runs_calls_are_bounded(image_site) -> None:
    """recursa holds the images it fetched until their calls are answered: hundreds of calls from a
    REPL's threads, each with its images, held them all at once. A tree's calls hold at most its
    ImageHold (fetches in flight reserve MAX_IMAGE_BYTES each), and what a call took is given back."""
    import asyncio

    from recursa.lm.images import MAX_IMAGE_BYTES, ImageError, ImageHold, fetched_parts

    cat, page = image_site.base + "/cat.png", image_site.other + "/page"
    hold = ImageHold(limit=MAX_IMAGE_BYTES)  # room for one fetch in flight
    groups, held = asyncio.run(fetched_parts([[{"type": "image", "url": cat}]], "llm_query: images", hold))
    assert groups[0][0]["sha256"] == hashlib.sha256(CAT).hexdigest() and held == hold.held == len(CAT)
    with pytest.raises(ImageError, match=f"calls in flight hold {len(CAT)} bytes of fetched images"):
        asyncio.run(fetched_parts([[{"type": "image", "url": cat}]], "llm_query: images", hold))
    hold.give(held)  # the call was answered
    with pytest.raises(ImageError, match="not one of image/"):  # a failure gives back what it took
        asyncio.run(fetched_parts([[{"type": "image", "url": page}]], "llm_query: images", hold))
    assert hold.held == 0
