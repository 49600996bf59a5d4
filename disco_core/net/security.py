"""The one security policy of every Disco link: tokens, binds, the handshake's proofs and keys.

Who may talk to whom is decided here, once, for the socket channel and every
disco-rpc service. The rules:

- **Token.** A shared secret, given as an argument or in ``$DISCO_TOKEN``
  (:func:`resolve_token`). It never crosses the wire.
- **Binds.** A service that listens beyond loopback needs a token, or TLS that
  requires the client's certificate (server-side TLS alone encrypts, and lets
  anyone in); ``allow_insecure_bind=True`` is the explicit opt-out and warns. A
  loopback service without a token warns once (:func:`check_bind`).
- **Mutual proof.** Each side proves it holds the token with an HMAC over the
  whole handshake transcript, keyed with the token stretched by scrypt
  (:func:`stretch_token`: a proof seen on the wire, or asked for by a fake peer,
  lets a guess of the token be checked offline, and scrypt makes each guess cost
  tens of milliseconds instead of microseconds) (both hellos, hence both nonces and everything the
  protocol put in them). A side that holds a token never goes on with a peer
  that has not proven it: "no authentication required" from a peer is a
  refusal, not a shortcut (:class:`Handshake`).
- **Binding.** The handshake yields per-direction keys derived from the token
  and the transcript (:meth:`Handshake.keys`); every later record is sealed
  with them (:mod:`disco_core.net.protect`), so a relay that passed the
  handshake through (a proxy, a tracker pairing, anyone on the path) can neither
  inject, alter, reorder nor replay a record.

The message layouts stay the protocols' own; what they must do is put a fresh
:func:`new_nonce` in each side's hello and feed both hellos, exactly as sent,
to :meth:`Handshake.bind`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
import struct
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import DiscoError, DiscoTypeError, DiscoValueError, InsecureBindError

__all__ = [
    "TOKEN_ENV",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "resolve_token",
    "is_loopback",
    "check_bind",
    "tls_authenticates_peers",
    "listen_family",
    "new_nonce",
    "stretch_token",
    "SessionKeys",
    "Handshake",
]

#: The environment variable that holds the shared token.
TOKEN_ENV = "DISCO_TOKEN"
#: Size of the nonce each side puts in its hello.
NONCE_BYTES = 32
#: Size of a proof (HMAC-SHA256).
PROOF_BYTES = 32

_VERSION = b"disco-net/2"
#: scrypt's cost parameters for a token: those of scrypt's paper for interactive logins
#: (16 MiB, 40-70 ms on this project's 2-vCPU VM, once a process per token).
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1
_LEN = struct.Struct("<Q")
_warned_loopback: set[str] = set()


def resolve_token(token: str | bytes | bytearray | None = None) -> bytes | None:
    """The shared token: ``token`` itself, else ``$DISCO_TOKEN``; ``None`` when neither is set.

    Parameters
    ----------
    token : str, bytes or None
        The token given by the caller (a ``str`` is UTF-8 encoded). An empty
        token counts as none.

    Returns
    -------
    bytes or None
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    if isinstance(token, str):
        token = token.encode("utf-8")
    elif not isinstance(token, (bytes, bytearray)):
        raise DiscoTypeError(f"token must be str or bytes, not {type(token).__name__}")
    return bytes(token) or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``127.0.0.0/8``, ``::1``, ``localhost``).

    The wildcard addresses (``""``, ``0.0.0.0``, ``::``) are *not* loopback: they
    listen on every interface. A name is resolved, and is loopback only when every
    address it resolves to is.
    """
    if not isinstance(host, str):
        raise DiscoTypeError(f"host must be a str, not {type(host).__name__}")
    if host in ("localhost", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if not host:
            return False
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return False
        addrs = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
        return bool(addrs) and all(_ip_loopback(a) for a in addrs)
    return _ip_loopback(ip)


def _ip_loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def tls_authenticates_peers(ssl_context: Any) -> bool:
    """Whether a server's ``ssl_context`` makes every peer prove who it is: TLS that
    requires the client's certificate (``verify_mode`` is ``ssl.CERT_REQUIRED``)."""
    return (
        ssl_context is not None and getattr(ssl_context, "verify_mode", None) == ssl.CERT_REQUIRED
    )


def check_bind(
    host: str,
    *,
    token: bytes | None,
    tls: Any,
    allow_insecure_bind: bool = False,
    what: str = "service",
) -> None:
    """Apply the bind policy before a service listens on ``host``.

    Parameters
    ----------
    host : str
        The address the service will listen on.
    token : bytes or None
        The resolved token (see :func:`resolve_token`).
    tls : ssl.SSLContext, bool or None
        The service's server-side TLS context (None: no TLS). It stands in for a
        token only when it requires the client's certificate
        (:func:`tls_authenticates_peers`): without that, anyone who reaches the
        port gets in, over TLS (an attacker check ran code on such a server). A
        bool says the same thing: True for TLS that requires client certificates.
    allow_insecure_bind : bool
        The explicit opt-out: listen beyond loopback with neither, with a warning.
    what : str
        The service's name, for the messages.

    Raises
    ------
    InsecureBindError
        ``host`` is reachable from other machines and the service has neither a
        token nor TLS that requires client certificates, and ``allow_insecure_bind``
        is false.
    DiscoValueError
        ``host`` is a name that does not resolve (it was reported as an insecure bind,
        and told the user to add a token: an outside check).
    """
    if isinstance(host, str):
        listen_family(host, what)  # a name that does not resolve is named here
    certs_required = tls is True or (not isinstance(tls, bool) and tls_authenticates_peers(tls))
    if is_loopback(host):
        # (a local user without a certificate the service trusts is refused too)
        if token is None and not certs_required and what not in _warned_loopback:
            _warned_loopback.add(what)
            warnings.warn(
                f"the {what} listens on {host} without a token: any local user can use it "
                f"(set {TOKEN_ENV} or pass token=...)",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    if token is not None or certs_required:
        return
    shown = host or "every interface"
    encrypted = tls is not None and tls is not False
    if not allow_insecure_bind:
        why = (
            "its TLS does not require client certificates, so anyone who reaches it gets in "
            "and could run code here"
            if encrypted
            else "anyone who reaches it could run code here"
        )
        raise InsecureBindError(
            f"refusing to listen on {shown} for the {what}: {why}. Give token=... (or set "
            f"{TOKEN_ENV}), or TLS that requires client certificates (verify_mode "
            "ssl.CERT_REQUIRED), or pass allow_insecure_bind=True if the network is trusted"
        )
    warnings.warn(
        f"the {what} listens on {shown} with neither a token nor TLS that requires client "
        "certificates (allow_insecure_bind=True)",
        RuntimeWarning,
        stacklevel=3,
    )


def listen_family(host: str, what: str = "service") -> int:
    """The address family a service listening on ``host`` binds with.

    An IPv6 literal is ``AF_INET6``; an IPv4 literal or ``""`` (every interface)
    ``AF_INET``; a name is resolved, and is ``AF_INET`` when it has an IPv4 address
    (``localhost`` keeps meaning 127.0.0.1), else ``AF_INET6`` (a name such as
    ``ip6-localhost`` that only has ``::1``).

    Raises
    ------
    DiscoValueError
        ``host`` is a name that does not resolve (before, a raw ``socket.gaierror``
        from ``bind``, or an insecure-bind error telling the user to add a token), or an
        address in brackets (``[::1]``), which ``bind`` does not take.
    """
    if not host:
        return socket.AF_INET
    if host.startswith("["):  # a URL's form of an IPv6 address: bind() takes it bare
        raise DiscoValueError(
            f"cannot listen on {host!r} for the {what}: give the address without brackets "
            f"({host.strip('[]')!r})"
        )
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:  # (a label over 63 characters: UnicodeError)
        raise DiscoValueError(
            f"cannot listen on {host!r} for the {what}: the name does not resolve "
            f"({getattr(exc, 'strerror', None) or exc})"
        ) from None
    families = {info[0] for info in infos}
    return socket.AF_INET if socket.AF_INET in families or not families else socket.AF_INET6


@functools.lru_cache(maxsize=16)
def stretch_token(token: bytes) -> bytes:
    """The key a token proves with: scrypt of ``token`` (32 bytes), made once a process.

    An attacker who sees a handshake (or is a fake peer that asks for a proof) can
    check guesses of the token offline; an HMAC keyed with the token itself allowed
    about 265,000 guesses a second on one core (an attacker check recovered the
    README's example token at once). Through scrypt each guess costs tens of
    milliseconds and 16 MiB. A token should still be random and long
    (``secrets.token_urlsafe(32)``): stretching slows guessing, it does not stop it.
    """
    if not token:
        raise ValueError("an empty token has nothing to stretch")
    return hashlib.scrypt(
        bytes(token),
        salt=_VERSION + b" token",
        n=_SCRYPT_N,
        r=_SCRYPT_R,
        p=_SCRYPT_P,
        maxmem=64 << 20,
        dklen=32,
    )


def new_nonce() -> bytes:
    """A fresh random nonce (:data:`NONCE_BYTES` bytes) for a hello."""
    return os.urandom(NONCE_BYTES)


@dataclass(frozen=True)
class SessionKeys:
    """The keys one side seals with (``send``) and checks with (``recv``); 64 bytes each."""

    send: bytes
    recv: bytes


class Handshake:
    """The cryptographic half of a handshake: proofs and keys over a transcript.

    Parameters
    ----------
    token : bytes
        The shared token (not None: a protocol without a token has nothing to prove).
    role : {"client", "server"}
        This side's role: the client sends the first hello.
    label : bytes
        The protocol's name and version (e.g. ``b"disco-rpc/2"``); proofs and keys
        of one protocol are worthless in another.
    stretch : bool
        Key the proofs and keys with :func:`stretch_token` of ``token`` (the
        default: for a token people chose). False for a secret that is random
        already, derived from a stretched token (a socket node's reply secret).

    Notes
    -----
    Call :meth:`bind` with both hellos exactly as they crossed the wire, then
    exchange :meth:`proof` and check the peer's with :meth:`verify`. The client
    proves first; the server answers with its own proof only after the client's
    checked out, so a peer without the token learns nothing it could replay.
    """

    def __init__(self, token: bytes, role: str, label: bytes, *, stretch: bool = True) -> None:
        if not token:
            raise ValueError("a Handshake needs a token")
        if role not in ("client", "server"):
            raise ValueError(f"role must be 'client' or 'server', not {role!r}")
        self._token = stretch_token(bytes(token)) if stretch else bytes(token)
        self.role = role
        self.peer_role = "server" if role == "client" else "client"
        self.label = bytes(label)
        self._transcript: bytes | None = None

    def bind(self, client_hello: bytes, server_hello: bytes) -> None:
        """Fix the transcript: both hellos, each of which carries its sender's nonce."""
        h = hashlib.sha256(_VERSION + b"\0" + self.label + b"\0")
        for msg in (client_hello, server_hello):
            h.update(_LEN.pack(len(msg)))
            h.update(msg)
        self._transcript = h.digest()

    @property
    def transcript(self) -> bytes:
        if self._transcript is None:
            raise DiscoError("Handshake.bind() must come before proofs and keys")
        return self._transcript

    def _proof_of(self, role: str) -> bytes:
        msg = _VERSION + b" proof " + role.encode() + b"\0" + self.transcript
        return hmac.new(self._token, msg, hashlib.sha256).digest()

    def proof(self) -> bytes:
        """This side's proof that it holds the token (:data:`PROOF_BYTES` bytes)."""
        return self._proof_of(self.role)

    def verify(self, peer_proof: bytes) -> bool:
        """Whether ``peer_proof`` is the peer's valid proof (constant-time comparison)."""
        return hmac.compare_digest(bytes(peer_proof), self._proof_of(self.peer_role))

    def keys(self) -> SessionKeys:
        """Per-direction keys for :class:`~disco_core.net.protect.SealedTransport` (HKDF-SHA256)."""
        okm = _hkdf(self._token, salt=self.transcript, info=_VERSION + b" record keys", length=128)
        c2s, s2c = okm[:64], okm[64:]
        if self.role == "client":
            return SessionKeys(send=c2s, recv=s2c)
        return SessionKeys(send=s2c, recv=c2s)


def _hkdf(ikm: bytes, *, salt: bytes, info: bytes, length: int) -> bytes:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:  # pragma: no cover - cryptography is a dependency of the network plugins
        raise DiscoError(
            "protected links need the 'cryptography' package: pip install cryptography"
        ) from None
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)
