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
import dataclasses
import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disco_core import DiscoTypeError, DiscoValueError
from disco_core.spi import env_seconds, is_loopback, may_poll_beside, placement, relay

from . import auth, wire
from .errors import ProtocolError, RPCError
from .handler import (
    BEATS_ALWAYS,
    BEATS_IDLE,
    OP_INIT,
    WORK_DIR_ENV,
    SessionHandler,
    error_value,
    link_prefix,
    serve_conn,
    session_prefix,
)
from .popen import PipeChild
from .protocol import (
    ERROR,
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
from .scratch import owned_scratch_dir, release, remove
from .service import (
    DEFAULT_LIVENESS_TIMEOUT,
    LIVENESS_ENV,
    MIN_LIVENESS_TIMEOUT,
    Liveness,
    Registration,
    ServiceProcess,
    bind_listener,
    can_watch,
    check_bind,
    exit_on_term,
    fork_session,
    is_stopped,
    resolve_liveness_timeout,
    run_time_ns,
    set_pdeathsig,
    start_watchdog,
)
from .stops import stops_held

__all__ = [
    "prepare_work_dir",
    "Server",
    "serve_stdio",
    "serve_forever",
    "ServerConfig",
    "check_bind",
    "is_loopback",
    "bind_listener",
    "load_libraries",
    "split_load_library",
    "HANDSHAKE_TIMEOUT",
    # the liveness of a session's client (disco_rpc.service)
    "LIVENESS_ENV",
    "DEFAULT_LIVENESS_TIMEOUT",
    "MIN_LIVENESS_TIMEOUT",
    "resolve_liveness_timeout",
    # a server behind a proxy
    "register_with_proxy",
    "serve_via_proxy",
    "MAX_PROXIED_HANDSHAKES",
]

logger = logging.getLogger("disco_rpc.server")

#: A server's scratch folder in the temporary directory (removed by the next server
#: started, if its own process and its maker were killed: see ``scratch``).
TEMP_PREFIX = "disco-rpc-server-"

#: Seconds a client has to complete the handshake.
HANDSHAKE_TIMEOUT = 10.0
#: Handshakes in progress at most; beyond, the oldest is dropped.
MAX_PENDING_HANDSHAKES = 64


#: how a server reaches its proxy: (host, port, key, token, ssl_context)
_ProxyArgs = tuple[str, int, str, Any, Any]


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
    #: the longest any session may last (``Server(session_timeout=...)``; None: no limit)
    session_timeout: float | None = None
    #: seconds a connecting client has for its handshake and session request (TVM's
    #: ``Server(timeout=...)`` lowers it; never above ``HANDSHAKE_TIMEOUT``)
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    no_fork: bool = False
    libs: list = field(default_factory=list)
    #: the link to a tracker (listener side), when the server registered with one
    registration: Any = None
    #: behind a proxy: accept ``key`` and ``key@ticket`` (the proxy checked the ticket)
    behind_proxy: bool = False
    #: seconds of silence after which a session's client is dead or frozen (0: never)
    liveness_timeout: float = 0.0


def split_load_library(load_library: Any) -> list[str]:
    """The files of a ``load_library`` argument: a list, or one string separated by ``:``
    (TVM 0.27's separator) or ``,`` (this project's earlier one).

    A string that names an existing file as a whole is that one file, separators
    and all, so no path that exists is split.
    """
    if not load_library:
        return []
    if isinstance(load_library, (str, os.PathLike)):
        text = os.fspath(load_library)
        if os.path.isfile(text):
            return [text]
        return [p for p in re.split("[:,]", text) if p]
    return [os.fspath(p) for p in load_library]


def load_libraries(load_library: Any) -> list:
    """Load ``.py`` files (their ``register_func`` calls run) and shared libraries.

    ``load_library`` is a list of paths or one string of them (:func:`split_load_library`);
    relative paths are taken from the current folder, as TVM's.
    """
    load_library = split_load_library(load_library)
    libs = []
    for path in load_library:
        path = os.path.abspath(os.fspath(path))
        if path.endswith(".py"):
            from disco_core.spi import load_py

            load_py(path)
        else:
            libs.append(ctypes.CDLL(path, mode=getattr(ctypes, "RTLD_GLOBAL", 0)))
    return libs


def prepare_work_dir(path: Any, name: str = "work_dir") -> str:
    """``path`` made (with its parents) and checked as a writable folder; its absolute path.

    Before anything is started (a server process, a scratch folder): a path that was a
    file was accepted, and the server process died with a raw traceback after its
    constructor had returned (an outside check).
    """
    try:
        where = os.path.abspath(os.path.expanduser(os.fspath(path)))
    except TypeError:
        raise DiscoTypeError(f"{name} must be a path, got {type(path).__name__} {path!r}") from None
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as exc:
        raise DiscoValueError(f"{name} {where!r} cannot be made: {exc.strerror or exc}") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise DiscoValueError(f"{name} {where!r} is not a folder this user can write to")
    return where


def _positive_or_none(value: Any, name: str) -> float | None:
    """``value`` as seconds (> 0), or None for no limit; anything else is refused."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise DiscoTypeError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise DiscoValueError(f"{name} must be > 0 seconds (None: no limit), got {value!r}")
    return seconds


def handshake_timeout(timeout: Any) -> float:
    """TVM's ``Server(timeout=...)`` (and ``Tracker``'s): the handshake's time, capped by ``HANDSHAKE_TIMEOUT``."""
    seconds = _positive_or_none(timeout, "timeout")
    return HANDSHAKE_TIMEOUT if seconds is None else min(seconds, HANDSHAKE_TIMEOUT)


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
        sock.settimeout(cfg.handshake_timeout)
        handler = SessionHandler(cfg.work_dir or None, cfg.libs, cfg.temp_root)
        if on_handler is not None:
            on_handler(handler)
        timeout, inner, log_relay = _init_session(conn, cfg, handler)
        if timeout is False:
            return
        sock.settimeout(None)
        if timeout:
            start_watchdog(timeout, sock, handler, forked)
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


def _remove_session_folders(temp_root: str | None, pid: int) -> None:
    """Remove the folders the session process ``pid``, which ended, made in ``temp_root``
    (its own removal did not run when it was killed or crashed)."""
    if not temp_root:
        return
    starts = (session_prefix(pid), link_prefix(pid))
    try:
        names = [n for n in os.listdir(temp_root) if n.startswith(starts)]
    except OSError:
        return
    for name in names:  # (nobody writes there any more: no retries in the server's loop)
        shutil.rmtree(os.path.join(temp_root, name), ignore_errors=True)


def _proxy_key_check(cfg: ServerConfig):
    if cfg.behind_proxy and cfg.key:
        key = cfg.key.encode()
        prefix = key + TICKET_SEP.encode()
        return lambda kb: kb == key or kb.startswith(prefix)
    return None


def _init_session(conn: wire.Conn, cfg: ServerConfig, handler: SessionHandler):
    """Read the INIT request; return ``(timeout, inner conn or None, log relay)``.

    ``timeout`` is ``False`` when the session must end at once. INIT carries
    ``(session_timeout, constructor, client max_message_bytes, heartbeats, placement,
    call beats)`` (the later ones optional); the reply tells the client this server's
    limits (``max_message_bytes``, ``server_timeout``) and its ``placement``: two
    processes pinned to one CPU do not poll for each other's frames. A client that
    asks for call beats (``True``) gets heartbeats while its calls run, every
    ``call_beats`` seconds of the reply at most, from the server that runs its
    session (this one, or the inner one of a chained session).
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
        want_beats = len(init) > 5 and init[5] is True
        if len(init) > 4 and not may_poll_beside(init[4]):
            wire.stop_polling(conn)
        timeout = _min_positive(session_timeout, cfg.session_timeout)
        inner, log_relay = None, False
        info = {
            "pid": os.getpid(),
            "version": auth.VERSION,
            "work_dir": handler.work,
            "max_message_bytes": cfg.max_message_bytes,
            "server_timeout": float(cfg.session_timeout or 0),
        }
        if ctor:
            inner, info, log_relay = _construct(
                ctor, timeout, cfg, conn.peer_max, beats, want_beats
            )
            child = getattr(inner, "child", None)  # rpc.PopenSession's: ends with the session
            if child is not None:
                handler.on_close.append(lambda: child.close(grace=0))
        info["placement"] = placement()  # this process's: the client's peer is this one
        own = cfg.liveness_timeout if can_watch(conn) else 0.0
        lt = _min_positive(own, info.get("liveness_timeout"))
        if lt:
            info["liveness_timeout"] = lt  # the client sends heartbeats well within it
        if inner is None:  # served here: this process beats (a chained one's are the inner's)
            conn.call_beats = bool(want_beats and own)  # read by _start_liveness
            info.pop("call_beats", None)
            if conn.call_beats:
                info["call_beats"] = min(1.0, own / 4)  # the watchdog's check
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
    ctor: list, timeout: float, cfg: ServerConfig, client_max: int | None, beats: int = 0,
    want_beats: bool = False,
):  # fmt: skip
    """Build the session ``ctor`` names; return ``(inner conn or None, info, log relay)``."""
    name, args = ctor[0], list(ctor[1:])
    if name in ("rpc.LocalSession", "LocalSession"):
        return None, {"pid": os.getpid(), "version": auth.VERSION}, False
    if name in ("rpc.PopenSession", "PopenSession"):
        return _construct_popen(args, timeout, cfg, client_max, beats)
    if name not in ("rpc.Connect", "Connect"):
        raise DiscoValueError(
            f"unknown session constructor {name!r}; known: rpc.LocalSession, rpc.Connect, "
            "rpc.PopenSession"
        )
    host, port, key, enable_logging, options, rest = connect_args(args)
    inner = auth.open_conn(
        host, port, key, token=options.get("token"),
        max_message_bytes=cfg.max_message_bytes, peer="inner RPC server",
    )  # fmt: skip
    # the client's heartbeats pass through the relay: the inner server may count on them
    # and the inner server's call beats pass back to the client
    inner.send(wire.REQUEST, OP_INIT, ((), (timeout, rest, client_max, beats, None, want_beats)))
    kind, _op, info = inner.recv()
    if kind != REPLY:
        exc_type, msg, _tb = info
        inner.close()
        raise RPCError(f"the inner server refused the session: {exc_type}: {msg}")
    info = dict(info)
    info["via"] = f"{host}:{port}"
    # this server ends the chained session at its own limit too
    info["server_timeout"] = _min_positive(cfg.session_timeout, info.get("server_timeout"))
    return inner, info, enable_logging


def _construct_popen(args: list, timeout: float, cfg: ServerConfig, client_max: int | None, beats: int):  # fmt: skip
    """``["rpc.PopenSession", binary]``: run the client's binary here and relay to it, as TVM.

    Only the bytes of an executable (a :func:`disco_rpc.with_minrpc` output) are
    accepted, not a path on this machine: the client's program runs in a folder of
    its own, removed with the session.
    """
    if len(args) != 1 or not isinstance(args[0], (bytes, bytearray)):
        raise DiscoTypeError(
            "rpc.PopenSession takes the bytes of the server binary: "
            '["rpc.PopenSession", open(path, "rb").read()], not '
            f"{[type(a).__name__ for a in args]}"
        )
    child = PipeChild(bytes(args[0]), max_message_bytes=cfg.max_message_bytes, temp_root=cfg.temp_root, die_with_parent=True)  # fmt: skip
    try:
        child.handshake(HANDSHAKE_TIMEOUT)
        inner = child.conn
        inner.t.settimeout(HANDSHAKE_TIMEOUT)
        # the client's heartbeats pass through the relay: the child skips them
        inner.send(wire.REQUEST, OP_INIT, ((), (timeout, [], client_max, beats)))
        kind, _op, info = inner.recv()
        inner.t.settimeout(None)
        if kind != REPLY:
            exc_type, msg, _tb = info
            raise RPCError(f"the popen server refused the session: {exc_type}: {msg}")
    except TimeoutError:
        child.close()
        raise RPCError(
            f"the popen server did not start its session within {HANDSHAKE_TIMEOUT:g} s"
        ) from None
    except BaseException:
        child.close()
        raise
    info = dict(info)
    info["via"] = "popen"
    info["server_timeout"] = _min_positive(cfg.session_timeout, info.get("server_timeout"))
    return inner, info, False


def _relay(outer: wire.Conn, inner: wire.Conn, log: bool = False) -> None:
    """Copy bytes both ways until either side closes (a chained session).

    :func:`disco_core.net.relay.relay` reads a sealed side record by record and
    passes a record on only once its tag verified (sealed again when the other
    side is sealed): nothing forged on one link reaches the other.
    """
    owed = [src.take_buffered() for src in (outer, inner)]  # read past their last frames
    if log:
        sock = getattr(inner.t, "sock", None)  # a popen session's child has pipes
        peer = sock.getpeername() if sock is not None else "a child process"
        logger.info("relaying a chained session to %s", peer)
    moved = (0, 0)
    try:
        moved = relay(outer.t, inner.t, owed[0], owed[1])
    finally:
        if log:
            logger.info("chained session ended: %d bytes to the inner server, %d back", *moved)
        inner.close()


def _start_liveness(conn: wire.Conn, addr: Any, cfg: ServerConfig, handler: SessionHandler, forked: bool, relay: bool = False) -> Liveness | None:  # fmt: skip
    """Watch the session's client (see :class:`Liveness`); None when off or impossible."""
    if not cfg.liveness_timeout or not can_watch(conn):
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

    live = Liveness(conn, addr, cfg.liveness_timeout, getattr(conn, "peer_beats", 0), end, relay, call_beats=getattr(conn, "call_beats", False))  # fmt: skip
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
        self.deadline = time.monotonic() + cfg.handshake_timeout
        self.hs = auth.ServerHandshake(cfg.key, cfg.token, key_check)
        self.buf = bytearray()
        #: Why a refused client was refused, as the server's log says it.
        self.why = "key, version or authentication"

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
                self.sock.do_handshake()  # type: ignore[attr-defined]  # an SSLSocket
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
            if isinstance(exc, ssl.SSLError) and exc.reason:
                self.why = f"TLS: {exc.reason}"  # e.g. PEER_DID_NOT_RETURN_A_CERTIFICATE
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


class _StoppedSessions:
    """Kills a session process stopped (``SIGSTOP``) for longer than twice the liveness
    bound (``liveness_timeout``; 0: never).

    Its own watchdog cannot run while it is stopped, so nothing else would end it: it
    kept its server out of the tracker's pool for good after its client had given up,
    and a client in a call with it waited for good without ``session_timeout`` (outside
    check). Looked at once a second at most, by the loop that reaps the sessions.
    """

    def __init__(self, liveness_timeout: float) -> None:
        self.bound = 2 * float(liveness_timeout or 0)
        #: pid -> (when it was seen stopped and not run since, its run time then)
        self.since: dict[int, tuple[float, int]] = {}
        self.looked = 0.0

    def forget(self, pid: int) -> None:
        self.since.pop(pid, None)

    def check(self, pids: Any) -> None:
        now = time.monotonic()
        if not self.bound or now - self.looked < 1.0:
            return
        self.looked = now
        for pid in list(pids):
            if not is_stopped(pid):
                self.since.pop(pid, None)
                continue
            # stopped now; if it ran since the last look (stopped again and again, each
            # time briefly, between two looks), the clock starts over
            ran = run_time_ns(pid)
            seen = self.since.get(pid)
            if seen is None or seen[1] != ran:
                self.since[pid] = (now, ran)
                continue
            if now - seen[0] > self.bound:
                logger.warning(
                    "killing session process %d: stopped (SIGSTOP) for over %g s, twice the "
                    "liveness timeout", pid, self.bound,
                )  # fmt: skip
                try:
                    os.killpg(pid, signal.SIGKILL)  # (a session process leads its own group)
                except (ProcessLookupError, PermissionError):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


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
        self.stopped = _StoppedSessions(cfg.liveness_timeout)
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
        return lambda kb: True if reg.accepts(kb) is not None else reg.refusal(kb)

    def _advance(self, hs: _Handshake) -> None:
        ok = hs.advance()
        if ok is None:
            return
        self.pending.remove(hs)
        if not ok:
            logger.warning("refused a client from %s (%s)", hs.addr, hs.why)
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
        signal.signal(signal.SIGTERM, exit_on_term)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        set_pdeathsig()
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
        self.stopped.check(self.children)
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if not done:
                continue
            ticket, pidfd = self.children.pop(pid)
            self.stopped.forget(pid)
            if pidfd is not None:
                os.close(pidfd)
            _remove_session_folders(self.cfg.temp_root, pid)  # what a process that died left
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


def serve_forever(listen_sock: socket.socket, cfg: ServerConfig, watch_fd: int | None = None) -> None:  # fmt: skip
    """Accept clients on ``listen_sock`` until SIGTERM/SIGINT or ``watch_fd`` closes."""
    signal.signal(signal.SIGTERM, exit_on_term)
    lock = None
    # One try from the scratch folder on: a SIGTERM or Ctrl-C as the server starts (a
    # supervisor stops it once it says it listens) left the folder behind (a test's
    # leftovers check, once in four runs of the suites)
    try:
        if not cfg.temp_root:
            with stops_held():  # made, and known here to be removed, as one step
                cfg.temp_root, lock = owned_scratch_dir(TEMP_PREFIX)
        if cfg.work_dir:
            os.makedirs(cfg.work_dir, exist_ok=True)  # (checked by the callers: prepare_work_dir)
        listen_sock.setblocking(True)
        listener = _Listener(listen_sock, cfg, watch_fd)
        try:
            listener.run()
        finally:
            listener.close()
    finally:
        if cfg.temp_root:
            remove(cfg.temp_root)
        release(lock)


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


# --------------------------------------------------------------------------- start-up report
def _start_timeout() -> float:
    return env_seconds("DISCO_START_TIMEOUT", 60.0)


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
        ``token`` or an ``ssl_context`` that requires client certificates, unless
        ``allow_insecure_bind=True``.
    port, port_end : int
        The first free port in ``[port, port_end)`` is used (``server.port``).
    is_proxy : bool
        ``host:port`` name an RPC proxy (:class:`disco_rpc.Proxy`): the server connects
        out to it (``proxy_token``/``proxy_ssl_context`` for that link) and serves the
        clients the proxy pairs with it, one session at a time. Anyone who reaches
        the proxy reaches the server, so a ``token`` is required unless
        ``allow_insecure_bind=True``.
    tracker_addr : tuple of str and int, optional
        Register with this tracker under ``key`` (``tracker_token``/``tracker_ssl_context``
        for that link; by default ``$DISCO_TRACKER_TOKEN``, else the server's ``token``,
        which the tracker must then hold and prove). The server then serves only
        clients holding a ticket from the tracker, and reports each session's end.
    key : str
        Clients must present this key (an empty key accepts any).
    load_library : str or list of str
        Files loaded in the server at start: ``.py`` files (their ``register_func``
        calls run) and shared libraries (their symbols reach ``system_lib()``). One
        string may name several, separated by ``:`` (TVM 0.27's separator) or ``,``.
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
        As TVM's, a timeout for the operations on the server's socket, not a limit
        on sessions: a client that connects has this long to complete its handshake
        and session request (at most ``HANDSHAKE_TIMEOUT``, 10 s, the server's
        bound on work before authentication; that bound by default).
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
        Allow a non-loopback address with neither token nor TLS that requires client certificates (and ``is_proxy``
        without a token).
    liveness_timeout : float, optional
        Seconds without a sign of life after which a session's client counts as
        frozen or gone: the session ends (its process exits, its tracker slot comes
        back). Clients send heartbeats when they have sent nothing for a quarter of
        it, during long calls too. A client that closed its connection (it died) is
        noticed within a second. Default ``$DISCO_RPC_LIVENESS_TIMEOUT``, else 8;
        0 turns the checks off. See the README, "Liveness".
    session_timeout : float, optional
        The longest any session may last, in seconds (a client's own
        ``session_timeout`` may only shorten it); None: no limit.
    """

    _kind = "Server"
    _temp_root: str | None = None
    _temp_lock: int | None = None  # holds the scratch folder's lock (see scratch)

    def __init__(self, host: str = "127.0.0.1", port: int = 9091, port_end: int = 9199, is_proxy: bool = False, tracker_addr: Any = None, key: str = "", load_library: Any = None, custom_addr: str | None = None, silent: bool = False, no_fork: bool = False, server_init_callback: Any = None, reuse_addr: bool = True, timeout: float | None = None, *, token: Any = None, ssl_context: Any = None, work_dir: str | None = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, allow_insecure_bind: bool = False, tracker_token: Any = None, tracker_ssl_context: Any = None, proxy_token: Any = None, proxy_ssl_context: Any = None, liveness_timeout: float | None = None, session_timeout: float | None = None) -> None:  # fmt: skip
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
            work_dir=prepare_work_dir(work_dir) if work_dir else "",
            max_message_bytes=wire.check_message_limit(max_message_bytes),
            session_timeout=_positive_or_none(session_timeout, "session_timeout"),
            handshake_timeout=handshake_timeout(timeout),
            no_fork=no_fork,
            behind_proxy=is_proxy,
            liveness_timeout=resolve_liveness_timeout(liveness_timeout),
        )
        self._sock = None
        reg = None
        auth.stretch_now(token_b)  # here, not in the first client's handshake
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
                reg = self._register(cfg, tracker_addr, tracker_token if tracker_token is not None else auth.tracker_token_or(token), tracker_ssl_context)  # fmt: skip
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
        if not self.key:
            self._sock.close()  # type: ignore[union-attr]  # a tracker's server listens
            raise DiscoValueError("a server that registers with a tracker needs a key")
        try:
            cfg.registration = Registration(
                tracker_addr, self.key, (self.custom_addr or self.host, self.port),
                token=token, ssl_context=ssl_context,
            )  # fmt: skip
        except BaseException:
            self._sock.close()  # type: ignore[union-attr]
            raise
        return cfg.registration

    def _start(self, cfg: ServerConfig, load_library: Any, init_callback: Any, proxy_args: _ProxyArgs | None) -> None:  # fmt: skip
        """Fork the server process; return once it reported ready (or raise its error)."""
        # made here, so that terminate() removes it even if the server process was killed
        # (and the next server removes it if this process was killed too)
        ready_r, ready_w = os.pipe()
        try:
            self._temp_root, self._temp_lock = owned_scratch_dir(TEMP_PREFIX)
        except BaseException:
            os.close(ready_r)
            os.close(ready_w)
            raise
        cfg.temp_root = self._temp_root

        def serve(watch_fd: int) -> None:
            os.close(ready_r)
            try:
                cfg.libs = load_libraries(load_library)
                if init_callback is not None:
                    init_callback()
                first = _first_proxy_link(proxy_args, self._proxy_strict) if proxy_args is not None else None  # fmt: skip
            except BaseException as exc:
                _report_ready(ready_w, exc)
                # The constructor raises it with this traceback: printing it here too
                # put a second, raw copy on stderr (an outside check).
                os._exit(1)
            _report_ready(ready_w, None)
            if proxy_args is not None:
                serve_via_proxy(cfg, *proxy_args, watch_fd=watch_fd, first=first, strict=self._proxy_strict)  # fmt: skip
            else:
                serve_forever(self._sock, cfg, watch_fd=watch_fd)  # type: ignore[arg-type]  # not proxied: listening

        try:
            pid = self._fork(serve)
        except BaseException:  # (terminate() removes the folder only once there is a process)
            os.close(ready_r)
            os.close(ready_w)
            self._cleanup()
            raise
        os.close(ready_w)
        if self._sock is not None:
            self._sock.close()
        try:
            _await_ready(ready_r, pid)
        except BaseException:
            self.terminate()
            raise

    def _cleanup(self) -> None:
        if self._temp_root is not None:
            remove(self._temp_root)
        release(self._temp_lock)
        self._temp_lock = None


def _first_proxy_link(proxy_args: _ProxyArgs, strict: bool = True) -> tuple:
    """Register with the proxy once before reporting ready: a refusal raises in the constructor."""
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


# --------------------------------------------------------------------------- behind a proxy
_proxy_log = logging.getLogger("disco_rpc.proxy")

#: Handshakes a server behind the proxy runs at once; beyond, the oldest is dropped.
MAX_PROXIED_HANDSHAKES = 64


def register_with_proxy(host: str, port: int, key: str, token: Any, ssl_context: Any, server_id: str, *, strict: bool = True) -> wire.Conn:  # fmt: skip
    """Connect to the proxy and register as an idle server of ``key``; return the link.

    ``strict=False``: ``token`` is only offered (the server's own token, by default
    also the proxy link's): a proxy that requires none is accepted.
    """
    if not key:
        raise DiscoValueError("a server behind a proxy needs a key")
    conn = auth.open_conn(
        host, port, PROXY_SERVER_KEY, token=token, ssl_context=ssl_context,
        max_message_bytes=PROXY_MAX_MESSAGE_BYTES, connect_timeout=5.0, peer="proxy",
        strict=strict,
    )  # fmt: skip
    try:
        conn.t.settimeout(10.0)  # the proxy answers at once: one that does not is not waited for
        conn.send(REQUEST, P_REGISTER, (key, server_id))
        conn.recv()
        conn.t.settimeout(None)
    except BaseException:
        conn.close()
        raise
    return conn


def serve_via_proxy(cfg: Any, host: str, port: int, key: str, token: Any, ssl_context: Any, watch_fd: int | None = None, first: tuple | None = None, strict: bool = True) -> None:  # fmt: skip
    """Serve sessions through the proxy at ``host:port``, one at a time, until told to stop.

    ``first``: ``(conn, server_id)`` of a registration already made (the server's
    constructor makes the first one, so that a refused token raises there).

    While no session runs, the server keeps one idle link registered at the
    proxy. When the proxy pairs a client with it, the link becomes that client's
    and a new idle link is registered at once; the client's handshake (end to
    end, through the proxy) runs here, in the server process, without blocking,
    beside those of other clients (at most :data:`MAX_PROXIED_HANDSHAKES`, each
    within ``disco_rpc.server.HANDSHAKE_TIMEOUT``). Only a client that proved the token gets a
    session process: a peer that never authenticates costs a socket for a few
    seconds and no process (a flood of them can still crowd out a slow client: the oldest
    handshake is dropped when all slots are taken). The first client to prove the token
    gets the session; the others whose handshakes ran beside it are told
    :data:`~disco_rpc.protocol.SERVER_TAKEN` and connect again, to be held by the proxy.
    """
    server_id = first[1] if first is not None else secrets.token_hex(8)
    idle = first[0] if first is not None else None
    scfg = dataclasses.replace(cfg, ssl_context=None)  # TLS, if any, is the link to the proxy
    key_check = _proxy_key_check(scfg)
    pending: list[_Handshake] = []
    session: tuple[int, int | None] | None = None  # (pid, pidfd) of the session process
    stopped = _StoppedSessions(cfg.liveness_timeout)
    backoff, next_try = 0.05, 0.0
    where = ("proxy", host, port)

    def drop(hs: _Handshake, why: str) -> None:
        _proxy_log.info("client through the proxy: %s", why)
        if hs in pending:
            pending.remove(hs)
        hs.close()

    try:
        while True:
            now = time.monotonic()
            if session is None and idle is None and now >= next_try:
                try:
                    idle = register_with_proxy(host, port, key, token, ssl_context, server_id, strict=strict)  # fmt: skip
                    backoff = 0.05
                except (RPCError, OSError, EOFError, wire.ProtocolError) as exc:
                    _proxy_log.info("cannot reach the proxy at %s:%s: %s", host, port, exc)
                    next_try = now + backoff
                    backoff = min(backoff * 2, 2.0)
            watch = [hs.fileno() for hs in pending]
            if idle is not None:
                watch.append(idle.t.fileno())
            if watch_fd is not None:
                watch.append(watch_fd)
            timeout = 1.0
            if session is not None:
                if session[1] is not None:
                    watch.append(session[1])
                else:
                    timeout = 0.05  # no pidfd: poll for the session's end
            elif idle is None:
                timeout = max(0.0, min(timeout, next_try - now))
            if pending:
                timeout = max(0.0, min(timeout, min(h.deadline for h in pending) - now))
            # the proxy's P_PAIRED may sit in the idle link's read buffer, unseen by select
            if idle is not None and idle.buffered():
                ready: set = {idle.t.fileno()}
            else:
                try:
                    ready = set(select.select(watch, [], [], timeout)[0])
                except InterruptedError:
                    ready = set()
            if watch_fd is not None and watch_fd in ready:
                return
            if session is not None:
                stopped.check([session[0]])
            if session is not None and _session_ended(session):
                stopped.forget(session[0])
                session = None
            if idle is not None and idle.t.fileno() in ready:
                sock, idle = _take_pairing(idle), None
                if sock is not None:
                    if len(pending) >= MAX_PROXIED_HANDSHAKES:
                        drop(pending[0], "too many handshakes in progress; dropped the oldest")
                    try:
                        hs = _Handshake(sock, where, scfg, key_check)
                    except (OSError, ValueError) as exc:
                        _proxy_log.info("cannot start a handshake through the proxy: %s", exc)
                        sock.close()
                    else:
                        pending.append(hs)
                        ready.add(hs.fileno())  # the hello is often there already
            for hs in [h for h in pending if h.fileno() in ready]:
                if hs not in pending:  # dropped meanwhile: another client's session started
                    continue
                ok = hs.advance()
                if ok is None:
                    continue
                if not ok:
                    if hs.hs.told_taken:  # a wrong token after that is still "refused"
                        drop(hs, "told it another client's session started first: it comes back through the proxy")  # fmt: skip
                    else:
                        _proxy_log.warning("refused a client through the proxy (key, version or authentication)")  # fmt: skip
                        drop(hs, "refused")
                    continue
                pending.remove(hs)
                if session is not None:  # not reached: a handshake of a taken server never lets in
                    hs.close()
                    continue
                session = _fork_proxied_session(hs, scfg, watch_fd, where)
                for other in pending:
                    # one session at a time: the others' handshakes go on, and end by
                    # telling each client that proves the token to connect again (the
                    # proxy then holds it until this session ends), not by a bare close
                    other.hs.taken = True
                if idle is not None:
                    idle.close()  # no pairing while the session runs
                    idle = None
            for hs in [h for h in pending if h.deadline <= time.monotonic()]:
                drop(hs, "handshake timed out")
    finally:
        for hs in pending:
            hs.close()
        if idle is not None:
            idle.close()
        if session is not None:
            try:
                os.kill(session[0], signal.SIGKILL)
                os.waitpid(session[0], 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _take_pairing(idle: wire.Conn) -> socket.socket | None:
    """The proxy paired a client with ``idle`` (or the link broke): acknowledge; return its socket."""
    try:
        idle.t.settimeout(10.0)  # select saw the frame begin; the rest follows at once
        _k, op, _v = idle.recv()
        if op != P_PAIRED:
            raise wire.ProtocolError(f"unexpected message {op} from the proxy")
        idle.send(REPLY, P_ACK, None)
        idle.t.settimeout(None)
    except (OSError, EOFError, wire.ProtocolError) as exc:
        _proxy_log.info("lost the proxy: %s", exc)
        idle.close()
        return None
    # what follows on this socket is the client's own stream, relayed by the proxy
    return idle.t.sock


def _fork_proxied_session(hs: Any, cfg: Any, watch_fd: int | None, where: tuple) -> tuple:
    """Fork the session process of an authenticated client; return ``(pid, pidfd)``."""
    hs.sock.setblocking(True)
    conn = hs.conn(cfg)

    def session() -> None:  # in the session process
        signal.signal(signal.SIGTERM, exit_on_term)
        set_pdeathsig()
        if watch_fd is not None:
            os.close(watch_fd)
        serve_session(conn, where, cfg, True)

    out = fork_session(session)
    hs.close()
    return out


def _session_ended(session: tuple) -> bool:
    pid, pidfd = session
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        done = pid
    if done and pidfd is not None:
        os.close(pidfd)
    return bool(done)
