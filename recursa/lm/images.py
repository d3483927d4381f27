"""Images in model calls: recursa's one content-part shape, and each provider's form of it.

A message's `content` is a str, or a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image", "media_type": ..., "data": <base64>, "sha256": ..., "bytes": n}` (image bytes,
with the `url` they were fetched from, if any). `{"type": "image", "url": ...}` is an image still to
fetch: it never reaches a provider. OpenAI-compatible servers get `image_url` parts (bytes as a data
URL), Anthropic `image` blocks with a base64 source. Traces and error messages show an image as a
reference (its URL, media type, size, sha256), never its bytes.

Image URLs come from generated code, so they are held to a policy, and no provider ever fetches
one: https only, a host name (no IP literal in any spelling, no "localhost"), and recursa fetches
the image itself (`fetched_parts`, through recursa.public_fetch: every address the name resolves to
must be public, and the connection goes to the address that was checked), within MAX_IMAGE_BYTES,
IMAGE_FETCH_TIMEOUT_S and an image Content-Type, and sends the provider the bytes. A self-hosted
model server (vLLM, SGLang) would otherwise fetch the URL from inside the operator's network,
resolving the name again: a name that answers differently a moment later (DNS rebinding) led there.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import re
from typing import Any
from urllib.parse import urlsplit

from recursa.confined import image_type

MAX_IMAGE_BYTES = 5 * 1024 * 1024  # Anthropic's limit per image; OpenAI's is higher


class ImageError(ValueError):
    """An image that cannot be sent; the message names the image and the fix."""


def bytes_part(data: bytes, where: str) -> dict[str, Any]:
    """An image part of raw bytes; ImageError if they are not an image the providers take."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where} is {len(data):,} bytes; images may be at most {MAX_IMAGE_BYTES:,} bytes")
    kind = image_type(data)
    if kind is None:
        raise ImageError(f"{where} is not a PNG, JPEG, GIF or WebP image")
    return {
        "type": "image",
        "media_type": kind,
        "data": base64.b64encode(data).decode("ascii"),
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }


def base64_part(text: str, where: str) -> dict[str, Any]:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where} is not valid base64") from None
    return bytes_part(data, where)


def url_part(url: str, where: str) -> dict[str, Any]:
    """An image to fetch (`fetched_parts`) before any call, if the URL policy (module doc) allows it."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme != "https" or not host:
        raise ImageError(f"{where}: image URLs must be https:// URLs, got {url[:100]!r}")
    if host == "localhost" or host.endswith(".localhost") or _is_ip(host) or "." not in host:
        raise ImageError(
            f"{where}: {host!r} is not a public host name; image URLs must name a public host "
            "(pass the image's bytes instead)"
        )
    return {"type": "image", "url": url}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        # 2130706433, 127.1, 0x7f.0.0.1, 0177.1: the numeric forms resolvers take (inet_aton's)
        return all(_NUMERIC_LABEL.fullmatch(label) for label in host.split("."))
    return True


_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
IMAGE_FETCH_TIMEOUT_S = 30.0  # one image URL's fetch, redirects included
# What the fetched images of one call tree's calls may hold at once, fetches in flight included (as
# much as a REPL's call frames in flight may: recursa.sandbox.connection.MAX_CALL_BYTES_IN_FLIGHT).
MAX_HELD_BYTES = 256 << 20
_FETCHES_AT_ONCE = 8  # per call


class ImageHold:
    """The bytes of fetched images that one call tree's model calls hold until they are answered.
    Each fetch reserves MAX_IMAGE_BYTES before it starts and gives back what the image did not
    need, so hundreds of calls from a REPL's threads cannot each bring in images at once."""

    def __init__(self, limit: int = MAX_HELD_BYTES) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int, where: str) -> None:
        if self.held + size > self.limit:
            raise ImageError(
                f"{where}: this run's calls in flight hold {self.held:,} bytes of fetched images, and "
                f"{self.limit:,} is the most they may; wait for some calls to finish, or send fewer images"
            )
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size


async def fetched_parts(
    groups: list[list[dict[str, Any]]], where: str, hold: ImageHold
) -> tuple[list[list[dict[str, Any]]], int]:
    """`groups` (each prompt's parts) with every URL part replaced by the image's bytes, fetched here
    (module doc), each distinct URL once; and the bytes they took from `hold`, which the caller gives
    back once its calls are answered. ImageError names the first URL that could not be had (what the
    others took is given back then)."""
    urls = list(dict.fromkeys(p["url"] for parts in groups for p in parts if "url" in p and "data" not in p))
    if not urls:
        return groups, 0
    # Imported here: the fetcher brings aiohttp (a quarter second), which only runs that send
    # image URLs need.
    from recursa.public_fetch import FetchError, fetch_public

    gate = asyncio.Semaphore(_FETCHES_AT_ONCE)
    held = 0

    async def one(url: str) -> dict[str, Any]:
        nonlocal held
        at = f"{where}: the image at {url[:100]!r}"
        async with gate:
            hold.take(MAX_IMAGE_BYTES, where)
            held += MAX_IMAGE_BYTES
            try:
                got = await fetch_public(
                    url,
                    what=at,
                    max_bytes=MAX_IMAGE_BYTES,
                    timeout_s=IMAGE_FETCH_TIMEOUT_S,
                    schemes=("https",),
                    accept=("image/",),
                    private_hint=" (image URLs must name a public host; pass the image's bytes instead)",
                )
            except FetchError as exc:
                raise ImageError(exc.message) from None
            spare = MAX_IMAGE_BYTES - len(got.data)
            hold.give(spare)
            held -= spare
        return {**bytes_part(got.data, at), "url": url}

    try:
        async with asyncio.TaskGroup() as group:  # the first failure cancels the other fetches
            tasks = [group.create_task(one(url)) for url in urls]
    except BaseException as exc:
        hold.give(held)
        refused = _first_image_error(exc)
        if refused is not None:
            raise refused from None
        raise
    parts = {url: task.result() for url, task in zip(urls, tasks, strict=True)}
    return [[parts[p["url"]] if "url" in p and "data" not in p else p for p in group] for group in groups], held


def _first_image_error(exc: BaseException) -> ImageError | None:
    if isinstance(exc, ImageError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next(filter(None, map(_first_image_error, exc.exceptions)), None)
    return None


def is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def reference(part: dict[str, Any]) -> str:
    """How traces and messages name an image: never its bytes."""
    source = f" from {part['url'][:200]}" if "url" in part else ""
    if "data" not in part:
        return f"[image{source}]"
    return f"[image{source} {part.get('media_type')} {part.get('bytes', 0):,} bytes sha256:{str(part.get('sha256'))[:16]}]"


def content_text(content: Any) -> str:
    """A content's text with each image as its reference."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(reference(p) if is_image(p) else str(p.get("text") or "") for p in content)
    return ""


def openai_content(content: Any) -> Any:
    """Content parts as the Chat Completions API takes them (a str stays a str)."""
    if not isinstance(content, list):
        return content
    out: list[dict[str, Any]] = []
    for part in content:
        if not is_image(part):
            out.append({"type": "text", "text": part.get("text") or ""})
        else:
            data_url = f"data:{part['media_type']};base64,{_data(part)}"
            out.append({"type": "image_url", "image_url": {"url": data_url}})
    return out


def anthropic_content(content: Any) -> Any:
    """Content parts as the Messages API takes them (a str stays a str)."""
    if not isinstance(content, list):
        return content
    out: list[dict[str, Any]] = []
    for part in content:
        if not is_image(part):
            out.append({"type": "text", "text": part.get("text") or "(empty)"})
        else:
            source = {"type": "base64", "media_type": part["media_type"], "data": _data(part)}
            out.append({"type": "image", "source": source})
    return out


def _data(part: dict[str, Any]) -> str:
    """An image's base64; a URL part that was never fetched is refused, never passed on (module doc)."""
    if "data" not in part:
        raise ImageError(f"{reference(part)} was not fetched; recursa sends providers image bytes, never URLs")
    return str(part["data"])


def image_refs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a trace keeps of a call's images: the reference fields, never the bytes."""
    return [
        {k: v for k, v in part.items() if k != "data"}
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if is_image(part)
    ]
