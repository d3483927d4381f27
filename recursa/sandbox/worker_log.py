"""What a worker writes to its stdout and stderr, kept for crash reports: the last 64 KiB, in memory.

The worker's fds 1 and 2 are the write end of a pipe; a thread of the host reads it as it comes and
keeps only the tail. A file would grow with whatever the code writes there (up to the file-size
limit, on the host's disk, outside every limit of the sandbox); a pipe holds at most its buffer,
and a worker that writes faster than the host reads waits. The thread ends when every process
holding the write end is gone.
"""

from __future__ import annotations

import contextlib
import os
import threading

KEEP_BYTES = 64 * 1024
_READ = 64 * 1024


class WorkerLog:
    """The tail of a worker's output. `pipe()`: fed by a worker through `write_fd`; `WorkerLog()`:
    fed by the host itself with `write` (sandboxes whose output arrives through an SDK)."""

    def __init__(self, keep: int = KEEP_BYTES) -> None:
        self.keep = keep
        self.write_fd = -1  # for the worker; the host closes its copy once the worker has one
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    @classmethod
    def pipe(cls, keep: int = KEEP_BYTES) -> WorkerLog:
        log = cls(keep)
        read_fd, log.write_fd = os.pipe2(os.O_CLOEXEC)
        log._reader = threading.Thread(
            target=log._drain, args=(read_fd,), name="recursa-worker-log", daemon=True
        )
        log._reader.start()
        return log

    def _drain(self, read_fd: int) -> None:
        try:
            while True:
                try:
                    data = os.read(read_fd, _READ)
                except InterruptedError:
                    continue
                if not data:
                    return
                self.write(data)
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                os.close(read_fd)

    def write(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            if len(self._buf) > self.keep:
                del self._buf[: len(self._buf) - self.keep]

    def wait_drained(self, timeout: float) -> None:
        """Wait up to `timeout` s for the reader to reach the end: every writer gone, all read."""
        if self._reader is not None:
            self._reader.join(timeout)

    def tail(self, chars: int) -> str:
        with self._lock:
            data = bytes(self._buf[-chars:])
        return data.decode("utf-8", "replace").strip()

    def spawned(self) -> None:
        """The worker holds the write end now: drop ours, so the reader sees the end with it."""
        fd, self.write_fd = self.write_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
