"""The image parts of a request, in each API's form (Chat Completions' `image_url` parts, Responses'
`input_image` parts, Messages' `image` blocks), made images of the run's context.

An image's bytes (base64, or a `data:` URL) are checked as `llm_query(images=...)` checks them (a
PNG, JPEG, GIF or WebP image of at most MAX_IMAGE_BYTES) and become a value of the context, named
`image-<n>.<ext>` in the order the request gives them: the code shows one to a sub-model with
`llm_query(prompt, images=[name])`. An image URL is held to llm_query's URL policy and listed in the
context by its URL, which the code passes to llm_query: recursa fetches it there, from the address
it checked (recursa.lm.images), and no provider is sent the URL. A request holds at most
`ServeSettings.max_images` images of at most `max_image_bytes` together; past either it is a 400
naming the image's field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

from recursa.lm.images import MAX_IMAGE_BYTES, ImageError, bytes_part, url_part
from recursa.serve.api_error import bad
from recursa.serve.settings import ServeSettings

_EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp"}
_HOW = "send the image's bytes as base64 (a data:image/...;base64 URL) or an https:// URL"


@dataclass(frozen=True)
class InlineImage:
    """One image part of a request: its bytes or its URL, and the request field it came from."""

    where: str
    data: bytes | None = None
    media_type: str | None = None
    url: str | None = None

    def fingerprint(self) -> str:
        return self.url if self.url is not None else "sha256:" + hashlib.sha256(self.data or b"").hexdigest()


def chat_image(part: dict[str, Any], at: str) -> InlineImage:
    """`{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (Chat Completions)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else None
    if not isinstance(url, str) or not url:
        raise bad(f"{at}.image_url.url must be the image as a data: URL or an https:// URL", at)
    return _url_or_data(url, at, ".image_url.url")


def responses_image(part: dict[str, Any], at: str) -> InlineImage:
    """`{"type": "input_image", "image_url": ..., "detail": ...}` (Responses)."""
    url = part.get("image_url")
    if part.get("file_id") and not url:
        raise bad(f"{at}: file_id references are not supported here; {_HOW} in image_url", at)
    if not isinstance(url, str) or not url:
        raise bad(f"{at}.image_url must be the image as a data: URL or an https:// URL", at)
    return _url_or_data(url, at, ".image_url")


def anthropic_image(block: dict[str, Any], at: str) -> InlineImage:
    """`{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}`."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        return _decoded(source.get("data"), at, ".source.data")
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return _checked_url(source["url"], at)
    if kind == "file":
        raise bad(f"{at}: file sources are not supported here; {_HOW.replace('a data:image/...;base64 URL', 'a base64 source')}", at)
    raise bad(f'{at}.source must be {{"type": "base64", "media_type": ..., "data": ...}} or {{"type": "url", "url": ...}}', at)


def _url_or_data(url: str, at: str, holder: str) -> InlineImage:
    if url.startswith("data:"):
        head, comma, data = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise bad(f"{at}{holder} must be a data:image/<type>;base64,<data> URL", at)
        return _decoded(data, at, holder)
    return _checked_url(url, at)


def base64_image(data: Any, at: str, holder: str = "") -> InlineImage:
    """An image from its bytes in base64 (an ACP prompt's image block, an Anthropic base64 source)."""
    return _decoded(data, at, holder)


def _decoded(data: Any, at: str, holder: str) -> InlineImage:
    if not isinstance(data, str) or not data:
        raise bad(f"{at}{holder} must be the image's bytes in base64", at)
    if len(data) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4:  # refused before it is decoded
        raise bad(f"{at}: the image is over {MAX_IMAGE_BYTES:,} bytes, the most a model takes; send a smaller one", at)
    try:
        raw = base64.b64decode(data, validate=True)
        part = bytes_part(raw, at)
    except (binascii.Error, ValueError) as exc:
        said = str(exc) if isinstance(exc, ImageError) else f"{at}{holder} is not valid base64"
        raise bad(f"{said}; {_HOW}", at) from None
    return InlineImage(at, data=raw, media_type=part["media_type"])


def _checked_url(url: str, at: str) -> InlineImage:
    try:
        url_part(url, at)
    except ImageError as exc:
        raise bad(str(exc), at) from None
    return InlineImage(at, url=url)


def context_images(images: list[InlineImage], settings: ServeSettings) -> dict[str, bytes | str]:
    """The request's images as values of its context, by name, within the server's bounds."""
    if len(images) > settings.max_images:
        at = images[settings.max_images].where
        raise bad(
            f"{at}: a request may hold at most {settings.max_images} images on this server "
            f"(ServeSettings.max_images, --max-images); send fewer, or one request per batch",
            at,
        )
    out: dict[str, bytes | str] = {}
    total = 0
    for n, image in enumerate(images, 1):
        if image.data is not None:
            total += len(image.data)
            if total > settings.max_image_bytes:
                raise bad(
                    f"{image.where}: the request's images pass {settings.max_image_bytes:,} bytes together, "
                    "the most this server takes (ServeSettings.max_image_bytes, --max-image-bytes); send fewer "
                    "or smaller images",
                    image.where,
                )
            out[f"image-{n}{_EXTENSIONS.get(image.media_type or '', '')}"] = image.data
        else:
            assert image.url is not None
            out[f"image-{n}"] = (
                f"[image at {image.url}. Show it to a sub-model with llm_query(prompt, images=[{image.url!r}])]"
            )
    return out
