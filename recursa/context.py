"""Turn what the user passed as a context into one UTF-8 buffer the REPL process maps once.

The buffer lives in a memfd (an anonymous in-memory file; a deleted temp file off Linux). The
local worker reads each piece straight into its own str and frees the buffer's pages as it goes
(`ContextPayload.rebuild` encodes the context again should a restarted worker need it), so a 1 GB
context is in memory once, not twice, and costs no copy per turn. The root model never sees the
buffer, only `ContextInfo`, which is known before the buffer is written: `defer_payload` (an
environment's episode starts) writes and hashes it on a helper thread while the REPL starts.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.confined import ConfinedPath, image_entry, image_type, read_context_path
from recursa.errors import ContextError

# Encoded piece by piece: the host's transient copy is a few of these (a slice, its bytes, the
# previous chunk being hashed), 6 MB at this size; 2-8 M chars encode a GB equally fast (0.67 s).
_CHUNK_CHARS = 2 * 1024 * 1024
PREFIX_CHARS = 300


@dataclass
class ContextInfo:
    """Constant-size facts about a context, shown to the root instead of the context."""

    type_name: str  # "str" | "list" | "dict"
    total_chars: int
    chunk_lengths: list[int]  # characters per element for list/dict contexts
    keys: list[str]  # dict keys (empty for other kinds)
    prefix: str
    sha256: str
    skipped_files: list[str] = field(default_factory=list)
    folder: bool = False  # read from a folder: the dict's keys are its files' relative paths

    def to_trace(self) -> dict[str, Any]:
        """What a trace stores about the context: never the context itself."""
        return {
            "type": self.type_name,
            "total_chars": self.total_chars,
            "n_chunks": len(self.chunk_lengths),
            "sha256": self.sha256,
            "prefix": self.prefix,
            **({"skipped_files": self.skipped_files[:100]} if self.skipped_files else {}),
        }


@dataclass
class ContextPayload:
    """The encoded context: `fd` holds the UTF-8 bytes, `spans` how to cut them into pieces."""

    kind: str  # "str" | "list" | "dict"
    fd: int
    size_bytes: int
    byte_lengths: list[int]  # one per piece (a single piece for "str")
    keys: list[str]
    info: ContextInfo
    # Encodes the same context again, for a sandbox that lets the REPL free the buffer as it reads it
    # (then restarts the REPL from a fresh one). None for a context read from a file: rereading it
    # might give other bytes, so that buffer is kept instead.
    rebuild: Callable[[], ContextPayload] | None = field(default=None, repr=False)
    released: bool = False  # the REPL freed the bytes while loading them: build it again to reuse
    # A folder's image files, or a dict context's image values, by name: kept on the host for
    # llm_query(images=[name]).
    images: dict[str, bytes] = field(default_factory=dict, repr=False)
    # Set while a helper thread writes the bytes (`defer_payload`): until `ready()` or `settle()`
    # has taken its result, `size_bytes`, `byte_lengths` and `info.sha256` are not known (0, [], "").
    pending: Future[Written] | None = field(default=None, repr=False)

    async def ready(self) -> None:
        """Wait until the bytes are written (at once unless `pending`); a failed write raises
        ContextError. Shielded: a cancelled waiter leaves the write, which other copies share, going."""
        if self.pending is not None:
            try:
                await asyncio.shield(asyncio.wrap_future(self.pending))
            except OSError as exc:
                raise ContextError(f"the context could not be written into its buffer: {exc}") from None
            self.settle()

    def when_written(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the running event loop once the bytes are written, or failed to be."""
        assert self.pending is not None
        loop = asyncio.get_running_loop()

        def done(_: Future[Written]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
                loop.call_soon_threadsafe(callback)

        self.pending.add_done_callback(done)

    def settle(self) -> bool:
        """Take the written bytes' facts if they are ready, without waiting; True once complete."""
        pending = self.pending
        if pending is None:
            return True
        if not pending.done() or pending.exception() is not None:
            return False
        written = pending.result()
        self.size_bytes, self.byte_lengths = written.size_bytes, list(written.byte_lengths)
        self.info.sha256 = written.sha256
        self.pending = None
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_bytes(self) -> bytes:
        """The whole buffer (for adapters that stream it, e.g. containers, or the in-process REPL)."""
        if self.released:
            raise ValueError("this context payload was released into a REPL; build it again")
        if self.pending is not None:
            self.pending.result()  # raises what the write raised
            self.settle()
        return os.pread(self.fd, self.size_bytes, 0) if self.size_bytes else b""

    def __del__(self) -> None:  # a payload dropped without close() must not leak its memfd
        try:
            self.close()
        except OSError:
            pass


def _new_buffer_fd() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("recursa-context", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="recursa-context-")
    os.unlink(path)
    return fd


def _str_chunks(text: str) -> Iterator[str]:
    for start in range(0, len(text), _CHUNK_CHARS):
        yield text[start : start + _CHUNK_CHARS]


class _Writer:
    """Writes the buffer and hashes it; large chunks are hashed on a helper thread while the next
    write runs (both release the GIL), which takes ~0.5 s off a 1 GB context on two cores."""

    _THREADED_HASH_BYTES = 1 << 20

    def __init__(self, fd: int | None = None) -> None:
        self.fd = _new_buffer_fd() if fd is None else fd
        self.size = 0
        self._hash = hashlib.sha256()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def write(self, data: bytes | memoryview) -> None:
        if self._pending is not None:
            self._pending.result()  # in order, and at most one chunk waiting
            self._pending = None
        if len(data) >= self._THREADED_HASH_BYTES:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="recursa-context-hash")
            self._pending = self._pool.submit(self._hash.update, data)
        else:
            self._hash.update(data)
        view = memoryview(data)
        while view:  # at its own offset: the descriptor's may be shared with a dup (defer_payload)
            written = os.pwrite(self.fd, view, self.size)
            view = view[written:]
            self.size += written

    def hexdigest(self) -> str:
        self.close_pool()
        return self._hash.hexdigest()

    def close_pool(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _write_text(writer: _Writer, text: str) -> int:
    before = writer.size
    for piece in _str_chunks(text):
        writer.write(piece.encode("utf-8", "surrogatepass"))
    return writer.size - before


def _validated_bytes_len(data: bytes) -> int:
    """Characters in UTF-8 `data`, validating it chunk by chunk instead of decoding it whole."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    chars = 0
    view = memoryview(data)
    step = 4 * _CHUNK_CHARS
    try:
        for start in range(0, len(view), step):
            chars += len(decoder.decode(view[start : start + step], final=start + step >= len(view)))
    except UnicodeDecodeError as exc:
        raise ContextError(
            f"the context bytes are not valid UTF-8 ({exc.reason} near byte {start + exc.start}). "
            "Decode them yourself (e.g. data.decode('latin-1')) and pass a str."
        ) from None
    return chars


@dataclass
class Written:
    """What writing a context's pieces into its buffer found out."""

    size_bytes: int
    byte_lengths: list[int]
    sha256: str


@dataclass
class _Pieces:
    """A str, list or dict context checked piece by piece: what the root is told about it, known
    before a byte is written, and the texts to write."""

    kind: str
    texts: list[str]
    keys: list[str]
    info: ContextInfo  # its sha256 is "" until the texts are written


def _pieces(context: Any, skipped: list[str]) -> _Pieces:
    kind, items = _items(context)
    texts: list[str] = []
    char_lengths: list[int] = []
    keys: list[str] = []
    prefix = ""
    for key, text in items:
        if not isinstance(text, str):
            where = f"element {len(keys)}" if kind == "list" else f"value of key {key!r}"
            nested = isinstance(text, (list, tuple, dict, set))
            raise ContextError(
                f"context {where} is {type(text).__name__}, not str"
                + (" (nested contexts are not supported)" if nested else "")
                + ". Contexts are str, list[str], dict[str, str], bytes or a pathlib.Path; "
                "convert the element to text first (e.g. json.dumps(element)), or flatten the "
                "structure into one str per piece."
            )
        keys.append(key if kind == "dict" else "")
        texts.append(text)
        char_lengths.append(len(text))
        if len(prefix) < PREFIX_CHARS:
            prefix += text[: PREFIX_CHARS - len(prefix)]
    if kind == "list":
        keys = []
    info = ContextInfo(
        type_name=kind,
        total_chars=sum(char_lengths),
        chunk_lengths=char_lengths,
        keys=[_encodable(k) for k in keys],
        prefix=_encodable(prefix),
        sha256="",
        skipped_files=skipped,
    )
    return _Pieces(kind, texts, keys, info)


def _write_texts(writer: _Writer, texts: list[str]) -> Written:
    try:
        byte_lengths = [_write_text(writer, text) for text in texts]
    finally:
        writer.close_pool()
    return Written(writer.size, byte_lengths, writer.hexdigest())


def _write_deferred(fd: int, texts: list[str]) -> Written:
    try:
        return _write_texts(_Writer(fd), texts)
    finally:
        os.close(fd)


def defer_payload(context: Any, executor: Executor) -> ContextPayload | None:
    """`build_payload` of a str, or of a list or dict of str small enough to check on the event
    loop, whose bytes are written and hashed on `executor`: the facts the root is shown, and any
    error in the context, are known on return; the buffer once `payload.ready()` returns. None for
    other contexts (bytes, images, paths, many pieces): `load_payload` builds those."""
    if not isinstance(context, str) and (
        not isinstance(context, list | tuple | dict) or _is_large(context) or _has_images(context)
    ):
        return None
    if _blank(context):
        raise ContextError(_EMPTY if not context else _BLANK)
    pieces = _pieces(context, [])  # its texts: a snapshot of a list or dict the caller may change next
    fd, own = _new_buffer_fd(), -1
    try:
        # The writer's own descriptor: the payload may be closed (its episode with it) mid-write.
        own = os.dup(fd)
        pending = executor.submit(_write_deferred, own, pieces.texts)
    except BaseException:
        for unused in (own, fd):
            if unused >= 0:
                os.close(unused)
        raise
    payload = ContextPayload(pieces.kind, fd, 0, [], pieces.keys, pieces.info, pending=pending)
    payload.rebuild = functools.partial(_encode_again, context, payload.info)
    return payload


def context_text(context: Any) -> str:
    """A context as one text for a prompt (a sub-call's, a baseline's): list elements, and dict
    entries under their keys, in order."""
    if isinstance(context, str):
        return context
    if isinstance(context, dict):
        return "\n\n".join(f"### {k}\n{v}" for k, v in context.items())
    if isinstance(context, list | tuple):
        return "\n\n".join(str(item) for item in context)
    return str(context)


def build_payload(context: Any) -> ContextPayload:
    """Encode a user context. Raises `ContextError` with the fix in the message."""
    payload = _encode(context)
    if not isinstance(context, (Path, ConfinedPath)):
        # The caller's own object, not a copy: encoding it again costs no memory until needed.
        payload.rebuild = functools.partial(_encode_again, context, payload.info)
    return payload


def _encode_again(context: Any, first: ContextInfo) -> ContextPayload:
    """The context encoded again for a restarted REPL; `first` is what its first encoding found
    (its sha256 is read now: a deferred payload knows it once written)."""
    payload = _encode(context)
    if payload.info.sha256 != first.sha256:
        payload.close()
        raise ContextError(
            "the context object changed after the run started, so the REPL cannot load it again "
            "after a restart; pass a copy (e.g. list(pieces)) if you keep changing the original."
        )
    return payload


def _encode(context: Any) -> ContextPayload:
    if isinstance(context, (Path, ConfinedPath)):
        images: dict[str, bytes] = {}
        text, skipped = read_context_path(context, images)
        payload = _encode_value(text, skipped)
        payload.images = images
        payload.info.folder = isinstance(text, dict)
        return payload
    if _has_images(context):
        return _with_images(context)
    return _encode_value(context, [])


def _has_images(context: Any) -> bool:
    return isinstance(context, dict) and any(isinstance(v, (bytes, bytearray, memoryview)) for v in context.values())


def _with_images(context: dict[Any, Any]) -> ContextPayload:
    """A dict context whose values may be image bytes: each image is listed as a folder's image
    file is, and kept on the host by its key for llm_query(images=[key])."""
    text: dict[Any, Any] = {}
    images: dict[str, bytes] = {}
    for key, value in context.items():
        if isinstance(value, (bytes, bytearray, memoryview)) and isinstance(key, str):
            data = bytes(value)
            kind = image_type(data)
            if kind is None:
                raise ContextError(
                    f"context value of key {key!r} is bytes but not a PNG, JPEG, GIF or WebP image; a dict "
                    "context's values are str, or image bytes (decode text with .decode('utf-8'))."
                )
            images[key] = data
            value = image_entry(key, kind, len(data))
        text[key] = value
    payload = _encode_value(text, [])
    payload.images = images
    return payload


def _encode_value(context: Any, skipped: list[str]) -> ContextPayload:
    if _blank(context):
        raise ContextError(_EMPTY if not context else _BLANK)
    if isinstance(context, (bytes, bytearray, memoryview)):
        data = bytes(context)
        chars = _validated_bytes_len(data)
        if chars == 0:
            raise ContextError(_EMPTY)
        writer = _Writer()
        writer.write(data)
        prefix = data[: PREFIX_CHARS * 4].decode("utf-8", "ignore")[:PREFIX_CHARS]
        info = ContextInfo("str", chars, [chars], [], prefix, writer.hexdigest())
        return ContextPayload("str", writer.fd, writer.size, [writer.size], [], info)
    pieces = _pieces(context, skipped)
    writer = _Writer()
    try:
        written = _write_texts(writer, pieces.texts)
    except BaseException:
        os.close(writer.fd)
        raise
    pieces.info.sha256 = written.sha256
    return ContextPayload(
        pieces.kind, writer.fd, written.size_bytes, written.byte_lengths, pieces.keys, pieces.info
    )


def _items(context: Any) -> tuple[str, Iterable[tuple[str, Any]]]:
    """The kind of a str, list or dict context and its (key, piece) pairs; ContextError otherwise."""
    if isinstance(context, str | list | tuple | dict) and not context:
        raise ContextError(_EMPTY)
    if isinstance(context, str):
        return "str", [("", context)]
    if isinstance(context, (list, tuple)):
        return "list", (("", item) for item in context)
    if isinstance(context, dict):
        for key in context:
            if not isinstance(key, str):
                raise ContextError(
                    f"context dict key {key!r} is not a str; use str keys, e.g. "
                    "{str(k): v for k, v in context.items()}."
                )
        return "dict", context.items()
    hint = (
        " (a set has no order: pass sorted(...) of it as a list)"
        if isinstance(context, (set, frozenset))
        else ""
    )
    raise ContextError(
        f"unsupported context type {type(context).__name__}{hint}. Pass a str, list[str], dict[str, str], "
        "UTF-8 bytes, or a pathlib.Path to a file or folder."
    )


_EMPTY = "the context is empty; pass the text the question is about (or use llm directly for no context)."
_BLANK = (
    "the context holds no text, only whitespace or empty pieces; pass the text the question is about "
    "(check that the file or variable you meant is not empty)."
)


def _blank(context: Any) -> bool:
    """Empty or whitespace only. Stops at the first visible character, so a huge context costs nothing."""
    if isinstance(context, (str, bytes, bytearray)):
        return not context or context.isspace()
    if isinstance(context, (list, tuple, dict)):
        pieces = context.values() if isinstance(context, dict) else context
        return all(isinstance(p, str) and (not p or p.isspace()) for p in pieces)
    return False


def _encodable(text: str) -> str:
    """`text` with lone surrogates replaced: the buffer keeps them for the REPL, but a prompt or a
    trace line (strict UTF-8) cannot hold them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


# Contexts above this size are encoded off the event loop so other runs in the process keep going.
_ENCODE_IN_THREAD_CHARS = 4_000_000


async def load_payload(context: Any) -> ContextPayload:
    """`build_payload`, with big contexts encoded in a worker thread instead of on the event loop."""
    if _is_large(context):
        return await asyncio.to_thread(build_payload, context)
    return build_payload(context)


def _is_large(context: Any) -> bool:
    if isinstance(context, (Path, ConfinedPath)):
        return True
    if isinstance(context, (str, bytes, bytearray)):
        return len(context) > _ENCODE_IN_THREAD_CHARS
    return isinstance(context, (list, dict)) and len(context) > 10_000
