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
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from disco_core.device import Device, as_dtype

from .errors import FrameTooLarge, ProtocolError

__all__ = [
    "HandleRef",
    "FileSource",
    "Pending",
    "encode",
    "decode",
    "Conn",
    "SocketTransport",
    "SSLTransport",
    "PipeTransport",
    "DEFAULT_MAX_MESSAGE_BYTES",
]

#: Default bound on one frame (header plus buffers).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
#: Byte strings at least this long travel out of band.
INLINE_BYTES = 1 << 14
#: Largest nesting depth of containers accepted from a peer.
MAX_DEPTH = 64
#: Largest number of out-of-band buffers in a frame.
MAX_BUFFERS = 1 << 16
#: Chunk size for progress reporting and file streaming.
CHUNK = 8 << 20
#: Microseconds a reader polls a socket without blocking before it sleeps in ``recv``
#: (``$DISCO_RPC_SPIN_US``; 0 turns polling off). See README, "Speed".
SPIN_US = float(os.environ.get("DISCO_RPC_SPIN_US", "50") or 0)

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


# frame kinds
REQUEST, REPLY, ERROR = 1, 2, 3

# value tags
(
    T_NONE,
    T_FALSE,
    T_TRUE,
    T_INT,
    T_BIGINT,
    T_FLOAT,
    T_COMPLEX,
    T_STR,
    T_BYTES,
    T_BUF,
    T_TUPLE,
    T_LIST,
    T_DICT,
    T_ARRAY,
    T_HANDLE,
    T_DEVICE,
    T_DTYPE,
) = range(17)

_HEAD = struct.Struct("<BBHII")
_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_TQ = struct.Struct("<Bq")
_TD = struct.Struct("<Bd")
_TDD = struct.Struct("<Bdd")
_TI = struct.Struct("<BI")
_TII = struct.Struct("<BII")
_BBQ = struct.Struct("<BBQ")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_perf = time.perf_counter
_yield = getattr(os, "sched_yield", lambda: None)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


class HandleRef:
    """A server-side object named by ``(kind, id)``; ``info`` describes it (a plain value)."""

    __slots__ = ("kind", "hid", "info")

    FUNC, MODULE, TENSOR, OBJECT = 1, 2, 3, 4

    def __init__(self, kind: int, hid: int, info: Any = None) -> None:
        self.kind = kind
        self.hid = hid
        self.info = info

    def __repr__(self) -> str:
        return f"HandleRef({self.kind}, {self.hid}, {self.info!r})"


class FileSource:
    """An out-of-band buffer read from an open binary file, ``size`` bytes from its position."""

    __slots__ = ("file", "size")

    def __init__(self, file: Any, size: int) -> None:
        self.file = file
        self.size = size


class Pending:
    """An out-of-band buffer not read yet (a deferred frame): stream it with :meth:`Conn.read_pending`."""

    __slots__ = ("index", "size", "done")

    def __init__(self, index: int, size: int) -> None:
        self.index = index
        self.size = size
        self.done = False


# --------------------------------------------------------------------------- encoding
def _array_view(arr: np.ndarray) -> memoryview:
    if arr.dtype.hasobject:
        raise TypeError("arrays of Python objects cannot be sent over RPC")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return memoryview(arr.reshape(-1).view(np.uint8))


def encode(value: Any, export: Callable[[Any], HandleRef | None] | None = None) -> tuple:
    """Encode ``value``; return ``(meta, buffers)``.

    ``export(obj)`` is asked first about every object that is not a plain value
    (arrays included); a :class:`HandleRef` it returns travels instead of ``obj``.
    """
    out = bytearray()
    bufs: list = []
    _enc(value, out, bufs, export, 0)
    return out, bufs


def _enc(v: Any, out: bytearray, bufs: list, export, depth: int) -> None:
    t = type(v)
    if v is None:
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
    elif t is tuple or t is list:
        if depth >= MAX_DEPTH:
            raise ValueError("value nested too deeply for RPC")
        out += _TI.pack(T_TUPLE if t is tuple else T_LIST, len(v))
        for x in v:
            _enc(x, out, bufs, export, depth + 1)
    elif t is HandleRef:
        out += _BBQ.pack(T_HANDLE, v.kind, v.hid)
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
    elif t is FileSource:
        out += _TI.pack(T_BUF, len(bufs))
        bufs.append(v)
    else:
        ref = getattr(v, "_rpc_ref", None)
        if ref is None and export is not None:
            ref = export(v)
        if ref is not None:
            _enc(ref, out, bufs, export, depth)
        elif isinstance(v, np.ndarray):
            view = _array_view(v)
            name = v.dtype.name.encode()
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
                raise ValueError("value nested too deeply for RPC")
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
            from disco_core.device import to_host

            _enc(np.asarray(to_host(v)), out, bufs, export, depth)
        else:
            raise TypeError(
                f"cannot send a {type(v).__module__}.{type(v).__qualname__} over RPC; "
                "send None, bool, int, float, complex, str, bytes, tuples, lists, dicts, "
                "NumPy arrays, dtypes, devices or remote objects"
            )


def _buffer_size(b: Any) -> int:
    return b.size if type(b) is FileSource else b.nbytes if isinstance(b, memoryview) else len(b)


class _Decoder:
    __slots__ = ("meta", "pos", "lens", "used", "on_handle", "defer", "fills")

    def __init__(self, meta, lens, on_handle, defer):
        self.meta = meta
        self.pos = 0
        self.lens = lens
        self.used = [False] * len(lens)
        self.on_handle = on_handle
        self.defer = defer
        self.fills: list = []  # (index, writable memoryview or Pending)

    def _take(self, n: int):
        p = self.pos
        if n < 0 or p + n > len(self.meta):
            raise ProtocolError("truncated value in frame")
        self.pos = p + n
        return self.meta[p : p + n]

    def _u32(self) -> int:
        p = self.pos
        if p + 4 > len(self.meta):
            raise ProtocolError("truncated value in frame")
        self.pos = p + 4
        return _I.unpack_from(self.meta, p)[0]

    def _buffer(self, expect: int | None) -> int:
        idx = self._u32()
        if idx >= len(self.lens) or self.used[idx]:
            raise ProtocolError(f"bad buffer index {idx}")
        if expect is not None and self.lens[idx] != expect:
            raise ProtocolError(f"buffer {idx} holds {self.lens[idx]} bytes, expected {expect}")
        self.used[idx] = True
        return idx

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ProtocolError("value nested too deeply")
        meta = self.meta
        p = self.pos
        if p >= len(meta):
            raise ProtocolError("truncated value in frame")
        tag = meta[p]
        self.pos = p + 1
        if tag == T_INT:
            return struct.unpack("<q", self._take(8))[0]
        if tag == T_NONE:
            return None
        if tag == T_STR:
            return bytes(self._take(self._u32())).decode("utf-8", "surrogatepass")
        if tag == T_TUPLE or tag == T_LIST:
            n = self._u32()
            if n > len(meta) - self.pos:
                raise ProtocolError("container longer than its frame")
            items = [self.value(depth + 1) for _ in range(n)]
            return tuple(items) if tag == T_TUPLE else items
        if tag == T_FALSE:
            return False
        if tag == T_TRUE:
            return True
        if tag == T_FLOAT:
            return struct.unpack("<d", self._take(8))[0]
        if tag == T_HANDLE:
            kind, hid = struct.unpack("<BQ", self._take(9))
            info = self.value(depth + 1)
            ref = HandleRef(kind, hid, info)
            return self.on_handle(ref) if self.on_handle is not None else ref
        if tag == T_BYTES:
            return bytes(self._take(self._u32()))
        if tag == T_BUF:
            idx = self._buffer(None)
            if self.defer:
                pend = Pending(idx, self.lens[idx])
                self.fills.append((idx, pend))
                return pend
            out = bytearray(self.lens[idx])
            self.fills.append((idx, memoryview(out)))
            return out
        if tag == T_ARRAY:
            nbytes_idx_pos = self.pos
            self._take(4)
            dtype = _parse_dtype(bytes(self._take(self._take(1)[0])))
            ndim = self._take(1)[0]
            shape = struct.unpack(f"<{ndim}Q", self._take(8 * ndim))
            count = 1
            for d in shape:
                count *= d
            end = self.pos
            self.pos = nbytes_idx_pos
            idx = self._buffer(count * dtype.itemsize)
            self.pos = end
            arr = np.empty(shape, dtype)
            self.fills.append((idx, memoryview(arr.reshape(-1).view(np.uint8))))
            return arr
        if tag == T_DICT:
            n = self._u32()
            if n > len(meta) - self.pos:
                raise ProtocolError("container longer than its frame")
            out = {}
            for _ in range(n):
                k = self.value(depth + 1)
                try:
                    out[k] = self.value(depth + 1)
                except TypeError:
                    raise ProtocolError("unhashable dict key") from None
            return out
        if tag == T_DEVICE:
            code, dev_id = struct.unpack("<II", self._take(8))
            try:
                return Device(code, dev_id)
            except (ValueError, TypeError) as exc:
                raise ProtocolError(str(exc)) from None
        if tag == T_DTYPE:
            return _parse_dtype(bytes(self._take(self._u32())))
        if tag == T_BIGINT:
            return int.from_bytes(self._take(self._u32()), "little", signed=True)
        if tag == T_COMPLEX:
            re, im = struct.unpack("<dd", self._take(16))
            return complex(re, im)
        raise ProtocolError(f"unknown value tag {tag}")


def _parse_dtype(name: bytes) -> np.dtype:
    try:
        return as_dtype(name.decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"bad dtype {name[:40]!r}: {exc}") from None


def decode(meta, lens=(), on_handle=None, defer=False) -> tuple[Any, list]:
    """Decode ``meta``; return ``(value, fills)``: the buffers' destinations, by index."""
    d = _Decoder(memoryview(meta), list(lens), on_handle, defer)
    try:
        value = d.value()
    except ProtocolError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, IndexError, OverflowError) as exc:
        raise ProtocolError(f"malformed value: {exc}") from None
    if d.pos != len(d.meta):
        raise ProtocolError("trailing bytes after the value")
    if not all(d.used):
        raise ProtocolError("frame has buffers no value refers to")
    d.fills.sort(key=lambda f: f[0])
    return value, d.fills


# --------------------------------------------------------------------------- transports
class SocketTransport:
    """A connected stream socket: ``sendmsg`` of header and buffers in one call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.recv_into = sock.recv_into
        self.spin = SPIN_US * 1e-6

    def recv_head_into(self, view) -> int:
        """``recv_into`` that first polls without blocking for up to ``SPIN_US``."""
        spin = self.spin
        sock = self.sock
        if spin > 0 and sock.gettimeout() is None:
            recv_into = sock.recv_into
            deadline = _perf() + spin
            while True:
                try:
                    return recv_into(view, 0, _DONTWAIT)
                except BlockingIOError:
                    if _perf() > deadline:
                        break
                    _yield()
        return sock.recv_into(view)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_parts(self, parts: list) -> None:
        sock = self.sock
        parts = [p if isinstance(p, memoryview) else memoryview(p) for p in parts if len(p)]
        while parts:
            n = sock.sendmsg(parts[:512])
            while n:
                first = parts[0]
                if n >= first.nbytes:
                    n -= first.nbytes
                    parts.pop(0)
                else:
                    parts[0] = first[n:]
                    n = 0

    def sendfile(self, file: Any, size: int) -> int:
        return self.sock.sendfile(file, count=size) if size else 0

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class SSLTransport(SocketTransport):
    """A TLS socket (``sendmsg`` and ``sendfile`` are not available through TLS)."""

    def recv_head_into(self, view) -> int:
        return self.sock.recv_into(view)

    def send_parts(self, parts: list) -> None:
        for p in parts:
            self.sock.sendall(p)

    def sendfile(self, file: Any, size: int) -> int:
        return 0


class PipeTransport:
    """A pair of pipe file descriptors (a server spoken to over stdin/stdout)."""

    def __init__(self, rfd: int, wfd: int, timeout: float | None = None) -> None:
        self.rfd = rfd
        self.wfd = wfd
        self.timeout = timeout

    def fileno(self) -> int:
        return self.rfd

    def recv_into(self, view) -> int:
        if self.timeout is not None:
            r, _, _ = select.select([self.rfd], [], [], self.timeout)
            if not r:
                raise TimeoutError("timed out reading from the pipe")
        return os.readv(self.rfd, [view])

    def send_parts(self, parts: list) -> None:
        parts = [p if isinstance(p, memoryview) else memoryview(p) for p in parts if len(p)]
        while parts:
            n = os.writev(self.wfd, parts[:512])
            while n:
                first = parts[0]
                if n >= first.nbytes:
                    n -= first.nbytes
                    parts.pop(0)
                else:
                    parts[0] = first[n:]
                    n = 0

    def sendfile(self, file: Any, size: int) -> int:
        return 0

    def settimeout(self, t: float | None) -> None:
        self.timeout = t

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            try:
                os.close(fd)
            except OSError:
                pass


# --------------------------------------------------------------------------- splicing
_CAN_SPLICE = hasattr(os, "splice")
_SPLICE_MIN = 1 << 20
_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031


def _real_fd(sink: Any) -> int | None:
    """The file descriptor of ``sink`` when bytes may be spliced into it, else None."""
    if not _CAN_SPLICE:
        return None
    try:
        fd = sink.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    return fd if isinstance(fd, int) else None


def _splice_to(sock: socket.socket, out_fd: int, size: int, progress: Any, total: int) -> None:
    """Move ``size`` bytes from ``sock`` to ``out_fd`` inside the kernel (socket -> pipe -> file).

    Received data is never copied through Python: reading into a buffer and writing
    it out costs two copies and halves an upload's speed.
    """
    import fcntl

    sfd = sock.fileno()
    timeout = sock.gettimeout()
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass
        left = size
        while left:
            try:
                k = os.splice(sfd, w, min(left, _PIPE_BYTES))
            except BlockingIOError:  # a socket with a timeout is non-blocking underneath
                if not select.select([sfd], [], [], timeout)[0]:
                    raise TimeoutError("timed out receiving a transfer") from None
                continue
            if not k:
                raise EOFError("the peer closed the connection in the middle of a transfer")
            left -= k
            while k:
                k -= os.splice(r, out_fd, k)
            if progress is not None:
                progress(total - left, total)
    finally:
        os.close(r)
        os.close(w)


# --------------------------------------------------------------------------- connection
class Conn:
    """Frames over a transport, with a read buffer and a bound on frame sizes."""

    _BUF = 1 << 16

    def __init__(self, transport: Any, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.t = transport
        self.max = int(max_message_bytes)
        self.buf = bytearray(self._BUF)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.pending: list = []

    # -- raw reads ------------------------------------------------------------
    def _recv(self, view) -> int:
        n = self.t.recv_into(view)
        if not n:
            raise EOFError("the peer closed the connection")
        return n

    def read_exact(self, n: int) -> bytes:
        """Read exactly ``n`` bytes (small reads: handshakes and frame heads)."""
        if self.end - self.start >= n:
            s = self.start
            self.start = s + n
            return self.buf[s : s + n]
        if n > len(self.buf):
            out = bytearray(n)
            self.read_into(memoryview(out))
            return out
        if self.start:
            self.buf[: self.end - self.start] = self.buf[self.start : self.end]
            self.end -= self.start
            self.start = 0
        recv = getattr(self.t, "recv_head_into", self.t.recv_into)
        while self.end < n:
            k = recv(self.view[self.end :])
            if not k:
                raise EOFError("the peer closed the connection")
            self.end += k
        self.start = n
        return self.buf[:n]

    def read_into(self, view: memoryview, progress=None, done: int = 0, total: int = 0) -> None:
        """Fill ``view`` (bytes), first from the read buffer, then straight from the transport."""
        size = view.nbytes
        have = min(size, self.end - self.start)
        if have:
            view[:have] = self.view[self.start : self.start + have]
            self.start += have
        if progress is None:
            while have < size:
                have += self._recv(view[have:])
            return
        while have < size:
            stop = min(size, have + CHUNK)
            while have < stop:
                have += self._recv(view[have:stop])
            progress(done + have, total)

    def buffered(self) -> int:
        return self.end - self.start

    # -- frames ---------------------------------------------------------------
    def send(self, kind: int, op: int, value: Any, export=None, progress=None) -> None:
        meta, bufs = encode(value, export)
        self.send_encoded(kind, op, meta, bufs, progress)

    def send_encoded(self, kind: int, op: int, meta, bufs: list, progress=None) -> None:
        sizes = [_buffer_size(b) for b in bufs]
        head = bytearray(_HEAD.pack(kind, op, 0, len(meta), len(bufs)))
        for s in sizes:
            head += _Q.pack(s)
        head += meta
        total = sum(sizes)
        if progress is None and not any(type(b) is FileSource for b in bufs):
            self.t.send_parts([head, *bufs])
            return
        self.t.send_parts([head])
        done = 0
        for b, size in zip(bufs, sizes):
            if type(b) is FileSource:
                done = self._send_file(b, done, total, progress)
                continue
            view = b if isinstance(b, memoryview) else memoryview(b)
            for off in range(0, size, CHUNK):
                self.t.send_parts([view[off : off + CHUNK]])
                done += min(CHUNK, size - off)
                if progress is not None:
                    progress(done, total)

    def _send_file(self, src: FileSource, done: int, total: int, progress) -> int:
        left = src.size
        if progress is None:
            sent = self.t.sendfile(src.file, left)
            left -= sent
            done += sent
        chunk = bytearray(min(CHUNK, max(left, 1)))
        view = memoryview(chunk)
        while left > 0:
            n = src.file.readinto(view[: min(left, len(chunk))])
            if not n:
                raise OSError(f"file ended {left} bytes early while sending it")
            self.t.send_parts([view[:n]])
            left -= n
            done += n
            if progress is not None:
                progress(done, total)
        return done

    def recv(self, on_handle=None, defer: bool | Callable[[int], bool] = False, progress=None):
        """Read one frame; return ``(kind, op, value)``.

        With ``defer`` (or ``defer(op)`` true), large byte buffers stay unread as
        :class:`Pending` values: read them with :meth:`read_pending`, then call
        :meth:`finish` (which skips any left over). Raises :class:`FrameTooLarge`
        (the connection must then be dropped), :class:`ProtocolError` (the frame was
        consumed: the connection is still in sync) or ``EOFError``.
        """
        kind, op, _flags, meta_len, nbuf = _HEAD.unpack(self.read_exact(_HEAD.size))
        if nbuf > MAX_BUFFERS or meta_len + 8 * nbuf > self.max:
            raise FrameTooLarge(
                f"frame declares {meta_len} header bytes and {nbuf} buffers; "
                f"the limit is {self.max} bytes"
            )
        lens = struct.unpack(f"<{nbuf}Q", self.read_exact(8 * nbuf)) if nbuf else ()
        total = meta_len + sum(lens)
        if total > self.max:
            raise FrameTooLarge(
                f"frame of {total} bytes is over the limit of {self.max} bytes (max_message_bytes)"
            )
        meta = bytes(self.read_exact(meta_len))
        if callable(defer):
            defer = defer(op)
        try:
            value, fills = decode(meta, lens, on_handle, defer)
        except ProtocolError:
            self._skip(sum(lens))
            raise
        except BaseException:
            self._skip(sum(lens))
            raise
        btotal = sum(lens)
        if defer:
            self.pending = [f for f in fills]
            return kind, op, value
        done = 0
        for _idx, view in fills:
            self.read_into(view, progress, done, btotal)
            done += view.nbytes
        return kind, op, value

    def read_pending(self, pend: Pending, sink=None, progress=None) -> Any:
        """Read a deferred buffer, into ``sink`` (a binary file) or a new ``bytearray``."""
        if self.pending and self.pending[0][1] is not pend:
            raise RuntimeError("deferred buffers must be read in order")
        if sink is None:
            # np.empty: no zero-filling pass over memory the socket overwrites anyway
            out = memoryview(np.empty(pend.size, np.uint8)).cast("B")
            self.read_into(out, progress, 0, pend.size)
            pend.done = True
            self.pending.pop(0)
            return out
        left = pend.size
        out_fd = _real_fd(sink) if left >= _SPLICE_MIN and type(self.t) is SocketTransport else None
        if out_fd is not None:
            have = min(left, self.end - self.start)
            if have:
                sink.write(self.view[self.start : self.start + have])
                self.start += have
            sink.flush()
            _splice_to(self.t.sock, out_fd, left - have, progress, pend.size)
            pend.done = True
            self.pending.pop(0)
            return None
        chunk = bytearray(min(CHUNK, max(pend.size, 1)))
        view = memoryview(chunk)
        while left:
            n = min(left, len(chunk))
            self.read_into(view[:n])
            sink.write(view[:n])
            left -= n
            if progress is not None:
                progress(pend.size - left, pend.size)
        pend.done = True
        self.pending.pop(0)
        return None

    def finish(self) -> None:
        """Skip whatever deferred buffers were not read."""
        left = sum(p.size for _i, p in self.pending if not p.done)
        self.pending = []
        self._skip(left)

    def _skip(self, n: int) -> None:
        if n <= 0:
            return
        scratch = memoryview(bytearray(min(n, CHUNK)))
        while n:
            k = min(n, scratch.nbytes)
            self.read_into(scratch[:k])
            n -= k

    def close(self) -> None:
        self.t.close()
