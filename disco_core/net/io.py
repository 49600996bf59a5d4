"""Byte I/O shared by every channel and service: all-buffer sends, exact receives, pipes, splice.

A *transport* here is any object with ``send_parts(list of buffers)`` (sends
all of them, in order, without copying) and ``recv_into(writable view) -> int``
(0 at end of stream); :class:`SocketTransport`, :class:`SSLTransport` and
:class:`PipeTransport` are the three the project uses, and
:class:`~disco_core.net.protect.SealedTransport` wraps any of them.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DiscoTimeoutError, IntegrityError

__all__ = [
    "IOV_MAX",
    "PIPE_BYTES",
    "SPIN_US",
    "CAN_SPLICE",
    "as_views",
    "send_all",
    "write_all",
    "recv_exact",
    "unfilled_bytearray",
    "grow_pipe",
    "new_pipe",
    "drain_fd",
    "splice_exact",
    "SinkFailedError",
    "placement",
    "may_poll_beside",
    "SocketTransport",
    "SSLTransport",
    "PipeTransport",
]

#: Most buffers one ``sendmsg``/``writev`` call takes.
IOV_MAX = 512
#: Size pipes are enlarged to: large arrays move in fewer wake-ups.
PIPE_BYTES = 1 << 20
#: Microseconds a socket reader polls without blocking before it sleeps in ``recv``
#: (``$DISCO_RPC_SPIN_US``; 0 turns polling off).
SPIN_US = float(os.environ.get("DISCO_RPC_SPIN_US", "50") or 0)
CAN_SPLICE = hasattr(os, "splice")

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
#: Frames up to this size go out with one ``sendall``. Its timeout bounds the whole
#: frame, not each write as ``send_all``'s does: the same where the frame fits the
#: socket's buffer and goes in one write, as a frame this small does unless the peer
#: stopped reading.
_SMALL = 1 << 16
_perf = time.perf_counter
_yield = getattr(os, "sched_yield", lambda: None)


def as_views(parts: Sequence[Any]) -> list:
    """``parts`` as flat byte views, empty ones left out (no data is copied)."""
    views = []
    for p in parts:
        m = p if type(p) is memoryview else memoryview(p)
        if m.format != "B" or m.ndim != 1:
            m = m.cast("B")
        if m.nbytes:
            views.append(m)
    return views


def send_all(write: Callable[[list], int], parts: Sequence[Any]) -> None:
    """Hand every byte of ``parts`` to ``write`` (``sock.sendmsg`` or ``os.writev`` of one fd).

    ``write`` takes a list of at most ``IOV_MAX`` views and returns how many
    bytes it took; partial writes resume where they stopped.
    """
    views = as_views(parts)
    i = 0
    while i < len(views):
        n = write(views[i : i + IOV_MAX])
        while n:
            first = views[i]
            if n >= first.nbytes:
                n -= first.nbytes
                i += 1
            else:
                views[i] = first[n:]
                n = 0


def write_all(fd: int, data: Any, stalled: Callable[[], None] | None = None) -> None:
    """Write all of ``data`` (any buffer) to a file descriptor, without copying it.

    Parameters
    ----------
    fd : int
        Blocking, or non-blocking (``os.set_blocking(fd, False)``) with ``stalled``.
    stalled : callable, optional
        For a non-blocking ``fd``: called every ``STALL_CHECK`` seconds while
        the reader takes nothing (a full pipe); it raises to give up. A stopped
        reader then cannot hold the writer for ever.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    total = len(view)
    try:
        n = os.write(fd, view)
    except BlockingIOError:
        n = 0
    if n == total:
        return
    view = memoryview(view)
    while n < total:
        try:
            n += os.write(fd, view[n:])
        except BlockingIOError:
            if stalled is None:
                raise
            _wait_writable(fd, stalled)


#: Bytes one ``sendfile`` of a socket with :meth:`SocketTransport.limit_waits` takes at
#: most: a piece that fits in the room ``poll`` saw never waits in the kernel.
_SENDFILE_PIECE = 1 << 16

#: Seconds between the checks of a writer waiting on a full pipe (``write_all``'s ``stalled``).
STALL_CHECK = 0.25


def _wait_readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` became readable within ``timeout`` seconds (None: for good).

    ``poll``, not ``select``: a descriptor past 1023 is refused by ``select``.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))):
        return True
    # a signal handler that ran longer than the timeout ends the wait on return without
    # a look (Python's retry after EINTR finds its deadline passed): look once more
    return bool(poller.poll(0))


def _wait_writable_for(fd: int, timeout: float) -> bool:
    """Whether ``fd`` had room to write within ``timeout`` seconds (a signal handler that
    outlasted it is no wait: one more look, as in :func:`_wait_readable`)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(max(0, int(timeout * 1000 + 0.999))) or poller.poll(0))


def _ready_now(sock: socket.socket, event: int) -> bool:
    """Whether ``sock`` can be read (``POLLIN``; a TLS socket's own buffer counts) or
    written (``POLLOUT``) without waiting."""
    if event == select.POLLIN and getattr(sock, "pending", None) is not None and sock.pending():  # type: ignore[attr-defined]
        return True
    poller = select.poll()
    poller.register(sock.fileno(), event)
    return bool(poller.poll(0))


def _wait_writable(fd: int, stalled: Callable[[], None]) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while not poller.poll(STALL_CHECK * 1000):
        stalled()


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = getattr(_libc, "madvise", None)
if _madvise is not None:
    _madvise.restype = ctypes.c_int
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_HUGEPAGE = 14  # Linux
_HUGE = 2 << 20  # x86-64's and arm64's transparent huge page
#: buffers at least this large ask for huge pages (NumPy's threshold for its arrays)
_HUGE_PAGES_FROM = 4 << 20


def unfilled_bytearray(n: int) -> bytearray:
    """A ``bytearray`` of ``n`` bytes whose contents are not set: for a buffer the caller
    fills whole before anyone sees it (a receive that fails drops it).

    ``bytearray(n)`` writes n zeros first: for 64 MiB that is 35 ms on a VM, more than
    receiving the data over loopback takes; this costs 0.05 ms. A large buffer asks
    for transparent huge pages (``madvise``, as NumPy does for its arrays): its first
    touch, when the data arrives, then faults once per 2 MiB instead of once per 4 KiB
    (64 MiB: 32 ms of faults on a VM, against 3 ms).
    """
    if n < 0:
        raise ValueError(f"negative size {n}")
    buf = _new_bytearray(None, n)
    if n >= _HUGE_PAGES_FROM and _madvise is not None:
        addr = ctypes.addressof((ctypes.c_char * n).from_buffer(buf))
        start = -(-addr // _HUGE) * _HUGE
        end = (addr + n) // _HUGE * _HUGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)  # best effort: THP may be off
    return buf


def recv_exact(
    recv_into: Callable[[memoryview], int], n: int, what: str = "a message"
) -> bytearray:
    """Read exactly ``n`` bytes through ``recv_into``; ``EOFError`` if the stream ends first."""
    buf = unfilled_bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = recv_into(view[got:])
        if not k:
            raise EOFError(f"the peer closed the connection in the middle of {what}")
        got += k
    return buf


def grow_pipe(fd: int, size: int = PIPE_BYTES) -> None:
    """Enlarge a pipe's buffer (best effort: the system limit may refuse)."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
    except OSError:
        pass


def new_pipe(size: int = PIPE_BYTES) -> tuple[int, int]:
    """A pipe ``(read fd, write fd)`` enlarged to ``size`` bytes."""
    r, w = os.pipe()
    grow_pipe(w, size)
    return r, w


def drain_fd(fd: int, n: int) -> None:
    """Read and drop ``n`` bytes from ``fd`` (a pipe left half-used by a failed splice)."""
    while n > 0:
        n -= len(os.read(fd, min(n, PIPE_BYTES))) or n


class SinkFailedError(OSError):
    """Writing spliced bytes to their destination failed; ``left`` bytes are still in the source."""

    def __init__(self, exc: OSError, left: int) -> None:
        super().__init__(exc.errno, str(exc))
        self.exc = exc
        self.left = left


def splice_exact(
    sock: socket.socket,
    pipe: tuple[int, int],
    out_fd: int,
    size: int,
    *,
    on_chunk: Callable[[int, int], None] | None = None,
    on_refused: Callable[[int, bytes], None] | None = None,
) -> None:
    """Move ``size`` bytes from ``sock`` to ``out_fd`` inside the kernel (socket -> pipe -> fd).

    Parameters
    ----------
    on_chunk : callable, optional
        ``on_chunk(k, left)`` after each ``k`` more bytes reached ``out_fd``, ``left``
        still to come (a sealed link feeds them to its MAC from the file's pages).
    on_refused : callable, optional
        ``on_refused(moved, rest)`` when ``out_fd`` refused bytes: ``moved`` of the last
        chunk reached it, ``rest`` are the bytes that were still in the pipe (read out,
        so the socket can still be read in sync). Without it they are dropped.

    Raises
    ------
    DiscoTimeoutError
        Past the socket's timeout.
    EOFError
        The peer closed the connection first.
    SinkFailedError
        ``out_fd`` refused the bytes (after ``on_refused``).
    """
    sfd = sock.fileno()
    timeout = sock.gettimeout()
    r, w = pipe
    left = size
    while left:
        try:
            k = os.splice(sfd, w, min(left, PIPE_BYTES))
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath
            if timeout is None:  # a blocking one's SO_RCVTIMEO ran out (limit_waits)
                raise DiscoTimeoutError("timed out receiving a transfer") from None
            if not _wait_readable(sfd, timeout):
                raise DiscoTimeoutError("timed out receiving a transfer") from None
            continue
        if not k:
            raise EOFError("the peer closed the connection in the middle of a transfer")
        left -= k
        moved = 0
        try:
            while moved < k:
                moved += os.splice(r, out_fd, k - moved)
        except OSError as exc:
            if on_refused is None:
                drain_fd(r, k - moved)  # the pipe must be empty for whoever reads the socket next
            else:
                rest = bytearray()
                while len(rest) < k - moved:
                    rest += os.read(r, k - moved - len(rest))
                on_refused(moved, bytes(rest))
            raise SinkFailedError(exc, left) from None
        if on_chunk is not None:
            on_chunk(k, left)


def placement() -> list:
    """Where this process runs, as a peer compares it (:func:`may_poll_beside`).

    Returns
    -------
    list
        ``[kernel, cpus]``: a hash of this kernel's boot id ("" where unknown) and the
        sorted CPUs this process may run on (plain values: a handshake carries them).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            kernel = hashlib.sha256(f.read().strip()).hexdigest()[:32]
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ["", []]
    return [kernel, cpus]


def may_poll_beside(peer: object) -> bool:
    """Whether a reader's polling can pay off, given the peer's :func:`placement`.

    False when the peer runs on this kernel pinned to the one CPU this process is
    pinned to (``taskset`` on both): the peer then runs only when the poller
    sleeps, so polling only delays the answer (a loopback RPC round trip took
    59 us with polling against 33 us without, and a download reached 0.46 of the
    raw stream against 0.72; 2-vCPU VM). A peer pinned to another CPU is what
    polling is for (128 us without it). Anything else, a malformed value included
    (it comes from the peer): True.
    """
    if not (isinstance(peer, (list, tuple)) and len(peer) == 2):
        return True
    kernel, cpus = peer
    if not isinstance(kernel, str) or not kernel or not isinstance(cpus, (list, tuple)) or len(cpus) != 1:  # fmt: skip
        return True
    mine = placement()
    return not (mine[0] == kernel and mine[1] == list(cpus))


class SocketTransport:
    """A connected stream socket: ``sendmsg`` of header and buffers in one call.

    Two ways to bound its waits. :meth:`limit_waits` (the kernel's ``SO_RCVTIMEO``
    and ``SO_SNDTIMEO``: nothing on the call path) makes each read or write that
    waits on the peer for that long with nothing moving raise.
    ``settimeout`` (of this transport, not of the socket) does it in Python, which polls
    before every read and write; a wait then raises ``TimeoutError`` only when the
    socket was not ready for that long: Python gives up a wait whose deadline passed
    while a signal handler of the program ran, even if the peer's bytes or room
    arrived meanwhile, so such a wait is tried again. Either way a write never ends
    with part of its bytes sent unknown.
    """

    #: True when the socket has a timeout (reads and writes then go the patient way)
    patient = False
    #: True when :meth:`limit_waits` bounds the blocking reads and writes (by ``_limit``)
    limited = False
    _limit = 0.0
    #: ``heard_within(seconds) -> bool``, optional: whether the peer showed it is alive in
    #: the last ``seconds`` (the RPC client: its heartbeats arrived, taken off the link
    #: then and there). A bounded write that found no room for its bound waits on while
    #: it does: a live peer behind a relay that holds back what it was sent (an ssh
    #: tunnel on a slow link) still sends its heartbeats.
    heard_within: Callable[[float], bool] | None = None

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.recv_into: Callable[..., int] = sock.recv_into
        # one CPU in the machine: nothing runs while this polls (see may_poll_beside)
        self.spin = SPIN_US * 1e-6 if (os.cpu_count() or 1) > 1 else 0.0

    def recv_head_into(self, view: Any) -> int:
        """``recv_into`` that first polls without blocking for up to ``SPIN_US``."""
        spin = self.spin
        sock = self.sock
        if spin > 0:
            if sock.gettimeout() is None:
                recv_into = sock.recv_into
                deadline = _perf() + spin
                while True:
                    try:
                        return recv_into(view, 0, _DONTWAIT)
                    except BlockingIOError:
                        if _perf() > deadline:
                            break
                        _yield()
            else:
                # a socket with a timeout waits in poll() before every recv, even with
                # MSG_DONTWAIT; its descriptor is non-blocking, so readv() tries once
                fd = sock.fileno()
                deadline = _perf() + spin
                while True:
                    try:
                        return os.readv(fd, [view])
                    except BlockingIOError:
                        if _perf() > deadline:
                            break
                        _yield()
        return self.recv_into(view)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_parts(self, parts: list) -> None:
        if self.patient:
            send_all(self._sendmsg_patiently, parts)  # (sendall may give up with part sent)
        elif len(parts) == 1 and type(parts[0]) is bytes and len(parts[0]) <= _SMALL:
            if not self.limited:
                self.sock.sendall(parts[0])  # a small frame: no views to make, one system call
                return
            try:  # (sendall's error would not say what went out)
                n = self.sock.send(parts[0], _DONTWAIT)
            except BlockingIOError:
                n = 0
            if n < len(parts[0]):
                send_all(self._sendmsg_limited, [memoryview(parts[0])[n:]])
        elif self.limited:
            send_all(self._sendmsg_limited, parts)
        else:
            send_all(self.sock.sendmsg, parts)

    def sendfile(self, file: Any, size: int) -> int:
        """Send ``size`` bytes from the file's position (``socket.sendfile`` starts at ``offset``)."""
        if not size:
            return 0
        if self.limited and not self.patient:
            return self._sendfile_limited(file, size)
        if not self.patient:
            return self.sock.sendfile(file, offset=file.tell(), count=size)
        start = file.tell()
        while True:
            done = file.tell() - start  # (socket.sendfile leaves the file where it stopped)
            try:
                return done + self.sock.sendfile(file, offset=start + done, count=size - done)
            except TimeoutError:
                if not _ready_now(self.sock, select.POLLOUT) and not self._peer_spoke(self.sock.gettimeout()):  # fmt: skip
                    raise

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)
        self.patient = t is not None
        self.recv_into = self._recv_into_patiently if self.patient else self.sock.recv_into

    def limit_waits(self, seconds: float | None) -> None:
        """Make a blocking read or write that moves nothing for ``seconds`` raise
        (``BlockingIOError``, errno ``EAGAIN``; ``TimeoutError`` from :meth:`sendfile`
        and a file transfer's splice; None: no limit). Kernel timeouts: no cost on the
        call path, and a signal handler that runs meanwhile starts the wait over."""
        t = 0.0 if seconds is None else min(max(float(seconds), 1e-3), 1e6)  # (a timeval's range)
        tv = struct.pack("@ll", int(t), int((t - int(t)) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.limited = seconds is not None
        self._limit = t

    def _sendmsg_limited(self, views: list) -> int:
        """``sendmsg`` that never waits in the kernel (whose ``SO_SNDTIMEO`` counts a
        call's waits together: a large write over a slow live link would run out) but in
        ``poll`` for room, at most the limit each time: nothing moved for that long."""
        while True:
            try:
                return self.sock.sendmsg(views, (), _DONTWAIT)
            except BlockingIOError:
                self._wait_for_room()

    def _wait_for_room(self) -> None:
        fd = self.sock.fileno()
        while not _wait_writable_for(fd, self._limit):
            if not self._peer_spoke(self._limit):
                raise TimeoutError(
                    f"timed out sending: the peer took nothing for {self._limit:g} s"
                )

    def _peer_spoke(self, seconds: float | None) -> bool:
        """Whether a write that waited ``seconds`` for room may wait on (see ``heard_within``)."""
        heard = self.heard_within
        try:
            return heard is not None and seconds is not None and heard(seconds)
        except IntegrityError:
            raise  # a forged heartbeat: the link is broken, and the write says why
        except OSError:
            return False

    def _sendfile_limited(self, file: Any, size: int) -> int:
        """``sendfile`` in pieces, each after ``poll`` saw room (as :meth:`_sendmsg_limited`;
        ``socket.sendfile`` would wait for room for good once the kernel's timeout ran out)."""
        sock_fd, file_fd = self.sock.fileno(), file.fileno()
        start = file.tell()
        done = 0
        try:
            while done < size:
                self._wait_for_room()
                try:  # a piece that fits in the room poll saw: no wait in the kernel
                    k = os.sendfile(sock_fd, file_fd, start + done, min(size - done, _SENDFILE_PIECE))  # fmt: skip
                except BlockingIOError:
                    continue
                if not k:
                    break  # the file ended
                done += k
        finally:
            file.seek(start + done)
        return done

    def _recv_into_patiently(self, view: Any) -> int:
        while True:
            try:
                return self.sock.recv_into(view)
            except TimeoutError:
                if not _ready_now(self.sock, select.POLLIN):
                    raise

    def _sendmsg_patiently(self, views: list) -> int:
        while True:
            try:
                return self.sock.sendmsg(views)  # (a timeout sends nothing: it is raised first)
            except TimeoutError:
                if not _ready_now(self.sock, select.POLLOUT) and not self._peer_spoke(self.sock.gettimeout()):  # fmt: skip
                    raise

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class SSLTransport(SocketTransport):
    """A TLS socket (``sendmsg`` and ``sendfile`` are not available through TLS)."""

    def recv_head_into(self, view: Any) -> int:
        return self.recv_into(view)

    def limit_waits(self, seconds: float | None) -> None:
        # OpenSSL retries a read that the kernel's timeout ended, for good: Python's own
        # timeout instead (it polls before every read and write; TLS costs more anyway)
        self.settimeout(seconds)

    def send_parts(self, parts: list) -> None:
        if not self.patient:
            for p in parts:
                self.sock.sendall(p)
            return
        for view in as_views(parts):
            while view.nbytes:
                try:
                    n = self.sock.send(view)  # (TLS: the same bytes again after a timeout)
                except TimeoutError:
                    if not _ready_now(self.sock, select.POLLOUT):
                        raise
                    continue
                view = view[n:]

    def sendfile(self, file: Any, size: int) -> int:
        return 0


class PipeTransport:
    """A pair of pipe file descriptors (a server spoken to over stdin/stdout)."""

    def __init__(self, rfd: int, wfd: int, timeout: float | None = None) -> None:
        self.rfd = rfd
        self.wfd = wfd
        self.timeout = timeout

    def fileno(self) -> int:
        return self.rfd

    def recv_into(self, view: Any) -> int:
        if self.timeout is not None:
            r = _wait_readable(self.rfd, self.timeout)
            if not r:
                raise TimeoutError("timed out reading from the pipe")
        return os.readv(self.rfd, [view])

    def send_parts(self, parts: list) -> None:
        wfd = self.wfd
        send_all(lambda views: os.writev(wfd, views), parts)

    def sendfile(self, file: Any, size: int) -> int:
        return 0

    def settimeout(self, t: float | None) -> None:
        self.timeout = t

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            try:
                os.close(fd)
            except OSError:
                pass
