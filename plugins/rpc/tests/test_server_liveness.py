"""Liveness the other way: a client ends a call whose server froze, or whose host or
network is gone, instead of waiting for good.

An outside chaos check SIGSTOPped a server's session process (and a proxy) in the
middle of 256 MiB uploads and downloads: with no ``session_timeout`` the client was
still blocked 45 s later, until the check killed the process. A server now sends
heartbeats to a client that asks for them while a request's work runs, and the
client's heartbeat thread ends a call that heard nothing for the server's
``liveness_timeout``. Real processes and sockets on 127.0.0.1; the servers use a
bound of 2 s (beats every 0.5 s).
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import threading
import time

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc

pytestmark = pytest.mark.timeout(120)

BOUND = 2.0
#: a frozen server is noticed within the bound, one check of the client's heartbeat
#: thread (BOUND / 4) and the call's own start; the rest is slack for a loaded machine
WITHIN = BOUND + 6.0


@disco.register_func("srvlive.sleep", override=True)
def _sleep(t):
    time.sleep(t)
    return t


@disco.register_func("srvlive.pid", override=True)
def _pid():
    return os.getpid()


@pytest.fixture(params=[None, "tok"], ids=["plain", "sealed"])
def server(request):
    srv = rpc.Server(port=10500, port_end=10600, liveness_timeout=BOUND, token=request.param)
    srv.token = request.param
    yield srv
    srv.terminate()


def _freeze_after(pid: int, delay: float) -> threading.Timer:
    t = threading.Timer(delay, os.kill, (pid, signal.SIGSTOP))
    t.start()
    return t


def _thaw_and_kill(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_long_call_to_a_live_server_is_kept(server):
    """Three bounds of work with nothing else on the wire: the server's beats keep it."""
    with rpc.connect("127.0.0.1", server.port, token=server.token) as s:
        assert s.info["call_beats"] == pytest.approx(BOUND / 4)
        assert s.get_function("srvlive.sleep")(3 * BOUND) == 3 * BOUND
        time.sleep(BOUND * 1.5)  # idle between calls: the server does not beat, and that is fine
        assert s.get_function("srvlive.sleep")(0) == 0


@pytest.mark.parametrize("during", ["call", "upload", "download"])
def test_a_frozen_server_ends_the_call_with_a_clear_error(server, during):
    with rpc.connect("127.0.0.1", server.port, token=server.token) as s:
        pid = s.info["pid"]
        blob = np.random.default_rng(0).bytes(256 << 20)
        if during == "download":
            s.upload(blob, "big.bin")
        timer = _freeze_after(pid, 0.3)
        t0 = time.monotonic()
        try:
            with pytest.raises(rpc.RPCError, match=r"sent nothing|took none") as err:
                if during == "call":
                    s.get_function("srvlive.sleep")(60)
                elif during == "upload":
                    while True:  # (one upload may end before the freeze)
                        s.upload(blob, "big.bin")
                else:
                    while True:
                        s.download("big.bin")
            took = time.monotonic() - t0
            assert took < 0.3 + WITHIN, f"noticed after {took:.1f} s"
            assert "frozen, or its host or network is gone" in str(err.value)
            assert "liveness_timeout: 2 s" in str(err.value)
            with pytest.raises(rpc.RPCError, match="is closed"):  # and says so after
                s.get_function("srvlive.pid")()
        finally:
            timer.cancel()
            _thaw_and_kill(pid)
    with rpc.connect("127.0.0.1", server.port, token=server.token) as s2:  # a new one works
        assert s2.get_function("srvlive.sleep")(0) == 0


def test_a_frozen_server_behind_a_proxy():
    px = rpc.Proxy(port=10600, port_end=10650, wait=5.0)
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="nat", token="t", liveness_timeout=BOUND)  # fmt: skip
    try:
        with rpc.connect("127.0.0.1", px.port, key="nat", token="t") as s:
            assert s.get_function("srvlive.sleep")(2 * BOUND) == 2 * BOUND  # beats pass the proxy
            pid = s.get_function("srvlive.pid")()
            timer = _freeze_after(pid, 0.3)
            t0 = time.monotonic()
            try:
                with pytest.raises(rpc.RPCError, match="sent nothing"):
                    s.get_function("srvlive.sleep")(60)
                assert time.monotonic() - t0 < 0.3 + WITHIN
            finally:
                timer.cancel()
                _thaw_and_kill(pid)
    finally:
        srv.terminate()
        px.terminate()


def test_a_chained_session_is_watched_through_its_inner_server():
    outer = rpc.Server(port=10500, port_end=10600, liveness_timeout=BOUND)
    inner = rpc.Server(port=10500, port_end=10600, liveness_timeout=BOUND)
    try:
        ctor = ["rpc.Connect", "127.0.0.1", inner.port, "", False]
        with rpc.connect("127.0.0.1", outer.port, session_constructor_args=ctor) as s:
            assert s.info["call_beats"] == pytest.approx(BOUND / 4)  # the inner server's
            assert s.get_function("srvlive.sleep")(2 * BOUND) == 2 * BOUND
            pid = s.get_function("srvlive.pid")()  # the inner session's process
            timer = _freeze_after(pid, 0.3)
            try:
                with pytest.raises(rpc.RPCError, match="sent nothing"):
                    s.get_function("srvlive.sleep")(60)
            finally:
                timer.cancel()
                _thaw_and_kill(pid)
    finally:
        inner.terminate()
        outer.terminate()


def test_tls_server_beats_during_calls(tls_files):
    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    srv = rpc.Server(port=10500, port_end=10600, ssl_context=sctx, token="tok", liveness_timeout=BOUND)  # fmt: skip
    try:
        cctx = ssl.create_default_context(cafile=cert)
        with rpc.connect("127.0.0.1", srv.port, ssl_context=cctx, token="tok") as s:
            assert s.get_function("srvlive.sleep")(2 * BOUND) == 2 * BOUND
            pid = s.info["pid"]
            timer = _freeze_after(pid, 0.3)
            try:
                with pytest.raises(rpc.RPCError, match="sent nothing"):
                    s.get_function("srvlive.sleep")(60)
            finally:
                timer.cancel()
                _thaw_and_kill(pid)
    finally:
        srv.terminate()


def test_a_server_that_promises_no_beats_is_not_watched():
    """Liveness off on the server (as on an older or foreign one): nothing promised, so a
    long call is never judged by its silence."""
    srv = rpc.Server(port=10500, port_end=10600, liveness_timeout=0)
    try:
        with rpc.connect("127.0.0.1", srv.port) as s:
            assert "call_beats" not in s.info and s._quiet_bound == 0
            assert s.get_function("srvlive.sleep")(1.0) == 1.0
    finally:
        srv.terminate()


def test_a_client_slow_to_read_its_reply_does_not_blame_the_server(server):
    """This process read nothing of a download for longer than the bound (a signal
    handler of the program ran meanwhile), so the server stopped sending: bytes that
    wait unread are no silence of the server's. The server ends the session by its own
    rule (a client that takes nothing for the bound), and the error must not say that
    the server froze."""
    with rpc.connect("127.0.0.1", server.port, token=server.token) as s:
        s.upload(bytes(32 << 20), "big.bin")
        state = {"slept": False}

        def slow(_sig, _frame):
            if not state["slept"]:
                state["slept"] = True
                time.sleep(2.5 * BOUND)  # the main thread reads nothing meanwhile

        old = signal.signal(signal.SIGALRM, slow)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            for _ in range(20):
                try:
                    assert len(s.download("big.bin")) == 32 << 20
                except rpc.RPCError as exc:
                    assert not re.search("sent nothing|took none", str(exc)), exc
                    break
                if state["slept"]:
                    break
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert state["slept"]


def test_an_interrupted_call_leaves_no_watch_behind(server):
    """Ctrl-C during a call ends the client's wait; the idle session after it is not
    judged (no call is under way), and the next call gets its own answer."""
    with rpc.connect("127.0.0.1", server.port, token=server.token) as s:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            s.get_function("srvlive.sleep")(1.0)
        time.sleep(2 * BOUND)
        assert s.get_function("srvlive.pid")() == s.info["pid"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_stopped_session_process_is_ended_and_its_server_pooled_again():
    """Found by the same check: a session process stopped for good kept its server out of
    the tracker's pool for good, after its client had given up (its own watchdog cannot
    run while it is stopped). The server's listener now kills it after twice the bound."""
    tr = rpc.Tracker(port=10650, port_end=10700, match_timeout=5.0)
    srv = rpc.Server(port=10500, port_end=10600, tracker_addr=("127.0.0.1", tr.port), key="k", liveness_timeout=BOUND)  # fmt: skip
    pid = None
    try:
        ts = rpc.connect_tracker("127.0.0.1", tr.port)
        deadline = time.monotonic() + 20
        while ts.summary()["queue_info"].get("k", {}).get("free", 0) < 1:
            assert time.monotonic() < deadline, "the server never registered"
            time.sleep(0.1)
        s = ts.request("k")
        pid = s.info["pid"]
        timer = _freeze_after(pid, 0.3)
        with pytest.raises(rpc.RPCError, match="sent nothing"):
            s.get_function("srvlive.sleep")(60)
        timer.cancel()
        deadline = time.monotonic() + 2 * BOUND + 8
        while not _gone(pid):
            assert time.monotonic() < deadline, "the stopped session process was left"
            time.sleep(0.1)
        while ts.summary()["queue_info"].get("k", {}).get("free", 0) < 1:
            assert time.monotonic() < deadline, "the server did not come back to the pool"
            time.sleep(0.1)
        s2 = ts.request("k")  # and it serves again
        assert s2.get_function("srvlive.sleep")(0) == 0
        s2.close()
    finally:
        if pid is not None:
            _thaw_and_kill(pid)
        srv.terminate()
        tr.terminate()
