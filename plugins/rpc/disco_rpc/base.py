"""TVM's RPC base definitions (``tvm.rpc.base``): magic numbers, tracker codes, helpers.

The names and values are TVM's, so code written against ``tvm.rpc.base`` runs
unchanged, and they define the TVM tracker wire protocol that
:class:`disco_rpc.Tracker` speaks with ``tvm_protocol=True``
(:mod:`disco_rpc.tvm_tracker`): the client sends :data:`RPC_TRACKER_MAGIC` as a
little-endian ``int32`` and the tracker answers with the same; then each message
is ``[size (int32, little-endian)] [JSON text of that size]``, the request a list
that starts with a :class:`TrackerCode`.

Two differences from TVM's helpers, both bounds: :func:`recvjson` refuses a size
outside ``(0, max_bytes]`` (TVM reads whatever size the peer declares), and
:func:`random_key` draws from the operating system's random source instead of
:mod:`random` (same format: ``"<prefix><delimiter><float in [0, 1)>"``).
"""

from __future__ import annotations

import errno
import json
import logging
import random
import socket
import struct
import time
from typing import Any

from disco_core import NetworkError

from .errors import ProtocolError, RPCError

__all__ = [
    "RPC_MAGIC",
    "RPC_TRACKER_MAGIC",
    "RPC_CODE_SUCCESS",
    "RPC_CODE_DUPLICATE",
    "RPC_CODE_MISMATCH",
    "RPC_SESS_MASK",
    "TRACKER_MAX_JSON_BYTES",
    "TrackerCode",
    "get_addr_family",
    "recvall",
    "sendjson",
    "recvjson",
    "random_key",
    "split_random_key",
    "connect_with_retry",
]

logger = logging.getLogger("disco_rpc.base")

#: Magic header of TVM's RPC data plane.
RPC_MAGIC = 0xFF271
#: Magic header of TVM's RPC tracker (its control plane).
RPC_TRACKER_MAGIC = 0x2F271
#: Success reply of a TVM RPC server or proxy handshake.
RPC_CODE_SUCCESS = RPC_MAGIC + 0
#: A TVM proxy already has a server with that key.
RPC_CODE_DUPLICATE = RPC_MAGIC + 1
#: A TVM server or proxy has no peer with the key presented.
RPC_CODE_MISMATCH = RPC_MAGIC + 2
#: TVM's mask of the session bits in a device type (``remote[<session>]:cpu(0)``).
RPC_SESS_MASK = 128
#: The largest JSON message of the TVM tracker protocol (TVM's ``MAX_TRACKER_MSG_BYTES``).
TRACKER_MAX_JSON_BYTES = 1 << 20

_SYSRANDOM = random.SystemRandom()


class TrackerCode:
    """Enumeration code for the RPC tracker (TVM's values)."""

    FAIL = -1
    SUCCESS = 0
    PING = 1
    STOP = 2
    PUT = 3
    REQUEST = 4
    UPDATE_INFO = 5
    SUMMARY = 6
    GET_PENDING_MATCHKEYS = 7


def get_addr_family(addr: tuple) -> int:
    """The address family of ``addr`` (``(host, port)``), as ``getaddrinfo`` resolves it."""
    res = socket.getaddrinfo(addr[0], addr[1], 0, 0, socket.IPPROTO_TCP)
    return res[0][0]


def recvall(sock: socket.socket, nbytes: int) -> bytes:
    """Receive exactly ``nbytes`` bytes from ``sock``.

    Raises
    ------
    OSError
        The peer closed the connection first (TVM's ``"connection reset"``).
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    nread = 0
    while nread < nbytes:
        n = sock.recv_into(view[nread:], nbytes - nread)
        if not n:
            raise NetworkError("connection reset")  # an OSError, as TVM's
        nread += n
    return bytes(buf)


def sendjson(sock: socket.socket, data: Any) -> None:
    """Send ``data`` as one length-prefixed JSON message (TVM's tracker framing)."""
    body = json.dumps(data).encode("utf-8")
    sock.sendall(struct.pack("<i", len(body)) + body)


def recvjson(sock: socket.socket, max_bytes: int = TRACKER_MAX_JSON_BYTES) -> Any:
    """Receive one length-prefixed JSON message.

    Raises
    ------
    disco_rpc.errors.ProtocolError
        The declared size is not in ``(0, max_bytes]`` (nothing more is read) or the
        text is not JSON.
    OSError
        The connection ended in the middle.
    """
    size = struct.unpack("<i", recvall(sock, 4))[0]
    if not 0 < size <= max_bytes:
        raise ProtocolError(f"a JSON message of {size} bytes; at most {max_bytes} are accepted")
    try:
        return json.loads(recvall(sock, size).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"a message that is not JSON: {exc}") from None


def random_key(prefix: str, delimiter: str = ":", cmap: Any = None) -> str:
    """A random key ``"<prefix><delimiter><random float>"`` not in ``cmap``.

    Parameters
    ----------
    prefix : str
        The string prefix.
    delimiter : str
        The delimiter.
    cmap : container, optional
        Keys to avoid (a conflict map).

    Returns
    -------
    key : str
        The generated random key.
    """
    while True:
        key = f"{prefix}{delimiter}{_SYSRANDOM.random()}"
        if not cmap or key not in cmap:
            return key


def split_random_key(key: str, delimiter: str = ":") -> list[str]:
    """Split a key made by :func:`random_key` into ``[prefix, random_part]``."""
    return key.rsplit(delimiter, 1)


def connect_with_retry(addr: tuple, timeout: float = 60, retry_period: float = 5) -> socket.socket:
    """Connect to ``addr``, retrying while it refuses, for at most ``timeout`` seconds.

    Raises
    ------
    RuntimeError
        Still refused after ``timeout`` seconds (TVM's error).
    OSError
        Any other connection error, at once.
    """
    tstart = time.time()
    while True:
        sock = socket.socket(get_addr_family(addr), socket.SOCK_STREAM)
        try:
            sock.connect(addr)
            return sock
        except OSError as sock_err:
            sock.close()
            if sock_err.args[0] not in (errno.ECONNREFUSED,):
                raise
            if time.time() - tstart > timeout:
                raise RPCError(f"Failed to connect to server {addr!s}") from None  # a RuntimeError
            logger.warning("Cannot connect to tracker %s, retry in %g secs...", addr, retry_period)
            time.sleep(retry_period)
