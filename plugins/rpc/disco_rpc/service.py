"""What a server, a tracker and a proxy have in common: a service in a forked process.

The service process leads a process group of its own (its session processes are
in it too, so :func:`stop_process` ends them all), ignores Ctrl-C (the user's
program handles it), and exits when the process that started it goes away (the
``watch`` pipe it is given reaches its end of file).

Also here, below the server, the tracker and the proxy that share them: binding
a listener under the core's bind policy (:func:`check_bind`,
:func:`bind_listener`), forking a session (:func:`fork_session`), the watchdogs
of a session (its ``session_timeout`` and the liveness of its client:
:func:`resolve_liveness_timeout`, :class:`Liveness`), and a server's (or a
proxy's) registration link to a tracker (:class:`Registration`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import operator
import os
import select
import signal
import socket
import struct
import sys
import termios
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from disco_core import DiscoTypeError, DiscoValueError
from disco_core.spi import check_bind as _check_bind
from disco_core.spi import listen_family

from . import auth, wire
from .errors import RPCError
from .procname import name_process
from .protocol import (
    BEATS_ALWAYS,
    BEATS_IDLE,
    BEATS_NONE,
    KEY_MISMATCH,
    REGISTRANT_KEY,
    REPLY,
    REQUEST,
    T_ASSIGN,
    T_PUT,
    T_REVOKE,
    T_START,
    TICKET_REQUIRED,
    TICKET_SEP,
    TRACKER_MAX_MESSAGE_BYTES,
)
from .stops import stops_held

__all__ = [
    "ServiceProcess",
    "stop_process",
    "fork_session",
    "set_pdeathsig",
    "exit_on_term",
    "check_bind",
    "bind_listener",
    "start_watchdog",
    "LIVENESS_ENV",
    "DEFAULT_LIVENESS_TIMEOUT",
    "MIN_LIVENESS_TIMEOUT",
    "resolve_liveness_timeout",
    "can_watch",
    "is_stopped",
    "run_time_ns",
    "Liveness",
    "Registration",
    "open_tracker_link",
]

_server_log = logging.getLogger("disco_rpc.server")
_tracker_log = logging.getLogger("disco_rpc.tracker")


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


class ServiceProcess:
    """Base of :class:`~disco_rpc.Server`, :class:`~disco_rpc.Tracker` and :class:`~disco_rpc.Proxy`.

    A subclass sets ``host`` and ``port`` and calls ``_fork``; it is a context
    manager, and :meth:`terminate` (also run when it is dropped) stops the process.
    """

    #: The name in ``repr``.
    _kind = "service"
    host: str
    port: int
    pid: int | None = None
    _watch: int | None = None

    def _fork(self, serve: Callable[[int], None]) -> int:
        """Fork the service process, which runs ``serve(watch_fd)`` and exits.

        It exits with 0 when ``serve`` returns or raises ``SystemExit``, else with 1
        after printing the traceback.
        """
        watch_r, watch_w = os.pipe()  # closes when this process goes: the service then exits
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                name_process(f"disco-{self._kind.lower()}")  # (not its parent's name)
                os.close(watch_w)
                wire.close_inherited()
                os.setpgid(0, 0)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                serve(watch_r)
            except SystemExit:
                pass
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(watch_r)
        self._watch = watch_w
        self.pid = pid
        return pid

    @property
    def addr(self) -> tuple[str, int]:
        """``(host, port)``, as given to ``connect`` and ``tracker_addr``."""
        return (self.host, self.port)

    def terminate(self) -> None:
        """Stop the process and every process it started; a second call does nothing."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        stop_process(pid)
        try:
            os.close(self._watch)  # type: ignore[arg-type]  # None: the TypeError below
        except (OSError, TypeError):
            pass
        self._cleanup()

    def _cleanup(self) -> None:
        """What a subclass removes after its process stopped."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    def __del__(self) -> None:
        try:
            self.terminate()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<disco_rpc.{self._kind} {self.host}:{self.port} pid={self.pid}>"


def fork_session(run: Callable[[], None]) -> tuple[int, int | None]:
    """Fork a session process that runs ``run()`` and ends (code 1 when it raised).

    Returns ``(pid, pidfd)``; the pidfd (None where the kernel has none) becomes
    readable when the child ends, so a select loop sees it at once.
    """
    sys.stdout.flush()  # what is buffered is printed once, not once per process
    sys.stderr.flush()
    # A stop held back over the fork: the service's handler (exit_on_term) raised its
    # SystemExit inside the interpreter's fork hooks, where Python prints it as ignored
    # and drops it (an attacker check: 6 of 10 terminate() calls right after handshakes)
    with stops_held() as held:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                held.forget()  # the child's handlers are the parent's; its stops are its own
                name_process("disco-session")  # a worker host renames it (before "ready")
                run()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
    # (a stop that came is raised here, in the parent)
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    return pid, pidfd


# --------------------------------------------------------------------------- listeners and session processes
def set_pdeathsig() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


def exit_on_term(signum, frame):
    """A SIGTERM handler: exit cleanly (``finally`` blocks run)."""
    raise SystemExit(0)


def check_bind(host: str, token: bytes | None, ssl_context: Any, allow_insecure_bind: bool, what: str = "RPC server") -> None:  # fmt: skip
    """The core's bind policy (:func:`disco_core.net.security.check_bind`) for an rpc service.

    Raises :class:`~disco_core.errors.InsecureBindError` for a non-loopback
    ``host`` with neither token nor TLS that requires client certificates, unless
    ``allow_insecure_bind`` (which warns).
    """
    _check_bind(host, token=token, tls=ssl_context, allow_insecure_bind=allow_insecure_bind, what=what)  # fmt: skip


def _port(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        port = operator.index(value)
    except TypeError:
        raise DiscoTypeError(f"{name} must be an int 0-65535, got {type(value).__name__} {value!r}") from None  # fmt: skip
    if not 0 <= port <= 65535:
        raise DiscoValueError(f"{name} must be an int 0-65535, got {value!r}")
    return port


def bind_listener(host: str, port: int, port_end: int, reuse_addr: bool = True) -> socket.socket:
    """Bind the first free port in ``[port, port_end)`` (``port`` alone when ``port_end <= port``)."""
    port, port_end = _port("port", port), _port("port_end", port_end)
    family = listen_family(host)
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
            # not this machine's address, say: named, as a port in use is (outside check)
            raise RPCError(f"cannot listen on {host}:{p}: {exc.strerror or exc}") from exc
    where = f"any port in [{port}, {port_end})" if port_end > port + 1 else f"port {port}"
    raise RPCError(f"cannot bind to {where} on {host}: {last}")


def start_watchdog(timeout: float, sock: socket.socket, handler: Any, forked: bool):
    """End the session on ``sock`` after ``timeout`` seconds (its ``session_timeout``).

    Returns the started :class:`threading.Timer`; a forked session process closes
    ``handler`` and exits when it fires.
    """

    def expire() -> None:
        _server_log.info("session timed out after %g s; ending it", timeout)
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


def can_watch(conn: wire.Conn) -> bool:
    """Whether this side can watch ``conn``'s peer (a TCP socket on Linux)."""
    sock = getattr(conn.t, "sock", None)
    return _TCP_INFO is not None and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)  # fmt: skip


def _tcp_state(sock: socket.socket) -> tuple[int, float, int]:
    """``(tcpi_state, seconds since data last arrived, bytes the peer acknowledged)`` from
    the kernel (``TCP_INFO``; the last is -1 where the kernel does not tell)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 136)  # type: ignore[arg-type]  # known here
    idle = _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0] / 1000.0
    acked = -1
    if len(info) >= _BYTES_ACKED_OFFSET + 8:
        acked = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0]
    return info[0], idle, acked


def heard_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer's data arrived on ``sock`` in the last ``seconds`` (read or not;
    ``TCP_INFO``: a TCP socket on Linux, see :func:`can_watch`)."""
    return _tcp_state(sock)[1] < seconds


def beat_within(conn: wire.Conn, seconds: float) -> bool:
    """Whether the peer's heartbeats arrived on ``conn`` in the last ``seconds``.

    For a writer that waited that long for room (the reader is idle meanwhile): the
    heartbeats at the head of what arrived are taken off the link now (through the
    seal, each checked: a forged one raises
    :class:`~disco_core.errors.IntegrityError`), and the kernel says data arrived
    within ``seconds`` (``TCP_INFO``: taken beats that came before the wait do not
    count). Other bytes never count: a man in the middle who sends the client a
    byte now and then, on a sealed link, no longer holds its write for good.
    """
    return conn.drop_heartbeats() > 0 and heard_within(conn.t.sock, seconds)


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (``SIGSTOP``, ``SIGTSTP``: state ``T``;
    a debugger's tracing stop is ``t`` and does not count). False where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def run_time_ns(pid: int) -> int:
    """The CPU time all threads of process ``pid`` ran, in nanoseconds (the scheduler's
    ``schedstat``); -1 where it cannot be read."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return -1
    return total


def _unsent(sock: socket.socket) -> int:
    """Bytes written and not yet acknowledged by the peer."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def _unread(sock: socket.socket) -> int:
    """Bytes received and not read yet."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


class Liveness:
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

    The other way round, with ``call_beats`` (the client asked for them in INIT):
    while a request is read or its work runs (``calling``, set by the serving thread
    from :meth:`begin_call` to :meth:`end_call`; no reply being sent; see
    :func:`~disco_rpc.handler.serve_conn`), it sends the client a heartbeat frame at
    every check, so a client waiting for a long call's reply, or for room to send a
    request that a relay holds back, can tell a live server from a frozen one, or
    one whose host or network is gone (``RPCSession`` with ``$DISCO_RPC_WATCH_SERVER``
    ends the session after 1.5 x ``timeout``, at least 3 s, with nothing from the
    server).
    """

    def __init__(self, conn: wire.Conn, addr: Any, timeout: float, beats: int, on_dead: Any, relay: bool, call_beats: bool = False) -> None:  # fmt: skip
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
        self.call_beats = call_beats
        #: True while a request is read or runs and no reply is being sent: heartbeats may go
        self.calling = False
        #: taken by a heartbeat being sent, and by :meth:`end_call` (so none is under way
        #: when the reply starts)
        self.send_lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="disco-rpc-liveness", daemon=True)

    def worker(self) -> None:
        """The session became a Disco worker: no more heartbeats, only its end counts."""
        self.worker_mode = True

    def stop(self) -> None:
        self._stop.set()

    def begin_call(self) -> None:
        """A request began (its head came): heartbeats may go until :meth:`end_call`."""
        self.calling = True

    def end_call(self) -> None:
        """Its work ended: no heartbeat from now on (one being sent is finished first)."""
        with self.send_lock:
            self.calling = False

    def _beat(self) -> None:
        """One heartbeat to the client, if a call runs and the socket has room for it."""
        if not self.send_lock.acquire(blocking=False):
            return
        try:
            poll = select.poll()  # (not select(): descriptors past 1023)
            poll.register(self.sock.fileno(), select.POLLOUT)
            if self.calling and poll.poll(0):
                self.conn.send_heartbeat()  # 12 bytes (a record when sealed): never blocks here
        except (OSError, ValueError):
            pass  # the connection broke: the session's own reads and writes see it
        finally:
            self.send_lock.release()

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
            if self.call_beats and self.calling:
                self._beat()
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
        _server_log.warning(
            "ending the session of the client at %s: it %s (liveness timeout %g s)",
            self.addr, why, self.timeout,
        )  # fmt: skip
        self.on_dead()


# --------------------------------------------------------------------------- links to a tracker
#: Seconds a registration link waits for the tracker's answer or for room to send.
REGISTRATION_TIMEOUT = 10.0


def open_tracker_link(addr: Any, role_key: str, token: Any, ssl_context: Any, timeout: float = 10.0) -> wire.Conn:  # fmt: skip
    """An authenticated link to the tracker at ``addr`` in the role ``role_key``."""
    host, port = addr
    return auth.open_conn(
        host,
        int(port),
        role_key,
        token=token,
        ssl_context=ssl_context,
        max_message_bytes=TRACKER_MAX_MESSAGE_BYTES,
        connect_timeout=timeout,
        peer="tracker",
    )


#: Tickets a registration takes from the tracker before its answer (a bound on a tracker
#: that never answers).
_MAX_EARLY_TICKETS = 1024


def _hear_ticket(tickets: set[str], op: int, value: Any) -> bool:
    """Apply a tracker's ``T_ASSIGN`` or ``T_REVOKE`` to ``tickets``; False for any other op."""
    if op == T_ASSIGN:
        tickets.add(str(value))
    elif op == T_REVOKE:
        tickets.discard(str(value))
    else:
        return False
    return True


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
        conn = open_tracker_link(self.tracker_addr, REGISTRANT_KEY, self.token, self.ssl_context)
        # bounded: the tracker answers at once; the bound stays for the link's later
        # sends and reads (poll reads only frames select saw begin)
        conn.t.settimeout(REGISTRATION_TIMEOUT)
        tickets: set[str] = set()
        try:
            conn.send(REQUEST, T_PUT, (self.key, self.addr[0], self.addr[1], busy))
            # a tracker of an earlier release matches a waiting client before it answers:
            # its tickets may come first (taken for a refusal before: the server exited)
            for _ in range(_MAX_EARLY_TICKETS):
                kind, op, value = conn.recv()
                if kind != REQUEST or not _hear_ticket(tickets, op, value):
                    break
        except BaseException:
            conn.close()
            raise
        if kind != REPLY:
            conn.close()
            why = value[1] if isinstance(value, (tuple, list)) and len(value) > 1 else value
            raise RPCError(f"the tracker refused the registration of key {self.key[:64]!r}: {why}")
        self.conn = conn
        self.tickets = tickets

    def reconnect_if_lost(self, every: float = 1.0) -> None:
        if self.conn is None and time.monotonic() - self.last_try >= every:
            try:
                self.connect()
                _tracker_log.info("registered again with the tracker at %s:%s", *self.tracker_addr)
            except (RPCError, OSError, EOFError, wire.ProtocolError) as exc:
                _tracker_log.debug("tracker not reachable yet: %s", exc)

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
                _hear_ticket(self.tickets, op, value)
        except (OSError, EOFError, wire.ProtocolError):
            self._lost()

    def _lost(self) -> None:
        if self.conn is not None:
            _tracker_log.warning("lost the link to the tracker; will register again")
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

    def refusal(self, presented: bytes) -> int:
        """The handshake status for a key :meth:`accepts` refused: this server's own key
        without a ticket is told that a ticket is required (as a proxy tells it), not
        that the key is wrong (an outside check: ``disco-rpc ls --key gpu`` said "key
        mismatch" to a server whose key was ``gpu``)."""
        return TICKET_REQUIRED if presented == self.key.encode() else KEY_MISMATCH

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
