"""Reading a context file or folder without leaving it.

A folder handed over as a context may hold symbolic links that lead anywhere (a cloned repository,
a shared upload folder), and a folder a server may read can change while it is read. So a folder is
walked through open directory descriptors, each entry opened relative to its folder's descriptor
with `O_NOFOLLOW`: no name is resolved twice, so nothing can be swapped between a check and the
open. A link to a file is followed only when the file it opened lies inside the folder (its real
path read back from the open descriptor through /proc/self/fd; without /proc no link is followed).
Links to folders are never followed. What is left out is listed with the reason, never read.
A walk looks at no more than MAX_ENTRIES entries and MAX_DEPTH folders down (a shared folder may
hold a million empty files or a chain of ten thousand nested folders): past that the rest is left
out and the list says so, and no more than MAX_DEPTH folder descriptors are open at once.

`ConfinedPath` is what a server hands to a run for a path a client named: the allowed root and a
path inside it, read component by component from the root's descriptor, and files with other hard
links refused (a hard link inside the root may be another name of a file outside it).
"""

from __future__ import annotations

import errno
import io
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from recursa.errors import ContextError

_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0)
_O_PATH = getattr(os, "O_PATH", 0)
MAX_ENTRIES = 100_000  # names one folder context may look at, files and folders alike
MAX_DEPTH = 64  # folders below the top one


@dataclass(frozen=True)
class ConfinedPath:
    """A file or folder at `relative` inside `root`, to be read without leaving `root`.

    Pass it as a run's context where someone other than the operator named the path (a server
    does, for `context_path`). Every component below `root` is opened without following links;
    links inside the folder count only when they lead to a file inside `root`; regular files with
    more than one hard link are left out unless `allow_hard_links`.
    """

    root: Path
    relative: PurePosixPath = field(default_factory=lambda: PurePosixPath("."))
    allow_hard_links: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "relative", PurePosixPath(self.relative))
        if self.relative.is_absolute() or ".." in self.relative.parts:
            raise ValueError(f"ConfinedPath.relative must stay inside the root, got {str(self.relative)!r}")

    @property
    def path(self) -> Path:
        return self.root / self.relative

    def __str__(self) -> str:
        return str(self.path)


def read_context_path(
    target: Path | ConfinedPath, images: dict[str, bytes] | None = None
) -> tuple[str | dict[str, str], list[str]]:
    """The text of a file, or {relative name: text} for a folder, plus what was left out and why.

    A folder's image files (PNG, JPEG, GIF, WebP) are listed with a line saying what they are and
    how to show them to a sub-model; their bytes go into `images` by the same name."""
    if isinstance(target, ConfinedPath):
        fd, real_root = _open_confined(target)
        allow_hard_links = target.allow_hard_links
    else:
        fd, real_root = _open_named(target), None
        allow_hard_links = True
    where = f"context path {str(target)!r}"
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            walk = _Walk(real_root or _real_path(fd), allow_hard_links, _available_memory(), where)
            walk.folder(fd, "")
            if images is not None:
                images.update(walk.images)
            if not walk.files:
                raise ContextError(
                    f"context directory {str(target)!r} holds no UTF-8 text files"
                    + (
                        f" (skipped {len(walk.skipped)}: {', '.join(walk.skipped[:5])})"
                        if walk.skipped
                        else ""
                    )
                    + "; point the context at a folder of text files."
                )
            return walk.files, walk.skipped
        if not allow_hard_links and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            raise ContextError(
                f"{where} has other hard links, which may be names of files outside the allowed folders; "
                "this server does not read such files (copy the file instead of linking it)."
            )
        if not stat.S_ISREG(st.st_mode) and (isinstance(target, ConfinedPath) or _is_device(st)):
            raise ContextError(
                f"{where} is not a regular file; pass a file or a folder of text files "
                "(on the command line, --context - reads standard input)."
            )
        _check_fits(where, st.st_size, _available_memory())
        return _file_text(_read_fd(fd), f"context file {str(target)!r}"), []
    finally:
        os.close(fd)


def _open_named(path: Path) -> int:
    """Open a path the user named (links followed: the user chose it). A device is refused from
    its stat, before opening it could have side effects."""
    where = f"context path {str(path)!r}"
    if "\x00" in str(path):
        raise ContextError(f"{where} contains a NUL byte, which no file name can hold; check the path.")
    try:
        if _is_device(os.stat(path)):
            raise ContextError(
                f"{where} is a device, not a text file; pass a file or a folder of text files "
                "(on the command line, --context - reads standard input)."
            )
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ContextError(f"{where} does not exist; check the path.") from None
    except OSError as exc:
        raise ContextError(f"cannot read {where}: {exc.strerror}.") from None


def _open_confined(target: ConfinedPath) -> tuple[int, str]:
    """Descend from the root's descriptor one component at a time, following no link."""
    try:
        fd = os.open(target.root, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise ContextError(f"cannot open the allowed folder {str(target.root)!r}: {exc.strerror}.") from None
    real_root = _real_path(fd)
    parts = [p for p in target.relative.parts if p not in ("", ".")]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        try:
            nxt = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise ContextError(
                    f"context path {str(target)!r} passes through a symbolic link (it changed after it was "
                    "checked); name the file or folder itself."
                ) from None
            if exc.errno == errno.ENOENT:
                raise ContextError(f"context path {str(target)!r} does not exist; check the path.") from None
            raise ContextError(f"cannot read context path {str(target)!r}: {exc.strerror}.") from None
        os.close(fd)
        fd = nxt
    return fd, real_root


class _Walk:
    """One folder read: the texts found so far, what was left out, and the bytes read."""

    def __init__(self, real_root: str, allow_hard_links: bool, free: int | None, where: str) -> None:
        self.real_root = real_root.rstrip("/") + "/"
        self.allow_hard_links = allow_hard_links
        self.free = free
        self.where = where
        self.total = 0
        self.seen = 0  # names looked at (MAX_ENTRIES)
        self.truncated = False
        self.files: dict[str, str] = {}
        self.images: dict[str, bytes] = {}  # image files by name (their entry in files describes them)
        self.skipped: list[str] = []

    def folder(self, dir_fd: int, prefix: str, depth: int = 0) -> None:
        with os.scandir(dir_fd) as it:
            # Never more names than the walk may still look at (plus one, to know there were more).
            names = [e for _, e in zip(range(MAX_ENTRIES - self.seen + 1), it, strict=False)]
        entries = sorted(names, key=lambda e: e.name)
        for entry in entries:
            if self.seen >= MAX_ENTRIES:
                if not self.truncated:
                    self.truncated = True
                    self.skipped.append(
                        f"{prefix or './'}... (the rest: a folder context looks at no more than "
                        f"{MAX_ENTRIES:,} names; point it at a smaller folder)"
                    )
                return
            self.seen += 1
            if entry.name.startswith("."):  # .git and friends: not "the documents in this folder"
                continue
            rel = prefix + entry.name
            try:
                if entry.is_symlink():
                    fd: int | str = self._open_link(dir_fd, entry.name)
                elif entry.is_dir(follow_symlinks=False):
                    if depth >= MAX_DEPTH:
                        self.skipped.append(f"{rel}/ (more than {MAX_DEPTH} folders deep; not read)")
                        continue
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        self.folder(sub, rel + "/", depth + 1)
                    finally:
                        os.close(sub)
                    continue
                elif entry.is_file(follow_symlinks=False):
                    fd = os.open(entry.name, _FILE_FLAGS, dir_fd=dir_fd)
                else:  # a pipe, socket or device: not even opened (opening some has effects)
                    fd = "not a regular file"
            except OSError as exc:
                self.skipped.append(f"{rel} ({_why(exc)})")
                continue
            if isinstance(fd, str):
                self.skipped.append(f"{rel} ({fd})")
                continue
            try:
                self._file(fd, rel)
            finally:
                os.close(fd)

    def _file(self, fd: int, rel: str) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            self.skipped.append(f"{rel} (not a regular file)")
            return
        if not self.allow_hard_links and st.st_nlink > 1:
            self.skipped.append(f"{rel} (has other hard links; not read on a server)")
            return
        self.total += st.st_size
        _check_fits(self.where, self.total, self.free)
        try:
            data = _read_fd(fd)
            kind = image_type(data)
            if kind is not None:
                self.images[rel] = data
                self.files[rel] = image_entry(rel, kind, len(data))
                return
            text = as_text(data)
        except OSError as exc:
            self.skipped.append(f"{rel} ({exc.strerror})")
        except NotText as exc:
            self.skipped.append(f"{rel} ({exc.reason})")
        else:
            self.files[rel] = text

    def _open_link(self, dir_fd: int, name: str) -> int | str:
        """A descriptor for the file a link leads to when it lies inside the root, else the reason."""
        if not _O_PATH or not os.path.isdir("/proc/self/fd"):
            return "a symbolic link; links are followed only where /proc shows where they lead"
        try:
            # O_PATH opens nothing for reading: a link to a device or a pipe has no effect here.
            handle = os.open(name, _O_PATH | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            return f"a symbolic link that leads nowhere readable: {_why(exc)}"
        try:
            mode = os.fstat(handle).st_mode
            if stat.S_ISDIR(mode):
                return "a symbolic link to a folder; links to folders are not followed"
            if not stat.S_ISREG(mode):
                return "a symbolic link to something that is not a regular file"
            if not _real_path(handle).startswith(self.real_root):
                return "a symbolic link leading outside the folder"
            # Reopening the descriptor's /proc entry opens exactly the file checked, not a name.
            return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            return f"a symbolic link that leads nowhere readable: {_why(exc)}"
        finally:
            os.close(handle)


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link, not followed"
    return exc.strerror or type(exc).__name__


def _real_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        # No /proc: links are not followed then, so this path is never compared with.
        return "/nonexistent-without-proc/"


def _read_fd(fd: int) -> bytes:
    # FileIO.readall sizes one buffer from fstat: a 1 GB file is held once, not as chunks plus a join.
    with io.FileIO(fd, "rb", closefd=False) as fh:
        return fh.readall()


class NotText(Exception):
    """A file that is not a text file, and why in a few words ("not UTF-8 text", ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def image_entry(name: str, kind: str, size: int) -> str:
    """What a context holds for an image (its bytes stay on the host, by `name`)."""
    return f"[image file: {kind}, {size:,} bytes. Show it to a sub-model with llm_query(prompt, images=[{name!r}])]"


def image_type(data: bytes) -> str | None:
    """The image type of `data` from its first bytes (PNG, JPEG, GIF, WebP: what vision models
    take), or None."""
    for magic, kind in _IMAGE_MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def as_text(data: bytes) -> str:
    """A file's text, or NotText: the one rule for a context file, alone or in a folder."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotText("not UTF-8 text", f"byte {exc.start}: {exc.reason}") from None
    # Binary files can happen to decode (a NUL-padded .pyc or database page does): no text file
    # holds a NUL byte, so one marks the file as binary.
    at = data.find(0)
    if at >= 0:
        raise NotText("binary: contains NUL bytes", f"first at byte {at}")
    return text


def _file_text(data: bytes, where: str) -> str:
    """A context given as one file: what a folder would leave out and list is an error here, since
    nothing else is left to read."""
    try:
        return as_text(data)
    except NotText as exc:
        raise ContextError(
            f"{where} is {exc.reason} ({exc.detail}): a folder's file like it is left out, and this "
            "one is all there is to read. Give a text file: extract the text of a PDF or other "
            "document, or convert text in another encoding to UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None


def _is_device(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)


def _available_memory() -> int | None:
    """Bytes of memory free for new allocations (Linux MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _human(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:,.0f} {unit}" if unit == "bytes" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} bytes"


def _check_fits(where: str, size: int, free: int | None) -> None:
    """Refuse before reading what can never fit: a context is held in memory whole, and reading
    more than is free would end in the OOM killer."""
    if free is not None and size > free:
        raise ContextError(
            f"{where} is {_human(size)}, more than the {_human(free)} of free memory, and a context is "
            "held in memory whole. Pass a smaller context (split the file, or filter it to the part the "
            "question is about), or run where more memory is free."
        )
