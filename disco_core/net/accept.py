"""One accept loop for every service: bounded work before a peer is known.

A service (a server, a tracker, a proxy) listens on one socket. Until a peer has
identified itself (its hello read, its token proven), what it may cost the
service is bounded:

* **No thread.** One thread runs a selector over the listener and every pending
  connection; each pending connection advances through a *handshake object*
  that never blocks (:class:`PendingConnection`; :class:`SocketHandshake` drives the
  ``want``/``step`` state machines of the rpc handshake over a non-blocking
  socket, TLS included).
* **A cap on pending connections** (``max_pending``). When it is reached, the
  oldest pending connection is dropped to make room: a flood of idle sockets
  cannot lock out a peer that speaks at once.
* **A deadline** (``handshake_timeout`` seconds from the accept) for each
  handshake; a connection that has not finished by then is closed.
* **Backoff on exhausted descriptors** (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
  ``ENOMEM``): the oldest pending connection, if any, is dropped to free a
  descriptor; when none is pending, the listener is left alone for a while
  (50 ms, doubling up to 1 s), so the loop sleeps instead of spinning on a
  listener it cannot accept from.

Only a connection whose handshake succeeded is handed to ``on_ready``, which
owns it from then on (it may start a thread, fork a process, or refuse it).
:class:`Slots` caps what ``on_ready`` starts.

This module imports the standard library and :mod:`disco_core.errors` only.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from disco_core.errors import DiscoValueError

__all__ = [
    "AcceptLoop",
    "PendingConnection",
    "StepMachine",
    "SocketHandshake",
    "Drain",
    "Slots",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_HANDSHAKE_TIMEOUT",
]

logger = logging.getLogger("disco_core.net.accept")

#: Connections accepted and not yet identified, at most (the oldest is dropped beyond).
DEFAULT_MAX_PENDING = 64
#: Seconds a peer has, from its accept, to finish its handshake.
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
#: Connections accepted per wake-up of the listener (then the others get a turn).
_ACCEPT_BATCH = 64
#: Backoff of the listener when descriptors run out: first and longest pause, seconds.
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 1.0
#: Errors of ``accept`` that mean "no descriptor or memory now": back off.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Seconds between two log lines that count dropped connections.
_LOG_EVERY = 10.0


class StepMachine(Protocol):
    """A handshake as a state machine fed exact byte counts (``auth.ServerHandshake``).

    ``want`` is the number of bytes :meth:`step` needs next (0: over); ``ok``
    says, once it is over, whether the peer may proceed.
    """

    want: int
    ok: bool

    def step(self, data: bytes) -> bytes:
        """Consume exactly ``want`` bytes; return the bytes to send back (maybe none)."""
        ...


class PendingConnection(Protocol):
    """What :class:`AcceptLoop` drives: a connection's handshake that never blocks.

    ``advance`` uses whatever has arrived and returns True (done: hand the
    connection on), False (refused, broken or gone: close it) or None (wait for
    more). ``wants_write`` (optional, default False) asks the loop to wake it
    when the socket is writable too (a TLS handshake may need that).
    """

    addr: Any

    def fileno(self) -> int: ...

    def advance(self) -> bool | None: ...

    def close(self) -> None: ...


class SocketHandshake:
    """A :class:`StepMachine` driven over a non-blocking socket, optionally inside TLS.

    Reads never go past what the machine wants, so bytes the peer sends after
    its handshake stay in the socket (or in the TLS buffer) for whoever reads
    next, and a peer that sends more than it should costs at most the
    handshake's few bytes of buffer.

    Parameters
    ----------
    sock : socket.socket
        The accepted connection; it is made non-blocking.
    addr : Any
        The peer's address (for messages).
    machine : StepMachine
        The protocol: what to read, what to answer.
    ssl_context : ssl.SSLContext, optional
        A server-side context: the TLS handshake runs first, also without blocking.
    """

    def __init__(self, sock: socket.socket, addr: Any, machine: StepMachine, ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        sock.setblocking(False)
        self._tls_pending = ssl_context is not None
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        self.sock: socket.socket = sock
        self.addr = addr
        self.machine = machine
        self.wants_write = False
        self._buf = bytearray()

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed)."""
        return self.sock.fileno()

    def advance(self) -> bool | None:
        """Use what arrived: True (done, accepted), False (refused or gone), None (wait)."""
        self.wants_write = False
        m = self.machine
        try:
            if self._tls_pending:
                self.sock.do_handshake()  # type: ignore[attr-defined]
                self._tls_pending = False
            while m.want:
                data = self.sock.recv(m.want - len(self._buf))
                if not data:
                    return False
                self._buf += data
                if len(self._buf) == m.want:
                    out = m.step(bytes(self._buf))
                    self._buf.clear()
                    if out and not self._send(out):
                        return False
        except ssl.SSLWantWriteError:
            self.wants_write = True
            return None
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return None
        except (OSError, ValueError, EOFError) as exc:
            logger.debug("handshake with %s failed: %s", self.addr, exc)
            return False
        return bool(m.ok)

    def _send(self, data: bytes) -> bool:
        # A few dozen bytes into a fresh socket's empty buffer: only a peer that
        # never reads (its window closed) makes this fail, and it is dropped.
        try:
            return self.sock.send(data) == len(data)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False

    def detach(self, timeout: float | None = None) -> socket.socket:
        """The socket, blocking again (``timeout``: its timeout), for whoever serves the peer."""
        self.sock.settimeout(timeout)
        return self.sock

    def close(self) -> None:
        """Close the socket (a second call does nothing)."""
        try:
            self.sock.close()
        except OSError:
            pass


class Drain:
    """A connection being closed politely: handed to :meth:`AcceptLoop.adopt` after a refusal.

    The write side is shut down at once (what was sent is followed by an end of
    file); what the peer still sends is read and dropped until it closes or the
    loop's deadline comes. Closing at once instead could make the peer's kernel
    throw the refusal away when a reset answers a request it sent meanwhile.
    """

    def __init__(self, sock: socket.socket, addr: Any) -> None:
        self.sock = sock
        self.addr = addr
        try:
            sock.setblocking(False)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def fileno(self) -> int:
        """The socket's descriptor."""
        return self.sock.fileno()

    def advance(self) -> bool | None:
        """Drop what arrived: False once the peer closed (close it), None while it has not."""
        try:
            for _ in range(16):
                if not self.sock.recv(65536):
                    return False
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError:
            return False
        return None

    def close(self) -> None:
        """Close the socket."""
        try:
            self.sock.close()
        except OSError:
            pass


class Slots:
    """A cap on what a service serves after the handshake (threads, sessions).

    Parameters
    ----------
    limit : int
        How many may be in use at once.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise DiscoValueError(f"Slots needs a limit of at least 1, not {limit}")
        self.limit = int(limit)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """How many are in use now."""
        return self._used

    def acquire(self) -> bool:
        """Take a slot; False (and nothing taken) when all are in use."""
        with self._lock:
            if self._used >= self.limit:
                return False
            self._used += 1
            return True

    def release(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._used = max(0, self._used - 1)

    def start_thread(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> bool:  # fmt: skip
        """Run ``target(*args)`` in a daemon thread holding a slot; False when none is free.

        The slot is given back when ``target`` returns or raises.
        """
        if not self.acquire():
            return False

        def run() -> None:
            try:
                target(*args)
            finally:
                self.release()

        try:
            threading.Thread(target=run, name=name, daemon=True).start()
        except BaseException:  # no thread could be started (RuntimeError, MemoryError)
            self.release()
            raise
        return True


class _Counter:
    """Counts of dropped connections, logged at most every ``_LOG_EVERY`` seconds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: dict[str, int] = {}
        self.last = 0.0

    def add(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        self.flush()

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.counts or (not force and now - self.last < _LOG_EVERY):
            return
        self.last = now
        text = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        self.counts = {}
        logger.warning("%s: connections dropped before their handshake ended: %s", self.name, text)  # fmt: skip


_LISTENER, _WATCH, _WAKE = object(), object(), object()


class AcceptLoop:
    """Accept connections, advance their handshakes in this one thread, hand on the good ones.

    Parameters
    ----------
    listen_sock : socket.socket
        A listening socket (made non-blocking). The loop never closes it.
    make_handshake : callable
        ``make_handshake(sock, addr) -> PendingConnection`` for each accepted connection;
        an ``OSError`` or ``ValueError`` it raises closes the connection.
    on_ready : callable
        ``on_ready(handshake)`` once a handshake returned True: the connection
        is no longer watched and belongs to ``on_ready``, which must not block
        (start a thread or a process, or refuse and close). What it raises is
        logged and the connection closed.
    max_pending : int
        Connections accepted and not yet through their handshake, at most; the
        oldest is dropped to make room for a new one.
    handshake_timeout : float
        Seconds from the accept to the end of the handshake.
    watch_fd : int, optional
        The loop returns when this descriptor becomes readable (the end of a pipe
        held by the process that started the service).
    on_tick : callable, optional
        Called about every ``tick_interval`` seconds from the loop's thread.
    tick_interval : float
        Seconds between two calls of ``on_tick``.
    name : str
        The service's name in log messages.
    """

    def __init__(self, listen_sock: socket.socket, make_handshake: Callable[[socket.socket, Any], PendingConnection], on_ready: Callable[[Any], None], *, max_pending: int = DEFAULT_MAX_PENDING, handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT, watch_fd: int | None = None, on_tick: Callable[[], None] | None = None, tick_interval: float = 1.0, name: str = "service") -> None:  # fmt: skip
        if max_pending < 1:
            raise DiscoValueError(f"max_pending must be at least 1, not {max_pending}")
        if handshake_timeout <= 0:
            raise DiscoValueError(f"handshake_timeout must be positive, not {handshake_timeout}")
        from .protect import preload

        preload()  # handshakes must not need to open module files (EMFILE under a flood)
        self.listen_sock = listen_sock
        self.make_handshake = make_handshake
        self.on_ready = on_ready
        self.max_pending = int(max_pending)
        self.handshake_timeout = float(handshake_timeout)
        self.watch_fd = watch_fd
        self.on_tick = on_tick
        self.tick_interval = float(tick_interval)
        self.name = name
        # pending handshakes, oldest first
        self._pending: dict[Any, tuple[float, int]] = {}  # handshake -> (deadline, fd)
        self._readers: dict[int, Callable[[int], None]] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopped = False
        self._running = False
        self._paused_until = 0.0
        self._backoff = _BACKOFF_FIRST
        self._dropped = _Counter(name)
        listen_sock.setblocking(False)

    # -- public ----------------------------------------------------------------
    @property
    def pending(self) -> int:
        """How many connections are in their handshake now."""
        return len(self._pending)

    def add_reader(self, fd: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(fd)`` from the loop when ``fd`` is readable (loop thread only)."""
        self._readers[fd] = callback
        if self._running:
            self._sel.register(fd, selectors.EVENT_READ, callback)

    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd`` (loop thread only)."""
        if self._readers.pop(fd, None) is not None:
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                pass

    def adopt(self, hs: Any, timeout: float | None = None) -> None:
        """Watch ``hs`` (a :class:`PendingConnection`, e.g. a :class:`Drain`) as a pending connection.

        It counts against ``max_pending`` and is closed after ``timeout`` seconds
        (default ``handshake_timeout``). Loop thread only (``on_ready`` may call it).
        """
        if len(self._pending) >= self.max_pending:
            self._drop(next(iter(self._pending)), "dropped (too many pending)")
        try:
            fd = hs.fileno()
            self._sel.register(fd, selectors.EVENT_READ, hs)
        except (OSError, ValueError, KeyError):
            hs.close()
            return
        wait = self.handshake_timeout if timeout is None else float(timeout)
        self._pending[hs] = (time.monotonic() + wait, fd)

    def stop(self) -> None:
        """Make :meth:`run` return soon (from any thread)."""
        self._stopped = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def run(self) -> None:
        """Serve until ``watch_fd`` is readable or :meth:`stop` is called; then close what is pending."""  # fmt: skip
        sel = self._sel
        self._running = True
        sel.register(self.listen_sock, selectors.EVENT_READ, _LISTENER)
        sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        if self.watch_fd is not None:
            sel.register(self.watch_fd, selectors.EVENT_READ, _WATCH)
        for fd, cb in self._readers.items():
            sel.register(fd, selectors.EVENT_READ, cb)
        next_tick = time.monotonic() + self.tick_interval
        try:
            while not self._stopped:
                now = time.monotonic()
                timeout = next_tick - now if self.on_tick is not None else 1.0
                if self._pending:
                    timeout = min(timeout, min(d for d, _fd in self._pending.values()) - now)
                if self._paused_until:
                    timeout = min(timeout, self._paused_until - now)
                try:
                    events = sel.select(max(0.0, timeout))
                except InterruptedError:
                    events = []
                accept = False
                for key, _mask in events:
                    data = key.data
                    if data is _LISTENER:
                        accept = True
                    elif data is _WATCH:
                        logger.info("%s: the process that started it is gone; exiting", self.name)  # fmt: skip
                        return
                    elif data is _WAKE:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                    elif data in self._pending:
                        self._advance(data)
                    elif callable(data) and key.fd in self._readers:
                        try:
                            data(key.fd)
                        except Exception:
                            logger.exception("%s: the reader of descriptor %d failed", self.name, key.fd)  # fmt: skip
                if self._stopped:
                    return
                now = time.monotonic()
                self._expire(now)
                if self._paused_until and now >= self._paused_until:
                    self._paused_until = 0.0
                    sel.register(self.listen_sock, selectors.EVENT_READ, _LISTENER)
                if accept:
                    self._accept_some()
                if self.on_tick is not None and now >= next_tick:
                    next_tick = now + self.tick_interval
                    try:
                        self.on_tick()
                    except Exception:
                        logger.exception("%s: the periodic task failed", self.name)
        finally:
            self._running = False
            self.close()

    def close(self) -> None:
        """Close every pending connection and the loop's own descriptors (not the listener)."""
        for hs in list(self._pending):
            self._drop(hs, None)
        self._dropped.flush(force=True)
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # -- internals -------------------------------------------------------------
    def _accept_some(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, addr = self.listen_sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _EXHAUSTED:
                    if self._pending:
                        # the pending handshakes hold the descriptors: the oldest makes room
                        self._drop(next(iter(self._pending)), "dropped (out of descriptors)")
                        continue
                    self._pause(exc)
                    return
                # ECONNABORTED, EPROTO, EPERM (a firewall)...: that connection only
                logger.debug("%s: accept failed: %s", self.name, exc)
                continue
            self._backoff = _BACKOFF_FIRST
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending)), "dropped (too many pending)")
            try:
                hs = self.make_handshake(sock, addr)
            except (OSError, ValueError) as exc:
                logger.info("%s: cannot start a handshake with %s: %s", self.name, addr, exc)
                sock.close()
                continue
            try:
                fd = hs.fileno()
                self._sel.register(fd, selectors.EVENT_READ, hs)
            except (OSError, ValueError, KeyError) as exc:
                logger.info("%s: cannot watch the connection from %s: %s", self.name, addr, exc)
                hs.close()
                continue
            self._pending[hs] = (time.monotonic() + self.handshake_timeout, fd)
            self._advance(hs)  # the hello is often there already

    def _pause(self, exc: OSError) -> None:
        """Descriptors ran out and no pending handshake holds one: leave the listener alone a while."""  # fmt: skip
        delay = self._backoff
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
        logger.warning("%s: cannot accept (%s); pausing the listener for %.2f s", self.name, exc.strerror, delay)  # fmt: skip
        try:
            self._sel.unregister(self.listen_sock)
        except (KeyError, ValueError):
            pass
        self._paused_until = time.monotonic() + delay

    def _advance(self, hs: Any) -> None:
        ok = hs.advance()
        if ok is None:
            events = selectors.EVENT_READ
            if getattr(hs, "wants_write", False):
                events |= selectors.EVENT_WRITE
            try:
                self._sel.modify(self._pending[hs][1], events, hs)
            except (KeyError, ValueError, OSError):
                self._drop(hs, "broken")
            return
        self._forget(hs)
        if not ok:
            if not isinstance(hs, Drain):
                logger.debug("%s: refused the connection from %s", self.name, hs.addr)
                self._dropped.add("refused")
            hs.close()
            return
        try:
            self.on_ready(hs)
        except Exception:
            logger.exception("%s: cannot serve the connection from %s", self.name, hs.addr)
            hs.close()

    def _expire(self, now: float) -> None:
        for hs, (deadline, _fd) in list(self._pending.items()):
            if deadline <= now:
                self._drop(hs, None if isinstance(hs, Drain) else "timed out")

    def _forget(self, hs: Any) -> None:
        entry = self._pending.pop(hs, None)
        if entry is None:
            return
        try:
            self._sel.unregister(entry[1])
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, hs: Any, why: str | None) -> None:
        self._forget(hs)
        if why is not None:
            logger.debug("%s: connection from %s %s", self.name, hs.addr, why)
            self._dropped.add(why)
        hs.close()
