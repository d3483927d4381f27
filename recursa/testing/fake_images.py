"""The images of a fake-server request, read and checked in each provider's own format."""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any

# What the fake bills per image: OpenAI's price of a 512x512 image at high detail.
IMAGE_TOKENS = 765


def images_of(api: str, content: Any) -> list[str]:
    """Each image of a message in the provider's own format, checked as the provider checks it:
    "sha256:<hex>" of the bytes sent, or the URL. A malformed image part is a 400."""
    if not isinstance(content, list):
        return []
    out: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        if api == "openai" and block.get("type") == "image_url":
            url = (block.get("image_url") or {}).get("url")
            if not isinstance(url, str):
                raise ValueError("an image_url part needs image_url.url")
            if url.startswith("data:"):
                head, _, data = url.partition(",")
                if not head.startswith("data:image/") or not head.endswith(";base64"):
                    raise ValueError("an image data URL must be data:image/<type>;base64,<data>")
                out.append(_digest(data))
            elif url.startswith("https://"):
                out.append(url)
            else:
                raise ValueError("image_url.url must be an https URL or a data URL")
        elif api == "anthropic" and block.get("type") == "image":
            source = block.get("source") or {}
            if source.get("type") == "base64" and str(source.get("media_type", "")).startswith("image/"):
                out.append(_digest(str(source.get("data"))))
            elif source.get("type") == "url" and str(source.get("url", "")).startswith("https://"):
                out.append(source["url"])
            else:
                raise ValueError("an image block needs a base64 source with media_type, or a url source")
        elif block.get("type") in ("image_url", "image", "input_image"):
            raise ValueError(f"{block.get('type')!r} parts are not this API's image format")
    return out


def _digest(data: str) -> str:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image data is not valid base64") from None
    return "sha256:" + hashlib.sha256(raw).hexdigest()
