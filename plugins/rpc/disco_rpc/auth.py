"""The handshake: magic, key matching, a mutual proof over the transcript, then sealed records.

Before a peer has authenticated, the server reads only fixed-size fields and a
bounded key string; nothing is decoded beyond that.

::

    client -> server   hello = b"DISCORPC" | u32 version | u32 key_len | key | 32-byte client nonce
    server -> client   reply = b"DISCORPC" | u32 version | u8 status | u8 auth_required | 32-byte server nonce
    (auth_required)
    client -> server   client proof (32 bytes)
    server -> client   u8 status | server proof (32 bytes), only once the client's proof checked out

The proofs are :class:`disco_core.net.security.Handshake`'s: an HMAC under the
token over the *transcript*, the hello and the reply exactly as they crossed
the wire, so each nonce, the key, the version, the status and the
``auth_required`` flag are all bound; the token itself never crosses the wire.
After a handshake with a token both sides seal every later byte with keys
derived from the token and the transcript
(:class:`~disco_rpc.wire.SealedLink`): a relay that passed the handshake
through (a proxy, a fake backend, anyone on the path) can neither inject,
alter, reorder nor replay a frame, and a record of one connection is worthless
on another.

A side that holds a token never goes on with a peer that has not proven it: a
client with a token refuses a server that answers "no authentication required".
A proxy that cannot pair a client answers with the reply and a status saying
why (no server for the key, servers busy, a tracker ticket required).
"""

from __future__ import annotations

import os
import random
import socket
import ssl
import struct
import time
from typing import Any

from disco_core import DiscoValueError
from disco_core.spi import (
    NONCE_BYTES,
    PROOF_BYTES,
    TOKEN_ENV,
    Handshake,
    SessionKeys,
    new_nonce,
    resolve_token,
    stretch_token,
)

from . import wire
from .errors import ProtocolError, RPCAuthError, RPCError
from .protocol import (
    AUTH_FAILED,
    BAD_VERSION,
    HELD,
    HELD_NOTICE_EVERY,
    KEY_MISMATCH,
    LABEL,
    LINK_KEYS,
    MAGIC,
    MAX_HELD_WAIT,
    MAX_KEY_BYTES,
    NO_SERVER,
    OK,
    SERVER_TAKEN,
    SERVERS_BUSY,
    TICKET_REQUIRED,
    VERSION,
)
from .wire import SealedLink

__all__ = [
    "MAGIC",
    "VERSION",
    "LABEL",
    "MAX_KEY_BYTES",
    "TOKEN_ENV",
    "OK",
    "KEY_MISMATCH",
    "BAD_VERSION",
    "AUTH_FAILED",
    "NO_SERVER",
    "SERVERS_BUSY",
    "TICKET_REQUIRED",
    "HELD",
    "SERVER_TAKEN",
    "held_notice",
    "refusal_text",
    "resolve_token",
    "TRACKER_TOKEN_ENV",
    "tracker_token_or",
    "stretch_now",
    "client_handshake",
    "server_handshake",
    "ServerHandshake",
    "seal",
    "refusal",
    "read_hello",
    "pack_hello",
    "open_conn",
]


_HELLO = struct.Struct("<8sII")
_REPLY = struct.Struct(f"<8sIBB{NONCE_BYTES}s")
_STATUS = struct.Struct(f"<B{PROOF_BYTES}s")
_HELD_NOTICE = _REPLY.pack(MAGIC, VERSION, HELD, 0, bytes(NONCE_BYTES))


class _ServerTaken(RPCAuthError):
    """The server behind a proxy started another client's session first: connect again."""


def seal(conn: Any, keys: SessionKeys | None) -> None:
    """Seal every later byte of ``conn`` (a :class:`~disco_rpc.wire.Conn`) with ``keys``.

    Nothing happens when ``keys`` is None (a handshake without a token).

    Raises
    ------
    ProtocolError
        The peer sent bytes before the handshake ended: no legitimate peer does
        (each side waits for the other's last handshake message), and those bytes
        could not be trusted.
    """
    if keys is None:
        return
    if conn.buffered():
        raise ProtocolError("the peer sent data before the handshake ended; dropped")
    conn.t = SealedLink(conn.t, keys)


def client_handshake(conn: Any, key: str, token: bytes | None, *, strict: bool = True, peer: str = "server") -> None:  # fmt: skip
    """Run the client side over a :class:`~disco_rpc.wire.Conn`; raise on refusal.

    With a token, the server must prove it holds it too, and ``conn`` is sealed
    afterwards. ``strict=False`` only offers the token: a peer that answers that
    it requires none is then accepted (and nothing is sealed). ``peer`` names the
    peer in messages.

    Raises
    ------
    RPCAuthError
        The peer is no disco-rpc server of this version, refused the key or the
        proof, asked for a token this client lacks, or (this client holding a
        token) did not prove that it holds the token.
    """
    kb = key.encode("utf-8")
    if len(kb) > MAX_KEY_BYTES:
        raise DiscoValueError(f"key is longer than {MAX_KEY_BYTES} bytes")
    hello = pack_hello(VERSION, kb, new_nonce())
    conn.t.send_parts([hello])
    held_until = None
    while True:
        try:
            reply = bytes(conn.read_exact(_REPLY.size))
        except EOFError:
            raise RPCAuthError(
                "the peer closed the connection during the handshake (not a disco-rpc "
                "server, or it refused this client)"
            ) from None
        if reply != _HELD_NOTICE:
            break
        # A proxy holds this client until a server of its key is free (TVM's
        # timeout_client) and says so every HELD_NOTICE_EVERY seconds, so the socket's
        # timeout (connect_timeout) runs between notices, not over the whole wait. The
        # notice is not part of the transcript: a forged one can only make us wait.
        now = time.monotonic()
        if held_until is None:
            held_until = now + MAX_HELD_WAIT
        elif now > held_until:
            raise RPCAuthError(
                f"the proxy held this client for more than {MAX_HELD_WAIT:g} s; giving up"
            )
    if reply == hello[: _REPLY.size]:
        # a real server's reply carries its own random nonce: this is our hello echoed
        raise RPCAuthError("the peer echoed the handshake back: it is not a disco-rpc server")
    magic, version, status, auth_required, _snonce = _REPLY.unpack(reply)
    if magic != MAGIC:
        raise RPCAuthError("the peer is not a disco-rpc server (bad magic)")
    _check_status(status, version, key)
    if not auth_required:
        if token is not None and strict:
            raise RPCAuthError(
                f"the {peer} answered that it requires no authentication, but this side "
                f"holds a token: a {peer} that holds the token always proves it, so this peer "
                f"is not the {peer} meant (an impostor, a relay, or a {peer} started without "
                "the token); refusing it"
            )
        return
    if token is None:
        conn.t.send_parts([bytes(PROOF_BYTES)])  # the server logs a refused client
        raise RPCAuthError(
            f"authentication failed: the {peer} requires a token: set {TOKEN_ENV} (or, "
            "from Python, pass token=...)"
        )
    hs = Handshake(token, "client", LABEL)
    hs.bind(hello, reply)
    conn.t.send_parts([hs.proof()])
    try:
        status, proof = _STATUS.unpack(conn.read_exact(_STATUS.size))
    except EOFError:
        raise RPCAuthError(
            f"the {peer} closed the connection before answering this client's proof (it "
            "refused the token, or dropped the handshake: busy, timed out, or a relay ended)"
        ) from None
    if status == SERVER_TAKEN:
        raise _ServerTaken("the server started another client's session first")
    if status != OK:
        hint = (
            f" (links to a tracker use ${TRACKER_TOKEN_ENV} when it is set, else ${TOKEN_ENV})"
            if peer == "tracker"
            else ""
        )
        raise RPCAuthError(f"authentication failed: wrong token (the {peer} refused this proof){hint}")  # fmt: skip
    if not hs.verify(proof):
        raise RPCAuthError(
            f"the {peer} failed to prove it knows the token (an impostor or a relay); refusing it"
        )
    seal(conn, hs.keys())


def _check_status(status: int, version: int, key: str) -> None:
    if status == OK:
        return
    if status == SERVER_TAKEN:
        raise _ServerTaken("the server started another client's session first")
    if status == BAD_VERSION:
        raise RPCAuthError(f"the server speaks protocol version {version}, this client {VERSION}")
    raise RPCAuthError(refusal_text(status, key))


def stretch_now(token: bytes | None) -> None:
    """Stretch ``token`` (scrypt, tens of milliseconds, once a process) before a service
    forks: its processes inherit the result, and no client's handshake waits for it."""
    if token:
        stretch_token(token)


#: The environment variable with the token of links to a tracker, when the tracker holds
#: a token of its own (then it does not hold the servers' token, and cannot open
#: sessions on them); unset, tracker links use the sessions' token (``DISCO_TOKEN``).
TRACKER_TOKEN_ENV = "DISCO_TRACKER_TOKEN"


def tracker_token_or(default: Any) -> Any:
    """The token of a link to a tracker that was given none: ``$DISCO_TRACKER_TOKEN`` when
    set, else ``default``."""
    return os.environ.get(TRACKER_TOKEN_ENV) or default


def refusal_text(status: int, key: str) -> str:
    """What a handshake's refusal ``status`` of a client asking with ``key`` means."""
    base = key.rpartition("@")[0] or key
    messages = {
        KEY_MISMATCH: f"key mismatch: the server does not accept the key {key!r}",
        NO_SERVER: f"the proxy has no server registered for key {base!r}",
        SERVERS_BUSY: f"every server for key {base!r} behind the proxy stayed busy",
        TICKET_REQUIRED: (
            f"the servers for key {base!r} are managed by a tracker: a ticket from the "
            "tracker is required (use connect_tracker(...).request(key), or the command "
            "line's --tracker HOST:PORT)"
        ),
    }
    return messages.get(status, f"the server refused the connection (status {status})")


def held_notice() -> bytes:
    """What a proxy sends a client it holds (at once, then every ``HELD_NOTICE_EVERY`` s)."""
    return _HELD_NOTICE


def refusal(status: int) -> bytes:
    """A server reply carrying only a refusal ``status`` (what a proxy answers)."""
    return _REPLY.pack(MAGIC, VERSION, status, 0, bytes(NONCE_BYTES))


def read_hello(conn: Any) -> tuple[int, bytes, bytes] | None:
    """Read a client's hello: ``(version, key bytes, client nonce)``, or None if it is not one."""
    magic, version, keylen = _HELLO.unpack(conn.read_exact(_HELLO.size))
    if magic != MAGIC or keylen > MAX_KEY_BYTES:
        return None
    kb = bytes(conn.read_exact(keylen))
    cnonce = bytes(conn.read_exact(NONCE_BYTES))
    return version, kb, cnonce


def pack_hello(version: int, kb: bytes, cnonce: bytes) -> bytes:
    """The bytes of a hello (a proxy forwards the client's own hello to the server)."""
    return _HELLO.pack(MAGIC, version, len(kb)) + kb + cnonce


class ServerHandshake:
    """The server side of the handshake as a state machine that never blocks.

    Feed it exactly :attr:`want` bytes at a time with :meth:`step`, send what it
    returns; when :attr:`want` is 0 it is over and :attr:`ok` says whether the
    client may proceed, :attr:`keys` what to seal the connection with (None
    without a token). Only fixed-size fields and a key of at most
    :data:`MAX_KEY_BYTES` are ever read. ``key_check(key_bytes)``, when given,
    decides instead of comparing with ``key``: true, false, or the status of its
    refusal (:data:`TICKET_REQUIRED` for a tracker's server asked without a ticket).

    Setting :attr:`taken` (a server behind a proxy that started another client's
    session meanwhile) makes it answer :data:`SERVER_TAKEN` where it would have let
    the client in: in place of the reply, or of the status once the client's proof
    checked out (a client without the token still learns only that it failed).
    """

    def __init__(self, key: str, token: bytes | None, key_check: Any = None) -> None:
        self.key = key.encode("utf-8")
        self.token = token
        self.key_check = key_check
        self.want = _HELLO.size
        self.ok = False
        self.peer_key = ""
        self.keys: SessionKeys | None = None
        self.taken = False
        self.told_taken = False  # it answered SERVER_TAKEN (not a refusal)
        self._stage = self._hello
        self._version = self._keylen = 0
        self._hello_bytes = self._reply = b""

    def step(self, data: bytes) -> bytes:
        """Consume ``want`` bytes; return the bytes to send back (maybe none)."""
        if len(data) != self.want:
            raise DiscoValueError(f"step() needs exactly {self.want} bytes")
        return self._stage(bytes(data))

    def _done(self, ok: bool, out: bytes = b"") -> bytes:
        self.want = 0
        self.ok = ok
        return out

    def _hello(self, data: bytes) -> bytes:
        magic, self._version, self._keylen = _HELLO.unpack(data)
        if magic != MAGIC or self._keylen > MAX_KEY_BYTES:
            return self._done(False)  # not a client: no answer
        self._hello_bytes = data
        self.want = self._keylen + NONCE_BYTES
        self._stage = self._key
        return b""

    def _key(self, data: bytes) -> bytes:
        kb = data[: self._keylen]
        self._hello_bytes += data
        self.peer_key = kb.decode("utf-8", "replace")
        status = OK
        if self._version != VERSION:
            status = BAD_VERSION
        elif self.key_check is not None:
            verdict = self.key_check(kb)  # True, False, or the status of a refusal
            status = verdict if type(verdict) is int else OK if verdict else KEY_MISMATCH
        elif kb != self.key and (self.key or kb.decode("utf-8", "replace") in LINK_KEYS):
            status = KEY_MISMATCH  # ("" takes any key but a service link's)
        if status == OK and self.taken:
            self.told_taken = True
            return self._done(False, refusal(SERVER_TAKEN))
        reply = _REPLY.pack(MAGIC, VERSION, status, 1 if self.token else 0, new_nonce())
        if status != OK or not self.token:
            return self._done(status == OK, reply)
        self._reply = reply
        self.want = PROOF_BYTES
        self._stage = self._proof
        return reply

    def _proof(self, data: bytes) -> bytes:
        hs = Handshake(self.token, "server", LABEL)  # type: ignore[arg-type]  # a proof: a token
        hs.bind(self._hello_bytes, self._reply)
        if not hs.verify(data):
            return self._done(False, _STATUS.pack(AUTH_FAILED, bytes(PROOF_BYTES)))
        if self.taken:
            self.told_taken = True
            return self._done(False, _STATUS.pack(SERVER_TAKEN, bytes(PROOF_BYTES)))
        self.keys = hs.keys()
        return self._done(True, _STATUS.pack(OK, hs.proof()))


def server_handshake(conn: Any, key: str, token: bytes | None, key_check: Any = None, hello: Any = None) -> bool:  # fmt: skip
    """Run the server side over a blocking connection; return True when the client may proceed.

    A peer that is not a client, sends the wrong key or fails authentication gets
    a status code and ``False``. On success with a token, ``conn`` is sealed.
    The key the client presented is left in ``conn.peer_key`` (str). ``hello`` is
    the result of :func:`read_hello` when the caller has read it already.
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
    if hs.ok:
        seal(conn, hs.keys)
    return hs.ok


# --------------------------------------------------------------------------- the client side of a link
def open_conn(url: str, port: int, key: str = "", *, token: Any = None, ssl_context: Any = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, connect_timeout: float = 10.0, peer: str = "RPC server", strict: bool = True) -> wire.Conn:  # fmt: skip
    """Connect and authenticate; return the framed connection (no session yet), sealed
    when a token was used.

    ``peer`` names what is at ``url:port`` in error messages ("tracker", "proxy"...).
    ``strict=False`` only offers the token: a peer that requires none is accepted
    (for a service link whose token was defaulted from another's, never a session).

    A server behind a proxy serves one client at a time; one that started another
    client's session while this client's handshake ran says so (:data:`SERVER_TAKEN`),
    and this client connects again, to be held by the proxy until the server is free
    (for at most :data:`MAX_HELD_WAIT` seconds in all, as a held client).
    """
    give_up = time.monotonic() + MAX_HELD_WAIT
    pause = 0.01
    while True:
        try:
            return _open_once(url, port, key, token, ssl_context, max_message_bytes, connect_timeout, peer, strict)  # fmt: skip
        except _ServerTaken:
            if time.monotonic() + pause > give_up:
                raise RPCAuthError(
                    f"the server behind the proxy at {url}:{port} kept starting other "
                    f"clients' sessions first for {MAX_HELD_WAIT:g} s; giving up"
                ) from None
        # the winner's session has begun and the proxy will hold the next attempt; a short
        # pause that grows keeps the losers of a crowded start from racing in lockstep
        time.sleep(pause * (1.0 + random.random()))
        pause = min(pause * 2, 0.5)


#: A TLS peer that ended the handshake: the client cannot tell a service that wants a
#: client certificate (TLS 1.3 says so only after the client's side is done, and often
#: by closing) from one that does not speak TLS; an outside check was told only the
#: second, with no word of the certificate it lacked.
_TLS_REFUSED_HINT = (
    " (if the {peer} requires client certificates, give one it trusts: "
    "ssl_context.load_cert_chain(...), or --tls-cert and --tls-key, or for a service's "
    "own link to its tracker or proxy --tracker-tls-cert/--proxy-tls-cert and -key; "
    "if it does not speak TLS, connect without ssl_context, or without --tls-*)"
)


def _open_once(url: str, port: int, key: str, token: Any, ssl_context: Any, max_message_bytes: int, connect_timeout: float, peer: str, strict: bool) -> wire.Conn:  # fmt: skip
    try:
        sock = socket.create_connection((url, int(port)), timeout=connect_timeout)
    except OSError as exc:
        raise RPCError(f"cannot connect to the {peer} at {url}:{port}: {exc}") from exc
    try:
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(
                sock, server_hostname=url if ssl_context.check_hostname else None
            )
            transport: Any = wire.SSLTransport(sock)
        else:
            transport = wire.SocketTransport(sock)
        conn = wire.Conn(transport, max_message_bytes)
        client_handshake(conn, key, resolve_token(token), strict=strict, peer=peer)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, RPCError):
            raise
        if isinstance(exc, TimeoutError):
            # through a proxy, the answer waits for a server of the key: say so
            hint = (
                " (a proxy holds a client until a server with its key is free and says so "
                f"every {HELD_NOTICE_EVERY:g} s: a shorter connect_timeout gives up while held)"
                if peer == "RPC server"
                else ""
            )
            raise RPCError(
                f"no answer from the {peer} at {url}:{port} within connect_timeout="
                f"{connect_timeout:g} s{hint}"
            ) from None
        if isinstance(exc, (OSError, EOFError)):
            # a TLS peer resets a plain hello, and a plain one a TLS hello: the bare "reset
            # by peer" gave no hint of it (an attacker check); a certificate refused is not that
            tls_hint = (
                ""
                if isinstance(exc, ssl.SSLCertVerificationError)
                else f" (if the {peer} speaks TLS, connect with TLS: ssl_context=..., or --tls-ca; "
                "a server's or proxy's link to its tracker: --tracker-tls-ca)"
                if ssl_context is None
                else _TLS_REFUSED_HINT.format(peer=peer)
            )
            raise RPCError(f"handshake with the {peer} at {url}:{port} failed: {exc}{tls_hint}") from exc  # fmt: skip
        raise
    sock.settimeout(None)
    return conn
