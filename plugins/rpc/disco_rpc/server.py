"""The RPC server: a listening process that serves each session in its own process.

``Server(...)`` binds in the calling process (so the port is known at once and a
refused address raises there), then forks the server process, which loads the
libraries, runs ``server_init_callback`` and reports ready (or the error) before
the constructor returns. The server process (the *listener*) runs every
client's handshake itself, without blocking, and forks one process per
*authenticated* session (a thread with ``no_fork=True``): a peer that does not
prove the token costs a socket and a few bytes, never a process.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import select
import shutil
import signal
import socket
import ssl
import struct
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disco_core import DiscoTypeError, DiscoValueError
from disco_core.spi import check_bind as _check_bind
from disco_core.spi import is_loopback, relay

from . import auth, wire
from ._service import ServiceProcess, fork_session
from .errors import ProtocolError, RPCError
from .handler import (
    BEATS_ALWAYS,
    BEATS_IDLE,
    BEATS_NONE,
    OP_INIT,
    WORK_DIR_ENV,
    SessionHandler,
    error_value,
    serve_conn,
)
from .protocol import ERROR, REPLY, T_END, T_START, TICKET_SEP

__all__ = ["Server", "serve_stdio", "serve_forever", "ServerConfig", "check_bind", "is_loopback"]

logger = logging.getLogger("disco_rpc.server")

#: Seconds a client has to complete the handshake.
HANDSHAKE_TIMEOUT = 10.0
#: Handshakes in progress at most; beyond, the oldest is dropped.
MAX_PENDING_HANDSHAKES = 64


@dataclass
class ServerConfig:
    key: str = ""
    token: bytes | None = None
    ssl_context: Any = None
    #: a folder every session uses as is and that is kept ("" = one temporary folder per session)
    work_dir: str = ""
    #: the server's private temporary folder (session folders, link scratch)
    temp_root: str | None = None
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    timeout: float | None = None
    no_fork: bool = False
    libs: list = field(default_factory=list)
    #: the link to a tracker (listener side), when the server registered with one
    registration: Any = None
    #: behind a proxy: accept ``key`` and ``key@ticket`` (the proxy checked the ticket)
    behind_proxy: bool = False
    #: seconds of silence after which a session's client is dead or frozen (0: never)
    liveness_timeout: float = 0.0


def load_libraries(load_library: Any) -> list:
    """Load ``.py`` files (their ``register_func`` calls run) and shared libraries."""
    if not load_library:
        return []
    if isinstance(load_library, str):
        load_library = [p for p in load_library.split(",") if p]
    libs = []
    for path in load_library:
        path = os.path.abspath(os.fspath(path))
        if path.endswith(".py"):
            from disco_core.spi import load_py

            load_py(path)
        else:
            libs.append(ctypes.CDLL(path, mode=getattr(ctypes, "RTLD_GLOBAL", 0)))
    return libs


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


def _min_positive(*values: Any) -> float:
    pos = [float(v) for v in values if v and float(v) > 0]
    return min(pos) if pos else 0.0


# --------------------------------------------------------------------------- one session
def _transport(sock: Any) -> Any:
    if isinstance(sock, ssl.SSLSocket):
        return wire.SSLTransport(sock)
    return wire.SocketTransport(sock)


def serve_session(conn: wire.Conn, addr: Any, cfg: ServerConfig, forked: bool, on_handler=None) -> None:  # fmt: skip
    """Serve an authenticated client until it leaves or its time is up."""
    handler = live = None
    sock = conn.t.sock
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        handler = SessionHandler(cfg.work_dir or None, cfg.libs, cfg.temp_root)
        if on_handler is not None:
            on_handler(handler)
        timeout, inner, log_relay = _init_session(conn, cfg, handler)
        if timeout is False:
            return
        sock.settimeout(None)
        if timeout:
            _start_watchdog(timeout, sock, handler, forked)
        live = _start_liveness(conn, addr, cfg, handler, forked, relay=inner is not None)
        logger.info("session from %s (pid %d)", addr, os.getpid())
        if inner is not None:
            _relay(conn, inner, log_relay)
        else:
            serve_conn(conn, handler, live)
    except (OSError, EOFError, ProtocolError) as exc:
        logger.info("session from %s ended: %s", addr, exc)
    finally:
        if live is not None:
            live.stop()
        if handler is not None:
            handler.close()
        try:
            sock.close()
        except OSError:
            pass


def _proxy_key_check(cfg: ServerConfig):
    if cfg.behind_proxy and cfg.key:
        key = cfg.key.encode()
        prefix = key + TICKET_SEP.encode()
        return lambda kb: kb == key or kb.startswith(prefix)
    return None


def _init_session(conn: wire.Conn, cfg: ServerConfig, handler: SessionHandler):
    """Read the INIT request; return ``(timeout, inner conn or None, log relay)``.

    ``timeout`` is ``False`` when the session must end at once. INIT carries
    ``(session_timeout, constructor, client max_message_bytes)``; the reply tells the
    client this server's limits (``max_message_bytes``, ``server_timeout``).
    """
    try:
        _kind, op, payload = conn.recv()
        if op != OP_INIT:
            raise ProtocolError("the first request of a session must be INIT")
        _frees, init = payload
        session_timeout, ctor = init[0], init[1]
        if len(init) > 2 and init[2]:
            conn.peer_max = int(init[2])
        beats = int(init[3]) if len(init) > 3 and init[3] in (BEATS_IDLE, BEATS_ALWAYS) else 0
        conn.peer_beats = beats  # read by _start_liveness
        timeout = _min_positive(session_timeout, cfg.timeout)
        inner, log_relay = None, False
        info = {
            "pid": os.getpid(),
            "version": auth.VERSION,
            "work_dir": handler.work,
            "max_message_bytes": cfg.max_message_bytes,
            "server_timeout": float(cfg.timeout or 0),
        }
        if ctor:
            inner, info, log_relay = _construct(ctor, timeout, cfg, conn.peer_max, beats)
        own = cfg.liveness_timeout if _can_watch(conn) else 0.0
        lt = _min_positive(own, info.get("liveness_timeout"))
        if lt:
            info["liveness_timeout"] = lt  # the client sends heartbeats well within it
        conn.send(REPLY, OP_INIT, info)
        return timeout, inner, log_relay
    except (EOFError, OSError) as exc:
        if isinstance(exc, RPCError):  # the inner server refused (RPCAuthError is an OSError)
            _send_init_error(conn, exc)
        return False, None, False
    except Exception as exc:
        _send_init_error(conn, exc)
        return False, None, False


def _send_init_error(conn: wire.Conn, exc: BaseException) -> None:
    try:
        conn.send(ERROR, OP_INIT, error_value(exc))
    except OSError:
        pass


def connect_args(args: list) -> tuple:
    """Parse ``rpc.Connect``'s arguments as TVM does: ``host, port, key, enable_logging, *init``.

    disco-rpc's own options come as a dict right after ``enable_logging``
    (``{"token": ...}``): a dict can never start TVM's init sequence (a name).
    Returns ``(host, port, key, enable_logging, options, init)``.
    """
    if len(args) < 2:
        raise DiscoValueError('rpc.Connect needs ["rpc.Connect", host, port, key, enable_logging]')
    host, port = str(args[0]), int(args[1])
    key = str(args[2]) if len(args) > 2 else ""
    enable_logging = args[3] if len(args) > 3 else False
    if not isinstance(enable_logging, (bool, int)):
        raise DiscoTypeError(
            "the 5th element of rpc.Connect is enable_logging (a bool), as in TVM; give the "
            'inner server\'s token as a dict after it: ["rpc.Connect", host, port, key, False, '
            '{"token": ...}]'
        )
    rest = list(args[4:])
    options: dict = {}
    if rest and isinstance(rest[0], dict):
        options = rest.pop(0)
        unknown = set(options) - {"token"}
        if unknown:
            raise DiscoValueError(f"unknown rpc.Connect options {sorted(unknown)}; known: token")
    return host, port, key, bool(enable_logging), options, rest


def _construct(
    ctor: list, timeout: float, cfg: ServerConfig, client_max: int | None, beats: int = 0
):
    """Build the session ``ctor`` names; return ``(inner conn or None, info, log relay)``."""
    name, args = ctor[0], list(ctor[1:])
    if name in ("rpc.LocalSession", "LocalSession"):
        return None, {"pid": os.getpid(), "version": auth.VERSION}, False
    if name not in ("rpc.Connect", "Connect"):
        raise DiscoValueError(
            f"unknown session constructor {name!r}; known: rpc.LocalSession, rpc.Connect"
        )
    host, port, key, enable_logging, options, rest = connect_args(args)
    from .client import open_conn

    inner = open_conn(
        host, port, key, token=options.get("token"),
        max_message_bytes=cfg.max_message_bytes, peer="inner RPC server",
    )  # fmt: skip
    # the client's heartbeats pass through the relay: the inner server may count on them
    inner.send(wire.REQUEST, OP_INIT, ((), (timeout, rest, client_max, beats)))
    kind, _op, info = inner.recv()
    if kind != REPLY:
        exc_type, msg, _tb = info
        inner.close()
        raise RPCError(f"the inner server refused the session: {exc_type}: {msg}")
    info = dict(info)
    info["via"] = f"{host}:{port}"
    # this server ends the chained session at its own limit too
    info["server_timeout"] = _min_positive(cfg.timeout, info.get("server_timeout"))
    return inner, info, enable_logging


def _relay(outer: wire.Conn, inner: wire.Conn, log: bool = False) -> None:
    """Copy bytes both ways until either side closes (a chained session).

    :func:`disco_core.net.relay.relay` reads a sealed side record by record and
    passes a record on only once its tag verified (sealed again when the other
    side is sealed): nothing forged on one link reaches the other.
    """
    owed = []
    for src in (outer, inner):  # what a Conn read past its last frame (verified: it settled)
        owed.append(bytes(src.view[src.start : src.end]) if src.buffered() else b"")
        src.start = src.end
    if log:
        logger.info("relaying a chained session to %s", inner.t.sock.getpeername())
    moved = (0, 0)
    try:
        moved = relay(outer.t, inner.t, owed[0], owed[1])
    finally:
        if log:
            logger.info("chained session ended: %d bytes to the inner server, %d back", *moved)
        inner.close()


def _start_watchdog(timeout: float, sock: socket.socket, handler: SessionHandler, forked: bool):
    def expire() -> None:
        logger.info("session timed out after %g s; ending it", timeout)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if forked:
            handler.close()
            os._exit(0)

    t = threading.Timer(timeout, expire)
    t.daemon = True
    t.start()
    return t


# --------------------------------------------------------------------------- liveness
#: ``$DISCO_RPC_LIVENESS_TIMEOUT``: seconds of silence after which a session's client is
#: taken for dead or frozen (``Server(liveness_timeout=...)`` wins; 0 turns it off).
LIVENESS_ENV = "DISCO_RPC_LIVENESS_TIMEOUT"
#: The default of ``liveness_timeout``: with checks every second, a frozen client's
#: session ends within 9 s, a dead client's (its socket closed) within 1 s.
DEFAULT_LIVENESS_TIMEOUT = 8.0
#: The shortest ``liveness_timeout`` accepted (a client beats every quarter of it).
MIN_LIVENESS_TIMEOUT = 0.5
#: Unread bytes past which the watchdog drops the heartbeats that piled up during a call.
_DRAIN_BYTES = 1 << 14

_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8  # tcpi_state: the peer reset or closed the connection
#: ``struct tcp_info``: ``tcpi_state`` is byte 0, ``tcpi_last_data_recv`` (ms) the u32 at 52,
#: ``tcpi_bytes_acked`` the u64 at 120 (Linux 4.1 and later)
_LAST_DATA_RECV = struct.Struct("<I")
_LAST_DATA_RECV_OFFSET = 8 + 11 * 4
_BYTES_ACKED = struct.Struct("<Q")
_BYTES_ACKED_OFFSET = 120


def resolve_liveness_timeout(value: Any = None) -> float:
    """The liveness timeout in seconds: ``value``, else ``$DISCO_RPC_LIVENESS_TIMEOUT``, else 8.

    Parameters
    ----------
    value : float or str, optional
        Seconds; 0 turns the checks off (a frozen client then holds its session
        until it closes the connection).

    Raises
    ------
    ValueError
        Not a number, negative, or between 0 and :data:`MIN_LIVENESS_TIMEOUT`.
    """
    origin = "liveness_timeout"
    if value is None:
        value = os.environ.get(LIVENESS_ENV) or DEFAULT_LIVENESS_TIMEOUT
        origin = f"${LIVENESS_ENV}"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise DiscoValueError(f"{origin} must be a number of seconds, got {value!r}") from None
    if not (seconds == 0 or MIN_LIVENESS_TIMEOUT <= seconds < float("inf")):
        raise DiscoValueError(
            f"{origin} must be 0 (off) or at least {MIN_LIVENESS_TIMEOUT:g} seconds, got {value!r}"
        )
    return seconds


def _can_watch(conn: wire.Conn) -> bool:
    """Whether this side can watch ``conn``'s peer (a TCP socket on Linux)."""
    sock = getattr(conn.t, "sock", None)
    return _TCP_INFO is not None and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)  # fmt: skip


def _tcp_state(sock: socket.socket) -> tuple[int, float, int]:
    """``(tcpi_state, seconds since data last arrived, bytes the peer acknowledged)`` from
    the kernel (``TCP_INFO``; the last is -1 where the kernel does not tell)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 136)
    idle = _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0] / 1000.0
    acked = -1
    if len(info) >= _BYTES_ACKED_OFFSET + 8:
        acked = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0]
    return info[0], idle, acked


def _unsent(sock: socket.socket) -> int:
    """Bytes written and not yet acknowledged by the peer."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def _unread(sock: socket.socket) -> int:
    """Bytes received and not read yet."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


class _Liveness:
    """Ends a session whose client died or froze, from a thread of the session.

    It reads the kernel's ``TCP_INFO`` on the client's socket once per check
    (every ``timeout / 4`` seconds, at most 1 s), so a request costs nothing more:

    * the connection is closed or reset by the peer (``CLOSE_WAIT``/``CLOSE``):
      the client is gone; the session ends at once (for a Disco worker, whose
      controller ends it by closing its side, after ``timeout`` more seconds);
    * what this side sent waits to go out and the client has acknowledged none
      of it for ``timeout`` seconds: it stopped reading (frozen) or its machine
      or network is gone (the kernel's ``tcpi_bytes_acked`` and ``TIOCOUTQ``;
      whatever the client is, a Disco worker's controller included);
    * no data arrived for ``timeout`` seconds: the client is frozen, or its
      machine or network is gone, since a live client sends a heartbeat frame
      when it has sent nothing for a while, during a long call included. A client
      that beats only between calls (TLS) is not judged by this rule while a
      request runs or its reply is sent (the session's ``gate`` is free, see
      :func:`~disco_rpc.handler.serve_conn`); one that does not beat at all (an
      older client, a Disco worker's controller) is judged by the first two rules
      only.

    While a call runs, the heartbeats pile up unread; past :data:`_DRAIN_BYTES`
    it drops them itself (taking the gate), so the socket's receive queue never
    fills, whatever the call's length.
    """

    def __init__(self, conn: wire.Conn, addr: Any, timeout: float, beats: int, on_dead: Any, relay: bool) -> None:  # fmt: skip
        self.conn = conn
        self.sock = conn.t.sock
        self.addr = addr
        self.timeout = timeout
        self.beats = BEATS_NONE if relay and beats != BEATS_ALWAYS else beats
        self.on_dead = on_dead
        link = type(getattr(conn.t, "inner", conn.t))  # under the seal, if sealed
        self.drain = beats == BEATS_ALWAYS and link is wire.SocketTransport and not relay
        self.gate = threading.Lock()
        self.gate.acquire()  # by the serving thread (this constructor's caller)
        self.worker_mode = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="disco-rpc-liveness", daemon=True)

    def worker(self) -> None:
        """The session became a Disco worker: no more heartbeats, only its end counts."""
        self.worker_mode = True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick = min(1.0, self.timeout / 4)
        in_call_at = time.monotonic()
        closed_at = waiting_since = None
        last_acked = -1
        while not self._stop.wait(tick):
            try:
                state, idle, acked = _tcp_state(self.sock)
                unsent = _unsent(self.sock) if acked >= 0 else 0
            except OSError:
                return  # closed here: the session is ending
            now = time.monotonic()
            # bytes wait to go out and none was taken since the last check: count how long
            if unsent > 0 and acked == last_acked:
                waiting_since = now if waiting_since is None else waiting_since
            else:
                waiting_since = None
            last_acked = acked
            if state in (_TCP_CLOSE_WAIT, _TCP_CLOSE):
                closed_at = closed_at if closed_at is not None else now
                if not self.worker_mode or now - closed_at >= self.timeout:
                    return self._dead("closed its connection")
                continue
            if waiting_since is not None and now - waiting_since > self.timeout:
                return self._dead(
                    f"took none of what it was sent for {now - waiting_since:.1f} s "
                    "(frozen, or its host is gone)"
                )
            if self.worker_mode or self.beats == BEATS_NONE:
                continue
            if not self.gate.locked():  # a request runs, or its reply is being sent
                if self.beats == BEATS_IDLE:
                    in_call_at = now  # such a client cannot beat meanwhile
                elif self.drain:
                    self._drop_heartbeats()
            if self.beats == BEATS_IDLE:
                idle = min(idle, now - in_call_at)
            if idle > self.timeout:
                return self._dead(f"sent nothing for {idle:.1f} s (frozen, or its host is gone)")

    def _drop_heartbeats(self) -> None:
        try:
            if _unread(self.sock) < _DRAIN_BYTES or not self.gate.acquire(blocking=False):
                return
        except OSError:
            return
        try:
            self.conn.drop_heartbeats()
        except OSError:
            pass
        finally:
            self.gate.release()

    def _dead(self, why: str) -> None:
        if self._stop.is_set():
            return
        logger.warning(
            "ending the session of the client at %s: it %s (liveness timeout %g s)",
            self.addr, why, self.timeout,
        )  # fmt: skip
        self.on_dead()


def _start_liveness(conn: wire.Conn, addr: Any, cfg: ServerConfig, handler: SessionHandler, forked: bool, relay: bool = False) -> _Liveness | None:  # fmt: skip
    """Watch the session's client (see :class:`_Liveness`); None when off or impossible."""
    if not cfg.liveness_timeout or not _can_watch(conn):
        return None
    sock = conn.t.sock

    def end() -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if forked:  # a call may be running: the process ends, the listener reaps it
            handler.close()
            os._exit(0)

    live = _Liveness(conn, addr, cfg.liveness_timeout, getattr(conn, "peer_beats", 0), end, relay)
    live.thread.start()
    return live


# --------------------------------------------------------------------------- the listener
class _Handshake:
    """A client's handshake in progress, advanced by the listener without ever blocking.

    Reads never go past the handshake, so a peer that sends more than it should
    costs at most the handshake's few bytes of buffer.
    """

    def __init__(self, sock: socket.socket, addr: Any, cfg: ServerConfig, key_check) -> None:
        sock.setblocking(False)
        self.tls = cfg.ssl_context is not None
        if self.tls:
            sock = cfg.ssl_context.wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
        self.sock = sock
        self.addr = addr
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self.hs = auth.ServerHandshake(cfg.key, cfg.token, key_check)
        self.buf = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def conn(self, cfg: ServerConfig) -> wire.Conn:
        """The authenticated connection, sealed when the handshake had a token."""
        conn = wire.Conn(_transport(self.sock), cfg.max_message_bytes)
        auth.seal(conn, self.hs.keys)
        return conn

    def advance(self) -> bool | None:
        """Use what arrived: True (authenticated), False (refused or gone), None (wait)."""
        try:
            if self.tls:
                self.sock.do_handshake()
                self.tls = False
            while self.hs.want:
                data = self.sock.recv(self.hs.want - len(self.buf))
                if not data:
                    return False
                self.buf += data
                if len(self.buf) == self.hs.want:
                    out = self.hs.step(bytes(self.buf))
                    self.buf.clear()
                    if out and not self._send(out):
                        return False
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except (OSError, ValueError) as exc:
            logger.info("handshake with %s failed: %s", self.addr, exc)
            return False
        return self.hs.ok

    def _send(self, data: bytes) -> bool:
        # a few dozen bytes into an empty socket buffer: only a peer that never
        # reads (its window closed) makes this fail, and it is dropped
        try:
            return self.sock.send(data) == len(data)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _ThreadSession:
    """A session served by a thread of the listener (``no_fork``)."""

    def __init__(self, conn: wire.Conn, ticket: str | None) -> None:
        self.conn = conn
        self.ticket = ticket
        self.handler: SessionHandler | None = None

    def close(self) -> None:
        try:
            self.conn.t.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.handler is not None:
            self.handler.close()


class _Listener:
    """The server process's loop: handshakes, session processes, the tracker link.

    A session's end is seen when its process is reaped (or its thread ends), so a
    process the session forked (a daemon it started) cannot keep the server
    marked busy at the tracker.
    """

    def __init__(self, listen_sock: socket.socket, cfg: ServerConfig, watch_fd: int | None) -> None:  # fmt: skip
        self.sock = listen_sock
        self.cfg = cfg
        self.watch_fd = watch_fd
        self.reg = cfg.registration
        self.pending: list[_Handshake] = []
        self.children: dict[int, tuple[str | None, int | None]] = {}  # pid -> (ticket, pidfd)
        self.threads: dict[int, _ThreadSession] = {}
        self.ended: list[int] = []  # thread sessions that ended (ids), under ended_lock
        self.ended_lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        if self.reg is not None:
            self.reg.busy = self.busy_ticket

    def busy_ticket(self) -> str | None:
        """The ticket of a session in progress (a tracker that restarts must not free it)."""
        for ticket, _fd in self.children.values():
            if ticket:
                return ticket
        for ts in list(self.threads.values()):
            if ts.ticket:
                return ts.ticket
        return None

    def run(self) -> None:
        while True:
            self._expire_handshakes()
            ready = self._wait()
            self._reap()
            self._collect_threads(ready)
            if self.watch_fd is not None and self.watch_fd in ready:
                logger.info("the process that started this server is gone; exiting")
                return
            if self.reg is not None:
                self.reg.poll()
            for hs in [h for h in self.pending if h.fileno() in ready]:
                self._advance(hs)
            if self.sock.fileno() in ready:
                self._accept()

    def _wait(self) -> set[int]:
        watch = [self.sock.fileno(), self.wake_r, *(h.fileno() for h in self.pending)]
        watch += [fd for _t, fd in self.children.values() if fd is not None]
        if self.watch_fd is not None:
            watch.append(self.watch_fd)
        if self.reg is not None:
            self.reg.reconnect_if_lost()
            if self.reg.conn is not None:
                watch.append(self.reg.fileno())
        timeout = 1.0
        if self.pending:
            timeout = max(0.0, min(timeout, min(h.deadline for h in self.pending) - time.monotonic()))  # fmt: skip
        try:
            return set(select.select(watch, [], [], timeout)[0])
        except InterruptedError:
            return set()

    def _accept(self) -> None:
        try:
            sock, addr = self.sock.accept()
        except OSError:
            return
        if len(self.pending) >= MAX_PENDING_HANDSHAKES:
            oldest = self.pending.pop(0)
            logger.warning("too many handshakes in progress; dropping %s", oldest.addr)
            oldest.close()
        try:
            hs = _Handshake(sock, addr, self.cfg, self._key_check())
        except (OSError, ValueError) as exc:
            logger.info("cannot start a handshake with %s: %s", addr, exc)
            sock.close()
            return
        self.pending.append(hs)
        self._advance(hs)  # the hello is often there already

    def _key_check(self):
        reg = self.reg
        if reg is None:
            return None
        return lambda kb: reg.accepts(kb) is not None

    def _advance(self, hs: _Handshake) -> None:
        ok = hs.advance()
        if ok is None:
            return
        self.pending.remove(hs)
        if not ok:
            logger.warning("refused a client from %s (key, version or authentication)", hs.addr)
            hs.close()
            return
        ticket = None
        if self.reg is not None:
            ticket = hs.hs.peer_key.rpartition(TICKET_SEP)[2]
            self.reg.report(T_START, ticket)
        self._start_session(hs, ticket)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for hs in [h for h in self.pending if h.deadline <= now]:
            logger.info("handshake with %s timed out", hs.addr)
            self.pending.remove(hs)
            hs.close()

    def _start_session(self, hs: _Handshake, ticket: str | None) -> None:
        hs.sock.setblocking(True)
        conn = hs.conn(self.cfg)
        if self.cfg.no_fork:
            ts = _ThreadSession(conn, ticket)
            self.threads[id(ts)] = ts
            threading.Thread(target=self._session_thread, args=(ts, hs.addr), daemon=True).start()
            return

        def session() -> None:  # in the session process
            self._child_setup()
            serve_session(conn, hs.addr, self.cfg, True)

        pid, pidfd = fork_session(session)  # no pidfd: seen at the next poll (<= 1 s)
        hs.close()
        self.children[pid] = (ticket, pidfd)

    def _child_setup(self) -> None:
        """In a session process: drop what belongs to the listener."""
        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _set_pdeathsig()
        self.sock.close()
        for fd in [self.watch_fd, self.wake_r, self.wake_w]:
            if fd is not None:
                os.close(fd)
        for hs in self.pending:
            hs.close()
        for _t, pidfd in self.children.values():
            if pidfd is not None:
                os.close(pidfd)
        if self.reg is not None and self.reg.conn is not None:
            self.reg.conn.t.sock.close()  # the listener's link, not this process's

    def _session_thread(self, ts: _ThreadSession, addr: Any) -> None:
        def keep(handler: SessionHandler) -> None:
            ts.handler = handler

        try:
            serve_session(ts.conn, addr, self.cfg, False, on_handler=keep)
        finally:
            with self.ended_lock:
                self.ended.append(id(ts))
            try:
                os.write(self.wake_w, b"x")
            except OSError:
                pass

    def _collect_threads(self, ready: set[int]) -> None:
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        with self.ended_lock:
            ended, self.ended = self.ended, []
        for key in ended:
            ts = self.threads.pop(key, None)
            if ts is not None and ts.ticket and self.reg is not None:
                self.reg.report(T_END, ts.ticket)

    def _reap(self) -> None:
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if not done:
                continue
            ticket, pidfd = self.children.pop(pid)
            if pidfd is not None:
                os.close(pidfd)
            if ticket and self.reg is not None:
                self.reg.report(T_END, ticket)

    def close(self) -> None:
        """Drop handshakes, end every session (threads included), wait for the processes."""
        for hs in self.pending:
            hs.close()
        self.pending.clear()
        for ts in list(self.threads.values()):
            ts.close()
        _stop_children(set(self.children))
        for _t, pidfd in self.children.values():
            if pidfd is not None:
                os.close(pidfd)
        self.children.clear()
        os.close(self.wake_r)
        os.close(self.wake_w)


def _term(signum, frame):
    raise SystemExit(0)


def serve_forever(listen_sock: socket.socket, cfg: ServerConfig, watch_fd: int | None = None) -> None:  # fmt: skip
    """Accept clients on ``listen_sock`` until SIGTERM/SIGINT or ``watch_fd`` closes."""
    signal.signal(signal.SIGTERM, _term)
    if not cfg.temp_root:
        cfg.temp_root = tempfile.mkdtemp(prefix="disco-rpc-server-")
    if cfg.work_dir:
        os.makedirs(cfg.work_dir, exist_ok=True)
    listen_sock.setblocking(True)
    listener = _Listener(listen_sock, cfg, watch_fd)
    try:
        listener.run()
    finally:
        listener.close()
        shutil.rmtree(cfg.temp_root, ignore_errors=True)


def _stop_children(children: set[int]) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while children and time.monotonic() < deadline:
        for pid in list(children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                children.discard(pid)
        time.sleep(0.01)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def check_bind(host: str, token: bytes | None, ssl_context: Any, allow_insecure_bind: bool, what: str = "RPC server") -> None:  # fmt: skip
    """The core's bind policy (:func:`disco_core.net.security.check_bind`) for an rpc service.

    Raises :class:`~disco_core.errors.InsecureBindError` for a non-loopback
    ``host`` with neither token nor TLS, unless ``allow_insecure_bind`` (which warns).
    """
    _check_bind(host, token=token, tls=ssl_context is not None, allow_insecure_bind=allow_insecure_bind, what=what)  # fmt: skip


def bind_listener(host: str, port: int, port_end: int, reuse_addr: bool = True) -> socket.socket:
    """Bind the first free port in ``[port, port_end)`` (``port`` alone when ``port_end <= port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last = None
    for p in range(port, max(port_end, port + 1)):
        sock = socket.socket(family, socket.SOCK_STREAM)
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, p))
            sock.listen(128)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                continue
            raise
    raise RPCError(f"cannot bind to any port in [{port}, {port_end}) on {host}: {last}")


# --------------------------------------------------------------------------- start-up report
def _start_timeout() -> float:
    return float(os.environ.get("DISCO_START_TIMEOUT", "60"))


def _report_ready(fd: int, exc: BaseException | None) -> None:
    """In the server process: tell the constructor it is ready, or why it is not."""
    msg = b"R" if exc is None else b"E" + bytes(wire.encode(error_value(exc))[0])
    try:
        os.write(fd, msg)
    except OSError:
        pass
    os.close(fd)


def _await_ready(fd: int, pid: int) -> None:
    """In the constructor: wait for the server process's report; raise if it failed."""
    limit = _start_timeout()
    data = bytearray()
    deadline = time.monotonic() + limit
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RPCError(f"the RPC server process did not start within {limit:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if data[:1] == b"R":
        return
    if data[:1] == b"E":
        exc_type, msg, tb = wire.decode(bytes(data[1:]))[0]
        raise RPCError(f"the RPC server failed to start: {exc_type}: {msg}", "", tb)
    raise RPCError("the RPC server process exited before it was ready")


class Server(ServiceProcess):
    """Start an RPC server in a separate process, as ``tvm.rpc.Server``.

    The constructor returns once the server process has loaded ``load_library``
    and run ``server_init_callback``; if either fails, it raises
    :class:`~disco_rpc.RPCError` with the server's error and traceback.

    Parameters
    ----------
    host : str
        The address to bind, ``127.0.0.1`` by default. Another address needs a
        ``token`` or an ``ssl_context`` unless ``allow_insecure_bind=True``.
    port, port_end : int
        The first free port in ``[port, port_end)`` is used (``server.port``).
    is_proxy : bool
        ``host:port`` name an RPC proxy (:class:`disco_rpc.Proxy`): the server connects
        out to it (``proxy_token``/``proxy_ssl_context`` for that link) and serves the
        clients the proxy pairs with it, one session at a time. Anyone who reaches
        the proxy reaches the server, so a ``token`` is required unless
        ``allow_insecure_bind=True``.
    tracker_addr : (str, int), optional
        Register with this tracker under ``key`` (``tracker_token``/``tracker_ssl_context``
        for that link; the server's ``token`` by default). The server then serves only
        clients holding a ticket from the tracker, and reports each session's end.
    key : str
        Clients must present this key (an empty key accepts any).
    load_library : str or list of str
        Files loaded in the server at start: ``.py`` files (their ``register_func``
        calls run) and shared libraries (their symbols reach ``system_lib()``).
    custom_addr : str, optional
        The host the tracker gives clients (default ``host``).
    silent : bool
        Log only errors.
    no_fork : bool
        Serve sessions in threads of the server process instead of one process each.
    server_init_callback : callable, optional
        Called in the server process before it accepts clients.
    reuse_addr : bool
        Set ``SO_REUSEADDR`` on the listening socket.
    timeout : float, optional
        The longest any session may last, in seconds.
    token : str or bytes, optional
        Shared secret clients must prove they know (default ``$DISCO_TOKEN``).
    ssl_context : ssl.SSLContext, optional
        A server-side TLS context (``ssl.PROTOCOL_TLS_SERVER`` with a certificate).
    work_dir : str, optional
        A folder every session uses as its work folder, shared by all sessions and
        kept (TVM's ``work_path``). By default each session gets a new folder,
        deleted when it ends.
    max_message_bytes : int
        The largest frame accepted from a client (files are streamed in frames of
        at most this size, so it does not bound their size).
    allow_insecure_bind : bool
        Allow a non-loopback address with neither token nor TLS (and ``is_proxy``
        without a token).
    liveness_timeout : float, optional
        Seconds without a sign of life after which a session's client counts as
        frozen or gone: the session ends (its process exits, its tracker slot comes
        back). Clients send heartbeats when they have sent nothing for a quarter of
        it, during long calls too. A client that closed its connection (it died) is
        noticed within a second. Default ``$DISCO_RPC_LIVENESS_TIMEOUT``, else 8;
        0 turns the checks off. See the README, "Liveness".
    """

    _kind = "Server"

    def __init__(self, host: str = "127.0.0.1", port: int = 9091, port_end: int = 9199, is_proxy: bool = False, tracker_addr: Any = None, key: str = "", load_library: Any = None, custom_addr: str | None = None, silent: bool = False, no_fork: bool = False, server_init_callback: Any = None, reuse_addr: bool = True, timeout: float | None = None, *, token: Any = None, ssl_context: Any = None, work_dir: str | None = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, allow_insecure_bind: bool = False, tracker_token: Any = None, tracker_ssl_context: Any = None, proxy_token: Any = None, proxy_ssl_context: Any = None, liveness_timeout: float | None = None) -> None:  # fmt: skip
        self.host = host
        self.key = key
        self.custom_addr = custom_addr
        self.proc = None
        self.pid: int | None = None
        self.is_proxy = is_proxy
        token_b = auth.resolve_token(token)
        if silent:
            logger.setLevel(logging.ERROR)
        cfg = ServerConfig(
            key=key,
            token=token_b,
            ssl_context=ssl_context,
            work_dir=os.path.abspath(os.fspath(work_dir)) if work_dir else "",
            max_message_bytes=int(max_message_bytes),
            timeout=timeout,
            no_fork=no_fork,
            behind_proxy=is_proxy,
            liveness_timeout=resolve_liveness_timeout(liveness_timeout),
        )
        self._sock = None
        reg = None
        if is_proxy:
            _check_proxied(token_b, allow_insecure_bind)
            # host/port name the proxy; this server connects out to it
            self.port = int(port)
            if tracker_addr is not None:
                logger.info("tracker_addr is ignored behind a proxy: give it to the Proxy")
        else:
            check_bind(host, token_b, ssl_context, allow_insecure_bind)
            self._sock = bind_listener(host, port, port_end, reuse_addr)
            self.port = self._sock.getsockname()[1]
            if tracker_addr is not None:
                reg = self._register(cfg, tracker_addr, tracker_token if tracker_token is not None else token, tracker_ssl_context)  # fmt: skip
        proxy_args = (host, int(port), key, proxy_token if proxy_token is not None else token, proxy_ssl_context)  # fmt: skip
        # the server's own token, used for the proxy link by default, is offered to a proxy
        # that asks for one; a proxy_token given as such must be proven by the proxy
        self._proxy_strict = proxy_token is not None
        try:
            self._start(cfg, load_library, server_init_callback, proxy_args if is_proxy else None)
        finally:
            if reg is not None and reg.conn is not None:
                reg.conn.t.sock.close()  # the server process holds the link now

    def _register(self, cfg: ServerConfig, tracker_addr: Any, token: Any, ssl_context: Any) -> Any:
        from .tracker import Registration

        if not self.key:
            self._sock.close()
            raise DiscoValueError("a server that registers with a tracker needs a key")
        try:
            cfg.registration = Registration(
                tracker_addr, self.key, (self.custom_addr or self.host, self.port),
                token=token, ssl_context=ssl_context,
            )  # fmt: skip
        except BaseException:
            self._sock.close()
            raise
        return cfg.registration

    def _start(self, cfg: ServerConfig, load_library: Any, init_callback: Any, proxy_args: Any) -> None:  # fmt: skip
        """Fork the server process; return once it reported ready (or raise its error)."""
        # made here, so that terminate() removes it even if the server process was killed
        cfg.temp_root = self._temp_root = tempfile.mkdtemp(prefix="disco-rpc-server-")
        ready_r, ready_w = os.pipe()

        def serve(watch_fd: int) -> None:
            os.close(ready_r)
            try:
                cfg.libs = load_libraries(load_library)
                if init_callback is not None:
                    init_callback()
                first = _first_proxy_link(proxy_args, self._proxy_strict) if proxy_args is not None else None  # fmt: skip
            except BaseException as exc:
                _report_ready(ready_w, exc)
                raise
            _report_ready(ready_w, None)
            if proxy_args is not None:
                from .proxy import serve_via_proxy

                serve_via_proxy(cfg, *proxy_args, watch_fd=watch_fd, first=first, strict=self._proxy_strict)  # fmt: skip
            else:
                serve_forever(self._sock, cfg, watch_fd=watch_fd)

        pid = self._fork(serve)
        os.close(ready_w)
        if self._sock is not None:
            self._sock.close()
        try:
            _await_ready(ready_r, pid)
        except BaseException:
            self.terminate()
            raise

    def _cleanup(self) -> None:
        shutil.rmtree(self._temp_root, ignore_errors=True)


def _first_proxy_link(proxy_args: tuple, strict: bool = True) -> tuple:
    """Register with the proxy once before reporting ready: a refusal raises in the constructor."""
    import secrets

    from .proxy import register_with_proxy

    server_id = secrets.token_hex(8)
    return register_with_proxy(*proxy_args, server_id, strict=strict), server_id


def _check_proxied(token: bytes | None, allow_insecure_bind: bool) -> None:
    """A server behind a proxy is reachable by whoever reaches the proxy: it needs a token."""
    if token is None and not allow_insecure_bind:
        raise RPCError(
            "refusing to serve through a proxy without a token: anyone who reaches the proxy "
            "could run code here (the proxy's token only guards server registration). Give "
            "token= (or set DISCO_TOKEN), or pass allow_insecure_bind=True if the network is "
            "trusted"
        )


# --------------------------------------------------------------------------- over pipes
def serve_stdio(load_library: Any = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES) -> None:  # fmt: skip
    """Serve one session over this process's stdin/stdout (for :class:`PopenSession`).

    What the served functions print goes to stderr, so it cannot corrupt the stream.
    """
    rfd, wfd = os.dup(0), os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    libs = load_libraries(load_library)
    conn = wire.Conn(wire.PipeTransport(rfd, wfd), max_message_bytes)
    # PopenSession makes the work folder and removes it, even after a crash here.
    handler = SessionHandler(os.environ.get(WORK_DIR_ENV) or None, libs)
    try:
        if not auth.server_handshake(conn, "", None):
            return
        cfg = ServerConfig(max_message_bytes=int(max_message_bytes))
        timeout, _inner, _log = _init_session(conn, cfg, handler)
        if timeout is False:
            return
        serve_conn(conn, handler)
    except (EOFError, OSError):
        pass
    finally:
        handler.close()
