"""Loading the context into the REPL.

Peak memory is what matters at 1 GB: the decoded context plus one window of raw bytes. A mapping of
the whole buffer would count in this process's RSS next to the decoded text (2x); ASCII text is read
straight into the str object (1x).
"""

from __future__ import annotations

import codecs
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


_WINDOW = 16 * 1024 * 1024


class ContextSource:
    """Random-access reads of the context bytes: from an fd (memfd) or an in-memory buffer.

    With `release` (the host keeps no copy of the buffer) every range read from the fd is freed at
    once (a hole punched into the memfd), so the context is never in memory twice: the str being
    built grows as the buffer shrinks, window by window.
    """

    def __init__(self, fd: int = -1, buffer: Any = None, release: bool = False) -> None:
        self.fd = fd
        self.buffer = buffer
        self.release = release and fd >= 0

    def read(self, size: int, pos: int) -> bytes:
        if self.buffer is not None:
            return bytes(self.buffer[pos : pos + size])
        chunks = []
        while size > 0:
            data = os.pread(self.fd, min(size, _RELEASE_STEP if self.release else 1 << 30), pos)
            if not data:
                raise EOFError("the context buffer is shorter than announced")
            chunks.append(data)
            self._free(pos, len(data))
            size -= len(data)
            pos += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_into(self, target: memoryview, pos: int) -> None:
        if self.buffer is not None:
            target[:] = self.buffer[pos : pos + len(target)]
            return
        done, step = 0, _RELEASE_STEP if self.release else 1 << 30
        while done < len(target):
            got = os.preadv(self.fd, [target[done : done + step]], pos + done)
            if got <= 0:
                raise EOFError("the context buffer is shorter than announced")
            self._free(pos + done, got)
            done += got

    def _free(self, pos: int, size: int) -> None:
        if self.release and not _punch_hole(self.fd, pos, size):
            self.release = False  # not supported here: the buffer goes when the load is done

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.buffer is not None and hasattr(self.buffer, "close"):
            self.buffer.close()
        self.buffer = None


# Read, then freed, this much at a time: the most the context is ever in memory twice.
_RELEASE_STEP = 4 * 1024 * 1024
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_fallocate: Any = None


def _punch_hole(fd: int, pos: int, size: int) -> bool:
    """Free the pages of bytes [pos, pos + size) of a memfd (Linux fallocate); False if unsupported."""
    global _fallocate
    if _fallocate is None:
        try:
            import ctypes

            _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
            _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (ImportError, OSError, AttributeError):
            _fallocate = False
    if not _fallocate:
        return False
    return _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, pos, size) == 0


def decode_pieces(source: ContextSource, byte_lengths: list[int], char_lengths: list[int]) -> list[str]:
    pieces: list[str] = []
    pos = i = 0
    while i < len(byte_lengths):
        n = byte_lengths[i]
        if n >= _WINDOW:
            ascii_only = i < len(char_lengths) and char_lengths[i] == n
            pieces.append(_read_large_piece(source, pos, n, ascii_only))
            pos += n
            i += 1
            continue
        j, total = i, 0
        while j < len(byte_lengths) and total + byte_lengths[j] <= _WINDOW:
            total += byte_lengths[j]
            j += 1
        window = source.read(total, pos)
        with memoryview(window) as view:
            offset = 0
            for k in range(i, j):
                m = byte_lengths[k]
                pieces.append(str(view[offset : offset + m], "utf-8", "surrogatepass"))
                offset += m
        del window
        pos += total
        i = j
    return pieces


def _read_large_piece(source: ContextSource, pos: int, size: int, ascii_only: bool) -> str:
    if ascii_only:
        text = _ascii_str_in_place(source, pos, size)
        if text is not None:
            return text
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    parts = []
    for start in range(0, size, _WINDOW):
        chunk = source.read(min(_WINDOW, size - start), pos + start)
        parts.append(decoder.decode(chunk, final=start + _WINDOW >= size))
        del chunk
    text = _join_in_huge_pages(parts)
    del parts
    return text


def _str_kind(part: str) -> int:
    """Bytes per character in `part`'s storage (1, 2 or 4), from its size: PEP 393, compact strs."""
    if part.isascii():
        return 1
    return (sys.getsizeof(part) - _COMPACT_HEADER) // (len(part) + 1)


_COMPACT_HEADER = sys.getsizeof("\xe9") - 2  # a non-ASCII compact str: header, 1 char, terminator
_WIDEN = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}


def _join_in_huge_pages(parts: list[str]) -> str:
    """Join `parts` into a str whose memory was advised for huge pages before it is written.

    A join fills its result at once, leaving it in 4 KiB pages that make every fork snapshot slow
    (see _advise_huge_pages). Here the result is allocated first, advised, then filled part by part,
    each part's characters widened to the result's width by encoding them (latin-1, UTF-16 or
    UTF-32 little-endian are exactly the 1-, 2- and 4-byte storage). Falls back to join without ctypes.
    """
    kind = max(map(_str_kind, parts), default=1)
    # The result must be canonical (PEP 393): ASCII-only text is stored and flagged as ASCII.
    ascii_only = all(part.isascii() for part in parts)
    maxchar = 0x7F if ascii_only else {1: 0xFF, 2: 0xFFFF, 4: 0x10FFFF}[kind]
    total = sum(map(len, parts))
    try:
        import ctypes

        new = ctypes.pythonapi.PyUnicode_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_ssize_t, ctypes.c_uint32]
        text = new(total, maxchar)
        if not total or _str_kind(text) != kind:
            return "".join(parts)
        data = id(text) + sys.getsizeof(text) - (total + 1) * kind  # the characters end the object
    except Exception:
        return "".join(parts)
    _advise_huge_pages(data, total * kind)
    offset = 0
    for part in parts:
        raw = part.encode(_WIDEN[kind], "surrogatepass")
        ctypes.memmove(data + offset, raw, len(raw))
        offset += len(raw)
        del raw
    return text


def _ascii_str_in_place(source: ContextSource, pos: int, size: int) -> str | None:
    """A fresh ASCII str whose character buffer the bytes are read straight into.

    UTF-8 of pure ASCII is the str's own storage, so this skips the second copy a decode needs.
    The str is filled before any other code can see it. Returns None where ctypes is unavailable.
    """
    try:
        import ctypes

        new = ctypes.pythonapi.PyUnicode_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_ssize_t, ctypes.c_uint32]
        text = new(size, 127)
        header = sys.getsizeof("") - 1  # a compact ASCII str's data follows its header
        storage = (ctypes.c_char * size).from_address(id(text) + header)
    except Exception:
        return None
    _advise_huge_pages(id(text) + header, size)  # before the first touch: faults take 2 MiB pages
    with memoryview(storage).cast("B") as target:
        source.read_into(target, pos)
    return text


_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14


def _advise_huge_pages(addr: int, length: int) -> None:
    """Ask for transparent huge pages over a large context piece (Linux; ignored elsewhere).

    With THP in "madvise" mode (the common default) a 1 GB str otherwise sits in 262,144 4 KiB
    pages, and every fork snapshot copies that many page-table entries; in 2 MiB pages it copies
    512 times fewer (docs/performance.md, "Figures behind choices in the code"), and filling the str takes 512 page faults instead of
    262,144. CPython allocates a str this large with mmap via malloc, so the
    range is anonymous private memory that the advice applies to.
    """
    start = (addr + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (addr + length) // _HUGE_PAGE * _HUGE_PAGE
    if end - start < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: an error changes nothing
    except (OSError, AttributeError):
        pass
