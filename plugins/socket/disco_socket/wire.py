"""The wire protocol between a controller and its node agents.

A connection has two phases.

**Handshake** (fixed binary and JSON messages only; nothing is unpickled)::

    node -> controller   MAGIC (8 bytes) | u32 protocol version | JSON hello
                         {"workers": N, "nonce": hex, "host": ..., "pid": ...}
    controller -> node   JSON {"version": V, "nonce": hex}   or   {"error": ...}
    node -> controller   JSON {"proof": HMAC(token, "node" | nonce_node | nonce_ctrl)}
    controller -> node   JSON {"proof": HMAC(token, "controller" | ...), "node_id": k, ...}
                         or {"error": "authentication failed"}

**Reply connections** (without TLS): right after its welcome, the node
opens one more connection per worker to the same address, and the controller
holds the node back until every one of them has authenticated::

    node -> controller   DATA_MAGIC | u32 protocol version | JSON
                         {"node_id": k, "worker": global id, "nonce": hex}
    controller -> node   JSON {"nonce": hex}   or   {"error": ...}
    node -> controller   JSON {"proof": HMAC(key, "data-node/<id>" | nonces)}
    controller -> node   JSON {"proof": HMAC(key, "data-controller/<id>" | nonces)}

``key`` = :func:`data_key` of the token and the node's handshake nonces, so a reply
connection is bound to its node's authenticated session. The node then hands the
socket to the worker as its ``--reply-fd``: the worker's reply frames (exactly as
:mod:`disco_core.protocol` writes them) go straight to the controller, without
the agent in between. With TLS there are no reply connections: replies are
relayed over the node's TLS connection.

Every JSON message is ``u32 length | UTF-8 JSON object`` of at most
:data:`MAX_HANDSHAKE_BYTES`. Both sides prove they know the shared token; the token
itself never travels. A peer that fails any step is dropped.

**Relay** (after both sides are authenticated). Every message starts with
``u32 kind | u32 arg`` (little endian):

``FRAME`` (controller -> node)
    ``arg`` = number of target workers (:data:`ALL` for every worker of the node),
    then that many ``u32`` local worker indices, then one frame exactly as
    :mod:`disco_core.protocol` writes it to a worker's pipe
    (``u64 header_len | u32 num_buffers | u32 flags | u64 lens... | header | buffers``).
``FRAME`` (node -> controller)
    ``arg`` = the global id of the replying worker, then one frame (only when the
    node has no reply connections, i.e. with TLS or ``direct_replies=False``).
``DIED`` (node -> controller)
    ``arg`` = the global id of a worker that died, then ``u32 length | UTF-8 JSON``
    ``{"reason": ..., "stderr": last bytes the worker wrote to its stderr}``.
``STAT`` / ``FILE`` (controller -> node), ``STAT`` (node -> controller)
    Module-file shipping for ``load_vm_module``: ``arg`` = request id, then a JSON
    message (``FILE`` is followed by the file's bytes).
``BYE`` (controller -> node)
    The session is shutting down.
``PING`` (both ways)
    A heartbeat, ``arg`` = 0, sent every :func:`heartbeat_interval` seconds by a
    :class:`Heartbeat` thread unless other bytes are being sent at that moment. A
    side that receives no bytes at all for the heartbeat timeout declares the peer
    dead (see :class:`Heartbeat`).

Frames are relayed as bytes: the agent never unpickles them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PROTOCOL_VERSION",
    "MAGIC",
    "HandshakeError",
    "StreamReader",
    "send_views",
    "send_json",
    "recv_json",
    "proof",
    "new_nonce",
    "data_key",
    "alloc",
    "resolve_token",
    "Heartbeat",
    "heartbeat_timeout",
    "idle_seconds",
]

#: 3: heartbeats (``PING``) and JSON death reports.
PROTOCOL_VERSION = 3
MAGIC = b"DISCOSOK"
#: First bytes of a reply connection (one per worker, after the node's handshake).
DATA_MAGIC = b"DISCODAT"
HELLO = struct.Struct("<8sI")
MAX_HANDSHAKE_BYTES = 64 * 1024

MSG = struct.Struct("<II")
U32 = struct.Struct("<I")
#: Same layout as ``disco_core.protocol``'s frame prefix (checked by the tests).
FRAME_PREFIX = struct.Struct("<QII")
MAX_FRAME_BYTES = 1 << 40

K_FRAME, K_DIED, K_STAT, K_FILE, K_BYE, K_PING = 1, 2, 3, 4, 5, 6
ALL = 0xFFFFFFFF
PING = MSG.pack(K_PING, 0)

#: Seconds of silence after which a peer is declared dead (``DISCO_HEARTBEAT_TIMEOUT``).
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
#: ``TCP_USER_TIMEOUT`` when heartbeats are off (unacknowledged data for this long).
_USER_TIMEOUT_OFF = 15.0

_IOV_MAX = 512


class HandshakeError(ConnectionError):
    """The peer failed the handshake (wrong version, wrong token, malformed message)."""


def resolve_token(token: str | bytes | None) -> bytes:
    """The shared token: ``token`` itself, else ``$DISCO_TOKEN``, else empty (no secret)."""
    if token is None:
        token = os.environ.get("DISCO_TOKEN", "")
    return token.encode() if isinstance(token, str) else bytes(token)


def new_nonce() -> str:
    return os.urandom(32).hex()


def proof(token: bytes, role: str, nonce_node: str, nonce_ctrl: str) -> str:
    """HMAC-SHA256 proof that the ``role`` side knows ``token`` (bound to both nonces)."""
    msg = f"disco-socket/{PROTOCOL_VERSION}/{role}\0{nonce_node}\0{nonce_ctrl}".encode()
    return hmac.new(token, msg, hashlib.sha256).hexdigest()


def data_key(token: bytes, nonce_node: str, nonce_ctrl: str) -> bytes:
    """The key a node's reply connections authenticate with (bound to its handshake)."""
    msg = f"disco-socket/{PROTOCOL_VERSION}/data-key\0{nonce_node}\0{nonce_ctrl}".encode()
    return hmac.new(token, msg, hashlib.sha256).digest()


def check_proof(expected: str, got: Any) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())


# --------------------------------------------------------------------------- handshake I/O
def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise HandshakeError("the peer closed the connection during the handshake")
        got += k
    return bytes(buf)


def send_json(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(U32.pack(len(data)) + data)


def recv_json(sock: socket.socket) -> dict:
    (n,) = U32.unpack(recv_exact(sock, 4))
    if n > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(f"handshake message too large ({n} bytes)")
    try:
        obj = json.loads(recv_exact(sock, n).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"malformed handshake message: {exc}") from None
    if not isinstance(obj, dict):
        raise HandshakeError("malformed handshake message: not a JSON object")
    return obj


# --------------------------------------------------------------------------- relay I/O
class StreamReader:
    """Buffered reads from a (possibly TLS) socket; large payloads go straight to their memory.

    Small fields (message heads, pickle headers) are parsed out of a 64 KiB buffer
    (several messages may arrive in one ``recv``); an out-of-band buffer is received
    with ``recv_into`` directly into its final ``bytearray``.
    """

    _CHUNK = 1 << 16

    def __init__(self, sock: socket.socket) -> None:
        self.recv_into = sock.recv_into
        self.buf = bytearray(self._CHUNK)
        self.start = 0
        self.end = 0

    def has_buffered(self) -> bool:
        return self.start < self.end

    def _fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if self.start:
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
        if need > len(self.buf):
            self.buf.extend(bytes(need - len(self.buf)))
        view = memoryview(self.buf)
        try:
            while self.end < need:
                k = self.recv_into(view[self.end :])
                if not k:
                    raise EOFError("connection closed")
                self.end += k
        finally:
            view.release()

    def take(self, n: int) -> bytes:
        self._fill(n)
        data = bytes(self.buf[self.start : self.start + n])
        self.start += n
        return data

    def read_into(self, out: memoryview) -> None:
        n = len(out)
        have = min(n, self.end - self.start)
        if have:
            out[:have] = self.buf[self.start : self.start + have]
            self.start += have
        while have < n:
            k = self.recv_into(out[have:])
            if not k:
                raise EOFError("connection closed in the middle of a message")
            have += k

    def read_msg(self) -> tuple[int, int]:
        return MSG.unpack(self.take(MSG.size))

    def read_frame(self) -> tuple[bytes, list[Any], int]:
        """One frame: ``(header, buffers, flags)``; buffers are fresh memory (:func:`alloc`)."""
        hlen, nbuf, flags = FRAME_PREFIX.unpack(self.take(FRAME_PREFIX.size))
        lens = struct.unpack(f"<{nbuf}Q", self.take(8 * nbuf)) if nbuf else ()
        if hlen > MAX_FRAME_BYTES or sum(lens) > MAX_FRAME_BYTES or nbuf > 1 << 20:
            raise EOFError(f"corrupt frame: declared size {hlen + sum(lens)} bytes")
        header = self.take(hlen)
        buffers = []
        for n in lens:
            b = alloc(n)
            if n:
                with memoryview(b) as view:
                    self.read_into(view)
            buffers.append(b)
        return header, buffers, flags

    def read_blob(self, limit: int = MAX_HANDSHAKE_BYTES) -> bytes:
        (n,) = U32.unpack(self.take(4))
        if n > limit:
            raise EOFError(f"message too large ({n} bytes)")
        return self.take(n)


def alloc(n: int) -> Any:
    """Writable memory for an ``n``-byte out-of-band buffer, left uninitialised.

    ``bytearray(n)`` zero-fills with 4 KiB pages (about 30 ms for 64 MiB here,
    longer than the transfer itself); numpy's allocator skips the fill and asks
    for transparent huge pages, so the pages are faulted in cheaply by the
    ``recv_into`` that fills them. Unpickled arrays use this memory as is.
    """
    return np.empty(n, np.uint8)


def frame_head(header: bytes, buffers: Sequence[Any], flags: int) -> bytes:
    lens = b"".join(struct.pack("<Q", memoryview(b).nbytes) for b in buffers)
    return FRAME_PREFIX.pack(len(header), len(buffers), flags) + lens + header


def blob(data: bytes) -> bytes:
    return U32.pack(len(data)) + data


def send_views(sock: socket.socket, parts: Sequence[Any]) -> None:
    """Send every buffer of ``parts`` in order, without copying (``sendmsg``; TLS: ``sendall``)."""
    views = []
    for p in parts:
        m = p if isinstance(p, bytes) else memoryview(p).cast("B")
        if len(m):
            views.append(m)
    if isinstance(sock, ssl.SSLSocket):
        for m in views:
            sock.sendall(m)
        return
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i : i + _IOV_MAX])
        while n and i < len(views):
            m = views[i]
            if n >= len(m):
                n -= len(m)
                i += 1
            else:
                views[i] = memoryview(m)[n:]
                n = 0


def tune_socket(sock: socket.socket, timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> None:
    """No Nagle delay; keepalive probes; ``TCP_USER_TIMEOUT`` at twice the heartbeat ``timeout``.

    ``TCP_USER_TIMEOUT`` (data unacknowledged that long: the peer is gone) also
    bounds keepalive on Linux, overriding ``TCP_KEEPCNT``. It is only the backstop
    of the :class:`Heartbeat`, which gives up on a silent peer first, with a
    clearer reason; without heartbeats it is 15 s.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass
    opt = getattr(socket, "TCP_USER_TIMEOUT", None)
    if opt is not None:
        try:
            ms = int(1000 * (2 * timeout if timeout > 0 else _USER_TIMEOUT_OFF))
            sock.setsockopt(socket.IPPROTO_TCP, opt, max(ms, 1000))
        except OSError:
            pass


# --------------------------------------------------------------------------- heartbeat
def heartbeat_timeout(value: float | None = None) -> float:
    """The heartbeat timeout in seconds: ``value``, else ``$DISCO_HEARTBEAT_TIMEOUT``, else 5.

    0 turns heartbeats off (a frozen peer is then never noticed; a vanished one
    only through TCP keepalive).
    """
    if value is None:
        value = float(os.environ.get("DISCO_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT))
    value = float(value)
    if value < 0 or value != value:
        raise ValueError(f"heartbeat timeout must be >= 0 seconds, got {value}")
    return value


def heartbeat_interval(timeout: float) -> float:
    """Seconds between pings: several per timeout, at most one a second."""
    return max(0.05, min(1.0, timeout / 5))


_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
#: ``struct tcp_info``: 8 bytes of u8 fields, then u32 fields; ``tcpi_last_data_recv`` is the 12th.
_LAST_DATA_RECV = struct.Struct("<I")
_LAST_DATA_RECV_OFFSET = 8 + 11 * 4


def idle_seconds(sock: socket.socket) -> float | None:
    """Seconds since the kernel last received data on ``sock``; None where it cannot tell.

    The kernel keeps this count itself (``TCP_INFO``), so watching it costs the
    data path nothing, and a large transfer in progress counts as life even while
    no whole message has arrived.
    """
    if _TCP_INFO is None:
        return None
    info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 104)
    if len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return None
    return _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0] / 1000.0


class Heartbeat:
    """Keeps one connection's liveness, both ways, from a thread of its own.

    Every :func:`heartbeat_interval` seconds it sends a ``PING`` (unless another
    thread is sending, which the peer hears just as well) and looks at how long
    ago data last arrived (:func:`idle_seconds`); past ``timeout`` it calls
    ``on_silence(idle)`` once and ends. The relay paths never touch it: a command
    or reply costs no extra work. It never blocks on the connection: the send lock
    is only tried, and a ping is only written when the socket has room for it.

    Parameters
    ----------
    sock : socket.socket
        The connection (plain or TLS).
    lock : threading.Lock
        The lock every writer of ``sock`` holds while it writes.
    timeout : float
        Seconds without incoming data after which the peer is dead (> 0).
    on_silence : callable
        ``on_silence(idle_seconds)``, called from the heartbeat thread.
    name : str
        The thread's name.
    """

    def __init__(
        self,
        sock: socket.socket,
        lock: threading.Lock,
        timeout: float,
        on_silence: Callable[[float], None],
        name: str,
    ) -> None:
        self.sock = sock
        self.lock = lock
        self.timeout = timeout
        self.interval = heartbeat_interval(timeout)
        self.on_silence = on_silence
        self._stop = threading.Event()
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLOUT)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def stop(self) -> None:
        """No more pings or checks (a ping already being written finishes first)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                idle = idle_seconds(self.sock)
            except OSError:
                return  # closed: the reader has seen it
            if idle is not None and idle > self.timeout:
                if not self._stop.is_set():
                    self.on_silence(idle)
                return
            self._ping()

    def _ping(self) -> None:
        if not self.lock.acquire(blocking=False):
            return  # someone is sending: those bytes are the heartbeat
        try:
            # Checked under the lock: after stop() (e.g. before BYE) nothing more is sent.
            if not self._stop.is_set() and self._poll.poll(0):
                self.sock.sendall(PING)
        except OSError:
            pass  # a broken connection: the reader reports it
        finally:
            self.lock.release()
