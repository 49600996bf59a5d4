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
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import auth, wire
from .errors import ProtocolError, RPCError
from .handler import OP_INIT, SessionHandler, error_value, serve_conn
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
            transport: Any = wire.SSLTransport(sock)
        else:
            transport = wire.SocketTransport(sock)
        conn = wire.Conn(transport, cfg.max_message_bytes)
        if not auth.server_handshake(conn, cfg.key, cfg.token):
            logger.warning("refused a client from %s (key, version or authentication)", addr)
            return
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

    def _term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    made_root = False
    if not cfg.work_root:
        cfg.work_root = tempfile.mkdtemp(prefix="disco-rpc-server-")
        made_root = True
    listen_sock.setblocking(True)
    watch = [listen_sock] + ([watch_fd] if watch_fd is not None else [])
    try:
        while True:
            try:
                ready, _, _ = select.select(watch, [], [], 1.0)
            except InterruptedError:
                continue
            _reap(children)
            if watch_fd is not None and watch_fd in ready:
                logger.info("the process that started this server is gone; exiting")
                return
            if listen_sock not in ready:
                continue
            try:
                sock, addr = listen_sock.accept()
            except OSError:
                continue
            if cfg.no_fork:
                threading.Thread(
                    target=run_session, args=(sock, addr, cfg, False), daemon=True
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
                    run_session(sock, addr, cfg, True)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            children.add(pid)
            sock.close()
    finally:
        _stop_children(children)
        if made_root:
            shutil.rmtree(cfg.work_root, ignore_errors=True)


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
    is_proxy, tracker_addr, custom_addr :
        Reserved for the proxy and tracker (not available yet).
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

    def __init__(self, host: str = "127.0.0.1", port: int = 9091, port_end: int = 9199, is_proxy: bool = False, tracker_addr: Any = None, key: str = "", load_library: Any = None, custom_addr: str | None = None, silent: bool = False, no_fork: bool = False, server_init_callback: Any = None, reuse_addr: bool = True, timeout: float | None = None, *, token: Any = None, ssl_context: Any = None, work_dir: str | None = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, allow_insecure_bind: bool = False) -> None:  # fmt: skip
        if is_proxy or tracker_addr is not None:
            raise NotImplementedError(
                "is_proxy and tracker_addr need the RPC proxy and tracker, which are not "
                "available yet in disco-rpc"
            )
        self.host = host
        self.key = key
        self.custom_addr = custom_addr
        self.proc = None
        self.pid: int | None = None
        token_b = auth.resolve_token(token)
        if not is_loopback(host) and token_b is None and ssl_context is None:
            if not allow_insecure_bind:
                raise RPCError(
                    f"refusing to listen on {host}: anyone who reaches it could run code here. "
                    "Give token= (or set DISCO_TOKEN) or ssl_context=, or pass "
                    "allow_insecure_bind=True if the network is trusted"
                )
            logger.warning("listening on %s without token or TLS", host)
        if silent:
            logger.setLevel(logging.ERROR)
        self._sock = bind_listener(host, port, port_end, reuse_addr)
        self.port = self._sock.getsockname()[1]
        cfg = ServerConfig(
            key=key,
            token=token_b,
            ssl_context=ssl_context,
            work_root=os.fspath(work_dir) if work_dir else "",
            max_message_bytes=int(max_message_bytes),
            timeout=timeout,
            no_fork=no_fork,
        )
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
        self._sock.close()

    @property
    def addr(self) -> tuple[str, int]:
        return (self.host, self.port)

    def terminate(self) -> None:
        """Stop the server and every session it started; a second call does nothing."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
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
