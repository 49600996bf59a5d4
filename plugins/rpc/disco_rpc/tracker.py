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

Requests wait in a queue per key: higher ``priority`` first, then first come.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import select
import signal
import socket
import threading
import time
from typing import Any

from . import auth, wire
from ._service import ServiceProcess, accept_loop
from .errors import RPCError, RPCRequestTimeoutError, RPCSessionTimeoutError
from .wire import ERROR, REPLY, REQUEST

__all__ = ["Tracker", "TrackerSession", "connect_tracker", "Registration", "serve_tracker"]

logger = logging.getLogger("disco_rpc.tracker")

#: Frames on tracker links are small; this bounds them.
TRACKER_MAX_MESSAGE_BYTES = 1 << 20
#: The handshake key a registering server or proxy presents.
REGISTRANT_KEY = "disco-rpc/registrant"
#: The handshake key a client presents.
CLIENT_KEY = "disco-rpc/client"
#: The separator between a server key and a ticket in a client's handshake key.
TICKET_SEP = "@"

# operations
T_PUT, T_REQUEST, T_SUMMARY, T_START, T_END, T_ASSIGN, T_REVOKE, T_FAIL, T_PING = range(1, 10)


def ticket_key(key: str, ticket: str) -> str:
    return f"{key}{TICKET_SEP}{ticket}"


# --------------------------------------------------------------------------- the tracker's state
class _Link:
    """One authenticated connection to the tracker, with a send lock."""

    def __init__(self, conn: wire.Conn, addr: Any) -> None:
        self.conn = conn
        self.addr = addr
        self.lock = threading.Lock()
        self.closed = False

    def send(self, kind: int, op: int, value: Any) -> bool:
        with self.lock:
            if self.closed:
                return False
            try:
                self.conn.send(kind, op, value)
                return True
            except OSError:
                return False

    def close(self) -> None:
        with self.lock:
            if not self.closed:
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
    __slots__ = ("link", "key", "priority", "seq", "cancelled")

    def __init__(self, link: _Link, key: str, priority: int, seq: int) -> None:
        self.link = link
        self.key = key
        self.priority = priority
        self.seq = seq
        self.cancelled = False


class TrackerState:
    """Servers, tickets and waiting requests, under one lock."""

    def __init__(self, match_timeout: float = 10.0) -> None:
        self.lock = threading.Lock()
        self.servers: dict[int, _ServerEntry] = {}
        self.by_ticket: dict[str, _ServerEntry] = {}
        self.queues: dict[str, list] = {}
        self.seq = itertools.count()
        self.next_sid = itertools.count(1)
        self.match_timeout = match_timeout

    # all methods below run with self.lock held
    def put(self, link: _Link, key: str, addr: tuple, busy: str | None = None) -> int:
        """Register a server; ``busy``: the ticket of the session it is serving (it registers
        again after a tracker restart in the middle of a session)."""
        sid = next(self.next_sid)
        e = self.servers[sid] = _ServerEntry(sid, key, addr, link)
        if busy and busy not in self.by_ticket:
            e.ticket, e.started = busy, True
            self.by_ticket[busy] = e
        logger.info("server %d registered: key %r at %s:%s%s", sid, key, *addr, " (busy)" if busy else "")  # fmt: skip
        self._match(key)
        return sid

    def remove(self, sid: int, reason: str) -> None:
        e = self.servers.pop(sid, None)
        if e is None:
            return
        if e.ticket is not None:
            self.by_ticket.pop(e.ticket, None)
        logger.info("server %d (key %r) removed: %s", sid, e.key, reason)

    def request(self, link: _Link, key: str, priority: int) -> _Waiting:
        w = _Waiting(link, key, priority, next(self.seq))
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
        for q in self.queues.values():
            for _p, _s, w in q:
                if w.link is link:
                    w.cancelled = True

    def expire(self) -> None:
        now = time.monotonic()
        for e in list(self.servers.values()):
            if e.ticket is not None and not e.started and now - e.matched_at > self.match_timeout:
                t = e.ticket
                e.link.send(REQUEST, T_REVOKE, t)
                self.release(t, "its ticket was not used in time")

    def _match(self, key: str) -> None:
        q = self.queues.get(key)
        while q:
            _p, _s, w = q[0]
            if w.cancelled or w.link.closed:
                heapq.heappop(q)
                continue
            free = [e for e in self.servers.values() if e.key == key and e.ticket is None]
            if not free:
                return
            e = min(free, key=lambda s: s.free_since)
            heapq.heappop(q)
            ticket = secrets.token_hex(16)
            # The server hears of the ticket before the client does.
            if not e.link.send(REQUEST, T_ASSIGN, ticket):
                self.remove(e.sid, "its registration link broke")
                heapq.heappush(q, (-w.priority, w.seq, w))
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

    def summary(self) -> dict:
        servers = []
        queue: dict[str, dict] = {}
        for e in self.servers.values():
            servers.append(
                {
                    "addr": [e.addr[0], e.addr[1]],
                    "key": e.key,
                    "free": e.ticket is None,
                    "in_session": e.started,
                }
            )
            qi = queue.setdefault(e.key, {"free": 0, "pending": 0, "total": 0})
            qi["total"] += 1
            qi["free"] += e.ticket is None
        for key, q in self.queues.items():
            n = sum(1 for _p, _s, w in q if not w.cancelled and not w.link.closed)
            queue.setdefault(key, {"free": 0, "pending": 0, "total": 0})["pending"] = n
        return {"server_info": servers, "queue_info": queue}


# --------------------------------------------------------------------------- serving
def _handle(sock: socket.socket, addr: Any, state: TrackerState, token: bytes | None, ssl_context: Any, max_bytes: int) -> None:  # fmt: skip
    link = None
    sid = None
    try:
        sock.settimeout(10.0)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_side=True)
            transport: Any = wire.SSLTransport(sock)
        else:
            transport = wire.SocketTransport(sock)
        conn = wire.Conn(transport, max_bytes)
        role: list = []

        def check(kb: bytes) -> bool:
            role.append(kb)
            return kb in (REGISTRANT_KEY.encode(), CLIENT_KEY.encode())

        if not auth.server_handshake(conn, "", token, key_check=check):
            logger.warning("refused a connection from %s", addr)
            return
        sock.settimeout(None)
        link = _Link(conn, addr)
        while True:
            try:
                _k, op, value = conn.recv()
            except wire.ProtocolError as exc:
                if isinstance(exc, wire.FrameTooLarge):
                    return
                link.send(ERROR, 0, ("ProtocolError", str(exc), ""))
                continue
            try:
                if op == T_PUT and role[0] == REGISTRANT_KEY.encode() and sid is None:
                    key, host, port = str(value[0]), str(value[1]), int(value[2])
                    busy = str(value[3]) if len(value) > 3 and value[3] else None
                    if host in ("", "0.0.0.0", "::"):
                        host = addr[0]
                    with state.lock:
                        sid = state.put(link, key, (host, port), busy)
                    link.send(REPLY, T_PUT, sid)
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
                    key, priority = str(value[0]), int(value[1])
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
                    raise ValueError(f"unexpected tracker operation {op}")
            except Exception as exc:  # a malformed request: answer it, keep serving
                link.send(ERROR, op, (type(exc).__name__, f"bad tracker request: {exc}", ""))
    except (OSError, EOFError, wire.ProtocolError) as exc:
        logger.debug("link from %s ended: %s", addr, exc)
    finally:
        if link is not None:
            with state.lock:
                state.cancel(link)
                if sid is not None:
                    state.remove(sid, "its registration link closed")
            link.close()
        else:
            try:
                sock.close()
            except OSError:
                pass


def serve_tracker(listen_sock: socket.socket, token: bytes | None = None, ssl_context: Any = None, max_message_bytes: int = TRACKER_MAX_MESSAGE_BYTES, match_timeout: float = 10.0, watch_fd: int | None = None) -> None:  # fmt: skip
    """Serve the tracker on ``listen_sock`` until SIGTERM or ``watch_fd`` closes."""
    state = TrackerState(match_timeout)
    stop = threading.Event()

    def expire_loop() -> None:
        while not stop.wait(0.25):
            with state.lock:
                state.expire()

    threading.Thread(target=expire_loop, daemon=True, name="tracker-expire").start()
    try:
        accept_loop(
            listen_sock, watch_fd,
            lambda sock, addr: _handle(sock, addr, state, token, ssl_context, max_message_bytes),
        )  # fmt: skip
    finally:
        stop.set()


class Tracker(ServiceProcess):
    """Start a tracker in a separate process, as ``tvm.rpc.tracker.Tracker``.

    Parameters
    ----------
    host : str
        The address to bind (``127.0.0.1`` by default; another address needs a
        token or TLS unless ``allow_insecure_bind``).
    port, port_end : int
        The first free port in ``[port, port_end)`` is used (``tracker.port``).
    silent : bool
        Log only errors.
    token : str or bytes, optional
        The shared secret every server, proxy and client must prove (default
        ``$DISCO_TOKEN``).
    ssl_context : ssl.SSLContext, optional
        Speak TLS (a server-side context).
    match_timeout : float
        Seconds a client has to reach the server it was given; then the server
        goes back into the pool.
    """

    _kind = "Tracker"

    def __init__(self, host: str = "127.0.0.1", port: int = 9190, port_end: int = 9199, silent: bool = False, *, token: Any = None, ssl_context: Any = None, max_message_bytes: int = TRACKER_MAX_MESSAGE_BYTES, match_timeout: float = 10.0, allow_insecure_bind: bool = False, reuse_addr: bool = True) -> None:  # fmt: skip
        from .server import bind_listener, check_bind

        token_b = auth.resolve_token(token)
        check_bind(host, token_b, ssl_context, allow_insecure_bind, what="RPC tracker")
        if silent:
            logger.setLevel(logging.ERROR)
        self.host = host
        sock = bind_listener(host, port, port_end, reuse_addr)
        self.port = sock.getsockname()[1]

        def serve(watch_fd: int) -> None:
            signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
            serve_tracker(sock, token_b, ssl_context, max_message_bytes, match_timeout, watch_fd)

        try:
            self._fork(serve)
        finally:
            sock.close()


# --------------------------------------------------------------------------- links to a tracker
def _open(addr: Any, role_key: str, token: Any, ssl_context: Any, timeout: float = 10.0) -> wire.Conn:  # fmt: skip
    from .client import open_conn

    host, port = addr
    return open_conn(
        host,
        int(port),
        role_key,
        token=token,
        ssl_context=ssl_context,
        max_message_bytes=TRACKER_MAX_MESSAGE_BYTES,
        connect_timeout=timeout,
        peer="tracker",
    )


class Registration:
    """A server's (or a proxy's) link to a tracker: registers, hears tickets, reports sessions.

    ``tickets`` holds the tickets assigned and not used yet. Call :meth:`poll` when
    :meth:`fileno` is readable (or any time: it never blocks). ``busy``, when set,
    returns the ticket of the session the server is serving: registering again
    (after a tracker restart) then says so, and the tracker keeps the server out of
    the free pool until that session's end is reported.
    """

    def __init__(self, tracker_addr: Any, key: str, addr: tuple, *, token: Any = None, ssl_context: Any = None) -> None:  # fmt: skip
        self.tracker_addr = tuple(tracker_addr)
        self.key = key
        self.addr = (str(addr[0]), int(addr[1]))
        self.token = token
        self.ssl_context = ssl_context
        self.tickets: set[str] = set()
        self.conn: wire.Conn | None = None
        self.lock = threading.Lock()
        self.last_try = 0.0
        self.busy: Any = None
        self.connect()

    def connect(self) -> None:
        self.last_try = time.monotonic()
        busy = self.busy() if self.busy is not None else None
        conn = _open(self.tracker_addr, REGISTRANT_KEY, self.token, self.ssl_context)
        conn.send(REQUEST, T_PUT, (self.key, self.addr[0], self.addr[1], busy))
        kind, _op, value = conn.recv()
        if kind != REPLY:
            conn.close()
            raise RPCError(f"the tracker refused the registration: {value}")
        self.conn = conn
        self.tickets.clear()

    def reconnect_if_lost(self, every: float = 1.0) -> None:
        if self.conn is None and time.monotonic() - self.last_try >= every:
            try:
                self.connect()
                logger.info("registered again with the tracker at %s:%s", *self.tracker_addr)
            except (RPCError, OSError) as exc:
                logger.debug("tracker not reachable yet: %s", exc)

    def fileno(self) -> int:
        return self.conn.t.fileno() if self.conn is not None else -1

    def poll(self) -> None:
        """Read every message the tracker has sent (never blocks)."""
        conn = self.conn
        if conn is None:
            return
        try:
            while conn.buffered() or select.select([conn.t.fileno()], [], [], 0)[0]:
                _k, op, value = conn.recv()
                if op == T_ASSIGN:
                    self.tickets.add(str(value))
                elif op == T_REVOKE:
                    self.tickets.discard(str(value))
        except (OSError, EOFError, wire.ProtocolError):
            self._lost()

    def _lost(self) -> None:
        if self.conn is not None:
            logger.warning("lost the link to the tracker; will register again")
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn = None
        self.tickets.clear()

    def report(self, op: int, ticket: str) -> None:
        if op == T_START:
            self.tickets.discard(ticket)
        with self.lock:
            if self.conn is None:
                return
            try:
                self.conn.send(REQUEST, op, ticket)
            except OSError:
                self._lost()

    def accepts(self, presented: bytes) -> str | None:
        """The ticket in a client's handshake key if the tracker assigned it, else None."""
        self.poll()
        try:
            text = presented.decode("utf-8")
        except UnicodeDecodeError:
            return None
        key, sep, ticket = text.rpartition(TICKET_SEP)
        if sep and key == self.key and ticket in self.tickets:
            return ticket
        return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# --------------------------------------------------------------------------- the client side
class TrackerSession:
    """A client's connection to a tracker (``rpc.connect_tracker``), as TVM's."""

    def __init__(self, addr: tuple, *, token: Any = None, ssl_context: Any = None, server_token: Any = None, server_ssl_context: Any = None) -> None:  # fmt: skip
        self._addr = (addr[0], int(addr[1]))
        self._token = token
        self._ssl = ssl_context
        self._server_token = server_token if server_token is not None else token
        self._server_ssl = server_ssl_context
        self._lock = threading.Lock()
        self._conn: wire.Conn | None = None
        self._connect()

    def _connect(self) -> None:
        self._conn = _open(self._addr, CLIENT_KEY, self._token, self._ssl)

    def _call(self, op: int, value: Any, timeout: float | None = None) -> Any:
        """One request and its reply; ``timeout`` bounds the wait (``TimeoutError``)."""
        with self._lock:
            if self._conn is None:
                self._connect()
            conn = self._conn
            try:
                conn.t.settimeout(timeout)
                conn.send(REQUEST, op, value)
                kind, _op, result = conn.recv()
                conn.t.settimeout(None)
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
        """``{"server_info": [...], "queue_info": {key: {"free", "pending", "total"}}}``."""
        return self._call(T_SUMMARY, None)

    def text_summary(self) -> str:
        """The summary as the tables ``disco-rpc query`` prints."""
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
        from .client import connect

        connect_args.setdefault("token", self._server_token)
        if self._server_ssl is not None:
            connect_args.setdefault("ssl_context", self._server_ssl)
        deadline = None if wait_timeout is None else time.monotonic() + float(wait_timeout)
        last: BaseException | None = None
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
                last = exc
                logger.warning("server %s:%s for key %r failed: %s; retrying", host, port, key, exc)
                try:
                    self._call_noreply(T_FAIL, ticket)
                except RPCError:
                    pass
        raise RPCError(f"cannot get a session for key {key!r} after {max_retry} tries: {last}")

    def _wait_for_server(self, key: str, priority: int, deadline: float | None, wait: Any) -> tuple:  # fmt: skip
        left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        try:
            return self._call(T_REQUEST, (key, int(priority)), timeout=left)
        except TimeoutError:
            raise RPCRequestTimeoutError(
                f"no server for key {key!r} became free within {float(wait):g} s "
                f"({self.pool_text(key)})"
            ) from None

    def pool_text(self, key: str) -> str:
        """How many servers of ``key`` the tracker has, in words (for error messages)."""
        try:
            q = self.summary()["queue_info"].get(key)
        except RPCError as exc:
            return f"the tracker could not be asked: {exc}"
        if not q:
            return f"the tracker has no server registered for key {key!r}"
        return (
            f"the tracker has {q['total']} server(s) for key {key!r}: {q['free']} free, "
            f"{q['pending']} request(s) waiting"
        )

    def _call_noreply(self, op: int, value: Any) -> None:
        with self._lock:
            if self._conn is None:
                self._connect()
            self._conn.send(REQUEST, op, value)

    def request_and_run(self, key: str, func: Any, priority: int = 1, session_timeout: float = 0, max_retry: int = 2, **connect_args: Any) -> Any:  # fmt: skip
        """Request a session and run ``func(session)``; retry on a server that drops."""
        last: BaseException | None = None
        for _ in range(max(1, int(max_retry))):
            sess = self.request(key, priority, session_timeout, **connect_args)
            try:
                return func(sess)
            except RPCSessionTimeoutError:
                raise
            except RPCError as exc:
                if not sess.closed:
                    raise  # the function failed remotely: not the server's fault
                last = exc
                logger.warning("session for key %r dropped: %s; retrying", key, exc)
            finally:
                sess.close()
        raise RPCError(f"request_and_run for key {key!r} failed {max_retry} times: {last}")

    def __repr__(self) -> str:
        return f"<TrackerSession {self._addr[0]}:{self._addr[1]}>"


def format_summary(s: dict) -> str:
    lines = ["Server List", "-" * 40, f"{'server-address':<24} {'key':<14}", "-" * 40]
    for info in s.get("server_info", []):
        addr = f"{info['addr'][0]}:{info['addr'][1]}"
        state = "" if info.get("free") else " (in use)"
        lines.append(f"{addr:<24} {info['key']}{state}")
    lines += ["-" * 40, "", "Queue Status", "-" * 40]
    lines.append(f"{'key':<16} {'total':>6} {'free':>6} {'pending':>8}")
    lines.append("-" * 40)
    for key, q in sorted(s.get("queue_info", {}).items()):
        lines.append(f"{key:<16} {q['total']:>6} {q['free']:>6} {q['pending']:>8}")
    lines.append("-" * 40)
    return "\n".join(lines)


def connect_tracker(url: str, port: int, *, token: Any = None, ssl_context: Any = None, server_token: Any = None, server_ssl_context: Any = None) -> TrackerSession:  # fmt: skip
    """Connect to a tracker, as ``tvm.rpc.connect_tracker``.

    ``token``/``ssl_context`` authenticate to the tracker; the sessions it hands out
    use ``server_token``/``server_ssl_context`` (the tracker's token by default).
    """
    return TrackerSession(
        (url, port),
        token=token,
        ssl_context=ssl_context,
        server_token=server_token,
        server_ssl_context=server_ssl_context,
    )
