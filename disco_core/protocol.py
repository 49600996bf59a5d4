"""The command protocol: TVM's nine actions, value (de)serialisation and framing.

Commands are plain tuples ``(action, *fields)``. In-process workers receive them as
Python objects (after :func:`isolate` gives each worker its own copy of mutable
values); workers in other processes receive them as frames: a pickle (protocol 5)
header plus its out-of-band buffers, written straight from the array's memory to
the file descriptor and read straight into the receiving array's memory, so large
arrays are never copied on the way.

Frame layout on a byte stream (all little endian)::

    u64 header_len | u32 num_buffers | u32 flags | u64 buffer_len * num_buffers
    header (pickle)  | buffer 0 | buffer 1 | ...
"""

from __future__ import annotations

import collections
import copyreg
import enum
import io
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Action",
    "RegRef",
    "Frame",
    "encode",
    "decode",
    "isolate",
    "write_frame",
    "read_frame",
    "FrameReader",
    "OOB_THRESHOLD",
    "FLAG_BATCH",
    "frame_head",
    "write_all",
    "register_ref_type",
    "isolate_command",
]

#: Buffers at least this large travel out of band (never copied into the pickle).
OOB_THRESHOLD = 4096
#: Refuse a frame whose declared size is beyond this (a corrupt or hostile stream).
MAX_FRAME_BYTES = 1 << 40

_PREFIX = struct.Struct("<QII")
_LEN = struct.Struct("<Q")


class Action(enum.IntEnum):
    """TVM's ``DiscoAction`` codes, in TVM's order."""

    SHUTDOWN = 0
    KILL_REG = 1
    GET_GLOBAL_FUNC = 2
    CALL_PACKED = 3
    SYNC_WORKER = 4
    COPY_FROM_WORKER0 = 5
    COPY_TO_WORKER0 = 6
    DEBUG_GET_FROM_REMOTE = 7
    DEBUG_SET_REGISTER = 8


# Plain ints for the hot path (an IntEnum is slower to compare and to pickle).
SHUTDOWN, KILL_REG, GET_GLOBAL_FUNC, CALL_PACKED, SYNC_WORKER = 0, 1, 2, 3, 4
COPY_FROM_WORKER0, COPY_TO_WORKER0, DEBUG_GET_FROM_REMOTE, DEBUG_SET_REGISTER = 5, 6, 7, 8


class RegRef:
    """A register named inside a command; the worker replaces it by the register's value."""

    __slots__ = ("reg_id",)

    def __init__(self, reg_id: int) -> None:
        self.reg_id = reg_id

    def __repr__(self) -> str:
        return f"RegRef({self.reg_id})"

    def __reduce__(self):
        return (RegRef, (self.reg_id,))


Frame = tuple[bytes, list]  # (header, out-of-band buffers)


#: Handle types (DRef and subclasses) pickled as the register they name.
_REF_TYPES: set[type] = set()
_DISPATCH = collections.ChainMap({}, copyreg.dispatch_table)

#: ``flags`` bit of a frame holding a tuple of commands rather than one.
FLAG_BATCH = 1


def _reduce_ref(obj: Any):
    return (RegRef, (obj.reg_id,))


def register_ref_type(cls: type) -> type:
    """Make ``cls`` (a handle with ``reg_id``) travel as a :class:`RegRef`."""
    _REF_TYPES.add(cls)
    _SHARED_TYPES.add(cls)
    _DISPATCH.maps[0][cls] = _reduce_ref
    return cls


def encode(obj: Any) -> Frame:
    """Serialise ``obj``; handles become :class:`RegRef`; large buffers stay out of band."""
    buffers: list = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        m = pb.raw()
        if m.nbytes < OOB_THRESHOLD:
            return True  # small: in band
        buffers.append(m)
        return False

    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=5, buffer_callback=keep)
    p.dispatch_table = _DISPATCH  # consulted only for non-builtin types: ints and tuples stay fast
    p.dump(obj)
    return f.getvalue(), buffers


def decode(header: bytes | bytearray | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Inverse of :func:`encode`; out-of-band buffers become the arrays' memory."""
    return pickle.loads(header, buffers=buffers)


_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), np.dtype, np.generic, RegRef)


_SHARED_TYPES = {int, float, complex, bool, str, bytes, type(None), RegRef}


def isolate_command(cmd: tuple) -> tuple:
    """:func:`isolate` the values of a command (the other fields are ints and strs)."""
    action = cmd[0]
    if action == CALL_PACKED:
        shared = _SHARED_TYPES
        for v in cmd[3]:
            if type(v) not in shared:
                return (action, cmd[1], cmd[2], isolate(cmd[3]))
        return cmd
    if action == DEBUG_SET_REGISTER:
        return (action, cmd[1], cmd[2], isolate(cmd[3]))
    return cmd


def isolate(value: Any) -> Any:
    """Give an in-process worker its own copy of ``value``, as a pipe would.

    Immutable values are shared; arrays are copied; DRefs become :class:`RegRef`.
    Anything else goes through a pickle round trip, so that in-process and
    out-of-process workers accept and reject the same values.
    """
    t = type(value)
    if t in _IMMUTABLE or isinstance(value, _IMMUTABLE):
        return value
    if t is tuple:
        return tuple([isolate(v) for v in value])
    if t is list:
        return [isolate(v) for v in value]
    if t in _REF_TYPES:
        return value  # handles are resolved by the worker, like RegRef
    if t is np.ndarray:
        return value.copy()
    if getattr(t, "__module__", "").startswith("disco_core.device"):
        return value
    if t is dict:
        return {isolate(k): isolate(v) for k, v in value.items()}
    return decode(*encode(value))


# --------------------------------------------------------------------------- framing
def frame_head(frame: Frame, flags: int = 0) -> bytes:
    """The bytes of a frame before its out-of-band buffers (prefix, lengths, header)."""
    header, buffers = frame
    lens = b"".join(_LEN.pack(m.nbytes) for m in buffers)
    return _PREFIX.pack(len(header), len(buffers), flags) + lens + header


def write_frame(fd: int, frame: Frame, flags: int = 0) -> None:
    """Write one frame to a blocking file descriptor; buffers are written in place."""
    write_all(fd, frame_head(frame, flags))
    for m in frame[1]:
        write_all(fd, m)


def write_all(fd: int, data: Any) -> None:
    """Write all of ``data`` (any buffer) to a blocking file descriptor, without copying it."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    n = os.write(fd, view)
    total = len(view)
    if n == total:
        return
    view = memoryview(view)
    while n < total:
        n += os.write(fd, view[n:])


class FrameReader:
    """Reads frames from a blocking file descriptor.

    Headers are read in large chunks (several frames may arrive in one read, so
    :meth:`has_buffered` tells a ``select`` loop to keep parsing); out-of-band
    buffers are read straight into freshly allocated, writable memory
    (``bytearray``), which becomes the arrays' storage.
    """

    _CHUNK = 1 << 16

    def __init__(self, fd: int) -> None:
        self.fd = fd
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
            chunk = os.read(self.fd, max(self._CHUNK, need - len(self.buf)))
            if not chunk:
                raise EOFError("peer closed the stream")
            self.buf += chunk

    def _take(self, n: int) -> bytes:
        self._fill(n)
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def read(self) -> tuple[bytes, list, int]:
        """Return ``(header, buffers, flags)``; raise ``EOFError`` when the peer is gone."""
        hlen, nbuf, flags = _PREFIX.unpack(self._take(_PREFIX.size))
        lens = struct.unpack(f"<{nbuf}Q", self._take(8 * nbuf)) if nbuf else ()
        if hlen > MAX_FRAME_BYTES or sum(lens) > MAX_FRAME_BYTES:
            raise EOFError(f"corrupt frame: declared size {hlen + sum(lens)} bytes")
        header = self._take(hlen)
        return header, [self._read_buffer(n) for n in lens], flags

    def _read_buffer(self, n: int) -> bytearray:
        out = bytearray(n)
        have = min(n, len(self.buf) - self.pos)
        if have:
            out[:have] = self.buf[self.pos : self.pos + have]
            self.pos += have
        view = memoryview(out)
        while have < n:
            got = os.readv(self.fd, [view[have:]])
            if not got:
                raise EOFError("peer closed the stream in the middle of a frame")
            have += got
        return out

    def close(self) -> None:
        self.buf = bytearray()


def read_frame(fd: int) -> tuple[bytes, list, int]:  # convenience for one-off reads
    return FrameReader(fd).read()


def describe_command(cmd: tuple, func_name: Callable[[int], str] | None = None) -> str:
    """A short human description of a command, for error messages."""
    action = Action(cmd[0])
    if action is Action.CALL_PACKED and func_name is not None:
        return f"call_packed({func_name(cmd[2])})"
    return action.name.lower()
