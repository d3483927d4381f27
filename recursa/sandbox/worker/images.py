"""llm_query's `images=`: what the code passes, made ready to cross the channel as JSON.

Bytes travel as base64; a str starting with http:// or https:// is a URL; any other str or path is
a file of the context (a folder context's image, by its name there). The host reads the files,
checks the URLs against its policy and sends each provider its own format.
"""

from __future__ import annotations

import base64
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USAGE = "llm_query(prompt, images=[...]) takes image bytes, names of the context's image files, or https:// URLs"


def images_arg(images: Any) -> list[dict[str, str]] | None:
    if images is None:
        return None
    if isinstance(images, (bytes, bytearray, memoryview, str, os.PathLike)):
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise TypeError(f"{USAGE}; got {type(images).__name__}")
    out: list[dict[str, str]] = []
    for i, item in enumerate(images):
        if isinstance(item, (bytes, bytearray, memoryview)):
            out.append({"data": base64.b64encode(bytes(item)).decode("ascii")})
        elif isinstance(item, os.PathLike):
            out.append({"path": os.fspath(item)})
        elif isinstance(item, str):
            out.append({"url": item} if item.startswith(("http://", "https://")) else {"path": item})
        else:
            raise TypeError(f"{USAGE}; images[{i}] is {type(item).__name__}")
    return out
