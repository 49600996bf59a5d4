"""Worker processes' stderr, copied through to ours with its last bytes kept.

A worker that dies before or while it runs usually says why on its stderr (``No
module named ...``, a traceback). Its exit code alone says little, and in a
notebook the child's stderr does not reach the user at all; so the channel reads
the workers' stderr through pipes, passes every byte on to its own stderr, and
keeps the tail of each for the :class:`~disco_core.errors.WorkerDiedError`.
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Sequence

__all__ = ["StderrTee", "STDERR_TAIL", "with_stderr"]

#: Bytes of a worker's stderr kept for its death report.
STDERR_TAIL = 2048


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class StderrTee:
    """Copy the pipes ``fds`` to file descriptor ``out_fd``, keeping each one's last bytes.

    One daemon thread serves every pipe; it closes each pipe at its end of file (the
    worker, and any child of it that held the pipe, is gone).

    Parameters
    ----------
    fds : sequence of int
        The read ends of the workers' stderr pipes (owned by the tee from now on).
    keep : int
        Bytes kept per pipe (default ``STDERR_TAIL``).
    out_fd : int
        Where the bytes go on (default 2, this process's stderr).
    """

    def __init__(self, fds: Sequence[int], keep: int = STDERR_TAIL, out_fd: int = 2) -> None:
        self.keep = keep
        self.out_fd = out_fd
        self.tails = [bytearray() for _ in fds]
        self.closed = [threading.Event() for _ in fds]
        self.sel = selectors.DefaultSelector()
        for i, fd in enumerate(fds):
            self.sel.register(fd, selectors.EVENT_READ, i)
        self.thread = threading.Thread(target=self._run, name="disco-worker-stderr", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        left = len(self.tails)
        while left:
            for key, _ in self.sel.select():
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    self.sel.unregister(key.fd)
                    os.close(key.fd)
                    self.closed[key.data].set()
                    left -= 1
                    continue
                try:
                    _write_fd(self.out_fd, chunk)
                except OSError:
                    pass  # our own stderr is gone; keep the tail anyway
                tail = self.tails[key.data]
                tail += chunk
                del tail[: -self.keep]
        self.sel.close()

    def tail(self, i: int, wait: float = 0.0) -> str:
        """The last bytes pipe ``i`` carried, from a line's start (waits up to ``wait`` s for its end)."""
        if wait:
            self.closed[i].wait(wait)
        data = bytes(self.tails[i])
        if len(data) >= self.keep and b"\n" in data:
            data = data[data.index(b"\n") + 1 :]
        return data.decode(errors="replace")

    def join(self, timeout: float | None = None) -> None:
        """Wait until every pipe reached its end (every byte was passed on)."""
        self.thread.join(timeout)


def with_stderr(reason: str, stderr: str) -> str:
    """``reason``, followed by the worker's last stderr lines when it wrote any."""
    stderr = stderr.strip()
    if not stderr:
        return reason
    return f"{reason}; its stderr ended with:\n{stderr}"
