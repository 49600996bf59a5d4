"""TVM's tracker wire protocol, spoken by :class:`disco_rpc.Tracker` with ``tvm_protocol=True``.

TVM's own RPC servers (``python -m tvm.exec.rpc_server --tracker ...``, the C++
``tvm_rpc``) register with the tracker and TVM's clients
(``tvm.rpc.connect_tracker(...).request(key)``, ``python -m tvm.exec.query_rpc_tracker``)
use it, on the tracker's one port: the first byte a peer sends tells the two
protocols apart (TVM's :data:`~disco_rpc.base.RPC_TRACKER_MAGIC` is a little-endian
``int32`` whose first byte is ``0x71``; this project's handshake starts with ``D``,
TLS with ``0x16``).

The protocol (TVM ``python/tvm/rpc/tracker.py``): the peer sends the magic, the
tracker answers with it; then every message is ``[size (int32 LE)] [JSON]``, a
list that starts with a :class:`~disco_rpc.base.TrackerCode`:

* ``[PING]`` -> ``SUCCESS``
* ``[UPDATE_INFO, {"key": "server:<key>", "addr": [host or null, port]}]`` -> ``SUCCESS``
  (a TVM server describes itself; it is then listed in ``summary()``)
* ``[PUT, key, [port, matchkey], custom_addr or null]`` -> ``SUCCESS`` (one free slot
  of a server; a client given it connects with ``client:<matchkey>``)
* ``[REQUEST, key, user, priority]`` -> ``[SUCCESS, [host, port, matchkey]]`` once
  a slot of ``key`` is free (higher priority first, then first come)
* ``[GET_PENDING_MATCHKEYS]`` -> the match keys this connection put that no client took
* ``[SUMMARY]`` -> ``[SUCCESS, summary]`` (the tracker's summary of TVM's world only)
* ``[STOP, stop_key]`` -> ``FAIL`` (this tracker is stopped by its owner, never remotely)

The two worlds are kept apart: a TVM client is only given slots that TVM-protocol
peers put (it cannot speak this project's authenticated protocol), and this
project's clients only this project's servers; this project's ``summary()`` lists
both, TVM's entries marked ``"protocol": "tvm"``, and counts a key's servers of both
kinds, while a TVM peer, who proves nothing, is shown TVM's world only.

What a peer may cost is bounded: a message is at most
:data:`~disco_rpc.base.TRACKER_MAX_JSON_BYTES` (a larger or non-positive size
closes the connection before anything more is read), the rest of a message must
arrive within :data:`MESSAGE_TIMEOUT` seconds of its first byte, at most
:data:`MAX_TVM_LINKS` TVM connections are served at once (apart from the tracker's
own links, which they cannot crowd out), a connection has
at most :data:`MAX_PUTS_PER_LINK` free slots and :data:`MAX_REQUESTS_PER_LINK`
requests waiting, and keys, hosts and match keys are bounded. Anything malformed
(not JSON, wrong types, an unknown code) closes that connection, as TVM's
tracker does; the tracker keeps serving. A connection that closes takes its
slots and its waiting requests with it at once. Nothing is ever unpickled.

TVM's protocol has no authentication: whoever reaches the port may register or
take servers. :class:`~disco_rpc.Tracker` therefore refuses ``tvm_protocol=True``
on a non-loopback address unless ``allow_insecure_bind=True``, even with a token.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from .base import RPC_TRACKER_MAGIC, TRACKER_MAX_JSON_BYTES, TrackerCode

__all__ = [
    "TVMWorld",
    "TVMLink",
    "SniffHandshake",
    "serve_tvm_link",
    "MESSAGE_TIMEOUT",
    "MAX_TVM_LINKS",
    "MAX_PUTS_PER_LINK",
    "MAX_REQUESTS_PER_LINK",
    "MAX_MATCHKEY_BYTES",
]

logger = logging.getLogger("disco_rpc.tracker")

#: Seconds the rest of a message has to arrive once its first byte did.
MESSAGE_TIMEOUT = 10.0
#: TVM-protocol connections served at once: a cap of their own, so that peers who prove
#: nothing cannot take the threads of the tracker's authenticated links.
MAX_TVM_LINKS = 512
#: Free slots one connection may have put at once (a TVM server has one).
MAX_PUTS_PER_LINK = 64
#: Requests one connection may have waiting at once.
MAX_REQUESTS_PER_LINK = 16
#: The longest match key accepted, in UTF-8 bytes (TVM's are ``<key>:<float>``).
MAX_MATCHKEY_BYTES = 512
#: The first byte of TVM's tracker magic on the wire (``struct.pack("<i", RPC_TRACKER_MAGIC)``).
_TVM_FIRST_BYTE = struct.pack("<i", RPC_TRACKER_MAGIC)[0]


class _Bogus(Exception):
    """A message that breaks the protocol: the connection is closed."""


def _text(value: Any, what: str, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise _Bogus(f"{what} must be a string, not {type(value).__name__}")
    n = len(value.encode("utf-8", "surrogatepass"))
    if n > max_bytes:
        raise _Bogus(f"{what} is {n} bytes long; at most {max_bytes} are accepted")
    return value


def _port(value: Any) -> int:
    # the C++ tvm_rpc reports its port as a string in UPDATE_INFO
    if isinstance(value, str) and value.isdigit() and len(value) <= 5:
        value = int(value)
    if type(value) is not int or not 0 < value < 65536:
        raise _Bogus(f"{value!r} is not a TCP port")
    return value


# --------------------------------------------------------------------------- the state
class TVMLink:
    """One TVM-protocol connection: its sends, its description, its slots and requests."""

    def __init__(self, sock: socket.socket, addr: Any) -> None:
        self.sock = sock
        self.addr = addr
        self.host = str(addr[0]) if isinstance(addr, tuple) else ""
        self.send_lock = threading.Lock()
        self.closed = False
        self.info: dict[str, Any] = {}  # "key" and "addr", from UPDATE_INFO
        self.values: list[_Value] = []  # its free slots, oldest first
        self.waiting = 0  # its requests in a queue

    def send(self, value: Any) -> bool:
        """Send one JSON message; False (and the connection shut down) when it cannot be sent."""  # fmt: skip
        body = json.dumps(value).encode("utf-8")
        with self.send_lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(struct.pack("<i", len(body)) + body)
                return True
            except OSError:
                # a half-sent message: out of sync; the shutdown ends the reader, which cleans up
                self.shutdown()
                return False

    def shutdown(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Value:
    __slots__ = ("link", "key", "host", "port", "matchkey")

    def __init__(self, link: TVMLink, key: str, host: str, port: int, matchkey: str) -> None:
        self.link = link
        self.key = key
        self.host = host
        self.port = port
        self.matchkey = matchkey


class _Request:
    __slots__ = ("link", "key", "priority", "seq")

    def __init__(self, link: TVMLink, key: str, priority: float, seq: int) -> None:
        self.link = link
        self.key = key
        self.priority = priority
        self.seq = seq


class TVMWorld:
    """The TVM-protocol slots and requests of a tracker.

    Every method but :meth:`deliver` must be called with ``lock`` held: the tracker's
    own state's lock, so that one summary sees both worlds at one instant. Nothing is
    sent with it held (a peer that does not read would stall both worlds): matches wait
    in ``outbox`` until :meth:`deliver`.

    Parameters
    ----------
    lock : threading.Lock
        The tracker state's lock.
    max_key_bytes, max_host_bytes : int
        The tracker's limits on keys and hosts.
    """

    def __init__(self, lock: Any, max_key_bytes: int = 256, max_host_bytes: int = 255) -> None:
        self.lock = lock
        self.max_key_bytes = max_key_bytes
        self.max_host_bytes = max_host_bytes
        self.links: dict[TVMLink, None] = {}  # ordered: summary lists them in arrival order
        self.free: dict[str, list[_Value]] = {}
        self.queues: dict[str, list] = {}
        self.seq = itertools.count()
        #: matches made with the lock held, sent by :meth:`deliver` once it is released
        self.outbox: list[tuple[_Request, _Value]] = []
        #: keys that had slots, latest last (summary() lists them after their servers left)
        self.seen: dict[str, None] = {}

    def check_key(self, key: Any) -> str:
        return _text(key, "a key", self.max_key_bytes)

    def check_host(self, host: Any) -> str:
        return _text(host, "a host", self.max_host_bytes)

    def add(self, link: TVMLink) -> None:
        self.links[link] = None

    def put(self, link: TVMLink, key: str, host: str, port: int, matchkey: str) -> None:
        if len(link.values) >= MAX_PUTS_PER_LINK:
            raise _Bogus(f"{MAX_PUTS_PER_LINK} free slots put by one connection already")
        v = _Value(link, key, host, port, matchkey)
        link.values.append(v)
        self.free.setdefault(key, []).append(v)
        remember_key(self.seen, key)
        self._match(key)

    def request(self, link: TVMLink, key: str, priority: float) -> None:
        if link.waiting >= MAX_REQUESTS_PER_LINK:
            raise _Bogus(f"{MAX_REQUESTS_PER_LINK} requests of one connection waiting already")
        link.waiting += 1
        r = _Request(link, key, priority, next(self.seq))
        heapq.heappush(self.queues.setdefault(key, []), (-priority, r.seq, r))
        self._match(key)

    def pending_matchkeys(self, link: TVMLink) -> list[str]:
        return list(dict.fromkeys(v.matchkey for v in link.values))

    def remove(self, link: TVMLink) -> None:
        """Forget ``link``: its slots leave the pool and its requests their queues, now."""
        self.links.pop(link, None)
        link.closed = True
        for key in {v.key for v in link.values}:
            pool = [v for v in self.free.get(key, ()) if v.link is not link]
            if pool:
                self.free[key] = pool
            else:
                self.free.pop(key, None)
        link.values.clear()
        if link.waiting:
            for key in list(self.queues):
                q = [item for item in self.queues[key] if item[2].link is not link]
                if q:
                    heapq.heapify(q)
                    self.queues[key] = q
                else:
                    del self.queues[key]
            link.waiting = 0

    def _match(self, key: str) -> None:
        q = self.queues.get(key)
        pool = self.free.get(key)
        while q and pool:
            _p, _s, r = heapq.heappop(q)
            r.link.waiting -= 1
            if r.link.closed:
                continue
            v = pool.pop(0)
            v.link.values.remove(v)
            # sent by deliver(), without the lock: a client that does not read must not
            # hold the lock (both worlds' state) while a send to it blocks
            self.outbox.append((r, v))
        if q is not None and not q:
            del self.queues[key]
        if pool is not None and not pool:
            del self.free[key]

    def deliver(self) -> None:
        """Send the matches made since the last call; call it with the lock **released**.

        A client that cannot be sent its match (gone, or not reading) gives the slot
        back to the front of its key's pool, unless the slot's own connection closed
        meanwhile.
        """
        while True:
            with self.lock:
                if not self.outbox:
                    return
                batch, self.outbox = self.outbox, []
            for r, v in batch:
                if r.link.send([TrackerCode.SUCCESS, [v.host, v.port, v.matchkey]]):
                    continue
                with self.lock:
                    if v.link.closed:
                        continue
                    v.link.values.insert(0, v)
                    self.free.setdefault(v.key, []).insert(0, v)
                    self._match(v.key)

    # -- summary ---------------------------------------------------------------------
    def server_info(self) -> list[dict]:
        """TVM's ``server_info`` entries: connections that described themselves as a server."""
        out = []
        for link in self.links:
            key = link.info.get("key")
            if isinstance(key, str) and key.startswith("server") and "addr" in link.info:
                out.append(
                    {
                        "addr": list(link.info["addr"]),
                        "key": key,
                        "free": bool(link.values),
                        "protocol": "tvm",
                    }
                )
        return out

    def add_counts(self, counts: dict[str, dict]) -> None:
        """Add this world's ``free``, ``pending`` and ``total`` per key to ``counts``."""

        def entry(key: str) -> dict:
            return counts.setdefault(key, {"free": 0, "pending": 0, "total": 0})

        for link in self.links:
            key = link.info.get("key")
            if isinstance(key, str) and key.startswith("server:"):
                entry(key.split(":", 1)[1])["total"] += 1
        for key, pool in self.free.items():
            entry(key)["free"] += len(pool)
        for key, q in self.queues.items():
            entry(key)["pending"] += sum(1 for _p, _s, r in q if not r.link.closed)


def remember_key(seen: dict[str, None], key: str, limit: int = 1000) -> None:
    """Move ``key`` to the end of ``seen``, which keeps the last ``limit`` keys."""
    seen.pop(key, None)
    seen[key] = None
    if len(seen) > limit:
        del seen[next(iter(seen))]


# --------------------------------------------------------------------------- the handshake
class SniffHandshake:
    """A pending connection that is either TVM's (its first byte says so) or this project's.

    For this project's protocol it becomes ``make_other(sock, addr)`` (the usual
    :class:`disco_core.spi.SocketHandshake`, TLS included) and delegates to it;
    for TVM's it reads the 4-byte magic and is done (``tvm`` is then True), and
    the link's thread answers with the magic. Peeking at one byte never spins:
    a readable socket has at least one byte or its end.
    """

    def __init__(self, sock: socket.socket, addr: Any, make_other: Callable[[socket.socket, Any], Any]) -> None:  # fmt: skip
        sock.setblocking(False)
        self.sock = sock
        self.addr = addr
        self.tvm = False
        self.inner: Any = None
        self._make_other = make_other
        self._buf = b""

    @property
    def wants_write(self) -> bool:
        return bool(self.inner is not None and getattr(self.inner, "wants_write", False))

    @property
    def machine(self) -> Any:
        """The inner handshake's state machine (this project's protocol only)."""
        return self.inner.machine

    def fileno(self) -> int:
        return (self.inner or self.sock).fileno()

    def advance(self) -> bool | None:
        if self.inner is None and not self.tvm:
            try:
                first = self.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                return False
            if not first:
                return False
            if first[0] == _TVM_FIRST_BYTE:
                self.tvm = True
            else:
                self.inner = self._make_other(self.sock, self.addr)
        if self.inner is not None:
            return self.inner.advance()
        try:
            data = self.sock.recv(4 - len(self._buf))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return False
        if not data:
            return False
        self._buf += data
        if len(self._buf) < 4:
            return None
        return struct.unpack("<i", self._buf)[0] == RPC_TRACKER_MAGIC

    def detach(self, timeout: float | None = None) -> socket.socket:
        if self.inner is not None:
            return self.inner.detach(timeout)
        self.sock.settimeout(timeout)
        return self.sock

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            return
        try:
            self.sock.close()
        except OSError:
            pass


# --------------------------------------------------------------------------- serving
def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    poller = None
    while len(buf) < n:
        if poller is None:  # poll, not select: descriptors may be above FD_SETSIZE
            poller = select.poll()
            poller.register(sock, select.POLLIN)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise _Bogus(f"a message not finished within {MESSAGE_TIMEOUT:g} s")
        chunk = sock.recv(min(n - len(buf), 65536))
        if not chunk:
            raise EOFError("the connection ended in the middle of a message")
        buf += chunk
    return bytes(buf)


def _read_message(sock: socket.socket) -> Any:
    """The next message (None at a clean end); _Bogus when it breaks the protocol."""
    first = sock.recv(4)  # waits as long as the peer is idle between messages
    if not first:
        return None
    deadline = time.monotonic() + MESSAGE_TIMEOUT
    head = first + _recv_exact(sock, 4 - len(first), deadline)
    size = struct.unpack("<i", head)[0]
    if not 0 < size <= TRACKER_MAX_JSON_BYTES:
        raise _Bogus(f"a message of {size} bytes (at most {TRACKER_MAX_JSON_BYTES})")
    body = _recv_exact(sock, size, deadline)
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Bogus(f"not JSON: {exc}") from None


def _summary_reply(summary: Callable[[int | None], dict]) -> list:
    """``[SUCCESS, summary]``, cut to fit in one message (the tracker's summary halves its lists)."""  # fmt: skip
    limit = None
    while True:
        reply = [TrackerCode.SUCCESS, summary(limit)]
        n = len(json.dumps(reply))
        if n <= TRACKER_MAX_JSON_BYTES:
            return reply
        limit = (limit or TRACKER_MAX_JSON_BYTES) // 2


def _handle(link: TVMLink, world: TVMWorld, args: Any, summary: Callable[[int | None], dict]) -> None:  # fmt: skip
    if not isinstance(args, list) or not args or type(args[0]) is not int:
        raise _Bogus("a message must be a list that starts with a tracker code")
    code = args[0]
    if code == TrackerCode.PING:
        link.send(TrackerCode.SUCCESS)
    elif code == TrackerCode.PUT:
        if len(args) < 3 or not isinstance(args[2], list) or len(args[2]) != 2:
            raise _Bogus("PUT takes [PUT, key, [port, matchkey], custom_addr]")
        key = world.check_key(args[1])
        port = _port(args[2][0])
        matchkey = _text(args[2][1], "a match key", MAX_MATCHKEY_BYTES)
        custom = args[3] if len(args) > 3 else None
        host = link.host if custom is None else world.check_host(custom)
        with world.lock:
            world.put(link, key, host, port, matchkey)
        world.deliver()
        link.send(TrackerCode.SUCCESS)
    elif code == TrackerCode.REQUEST:
        if len(args) < 4:
            raise _Bogus("REQUEST takes [REQUEST, key, user, priority]")
        key = world.check_key(args[1])
        priority = args[3]
        try:  # an int beyond a float's range overflows
            finite = type(priority) in (int, float) and math.isfinite(priority)
        except OverflowError:
            finite = False
        if not finite:
            raise _Bogus(f"a priority must be a finite number, not {str(priority)[:40]}")
        with world.lock:
            world.request(link, key, priority)
        world.deliver()
    elif code == TrackerCode.GET_PENDING_MATCHKEYS:
        with world.lock:
            keys = world.pending_matchkeys(link)
        link.send(keys)
    elif code == TrackerCode.UPDATE_INFO:
        info = args[1] if len(args) > 1 else None
        if not isinstance(info, dict):
            raise _Bogus("UPDATE_INFO takes a dict")
        new: dict[str, Any] = {}
        if "key" in info:
            new["key"] = _text(info["key"], "a key", world.max_key_bytes + len("server:"))
        if "addr" in info:
            addr = info["addr"]
            if not isinstance(addr, list) or len(addr) != 2:
                raise _Bogus("an addr is [host, port]")
            host = link.host if addr[0] is None else world.check_host(addr[0])
            new["addr"] = [host, _port(addr[1])]
        with world.lock:
            link.info.update(new)  # other entries are not kept: what a peer stores is bounded
        link.send(TrackerCode.SUCCESS)
    elif code == TrackerCode.SUMMARY:
        with world.lock:
            reply = _summary_reply(summary)
        link.send(reply)
    elif code == TrackerCode.STOP:
        logger.warning("refused a STOP from %s: this tracker is stopped by its owner only", link.addr)  # fmt: skip
        link.send(TrackerCode.FAIL)
    else:
        raise _Bogus(f"unknown tracker code {code}")


def serve_tvm_link(sock: socket.socket, addr: Any, world: TVMWorld, summary: Callable[[int | None], dict]) -> None:  # fmt: skip
    """Serve one TVM-protocol connection whose magic was read, until it closes (a thread of its own).

    ``summary(max_bytes)`` returns the tracker's summary and is called with
    ``world.lock`` held.
    """
    link = TVMLink(sock, addr)
    with world.lock:
        world.add(link)
    try:
        sock.sendall(struct.pack("<i", RPC_TRACKER_MAGIC))
        while True:
            args = _read_message(sock)
            if args is None:
                return
            _handle(link, world, args, summary)
    except _Bogus as exc:
        logger.warning("closed the TVM-protocol connection from %s: %s", addr, exc)
    except (OSError, EOFError) as exc:
        logger.debug("TVM-protocol connection from %s ended: %s", addr, exc)
    finally:
        with world.lock:
            world.remove(link)
        link.shutdown()
        try:
            sock.close()
        except OSError:
            pass
