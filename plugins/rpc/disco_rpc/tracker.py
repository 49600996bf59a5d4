"""The RPC tracker: a pool of servers registered under keys, handed out to clients.

Servers (or a proxy on their behalf) keep one *registration link* open to the
tracker; clients ask for a server by key and get an address and a one-time
*ticket*. The server accepts only clients that present a ticket the tracker
assigned to it (``key@ticket`` as the handshake key) and reports over its link
when that session starts and ends, so the tracker puts the server back into the
free pool when the session ends for any reason: the client closed it, crashed,
or its ``session_timeout`` expired. A ticket nobody used within
``match_timeout`` seconds is revoked. A server whose link closes is removed.

Every link starts with the disco-rpc handshake (HMAC token, optional TLS) and
then carries frames of the tagged wire format (no pickle), bounded by
``max_message_bytes`` (1 MiB by default).

Requests wait in a queue per key: higher ``priority`` first, then first come. A
request leaves its queue as soon as its client's link closes (cancelled, timed
out, crashed).

What anyone who can reach the port may cost the tracker is bounded: one thread
accepts and runs every handshake (:class:`disco_core.net.accept.AcceptLoop`:
at most :data:`MAX_PENDING` at once, :data:`HANDSHAKE_TIMEOUT` seconds each);
an authenticated link gets a thread, up to :data:`MAX_LINKS`; keys are at most
:data:`MAX_KEY_BYTES` bytes, a link has at most :data:`MAX_REQUESTS_PER_LINK`
requests waiting, and ``summary()`` always fits in one frame (it lists fewer
entries and says so under ``"truncated"`` when it must).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import os
import reprlib
import secrets
import select
import signal
import socket
import ssl
import struct
import threading
import time
from typing import Any

from disco_core import DiscoTimeoutError, DiscoValueError, InsecureBindError
from disco_core.spi import AcceptLoop, Drain, Slots, SocketHandshake

from . import auth, wire
from .client import check_connect_args, connect
from .errors import RPCError, RPCRequestTimeoutError, RPCSessionTimeoutError
from .protocol import (  # noqa: F401 (the tracker's codes, also names of this module)
    CLIENT_KEY,
    ERROR,
    REGISTRANT_KEY,
    REPLY,
    REQUEST,
    T_ASSIGN,
    T_END,
    T_FAIL,
    T_PING,
    T_PUT,
    T_REQUEST,
    T_REVOKE,
    T_START,
    T_SUMMARY,
    TICKET_SEP,
    TRACKER_MAX_MESSAGE_BYTES,
    ticket_key,
)
from .server import handshake_timeout
from .service import Registration, ServiceProcess, bind_listener, check_bind, open_tracker_link
from .tvm_tracker import MAX_TVM_LINKS, SniffHandshake, TVMWorld, remember_key, serve_tvm_link

__all__ = [
    "Tracker",
    "TrackerSession",
    "connect_tracker",
    "Registration",
    "serve_tracker",
    "format_summary",
]

logger = logging.getLogger("disco_rpc.tracker")


# --------------------------------------------------------------------------- limits
#: The longest key (kind of server) the tracker accepts, in UTF-8 bytes.
MAX_KEY_BYTES = 256
#: The longest host a server may register under, in UTF-8 bytes (a DNS name is at most 253).
MAX_HOST_BYTES = 255
#: Requests one connection may have waiting at once (a client waits for one at a time).
MAX_REQUESTS_PER_LINK = 16
#: Connections the tracker serves at once (registrations and clients, after their handshake).
MAX_LINKS = 1024
#: Connections still in their handshake, at most (the oldest is dropped to make room).
MAX_PENDING = 64
#: Seconds a connection has to finish its handshake.
HANDSHAKE_TIMEOUT = 10.0
#: Entries ``summary()`` lists at most; it also always fits in one frame (else it lists fewer).
SUMMARY_MAX_SERVERS = 1000
SUMMARY_MAX_KEYS = 1000
#: Room left in a frame besides the summary's own bytes.
_SUMMARY_SLACK = 4096
#: The longest ticket a server may say it is serving (the tracker hands out 32 hex digits).
_MAX_TICKET_CHARS = 64
#: Seconds a send to a peer that does not read may block before its link is dropped.
_SEND_TIMEOUT = 2.0
#: Seconds a client gives the tracker to answer what it answers at once (a summary, a
#: ping) or to finish a reply it began; then the tracker is taken for gone (an RPCError).
REPLY_TIMEOUT = 30.0
#: Seconds a client waiting for a server hears nothing before it pings the tracker: the
#: wait lasts as long as servers stay busy, but not past a tracker that stopped answering.
ALIVE_EVERY = 30.0
#: Seconds :meth:`TrackerSession.pool_text` waits for the summary it words.
POOL_TEXT_TIMEOUT = 5.0


def _check_key(key: Any) -> str:
    """``key`` if it is a string of at most :data:`MAX_KEY_BYTES` UTF-8 bytes; else ValueError."""
    if not isinstance(key, str):
        raise DiscoValueError(f"a key must be a string, not {type(key).__name__}")
    n = len(key.encode("utf-8", "surrogatepass"))
    if n > MAX_KEY_BYTES:
        raise DiscoValueError(
            f"the key is {n} bytes long; the tracker accepts keys of at most {MAX_KEY_BYTES} bytes"
        )
    return key


def _check_host(host: Any) -> str:
    if not isinstance(host, str):
        raise DiscoValueError(f"a host must be a string, not {type(host).__name__}")
    n = len(host.encode("utf-8", "surrogatepass"))
    if n > MAX_HOST_BYTES:
        raise DiscoValueError(
            f"the host is {n} bytes long; the tracker accepts hosts of at most {MAX_HOST_BYTES} bytes"  # fmt: skip
        )
    return host


# --------------------------------------------------------------------------- the tracker's state
#: What poll() reports for a peer that closed its end (POLLRDHUP: Linux; POLLHUP elsewhere).
_PEER_CLOSED = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


class _Link:
    """One authenticated connection to the tracker, with a send lock.

    ``waiting`` holds its requests still in a queue (at most
    :data:`MAX_REQUESTS_PER_LINK`); they leave the queues when it closes.
    """

    def __init__(self, conn: wire.Conn, addr: Any, role: str = CLIENT_KEY) -> None:
        self.conn = conn
        self.addr = addr
        self.role = role
        self.lock = threading.Lock()
        self.closed = False
        self.waiting: set[_Waiting] = set()

    def send(self, kind: int, op: int, value: Any) -> bool:
        """Send one frame; False (and the link shut down) when the peer is gone or stopped reading."""  # fmt: skip
        with self.lock:
            if self.closed:
                return False
            try:
                self.conn.send(kind, op, value)
                return True
            except OSError:
                # gone, or not reading for _SEND_TIMEOUT: a frame may be half sent, so the
                # link is out of sync; shutting it down ends its reader, which cancels its
                # requests
                self.closed = True
                try:
                    self.conn.t.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return False

    def peer_left(self) -> bool:
        """Whether the peer closed its end: a ticket sent now would reach no one.

        Its reader thread cancels its requests when it sees the close, but a server
        freed first (by a session that client ended just before) would otherwise be
        matched with its request, and sit out the unused ticket's whole match timeout.
        """
        if self.closed:
            return True
        try:
            poller = select.poll()
            poller.register(self.conn.t.sock.fileno(), _PEER_CLOSED)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # its socket is closed already
            return True

    def close(self) -> None:
        with self.lock:
            self.closed = True
            try:
                self.conn.close()
            except OSError:
                pass


class _ServerEntry:
    __slots__ = ("sid", "key", "addr", "link", "ticket", "matched_at", "started", "free_since")

    def __init__(self, sid: int, key: str, addr: tuple, link: _Link) -> None:
        self.sid = sid
        self.key = key
        self.addr = addr
        self.link = link
        self.ticket: str | None = None
        self.matched_at = 0.0
        self.started = False
        self.free_since = time.monotonic()


class _Waiting:
    __slots__ = ("link", "key", "priority", "seq")

    def __init__(self, link: _Link, key: str, priority: int, seq: int) -> None:
        self.link = link
        self.key = key
        self.priority = priority
        self.seq = seq


class TrackerState:
    """Servers, tickets and waiting requests, under one lock.

    Parameters
    ----------
    match_timeout : float
        Seconds a client has to reach the server it was given.
    max_summary_bytes : int
        The frame limit :meth:`summary` fits in.
    """

    def __init__(self, match_timeout: float = 10.0, max_summary_bytes: int = TRACKER_MAX_MESSAGE_BYTES) -> None:  # fmt: skip
        self.lock = threading.Lock()
        self.servers: dict[int, _ServerEntry] = {}
        self.by_key: dict[str, dict[int, _ServerEntry]] = {}
        self.by_ticket: dict[str, _ServerEntry] = {}
        self.queues: dict[str, list] = {}
        self.seq = itertools.count()
        self.next_sid = itertools.count(1)
        self.match_timeout = match_timeout
        self.max_summary_bytes = int(max_summary_bytes)
        #: TVM-protocol servers and requests (``tvm_protocol=True``), listed by summary() too
        self.tvm: TVMWorld | None = None
        #: keys that had servers, latest last: summary() keeps listing a key whose servers
        #: all left (free 0), as TVM's does, for the last SUMMARY_MAX_KEYS keys of each world
        self.seen_keys: dict[str, None] = {}

    # all methods below run with self.lock held
    def put(self, link: _Link, key: str, addr: tuple, busy: str | None = None) -> int:
        """Register a server; ``busy``: the ticket of the session it is serving (it registers
        again after a tracker restart in the middle of a session). The caller answers the
        registration, then calls :meth:`match`: a server of an earlier release took a
        ticket that came before that answer for a refusal, and exited."""
        sid = next(self.next_sid)
        remember_key(self.seen_keys, key, SUMMARY_MAX_KEYS)
        e = self.servers[sid] = _ServerEntry(sid, key, addr, link)
        self.by_key.setdefault(key, {})[sid] = e
        if busy and busy not in self.by_ticket:
            e.ticket, e.started = busy, True
            self.by_ticket[busy] = e
        logger.info("server %d registered: key %r at %s:%s%s", sid, key, *addr, " (busy)" if busy else "")  # fmt: skip
        return sid

    def remove(self, sid: int, reason: str) -> None:
        e = self.servers.pop(sid, None)
        if e is None:
            return
        pool = self.by_key.get(e.key)
        if pool is not None:
            pool.pop(sid, None)
            if not pool:
                del self.by_key[e.key]
        if e.ticket is not None:
            self.by_ticket.pop(e.ticket, None)
        logger.info("server %d (key %r) removed: %s", sid, e.key, reason)

    def request(self, link: _Link, key: str, priority: int) -> _Waiting:
        """Queue a request of ``link`` for a server of ``key`` (ValueError beyond the link's cap)."""  # fmt: skip
        if len(link.waiting) >= MAX_REQUESTS_PER_LINK:
            raise DiscoValueError(
                f"this connection has {len(link.waiting)} requests waiting already, "
                f"the most one connection may have"
            )
        w = _Waiting(link, key, priority, next(self.seq))
        link.waiting.add(w)
        heapq.heappush(self.queues.setdefault(key, []), (-priority, w.seq, w))
        self._match(key)
        return w

    def release(self, ticket: str, why: str) -> None:
        e = self.by_ticket.pop(ticket, None)
        if e is None or e.ticket != ticket:
            return
        e.ticket = None
        e.started = False
        e.free_since = time.monotonic()
        logger.info("server %d (key %r) is free again (%s)", e.sid, e.key, why)
        self._match(e.key)

    def start(self, ticket: str) -> None:
        e = self.by_ticket.get(ticket)
        if e is not None:
            e.started = True

    def cancel(self, link: _Link) -> None:
        """Take every request of ``link`` out of the queues now (it closed or was cancelled)."""
        keys = {w.key for w in link.waiting}
        link.waiting.clear()
        for key in keys:
            q = self.queues.get(key)
            if q is None:
                continue
            q[:] = [item for item in q if item[2].link is not link]
            if q:
                heapq.heapify(q)
            else:
                del self.queues[key]

    def expire(self) -> None:
        now = time.monotonic()
        for e in list(self.servers.values()):
            if e.ticket is not None and not e.started and now - e.matched_at > self.match_timeout:
                t = e.ticket
                e.link.send(REQUEST, T_REVOKE, t)
                self.release(t, "its ticket was not used in time")

    def match(self, key: str) -> None:
        """Give the free servers of ``key`` to the requests waiting for one."""
        self._match(key)

    def _match(self, key: str) -> None:
        q = self.queues.get(key)
        while q:
            _p, _s, w = q[0]
            if w.link.peer_left():  # its reader is about to cancel it
                heapq.heappop(q)
                w.link.waiting.discard(w)
                continue
            pool = self.by_key.get(key)
            free = [e for e in pool.values() if e.ticket is None] if pool else []
            if not free:
                return
            e = min(free, key=lambda s: s.free_since)
            heapq.heappop(q)
            w.link.waiting.discard(w)
            ticket = secrets.token_hex(16)
            # The server hears of the ticket before the client does.
            if not e.link.send(REQUEST, T_ASSIGN, ticket):
                self.remove(e.sid, "its registration link broke")
                heapq.heappush(q, (-w.priority, w.seq, w))
                w.link.waiting.add(w)
                continue
            e.ticket = ticket
            e.matched_at = time.monotonic()
            e.started = False
            self.by_ticket[ticket] = e
            if not w.link.send(REPLY, T_REQUEST, (e.addr[0], e.addr[1], ticket)):
                self.release(ticket, "the client left before its match")
                e.link.send(REQUEST, T_REVOKE, ticket)
        if q is not None and not q:
            self.queues.pop(key, None)

    def summary(self, max_bytes: int | None = None, *, ours: bool = True) -> dict:
        """TVM's summary: ``server_info`` (``"key": "server:<key>"``) and ``queue_info`` per key.

        Servers of both protocols are listed (TVM's marked ``"protocol": "tvm"``)
        and counted per key; a key with servers or requests of both worlds also has
        TVM's world's counts in its entry's ``"tvm"`` (so that this project's clients
        can tell what they may get).
        ``ours=False`` leaves this project's servers out: what a TVM peer, who proves
        nothing, is shown (it can use none of them anyway). It always fits in one frame of ``max_bytes`` (default:
        ``max_summary_bytes``): it lists at most :data:`SUMMARY_MAX_SERVERS` servers and
        :data:`SUMMARY_MAX_KEYS` keys, fewer if their bytes need it, and then says
        so in ``"truncated": {"server_info": [listed, total], "queue_info": [listed, total]}``
        (absent when everything is listed).
        """
        budget = (self.max_summary_bytes if max_bytes is None else int(max_bytes)) - _SUMMARY_SLACK  # fmt: skip
        counts: dict[str, dict] = {}
        for e in self.servers.values() if ours else ():
            qi = counts.setdefault(e.key, {"free": 0, "pending": 0, "total": 0})
            qi["total"] += 1
            qi["free"] += e.ticket is None
        for key, q in self.queues.items() if ours else ():
            n = sum(1 for _p, _s, w in q if not w.link.closed)
            counts.setdefault(key, {"free": 0, "pending": 0, "total": 0})["pending"] = n
        servers = [
            {
                "addr": [e.addr[0], e.addr[1]],
                "key": f"server:{e.key}",
                "free": e.ticket is None,
                "in_session": e.started,
            }
            for e in (self.servers.values() if ours else ())
        ]
        if self.tvm is not None:
            servers += self.tvm.server_info()
            tvm_counts: dict[str, dict] = {}
            self.tvm.add_counts(tvm_counts)
            for key, tc in tvm_counts.items():
                mixed = key in counts  # servers or requests of this project's world too
                qi = counts.setdefault(key, {"free": 0, "pending": 0, "total": 0})
                for field in ("free", "pending", "total"):
                    qi[field] += tc[field]
                if mixed:
                    qi["tvm"] = tc
        seen_tvm = self.tvm.seen if self.tvm is not None else ()
        for key in itertools.chain(self.seen_keys if ours else (), seen_tvm):
            counts.setdefault(key, {"free": 0, "pending": 0, "total": 0})
        ns = min(len(servers), SUMMARY_MAX_SERVERS)
        nk = min(len(counts), SUMMARY_MAX_KEYS)
        while True:
            out: dict[str, Any] = {
                "server_info": servers[:ns],
                "queue_info": dict(itertools.islice(counts.items(), nk)),
            }
            if ns < len(servers) or nk < len(counts):
                out["truncated"] = {
                    "server_info": [ns, len(servers)],
                    "queue_info": [nk, len(counts)],
                }
            if (ns == 0 and nk == 0) or wire.frame_size(*wire.encode(out)) <= budget:
                return out
            ns, nk = ns // 2, nk // 2


# --------------------------------------------------------------------------- serving
def _tune_link(sock: socket.socket) -> None:
    """Keepalive (a peer that vanished is noticed) and a bound on blocking sends."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        sec = int(_SEND_TIMEOUT)
        usec = int((_SEND_TIMEOUT - sec) * 1e6)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))
    except OSError:
        pass


def _serve_link(link: _Link, state: TrackerState) -> None:
    """One authenticated link's requests, until it closes (a thread of its own)."""
    conn = link.conn
    addr = link.addr
    sid = None
    try:
        while True:
            try:
                _k, op, value = conn.recv()
            except wire.ProtocolError as exc:
                if isinstance(exc, wire.DesyncError):
                    return
                link.send(ERROR, 0, ("ProtocolError", str(exc), ""))
                continue
            try:
                if op == T_PUT:
                    if link.role != REGISTRANT_KEY:
                        raise DiscoValueError("only a registration link (a server's or a proxy's) may register a server")  # fmt: skip
                    if sid is not None:
                        raise DiscoValueError("this link has registered a server already (one per link)")  # fmt: skip
                    key = _check_key(value[0])
                    host = _check_host(value[1])
                    port = int(value[2])
                    if not 0 < port < 65536:
                        raise DiscoValueError(f"port {port} is not a TCP port")
                    busy = value[3] if len(value) > 3 and value[3] else None
                    if busy is not None and (not isinstance(busy, str) or len(busy) > _MAX_TICKET_CHARS):  # fmt: skip
                        raise DiscoValueError("the busy ticket is not a ticket this tracker hands out")  # fmt: skip
                    if host in ("", "0.0.0.0", "::"):
                        host = addr[0]
                    with state.lock:
                        sid = state.put(link, key, (host, port), busy)
                        link.send(REPLY, T_PUT, sid)  # first: then the tickets
                        state.match(key)
                elif op in (T_START, T_END):
                    ticket = str(value)
                    with state.lock:
                        e = state.by_ticket.get(ticket)
                        if e is not None and e.sid == sid:  # only the server's own link
                            if op == T_START:
                                state.start(ticket)
                            else:
                                state.release(ticket, "its session ended")
                elif op == T_REQUEST:
                    key, priority = _check_key(value[0]), int(value[1])
                    with state.lock:
                        state.request(link, key, priority)
                elif op == T_FAIL:
                    ticket = str(value)
                    with state.lock:
                        e = state.by_ticket.get(ticket)
                        if e is not None and not e.started:
                            # the client could not reach it: free it; if its link is
                            # dead too, the link's reader removes it
                            e.link.send(REQUEST, T_REVOKE, ticket)
                            state.release(ticket, "the client could not reach it")
                elif op == T_SUMMARY:
                    with state.lock:
                        s = state.summary()
                    link.send(REPLY, T_SUMMARY, s)
                elif op == T_PING:
                    link.send(REPLY, T_PING, None)
                else:
                    raise DiscoValueError(f"unexpected tracker operation {op}")
            except Exception as exc:  # a malformed request: answer it, keep serving
                link.send(ERROR, op, (type(exc).__name__, f"bad tracker request: {exc}", ""))
    except (OSError, EOFError, wire.ProtocolError) as exc:
        logger.debug("link from %s ended: %s", addr, exc)
    finally:
        with state.lock:
            link.closed = True
            state.cancel(link)
            if sid is not None:
                state.remove(sid, "its registration link closed")
        link.close()


def _transport(sock: socket.socket) -> Any:
    return wire.SSLTransport(sock) if isinstance(sock, ssl.SSLSocket) else wire.SocketTransport(sock)  # fmt: skip


def serve_tracker(listen_sock: socket.socket, token: bytes | None = None, ssl_context: Any = None, max_message_bytes: int = TRACKER_MAX_MESSAGE_BYTES, match_timeout: float = 10.0, watch_fd: int | None = None, *, max_links: int = MAX_LINKS, max_pending: int = MAX_PENDING, handshake_timeout: float = HANDSHAKE_TIMEOUT, tvm_protocol: bool = False, max_tvm_links: int = MAX_TVM_LINKS) -> None:  # fmt: skip
    """Serve the tracker on ``listen_sock`` until SIGTERM or ``watch_fd`` closes.

    One thread accepts connections and runs their handshakes
    (:class:`disco_core.net.accept.AcceptLoop`: at most ``max_pending`` at once,
    ``handshake_timeout`` seconds each, no thread for them); each authenticated
    link then gets a thread, up to ``max_links`` (beyond, it is told so and closed).
    With ``tvm_protocol``, a connection that starts with TVM's tracker magic is
    served by ``disco_rpc.tvm_tracker`` instead (a thread too, up to ``max_tvm_links``,
    a cap of their own: unauthenticated peers cannot crowd out authenticated links).
    """
    state = TrackerState(match_timeout, min(int(max_message_bytes), TRACKER_MAX_MESSAGE_BYTES))
    slots = Slots(max_links)
    roles = (REGISTRANT_KEY.encode(), CLIENT_KEY.encode())
    if tvm_protocol:
        state.tvm = TVMWorld(state.lock, MAX_KEY_BYTES, MAX_HOST_BYTES)
        tvm_slots = Slots(max_tvm_links)

    def make_ours(sock: socket.socket, addr: Any) -> SocketHandshake:
        machine = auth.ServerHandshake("", token, key_check=lambda kb: kb in roles)
        return SocketHandshake(sock, addr, machine, ssl_context)

    def make_handshake(sock: socket.socket, addr: Any) -> Any:
        return SniffHandshake(sock, addr, make_ours) if tvm_protocol else make_ours(sock, addr)

    def on_ready(hs: Any) -> None:
        if getattr(hs, "tvm", False):
            sock = hs.detach(None)
            _tune_link(sock)
            # a TVM peer proves nothing: it is shown TVM's world only
            tvm_summary = functools.partial(state.summary, ours=False)
            if not tvm_slots.start_thread(serve_tvm_link, sock, hs.addr, state.tvm, tvm_summary, name="tracker-tvm-link"):  # fmt: skip
                logger.warning("refused a TVM link from %s: %d TVM links already", hs.addr, tvm_slots.limit)  # fmt: skip
                loop.adopt(Drain(sock, hs.addr), timeout=2.0)
            return
        sock = hs.detach(None)
        _tune_link(sock)
        conn = wire.Conn(_transport(sock), max_message_bytes)
        auth.seal(conn, hs.machine.keys)  # with a token, every later byte is sealed
        link = _Link(conn, hs.addr, hs.machine.peer_key)
        if not slots.start_thread(_serve_link, link, state, name="tracker-link"):
            logger.warning("refused a link from %s: %d links already", hs.addr, slots.limit)
            link.send(ERROR, 0, ("RPCError", f"the tracker serves at most {slots.limit} connections at once; try again later", ""))  # fmt: skip
            loop.adopt(Drain(sock, hs.addr), timeout=2.0)

    stop = threading.Event()

    def expire_loop() -> None:
        # a thread of its own: it takes the state's lock, which the accept loop never waits for
        while not stop.wait(0.25):
            with state.lock:
                state.expire()

    threading.Thread(target=expire_loop, daemon=True, name="tracker-expire").start()
    loop = AcceptLoop(
        listen_sock, make_handshake, on_ready,
        max_pending=max_pending, handshake_timeout=handshake_timeout,
        watch_fd=watch_fd, name="tracker",
    )  # fmt: skip
    try:
        loop.run()
    finally:
        stop.set()


class Tracker(ServiceProcess):
    """Start a tracker in a separate process, as ``tvm.rpc.tracker.Tracker``.

    Parameters
    ----------
    host : str
        The address to bind (``127.0.0.1`` by default; another address needs a
        token or TLS that requires client certificates unless ``allow_insecure_bind``).
    port, port_end : int
        The first free port in ``[port, port_end)`` is used (``tracker.port``).
    silent : bool
        Log only errors.
    reuse_addr : bool
        Set ``SO_REUSEADDR`` on the listening socket.
    timeout : float, optional
        As TVM's: a timeout on the tracker's socket operations; here the time a
        connecting peer has for its handshake, capped at the 10 s kept on work
        before authentication.
    token : str or bytes, optional
        The shared secret every server, proxy and client must prove (default
        ``$DISCO_TRACKER_TOKEN``, else ``$DISCO_TOKEN``). A tracker that holds the
        servers' own token could open sessions on them: give it a token of its own.
    ssl_context : ssl.SSLContext, optional
        Speak TLS (a server-side context).
    match_timeout : float
        Seconds a client has to reach the server it was given; then the server
        goes back into the pool.
    tvm_protocol : bool
        Also speak TVM's tracker protocol on the same port, for TVM's own servers
        and clients (``disco_rpc.tvm_tracker``). That protocol has no
        authentication, so on a non-loopback ``host`` it needs
        ``allow_insecure_bind`` even with a token or TLS.
    """

    _kind = "Tracker"

    def __init__(self, host: str = "127.0.0.1", port: int = 9190, port_end: int = 9199, silent: bool = False, reuse_addr: bool = True, timeout: float | None = None, *, token: Any = None, ssl_context: Any = None, max_message_bytes: int = TRACKER_MAX_MESSAGE_BYTES, match_timeout: float = 10.0, allow_insecure_bind: bool = False, tvm_protocol: bool = False) -> None:  # fmt: skip
        hs_timeout = handshake_timeout(timeout)
        token_b = auth.resolve_token(token if token is not None else auth.tracker_token_or(None))
        check_bind(host, token_b, ssl_context, allow_insecure_bind, what="RPC tracker")
        auth.stretch_now(token_b)  # here, not in the first client's handshake
        if tvm_protocol:
            # TVM's peers prove nothing: as open as a tracker with neither token nor TLS
            # (on loopback it warns so too: a mutual-TLS tracker no longer did, while
            # any local user was served over TVM's protocol; an outside check)
            try:
                check_bind(host, None, None, allow_insecure_bind, what="RPC tracker's TVM protocol")  # fmt: skip
            except InsecureBindError as exc:
                raise InsecureBindError(
                    f"refusing to listen on {host or 'every interface'} for the RPC tracker's "
                    "TVM protocol: TVM's peers prove nothing (no token, no certificate), so "
                    "neither a token nor TLS can guard it; listen on loopback, or pass "
                    "allow_insecure_bind=True (--allow-insecure-bind) on a trusted network"
                ) from exc
        if silent:
            logger.setLevel(logging.ERROR)
        self.host = host
        sock = bind_listener(host, port, port_end, reuse_addr)
        self.port = sock.getsockname()[1]

        def serve(watch_fd: int) -> None:
            signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
            serve_tracker(sock, token_b, ssl_context, max_message_bytes, match_timeout, watch_fd, handshake_timeout=hs_timeout, tvm_protocol=tvm_protocol)  # fmt: skip

        try:
            self._fork(serve)
        finally:
            sock.close()


# --------------------------------------------------------------------------- links to a tracker


# --------------------------------------------------------------------------- the client side
class TrackerSession:
    """A client's connection to a tracker (``rpc.connect_tracker``), as TVM's."""

    def __init__(self, addr: tuple, *, token: Any = None, ssl_context: Any = None, server_token: Any = None, server_ssl_context: Any = None, connect_timeout: float = HANDSHAKE_TIMEOUT) -> None:  # fmt: skip
        # connect_timeout: the longest connect and handshake (a frozen tracker accepts
        # into its backlog, then says nothing); the CLI's --wait-timeout bounds it too
        self._connect_timeout = float(connect_timeout)
        self._addr = (addr[0], int(addr[1]))
        self._token = token if token is not None else auth.tracker_token_or(None)
        self._ssl = ssl_context
        self._server_token = server_token if server_token is not None else token
        self._server_ssl = server_ssl_context
        self._lock = threading.Lock()
        self._conn: wire.Conn | None = None
        self._connect()

    def _connect(self) -> None:
        self._conn = open_tracker_link(self._addr, CLIENT_KEY, self._token, self._ssl, self._connect_timeout)  # fmt: skip

    def _call(self, op: int, value: Any, timeout: float | None = None) -> Any:
        """One request and its reply; ``timeout`` bounds the wait (``TimeoutError``).

        Without ``timeout`` the wait is bounded all the same: a reply the tracker gives
        at once must come within :data:`REPLY_TIMEOUT`, and the wait for a server
        (``T_REQUEST``) lasts as long as the tracker answers a ping after every
        :data:`ALIVE_EVERY` seconds of silence; else an :class:`RPCError` says so.
        """
        with self._lock:
            if self._conn is None:
                self._connect()
            conn: wire.Conn = self._conn  # type: ignore[assignment]  # _connect() set it
            try:
                conn.send(REQUEST, op, value)
                kind, _op, result = self._reply(conn, op, timeout)
            except BaseException as exc:
                # Interrupted, timed out or broken: a reply may still be on its way,
                # so this connection is out of sync. Dropping it also makes the
                # tracker cancel the request it queued for this client.
                self._drop()
                if isinstance(exc, TimeoutError) and timeout is not None:
                    raise
                if isinstance(exc, (OSError, EOFError, wire.ProtocolError)):
                    raise RPCError(
                        f"lost the connection to the tracker at {self._addr[0]}:{self._addr[1]}: {exc}"  # fmt: skip
                    ) from exc
                raise
        if kind == ERROR:
            raise RPCError(f"the tracker refused: {result[0]}: {result[1]}")
        return result

    def _reply(self, conn: wire.Conn, op: int, timeout: float | None) -> tuple:
        """The tracker's reply to ``op``, its answers to this method's pings skipped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        quiet = ALIVE_EVERY if op == T_REQUEST else REPLY_TIMEOUT
        since, pinged = time.monotonic(), False
        silent_since = since  # when the tracker last said anything, once a ping is out
        while True:
            until = since + quiet if deadline is None else min(since + quiet, deadline)
            if not _frame_ready(conn, until - time.monotonic()):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise DiscoTimeoutError("no reply from the tracker in time")
                if now - since < quiet:
                    continue
                if op == T_REQUEST and not pinged:  # a long wait: is the tracker still there?
                    conn.send(REQUEST, T_PING, None)
                    silent_since = since
                    since, pinged, quiet = now, True, REPLY_TIMEOUT
                    continue
                what = (
                    f"{now - silent_since:.0f} s (nothing for {ALIVE_EVERY:g} s, then no answer "
                    f"to a ping for {REPLY_TIMEOUT:g} s)"
                    if pinged
                    else f"{quiet:g} s"
                )
                raise RPCError(
                    f"the tracker at {self._addr[0]}:{self._addr[1]} did not answer for "
                    f"{what} (stopped, overloaded or cut off); gave up waiting"
                )
            conn.t.settimeout(REPLY_TIMEOUT)  # a frame that began must end
            try:
                kind, rop, result = conn.recv()
            except TimeoutError:
                raise RPCError(
                    f"the tracker at {self._addr[0]}:{self._addr[1]} stopped in the middle of "
                    f"a reply ({REPLY_TIMEOUT:g} s without a byte)"
                ) from None
            finally:
                conn.t.settimeout(None)
            if kind == REPLY and rop == T_PING and op != T_PING:
                since, pinged, quiet = time.monotonic(), False, ALIVE_EVERY
                continue
            return kind, rop, result

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None

    def close(self) -> None:
        """Close the connection to the tracker (sessions already obtained stay open)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> TrackerSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._drop()
        except Exception:
            pass

    def summary(self) -> dict:
        """``{"server_info": [...], "queue_info": {key: {"free", "pending", "total"}}}``.

        ``server_info`` entries are ``{"addr": [host, port], "key": "server:<key>",
        "free": bool, "in_session": bool}`` (a TVM-protocol server's:
        ``{"addr", "key", "free", "protocol": "tvm"}``). When the tracker has more than fits in
        one reply, some are left out and ``"truncated"`` says
        ``{"server_info": [listed, total], "queue_info": [listed, total]}``.
        """
        return self._call(T_SUMMARY, None)

    def text_summary(self) -> str:
        """The summary as TVM's ``text_summary`` prints it (``disco-rpc query`` prints it too)."""
        return format_summary(self.summary())

    def request(self, key: str, priority: int = 1, session_timeout: float = 0, max_retry: int = 5, session_constructor_args: list | None = None, *, wait_timeout: float | None = None, **connect_args: Any):  # fmt: skip
        """Wait for a free server with ``key``; return a session with it.

        Parameters
        ----------
        key : str
            The kind of server (its ``key`` at registration).
        priority : int
            Higher is served first, then first come.
        session_timeout : float
            Passed to :func:`disco_rpc.connect`. The server goes back into the pool
            when the session ends (closed, crashed client, timed out).
        max_retry : int
            Servers tried when one cannot be reached.
        session_constructor_args : list, optional
            Passed to :func:`disco_rpc.connect`.
        wait_timeout : float, optional
            The longest wait for a free server, in seconds (default: forever); then
            :class:`~disco_rpc.errors.RPCRequestTimeoutError` (a ``TimeoutError``)
            names how many servers of ``key`` the tracker has. The request is
            cancelled at the tracker, as it is when the wait is interrupted.
        **connect_args
            Passed to :func:`disco_rpc.connect` (``token``, ``ssl_context``...).
        """
        connect_args.setdefault("token", self._server_token)
        if self._server_ssl is not None:
            connect_args.setdefault("ssl_context", self._server_ssl)
        check_connect_args(session_timeout, **connect_args)  # before a server is held for it
        deadline = None if wait_timeout is None else time.monotonic() + float(wait_timeout)
        # the last failure as text, logged as text: the exception refers to this frame and
        # its callers' (their sessions) through its traceback, so keeping it (here, or in a
        # log record a handler keeps) kept those sessions, and their servers, busy
        last = ""
        for _ in range(max(1, int(max_retry))):
            host, port, ticket = self._wait_for_server(key, priority, deadline, wait_timeout)
            try:
                return connect(
                    host,
                    port,
                    ticket_key(key, ticket),
                    session_timeout,
                    session_constructor_args,
                    **connect_args,
                )
            except RPCError as exc:
                last = str(exc)
                logger.warning(
                    "server %s:%s for key %r failed: %s; retrying", host, port, key, last
                )
                try:
                    self._call_noreply(T_FAIL, ticket)
                except RPCError:
                    pass
        raise RPCError(f"cannot get a session for key {key!r} after {max_retry} tries: {last}")

    def _wait_for_server(self, key: str, priority: int, deadline: float | None, wait: Any) -> tuple:  # fmt: skip
        left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        try:
            ticket = self._call(T_REQUEST, (key, int(priority)), timeout=left)
        except TimeoutError:
            raise RPCRequestTimeoutError(
                f"no server for key {key!r} became free within {float(wait):g} s "
                f"({self.pool_text(key)})"
            ) from None
        # (host, port, ticket) from the tracker: checked, since a fake tracker's answer
        # raised raw ValueErrors and TypeErrors in the client (an attacker check)
        if (
            type(ticket) is not tuple
            or len(ticket) != 3
            or type(ticket[0]) is not str
            or not ticket[0]
            or type(ticket[1]) is not int
            or not 0 < ticket[1] < 65536
            or type(ticket[2]) is not str
        ):
            raise RPCError(
                f"the tracker at {self._addr[0]}:{self._addr[1]} answered a request for key "
                f"{key!r} with no (host, port, ticket): {reprlib.repr(ticket)}"
            )
        return ticket

    def pool_text(self, key: str) -> str:
        """How many servers of ``key`` the tracker has, in words (for error messages)."""
        try:  # (for an error message: bounded, a frozen tracker's 30 s is too long here)
            summary = self._call(T_SUMMARY, None, timeout=POOL_TEXT_TIMEOUT)
        except (RPCError, TimeoutError) as exc:
            return f"the tracker could not be asked: {exc}"
        q = summary["queue_info"].get(key)
        # TVM's servers (a TVM-mode tracker) are of no use to this client: leave them out
        if q and "tvm" in q:
            q = {f: q[f] - q["tvm"][f] for f in ("free", "pending", "total")}
        elif q and "truncated" not in summary:
            mine = [s for s in summary["server_info"] if s.get("key") == f"server:{key}"]
            if mine and all(s.get("protocol") == "tvm" for s in mine):
                q = None
        if not q or not q["total"]:
            return f"the tracker has no server registered for key {key!r}"
        return (
            f"the tracker has {q['total']} server(s) for key {key!r}: {q['free']} free, "
            f"{q['pending']} request(s) waiting"
        )

    def _call_noreply(self, op: int, value: Any) -> None:
        with self._lock:
            if self._conn is None:
                self._connect()
            self._conn.send(REQUEST, op, value)  # type: ignore[union-attr]  # _connect() set it

    def request_and_run(self, key: str, func: Any, priority: int = 1, session_timeout: float = 0, max_retry: int = 2, **connect_args: Any) -> Any:  # fmt: skip
        """Request a session and run ``func(session)``; retry on a server that drops."""
        last = ""  # text, not the exception: see request()
        for _ in range(max(1, int(max_retry))):
            sess = self.request(key, priority, session_timeout, **connect_args)
            try:
                return func(sess)
            except RPCSessionTimeoutError:
                raise
            except RPCError as exc:
                if not sess.closed:
                    raise  # the function failed remotely: not the server's fault
                last = str(exc)
                logger.warning("session for key %r dropped: %s; retrying", key, last)
            finally:
                sess.close()
        raise RPCError(f"request_and_run for key {key!r} failed {max_retry} times: {last}")

    def __repr__(self) -> str:
        return f"<TrackerSession {self._addr[0]}:{self._addr[1]}>"


def _frame_ready(conn: wire.Conn, timeout: float) -> bool:
    """Whether ``conn`` has bytes to read, waiting up to ``timeout`` seconds.

    Bytes already taken from the socket count (the connection's buffer, a sealed
    record's verified bytes or the rest of a large one, TLS's decrypted bytes):
    ``select`` cannot see them.
    """
    t = conn.t
    if conn.buffered() or getattr(t, "pending", 0) or getattr(t, "record_left", 0):
        return True
    sock = t.sock
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()  # not select(): a process may hold more than 1024 descriptors
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def format_summary(s: dict) -> str:
    """A summary as TVM's ``TrackerSession.text_summary`` prints it (same text, same layout).

    It reads TVM's layout only (``server_info`` entries' ``addr`` and ``key``,
    ``queue_info``'s ``free`` and ``pending``), so a summary from TVM's own tracker
    prints too. A key's total is ``queue_info``'s ``total`` when given (it counts
    servers a truncated list leaves out), else counted from ``server_info`` as TVM
    does. A truncated summary ends with a line that says so.
    """
    total_ct: dict[str, int] = {}
    res = "Server List\n"
    res += "------------------------------\n"
    res += "server-address           key\n"
    res += "------------------------------\n"
    for item in sorted(s.get("server_info", []), key=lambda x: x["key"]):
        res += f"{':'.join(map(str, item['addr'])):21s}    " + item["key"] + "\n"
        key = item["key"].split(":", 1)[-1]  # 'server:rasp3b' -> 'rasp3b'
        total_ct[key] = total_ct.get(key, 0) + 1
    res += "------------------------------\n"
    res += "\n"
    queue_info = s.get("queue_info", {})
    keys = sorted(queue_info)
    max_key_len = max((len(k) for k in keys), default=0)
    res += "Queue Status\n"
    title = f"{'key':<{max_key_len}s}   total  free  pending\n"
    separate_line = "-" * len(title) + "\n"
    res += separate_line + title + separate_line
    for k in keys:
        q = queue_info[k]
        total = q.get("total", total_ct.get(k, 0))
        free, pending = q["free"], q["pending"]
        if total or pending:
            res += f"{k:<{max_key_len}}   {total:<5d}  {free:<4d}  {pending:<7d}\n"
    res += separate_line
    cut = s.get("truncated")
    if cut:
        servers, keys_cut = cut.get("server_info", (0, 0)), cut.get("queue_info", (0, 0))
        res += f"(truncated: {servers[0]} of {servers[1]} servers and {keys_cut[0]} of {keys_cut[1]} keys listed)\n"  # fmt: skip
    return res


def connect_tracker(url: str, port: int, *, token: Any = None, ssl_context: Any = None, server_token: Any = None, server_ssl_context: Any = None) -> TrackerSession:  # fmt: skip
    """Connect to a tracker, as ``tvm.rpc.connect_tracker``.

    ``token``/``ssl_context`` authenticate to the tracker (``token`` by default
    ``$DISCO_TRACKER_TOKEN``, else ``$DISCO_TOKEN``); the sessions it hands out use
    ``server_token``/``server_ssl_context`` (by default the ``token`` given here, else
    ``$DISCO_TOKEN``).
    """
    return TrackerSession(
        (url, port),
        token=token,
        ssl_context=ssl_context,
        server_token=server_token,
        server_ssl_context=server_ssl_context,
    )
