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
    conn.t.send_parts([_HELLO.pack(MAGIC, VERSION, len(kb)) + kb + cnonce])
    try:
        magic, version, status, auth_required, snonce = _REPLY.unpack(conn.read_exact(_REPLY.size))
    except EOFError:
        raise RPCAuthError(
            "the peer closed the connection during the handshake (not a disco-rpc server, "
            "or it refused this client)"
        ) from None
    if magic != MAGIC:
        raise RPCAuthError("the peer is not a disco-rpc server (bad magic)")
    if status == BAD_VERSION:
        raise RPCAuthError(f"the server speaks protocol version {version}, this client {VERSION}")
    if status == KEY_MISMATCH:
        raise RPCAuthError(f"key mismatch: the server does not accept the key {key!r}")
    if status != OK:
        raise RPCAuthError(f"the server refused the connection (status {status})")
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


def server_handshake(conn, key: str, token: bytes | None, key_check=None, hello=None) -> bool:
    """Run the server side; return True when the client may proceed.

    Reads only fixed-size fields; a peer that is not a client, sends the wrong key
    or fails authentication gets a status code and ``False``. ``key_check(key_bytes)``,
    when given, decides instead of comparing with ``key``. The key the client
    presented is left in ``conn.peer_key`` (str). ``hello`` is the result of
    :func:`read_hello` when the caller has read it already.
    """
    if hello is None:
        hello = read_hello(conn)
        if hello is None:
            return False
    version, kb, cnonce = hello
    snonce = os.urandom(32)
    status = OK
    if version != VERSION:
        status = BAD_VERSION
    elif key_check is not None:
        if not key_check(kb):
            status = KEY_MISMATCH
    elif key and kb != key.encode("utf-8"):
        status = KEY_MISMATCH
    conn.peer_key = kb.decode("utf-8", "replace")
    conn.t.send_parts([_REPLY.pack(MAGIC, VERSION, status, 1 if token else 0, snonce)])
    if status != OK:
        return False
    if not token:
        return True
    mac = bytes(conn.read_exact(32))
    if not hmac.compare_digest(mac, _mac(token, b"disco-rpc client", snonce, cnonce, kb)):
        conn.t.send_parts([_STATUS.pack(AUTH_FAILED, bytes(32))])
        return False
    conn.t.send_parts([_STATUS.pack(OK, _mac(token, b"disco-rpc server", cnonce, snonce))])
    return True
