"""A file that refuses spliced bytes mid-stream: the error is raised and the link stays in sync.

Runs in a subprocess: the file-size limit (RLIMIT_FSIZE) that makes the sink refuse
would otherwise apply to the test process itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import errno, os, resource, signal, socket, sys, tempfile, threading
    from disco_core.net.security import Handshake
    from disco_rpc import wire

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
    sealed = sys.argv[1] == "sealed"
    a, b = socket.socketpair()
    tx, rx = wire.Conn(wire.SocketTransport(a)), wire.Conn(wire.SocketTransport(b))
    if sealed:
        c, s = Handshake(b"t", "client", b"x"), Handshake(b"t", "server", b"x")
        c.bind(b"h", b"r"); s.bind(b"h", b"r")
        tx.t, rx.t = wire.SealedLink(tx.t, c.keys()), wire.SealedLink(rx.t, s.keys())
    calls = []
    real = wire.splice_exact
    wire.splice_exact = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    data = os.urandom(8 << 20)
    second = os.urandom(4 << 20)
    t = threading.Thread(target=lambda: (tx.send_stream(7, data, len(data)), tx.send(wire.REQUEST, 1, "after"), tx.send_stream(7, second, len(second))))
    t.start()
    with tempfile.TemporaryFile() as f:
        try:
            rx.recv_stream(7, len(data), sink=f)
        except OSError as exc:
            assert exc.errno == errno.EFBIG, exc
            print("refused", f.tell() <= 2 << 20)
        else:
            print("not refused")
    print("next frame", rx.recv()[2])  # the stream was read to its end: still in sync
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    with tempfile.TemporaryFile() as f:  # the same pipe spliced again: nothing stale in it
        rx.recv_stream(7, len(second), sink=f)
        f.seek(0)
        print("second", f.read() == second, "spliced", bool(calls))
    t.join()
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("link", ["plain", "sealed"])
def test_refused_splice_keeps_the_link_in_sync(link):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, link], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "refused", "True", "next", "frame", "after", "second", "True", "spliced", "True",
    ], out.stdout  # fmt: skip
