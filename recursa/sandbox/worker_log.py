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
import select
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
        self._fd = -1  # the pipe's read end, until the reader has seen its end
        self._ended = False

    @classmethod
    def pipe(cls, keep: int = KEEP_BYTES) -> WorkerLog:
        log = cls(keep)
        read_fd, log.write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(read_fd, False)  # the read end only: a worker writing faster still waits
        log._fd = read_fd
        log._reader = threading.Thread(target=log._drain, name="recursa-worker-log", daemon=True)
        log._reader.start()
        return log

    def _drain(self) -> None:
        # Reads happen under the lock, here and in `tail`, so that `tail` can take what the pipe
        # holds at once (the last words of a worker that just died) without reordering the bytes.
        # Only this thread closes the fd: a number closed under a poll could be reused meanwhile.
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        try:
            while True:
                with contextlib.suppress(InterruptedError):
                    poller.poll()
                with self._lock:
                    if not self._read_now():
                        return
        finally:
            with self._lock:
                fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read_now(self) -> bool:
        """Read what the pipe holds now (the lock held); False at its end."""
        while not self._ended:
            try:
                data = os.read(self._fd, _READ)
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                self._ended = True
            else:
                self._keep(data)
        return False

    def write(self, data: bytes) -> None:
        with self._lock:
            self._keep(data)

    def _keep(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > self.keep:
            del self._buf[: len(self._buf) - self.keep]

    def wait_drained(self, timeout: float) -> None:
        """Wait up to `timeout` s for the reader to reach the end: every writer gone, all read."""
        if self._reader is not None:
            self._reader.join(timeout)

    def tail(self, chars: int) -> str:
        """The last `chars` of the output, everything written before this call included."""
        with self._lock:
            if self._fd >= 0:
                self._read_now()
            data = bytes(self._buf[-chars:])
        return data.decode("utf-8", "replace").strip()

    def spawned(self) -> None:
        """The worker holds the write end now: drop ours, so the reader sees the end with it."""
        fd, self.write_fd = self.write_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
