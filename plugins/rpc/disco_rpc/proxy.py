"""The RPC proxy: servers behind NAT connect out to it; clients reach them through it by key.

A server started with ``Server(host=proxy_host, port=proxy_port, is_proxy=True,
key=...)`` keeps one authenticated connection open to the proxy (the proxy's
token, optional TLS) and waits. A client connects to the proxy exactly as to a
server (``rpc.connect(proxy_host, proxy_port, key=...)``): the proxy reads the
client's hello (fixed-size fields and a key of at most 4 KiB), picks an idle
server registered under that key, tells it a client arrived, forwards the hello
and then relays bytes both ways. A client with no idle server of its key is held,
as TVM's proxy holds it, until one registers or comes back from a session, for
up to ``timeout_client`` seconds. Authentication between client and server stays
end to end (the server's token), and so does the seal on every later frame: the
proxy never decodes a client's frames and cannot alter them, and a fake backend
that relays a real client's handshake gains nothing. The server runs each paired
client's handshake in its own process, registering a new idle link meanwhile, and
forks a session only for a client that proved the token; one session at a time.

With ``tracker_addr``, the proxy registers each server behind it with the
tracker under the proxy's address: a tracker's client is sent to the proxy with
a ticket, the proxy checks the ticket and reports the session's start and end,
so the server returns to the pool as with a direct registration.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import ssl
import threading
import time
from typing import Any

from disco_core import DiscoValueError
from disco_core.spi import AcceptLoop, Slots, SocketHandshake, relay

from . import auth, wire
from .errors import RPCError
from .protocol import (  # noqa: F401 (the proxy's codes, also names of this module)
    HELD_NOTICE_EVERY,
    P_ACK,
    P_PAIRED,
    P_REGISTER,
    PROXY_MAX_MESSAGE_BYTES,
    PROXY_SERVER_KEY,
    REPLY,
    REQUEST,
    T_END,
    T_START,
    TICKET_SEP,
)
from .server import (  # noqa: F401 (the server side of the proxy, once in this module)
    MAX_PROXIED_HANDSHAKES,
    register_with_proxy,
    serve_via_proxy,
)
from .service import Registration, ServiceProcess, bind_listener, check_bind

__all__ = ["Proxy", "serve_proxy", "serve_via_proxy"]

logger = logging.getLogger("disco_rpc.proxy")

#: Seconds a client is held for an idle server with its key (TVM's ``timeout_client``).
DEFAULT_WAIT = 600.0
#: Clients held at once, at most: beyond, a client is refused at once, so that held
#: clients (anyone can send a hello with any key) never take every connection slot.
MAX_HELD = 512
#: Seconds a client with a tracker's ticket is held at most: the tracker revokes a ticket
#: not used within its ``match_timeout`` (10 s by default), so a longer wait cannot succeed.
TICKET_WAIT = 10.0
#: Seconds a server has to come back after a session before it leaves the tracker.
REJOIN_GRACE = 5.0
#: Connections the proxy serves at once after their hello (servers, waiting and paired clients).
MAX_CONNECTIONS = 1024
#: Connections whose first hello is not read yet, at most (the oldest is dropped to make room).
MAX_PENDING = 64
#: Seconds a connection has to send its hello (a server: to prove the proxy's token too).
HANDSHAKE_TIMEOUT = 10.0
#: Seconds a relayed send may wait for a peer that takes nothing (frozen, or its host
#: gone) before the pairing is ended: a relay thread is never held for ever.
RELAY_SEND_TIMEOUT = 60.0


class _Backend:
    """One server behind the proxy (stable across its reconnections)."""

    def __init__(self, server_id: str, key: str) -> None:
        self.server_id = server_id
        self.key = key
        self.conn: wire.Conn | None = None  # its idle connection, when idle
        self.sessions = 0  # links of this server relaying a client now
        self.reg: Registration | None = None
        self.gone_since: float | None = None
        self.ticket: str | None = None  # the tracker ticket of the session in progress


class _ProxyState:
    def __init__(self, host: str, port: int, tracker_addr: Any, tracker_token: Any, tracker_ssl: Any, max_held: int = MAX_HELD) -> None:  # fmt: skip
        self.cv = threading.Condition()
        self.backends: dict[str, _Backend] = {}
        self.held = 0  # clients waiting for a server now
        self.max_held = int(max_held)
        self.addr = (host, port)
        self.tracker_addr = tracker_addr
        self.tracker_token = tracker_token
        self.tracker_ssl = tracker_ssl

    def idle(self, key: str, ticket: str | None) -> _Backend | None:
        for b in self.backends.values():
            if b.conn is None or b.key != key:
                continue
            if ticket is not None:
                if b.reg is None:
                    continue
                b.reg.poll()
                if ticket not in b.reg.tickets:
                    continue
            elif b.reg is not None:
                continue  # a tracker-managed server serves ticket holders only
            return b
        return None

    def refusal(self, key: str, ticket: str | None) -> int | None:
        """The status that refuses a client at once (it cannot be paired by waiting), or None.

        A key with no server yet is not refused: the client is held until one registers
        (TVM's ``timeout_client``); only a ticketless client of tracker-managed servers is.
        """
        mine = [b for b in self.backends.values() if b.key == key]
        if ticket is None and mine and all(b.reg is not None for b in mine):
            return auth.TICKET_REQUIRED
        return None

    def timed_out(self, key: str, ticket: str | None) -> int:
        """The status of a client held for its whole wait."""
        if ticket is not None:
            return auth.KEY_MISMATCH  # no server of the key was told of this ticket
        if any(b.key == key for b in self.backends.values()):
            return auth.SERVERS_BUSY
        return auth.NO_SERVER


def _relay(a: Any, b: Any, a_buffered: bytes = b"", b_buffered: bytes = b"") -> None:
    """Copy bytes both ways between two sockets until either side closes, then close both.

    The proxy holds no session keys: what it relays is sealed (or not) end to end
    between the client and the server. Reads wait only after ``select`` said the
    peer sent something, so the sockets' timeout bounds the sends alone
    (:data:`RELAY_SEND_TIMEOUT`): a peer that stopped reading ends the pairing.
    """
    for s in (a, b):
        s.settimeout(RELAY_SEND_TIMEOUT)
    ends = [wire.SSLTransport(s) if isinstance(s, ssl.SSLSocket) else wire.SocketTransport(s) for s in (a, b)]  # fmt: skip
    try:
        relay(ends[0], ends[1], a_buffered, b_buffered)
    finally:
        for t in ends:
            t.close()


class _NeedBytes(Exception):
    """A hello is not complete yet: ``args[0]`` more bytes are needed."""


class _Replay:
    """The bytes read so far, as the ``read_exact`` that :func:`auth.read_hello` reads from."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def read_exact(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _NeedBytes(self.pos + n - len(self.data))
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


class _FirstHello:
    """What the proxy reads before it hands a connection on (an ``AcceptLoop`` step machine).

    A client's hello is read (:func:`auth.read_hello` decides its fields and
    bounds) and kept as it came (``raw``), to be forwarded to the server; a
    backend's (a server behind the proxy) is answered and its proof of the
    proxy's token checked (:class:`auth.ServerHandshake`). Either way this
    happens in the accept loop, without a thread, under its deadline.
    """

    def __init__(self, token: bytes | None) -> None:
        self.token = token
        self.raw = b""
        self.hello: tuple[int, bytes, bytes] | None = None
        self.backend = False
        self.ok = False
        self._server: auth.ServerHandshake | None = None
        self._left = b""
        self.want = self._parse()

    def _parse(self) -> int:
        """Bytes still needed for the hello (0 once it is read or refused)."""
        try:
            self.hello = auth.read_hello(_Replay(self.raw))
        except _NeedBytes as need:
            return int(need.args[0])
        return 0

    def step(self, data: bytes) -> bytes:
        if self._server is not None:
            return self._feed_server(data)
        self.raw += data
        self.want = self._parse()
        if self.want:
            return b""
        if self.hello is None:  # not a disco-rpc hello: dropped without an answer
            return b""
        if self.hello[1] == PROXY_SERVER_KEY.encode():
            self.backend = True
            self._server = auth.ServerHandshake(PROXY_SERVER_KEY, self.token)
            return self._feed_server(self.raw)
        self.ok = True
        return b""

    def _feed_server(self, data: bytes) -> bytes:
        hs: auth.ServerHandshake = self._server  # type: ignore[assignment]  # set before it is fed
        self._left += data
        out = b""
        while hs.want and len(self._left) >= hs.want:
            chunk, self._left = self._left[: hs.want], self._left[hs.want :]
            out += hs.step(chunk)
        self.want = hs.want - len(self._left) if hs.want else 0
        self.ok = bool(hs.ok) and not self.want
        return out


def _transport(sock: Any) -> Any:
    return wire.SSLTransport(sock) if isinstance(sock, ssl.SSLSocket) else wire.SocketTransport(sock)  # fmt: skip


def _handle(sock: socket.socket, addr: Any, state: _ProxyState, first: _FirstHello, wait: float) -> None:  # fmt: skip
    """Serve a connection whose hello the accept loop has read (a thread of its own)."""
    try:
        conn = wire.Conn(_transport(sock), PROXY_MAX_MESSAGE_BYTES)
        if first.backend:
            if first._left:  # bytes past the handshake: no legitimate backend sends them
                raise wire.ProtocolError("a server sent data before its handshake ended")
            auth.seal(conn, first._server.keys)  # type: ignore[union-attr]  # the backend link, sealed under the proxy token
            _serve_backend(conn, sock, addr, state)
        else:
            _serve_client(conn, sock, addr, first.raw, first.hello[1], state, wait)  # type: ignore[index]  # a hello was read
    except (OSError, EOFError, wire.ProtocolError, ValueError) as exc:
        logger.debug("connection from %s ended: %s", addr, exc)
        try:
            sock.close()
        except OSError:
            pass


def _serve_backend(conn, sock, addr, state: _ProxyState) -> None:
    """A server behind the proxy, authenticated already: its registration, then its idle wait."""
    _k, op, value = conn.recv()
    if op != P_REGISTER:
        sock.close()
        return
    key, server_id = str(value[0]), str(value[1])
    with state.cv:
        b = state.backends.get(server_id)
        if b is None:
            b = state.backends[server_id] = _Backend(server_id, key)
        need_reg = state.tracker_addr is not None and b.reg is None
    reg = None
    if need_reg:  # outside the lock: talking to the tracker must not stop every pairing
        try:
            reg = Registration(
                state.tracker_addr, key, state.addr,
                token=state.tracker_token, ssl_context=state.tracker_ssl,
            )  # fmt: skip
            reg.busy = lambda b=b: b.ticket
        except (RPCError, OSError, EOFError, wire.ProtocolError) as exc:
            logger.warning("cannot register %r with the tracker: %s", key, exc)
    with state.cv:
        if reg is not None:
            if b.reg is None:
                b.reg = reg
            else:  # another link of this server registered it meanwhile
                reg.close()
        b.conn, b.gone_since = conn, None
        conn.send(REPLY, P_REGISTER, None)
        state.cv.notify_all()
    logger.info("server %s (key %r) is behind the proxy", server_id, key)
    sock.settimeout(None)
    while True:  # idle: watch for its death until a client takes it
        with state.cv:
            if b.conn is not conn:
                return  # a client's thread took it (or a newer link replaced it)
        r, _, _ = select.select([sock], [], [], 0.2)
        if r:
            with state.cv:
                if b.conn is not conn:
                    return
                b.conn = None
                b.gone_since = time.monotonic()
                state.cv.notify_all()
            logger.info("server %s (key %r) left the proxy", server_id, key)
            sock.close()
            return


def _serve_client(conn, sock, addr, hello_bytes: bytes, kb: bytes, state: _ProxyState, wait: float) -> None:  # fmt: skip
    text = kb.decode("utf-8", "replace")
    ticket: str | None
    key, sep, ticket = text.rpartition(TICKET_SEP)
    if not sep:
        key, ticket = text, None
    deadline = time.monotonic() + (wait if ticket is None else min(wait, TICKET_WAIT))
    while True:
        paired = _take_idle_backend(sock, addr, key, ticket, deadline, state)
        if paired is None:
            return  # refused or gone: the client was answered or closed
        b, server_conn = paired
        if _pair(server_conn):
            break
        # the link died between its registration and this client (the server closed it as
        # another session started, or the server died): not this client's failure, so it
        # waits for the next idle link within what is left of its wait
        logger.info("an idle link of server %s (key %r) was gone at pairing", b.server_id, key)
        _end_link(b, ticket, state)
    try:
        sock.settimeout(None)
        if ticket is not None and b.reg is not None:
            b.reg.report(T_START, ticket)
        # bytes either Conn read ahead belong to the relayed stream
        _relay(sock, server_conn.t.sock, hello_bytes + conn.take_buffered(), server_conn.take_buffered())  # fmt: skip
    finally:
        _end_link(b, ticket, state)
        if ticket is not None and b.reg is not None:
            b.reg.report(T_END, ticket)


def _take_idle_backend(sock: Any, addr: Any, key: str, ticket: str | None, deadline: float, state: _ProxyState) -> tuple[_Backend, wire.Conn] | None:  # fmt: skip
    """Wait for an idle server of ``key`` (until ``deadline``) and take its link.

    Returns ``(backend, link)``, or None when the client was refused (answered with the
    status) or left while held (closed).
    """
    held = False
    next_notice = 0.0
    with state.cv:
        try:
            while True:
                b = state.idle(key, ticket)
                if b is not None:
                    # the link is this thread's now; the server registers another one at
                    # once, so a client that never authenticates cannot keep it busy
                    server_conn, b.conn = b.conn, None
                    b.sessions += 1
                    if ticket is not None:
                        b.ticket = ticket
                    return b, server_conn  # type: ignore[return-value]
                status = state.refusal(key, ticket)
                left = deadline - time.monotonic()
                if status is None and left <= 0:
                    status = state.timed_out(key, ticket)
                if status is None and not held:
                    if state.held >= state.max_held:
                        logger.warning("%d clients held already: refusing %s", state.held, addr)
                        status = auth.SERVERS_BUSY
                    else:
                        held = True
                        state.held += 1
                if status is not None:
                    logger.warning("cannot pair %s with a server of key %r: %s", addr, key, auth.refusal_text(status, key))  # fmt: skip
                    _refuse(sock, status)
                    return None
                now = time.monotonic()
                if now >= next_notice:  # the client's connect_timeout runs between these
                    next_notice = now + HELD_NOTICE_EVERY
                    if not _notify_held(sock):
                        logger.info("client %s left while held for key %r", addr, key)
                        sock.close()
                        return None
                state.cv.wait(min(left, 0.2))
                if _gone(sock):  # the client gave up (its own connect_timeout) or misbehaved
                    logger.info("client %s left while held for key %r", addr, key)
                    sock.close()
                    return None
        finally:
            if held:
                state.held -= 1


def _pair(server_conn: wire.Conn) -> bool:
    """Tell an idle server's link that a client is paired with it; False if the link is dead."""
    try:
        server_conn.send(REQUEST, P_PAIRED, None)
        server_conn.t.sock.settimeout(10.0)
        _k, op, _v = server_conn.recv()
        if op != P_ACK:
            raise wire.ProtocolError("the server did not acknowledge the client")
        server_conn.t.sock.settimeout(None)
    except (OSError, EOFError, wire.ProtocolError):
        server_conn.close()
        return False
    return True


def _end_link(b: _Backend, ticket: str | None, state: _ProxyState) -> None:
    """A link of ``b`` taken by a client is done (relayed to its end, or dead at pairing)."""
    with state.cv:
        b.sessions -= 1
        if ticket is not None and b.ticket == ticket:
            b.ticket = None
        if b.conn is None and not b.sessions:
            b.gone_since = time.monotonic()
        state.cv.notify_all()


def _gone(sock: Any) -> bool:
    """Whether a held client closed its connection (or sent bytes, which it must not yet)."""
    poller = select.poll()  # not select(): the proxy may hold more than 1024 descriptors
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _notify_held(sock: Any) -> bool:
    """Tell a held client it is held (a few bytes, never blocking); False if it is gone."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    events = poller.poll(0)
    if not events:
        return True  # its buffer is full of notices: it is not reading, but not gone either
    if events[0][1] & (select.POLLERR | select.POLLHUP):
        return False
    try:
        sock.sendall(auth.held_notice())  # a few bytes into a writable socket: no wait
    except OSError:
        return False
    return True


def _refuse(sock: Any, status: int) -> None:
    """Answer a client's hello with a refusal status (what the client reports), then close."""
    try:
        sock.sendall(auth.refusal(status))
    except OSError:
        pass
    sock.close()


def _janitor(state: _ProxyState, stop: threading.Event) -> None:
    """Drop tracker registrations of servers that left and did not come back."""
    while not stop.wait(0.5):
        with state.cv:
            now = time.monotonic()
            for sid, b in list(state.backends.items()):
                if b.reg is not None:
                    b.reg.poll()
                    b.reg.reconnect_if_lost()
                if b.conn is None and not b.sessions and b.gone_since is not None:
                    if now - b.gone_since > REJOIN_GRACE:
                        if b.reg is not None:
                            b.reg.close()
                        del state.backends[sid]


def serve_proxy(listen_sock: socket.socket, host: str, port: int, token: bytes | None = None, ssl_context: Any = None, tracker_addr: Any = None, tracker_token: Any = None, tracker_ssl_context: Any = None, wait: float = DEFAULT_WAIT, watch_fd: int | None = None, *, max_connections: int = MAX_CONNECTIONS, max_pending: int = MAX_PENDING, handshake_timeout: float = HANDSHAKE_TIMEOUT, max_held: int = MAX_HELD) -> None:  # fmt: skip
    """Serve the proxy on ``listen_sock`` until ``watch_fd`` closes (or forever).

    One thread accepts connections and reads their first hello
    (:class:`disco_core.net.accept.AcceptLoop`: at most ``max_pending`` at once,
    ``handshake_timeout`` seconds each, no thread for them; a backend also proves
    the proxy's token there). Then each connection gets a thread, up to
    ``max_connections`` (beyond, a client is told the servers are busy). A client
    with no idle server of its key is held up to ``wait`` seconds, at most
    ``max_held`` clients at once.
    """
    state = _ProxyState(host, port, tracker_addr, tracker_token, tracker_ssl_context, max_held)
    stop = threading.Event()
    threading.Thread(target=_janitor, args=(state, stop), daemon=True).start()
    slots = Slots(max_connections)

    def make_handshake(sock: socket.socket, addr: Any) -> SocketHandshake:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return SocketHandshake(sock, addr, _FirstHello(token), ssl_context)

    def on_ready(hs: SocketHandshake) -> None:
        sock = hs.detach(10.0)
        first: _FirstHello = hs.machine  # type: ignore[assignment]
        if slots.start_thread(_handle, sock, hs.addr, state, first, wait, name="proxy-conn"):
            return
        logger.warning("refused a connection from %s: %d connections already", hs.addr, slots.limit)  # fmt: skip
        if first.backend:
            sock.close()
        else:
            _refuse(sock, auth.SERVERS_BUSY)

    try:
        AcceptLoop(
            listen_sock, make_handshake, on_ready,
            max_pending=max_pending, handshake_timeout=handshake_timeout,
            watch_fd=watch_fd, name="proxy",
        ).run()  # fmt: skip
    finally:
        stop.set()


def _seconds(name: str, value: Any) -> float:
    """``value`` as a positive number of seconds, else a DiscoValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DiscoValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


class Proxy(ServiceProcess):
    """Start an RPC proxy in a separate process, as ``tvm.rpc.proxy.Proxy``.

    Parameters
    ----------
    host : str
        The address to bind (``127.0.0.1`` by default; another address needs a
        token or TLS that requires client certificates unless ``allow_insecure_bind``).
    port, port_end : int
        The first free port in ``[port, port_end)`` is used (``proxy.port``);
        servers and clients both connect to it.
    web_port : int
        TVM's WebSocket port: not supported (only 0).
    timeout_client : float
        Seconds a client is held until a server with its key is idle (one registers,
        or comes back from a session), as TVM's; then it is refused with the reason
        (no server registered for the key, or every one stayed busy). The client
        waits as long as its own ``connect_timeout`` allows.
    timeout_server : float
        Accepted for TVM's signature; an idle server stays registered as long as
        its link is open (TVM's reconnects after ``timeout_server``).
    tracker_addr : tuple of str and int, optional
        Register the servers behind the proxy with this tracker.
    token : str or bytes, optional
        The secret servers must prove to register (default ``$DISCO_TOKEN``).
        Clients are authenticated end to end by the servers themselves.
    ssl_context : ssl.SSLContext, optional
        Speak TLS with servers and clients (a server-side context).
    tracker_token, tracker_ssl_context :
        For the link to the tracker (by default ``$DISCO_TRACKER_TOKEN``, else the
        proxy's token).
    wait : float, optional
        The former name of ``timeout_client``; when given, it wins.
    """

    _kind = "Proxy"

    def __init__(self, host: str = "127.0.0.1", port: int = 9091, port_end: int = 9199, web_port: int = 0, timeout_client: float = 600, timeout_server: float = 600, tracker_addr: Any = None, index_page: Any = None, resource_files: Any = None, *, token: Any = None, ssl_context: Any = None, tracker_token: Any = None, tracker_ssl_context: Any = None, wait: float | None = None, allow_insecure_bind: bool = False, reuse_addr: bool = True) -> None:  # fmt: skip
        if web_port:
            raise NotImplementedError("the web (WebSocket) port of TVM's proxy is not supported")
        wait = _seconds("timeout_client" if wait is None else "wait", timeout_client if wait is None else wait)  # fmt: skip
        _seconds("timeout_server", timeout_server)
        token_b = auth.resolve_token(token)
        check_bind(host, token_b, ssl_context, allow_insecure_bind, what="RPC proxy")
        auth.stretch_now(token_b)  # here, not in the first client's handshake
        self.host = host
        sock = bind_listener(host, port, port_end, reuse_addr)
        self.port = sock.getsockname()[1]
        tracker_token = auth.tracker_token_or(token) if tracker_token is None else tracker_token

        def serve(watch_fd: int) -> None:
            signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
            serve_proxy(
                    sock, host, self.port, token_b, ssl_context,
                    tuple(tracker_addr) if tracker_addr else None,
                    tracker_token, tracker_ssl_context, wait, watch_fd,
                )  # fmt: skip

        try:
            self._fork(serve)
        finally:
            sock.close()


# --------------------------------------------------------------------------- the server side
