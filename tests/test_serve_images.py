"""`recursa serve` takes image parts (Chat Completions' image_url, Responses' input_image, Messages'
image blocks) through the real openai and anthropic SDKs: they become images of the run's context,
which the code shows to a vision sub-model by name; bounded per request with a 400 naming the part."""

from __future__ import annotations

import base64
import hashlib

import pytest

pytest.importorskip("fastapi")
import anthropic
import openai

from recursa.asgi.background import BackgroundServer
from recursa.serve.openai_server import create_app
from recursa.serve.settings import ServeSettings
from recursa.testing.fake_server import FakeServer

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
GIF = b"GIF89a" + b"\x01" * 300
URL = "https://example.com/cat.png"
KEY = "images-test-key-0123456789"
CODE = (
    "print(sorted(context))\n"
    "names = [k for k in context if k.startswith('image-') and k[-4:] in ('.png', '.gif')]\n"
    "print(llm_query('describe them', images=names))"
)


def responder(model: str, messages: list[dict]) -> str:
    if model == "sub":
        return "a picture"
    done = sum(1 for m in messages if m["role"] == "assistant")
    return f"```repl\n{CODE}\n```" if done == 0 else "FINAL(done)"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def test_image_parts_of_each_api_become_images_of_the_context(tmp_path) -> None:
    b64 = base64.b64encode(PNG).decode()
    with FakeServer(responder=responder) as upstream:
        settings = ServeSettings(
            model="openai/root", sub_model="openai/sub", base_url=upstream.base_url, upstream_api_key="k",
            trace_dir=tmp_path, api_key=KEY, max_images=2, max_image_bytes=len(PNG) + len(GIF),
        )  # fmt: skip
        with (
            BackgroundServer(create_app(settings)) as srv,
            openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0) as oai,
            anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0) as ant,
        ):
            chat = oai.chat.completions.create(
                model="recursa",
                messages=[
                    {"role": "system", "content": "notes about the pictures"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in these?"},
                            {"type": "image_url", "image_url": {"url": data_url(PNG)}},
                            {"type": "image_url", "image_url": {"url": data_url(GIF, "gif")}},
                        ],
                    },
                ],
            )
            responses = oai.responses.create(
                model="recursa",
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "And this?"},
                            {"type": "input_image", "image_url": URL, "detail": "auto"},
                            {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                        ],
                    }
                ],
            )
            messages = ant.messages.create(
                model="recursa",
                max_tokens=1000,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": b64},
                            },
                            {"type": "text", "text": "And this one?"},
                        ],
                    }
                ],
            )
            too_many = [{"type": "image_url", "image_url": {"url": data_url(GIF, "gif")}}] * 3
            over_count = _refused(oai, too_many)
            too_big = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}] * 2
            over_bytes = _refused(oai, too_big)
            with pytest.raises(anthropic.BadRequestError) as not_an_image:
                bad = {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                }
                ant.messages.create(
                    model="recursa", max_tokens=10, messages=[{"role": "user", "content": [bad]}]
                )
        records = list(upstream.requests)

    assert chat.choices[0].message.content == "done"
    assert responses.output_text == "done" and messages.content[0].text == "done"
    roots = [r for r in records if r.model == "root" and len(r.messages) > 2]
    # the code saw the images among the context's keys, each as a line naming it
    assert "'image-1.png', 'image-2.gif', 'messages[0] (system)'" in roots[0].messages[-1]["content"]
    assert "'image-1', 'image-2.png'" in roots[1].messages[-1]["content"]  # the URL image: by its URL
    assert "['image-1.png']" in roots[2].messages[-1]["content"]
    first_prompt = next(r for r in records if r.model == "root").messages
    assert "image-2.gif" in str(first_prompt)  # the prompt's facts about the context list them
    subs = [r.images for r in records if r.model == "sub"]
    assert subs == [[sha(PNG), sha(GIF)], [sha(PNG)], [sha(PNG)]]
    assert over_count.param == "messages[0].content[3]" and "at most 2 images" in over_count.message
    assert over_bytes.param == "messages[0].content[2]" and "max_image_bytes" in over_bytes.message
    assert "not a PNG, JPEG, GIF or WebP image" in str(not_an_image.value)


def _refused(client: openai.OpenAI, parts: list[dict]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="recursa", messages=[{"role": "user", "content": [{"type": "text", "text": "q"}, *parts]}]
        )
    return refused.value


def test_images_make_a_dict_context_and_cannot_go_with_a_named_context() -> None:
    from recursa.context import build_payload
    from recursa.errors import ContextError
    from recursa.serve.request import ApiError, parse_chat_request

    settings = ServeSettings(model="scripted/gpt5-like")
    image = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    body = {
        "model": "recursa",
        "messages": [
            {"role": "system", "content": "notes"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "q"},
                    image,
                    {"type": "image_url", "image_url": {"url": URL}},
                ],
            },
        ],
    }
    req = parse_chat_request(body, settings)
    assert req.question == "q" and req.context["messages[0] (system)"] == "notes"
    assert req.context["image-1.png"] == PNG and URL in req.context["image-2"]
    payload = build_payload(req.context)  # the run's context: the image by name, its line in the buffer
    assert list(payload.images) == ["image-1.png"] and b"image/png, 1,032 bytes" in payload.read_bytes()
    with pytest.raises(ApiError) as refused:
        parse_chat_request({**body, "recursa": {"context": "elsewhere"}}, settings)
    assert refused.value.param == "messages[1].content[1]" and "recursa.context" in refused.value.message
    with pytest.raises(ContextError, match=r"key 'scan\.png' is bytes but not a PNG, JPEG, GIF or WebP image"):
        build_payload({"notes": "x", "scan.png": b"not an image"})
