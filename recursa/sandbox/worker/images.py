"""llm_query's `images=`: what the code passes, made ready to cross the channel as JSON.

Bytes travel as base64; a str starting with http:// or https:// is a URL; any other str or path is
a file of the context (a folder context's image, by its name there). The host reads the files,
checks the URLs against its policy and sends each provider its own format.

llm_query_batched's `images[i]` goes with `prompts[i]` (one image, a list of them, or None), as
rlm_query_batched's `contexts[i]` does. Bytes given for several prompts (the same object, e.g.
`[page] * len(prompts)`) cross the channel once: the prompts' parts refer to them by index.
"""

from __future__ import annotations

import base64
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USAGE = "llm_query(prompt, images=[...]) takes image bytes, names of the context's image files, or https:// URLs"
BATCH_USAGE = (
    "llm_query_batched(prompts, images=[...]) takes one entry per prompt, images[i] going with prompts[i]: "
    "one image (bytes, the name of a context image file, an https:// URL), a list of them, or None"
)
_ONE = (bytes, bytearray, memoryview, str, os.PathLike)


def images_arg(images: Any) -> list[dict[str, Any]] | None:
    if images is None:
        return None
    return _parts(images, "images", USAGE, None)


def batch_images_arg(images: Any, count: int) -> tuple[list[list[dict[str, Any]] | None], list[str]]:
    """(each prompt's image parts, the base64 of every distinct bytes object they refer to)."""
    if not isinstance(images, (list, tuple)) or len(images) != count:
        got = f"a list of {len(images)}" if isinstance(images, (list, tuple)) else type(images).__name__
        raise ValueError(f"{BATCH_USAGE}; got {got} for {count} prompts")
    blobs: dict[int, tuple[int, str]] = {}  # id of a bytes object -> (its index, its base64)
    lists = [None if entry is None else _parts(entry, f"images[{i}]", BATCH_USAGE, blobs) for i, entry in enumerate(images)]
    return lists, [data for _, data in sorted(blobs.values())]


def _parts(images: Any, where: str, usage: str, blobs: dict[int, tuple[int, str]] | None) -> list[dict[str, Any]]:
    if isinstance(images, _ONE):
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise TypeError(f"{usage}; {where} is {type(images).__name__}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(images):
        if isinstance(item, (bytes, bytearray, memoryview)):
            if blobs is None:
                out.append({"data": base64.b64encode(bytes(item)).decode("ascii")})
            else:
                if id(item) not in blobs:
                    blobs[id(item)] = (len(blobs), base64.b64encode(bytes(item)).decode("ascii"))
                out.append({"blob": blobs[id(item)][0]})
        elif isinstance(item, os.PathLike):
            out.append({"path": os.fspath(item)})
        elif isinstance(item, str):
            out.append({"url": item} if item.startswith(("http://", "https://")) else {"path": item})
        else:
            raise TypeError(f"{usage}; {where}[{i}] is {type(item).__name__}")
    return out
