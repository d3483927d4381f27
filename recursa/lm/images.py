"""Images in model calls: recursa's one content-part shape, and each provider's form of it.

A message's `content` is a str, or a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image", "media_type": ..., "data": <base64>, "sha256": ..., "bytes": n}` (image bytes)
or `{"type": "image", "url": ...}` (an image the provider fetches). OpenAI-compatible servers get
`image_url` parts (bytes as a data URL), Anthropic `image` blocks with a base64 or url source.
Traces and error messages show an image as a reference (media type, size, sha256), never its bytes.

Image URLs come from generated code, so they are held to a policy before any provider sees them:
https only, a host name (no IP literal in any spelling, no "localhost"), and a name that resolves
here only to public addresses (recursa.addresses; `public_hosts`): a self-hosted model server
(vLLM, SGLang) fetches image URLs itself, from inside the operator's network, and a name such as
`127.0.0.1.nip.io` or an internal one leads there. The provider resolves the name again when it
fetches: a name that answers differently a moment later (DNS rebinding) is not covered, nor a name
this host cannot resolve (its resolver cannot say where it leads); pass the bytes where that matters.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import re
import socket
from typing import Any
from urllib.parse import urlsplit

from recursa.addresses import address_problem
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
    """An image the provider fetches, if the URL policy (module docstring) allows it."""
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
_RESOLVE_TIMEOUT_S = 10.0


async def public_hosts(parts: list[dict[str, Any]], where: str) -> None:
    """ImageError when the host of an image URL among `parts` resolves here to an address that is
    not public (see the module doc for what this does not cover)."""
    hosts = dict.fromkeys((urlsplit(p["url"]).hostname or "").rstrip(".") for p in parts if "url" in p)
    loop = asyncio.get_running_loop()
    for host in filter(None, hosts):
        try:
            async with asyncio.timeout(_RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError):
            continue  # unresolvable here: the provider's resolver may still know it
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            problem = address_problem(address)
            if problem is not None:
                raise ImageError(
                    f"{where}: the image URL's host {host[:100]!r} leads to {address} ({problem} address), "
                    "not to a public one; image URLs must name a public host (pass the image's bytes instead)"
                )


def is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def reference(part: dict[str, Any]) -> str:
    """How traces and messages name an image: never its bytes."""
    if "url" in part:
        return f"[image {part['url'][:200]}]"
    return f"[image {part.get('media_type')} {part.get('bytes', 0):,} bytes sha256:{str(part.get('sha256'))[:16]}]"


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
        elif "url" in part:
            out.append({"type": "image_url", "image_url": {"url": part["url"]}})
        else:
            data_url = f"data:{part['media_type']};base64,{part['data']}"
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
        elif "url" in part:
            out.append({"type": "image", "source": {"type": "url", "url": part["url"]}})
        else:
            source = {"type": "base64", "media_type": part["media_type"], "data": part["data"]}
            out.append({"type": "image", "source": source})
    return out


def image_refs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a trace keeps of a call's images: the reference fields, never the bytes."""
    return [
        {k: v for k, v in part.items() if k != "data"}
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if is_image(part)
    ]
