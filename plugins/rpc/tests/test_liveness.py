"""Liveness of held sessions: a server ends the session of a client that died or froze.

Real processes and sockets on 127.0.0.1. The servers here use a liveness timeout of
2 s (checks every 0.5 s), so a frozen client's session must end within about 3 s
and a dead client's within about 0.5 s; the assertions allow a loaded machine
some slack on top, and are still far below the 15 s calls the clients are in.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_core.net.protect import SealedTransport
from disco_rpc import server as rpc_server
from disco_rpc import wire

pytestmark = pytest.mark.timeout(90)

BOUND = 2.0  # the servers' liveness_timeout
# A frozen client's session ends BOUND after the client's last sign of life, which may
# be up to two heartbeat intervals (2 * BOUND / 4) before it was stopped: so not before
# BOUND / 2 after the SIGSTOP (the tests check BOUND * 0.4, for a loaded machine).
#: a frozen client's session ends within BOUND + one check (BOUND / 4) + a heartbeat gap;
#: the rest is slack for a shared 2-core machine
FROZEN_WITHIN = BOUND + 4.0
#: a dead client's closed socket is seen at the next check
DEAD_WITHIN = 3.0


@disco.register_func("live.sleep", override=True)
def _sleep(t):
    time.sleep(t)
    return t


@disco.register_func("live.pid", override=True)
def _pid():
    return os.getpid()


CLIENT = textwrap.dedent(
    """
    import sys, time
    import disco_rpc as rpc
    how, port, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if how == "tracker":
        ts = rpc.connect_tracker("127.0.0.1", port)
        s = ts.request("k")
    elif how == "proxy":
        s = rpc.connect("127.0.0.1", port, key="nat", token="t")
    elif how.startswith("chain:"):  # through this server to the one at the port after ":"
        inner = ["rpc.Connect", "127.0.0.1", int(how[6:]), "", False]
        s = rpc.connect("127.0.0.1", port, session_constructor_args=inner)
    else:
        s = rpc.connect("127.0.0.1", port)
    print(s.get_function("live.pid")(), flush=True)
    try:
        if what == "call":
            print("CALLING", flush=True)
            s.get_function("live.sleep")(15)
        else:
            sys.stdin.readline()  # idle until told
            s.get_function("live.pid")()
        print("OK", flush=True)
    except rpc.RPCError as exc:
        print("ERROR", exc, flush=True)
    """
)


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _gone(pid: int) -> bool:
    """The process ended (and was reaped, or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or between open and read
        return True


def _free(ts, key="k"):
    return ts.summary()["queue_info"].get(key, {}).get("free", 0)


class _Client:
    """A client in a process of its own; ``session_pid`` is its session's process."""

    def __init__(self, how: str, port: int, what: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, how, str(port), what],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.session_pid = int(self.proc.stdout.readline())
        if what == "call":
            assert self.proc.stdout.readline().strip() == "CALLING"
            time.sleep(0.5)  # the call is running on the server

    def signal(self, sig: int) -> float:
        os.kill(self.proc.pid, sig)
        return time.monotonic()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server():
    srv = rpc.Server(port=10200, port_end=10300, liveness_timeout=BOUND)
    yield srv
    srv.terminate()


@pytest.fixture
def tracker():
    tr = rpc.Tracker(port=10300, port_end=10350, match_timeout=5.0)
    yield tr
    tr.terminate()


# --------------------------------------------------------------------------- (a) killed
def test_client_killed_mid_call(server):
    """A client SIGKILLed during a 15 s call: its session ends at once, not after the call."""
    c = _Client("direct", server.port, "call")
    try:
        t0 = c.signal(signal.SIGKILL)
        assert _wait(lambda: _gone(c.session_pid), DEAD_WITHIN), "the session outlived its client"
        assert time.monotonic() - t0 < DEAD_WITHIN
    finally:
        c.close()
    with rpc.connect("127.0.0.1", server.port) as s:  # the server serves the next client
        assert s.get_function("live.sleep")(0) == 0


# --------------------------------------------------------------------------- (b) frozen
@pytest.mark.parametrize("what", ["idle", "call"])
def test_client_frozen(server, what):
    """A SIGSTOPped client, idle or mid-call: its session ends after the bound."""
    c = _Client("direct", server.port, what)
    try:
        t0 = c.signal(signal.SIGSTOP)
        assert _wait(lambda: _gone(c.session_pid), FROZEN_WITHIN), "a frozen client kept its session"  # fmt: skip
        took = time.monotonic() - t0
        assert took >= BOUND * 0.4, (
            f"ended {took:.2f} s after the SIGSTOP: sooner than the silence rule allows"
        )
        # thawed, the client is told why its session is gone
        time.sleep(max(0.0, t0 + BOUND - time.monotonic()))
        c.signal(signal.SIGCONT)
        if what == "idle":
            c.proc.stdin.write("go\n")
            c.proc.stdin.flush()
        line = c.proc.stdout.readline()
        assert line.startswith("ERROR") and "liveness_timeout of 2 s" in line, line
        assert "could not run for" in line and "took this client for frozen" in line, line
    finally:
        c.close()
    with rpc.connect("127.0.0.1", server.port) as s:  # the server serves the next client
        assert s.get_function("live.sleep")(0) == 0


# --------------------------------------------------------------------------- with a tracker
@pytest.mark.parametrize(
    "sig, what, no_fork",
    [(signal.SIGKILL, "call", False), (signal.SIGSTOP, "call", False), (signal.SIGSTOP, "idle", False), (signal.SIGSTOP, "idle", True)],
)  # fmt: skip
def test_tracker_slot_comes_back(tracker, sig, what, no_fork):
    """The tracker's slot of a dead or frozen client's server is free again within the bound.

    (A ``no_fork`` session's thread cannot be stopped in the middle of a call: only the
    idle case frees its slot within the bound.)
    """
    srv = rpc.Server(port=10200, port_end=10300, tracker_addr=tracker.addr, key="k", liveness_timeout=BOUND, no_fork=no_fork)  # fmt: skip
    ts = rpc.connect_tracker(*tracker.addr)
    c = None
    try:
        c = _Client("tracker", tracker.port, what)
        assert _free(ts) == 0
        t0 = c.signal(sig)
        within = DEAD_WITHIN if sig == signal.SIGKILL else FROZEN_WITHIN
        assert _wait(lambda: _free(ts) == 1, within), "the server did not come back to the pool"
        assert time.monotonic() - t0 < within
        s = ts.request("k", wait_timeout=10)
        assert s.get_function("live.sleep")(0) == 0
        s.close()
    finally:
        if c is not None:
            c.close()
        srv.terminate()
        ts.close()


# --------------------------------------------------------------------------- proxy, chains
def test_frozen_client_through_proxy():
    """Behind a proxy (a relay that keeps its own connections open), a frozen client's
    session ends after the bound and the server serves the next client."""
    px = rpc.Proxy(port=10350, port_end=10400, wait=5.0)
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="nat", token="t", liveness_timeout=BOUND)  # fmt: skip
    c = None
    try:
        c = _Client("proxy", px.port, "call")
        t0 = c.signal(signal.SIGSTOP)
        assert _wait(lambda: _gone(c.session_pid), FROZEN_WITHIN)
        assert time.monotonic() - t0 >= BOUND * 0.4
        with rpc.connect("127.0.0.1", px.port, key="nat", token="t") as s:
            assert s.get_function("live.sleep")(0) == 0
    finally:
        if c is not None:
            c.close()
        srv.terminate()
        px.terminate()


def test_frozen_client_of_a_chained_session(server):
    """A chained session (rpc.Connect): the inner server's session ends too."""
    inner = rpc.Server(port=10200, port_end=10300, liveness_timeout=BOUND)
    c = None
    try:
        c = _Client(f"chain:{inner.port}", server.port, "call")  # session_pid: the inner one
        c.signal(signal.SIGSTOP)
        assert _wait(lambda: _gone(c.session_pid), FROZEN_WITHIN)
    finally:
        if c is not None:
            c.close()
        inner.terminate()


# --------------------------------------------------------------------------- (c) alive
def test_idle_client_kept(server):
    """A live client idle for 3 bounds keeps its session (its heartbeats)."""
    with rpc.connect("127.0.0.1", server.port) as s:
        pid = s.get_function("live.pid")()
        assert s.info["liveness_timeout"] == BOUND
        time.sleep(3 * BOUND)
        assert not _gone(pid)
        assert s.get_function("live.pid")() == pid


def test_the_heartbeat_thread_ends_when_the_last_session_closes():
    """No thread is left in the client once its sessions are closed (an outside check saw
    ``disco-rpc-heartbeats`` alive after every session and server was gone)."""

    def beating() -> bool:
        return any(t.name == "disco-rpc-heartbeats" for t in threading.enumerate())

    srv = rpc.Server(port=10200, port_end=10300, liveness_timeout=40)  # a beat every 10 s
    try:
        a = rpc.connect("127.0.0.1", srv.port)
        b = rpc.connect("127.0.0.1", srv.port)
        assert beating()
        a.close()
        time.sleep(0.2)
        assert beating(), "b still needs its heartbeats"
        b.close()
        deadline = time.monotonic() + 3.0  # before: at its next look, 10 s later
        while beating() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not beating()
    finally:
        srv.terminate()


def test_long_call_kept(server):
    """A call lasting 2.5 bounds returns; the session stays usable."""
    with rpc.connect("127.0.0.1", server.port) as s:
        pid = s.get_function("live.pid")()
        assert s.get_function("live.sleep")(2.5 * BOUND) == 2.5 * BOUND
        assert s.get_function("live.pid")() == pid


def test_heartbeats_do_not_fill_the_queue_during_a_call(server):
    """The heartbeats piled up during a call are dropped by the server as they come.

    A call of hours gathers heartbeats the session does not read; past about 100 KB
    the kernel takes no more data and a live client would look silent. Here a
    client sends far more heartbeats than that (1.2 MB of them) during a call of
    two bounds: the session must survive, and stay in sync.
    """
    with rpc.connect("127.0.0.1", server.port) as s:
        pid = s.get_function("live.pid")()
        conn = s._conn
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            burst = wire.HEARTBEAT_FRAME * 1000
            while not stop.is_set():
                with s._send_lock:
                    try:
                        conn.t.sock.sendall(burst)
                    except OSError:
                        return
                sent[0] += len(burst)
                time.sleep(0.01)

        t = threading.Thread(target=flood, daemon=True)
        result = {}
        caller = threading.Thread(target=lambda: result.update(r=s.get_function("live.sleep")(2 * BOUND)))  # fmt: skip
        caller.start()
        time.sleep(0.1)
        t.start()
        caller.join(30)
        stop.set()
        t.join(10)
        assert result.get("r") == 2 * BOUND, "the session was cut off during the call"
        assert sent[0] > 1 << 20, f"only {sent[0]} bytes of heartbeats could be sent"
        assert s.get_function("live.pid")() == pid


def test_sealed_heartbeats_do_not_fill_the_queue_during_a_call():
    """The same on a sealed link: each heartbeat is a record, checked as it is dropped."""
    token = "liveness-token"
    srv = rpc.Server(port=10360, port_end=10400, liveness_timeout=BOUND, token=token)
    try:
        with rpc.connect("127.0.0.1", srv.port, session_constructor_args=None, token=token) as s:
            assert isinstance(s._conn.t, SealedTransport)
            pid = s.get_function("live.pid")()
            stop = threading.Event()
            sent = [0]

            def flood() -> None:
                while not stop.is_set():
                    with s._send_lock:
                        try:
                            for _ in range(50):
                                s._conn.t.send_parts([wire.HEARTBEAT_FRAME])
                        except OSError:
                            return
                    sent[0] += 50 * 36  # a sealed heartbeat is a 36-byte record
                    time.sleep(0.01)

            t = threading.Thread(target=flood, daemon=True)
            result = {}
            caller = threading.Thread(target=lambda: result.update(r=s.get_function("live.sleep")(2 * BOUND)))  # fmt: skip
            caller.start()
            time.sleep(0.1)
            t.start()
            caller.join(30)
            stop.set()
            t.join(10)
            assert result.get("r") == 2 * BOUND, "the session was cut off during the call"
            # far beyond the ~110 KB after which an undrained queue stops the client (a real
            # client sends one 36-byte record every liveness_timeout / 4 seconds)
            assert sent[0] > 256 << 10, f"only {sent[0]} bytes of sealed heartbeats could be sent"
            assert s.get_function("live.pid")() == pid
    finally:
        srv.terminate()


def test_tls_client_kept_and_frozen_noticed(tls_files):
    """TLS clients beat only between calls: a long call is not cut, a frozen idle one is."""
    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    srv = rpc.Server(port=10200, port_end=10300, ssl_context=sctx, token="tok", liveness_timeout=BOUND)  # fmt: skip
    try:
        cctx = ssl.create_default_context(cafile=cert)
        with rpc.connect("127.0.0.1", srv.port, ssl_context=cctx, token="tok") as s:
            pid = s.get_function("live.pid")()
            assert s.get_function("live.sleep")(2 * BOUND) == 2 * BOUND
            time.sleep(2 * BOUND)
            assert s.get_function("live.pid")() == pid
            # a TLS client that stops beating (as if frozen) loses its session
            s._stop_heartbeats()
            assert _wait(lambda: _gone(pid), FROZEN_WITHIN)
    finally:
        srv.terminate()


TLS_DOWNLOADER = textwrap.dedent(
    """
    import os, signal, ssl, sys
    import disco_rpc as rpc
    port, cert = int(sys.argv[1]), sys.argv[2]
    s = rpc.connect("127.0.0.1", port, ssl_context=ssl.create_default_context(cafile=cert), token="tok")
    s.upload(bytes(64 << 20), "big")
    print(s.get_function("live.pid")(), flush=True)

    def progress(done, total):
        if done >= 8 << 20:  # freeze in the middle of the download
            os.kill(os.getpid(), signal.SIGSTOP)

    s.download("big", progress=progress)
    """
)


def test_tls_client_frozen_mid_download(tls_files):
    """A frozen TLS client cannot beat during a call; one that stops taking its reply
    (a download) is noticed all the same: its session ends within the bound."""
    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    srv = rpc.Server(port=10200, port_end=10300, ssl_context=sctx, token="tok", liveness_timeout=BOUND)  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", TLS_DOWNLOADER, str(srv.port), cert], stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        pid = int(proc.stdout.readline())
        assert _wait(lambda: _stopped(proc.pid), 20), "the client did not freeze itself"
        t0 = time.monotonic()
        assert _wait(lambda: _gone(pid), FROZEN_WITHIN), "a frozen TLS client kept its session"
        assert time.monotonic() - t0 >= BOUND * 0.4
    finally:
        proc.kill()
        proc.wait(timeout=10)
        srv.terminate()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


# --------------------------------------------------------------------------- settings
def test_liveness_timeout_setting(monkeypatch):
    monkeypatch.delenv(rpc_server.LIVENESS_ENV, raising=False)
    assert rpc_server.resolve_liveness_timeout() == rpc_server.DEFAULT_LIVENESS_TIMEOUT
    monkeypatch.setenv(rpc_server.LIVENESS_ENV, "3.5")
    assert rpc_server.resolve_liveness_timeout() == 3.5
    assert rpc_server.resolve_liveness_timeout(0) == 0
    with pytest.raises(ValueError, match="DISCO_RPC_LIVENESS_TIMEOUT"):
        monkeypatch.setenv(rpc_server.LIVENESS_ENV, "soon")
        rpc_server.resolve_liveness_timeout()
    with pytest.raises(ValueError, match="at least"):
        rpc_server.resolve_liveness_timeout(0.01)
    with pytest.raises(ValueError, match="liveness_timeout"):
        rpc.Server(port=10200, port_end=10300, liveness_timeout=-1)


def test_liveness_off():
    """liveness_timeout=0: no heartbeats are asked for, an idle client keeps its session."""
    srv = rpc.Server(port=10200, port_end=10300, liveness_timeout=0)
    try:
        with rpc.connect("127.0.0.1", srv.port) as s:
            assert "liveness_timeout" not in s.info
            assert s._beat_every == 0
    finally:
        srv.terminate()


# --------------------------------------------------------------------------- Disco workers
def test_disco_worker_session_not_cut(server):
    """A session that became a Disco worker carries the core's frames: no heartbeat may
    enter it, and its server does not expect any (an idle worker stays)."""
    sess = disco.Session.create("rpc", servers=[server.addr])
    try:
        f = sess.get_global_func("live.pid")
        pid = f().debug_get_from_remote(1)
        time.sleep(2 * BOUND)  # heartbeats would have gone out meanwhile, and idleness judged
        assert f().debug_get_from_remote(1) == pid
        assert not _gone(pid)
    finally:
        sess.shutdown()


def test_disco_worker_controller_killed(server):
    """A Disco controller killed while its worker runs a long function: the worker's
    session ends within the bound after its controller's end, not when the function
    returns."""
    script = textwrap.dedent(
        f"""
        import os, time
        import disco_core as disco
        disco.register_func("live.pid")(os.getpid)  # worker 0 runs in this process
        disco.register_func("live.sleep")(time.sleep)
        sess = disco.Session.create("rpc", servers=[("127.0.0.1", {server.port})])
        print(sess.get_global_func("live.pid")().debug_get_from_remote(1), flush=True)
        sess.get_global_func("live.sleep")(15)
        print("CALLING", flush=True)
        sess.sync_worker_0()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "CALLING"
        time.sleep(0.5)
        proc.kill()
        t0 = time.monotonic()
        assert _wait(lambda: _gone(pid), BOUND + DEAD_WITHIN), "the worker outlived its controller"  # fmt: skip
        assert time.monotonic() - t0 < BOUND + DEAD_WITHIN
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --------------------------------------------------------------------------- the frame
def test_heartbeat_frames_on_the_wire():
    """Conn.recv skips heartbeats; drop_heartbeats drops those at the head, keeps the rest."""
    import socket

    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    a.settimeout(10)  # a test that goes wrong fails instead of hanging
    b.settimeout(10)
    try:
        ca, cb = wire.Conn(wire.SocketTransport(a)), wire.Conn(wire.SocketTransport(b))
        ca.send_heartbeat()
        ca.send_heartbeat()
        ca.send(wire.REQUEST, 7, ("x", 1))
        assert cb.recv() == (wire.REQUEST, 7, ("x", 1))
        for _ in range(3000):  # more than the read buffer (64 KiB) holds
            ca.send_heartbeat()
        ca.send(wire.REQUEST, 8, None)
        ca.send_heartbeat()
        time.sleep(0.2)  # all of it arrived
        cb.drop_heartbeats()
        assert cb.buffered() and bytes(cb.view[cb.start : cb.start + 1]) == bytes([wire.REQUEST])
        assert cb.recv() == (wire.REQUEST, 8, None)
        cb.drop_heartbeats()  # the last heartbeat; then nothing is there: it returns at once
        assert cb.buffered() == 0
    finally:
        a.close()
        b.close()


def _stopped_in_a_call(s, pid: int) -> float:
    """Stop the session process ``pid`` 0.3 s into a long call of ``s``; the seconds until
    the call raised (the server's kill, after twice the bound; or, with
    $DISCO_RPC_WATCH_SERVER, the client's own watch after 1.5 times: test_server_liveness.py)."""
    threading.Timer(0.3, os.kill, (pid, signal.SIGSTOP)).start()
    t0 = time.monotonic()
    with pytest.raises(rpc.RPCError, match="sent nothing|lost the connection"):
        s.get_function("live.sleep")(60)
    return time.monotonic() - t0


def _thaw_and_kill(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_stopped_session_process_is_ended_and_its_server_pooled_again(tracker):
    """Found by an outside chaos check: a session process stopped for good (SIGSTOP) kept
    its server out of the tracker's pool for good, and a client in a call with it waited
    for good without session_timeout (its own watchdog cannot run while it is stopped).
    The server's listener now kills it after twice the bound (and the client, which now
    watches its server, gave up on the call before)."""
    srv = rpc.Server(port=10200, port_end=10300, tracker_addr=("127.0.0.1", tracker.port), key="k", liveness_timeout=BOUND)  # fmt: skip
    pid = None
    try:
        ts = rpc.connect_tracker("127.0.0.1", tracker.port)
        assert _wait(lambda: _free(ts) >= 1, 20), "the server never registered"
        s = ts.request("k")
        pid = s.get_function("live.pid")()
        took = _stopped_in_a_call(s, pid)
        assert 1.4 * BOUND <= took < 2 * BOUND + 6, f"the call ended after {took:.1f} s"
        # the server's listener kills it after twice the bound (nothing else can)
        assert _wait(lambda: _gone(pid), 2 * BOUND + 5), "the stopped session process was left"
        assert _wait(lambda: _free(ts) >= 1, 10), "the server did not come back to the pool"
        with ts.request("k") as s2:  # and it serves again
            assert s2.get_function("live.sleep")(0) == 0
    finally:
        if pid is not None:
            _thaw_and_kill(pid)
        srv.terminate()


def test_a_stopped_session_process_behind_a_proxy_is_ended_too():
    """The same for a server that takes its sessions through a proxy (its own loop, not
    the listener's: found when the fix above was checked from outside)."""
    px = rpc.Proxy(port=10350, port_end=10400, wait=5.0)
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="nat", token="t", liveness_timeout=BOUND)  # fmt: skip
    pid = None
    try:
        s = rpc.connect("127.0.0.1", px.port, key="nat", token="t")
        pid = s.get_function("live.pid")()
        assert _stopped_in_a_call(s, pid) < 2 * BOUND + 6
        assert _wait(lambda: _gone(pid), 2 * BOUND + 5), "the stopped session process was left"
        with rpc.connect("127.0.0.1", px.port, key="nat", token="t") as s2:  # served again
            assert s2.get_function("live.sleep")(0) == 0
    finally:
        if pid is not None:
            _thaw_and_kill(pid)
        srv.terminate()
        px.terminate()
