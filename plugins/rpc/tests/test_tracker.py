"""The tracker (issue 8): several servers, competing clients, priorities, deaths; timing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_rpc.tracker import Tracker, format_summary

pytestmark = pytest.mark.timeout(60)


@disco.register_func("trk.pid", override=True)
def _pid():
    return os.getpid()


@disco.register_func("trk.sleep", override=True)
def _sleep(t):
    time.sleep(t)
    return t


@disco.register_func("trk.die", override=True)
def _die():
    os._exit(3)


@disco.register_func("trk.spin", override=True)
def _spin(n):
    s = 0
    for i in range(int(n)):
        s += i
    return s


@disco.register_func("trk.spawn_daemon", override=True)
def _spawn_daemon(seconds):
    """Fork a process that outlives the session (it inherits every descriptor)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(0)
    return pid


CALLS = [0]


@disco.register_func("trk.count", override=True)
def _count():
    CALLS[0] += 1


@disco.register_func("trk.calls", override=True)
def _calls():
    return CALLS[0]


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _free(ts, key):
    return ts.summary()["queue_info"].get(key, {}).get("free", 0)


@pytest.fixture
def tracker():
    tr = rpc.Tracker(port=9600, port_end=9700, match_timeout=2.0)
    yield tr
    tr.terminate()


def test_tracker_surface_and_start_time():
    t0 = time.perf_counter()
    tr = Tracker(port=9600, port_end=9700)
    try:
        assert time.perf_counter() - t0 < 0.5
        assert rpc.Tracker is Tracker
        ts = rpc.connect_tracker("127.0.0.1", tr.port)
        assert ts.summary() == {"server_info": [], "queue_info": {}}
        assert "Server List" in ts.text_summary()
        ts.close()
    finally:
        tr.terminate()


def test_several_servers_and_release(tracker):
    servers = [rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="cpu") for _ in range(3)]  # fmt: skip
    try:
        ts = rpc.connect_tracker(*tracker.addr)
        info = ts.summary()
        assert info["queue_info"]["cpu"] == {"free": 3, "pending": 0, "total": 3}
        assert sorted(s["addr"][1] for s in info["server_info"]) == sorted(s.port for s in servers)
        sessions = [ts.request("cpu") for _ in range(3)]
        pids = {s.get_function("trk.pid")() for s in sessions}
        assert len(pids) == 3
        assert _free(ts, "cpu") == 0
        text = ts.text_summary()  # TVM's table: key, total, free, pending
        assert "cpu   3      0     0      \n" in text, text
        for s in sessions:
            s.close()
        assert _wait(lambda: _free(ts, "cpu") == 3)
        # request() -> usable session is fast
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            s = ts.request("cpu")
            s.get_function("trk.pid")()
            times.append(time.perf_counter() - t0)
            s.close()
        assert sorted(times)[2] < 0.1  # target 10 ms; loose for loaded CI machines
        ts.close()
    finally:
        for s in servers:
            s.terminate()


def test_key_isolation_and_tickets(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="gpu")
    try:
        ts = rpc.connect_tracker(*tracker.addr)
        # a tracker-managed server refuses clients without a ticket
        # its own key without a ticket is told so (it was "key mismatch"), others are not
        with pytest.raises(rpc.RPCAuthError, match="a ticket from the tracker is required"):
            rpc.connect("127.0.0.1", srv.port, key="gpu")
        with pytest.raises(rpc.RPCAuthError, match="key mismatch"):
            rpc.connect("127.0.0.1", srv.port, key="gpu@forged")
        with pytest.raises(rpc.RPCAuthError, match="key mismatch"):
            rpc.connect("127.0.0.1", srv.port, key="cpu")
        s = ts.request("gpu")
        assert s.get_function("trk.pid")() > 0
        s.close()
        ts.close()
    finally:
        srv.terminate()


def test_priority_then_fifo(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="one")
    try:
        ts = rpc.connect_tracker(*tracker.addr)
        holder = ts.request("one")
        order: list[str] = []
        lock = threading.Lock()

        def client(name, prio):
            t = rpc.connect_tracker(*tracker.addr)
            s = t.request("one", priority=prio)
            with lock:
                order.append(name)
            time.sleep(0.05)
            s.close()
            t.close()

        threads = []
        for name, prio in [("low1", 1), ("high", 5), ("low2", 1), ("mid", 3)]:
            th = threading.Thread(target=client, args=(name, prio))
            th.start()
            threads.append(th)
            # each request reaches the tracker before the next one starts
            assert _wait(lambda n=len(threads): ts.summary()["queue_info"]["one"]["pending"] == n)
        holder.close()
        for th in threads:
            th.join(20)
        assert order == ["high", "mid", "low1", "low2"]
        ts.close()
    finally:
        srv.terminate()


@pytest.mark.parametrize(
    "tracker_first", [True, False], ids=["this-tracker", "tracker-of-the-last-release"]
)
def test_a_server_registering_while_a_client_waits_serves_it(tracker, monkeypatch, tracker_first):
    """A request waits at the tracker; a server of its key then registers. The tracker
    matched them before it answered the registration, and the server took the ticket
    that came first for a refusal and exited (outside chaos check, 8 of 8 runs). Now
    the tracker answers first, and a server takes tickets that come before the answer
    (as a tracker of the last release sends them: the second case patches this one
    back to that order)."""
    if not tracker_first:
        tracker.terminate()
        from disco_rpc import tracker as tracker_module

        def put_then_match(self, link, key, addr, busy=None, _put=tracker_module.TrackerState.put):
            sid = _put(self, link, key, addr, busy)
            self.match(key)  # the tickets before the answer, as the last release did
            return sid

        monkeypatch.setattr(tracker_module.TrackerState, "put", put_then_match)
        tracker = rpc.Tracker(port=9600, port_end=9700, match_timeout=2.0)
    result: list = []

    def client() -> None:
        ts = rpc.connect_tracker(*tracker.addr)
        try:
            with ts.request("late", wait_timeout=30) as s:
                result.append(s.get_function("trk.calls")() >= 0)
        except Exception as exc:  # noqa: BLE001 - checked below
            result.append(exc)
        finally:
            ts.close()

    th = threading.Thread(target=client)
    th.start()
    ts = rpc.connect_tracker(*tracker.addr)
    srv = None
    try:
        assert _wait(lambda: ts.summary()["queue_info"].get("late", {}).get("pending") == 1)
        srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="late")
        th.join(30)
        assert result == [True]
        assert os.waitpid(srv.pid, os.WNOHANG) == (0, 0)  # it did not exit
    finally:
        ts.close()
        if srv is not None:
            srv.terminate()
        if not tracker_first:
            tracker.terminate()


def test_server_death_removes_it(tracker):
    a = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    b = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    try:
        os.kill(a.pid, signal.SIGKILL)
        assert _wait(lambda: ts.summary()["queue_info"]["k"]["total"] == 1)
        assert ts.summary()["server_info"][0]["addr"][1] == b.port
        s = ts.request("k")
        assert s.get_function("trk.pid")() > 0
        s.close()
    finally:
        a.terminate()
        b.terminate()
        ts.close()


def test_session_process_death_frees_server(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    try:
        s = ts.request("k")
        with pytest.raises(rpc.RPCError):
            s.get_function("trk.die")()
        assert _wait(lambda: _free(ts, "k") == 1)
        s2 = ts.request("k")
        s2.close()
    finally:
        srv.terminate()
        ts.close()


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import disco_rpc as rpc
    ts = rpc.connect_tracker("127.0.0.1", int(sys.argv[1]))
    s = ts.request("k")
    print("GOT", flush=True)
    time.sleep(60)
    """
)


def test_client_crash_frees_server(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, str(tracker.port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "GOT"
        assert _free(ts, "k") == 0
        proc.kill()
        proc.wait()
        assert _wait(lambda: _free(ts, "k") == 1)
        s = ts.request("k")
        s.close()
    finally:
        proc.kill()
        srv.terminate()
        ts.close()


def test_session_timeout_frees_server(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    try:
        s = ts.request("k", session_timeout=0.5)
        with pytest.raises(rpc.RPCSessionTimeoutError):
            s.get_function("trk.sleep")(5)
        assert _wait(lambda: _free(ts, "k") == 1)
    finally:
        srv.terminate()
        ts.close()


def test_unused_ticket_expires(tracker):
    from disco_rpc import tracker as T

    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    try:
        ts._call(T.T_REQUEST, ("k", 1))  # a client that never connects
        assert _free(ts, "k") == 0
        assert _wait(lambda: _free(ts, "k") == 1, timeout=6)  # match_timeout=2
    finally:
        srv.terminate()
        ts.close()


def test_request_and_run_retries_dropped_server(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    calls = []

    def job(sess):
        calls.append(1)
        if len(calls) == 1:
            sess.get_function("trk.die")()  # the session drops: retried
        return sess.get_function("trk.pid")()

    try:
        assert ts.request_and_run("k", job) > 0
        assert len(calls) == 2
        with pytest.raises(rpc.RPCError, match="not registered"):
            ts.request_and_run("k", lambda s: s.get_function("no.such.function")())
    finally:
        srv.terminate()
        ts.close()


def test_tracker_token_required():
    tr = rpc.Tracker(port=9600, port_end=9700, token="s3cret")
    try:
        with pytest.raises(rpc.RPCAuthError):
            rpc.connect_tracker("127.0.0.1", tr.port)
        with pytest.raises(rpc.RPCAuthError, match=r"the tracker refused.*DISCO_TRACKER_TOKEN"):
            rpc.connect_tracker("127.0.0.1", tr.port, token="wrong")
        with pytest.raises(rpc.RPCAuthError):
            rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="k")
        srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="k", token="s3cret")
        try:
            ts = rpc.connect_tracker("127.0.0.1", tr.port, token="s3cret")
            s = ts.request("k")
            assert s.get_function("trk.pid")() > 0
            s.close()
            ts.close()
        finally:
            srv.terminate()
    finally:
        tr.terminate()


def test_a_tracker_of_its_own_token_through_disco_tracker_token(monkeypatch):
    """With one token for everything, the tracker holds the servers' token and could open
    sessions on them (an attacker check; the README said the server's token was only
    offered to it). ``$DISCO_TRACKER_TOKEN`` gives the tracker links a token of their
    own, beside ``$DISCO_TOKEN``, for the Python API and the commands alike."""
    from disco_rpc import tracker as T

    monkeypatch.setenv("DISCO_TRACKER_TOKEN", "tracker-only")
    monkeypatch.setenv("DISCO_TOKEN", "servers-only")
    tr = rpc.Tracker(port=9600, port_end=9700)  # proves "tracker-only"
    try:
        srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="own")
        try:
            with rpc.connect_tracker("127.0.0.1", tr.port) as ts:
                with ts.request("own", wait_timeout=20) as s:  # a session under "servers-only"
                    assert s.get_function("trk.pid")() > 0
                # what the tracker holds (a ticket it hands itself, its own token) opens no
                # session on the server
                host, port, ticket = ts._wait_for_server("own", 1, None, None)
                with pytest.raises(rpc.RPCAuthError, match="wrong token"):
                    rpc.connect(host, port, T.ticket_key("own", ticket), token="tracker-only")
            r = subprocess.run(
                [sys.executable, "-m", "disco_rpc", "query", "--port", str(tr.port)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert r.returncode == 0 and "own" in r.stdout, r
        finally:
            srv.terminate()
    finally:
        tr.terminate()


def test_tracker_bounded_messages(tracker):
    import socket
    import struct

    from disco_rpc import auth, wire
    from disco_rpc import tracker as T

    conn = T.open_tracker_link(tracker.addr, T.CLIENT_KEY, None, None)
    head = struct.pack("<BBHII", wire.REQUEST, T.T_SUMMARY, 0, 10 << 20, 0)
    conn.t.send_parts([head])
    with pytest.raises((EOFError, OSError)):
        conn.recv()
    conn.close()
    # a bad key is refused at the handshake
    with pytest.raises(rpc.RPCAuthError):
        T.open_tracker_link(tracker.addr, "someone-else", None, None)
    # the tracker still serves others
    ts = rpc.connect_tracker(*tracker.addr)
    assert ts.summary()["server_info"] == []
    ts.close()
    _ = (socket, auth)


def test_query_command(tracker):
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="q")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "disco_rpc", "query", "--port", str(tracker.port)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "Queue Status" in out.stdout and f":{srv.port}" in out.stdout
    finally:
        srv.terminate()


def test_tracker_command():
    proc = subprocess.Popen(
        [sys.executable, "-m", "disco_rpc", "tracker", "--port", "9600", "--port-end", "9700"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "tracker listening" in line
        port = int(line.rsplit(":", 1)[1])
        ts = rpc.connect_tracker("127.0.0.1", port)
        assert format_summary(ts.summary()).startswith("Server List")
        ts.close()
    finally:
        proc.terminate()
        proc.wait(10)


# --------------------------------------------------------------------------- time_evaluator
C_SOURCE = "#include <stdint.h>\nint64_t busy(int64_t n) { volatile int64_t s = 0; for (int64_t i = 0; i < n; ++i) s += i; return s; }\n"


@pytest.fixture(scope="module")
def plain_server():
    srv = rpc.Server(port=9400, port_end=9500)
    yield srv
    srv.terminate()


@pytest.mark.parametrize("kind", ["server", "local"])
def test_time_evaluator_python(plain_server, kind, tmp_path):
    sess = rpc.connect("127.0.0.1", plain_server.port) if kind == "server" else rpc.LocalSession()
    try:
        (tmp_path / "k.py").write_text("def work(n):\n    return sum(range(n))\n")
        sess.upload(str(tmp_path / "k.py"))
        mod = sess.load_module("k.py")
        ev = mod.time_evaluator("work", sess.cpu(0), number=5, repeat=3)
        res = ev(1000)
        assert isinstance(res, rpc.BenchmarkResult)
        assert len(res.results) == 3
        assert 0 < res.min <= res.median <= res.max
        assert res.mean > 0 and res.std >= 0
        assert "mean (ms)" in str(res)
        # min_repeat_ms raises the number of runs until a repeat lasts that long
        res = mod.time_evaluator("work", sess.cpu(0), number=1, repeat=2, min_repeat_ms=20)(10)
        assert len(res.results) == 2 and res.max < 0.01
        # a global function through the system library
        slow = sess.system_lib().time_evaluator("trk.sleep", sess.cpu(0), number=2)(0.01)
        assert 0.009 < slow.mean < 0.5
        with pytest.raises(rpc.RPCError):
            mod.time_evaluator("nope", sess.cpu(0))()
    finally:
        sess.close()


def test_time_evaluator_ctypes(plain_server, tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) on this machine")
    src = tmp_path / "busy.c"
    src.write_text(C_SOURCE)
    so = tmp_path / "busy.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    sess = rpc.connect("127.0.0.1", plain_server.port)
    try:
        sess.upload(str(so))
        mod = sess.load_module("busy.so")
        assert mod.get_function("busy", restype="int64")(10) == 45
        small = mod.time_evaluator("busy", sess.cpu(0), number=20, repeat=3, restype="int64")(1000)
        big = mod.time_evaluator("busy", sess.cpu(0), number=5, repeat=3, restype="int64")(
            2_000_000
        )
        assert len(small.results) == 3 and len(big.results) == 3
        assert big.median > small.median * 10
        assert np.isfinite(big.std)
    finally:
        sess.close()


# --------------------------------------------------------------------------- audit findings
@pytest.mark.timeout(120, method="thread")  # (SIGALRM is the test's own)
def test_interrupted_request_is_cancelled(tracker):
    """Ctrl-C while waiting in request(): the connection resyncs, the request is gone (issue 8, b)."""
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    try:
        holder = ts.request("k")

        def interrupt(*_a):
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            with pytest.raises(KeyboardInterrupt):
                ts.request("k")  # waits: the only server is held
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert _wait(lambda: ts.summary()["queue_info"]["k"]["pending"] == 0)
        holder.close()
        # nobody takes the server: the interrupted request was cancelled, and the
        # next calls read their own replies
        assert _wait(lambda: _free(ts, "k") == 1)
        time.sleep(0.3)
        assert _free(ts, "k") == 1
        s = ts.request("k")
        assert s.get_function("trk.pid")() > 0
        s.close()
    finally:
        srv.terminate()
        ts.close()


def test_forked_daemon_does_not_hold_the_server(tracker):
    """A process the session forked does not keep the server "in use" (issue 8, c)."""
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="k")
    ts = rpc.connect_tracker(*tracker.addr)
    daemon = None
    try:
        s = ts.request("k")
        daemon = s.get_function("trk.spawn_daemon")(30)
        s.close()
        assert _wait(lambda: _free(ts, "k") == 1, timeout=5)
        os.kill(daemon, 0)  # the daemon is still running
    finally:
        if daemon is not None:
            try:
                os.kill(daemon, signal.SIGKILL)
            except ProcessLookupError:
                pass
        srv.terminate()
        ts.close()


def test_tracker_restart_keeps_a_busy_server_busy():
    """A server in a session registers again as busy with a restarted tracker (issue 8, d)."""
    tr = rpc.Tracker(port=9600, port_end=9700)
    port = tr.port
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tr.addr, key="k")
    tr2 = None
    try:
        ts = rpc.connect_tracker(*tr.addr)
        s = ts.request("k")
        ts.close()
        tr.terminate()
        tr2 = rpc.Tracker(port=port, port_end=port + 1)
        ts2 = rpc.connect_tracker("127.0.0.1", port)
        assert _wait(lambda: ts2.summary()["queue_info"].get("k", {}).get("total") == 1)
        assert _free(ts2, "k") == 0  # not handed to a second client
        assert s.get_function("trk.pid")() > 0
        s.close()
        assert _wait(lambda: _free(ts2, "k") == 1)
        s2 = ts2.request("k")
        s2.close()
        ts2.close()
    finally:
        srv.terminate()
        tr.terminate()
        if tr2 is not None:
            tr2.terminate()


def test_malformed_tracker_requests_answered(tracker):
    """Any bad request gets an error reply; the link and the tracker keep working (issue 8, e)."""
    from disco_rpc import tracker as T
    from disco_rpc import wire

    conn = T.open_tracker_link(tracker.addr, T.CLIENT_KEY, None, None)
    try:
        for op, value in [
            (T.T_REQUEST, {"a": 1}),
            (T.T_REQUEST, ("k",)),
            (T.T_REQUEST, None),
            (T.T_PUT, ("k", "h", 1)),  # a client may not register
            (77, None),
        ]:
            conn.send(wire.REQUEST, op, value)
            kind, _op, reply = conn.recv()
            assert kind == wire.ERROR and isinstance(reply[1], str), (op, value, reply)
        conn.send(wire.REQUEST, T.T_SUMMARY, None)
        kind, _op, reply = conn.recv()
        assert kind == wire.REPLY and reply == {"server_info": [], "queue_info": {}}
    finally:
        conn.close()


def _dead_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_unreachable_tracker_errors():
    """A tracker that is down is named as such, in one line (issue 8, f)."""
    port = _dead_port()
    r = subprocess.run(
        [sys.executable, "-m", "disco_rpc", "query", "--port", str(port)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == r.stderr.strip().splitlines()[0]
    assert r.stderr.startswith(f"disco-rpc: cannot connect to the tracker at 127.0.0.1:{port}")
    with pytest.raises(rpc.RPCError, match=f"cannot connect to the tracker at 127.0.0.1:{port}"):
        rpc.Server(port=9400, port_end=9500, tracker_addr=("127.0.0.1", port), key="k")


@pytest.mark.parametrize("kind", ["server", "local"])
def test_time_evaluator_zero_time_limit(monkeypatch, kind):
    """A clock that measures 0 does not hang the evaluator: limit_zero_time_iterations (issue 8, h)."""
    from disco_rpc import handler

    monkeypatch.setattr(handler, "_clock", lambda: 1.0)  # every run measures exactly 0
    CALLS[0] = 0
    srv = rpc.Server(port=9400, port_end=9500) if kind == "server" else None  # forks the patch
    sess = rpc.connect("127.0.0.1", srv.port) if srv else rpc.LocalSession()
    try:
        lib = sess.system_lib()
        ev = lib.time_evaluator("trk.count", sess.cpu(0), number=2, repeat=3, min_repeat_ms=50, limit_zero_time_iterations=4)  # fmt: skip
        res = ev()
        assert res.results == (0.0, 0.0, 0.0)
        # one warm-up, then per repeat 4 tries of `number` calls (number does not grow on 0)
        assert sess.get_function("trk.calls")() == 1 + 3 * 4 * 2
    finally:
        sess.close()
        if srv is not None:
            srv.terminate()


# --------------------------------------------------------------------------- issue 13, finding 4
def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _summary_bytes(summary: dict) -> int:
    from disco_rpc import wire

    return wire.frame_size(*wire.encode(summary))


def test_abandoned_requests_leave_the_queue_at_once(tracker):
    """3 x 300 requests whose clients left: the queues are empty at once, summary() small."""
    from disco_rpc import tracker as T
    from disco_rpc.wire import REQUEST

    ts = rpc.connect_tracker(*tracker.addr)
    base_threads = _threads(tracker.pid)
    # two clients still waiting are counted; they must not be lost among the abandoned
    live = []
    for key in ("a0", "a1"):
        c = T.open_tracker_link(tracker.addr, T.CLIENT_KEY, None, None)
        c.send(REQUEST, T.T_REQUEST, (key, 1))
        live.append(c)
    t0 = time.monotonic()
    for i in range(3):
        for _ in range(300):
            c = T.open_tracker_link(tracker.addr, T.CLIENT_KEY, None, None)
            c.send(REQUEST, T.T_REQUEST, (f"a{i}", 1))
            c.close()
    # and requests cancelled by their own timeout
    for _ in range(3):
        with pytest.raises(TimeoutError):
            ts.request("a2", wait_timeout=0.05)
    assert time.monotonic() - t0 < 30
    expected = {"a0": 1, "a1": 1}
    assert _wait(
        lambda: {k: q["pending"] for k, q in ts.summary()["queue_info"].items()} == expected,
        timeout=2.0,
    ), ts.summary()
    s = ts.summary()
    assert _summary_bytes(s) < 1024 and "truncated" not in s
    # every abandoned link's thread ended: nothing holds their buffers any more
    assert _wait(lambda: _threads(tracker.pid) <= base_threads + len(live) + 1, timeout=3.0)
    for c in live:
        c.close()
    assert _wait(lambda: ts.summary()["queue_info"] == {}, timeout=2.0), ts.summary()
    # a server that registers now is free: no abandoned request took it
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="a0")
    try:
        time.sleep(0.3)
        assert ts.summary()["queue_info"]["a0"] == {"free": 1, "pending": 0, "total": 1}
    finally:
        srv.terminate()
        ts.close()


def test_long_keys_refused_and_summary_still_works(tracker):
    """A server registering with a 1 MB key is refused; summary() and query keep working."""
    from disco_rpc import tracker as T
    from disco_rpc.wire import ERROR, REQUEST

    with pytest.raises(rpc.RPCError, match="at most 256 bytes"):
        T.Registration(tracker.addr, "k" * 1_000_000, ("127.0.0.1", 1234))
    with pytest.raises(rpc.RPCError, match="at most 255 bytes"):
        T.Registration(tracker.addr, "k", ("h" * 300, 1234))
    raw = T.open_tracker_link(tracker.addr, T.REGISTRANT_KEY, None, None)
    raw.send(REQUEST, T.T_PUT, ("k", "127.0.0.1", 1234, "t" * 100_000))  # a "busy" ticket
    kind, _op, value = raw.recv()
    assert kind == ERROR and "not a ticket this tracker hands out" in value[1]
    raw.close()
    ok = T.Registration(tracker.addr, "k" * T.MAX_KEY_BYTES, ("127.0.0.1", 1234))
    ts = rpc.connect_tracker(*tracker.addr)
    try:
        with pytest.raises(rpc.RPCError, match="the key is 257 bytes long"):
            ts.request("é" * 128 + "x", wait_timeout=1)
        s = ts.summary()
        assert s["queue_info"] == {"k" * 256: {"free": 1, "pending": 0, "total": 1}}
        assert s["server_info"] == [
            {
                "addr": ["127.0.0.1", 1234],
                "key": "server:" + "k" * 256,
                "free": True,
                "in_session": False,
            }
        ]
        assert "k" * 256 in ts.text_summary()
        out = subprocess.run(
            [sys.executable, "-m", "disco_rpc", "query", "--port", str(tracker.port)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "Queue Status" in out.stdout and "127.0.0.1:1234" in out.stdout
    finally:
        ok.close()
        ts.close()


def test_requests_per_link_are_capped(tracker):
    from disco_rpc import tracker as T
    from disco_rpc.wire import ERROR, REQUEST

    c = T.open_tracker_link(tracker.addr, T.CLIENT_KEY, None, None)
    try:
        for _ in range(T.MAX_REQUESTS_PER_LINK + 1):
            c.send(REQUEST, T.T_REQUEST, ("capped", 1))
        c.t.settimeout(5)
        kind, _op, value = c.recv()
        assert kind == ERROR and "requests waiting already" in value[1]
        ts = rpc.connect_tracker(*tracker.addr)
        assert ts.summary()["queue_info"]["capped"]["pending"] == T.MAX_REQUESTS_PER_LINK
        # a client may not register a server
        c.send(REQUEST, T.T_PUT, ("x", "127.0.0.1", 1, None))
        kind, _op, value = c.recv()
        assert kind == ERROR and "only a registration link" in value[1]
        ts.close()
    finally:
        c.close()


class _FakeLink:
    closed = False

    def __init__(self):
        self.waiting = set()

    def send(self, *a):
        return True

    def peer_left(self):
        return False


def test_summary_always_fits_in_a_frame():
    """Thousands of servers and keys of the longest kind: summary() is cut to fit, and says so."""
    from disco_rpc import tracker as T

    state = T.TrackerState()
    link = _FakeLink()
    host = "h" * T.MAX_HOST_BYTES
    for i in range(3000):
        state.put(link, f"{i:06d}".ljust(T.MAX_KEY_BYTES, "s"), (host, 1000 + i))
    links = [_FakeLink() for _ in range(300)]
    for i in range(3000):
        state.request(links[i % 300], f"{i:06d}".ljust(T.MAX_KEY_BYTES, "q"), 1)
    s = state.summary()
    assert _summary_bytes(s) <= T.TRACKER_MAX_MESSAGE_BYTES
    listed, total = s["truncated"]["server_info"]
    assert total == 3000 and 0 < listed == len(s["server_info"]) < 3000
    listed, total = s["truncated"]["queue_info"]
    assert total == 6000 and 0 < listed == len(s["queue_info"]) < 6000
    assert s["server_info"][0]["key"] == "server:" + "000000".ljust(T.MAX_KEY_BYTES, "s")
    assert "(truncated:" in format_summary(s)
    # a smaller frame limit: still fits
    small = state.summary(max_bytes=64 * 1024)
    assert _summary_bytes(small) <= 64 * 1024 and "truncated" in small
    # cancelling a link's requests empties their queues at once
    for lk in links:
        state.cancel(lk)
    assert state.queues == {} and all(not lk.waiting for lk in links)
    assert "truncated" in state.summary()  # 3000 servers still do not all fit


def test_a_server_freed_after_its_waiting_client_left_stays_free():
    """A client that gave up its request (a timed-out ``request``, as the "rpc" channel's
    start does) closes its tracker link; a server freed before the tracker's reader saw
    that close was matched with the dead request, and stayed out of the pool for the
    unused ticket's whole match timeout (10 s: CI saw test_tracker_pool_too_small time
    out on it). The match now looks whether the client's end is closed."""
    import socket

    from disco_rpc import wire
    from disco_rpc.tracker import TrackerState, _Link

    lst = socket.create_server(("127.0.0.1", 0))

    def link():  # TCP, as a tracker's: a send to a peer that closed succeeds at first
        b = socket.create_connection(lst.getsockname())
        a, _ = lst.accept()
        return _Link(wire.Conn(wire.SocketTransport(a)), ("test", 0)), b

    state = TrackerState(match_timeout=10.0)
    server_link, server_end = link()
    client_link, client_end = link()
    try:
        sid = state.put(server_link, "k", ("127.0.0.1", 9))
        state.servers[sid].ticket = "in-session"  # busy: the request waits
        state.by_ticket["in-session"] = state.servers[sid]
        state.request(client_link, "k", 1)
        client_end.close()  # the client gave up; its reader has not run yet
        state.release("in-session", "its session ended")
        assert state.servers[sid].ticket is None  # free, not given to the dead request
        assert not state.queues.get("k")
    finally:
        for s in (server_end, client_end, lst):
            s.close()
        server_link.close()
        client_link.close()
