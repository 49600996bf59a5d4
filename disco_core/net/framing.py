"""The core's frame layout on a byte stream, and one reader with caps on every field.

Layout (little endian)::

    u64 header_len | u32 num_buffers | u32 flags | u64 buffer_len * num_buffers
    header | buffer 0 | buffer 1 | ...

Every count and length a peer declares is checked against this side's limits
*before* anything is allocated for it, so a hostile or corrupt stream costs at
most what the limits allow.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any

from ..errors import FrameLimitError
from .io import unfilled_bytearray

__all__ = [
    "PREFIX",
    "MAX_BUFFERS",
    "MAX_HEADER_BYTES",
    "MAX_FRAME_BYTES",
    "frame_head",
    "check_frame",
    "read_frame_head",
    "FrameReader",
]

PREFIX = struct.Struct("<QII")
_PREFIX_SIZE = PREFIX.size
_unpack_prefix = PREFIX.unpack_from
_LEN = struct.Struct("<Q")
#: Most out-of-band buffers in one frame.
MAX_BUFFERS = 1 << 16
#: Largest header (the serialised command without its large buffers).
MAX_HEADER_BYTES = 1 << 30
#: Largest frame, header and buffers together.
MAX_FRAME_BYTES = 1 << 40


def frame_head(header: Any, buffers: Any, flags: int = 0) -> bytes:
    """The bytes of a frame before its buffers (prefix, buffer lengths, header)."""
    lens = b"".join(_LEN.pack(memoryview(m).nbytes) for m in buffers)
    return PREFIX.pack(len(header), len(buffers), flags) + lens + bytes(header)


def check_frame(
    header_len: int,
    nbuf: int,
    lens: tuple = (),
    *,
    max_frame: int = MAX_FRAME_BYTES,
    max_header: int = MAX_HEADER_BYTES,
) -> None:
    """Raise :class:`~disco_core.errors.FrameLimitError` if a declared frame is over a limit.

    Called twice per frame: with the prefix alone (before the buffer lengths are
    read), then with the lengths.
    """
    if nbuf > MAX_BUFFERS:
        raise FrameLimitError(f"frame declares {nbuf} buffers (at most {MAX_BUFFERS})")
    if header_len > min(max_header, max_frame):
        raise FrameLimitError(
            f"frame declares a header of {header_len} bytes (at most {min(max_header, max_frame)})"
        )
    if lens and header_len + sum(lens) > max_frame:
        raise FrameLimitError(
            f"frame declares {header_len + sum(lens)} bytes (at most {max_frame})"
        )


def read_frame_head(
    take: Callable[[int], Any], *, max_frame: int = MAX_FRAME_BYTES
) -> tuple[int, tuple[int, ...], int]:
    """Parse a frame's prefix and buffer lengths, checking each before reading on.

    The one parser of a frame's head: :class:`FrameReader` and every other reader
    of frames (a plugin's buffered socket reader, a relay that forwards the head
    and splices the buffers) read it through this.

    Parameters
    ----------
    take : callable
        ``take(n)`` returns the next ``n`` bytes of the stream (any buffer).
    max_frame : int
        The largest frame accepted (:func:`check_frame`).

    Returns
    -------
    tuple
        ``(header_len, buffer_lengths, flags)``; the header itself is not read.

    Raises
    ------
    FrameLimitError
        A declared count or length is over a limit (checked before the lengths
        are read, so an absurd count costs nothing).
    """
    hlen, nbuf, flags = PREFIX.unpack(take(PREFIX.size))
    check_frame(hlen, nbuf, max_frame=max_frame)
    lens = struct.unpack(f"<{nbuf}Q", take(8 * nbuf)) if nbuf else ()
    check_frame(hlen, nbuf, lens, max_frame=max_frame)
    return hlen, lens, flags


class FrameReader:
    """Reads frames from a blocking file descriptor (or any ``read``/``readinto`` pair).

    Headers are read in large chunks (several frames may arrive in one read, so
    :meth:`has_buffered` tells a ``select`` loop to keep parsing); out-of-band
    buffers are read straight into freshly allocated, writable memory
    (``bytearray``), which becomes the arrays' storage.

    Parameters
    ----------
    fd : int
        The file descriptor to read (ignored when ``read`` and ``readinto`` are given).
    max_frame : int
        The largest frame accepted; see :func:`check_frame`.
    read, readinto : callable, optional
        ``read(n) -> bytes`` and ``readinto(view) -> int`` to read through instead
        of ``fd`` (a socket, a sealed transport); both return 0 bytes at the end.

    Attributes
    ----------
    progress : callable or None
        Called after each read of a large buffer's bytes: a frame still arriving
        is a sign of life of its sender (the channels' liveness watch).
    verify : callable or None
        Called once a frame's head and header are read, before memory is sized
        from its buffer lengths: over a sealed link, it reads on to the end of the
        record under way, so those lengths are checked first (an attacker on the
        path sizes nothing).
    """

    _CHUNK = 1 << 16
    progress: Callable[[], None] | None = None
    verify: Callable[[], None] | None = None

    def __init__(
        self,
        fd: int,
        max_frame: int = MAX_FRAME_BYTES,
        *,
        read: Callable[[int], bytes | bytearray] | None = None,
        readinto: Callable[[Any], int] | None = None,
    ) -> None:
        self.fd = fd
        self.max_frame = int(max_frame)
        self._max_header = min(MAX_HEADER_BYTES, self.max_frame)
        self._read = read if read is not None else (lambda n: os.read(fd, n))
        self._readinto = readinto if readinto is not None else (lambda view: os.readv(fd, [view]))
        self.buf = bytearray()
        self.pos = 0

    def has_buffered(self) -> bool:
        """True when bytes of a further frame are already buffered."""
        return self.pos < len(self.buf)

    def _fill(self, need: int) -> None:
        avail = len(self.buf) - self.pos
        if avail >= need:
            return
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        while len(self.buf) < need:
            chunk = self._read(max(self._CHUNK, need - len(self.buf)))
            if not chunk:
                raise EOFError("peer closed the stream")
            self.buf += chunk

    def _take(self, n: int) -> bytes:
        self._fill(n)
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def read(self) -> tuple[bytes, list, int]:
        """Return ``(header, buffers, flags)``.

        Raises
        ------
        EOFError
            The peer is gone.
        FrameLimitError
            The frame declares more than this reader accepts (the stream is then
            out of step and must be dropped).
        """
        buf, pos = self.buf, self.pos
        if len(buf) - pos >= _PREFIX_SIZE:  # the common case: a small frame, all buffered
            hlen, nbuf, flags = _unpack_prefix(buf, pos)
            end = pos + _PREFIX_SIZE + hlen
            if not nbuf and end <= len(buf) and hlen <= self._max_header:
                self.pos = end
                return bytes(buf[pos + _PREFIX_SIZE : end]), [], flags
        hlen, lens, flags = read_frame_head(self._take, max_frame=self.max_frame)
        header = self._take(hlen)
        if lens and self.verify is not None:
            self.verify()
        return header, [self._read_buffer(n) for n in lens], flags

    def _read_buffer(self, n: int) -> bytearray:
        out = unfilled_bytearray(n)  # filled whole below, or dropped with the EOFError
        have = min(n, len(self.buf) - self.pos)
        if have:
            out[:have] = self.buf[self.pos : self.pos + have]
            self.pos += have
        view = memoryview(out)
        readinto, progress = self._readinto, self.progress
        while have < n:
            got = readinto(view[have:])
            if not got:
                raise EOFError("peer closed the stream in the middle of a frame")
            have += got
            if progress is not None:
                progress()
        return out

    def close(self) -> None:
        self.buf = bytearray()


def read_frame(fd: int) -> tuple[bytes, list, int]:
    """Read one frame from ``fd`` (a one-off read: nothing beyond it may be buffered)."""
    return FrameReader(fd).read()
