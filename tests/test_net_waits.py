"""disco_core.net.io: bounded waits of a socket transport (``limit_waits``, ``settimeout``).

A bound counts the time nothing moved, not the time a call took: a large write over a
slow live link is many waits, and a signal handler that outlasts a wait is no silence.
Real sockets on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from disco_core.net.io import SocketTransport

pytestmark = pytest.mark.timeout(60)

LIMIT = 0.5


@pytest.fixture(params=["limit_waits", "settimeout"])
def pair(request):
    lsock = socket.create_server(("127.0.0.1", 0))
    near = socket.create_connection(lsock.getsockname())
    far, _ = lsock.accept()
    lsock.close()
    for s in (near, far):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    t = SocketTransport(near)
    getattr(t, request.param)(LIMIT)
    yield t, far
    near.close()
    far.close()


def _expired(exc: BaseException) -> bool:
    return isinstance(exc, (TimeoutError, BlockingIOError))


def test_a_silent_peer_ends_a_read_after_the_bound(pair):
    t, _far = pair
    t0 = time.monotonic()
    with pytest.raises(OSError) as err:
        t.recv_into(memoryview(bytearray(16)))
    assert _expired(err.value)
    assert LIMIT * 0.9 <= time.monotonic() - t0 < LIMIT + 1.0


def test_a_peer_that_takes_nothing_ends_a_write_after_the_bound(pair):
    t, _far = pair  # the far end reads nothing: the buffers fill, then nothing moves
    t0 = time.monotonic()
    with pytest.raises(OSError) as err:
        t.send_parts([bytes(64 << 20)])
    assert _expired(err.value)
    assert time.monotonic() - t0 < LIMIT * 2 + 1.0  # (filling the buffers is quick)


def test_a_peer_that_takes_nothing_ends_a_sendfile_after_the_bound(pair, tmp_path):
    t, _far = pair
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(64 << 20))
    with open(path, "rb") as f:
        with pytest.raises(OSError) as err:
            t.sendfile(f, 64 << 20)
        assert _expired(err.value)
        assert 0 < f.tell() < 64 << 20  # where it stopped: what went out


def _read_slowly(far: socket.socket, size: int, every: float = 0.2, piece: int = 256 << 10, after: float = 0.0) -> tuple[bytearray, threading.Thread]:  # fmt: skip
    """A thread that reads ``size`` bytes from ``far``, ``piece`` bytes every ``every``
    seconds, starting ``after`` seconds from now, into the bytearray returned with it."""
    got = bytearray()

    def slow_reader():
        time.sleep(after)
        while len(got) < size:
            time.sleep(every)
            chunk = far.recv(piece)
            if not chunk:
                return
            got.extend(chunk)

    th = threading.Thread(target=slow_reader)
    th.start()
    return got, th


def test_a_write_longer_than_the_bound_to_a_slow_reader_goes_through(pair):
    """The reader takes at most 256 KiB every 0.2 s: the write takes several bounds, and
    each of its waits is short."""
    t, far = pair
    size = 3 << 19
    got, th = _read_slowly(far, size)
    t0 = time.monotonic()
    t.send_parts([bytes(range(256)) * (size // 256)])
    th.join(30)
    assert time.monotonic() - t0 > 4 * LIMIT
    assert bytes(got) == bytes(range(256)) * (size // 256)


def test_a_file_sent_to_a_slow_reader_goes_through(pair, tmp_path):
    t, far = pair
    size = 1 << 20
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    got, th = _read_slowly(far, size)
    with open(path, "rb") as f:
        assert t.sendfile(f, size) == size
        assert f.tell() == size
    th.join(30)
    assert bytes(got) == data


def _heard_while(t: SocketTransport, far: socket.socket, seconds: float) -> None:
    """The far end sends a byte every quarter bound for ``seconds`` (a server's beats)
    and ``t.heard_within`` tells when the last came, as the kernel's ``TCP_INFO`` would."""
    last = [time.monotonic()]

    def beat():
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                far.sendall(b"h")
            except OSError:
                return  # (the test ended)
            last[0] = time.monotonic()
            time.sleep(LIMIT / 4)

    t.heard_within = lambda within: time.monotonic() - last[0] < within
    threading.Thread(target=beat, daemon=True).start()


@pytest.mark.parametrize("how", ["send_parts", "sendfile"])
def test_a_write_waits_on_while_the_peer_is_heard(pair, how, tmp_path):
    """A relay holds back what was sent (no room for 4 bounds) while the peer's bytes
    keep coming: the write waits on, and goes through once room comes."""
    t, far = pair
    size = 4 << 20
    data = os.urandom(size)
    _heard_while(t, far, 6 * LIMIT)
    got, th = _read_slowly(far, size + 1, every=0.0, piece=1 << 20, after=4 * LIMIT)
    t0 = time.monotonic()
    if how == "sendfile":
        path = tmp_path / "f.bin"
        path.write_bytes(data)
        with open(path, "rb") as f:
            assert t.sendfile(f, size) == size
    else:
        t.send_parts([data])
    assert time.monotonic() - t0 > 3 * LIMIT
    t.send_parts([b"!"])
    th.join(30)
    assert len(got) == size + 1 and bytes(got[:size]) == data


def test_a_write_ends_once_the_peer_falls_silent(pair):
    """The peer is heard for 3 bounds, takes nothing, then falls silent: the write ends
    about a bound after the last of its bytes."""
    t, far = pair
    _heard_while(t, far, 3 * LIMIT)
    t0 = time.monotonic()
    with pytest.raises(OSError) as err:
        t.send_parts([bytes(64 << 20)])
    assert _expired(err.value)
    assert 3 * LIMIT < time.monotonic() - t0 < 5 * LIMIT + 1.0


def test_a_signal_handler_longer_than_the_bound_is_no_silence(pair):
    """The peer's bytes arrive while a handler of the program runs for 3 bounds inside
    the wait: Python's own timeout would give up on return without a look."""
    t, far = pair
    old = signal.signal(signal.SIGALRM, lambda *_: time.sleep(3 * LIMIT))
    try:
        threading.Timer(0.3, far.sendall, (b"x" * 8,)).start()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        view = memoryview(bytearray(8))
        assert t.recv_into(view) >= 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_no_limit_again(pair):
    t, far = pair
    t.limit_waits(None) if t.limited else t.settimeout(None)
    assert not t.limited and not t.patient
    threading.Timer(3 * LIMIT, far.sendall, (b"late",)).start()
    view = memoryview(bytearray(4))
    assert t.recv_into(view) == 4 and bytes(view) == b"late"
