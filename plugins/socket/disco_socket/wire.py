"""The wire protocol between a controller and its node agents.

A connection has two phases: a handshake of fixed binary and JSON messages
(nothing is unpickled, each message at most :data:`MAX_HANDSHAKE_BYTES`), then
the relay. The cryptography is the core's one policy,
:mod:`disco_core.net.security` (proofs, keys) and :mod:`disco_core.net.protect`
(sealed records); this module holds only disco-socket's own messages.

**Handshake** (every JSON message is ``u32 length | UTF-8 JSON object``)::

    node -> controller   MAGIC (8 bytes) | u32 protocol version | JSON hello
                         {"workers": N, "nonce": hex, "auth": bool, "host": ..., "pid": ...}
    controller -> node   JSON challenge {"version": V, "nonce": hex, "auth": bool}
                         or {"error": ...}

``auth`` says whether that side holds a token. A side with a token refuses a peer
whose ``auth`` is false (it cannot prove anything), and a side without one
refuses a peer that asks for one. With a token, :class:`~disco_core.net.security.Handshake`
(label :data:`LABEL`) is bound to the hello and the challenge exactly as sent
(both nonces, both ``auth`` flags, the version and everything else in them)::

    node -> controller   JSON {"proof": hex}    the node proves first
    controller -> node   JSON {"proof": hex}    only once the node's proof checked out
                         or {"error": "authentication failed ..."}

From here on, with a token, every byte either side sends is a sealed record
(:class:`~disco_core.net.protect.SealedTransport`, keys from the handshake): a
relay can neither inject, alter, reorder nor replay anything. Then::

    controller -> node   JSON welcome {"node_id": k, "worker_ids": [...], ...} or {"error": ...}

**Reply connections** (without TLS): right after its welcome, the node opens one
more connection per worker to the same address, and the controller holds the
node back until every one of them has authenticated::

    node -> controller   DATA_MAGIC | u32 protocol version | JSON
                         {"node_id": k, "worker": global id, "nonce": hex, "auth": bool}
    controller -> node   JSON {"nonce": hex, "auth": bool}   or   {"error": ...}

and, with a token, the same two proofs under :func:`reply_secret` (derived from the
token and the node's own handshake transcript, so a reply connection is bound to
its node's authenticated session). The node then hands the socket to the worker
as its ``--reply-fd`` (and, with a token, the sending key through
``--reply-key-fd``): the worker's reply frames go straight to the controller,
without the agent in between, one sealed record per frame. With TLS there are no
reply connections: replies are relayed over the node's connection.

**Relay** (after the handshake). Every message starts with ``u32 kind | u32 arg``
(little endian):

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

Each sender puts whole messages in a record, and a receiver acts on a message
only once the record it ended in has verified (:meth:`StreamReader.settle`).
Frames are relayed as bytes: the agent never decodes them. They are in the core's
tagged network format both ways (never pickles): the workers (``--untrusted``) and
the controller rebuild them with :func:`disco_core.spi.decode_untrusted`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import select
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from disco_core import DiscoTypeError, DiscoValueError, IntegrityError, NetworkError
from disco_core.spi import (
    FRAME_PREFIX,
    SEND_RECORD_BYTES,
    SealedTransport,
    SessionKeys,
    SocketTransport,
    SSLTransport,
    env_seconds,
    read_frame_head,
    stretch_token,
)
from disco_core.spi import frame_head as _frame_head
from disco_core.spi import recv_exact as _recv_exact

__all__ = [
    "PROTOCOL_VERSION",
    "LABEL",
    "MAGIC",
    "DATA_MAGIC",
    "HandshakeError",
    "StreamReader",
    "transport",
    "seal",
    "send_json",
    "json_message",
    "recv_json",
    "recv_json_raw",
    "parse_json",
    "recv_exact",
    "nonce_hex",
    "parse_proof",
    "reply_secret",
    "frame_head",
    "FRAME_PREFIX",
    "alloc",
    "Heartbeat",
    "heartbeat_timeout",
    "idle_seconds",
]

#: The protocol's version. Version 3 added heartbeats (``PING``) and JSON death
#: reports, 4 the core's handshake (transcript-bound proofs, ``auth`` flags)
#: and sealed records with a token, 5 the fence command (a ``SYNC_WORKER`` with
#: a token, which a node of version 4 would answer without it: the controller's
#: waits would then drop every answer), and 6 sealed records of at most
#: ``MAX_RECORD_BYTES`` (a frame's head in a record of its own), 7 proofs and keys
#: from scrypt of the token (``disco-net/2``; a node of version 6 failed as "wrong token").
PROTOCOL_VERSION = 7
#: The label of this protocol's handshakes (proofs and keys of other protocols never fit).
LABEL = b"disco-socket/4"
MAGIC = b"DISCOSOK"
#: First bytes of a reply connection (one per worker, after the node's handshake).
DATA_MAGIC = b"DISCODAT"
HELLO = struct.Struct("<8sI")
MAX_HANDSHAKE_BYTES = 64 * 1024

MSG = struct.Struct("<II")
U32 = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 40
#: The largest sealed record a side accepts, and sends: a larger message leaves as
#: several records (the core's ``max_send``). A receiver reads at most this many
#: bytes before their tag is checked, and sizes no memory from them (see
#: :meth:`StreamReader.read_frame`), whatever an attacker on the path declares.
MAX_RECORD_BYTES = SEND_RECORD_BYTES

K_FRAME, K_DIED, K_STAT, K_FILE, K_BYE, K_PING = 1, 2, 3, 4, 5, 6
ALL = 0xFFFFFFFF
PING = MSG.pack(K_PING, 0)

#: Seconds :meth:`StreamReader.blame` waits for the rest of a record it reads on.
BLAME_WAIT = 2.0
#: Seconds of silence after which a peer is declared dead (``DISCO_HEARTBEAT_TIMEOUT``).
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
#: ``TCP_USER_TIMEOUT`` when heartbeats are off (unacknowledged data for this long).
_USER_TIMEOUT_OFF = 15.0


class HandshakeError(NetworkError):
    """The peer failed the handshake (wrong version, wrong or missing token, malformed message)."""


# --------------------------------------------------------------------------- handshake
def nonce_hex(value: Any, what: str) -> str:
    """``value`` if it is a well-formed nonce (64 hex digits), else :class:`HandshakeError`."""
    if not isinstance(value, str) or len(value) != 64:
        raise HandshakeError(f"malformed {what} (nonce)")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise HandshakeError(f"malformed {what} (nonce)") from None
    return value


def parse_proof(msg: dict) -> bytes | None:
    """The proof in a JSON message (bytes), or None when it is missing or malformed."""
    value = msg.get("proof")
    if not isinstance(value, str) or len(value) != 64:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def reply_secret(token: bytes, transcript: bytes) -> bytes:
    """The secret a node's reply connections authenticate with.

    Derived from the token and the transcript of the node's own handshake
    (:attr:`disco_core.net.security.Handshake.transcript`), so a reply connection
    only ever joins the session of the node that opened it.
    """
    msg = LABEL + b" reply connections\0" + transcript
    # keyed with the stretched token: the raw one made each node's reply handshake an
    # offline check of token guesses (see disco_core.net.security.stretch_token)
    return hmac.new(stretch_token(token), msg, hashlib.sha256).digest()


def transport(sock: socket.socket) -> SocketTransport:
    """The core transport of a connected socket (TLS or plain)."""
    if isinstance(sock, ssl.SSLSocket):
        return SSLTransport(sock)
    return SocketTransport(sock)


class _Sealed(SealedTransport):
    """A :class:`~disco_core.net.protect.SealedTransport` that says where its records end."""

    @property
    def at_boundary(self) -> bool:
        """True when every byte received so far belongs to a record whose tag verified."""
        return not self.record_left


def seal(tx: Any, keys: SessionKeys) -> SealedTransport:
    """``tx`` with every record sealed under ``keys`` (after a token handshake)."""
    return _Sealed(tx, keys, max_record=MAX_RECORD_BYTES, max_send=MAX_RECORD_BYTES)


def recv_exact(tx: Any, n: int) -> bytes:
    """Exactly ``n`` bytes from ``tx`` (a socket or a transport) during the handshake.

    The core's :func:`~disco_core.spi.recv_exact`; a peer that closes first is a
    :class:`HandshakeError`.
    """
    try:
        return bytes(_recv_exact(tx.recv_into, n, "the handshake"))
    except EOFError:
        raise HandshakeError("the peer closed the connection during the handshake") from None


def frame_head(header: Any, buffers: Any, flags: int = 0) -> bytes:
    """The bytes of a frame before its buffers (the core's :func:`~disco_core.spi.frame_head`)."""
    return _frame_head((header, buffers), flags)


def json_message(obj: dict) -> bytes:
    """The bytes of one handshake message: ``u32 length | compact UTF-8 JSON``."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return U32.pack(len(data)) + data


def send_json(tx: Any, obj: dict) -> bytes:
    """Send one JSON message (to a socket or a transport); return its bytes exactly as sent."""
    msg = json_message(obj)
    if hasattr(tx, "send_parts"):
        tx.send_parts([msg])
    else:
        tx.sendall(msg)
    return msg


def recv_json_raw(tx: Any) -> tuple[dict, bytes]:
    """One JSON message and its bytes exactly as received (for a handshake transcript).

    Raises
    ------
    HandshakeError
        The message is larger than :data:`MAX_HANDSHAKE_BYTES`, not UTF-8, not
        JSON, nested too deeply, or not a JSON object.
    """
    head = recv_exact(tx, 4)
    (n,) = U32.unpack(head)
    if n > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(
            f"handshake message too large ({n} bytes, at most {MAX_HANDSHAKE_BYTES})"
        )
    data = recv_exact(tx, n)
    return parse_json(data), head + data


def parse_json(data: bytes) -> dict:
    """The JSON object of one handshake message's body.

    Raises
    ------
    HandshakeError
        ``data`` is not UTF-8, not JSON, nested too deeply, or not a JSON object.
    """
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"malformed handshake message: {exc}") from None
    except RecursionError:
        raise HandshakeError("malformed handshake message: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise HandshakeError("malformed handshake message: not a JSON object")
    return obj


def recv_json(tx: Any) -> dict:
    """One JSON message (see :func:`recv_json_raw`)."""
    return recv_json_raw(tx)[0]


# --------------------------------------------------------------------------- relay I/O
class StreamReader:
    """Buffered reads from a transport; large payloads go straight to their memory.

    Small fields (message heads, frame headers) are parsed out of a 64 KiB buffer
    (several messages may arrive in one read); an out-of-band buffer is received
    with ``recv_into`` directly into its final memory. Over a sealed transport,
    call :meth:`settle` after a message is read and before acting on it.

    Parameters
    ----------
    tx : transport or socket
        Anything with ``recv_into``; a sealed one also has ``at_boundary``.
    """

    _CHUNK = 1 << 16

    def __init__(self, tx: Any) -> None:
        self.tx = tx
        self.recv_into = tx.recv_into
        self.sealed = hasattr(tx, "at_boundary")
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
        while self.end < need:
            if self.end == len(self.buf):
                # grow with what arrives, not with what a length declares: a declared
                # length may not have been verified yet (a sealed record's tag comes last)
                self.buf.extend(bytes(min(need - self.end, max(len(self.buf), self._CHUNK))))
            with memoryview(self.buf) as view:
                k = self.recv_into(view[self.end :])
            if not k:
                raise EOFError("connection closed")
            self.end += k

    def settle(self) -> None:
        """Read on to the end of the current sealed record, so what was read is verified.

        A record may hold several messages (a batch); the bytes of one that ends
        before its record does arrive before the record's tag. They are acted on
        only after this returns; the rest of the record waits in the buffer.
        Raises :class:`~disco_core.errors.IntegrityError` for a forged record. Does
        nothing on an unsealed link.
        """
        if not self.sealed:
            return
        tx = self.tx
        while not tx.at_boundary:
            if self.end == len(self.buf):
                if self.start:
                    n = self.end - self.start
                    self.buf[:n] = self.buf[self.start : self.end]
                    self.start, self.end = 0, n
                else:
                    self.buf.extend(bytes(self._CHUNK))
            with memoryview(self.buf) as view:
                k = self.recv_into(view[self.end :])
            if not k:
                raise EOFError("connection closed")
            self.end += k

    def blame(self, exc: Exception) -> Exception:
        """What to report for ``exc``, raised while this reader's bytes were acted on.

        Over a sealed transport, bytes of a large record are parsed before its tag
        comes: when ``exc`` (a malformed message, an unknown kind, a declared size
        over a limit) came from such bytes, the rest of the record is read, and a
        forged record is reported as the :class:`~disco_core.errors.IntegrityError`
        it is, not as a protocol error of the peer's. Otherwise ``exc`` itself (a
        link that broke meanwhile ends the read at once, and a peer that stopped
        sending, frozen or not, after :data:`BLAME_WAIT` seconds: the link is
        being given up anyway).
        """
        if not self.sealed or isinstance(exc, IntegrityError) or self.tx.at_boundary:
            return exc
        sock = getattr(self.tx, "sock", None)
        try:
            if sock is not None:
                sock.settimeout(BLAME_WAIT)
            self.settle()
        except IntegrityError as forged:
            return forged
        except Exception:  # noqa: BLE001 - the link broke meanwhile: the first error stands
            pass
        return exc

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
        """One frame: ``(header, buffers, flags)``; buffers are fresh memory (:func:`alloc`).

        Every declared count and length is checked before anything is allocated
        for it (:func:`disco_core.spi.read_frame_head`;
        :class:`~disco_core.errors.FrameLimitError` past a limit). Over a sealed
        transport, buffers are sized from verified bytes only: when the head's
        record goes on past the header (a sender of this version puts a large
        frame's head in a record of its own, so only a batch of small frames or a
        forgery does), the rest of that record is read and checked first.
        """
        hlen, lens, flags = read_frame_head(self.take, max_frame=MAX_FRAME_BYTES)
        header = self.take(hlen)
        if self.sealed and any(lens) and not self.tx.at_boundary:
            self.settle()
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
    ``recv_into`` that fills them. Decoded arrays use this memory as is.
    """
    return np.empty(n, np.uint8)


def blob(data: bytes) -> bytes:
    return U32.pack(len(data)) + data


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
        return env_seconds("DISCO_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT)
    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise DiscoTypeError(
            f"heartbeat_timeout must be a number of seconds, got {value!r}"
        ) from None
    if seconds < 0 or seconds != seconds:
        raise DiscoValueError(f"heartbeat_timeout must be >= 0 seconds, got {value!r}")
    return seconds


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
        The connection (plain or TLS): its kernel state is watched.
    lock : threading.Lock or threading.RLock
        The lock every writer of ``sock`` holds while it writes.
    send : callable, optional
        ``send(parts)`` writes a ping (the link's transport's ``send_parts``, so a
        ping is a sealed record like any other); default ``sock.sendall``.
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
        lock: threading.Lock | threading.RLock,
        timeout: float,
        on_silence: Callable[[float], None],
        name: str,
        send: Callable[[list], None] | None = None,
    ) -> None:
        self.sock = sock
        self.send = send if send is not None else (lambda parts: sock.sendall(b"".join(parts)))
        self.lock = lock
        self.timeout = timeout
        self.interval = heartbeat_interval(timeout)
        self.on_silence = on_silence
        self._stop = threading.Event()
        #: the longest time this thread was late for a tick: this process was not running
        #: (stopped, suspended), so the peer's silence may be its own doing, not the peer's
        self.paused_for = 0.0
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
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            self.paused_for = max(self.paused_for, now - last - self.interval)
            last = now
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
                self.send([PING])
        except OSError:
            pass  # a broken connection: the reader reports it
        finally:
            self.lock.release()
