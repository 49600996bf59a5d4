"""The wire format of disco-rpc: a tagged binary encoding and the framing.

Nothing on this wire is ever unpickled. Values are encoded with a small tagged
format that can only build ``None``, ``bool``, ``int``, ``float``, ``complex``,
``str``, ``bytes``, ``tuple``, ``list``, ``dict``, NumPy arrays of numeric dtypes,
dtypes, devices and handles (integers naming objects that live on the server).
Arrays and large byte strings travel as raw out-of-band buffers after the
encoded header, written straight from their memory and read straight into the
receiver's memory.

Frame layout (little endian)::

    u8 kind | u8 op | u16 flags | u32 meta_len | u32 num_buffers     (12 bytes)
    u64 buffer_len * num_buffers
    meta (the tagged encoding, buffers referred to by index)
    buffer 0 | buffer 1 | ...

Files travel as *streams*: the request (upload) or the reply (download) declares
the total size, then ``CHUNK`` frames follow, each with no meta and one buffer of
at most the receiver's ``max_message_bytes``, until the declared size is reached,
then an empty ``CHUNK`` frame with ``FLAG_END``. So a file of any size crosses a
link whose frames are bounded. A sender whose file fails in the middle completes
the chunk under way with padding and sends a ``CHUNK`` frame with ``FLAG_ABORT``
(its meta: the reason) instead of the rest and the end: the receiver drops what
it got and the connection stays in sync.

A ``HEARTBEAT`` frame (kind 5, no op, meta or buffer: 12 bytes) may come from a
client between any two of its frames, never inside a frame or a file stream: it
only says that the client is alive, and :meth:`Conn.recv` skips it (README,
"Liveness"). A server sends them too, to a client that asked in INIT, while a
request's work runs (before its reply; never during a file stream).
"""

from __future__ import annotations

import fcntl
import operator
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from disco_core import DiscoTimeoutError, DiscoTypeError, DiscoValueError, FrameLimitError
from disco_core.spi import (
    CAN_SPLICE,
    Device,
    PipeTransport,
    SealedTransport,
    SinkFailedError,
    SocketTransport,
    SSLTransport,
    as_dtype,
    dtype_name,
    new_pipe,
    splice_exact,
    unfilled_bytearray,
)

from .errors import (
    DesyncError,
    FrameTooLargeError,
    MessageTooLargeError,
    ProtocolError,
    StreamAbortedError,
    TransferError,
)
from .protocol import (
    CHUNK,
    CHUNK_FRAME,
    ERROR,
    FLAG_ABORT,
    FLAG_END,
    FRAME_HEAD,
    HANDLE_FUNC,
    HANDLE_MODULE,
    HANDLE_OBJECT,
    HANDLE_TENSOR,
    HEARTBEAT,
    HEARTBEAT_FRAME,
    INLINE_BYTES,
    MAX_BUFFERS,
    MAX_DEPTH,
    REPLY,
    REQUEST,
    T_ARRAY,
    T_BIGINT,
    T_BUF,
    T_BYTES,
    T_COMPLEX,
    T_DEVICE,
    T_DICT,
    T_DTYPE,
    T_FALSE,
    T_FLOAT,
    T_HANDLE,
    T_INT,
    T_LIST,
    T_NONE,
    T_STR,
    T_TRUE,
    T_TUPLE,
)

__all__ = [
    "HandleRef",
    "FileSource",
    "encode",
    "encode_call",
    "decode",
    "Conn",
    "SocketTransport",
    "SSLTransport",
    "PipeTransport",
    "SealedLink",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MIN_MAX_MESSAGE_BYTES",
    "check_message_limit",
    "RECORD_BYTES",
    "SEND_RECORD_BYTES",
    # the frame kinds, from disco_rpc.protocol
    "REQUEST",
    "REPLY",
    "ERROR",
    "CHUNK_FRAME",
    "HEARTBEAT",
]

#: Default bound on one frame (header plus buffers).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
#: The smallest ``max_message_bytes`` a side may set: the session's own frames (its
#: INIT, a call with its arguments) must fit.
MIN_MAX_MESSAGE_BYTES = 1 << 16


def check_message_limit(value: Any, name: str = "max_message_bytes") -> int:
    """``value`` as a frame bound, or a Disco error naming ``name`` (at the call, before a
    connection or server exists: a bound of -1 or 10 made every call fail remotely)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise DiscoTypeError(f"{name} must be an int (bytes), got {value!r}") from None
    if n < MIN_MAX_MESSAGE_BYTES:
        raise DiscoValueError(f"{name} must be at least {MIN_MAX_MESSAGE_BYTES} bytes, got {n}")
    return n


#: The largest sealed record a disco-rpc peer accepts (a file chunk with its frame heads
#: fits in one: what releases before 2026-11-28 sent).
RECORD_BYTES = CHUNK + (1 << 12)
#: On a sealed link, a frame with this many bytes of buffers or more sends its head in a
#: record of its own (records this large are received before their tag is checked).
_HEAD_ALONE_FROM = 64 << 10
#: The largest sealed record a disco-rpc peer sends; a larger frame leaves as several.
#: A relay (a chained session's outer server) passes a record on only once its tag
#: checked: a record must cross the slowest link in well under the bound of the
#: inner server's liveness check (8 s by default; 1 MiB takes 3.5 s at 300 KB/s).
SEND_RECORD_BYTES = 1 << 20

#: File descriptors that processes forked by disco-rpc close at once (the pipes of
#: PopenSessions, so that a forked server does not keep them open).
CLOSE_IN_CHILD: set[int] = set()


def close_inherited() -> None:
    for fd in list(CLOSE_IN_CHILD):
        try:
            os.close(fd)
        except OSError:
            pass
    CLOSE_IN_CHILD.clear()


_HEAD = FRAME_HEAD
_HEAD_SIZE = _HEAD.size
_HEAD_FROM = _HEAD.unpack_from
_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_TQ = struct.Struct("<Bq")
_TD = struct.Struct("<Bd")
_TDD = struct.Struct("<Bdd")
_TI = struct.Struct("<BI")
_TII = struct.Struct("<BII")
_BBQ = struct.Struct("<BBQ")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_EMPTY_TUPLE = _TI.pack(T_TUPLE, 0)
_NONE_META = bytes([T_NONE])
#: How a call's request with no frees begins: ``(``, ``()``, ``(``, then a handle's tag.
_CALL_PREFIX = _TI.pack(T_TUPLE, 2) + _EMPTY_TUPLE + _TI.pack(T_TUPLE, 2)
_CALL_HEAD = _CALL_PREFIX + bytes([T_HANDLE])
_CALL_HID_AT = len(_CALL_HEAD)  # the handle's kind and id (9 bytes), then its info's tag
_CALL_ARGS_AT = _CALL_HID_AT + 10
#: A sealed record's bytes besides its payload (length and tag).
_SEALED_OVERHEAD = 8 + 16
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


class HandleRef:
    """A server-side object named by ``(kind, id)``; ``info`` describes it (a plain value)."""

    __slots__ = ("kind", "hid", "info")

    FUNC, MODULE, TENSOR, OBJECT = HANDLE_FUNC, HANDLE_MODULE, HANDLE_TENSOR, HANDLE_OBJECT

    def __init__(self, kind: int, hid: int, info: Any = None) -> None:
        self.kind = kind
        self.hid = hid
        self.info = info

    def __repr__(self) -> str:
        return f"HandleRef({self.kind}, {self.hid}, {self.info!r})"


class FileSource:
    """An open binary file to stream, ``size`` bytes from its position."""

    __slots__ = ("file", "size")

    def __init__(self, file: Any, size: int) -> None:
        self.file = file
        self.size = size


# --------------------------------------------------------------------------- encoding
def _array_view(arr: np.ndarray) -> memoryview:
    if arr.dtype.hasobject:
        raise DiscoTypeError("arrays of Python objects cannot be sent over RPC")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8).data


def encode(value: Any, export: Callable[[Any], HandleRef | None] | None = None) -> tuple:
    """Encode ``value``; return ``(meta, buffers)``.

    ``export(obj)`` is asked first about every object that is not a plain value
    (arrays included); a :class:`HandleRef` it returns travels instead of ``obj``.
    """
    t = type(value)
    if t is int and _INT64_MIN <= value <= _INT64_MAX:  # most results: the same bytes, sooner
        return bytearray(_TQ.pack(T_INT, value)), []
    if value is None:
        return bytearray(_NONE_META), []
    out = bytearray()
    bufs: list = []
    _enc(value, out, bufs, export, 0)
    return out, bufs


def encode_call(fn: Any, args: tuple, export: Callable[[Any], HandleRef | None] | None = None) -> tuple:  # fmt: skip
    """``encode(((), (fn, args)), export)``: a call's request with nothing to free.

    The same bytes, made without the general path's first steps where ``fn`` is a
    remote object whose handle carries no description (a client's).
    """
    ref = export(fn) if export is not None else getattr(fn, "_rpc_ref", None)
    if ref is None or ref.info is not None:
        return encode(((), (fn, args)), export)
    out = bytearray(_CALL_PREFIX)
    out += _BBQ.pack(T_HANDLE, ref.kind, ref.hid)
    out.append(T_NONE)
    bufs: list = []
    _enc(args, out, bufs, export, 2)
    return out, bufs


def _enc(v: Any, out: bytearray, bufs: list, export, depth: int) -> None:
    t = type(v)
    if t is tuple or t is list:  # a request is a tuple of tuples: the common case first
        if depth >= MAX_DEPTH:
            raise DiscoValueError("value nested too deeply for RPC")
        out += _TI.pack(T_TUPLE if t is tuple else T_LIST, len(v))
        for x in v:
            tx = type(x)  # plain ints, None and () inline: most arguments and results
            if tx is int and _INT64_MIN <= x <= _INT64_MAX:
                out += _TQ.pack(T_INT, x)
            elif x is None:
                out.append(T_NONE)
            elif tx is tuple and not x:  # (a request's frees, mostly)
                out += _EMPTY_TUPLE
            else:
                _enc(x, out, bufs, export, depth + 1)
    elif v is None:
        out.append(T_NONE)
    elif t is bool:
        out.append(T_TRUE if v else T_FALSE)
    elif t is int:
        if _INT64_MIN <= v <= _INT64_MAX:
            out += _TQ.pack(T_INT, v)
        else:
            b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            out += _TI.pack(T_BIGINT, len(b))
            out += b
    elif t is float:
        out += _TD.pack(T_FLOAT, v)
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        out += _TI.pack(T_STR, len(b))
        out += b
    elif t is HandleRef:
        out += _BBQ.pack(T_HANDLE, v.kind, v.hid)
        if v.info is None:  # a client's handles carry no description
            out.append(T_NONE)
        else:
            _enc(v.info, out, bufs, export, depth + 1)
    elif t in (bytes, bytearray, memoryview):
        m = memoryview(v).cast("B") if t is memoryview else v
        if len(m) < INLINE_BYTES:
            out += _TI.pack(T_BYTES, len(m))
            out += m
        else:
            out += _TI.pack(T_BUF, len(bufs))
            bufs.append(m)
    elif t is complex:
        out += _TDD.pack(T_COMPLEX, v.real, v.imag)
    else:
        # export decides about every remote handle too: a client refuses another
        # session's objects, a server turns a client object it holds into its own handle
        ref = export(v) if export is not None else getattr(v, "_rpc_ref", None)
        if ref is not None:
            _enc(ref, out, bufs, export, depth)
        elif isinstance(v, np.ndarray):
            view = _array_view(v)
            name = dtype_name(v.dtype).encode()
            out += _TI.pack(T_ARRAY, len(bufs))
            out.append(len(name))
            out += name
            out.append(v.ndim)
            for d in v.shape:
                out += _Q.pack(d)
            bufs.append(view)
        elif isinstance(v, Device):
            out += _TII.pack(T_DEVICE, v.device_type_code, v.device_id)
        elif isinstance(v, (bool, np.bool_)):
            out.append(T_TRUE if v else T_FALSE)
        elif isinstance(v, (int, np.integer)):
            _enc(int(v), out, bufs, export, depth)
        elif isinstance(v, (float, np.floating)):
            out += _TD.pack(T_FLOAT, float(v))
        elif isinstance(v, (complex, np.complexfloating)):
            out += _TDD.pack(T_COMPLEX, v.real, v.imag)
        elif isinstance(v, str):
            _enc(str(v), out, bufs, export, depth)
        elif isinstance(v, dict):
            if depth >= MAX_DEPTH:
                raise DiscoValueError("value nested too deeply for RPC")
            out += _TI.pack(T_DICT, len(v))
            for k, x in v.items():
                _enc(k, out, bufs, export, depth + 1)
                _enc(x, out, bufs, export, depth + 1)
        elif isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
            name = np.dtype(v).name.encode()
            out += _TI.pack(T_DTYPE, len(name))
            out += name
        elif isinstance(v, (tuple, list)):
            _enc((tuple if isinstance(v, tuple) else list)(v), out, bufs, export, depth)
        elif hasattr(v, "__dlpack__") or hasattr(v, "__array__"):
            from disco_core.spi import to_host

            _enc(np.asarray(to_host(v)), out, bufs, export, depth)
        else:
            raise DiscoTypeError(
                f"cannot send a {type(v).__module__}.{type(v).__qualname__} over RPC; "
                "send None, bool, int, float, complex, str, bytes, tuples, lists, dicts, "
                "NumPy arrays, dtypes, devices or remote objects"
            )


def _buffer_size(b: Any) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def frame_size(meta, bufs: list) -> int:
    """The size a receiver checks against its ``max_message_bytes``."""
    return len(meta) + sum(_buffer_size(b) for b in bufs)


def _freeze(v: Any) -> Any:
    """``v`` with every ``bytearray`` (a large byte string read in place) turned into ``bytes``."""
    t = type(v)
    if t is bytearray:
        return bytes(v)
    if t is tuple or t is list:
        return t(_freeze(x) for x in v)
    if t is dict:
        return {k: _freeze(x) for k, x in v.items()}
    return v


_q_from = struct.Struct("<q").unpack_from
_d_from = struct.Struct("<d").unpack_from
_dd_from = struct.Struct("<dd").unpack_from
_I_from = _I.unpack_from
_II_from = struct.Struct("<II").unpack_from
_BQ_from = struct.Struct("<BQ").unpack_from


class _Reads:
    """What a decode collects beside the value: the out-of-band buffers it refers to."""

    __slots__ = ("lens", "used", "on_handle", "fills", "has_bytes")

    def __init__(self, lens: Any, on_handle: Any) -> None:
        self.lens = lens
        self.used: Any = [False] * len(lens) if lens else ()  # (no buffer: indexes refused first)
        self.on_handle = on_handle
        self.fills: list = []  # (index, writable memoryview)
        self.has_bytes = False

    def buffer(self, idx: int, expect: int | None) -> int:
        if idx >= len(self.lens) or self.used[idx]:
            raise ProtocolError(f"bad buffer index {idx}")
        if expect is not None and self.lens[idx] != expect:
            raise ProtocolError(f"buffer {idx} holds {self.lens[idx]} bytes, expected {expect}")
        self.used[idx] = True
        return idx


def _span(meta: bytes, p: int, n: int) -> int:
    """The end of ``n`` bytes from ``p``, which must lie within ``meta``."""
    e = p + n
    if e > len(meta):
        raise ProtocolError("truncated value in frame")
    return e


def _value(meta: bytes, p: int, depth: int, r: _Reads) -> tuple[Any, int]:
    """The value encoded at ``meta[p:]`` and where it ends.

    One function with its state in locals, the common tags first: a call's request
    is decoded on the round trip of every remote call. A read past the end raises
    ``IndexError`` or ``struct.error``, which :func:`decode` reports as truncation.
    """
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    tag = meta[p]
    p += 1
    if tag == T_INT:
        return _q_from(meta, p)[0], p + 8
    if tag == T_TUPLE or tag == T_LIST:
        n = _I_from(meta, p)[0]
        p += 4
        if n > len(meta) - p:
            raise ProtocolError("container longer than its frame")
        items = []
        for _ in range(n):
            t = meta[p]  # plain ints, None, () and bare handles inline: most of a call
            if t == T_INT:
                items.append(_q_from(meta, p + 1)[0])
                p += 9
            elif t == T_NONE:
                items.append(None)
                p += 1
            elif t == T_TUPLE and not _I_from(meta, p + 1)[0]:
                items.append(())
                p += 5
            elif t == T_HANDLE and meta[p + 10] == T_NONE:  # a client's handle (no info)
                kind, hid = _BQ_from(meta, p + 1)
                ref = HandleRef(kind, hid)
                items.append(r.on_handle(ref) if r.on_handle is not None else ref)
                p += 11
            else:
                v, p = _value(meta, p, depth + 1, r)
                items.append(v)
        return (tuple(items) if tag == T_TUPLE else items), p
    if tag == T_NONE:
        return None, p
    if tag == T_HANDLE:
        kind, hid = _BQ_from(meta, p)
        info, p = _value(meta, p + 9, depth + 1, r)
        ref = HandleRef(kind, hid, info)
        return (r.on_handle(ref) if r.on_handle is not None else ref), p
    if tag == T_STR:
        p += 4
        e = _span(meta, p, _I_from(meta, p - 4)[0])
        return meta[p:e].decode("utf-8", "surrogatepass"), e
    if tag == T_FALSE:
        return False, p
    if tag == T_TRUE:
        return True, p
    if tag == T_FLOAT:
        return _d_from(meta, p)[0], p + 8
    if tag == T_BYTES:
        p += 4
        e = _span(meta, p, _I_from(meta, p - 4)[0])
        return meta[p:e], e
    if tag == T_BUF:
        idx = r.buffer(_I_from(meta, p)[0], None)
        out = bytearray(r.lens[idx])  # read in place, made bytes once filled
        r.fills.append((idx, memoryview(out)))
        r.has_bytes = True
        return out, p + 4
    if tag == T_ARRAY:
        idx_at = p
        p += 4
        e = _span(meta, p + 1, meta[p])
        dtype = _parse_dtype(meta[p + 1 : e])
        ndim = meta[e]
        p = _span(meta, e + 1, 8 * ndim)
        shape = struct.unpack_from(f"<{ndim}Q", meta, e + 1)
        count = 1
        for d in shape:
            count *= d
        idx = r.buffer(_I_from(meta, idx_at)[0], count * dtype.itemsize)
        arr = np.empty(shape, dtype)
        r.fills.append((idx, arr.reshape(-1).view(np.uint8).data))
        return arr, p
    if tag == T_DICT:
        n = _I_from(meta, p)[0]
        p += 4
        if n > len(meta) - p:
            raise ProtocolError("container longer than its frame")
        items_of: dict = {}
        hashes: dict[int, int] | None = {} if n > _HASH_CHECK_FROM else None
        for _ in range(n):
            k, p = _value(meta, p, depth + 1, r)
            x, p = _value(meta, p, depth + 1, r)
            try:
                if hashes is not None:
                    _count_hash(hashes, k)
                items_of[k] = x
            except TypeError:
                raise ProtocolError("unhashable dict key") from None
        return items_of, p
    if tag == T_DEVICE:
        code, dev_id = _II_from(meta, p)
        try:
            return Device(code, dev_id), p + 8
        except (ValueError, TypeError) as exc:
            raise ProtocolError(str(exc)) from None
    if tag == T_DTYPE:
        p += 4
        e = _span(meta, p, _I_from(meta, p - 4)[0])
        return _parse_dtype(meta[p:e]), e
    if tag == T_BIGINT:
        p += 4
        e = _span(meta, p, _I_from(meta, p - 4)[0])
        return int.from_bytes(meta[p:e], "little", signed=True), e
    if tag == T_COMPLEX:
        re, im = _dd_from(meta, p)
        return complex(re, im), p + 16
    raise ProtocolError(f"unknown value tag {tag}")


#: Dicts with more keys than this are checked for keys that share a hash: int (and
#: float, tuple) hashes are not randomised, so a peer could send thousands of keys in
#: one hash bucket and make the decoding quadratic (an attacker check: 1 MiB of such
#: keys cost a tracker 18 s of CPU). Hash values are ints below 2**61 that hash to
#: themselves, so counting them is linear whatever the keys.
_HASH_CHECK_FROM = 32
_MAX_SHARED_HASH = 8


def _count_hash(hashes: dict[int, int], key: Any) -> None:
    h = hash(key)
    seen = hashes.get(h, 0) + 1
    if seen > _MAX_SHARED_HASH:
        raise ProtocolError(f"a dict with more than {_MAX_SHARED_HASH} keys of one hash value")
    hashes[h] = seen


def _parse_dtype(name: bytes) -> np.dtype:
    try:
        return as_dtype(name.decode("ascii"))
    except (TypeError, ValueError, SyntaxError, OverflowError, RecursionError) as exc:
        # (as_dtype names most; NumPy's parser raises SyntaxError, and a signal handler's
        # exception must pass through: a broad except took one for a bad dtype)
        raise ProtocolError(f"bad dtype {name[:40]!r}: {type(exc).__name__}: {exc}") from None


def decode(meta, lens=(), on_handle=None) -> tuple[Any, list, bool]:
    """Decode ``meta``; return ``(value, fills, has_bytes)``.

    ``fills`` are the buffers' destinations, by index; ``has_bytes`` says that some
    are byte strings, to pass through :func:`_freeze` once filled.
    """
    if type(meta) is not bytes:
        meta = bytes(meta)
    if type(lens) is not tuple:
        lens = tuple(lens)
    if not lens:  # most replies: an int or None, decoded as the general path would
        n = len(meta)
        if n == 9 and meta[0] == T_INT:
            return _q_from(meta, 1)[0], [], False
        if n == 1 and meta[0] == T_NONE:
            return None, [], False
    r = _Reads(lens, on_handle)
    try:
        if meta.startswith(_CALL_HEAD) and meta[_CALL_ARGS_AT - 1] == T_NONE:
            # a call's request with nothing to free, ``((), (function, args))``: the
            # same value as the general path's, two of its steps fewer
            kind, hid = _BQ_from(meta, _CALL_HID_AT)
            ref = HandleRef(kind, hid)
            args, end = _value(meta, _CALL_ARGS_AT, 2, r)
            value = ((), (on_handle(ref) if on_handle is not None else ref, args))
        else:
            value, end = _value(meta, 0, 0, r)
    except ProtocolError:
        raise
    except (IndexError, struct.error):
        raise ProtocolError("truncated value in frame") from None
    except (UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"malformed value: {exc}") from None
    if end != len(meta):
        raise ProtocolError("trailing bytes after the value")
    if lens:
        if not all(r.used):
            raise ProtocolError("frame has buffers no value refers to")
        r.fills.sort(key=_first)
    return value, r.fills, r.has_bytes


def _first(fill: tuple) -> int:
    return fill[0]


# --------------------------------------------------------------------------- splicing
_SPLICE_MIN = 1 << 20
_CHUNK_HEAD = struct.Struct("<BBHIIQ")  # a frame head with one buffer and no meta


def _unread(sock: socket.socket) -> int:
    """Bytes received on ``sock`` and not read yet."""
    import fcntl
    import termios

    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _real_fd(sink: Any) -> int | None:
    """The file descriptor of ``sink`` when bytes may be spliced into it, else None."""
    if not CAN_SPLICE:
        return None
    try:
        fd = sink.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    return fd if isinstance(fd, int) else None


# --------------------------------------------------------------------------- sealing
class SealedLink(SealedTransport):
    """A :class:`~disco_core.net.protect.SealedTransport` with records of bounded size.

    A ``send_parts`` larger than :data:`SEND_RECORD_BYTES` leaves as several records
    (the core's ``max_send``), so a receiver (or a relay, which forwards only whole verified records) never
    holds more than one record's worth of unverified bytes, and records from the
    peer larger than :data:`RECORD_BYTES` are refused before they are read.
    Its :attr:`record_left` tells a reader whether the bytes it has are all verified.
    """

    def __init__(self, inner: Any, keys: Any) -> None:
        super().__init__(inner, keys, max_record=RECORD_BYTES, max_send=SEND_RECORD_BYTES)
        if getattr(inner, "spin", 0) > 0:
            # the seal adds about 10 µs of work per frame on each side: with the polling
            # window of an unsealed link ($DISCO_RPC_SPIN_US) the next frame often comes
            # just after the reader went to sleep, and a wake-up costs far more
            inner.spin *= 2


def _splices_sealed(t: Any) -> bool:
    """Whether ``t`` is sealed over a plain socket, with a large record under way or
    nothing of a record held (a chunk's head travels in a record of its own: its
    bytes follow in the next records)."""
    return (
        CAN_SPLICE
        and isinstance(t, SealedTransport)
        and type(t.inner) is SocketTransport
        and (t.record_left > 0 or not t.pending)
    )


def _readable(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    except OSError:
        return False


#: Spliced bytes are read back into the record's MAC this many at a time.
_ABSORB_BYTES = 4 << 20


def _absorb_file(t: SealedTransport, fd: int, pos: int, k: int, scratch: memoryview) -> None:
    """Feed the ``k`` bytes at ``pos`` of ``fd`` (just spliced there) to ``t``'s record MAC."""
    while k:
        n = os.preadv(fd, [scratch[: min(k, scratch.nbytes)]], pos)
        if not n:
            raise TransferError(f"the file ended while its spliced bytes were checked ({k} left)")
        t.absorb(scratch[:n])
        pos += n
        k -= n


def _splice_sealed(t: SealedTransport, pipe: tuple[int, int], out_fd: int, size: int, scratch: memoryview) -> None:  # fmt: skip
    """Splice ``size`` payload bytes of ``t``'s current record from its socket into ``out_fd``.

    The bytes never pass through Python on their way (socket -> pipe -> file); every
    :data:`_ABSORB_BYTES` they are read back from the file (page cache, through
    ``scratch``) into the record's MAC, so the tag is checked exactly as if the bytes
    had been received, and before this returns when the record ends here. A file
    that fails mid-way raises :class:`SinkFailedError` after the bytes still in the
    pipe were read and counted: the connection stays in sync.
    """
    mark = [os.lseek(out_fd, 0, os.SEEK_CUR)] * 2  # spliced up to [0], hashed up to [1]

    def on_chunk(k: int, left: int) -> None:
        mark[0] += k
        if mark[0] - mark[1] >= _ABSORB_BYTES or not left:
            _absorb_file(t, out_fd, mark[1], mark[0] - mark[1], scratch)
            mark[1] = mark[0]

    def on_refused(moved: int, rest: bytes) -> None:
        _absorb_file(t, out_fd, mark[1], mark[0] + moved - mark[1], scratch)
        t.absorb(rest)  # the refused bytes still count: the record is checked all the same

    splice_exact(t.inner.sock, pipe, out_fd, size, on_chunk=on_chunk, on_refused=on_refused)


# --------------------------------------------------------------------------- connection
def stop_polling(conn: Conn) -> None:
    """Make ``conn``'s reader sleep in ``recv`` at once (its peer shares its one CPU)."""
    t = getattr(conn.t, "inner", conn.t)  # a sealed link polls on the socket under it
    if hasattr(t, "spin"):
        t.spin = 0.0


class Conn:
    """Frames over a transport, with a read buffer and a bound on frame sizes.

    ``max`` bounds the frames this side accepts; ``peer_max`` (when known) the frames
    the peer accepts: a larger request raises :class:`MessageTooLargeError` before
    anything is sent, and file streams are cut into chunks that fit.
    """

    _BUF = 1 << 16
    #: what a server session learnt from INIT: the heartbeats its client sends (set there)
    peer_beats: int
    #: and whether it sends that client heartbeats while its calls run (set there)
    call_beats: bool

    def __init__(self, transport: Any, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.t = transport
        self.max = int(max_message_bytes)
        self.peer_max: int | None = None
        self.buf = bytearray(self._BUF)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self._pipe: tuple[int, int] | None = None
        self._hash_buf: memoryview | None = None  # sealed bytes spliced to a file, read back

    # -- raw reads ------------------------------------------------------------
    def _recv(self, view) -> int:
        n = self.t.recv_into(view)
        if not n:
            raise EOFError("the peer closed the connection")
        return n

    def read_exact(self, n: int) -> bytearray:
        """Read exactly ``n`` bytes (small reads: handshakes and frame heads)."""
        if self.end - self.start >= n:
            s = self.start
            self.start = s + n
            return self.buf[s : s + n]
        if n > len(self.buf):
            out = unfilled_bytearray(n)  # filled whole, or dropped with the error
            self.read_into(memoryview(out))
            return out
        self._fill(n)
        self.start = n
        return self.buf[:n]

    def _fill(self, n: int) -> None:
        """Have at least ``n`` (at most the buffer's size) bytes buffered, from ``buf[0]``."""
        if self.start == self.end and len(self.buf) > self._BUF:  # grown by settle()
            self.buf = bytearray(self._BUF)
            self.view = memoryview(self.buf)
            self.start = self.end = 0
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start:
            self.buf[: self.end - self.start] = self.buf[self.start : self.end]
            self.end -= self.start
            self.start = 0
        recv = getattr(self.t, "recv_head_into", self.t.recv_into)
        while self.end < n:
            k = recv(self.view[self.end :])
            if not k:
                raise EOFError("the peer closed the connection")
            self.end += k

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (bytes), first from the read buffer, then straight from the transport."""
        size = view.nbytes
        have = min(size, self.end - self.start)
        if have:
            view[:have] = self.view[self.start : self.start + have]
            self.start += have
        while have < size:
            have += self._recv(view[have:])

    def buffered(self) -> int:
        return self.end - self.start

    def drop_through(self, marker: bytes, limit: int, deadline: float | None = None) -> None:
        """Read and drop every byte up to the end of the next ``marker`` in the stream.

        For a client putting its connection back in step after an interrupted call
        (``marker``: the exact frame its fresh ping's answer is). Bytes are searched,
        not parsed as frames: the interruption may have lost the count of a read (Python
        runs a signal handler as a C call returns, before its result is stored), so
        the stream may go on from the middle of a frame, whose bytes could read as a
        plausible head and wait for a frame that never comes.

        ``limit``: the bytes that may come before it (what the interrupted call left to
        come is one frame at most), then :class:`FrameLimitError`; ``deadline``
        (``time.monotonic()``), then :class:`DiscoTimeoutError`: a peer that sends bytes
        without end never ends a read's own timeout.
        """
        keep = len(marker) - 1  # a marker's head may end the bytes searched so far
        dropped = 0
        while True:
            at = self.buf.find(marker, self.start, self.end)
            if at >= 0:
                self.start = at + len(marker)
                self.settle()
                return
            tail = max(self.start, self.end - keep)
            dropped += tail - self.start
            if dropped > limit:
                raise FrameLimitError(
                    f"{dropped} bytes came before the answer awaited, over the {limit} that may"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise DiscoTimeoutError("the answer awaited did not come in time")
            self.buf[: self.end - tail] = self.buf[tail : self.end]
            self.start, self.end = 0, self.end - tail
            if self.end == len(self.buf):  # (a buffer grown by settle(), full of a tail)
                self.buf.extend(bytes(self._BUF))
                self.view = memoryview(self.buf)
            self.end += self._recv(self.view[self.end :])

    def take_buffered(self) -> bytes:
        """The bytes read past the last frame, handed over (a relay or another reader owns them now).

        On a sealed link they are verified: a frame is settled before it is acted on.
        """
        data = bytes(self.view[self.start : self.end])
        self.start = self.end
        return data

    def settle(self) -> None:
        """Make every byte handed out so far verified: finish the sealed record under way.

        Called before a frame is acted on. A frame sent as one record ends with it
        and costs nothing here; when a record goes on past the frame (a relay
        that re-sealed the stream), the rest of it is read into the buffer, where
        the next frames will find it, so its tag is checked first.
        :class:`~disco_core.errors.IntegrityError` if it fails.
        """
        # verified bytes the transport holds go to the buffer too, where select()-driven
        # callers look (``buffered()``) before they wait on the socket
        t = self.t
        if not isinstance(t, SealedTransport):
            return
        left = t.record_left + t.pending
        if not left:
            return
        have = self.end - self.start
        if have + left > len(self.buf):
            nb = bytearray(max(have + left, self._BUF))
            nb[:have] = self.view[self.start : self.end]
            self.buf, self.view = nb, memoryview(nb)
        elif self.start:
            self.buf[:have] = self.buf[self.start : self.end]
        self.start, self.end = 0, have
        while left:
            self.end += self._recv(self.view[self.end : self.end + left])
            left = self.t.record_left + self.t.pending

    # -- frames ---------------------------------------------------------------
    def send(self, kind: int, op: int, value: Any, export=None, flags: int = 0) -> None:
        meta, bufs = encode(value, export)
        self.send_encoded(kind, op, meta, bufs, flags)

    def check_size(self, meta, bufs: list) -> None:
        """Raise :class:`MessageTooLargeError` if the peer would refuse this frame."""
        if self.peer_max is None:
            return
        size = frame_size(meta, bufs) if bufs else len(meta)
        if size > self.peer_max:
            raise MessageTooLargeError(
                f"the message is {size} bytes, over the peer's limit of {self.peer_max} bytes "
                "(its max_message_bytes); nothing was sent"
            )

    def send_encoded(self, kind: int, op: int, meta, bufs: list, flags: int = 0) -> None:
        if not bufs:  # a small frame: one buffer, one system call
            self.t.send_parts([_HEAD.pack(kind, op, flags, len(meta), 0) + meta])
            return
        head = bytearray(_HEAD.pack(kind, op, flags, len(meta), len(bufs)))
        total = 0
        for b in bufs:
            size = _buffer_size(b)
            total += size
            head += _Q.pack(size)
        head += meta
        if total >= _HEAD_ALONE_FROM and isinstance(self.t, SealedTransport):
            # The head in a record of its own: the peer sizes its buffers from verified
            # bytes (in one record with the data, it allocated what an on-path attacker
            # wrote there before the tag could fail: an attacker check)
            self.t.send_parts([head])
            self.t.send_parts(bufs)
            return
        self.t.send_parts([head, *bufs])

    def recv(self, on_handle=None, direct=None, on_begin=None):
        """Read one frame; return ``(kind, op, value)``.

        ``on_begin()``, optional, is called once the frame's head has come (the rest of
        a large frame may take long to arrive): a server starts its heartbeats there.

        ``direct(op, value, fills)``, optional, is asked where the frame's buffers go
        before they are read (``fills``: ``(index, writable view)`` pairs) and returns
        ``(value, fills)``: a server receives a ``copyfrom``'s array straight into the
        tensor it overwrites.

        Raises :class:`DesyncError` (:class:`FrameTooLargeError`: the connection must then be
        dropped), :class:`ProtocolError` (the frame was consumed: the connection is
        still in sync) or ``EOFError``.
        """
        while True:  # the head, read in place (a head read in part stays for the next call)
            if self.end - self.start < _HEAD_SIZE:
                self._fill(_HEAD_SIZE)
            kind, op, _flags, meta_len, nbuf = _HEAD_FROM(self.buf, self.start)
            self.start += _HEAD_SIZE
            if kind != HEARTBEAT or meta_len or nbuf:
                break  # (a heartbeat, "still here", is skipped)
        if on_begin is not None:
            on_begin()
        if nbuf > MAX_BUFFERS or meta_len + 8 * nbuf > self.max:
            self._blame()
            raise FrameTooLargeError(
                f"frame declares {meta_len} header bytes and {nbuf} buffers; "
                f"the limit is {self.max} bytes"
            )
        if nbuf:
            lens = struct.unpack(f"<{nbuf}Q", self.read_exact(8 * nbuf))
            total = meta_len + sum(lens)
        else:
            lens, total = (), meta_len
        if total > self.max:
            self._blame()
            raise FrameTooLargeError(
                f"frame of {total} bytes is over the limit of {self.max} bytes (max_message_bytes)"
            )
        if kind == CHUNK_FRAME:
            self._skip(total)
            self.settle()
            raise ProtocolError("a file chunk where no file transfer was going on")
        s = self.start
        if self.end - s >= meta_len:  # a small frame came whole with its head: one copy
            meta = bytes(self.view[s : s + meta_len])
            self.start = s + meta_len
        else:
            if getattr(self.t, "record_left", 0):
                # The head's record goes on unverified: verify it before the header is
                # sized from the head (an on-path attacker declared 4 GiB: outside check)
                self.settle()
            meta = self.read_exact(meta_len)  # decode() makes it bytes
        if nbuf and getattr(self.t, "record_left", 0):
            # The head's record goes on unverified: verify it before anything is sized
            # from the head (a sender of this version seals a large frame's head alone,
            # so this copies only what another sender or a relay put with it)
            self.settle()
        try:
            value, fills, has_bytes = decode(meta, lens, on_handle)
            if direct is not None and fills:
                value, fills = direct(op, value, fills)
        except BaseException:
            self._skip(sum(lens))
            self.settle()
            raise
        for _idx, view in fills:
            self.read_into(view)
        self.settle()
        return kind, op, (_freeze(value) if has_bytes else value)

    def _blame(self) -> None:
        """Before a head's sizes are reported as the peer's: verify the record it came in.

        On a sealed link a head at the start of a large record is handed out before
        the record's tag is checked; an on-path attacker who wrote it is then an
        :class:`~disco_core.errors.IntegrityError`, not the peer's oversize frame
        (the rest of the record is at most a record's bound).
        """
        if getattr(self.t, "record_left", 0):
            self.settle()

    # -- file streams ---------------------------------------------------------
    def chunk_size(self) -> int:
        """The largest chunk the peer accepts (:data:`CHUNK` at most)."""
        return max(1, min(CHUNK, self.peer_max if self.peer_max is not None else CHUNK))

    def send_stream(self, op: int, source: Any, size: int, progress=None) -> OSError | None:
        """Send ``size`` bytes of ``source`` (bytes-like, or a :class:`FileSource`) as chunks.

        Returns None, or the error of a local file that failed in the middle (the
        peer was then sent an abort, so the connection stays in sync).
        """
        chunk = self.chunk_size()
        view = None if type(source) is FileSource else memoryview(source).cast("B")
        end = _HEAD.pack(CHUNK_FRAME, op, FLAG_END, 0, 0)
        done = 0
        if progress is not None and size == 0:
            progress(0, 0)
        while done < size:
            n = min(chunk, size - done)
            tail = [end] if done + n == size else []
            if view is not None:
                self.t.send_parts([_CHUNK_HEAD.pack(CHUNK_FRAME, op, 0, 0, 1, n), view[done : done + n], *tail])  # fmt: skip
            else:
                self.t.send_parts([_CHUNK_HEAD.pack(CHUNK_FRAME, op, 0, 0, 1, n)])
                err = self._send_file_chunk(source.file, n)
                if err is not None:
                    self.send(CHUNK_FRAME, op, f"the sender's file failed: {err}", flags=FLAG_ABORT)
                    return err
                if tail:
                    self.t.send_parts(tail)
            done += n
            if progress is not None:
                progress(done, size)
        if size == 0:
            self.t.send_parts([end])
        return None

    def _send_file_chunk(self, file: Any, n: int) -> OSError | None:
        """Send ``n`` bytes of ``file``; a file that fails is padded so the chunk stays whole."""
        left = n - self.t.sendfile(file, n)
        err = None
        buf: Any = memoryview(bytearray(min(left, CHUNK))) if left else None  # used only if left
        while left:
            k = 0
            if err is None:
                try:
                    k = file.readinto(buf[: min(left, buf.nbytes)])
                except OSError as exc:
                    err = exc
                if not k and err is None:
                    err = OSError(f"the file ended {left} bytes early")
            if err is not None:
                k = min(left, buf.nbytes)
                buf[:k] = bytes(k)  # padding behind the abort
            self.t.send_parts([buf[:k]])
            left -= k
        return err

    def recv_stream(self, op: int, size: int, into: memoryview | None = None, sink: Any = None, progress=None) -> None:  # fmt: skip
        """Receive a stream of ``size`` bytes into ``into`` (a writable view), ``sink`` (a binary file) or nowhere.

        A sink that fails is not written any more, the rest of the stream is read
        and dropped, then its ``OSError`` is raised: the connection stays in sync.
        Raises :class:`StreamAbortedError` if the sender gave up, :class:`DesyncError` on a
        malformed stream.
        """
        done = 0
        failed: OSError | None = None
        if progress is not None and size == 0:
            progress(0, 0)
        while done < size:
            n = self._chunk_head(op, size - done)
            if failed is not None or (into is None and sink is None):
                self._skip(n)
            elif into is not None:
                self.read_into(into[done : done + n])
            else:
                try:
                    self._chunk_to_file(sink, n)
                except SinkFailedError as exc:
                    failed = exc.exc
                    self._skip(exc.left)
            done += n
            if progress is not None:
                progress(done, size)
        self._chunk_head(op, 0)  # the end (or an abort that comes with the last chunk)
        self.settle()  # nothing of the stream counts before its last record verified
        if failed is not None:
            raise failed

    def skip_stream(self, op: int, size: int) -> None:
        """Read and drop a stream of ``size`` bytes (its request was refused)."""
        self.recv_stream(op, size)

    def _chunk_head(self, op: int, left: int) -> int:
        """Read a chunk frame's head; return its size (its bytes come next).

        With ``left == 0`` the frame must be the stream's end (0 is returned).
        """
        kind, cop, flags, meta_len, nbuf = _HEAD.unpack(self.read_exact(_HEAD.size))
        if kind != CHUNK_FRAME or cop != op:
            raise DesyncError(f"expected a file chunk, got a frame of kind {kind}")
        if flags & FLAG_ABORT and nbuf == 0 and meta_len <= min(self.max, 1 << 16):
            try:
                reason, _f, _b = decode(bytes(self.read_exact(meta_len)))
            except ProtocolError:
                reason = "(unreadable reason)"
            self.settle()
            raise StreamAbortedError(str(reason))
        if left == 0:
            if flags != FLAG_END or nbuf or meta_len:
                raise DesyncError("a file stream without its end")
            return 0
        if flags or nbuf != 1 or meta_len:
            raise DesyncError("malformed file chunk")
        (n,) = _Q.unpack(self.read_exact(8))
        if not 0 < n <= min(left, self.max):
            raise DesyncError(f"file chunk of {n} bytes (expected at most {min(left, self.max)})")
        return n

    def _chunk_to_file(self, sink: Any, n: int) -> None:
        """Write the ``n`` bytes of a chunk to ``sink``, spliced when it is a real file."""
        t = self.t
        sealed = None
        out_fd = _real_fd(sink) if n >= _SPLICE_MIN and type(t) is SocketTransport else None
        if out_fd is None and n >= _SPLICE_MIN and _splices_sealed(t):
            out_fd = _real_fd(sink)
            if out_fd is not None and _readable(out_fd):
                sealed = t  # spliced too, then read back into its MAC
            else:
                out_fd = None
        have = min(n, self.end - self.start)
        try:
            if have:
                sink.write(self.view[self.start : self.start + have])
        except OSError as exc:
            raise SinkFailedError(exc, n) from None
        self.start += have
        if out_fd is not None:
            try:
                sink.flush()
            except OSError as exc:
                raise SinkFailedError(exc, n - have) from None
            if self._pipe is None:
                self._pipe = new_pipe()
            if sealed is None:
                splice_exact(self.t.sock, self._pipe, out_fd, n - have)
                return
            # a chunk sent in several records: each large one is spliced in turn; a
            # small one (read whole by the seal) and what follows it are read below
            if self._hash_buf is None:
                self._hash_buf = memoryview(bytearray(_ABSORB_BYTES))
            while have < n:
                k = min(n - have, sealed.record_left or sealed.begin_record())
                if not k:
                    break
                try:
                    _splice_sealed(sealed, self._pipe, out_fd, k, self._hash_buf)
                except SinkFailedError as exc:  # what this record held is read: the rest
                    raise SinkFailedError(exc.exc, exc.left + n - have - k) from None
                have += k
        left = n - have
        scratch = memoryview(bytearray(min(left, CHUNK) or 1))
        while left:
            k = min(left, scratch.nbytes)
            self.read_into(scratch[:k])
            left -= k
            try:
                sink.write(scratch[:k])
            except OSError as exc:
                raise SinkFailedError(exc, left) from None

    def _skip(self, n: int) -> None:
        if n <= 0:
            return
        scratch = memoryview(bytearray(min(n, CHUNK)))
        while n:
            k = min(n, scratch.nbytes)
            self.read_into(scratch[:k])
            n -= k

    # -- liveness (see HEARTBEAT) ----------------------------------------------
    def send_heartbeat(self) -> None:
        """Send one heartbeat frame (the caller holds whatever serialises this side's sends)."""
        self.send_encoded(HEARTBEAT, 0, b"", [])  # the 12 bytes of HEARTBEAT_FRAME

    def drop_heartbeats(self, limit: int = 4 << 20) -> int:
        """Read what has arrived, without blocking, and drop the heartbeat frames at its head.

        For a thread other than the reader, while the reader is busy elsewhere (a
        session running a long call): the heartbeats a live client sends meanwhile
        would otherwise fill the socket's receive queue, after which the kernel
        stops taking data and the client looks silent. Anything else stays in the
        read buffer for the reader. At most ``limit`` bytes are read (a peer that
        floods heartbeats cannot keep the caller here). On a sealed link each one is
        checked (:class:`~disco_core.errors.IntegrityError` if forged). Plain
        sockets and sealed links over them; the caller makes sure the reader is not
        reading meanwhile. Returns how many heartbeats were dropped.
        """
        sock = self.t.sock
        size = _HEAD.size
        sealed = isinstance(self.t, SealedTransport)
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        dropped = 0
        while True:
            while self.end - self.start >= size and self.buf[self.start : self.start + size] == HEARTBEAT_FRAME:  # fmt: skip
                self.start += size
                dropped += 1
            if self.end - self.start >= size:
                return dropped  # something else: the reader's
            if self.start:
                self.buf[: self.end - self.start] = self.buf[self.start : self.end]
                self.end -= self.start
                self.start = 0
            if limit <= 0 or not poll.poll(0):
                return dropped  # nothing more has arrived (a socket with a timeout would wait)
            if sealed:
                k = self._take_sealed_heartbeat(sock)
            else:
                try:
                    k = sock.recv_into(self.view[self.end :], 0, _DONTWAIT)
                except (BlockingIOError, InterruptedError, TimeoutError):
                    return dropped
            if not k:
                return dropped  # the end of the stream (the reader sees it too), or not a heartbeat
            self.end += k
            limit -= k

    def _take_sealed_heartbeat(self, sock: socket.socket) -> int:
        """On a sealed link: take the next record if it is whole here and heartbeat-sized.

        The record is read through the seal (checked, then its bytes are the
        reader's like any other), so this never blocks and never passes on a forged
        byte; anything else is left on the socket for the reader.
        """
        t = self.t
        if t.pending or t.record_left or self.end + _HEAD.size > len(self.buf):
            return 0
        whole = _SEALED_OVERHEAD + _HEAD.size
        try:
            head = sock.recv(8, socket.MSG_PEEK | _DONTWAIT)
            if len(head) < 8 or _Q.unpack(head)[0] != _HEAD.size or _unread(sock) < whole:
                return 0
        except (BlockingIOError, InterruptedError, TimeoutError):
            return 0
        return t.recv_into(self.view[self.end : self.end + _HEAD.size])

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        self.t.close()
