"""Disco workers on an RPC server: the server side of the ``"rpc"`` Disco channel.

A session asked to become a Disco worker (``OP_DISCO_WORKER``) runs the core's
worker loop on its own connection (:func:`run_worker`), reading the core's frames
with :class:`LinkFrames`: sealed records when the session has a token, every frame
checked before it is acted on, and rebuilt from the core's tagged network format
(:func:`disco_core.spi.decode_untrusted`), never unpickled; replies go in that
format too (:func:`disco_core.spi.encode_for_network`). The controller's side
is :mod:`disco_rpc.channel`.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from disco_core.spi import (
    FrameReader,
    HeartbeatSender,
    Worker,
    command_stream,
    encode_for_network,
    frame_head,
    unfilled_bytearray,
)

from . import wire
from .procname import name_process

__all__ = [
    "LinkFrames",
    "WORKER_PROCESS_NAME",
    "mark_worker_process",
    "name_process",
    "send_frame",
    "run_worker",
]

#: The name (``/proc/<pid>/comm``) a session process takes when it becomes a Disco
#: worker. The controller kills a worker that stopped answering on this machine only
#: when the process holding the other end of its link has this name: a process can
#: name only its own threads, so a peer cannot have a relay that carries the link
#: (an ssh tunnel, a shared ``rpc.Proxy``) taken for the worker and killed.
WORKER_PROCESS_NAME = "disco-worker"


def mark_worker_process() -> bool:
    """Name this process :data:`WORKER_PROCESS_NAME`, when the calling thread leads it.

    A session served by a thread (a ``no_fork`` server) names nothing: the process is
    the server's, and is never to be killed by a client. Returns whether it was named.
    """
    return name_process(WORKER_PROCESS_NAME)


class LinkFrames:
    """The core's frames read from a session's transport, sealed or not.

    Every frame :meth:`read` returns has been verified: when a sealed record
    goes on past the frame (several small frames in one record), the rest of
    the record is read into the buffer first, so its tag is checked before
    anything in it is acted on; and so it is before memory is sized from a
    frame's buffer lengths.

    Parameters
    ----------
    conn : disco_rpc.wire.Conn
        The session's connection, past its last RPC frame; bytes it read ahead
        are taken over.
    """

    def __init__(self, conn: wire.Conn) -> None:
        self.t = conn.t
        self.fd = conn.t.fileno()
        self._scratch = bytearray(FrameReader._CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self.reader = FrameReader(self.fd, read=self._read, readinto=self.t.recv_into)
        self.reader.buf += conn.take_buffered()  # read past the last RPC frame (verified)
        self.reader.verify = self._settle

    def _read(self, n: int) -> bytearray:
        # at most what the record under way holds: n may come from a length not verified yet
        n = min(n, max(len(self._scratch), self._left()))
        if n <= len(self._scratch):  # headers: into a reused buffer, copied out as received
            k = self.t.recv_into(self._scratch_view[:n])
            return self._scratch[:k]
        buf = unfilled_bytearray(n)
        k = self.t.recv_into(memoryview(buf))
        del buf[k:]  # the unfilled rest is never seen
        return buf

    def has_buffered(self) -> bool:
        """True when bytes of a further frame are already buffered."""
        return self.reader.has_buffered()

    def read(self) -> tuple:
        """The next frame ``(header, buffers, flags)``; raises ``IntegrityError`` if forged."""
        frame = self.reader.read()
        self._settle()
        return frame

    def _settle(self) -> None:
        # the rest of the record under way (so it is verified), and verified bytes the
        # transport holds (so that has_buffered() sees them before select() waits)
        left = self._left()
        while left:
            chunk = self._read(left)
            if not chunk:
                raise EOFError("the peer closed the connection in the middle of a record")
            self.reader.buf += chunk
            left = self._left()

    def _left(self) -> int:
        """Bytes of the sealed record under way not read yet (0 on a plain link)."""
        return getattr(self.t, "record_left", 0) + getattr(self.t, "pending", 0)


def send_frame(t: Any, frame: tuple) -> None:
    """Send one core frame as one record (several when it is very large)."""
    t.send_parts([frame_head(frame), *frame[1]])


def run_worker(conn: wire.Conn, worker_id: int, num_workers: int, num_groups: int, sys_path: Any = ()) -> None:  # fmt: skip
    """Run the core's worker loop on the session's socket until shutdown or end of file."""
    for p in reversed(list(sys_path or ())):
        if isinstance(p, str) and p and os.path.isdir(p) and p not in sys.path:
            sys.path.insert(0, p)
    conn.t.sock.settimeout(None)
    t = conn.t
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        frame = encode_for_network(msg)  # the controller unpickles nothing from a socket
        with lock:
            send_frame(t, frame)

    send = HeartbeatSender(send)  # its own lock; the controller watches the beats
    worker = Worker(int(worker_id), int(num_workers), int(num_groups), send)
    reader = LinkFrames(conn)
    send.start()  # the first heartbeat goes before "ready": the controller knows to expect them
    mark_worker_process()  # before "ready": the controller checks the name then
    send(("ready", os.getpid()))

    try:
        # commands crossed a socket: the network format, never unpickled
        worker.run(command_stream(reader, untrusted=True).__next__)  # type: ignore[arg-type]  # reads like a FrameReader
    except (EOFError, OSError):  # IntegrityError too: a forged frame ends the worker
        worker.close()  # the controller is gone
