"""The handshake: magic, key matching, and HMAC-SHA256 challenge-response.

Before a peer has authenticated, the server reads only fixed-size fields and a
bounded key string; nothing is decoded beyond that.

::

    client -> server   b"DISCORPC" | u32 version | u32 key_len | key | 32-byte client nonce
    server -> client   b"DISCORPC" | u32 version | u8 status | u8 auth_required | 32-byte server nonce
    (auth_required)
    client -> server   HMAC(token, b"disco-rpc client" | server nonce | client nonce | key)
    server -> client   u8 status | HMAC(token, b"disco-rpc server" | client nonce | server nonce)

Both sides prove they know the token; the token itself never crosses the wire.
A proxy that cannot pair a client answers with the server reply and a status
saying why (no server for the key, servers busy, a tracker ticket required).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from .errors import RPCAuthError

MAGIC = b"DISCORPC"
VERSION = 1
MAX_KEY_BYTES = 4096
OK, KEY_MISMATCH, BAD_VERSION, AUTH_FAILED = 0, 1, 2, 3
# statuses a proxy answers with when it cannot pair a client with a server
NO_SERVER, SERVERS_BUSY, TICKET_REQUIRED = 4, 5, 6
TOKEN_ENV = "DISCO_TOKEN"

_HELLO = struct.Struct("<8sII")
_REPLY = struct.Struct("<8sIBB32s")
_STATUS = struct.Struct("<B32s")


def resolve_token(token: str | bytes | None) -> bytes | None:
    """``token``, else ``$DISCO_TOKEN``; ``None`` when neither is set (or both empty)."""
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    if isinstance(token, str):
        token = token.encode("utf-8")
    return bytes(token) or None


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def client_handshake(conn, key: str, token: bytes | None) -> None:
    """Run the client side over a :class:`~disco_rpc.wire.Conn`; raise on refusal."""
    kb = key.encode("utf-8")
    if len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"key is longer than {MAX_KEY_BYTES} bytes")
    cnonce = os.urandom(32)
    hello = _HELLO.pack(MAGIC, VERSION, len(kb)) + kb + cnonce
    conn.t.send_parts([hello])
    try:
        reply = bytes(conn.read_exact(_REPLY.size))
    except EOFError:
        raise RPCAuthError(
            "the peer closed the connection during the handshake (not a disco-rpc server, "
            "or it refused this client)"
        ) from None
    if reply == hello[: _REPLY.size]:
        # a real server's reply carries its own random nonce: this is our hello echoed
        raise RPCAuthError("the peer echoed the handshake back: it is not a disco-rpc server")
    magic, version, status, auth_required, snonce = _REPLY.unpack(reply)
    if magic != MAGIC:
        raise RPCAuthError("the peer is not a disco-rpc server (bad magic)")
    _check_status(status, version, key)
    if not auth_required:
        return
    mac = _mac(token, b"disco-rpc client", snonce, cnonce, kb) if token else bytes(32)
    conn.t.send_parts([mac])
    try:
        status, smac = _STATUS.unpack(conn.read_exact(_STATUS.size))
    except EOFError:
        status, smac = AUTH_FAILED, b""
    if status != OK:
        hint = (
            "the server requires a token: pass token=... or set DISCO_TOKEN"
            if not token
            else "wrong token"
        )
        raise RPCAuthError(f"authentication failed: {hint}")
    if not hmac.compare_digest(smac, _mac(token, b"disco-rpc server", cnonce, snonce)):
        raise RPCAuthError("the server failed to prove it knows the token")


def _check_status(status: int, version: int, key: str) -> None:
    if status == OK:
        return
    if status == BAD_VERSION:
        raise RPCAuthError(f"the server speaks protocol version {version}, this client {VERSION}")
    base = key.rpartition("@")[0] or key
    messages = {
        KEY_MISMATCH: f"key mismatch: the server does not accept the key {key!r}",
        NO_SERVER: f"the proxy has no server registered for key {base!r}",
        SERVERS_BUSY: f"every server for key {base!r} behind the proxy stayed busy",
        TICKET_REQUIRED: (
            f"the servers for key {base!r} behind the proxy are managed by a tracker: "
            "a ticket from the tracker is required (use connect_tracker(...).request(key))"
        ),
    }
    raise RPCAuthError(messages.get(status, f"the server refused the connection (status {status})"))


def refusal(status: int) -> bytes:
    """A server reply carrying only a refusal ``status`` (what a proxy answers)."""
    return _REPLY.pack(MAGIC, VERSION, status, 0, bytes(32))


def read_hello(conn) -> tuple[int, bytes, bytes] | None:
    """Read a client's hello: ``(version, key bytes, client nonce)``, or None if it is not one."""
    magic, version, keylen = _HELLO.unpack(conn.read_exact(_HELLO.size))
    if magic != MAGIC or keylen > MAX_KEY_BYTES:
        return None
    kb = bytes(conn.read_exact(keylen))
    cnonce = bytes(conn.read_exact(32))
    return version, kb, cnonce


def pack_hello(version: int, kb: bytes, cnonce: bytes) -> bytes:
    """The bytes of a hello (a proxy forwards the client's own hello to the server)."""
    return _HELLO.pack(MAGIC, version, len(kb)) + kb + cnonce


class ServerHandshake:
    """The server side of the handshake as a state machine that never blocks.

    Feed it exactly :attr:`want` bytes at a time with :meth:`step`, send what it
    returns; when :attr:`want` is 0 it is over and :attr:`ok` says whether the
    client may proceed. Only fixed-size fields and a key of at most
    :data:`MAX_KEY_BYTES` are ever read. ``key_check(key_bytes)``, when given,
    decides instead of comparing with ``key``.
    """

    def __init__(self, key: str, token: bytes | None, key_check=None) -> None:
        self.key = key.encode("utf-8")
        self.token = token
        self.key_check = key_check
        self.want = _HELLO.size
        self.ok = False
        self.peer_key = ""
        self._stage = self._hello
        self._version = self._keylen = 0
        self._kb = self._cnonce = self._snonce = b""

    def step(self, data: bytes) -> bytes:
        """Consume ``want`` bytes; return the bytes to send back (maybe none)."""
        if len(data) != self.want:
            raise ValueError(f"step() needs exactly {self.want} bytes")
        return self._stage(bytes(data))

    def _done(self, ok: bool, out: bytes = b"") -> bytes:
        self.want = 0
        self.ok = ok
        return out

    def _hello(self, data: bytes) -> bytes:
        magic, self._version, self._keylen = _HELLO.unpack(data)
        if magic != MAGIC or self._keylen > MAX_KEY_BYTES:
            return self._done(False)  # not a client: no answer
        self.want = self._keylen + 32
        self._stage = self._key
        return b""

    def _key(self, data: bytes) -> bytes:
        kb, self._cnonce = data[: self._keylen], data[self._keylen :]
        self._kb = kb
        self.peer_key = kb.decode("utf-8", "replace")
        status = OK
        if self._version != VERSION:
            status = BAD_VERSION
        elif self.key_check is not None:
            status = OK if self.key_check(kb) else KEY_MISMATCH
        elif self.key and kb != self.key:
            status = KEY_MISMATCH
        self._snonce = os.urandom(32)
        reply = _REPLY.pack(MAGIC, VERSION, status, 1 if self.token else 0, self._snonce)
        if status != OK or not self.token:
            return self._done(status == OK, reply)
        self.want = 32
        self._stage = self._mac
        return reply

    def _mac(self, data: bytes) -> bytes:
        token = self.token
        expected = _mac(token, b"disco-rpc client", self._snonce, self._cnonce, self._kb)
        if not hmac.compare_digest(data, expected):
            return self._done(False, _STATUS.pack(AUTH_FAILED, bytes(32)))
        proof = _mac(token, b"disco-rpc server", self._cnonce, self._snonce)
        return self._done(True, _STATUS.pack(OK, proof))


def server_handshake(conn, key: str, token: bytes | None, key_check=None, hello=None) -> bool:
    """Run the server side over a blocking connection; return True when the client may proceed.

    A peer that is not a client, sends the wrong key or fails authentication gets
    a status code and ``False``. The key the client presented is left in
    ``conn.peer_key`` (str). ``hello`` is the result of :func:`read_hello` when the
    caller has read it already.
    """
    hs = ServerHandshake(key, token, key_check)
    pending = pack_hello(*hello) if hello is not None else b""
    while hs.want:
        if pending:
            data, pending = pending[: hs.want], pending[hs.want :]
        else:
            data = conn.read_exact(hs.want)
        out = hs.step(data)
        if out:
            conn.t.send_parts([out])
    conn.peer_key = hs.peer_key
    return hs.ok
