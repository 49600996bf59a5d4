"""The RPC server: a listening process that serves each session in its own process.

``Server(...)`` binds in the calling process (so the port is known at once and a
refused address raises there), then forks the server process, which accepts
connections and forks one process per session (threads with ``no_fork=True``).
Each session authenticates first; only then is anything but fixed-size
handshake fields read from the peer.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import os
import select
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from . import auth, wire
from .errors import ProtocolError, RPCError
from .handler import OP_INIT, SessionHandler, error_value, serve_conn
from .tracker import T_END, T_START, TICKET_SEP, ticket_key
from .wire import ERROR, REPLY

__all__ = ["Server", "serve_stdio", "serve_forever", "ServerConfig"]

logger = logging.getLogger("disco_rpc.server")

HANDSHAKE_TIMEOUT = 10.0


@dataclass
class ServerConfig:
    key: str = ""
    token: bytes | None = None
    ssl_context: Any = None
    work_root: str = ""
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    timeout: float | None = None
    no_fork: bool = False
    libs: list = field(default_factory=list)
    #: the link to a tracker (listener side), when the server registered with one
    registration: Any = None
    #: tickets a session process may accept (a snapshot taken when it was forked)
    tickets: frozenset = frozenset()
    #: where a session reports the ticket it accepted (a pipe to the listener)
    report_fd: int | None = None
    #: behind a proxy: accept ``key`` and ``key@ticket`` (the proxy checked the ticket)
    behind_proxy: bool = False


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
            from disco_core.loaders import load_py

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


# --------------------------------------------------------------------------- one session
def run_session(sock: socket.socket, addr: Any, cfg: ServerConfig, forked: bool) -> None:
    """Handshake, then serve one client until it leaves or its time is up."""
    handler = None
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        if cfg.ssl_context is not None:
            sock = cfg.ssl_context.wrap_socket(sock, server_side=True)
        if isinstance(sock, ssl.SSLSocket):
            transport: Any = wire.SSLTransport(sock)
        else:
            transport = wire.SocketTransport(sock)
        conn = wire.Conn(transport, cfg.max_message_bytes)
        if not auth.server_handshake(conn, cfg.key, cfg.token, key_check=_key_check(cfg)):
            logger.warning("refused a client from %s (key, version or authentication)", addr)
            return
        if cfg.registration is not None and cfg.report_fd is not None:
            ticket = conn.peer_key.rpartition(TICKET_SEP)[2]
            try:
                os.write(cfg.report_fd, ticket.encode() + b"\n")
            except OSError:
                pass
        handler = SessionHandler(cfg.work_root or None, cfg.libs)
        timeout, inner = _init_session(conn, cfg, handler)
        if timeout is False:
            return
        sock.settimeout(None)
        if timeout:
            _start_watchdog(timeout, sock, handler, forked)
        logger.info("session from %s (pid %d)", addr, os.getpid())
        if inner is not None:
            _relay(conn, inner)
        else:
            serve_conn(conn, handler)
    except (OSError, EOFError, ProtocolError) as exc:
        logger.info("session from %s ended: %s", addr, exc)
    finally:
        if handler is not None:
            handler.close()
        try:
            sock.close()
        except OSError:
            pass


def _key_check(cfg: ServerConfig):
    if cfg.registration is not None:
        allowed = {ticket_key(cfg.key, t).encode() for t in cfg.tickets}
        return allowed.__contains__
    if cfg.behind_proxy and cfg.key:
        key = cfg.key.encode()
        prefix = key + TICKET_SEP.encode()
        return lambda kb: kb == key or kb.startswith(prefix)
    return None


def _init_session(conn: wire.Conn, cfg: ServerConfig, handler: SessionHandler):
    """Read the INIT request; return ``(timeout, inner conn or None)``, or ``(False, None)``."""
    try:
        _kind, op, payload = conn.recv()
        if op != OP_INIT:
            raise ProtocolError("the first request of a session must be INIT")
        _frees, (session_timeout, ctor) = payload
        session_timeout = float(session_timeout or 0)
        timeouts = [t for t in (session_timeout, cfg.timeout or 0) if t and t > 0]
        timeout = min(timeouts) if timeouts else 0.0
        inner = None
        info = {"pid": os.getpid(), "version": auth.VERSION, "work_dir": handler.work}
        if ctor:
            inner, info = _construct(ctor, timeout, cfg)
        conn.send(REPLY, OP_INIT, info)
        return timeout, inner
    except (EOFError, OSError):
        return False, None
    except Exception as exc:
        try:
            conn.send(ERROR, OP_INIT, error_value(exc))
        except OSError:
            pass
        return False, None


def _construct(ctor: list, timeout: float, cfg: ServerConfig):
    name, args = ctor[0], list(ctor[1:])
    if name in ("rpc.LocalSession", "LocalSession"):
        return None, {"pid": os.getpid(), "version": auth.VERSION}
    if name in ("rpc.Connect", "Connect"):
        if len(args) < 2:
            raise ValueError('rpc.Connect needs ["rpc.Connect", host, port, key]')
        host, port = args[0], int(args[1])
        key = args[2] if len(args) > 2 else ""
        token = args[3] if len(args) > 3 and args[3] else None
        rest = args[4:]
        from .client import open_conn

        inner = open_conn(host, port, key, token=token, max_message_bytes=cfg.max_message_bytes)
        inner.send(wire.REQUEST, OP_INIT, ((), (timeout, rest)))
        kind, _op, info = inner.recv()
        if kind != REPLY:
            exc_type, msg, _tb = info
            raise RPCError(f"the inner server refused the session: {exc_type}: {msg}")
        info = dict(info)
        info["via"] = f"{host}:{port}"
        return inner, info
    raise ValueError(f"unknown session constructor {name!r}; known: rpc.LocalSession, rpc.Connect")


def _relay(outer: wire.Conn, inner: wire.Conn) -> None:
    """Copy bytes both ways until either side closes (a chained session)."""
    pairs = {outer.t.fileno(): (outer, inner), inner.t.fileno(): (inner, outer)}
    for src, dst in pairs.values():
        if src.buffered():
            dst.t.send_parts([bytes(src.view[src.start : src.end])])
            src.start = src.end
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        while True:
            ready = [
                fd for fd, (src, _d) in pairs.items() if getattr(src.t.sock, "pending", None)
                and src.t.sock.pending()
            ]  # fmt: skip
            if not ready:
                ready, _, _ = select.select(list(pairs), [], [])
            for fd in ready:
                src, dst = pairs[fd]
                n = src.t.recv_into(view)
                if not n:
                    return
                dst.t.send_parts([view[:n]])
    finally:
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


# --------------------------------------------------------------------------- the listener
def serve_forever(listen_sock: socket.socket, cfg: ServerConfig, watch_fd: int | None = None) -> None:  # fmt: skip
    """Accept clients on ``listen_sock`` until SIGTERM/SIGINT or ``watch_fd`` closes."""
    children: set[int] = set()
    reports: dict[int, list] = {}  # session report pipe -> [ticket or None]
    reg = cfg.registration

    def _term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    made_root = False
    if not cfg.work_root:
        cfg.work_root = tempfile.mkdtemp(prefix="disco-rpc-server-")
        made_root = True
    listen_sock.setblocking(True)
    try:
        while True:
            watch = [listen_sock, *reports] + ([watch_fd] if watch_fd is not None else [])
            if reg is not None:
                reg.reconnect_if_lost()
                if reg.conn is not None:
                    watch.append(reg.fileno())
            try:
                ready, _, _ = select.select(watch, [], [], 1.0)
            except InterruptedError:
                continue
            _reap(children)
            if watch_fd is not None and watch_fd in ready:
                logger.info("the process that started this server is gone; exiting")
                return
            if reg is not None:
                reg.poll()
                for fd in [fd for fd in ready if fd in reports]:
                    _read_report(fd, reports, reg)
            if listen_sock not in ready:
                continue
            try:
                sock, addr = listen_sock.accept()
            except OSError:
                continue
            wfd = None
            scfg = cfg
            if reg is not None:
                reg.poll()
                rfd, wfd = os.pipe()
                reports[rfd] = [None]
                scfg = replace(cfg, tickets=frozenset(reg.tickets), report_fd=wfd)
            if cfg.no_fork:
                threading.Thread(
                    target=_session_thread, args=(sock, addr, scfg, wfd), daemon=True
                ).start()
                continue
            pid = os.fork()
            if pid == 0:  # the session process
                code = 0
                try:
                    signal.signal(signal.SIGTERM, _term)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    _set_pdeathsig()
                    listen_sock.close()
                    if watch_fd is not None:
                        os.close(watch_fd)
                    for fd in reports:
                        os.close(fd)
                    if reg is not None and reg.conn is not None:
                        reg.conn.t.sock.close()  # the listener's link, not this process's
                    run_session(sock, addr, scfg, True)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            children.add(pid)
            sock.close()
            if wfd is not None:
                os.close(wfd)
    finally:
        _stop_children(children)
        if made_root:
            shutil.rmtree(cfg.work_root, ignore_errors=True)


def _session_thread(sock, addr, cfg: ServerConfig, wfd: int | None) -> None:
    try:
        run_session(sock, addr, cfg, False)
    finally:
        if wfd is not None:
            os.close(wfd)


def _read_report(fd: int, reports: dict, reg: Any) -> None:
    """A session said which ticket it accepted (a line), or ended (end of file)."""
    try:
        data = os.read(fd, 256)
    except OSError:
        data = b""
    slot = reports[fd]
    if data:
        ticket = data.split(b"\n")[0].decode("ascii", "replace")
        slot[0] = ticket
        reg.report(T_START, ticket)
        return
    os.close(fd)
    del reports[fd]
    if slot[0] is not None:
        reg.report(T_END, slot[0])


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _stop_children(children: set[int]) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.01)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def check_bind(host: str, token: bytes | None, ssl_context: Any, allow_insecure_bind: bool) -> None:
    """Refuse a non-loopback address without token or TLS unless explicitly allowed."""
    if not is_loopback(host) and token is None and ssl_context is None:
        if not allow_insecure_bind:
            raise RPCError(
                f"refusing to listen on {host}: anyone who reaches it could run code here. "
                "Give token= (or set DISCO_TOKEN) or ssl_context=, or pass "
                "allow_insecure_bind=True if the network is trusted"
            )
        logger.warning("listening on %s without token or TLS", host)


def stop_process(pid: int, grace: float = 3.0) -> None:
    """SIGTERM ``pid`` (a process group leader we forked), then SIGKILL its group."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            break
        time.sleep(0.005)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        return
    try:  # session processes left behind in the group
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


class Server:
    """Start an RPC server in a separate process, as ``tvm.rpc.Server``.

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
        clients the proxy pairs with it, one session at a time.
    tracker_addr : (str, int), optional
        Register with this tracker under ``key`` (``tracker_token``/``tracker_ssl_context``
        for that link; the server's ``token`` by default). The server then serves only
        clients holding a ticket from the tracker, and reports each session's end.
    custom_addr : str, optional
        The host the tracker gives clients (default ``host``).
    key : str
        Clients must present this key (an empty key accepts any).
    load_library : str or list of str
        Files loaded in the server at start: ``.py`` files (their ``register_func``
        calls run) and shared libraries (their symbols reach ``system_lib()``).
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
        Where the sessions' work folders are made (a temporary folder by default).
    max_message_bytes : int
        The largest frame accepted from a client.
    allow_insecure_bind : bool
        Allow a non-loopback address with neither token nor TLS.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9091, port_end: int = 9199, is_proxy: bool = False, tracker_addr: Any = None, key: str = "", load_library: Any = None, custom_addr: str | None = None, silent: bool = False, no_fork: bool = False, server_init_callback: Any = None, reuse_addr: bool = True, timeout: float | None = None, *, token: Any = None, ssl_context: Any = None, work_dir: str | None = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, allow_insecure_bind: bool = False, tracker_token: Any = None, tracker_ssl_context: Any = None, proxy_token: Any = None, proxy_ssl_context: Any = None) -> None:  # fmt: skip
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
            work_root=os.fspath(work_dir) if work_dir else "",
            max_message_bytes=int(max_message_bytes),
            timeout=timeout,
            no_fork=no_fork,
            behind_proxy=is_proxy,
        )
        tracker_token = token if tracker_token is None else tracker_token
        self._sock = None
        reg = None
        if is_proxy:
            # host/port name the proxy; this server connects out to it
            self.port = int(port)
            if tracker_addr is not None:
                logger.info("tracker_addr is ignored behind a proxy: give it to the Proxy")
        else:
            check_bind(host, token_b, ssl_context, allow_insecure_bind)
            self._sock = bind_listener(host, port, port_end, reuse_addr)
            self.port = self._sock.getsockname()[1]
            if tracker_addr is not None:
                from .tracker import Registration

                if not key:
                    raise ValueError("a server that registers with a tracker needs a key")
                reg = Registration(
                    tracker_addr,
                    key,
                    (custom_addr or host, self.port),
                    token=tracker_token,
                    ssl_context=tracker_ssl_context,
                )
                cfg.registration = reg
        proxy_args = (host, int(port), key, proxy_token if proxy_token is not None else token, proxy_ssl_context)  # fmt: skip
        rfd, wfd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the server process
            code = 0
            try:
                os.close(wfd)
                wire.close_inherited()
                os.setpgid(0, 0)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                cfg.libs = load_libraries(load_library)
                if server_init_callback is not None:
                    server_init_callback()
                if is_proxy:
                    from .proxy import serve_via_proxy

                    serve_via_proxy(cfg, *proxy_args, watch_fd=rfd)
                else:
                    serve_forever(self._sock, cfg, watch_fd=rfd)
            except SystemExit:
                pass
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(rfd)
        self._watch = wfd
        self.pid = pid
        if self._sock is not None:
            self._sock.close()
        if reg is not None and reg.conn is not None:
            reg.conn.t.sock.close()  # the server process holds the link now

    @property
    def addr(self) -> tuple[str, int]:
        return (self.host, self.port)

    def terminate(self) -> None:
        """Stop the server and every session it started; a second call does nothing."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        stop_process(pid)
        try:
            os.close(self._watch)
        except OSError:
            pass

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    def __del__(self) -> None:
        try:
            self.terminate()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<disco_rpc.Server {self.host}:{self.port} pid={self.pid}>"


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
    handler = SessionHandler(None, libs)
    try:
        if not auth.server_handshake(conn, "", None):
            return
        timeout, _inner = _init_session(conn, ServerConfig(), handler)
        if timeout is False:
            return
        serve_conn(conn, handler)
    except (EOFError, OSError):
        pass
    finally:
        handler.close()
