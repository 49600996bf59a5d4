"""Issue 15, items 12 (``disco_rpc.base``), 13 (TVM's summary layout) and 16 (the tracker
speaks TVM's tracker protocol with ``tvm_protocol=True``).

Most tests speak TVM's protocol over raw sockets with ``disco_rpc.base``; the last
one runs the real ``apache-tvm``: a TVM RPC server registers with our tracker and
a TVM client gets a session through it (skipped only where ``tvm`` is not installed;
``scripts/test.sh`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_rpc import base, tvm_tracker
from disco_rpc.base import TrackerCode as C
from disco_rpc.tracker import format_summary

pytestmark = pytest.mark.timeout(60)


@disco.register_func("tvmtrk.add", override=True)
def _add(a, b):
    return a + b


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _conn(tr) -> socket.socket:
    """A TVM-protocol connection to ``tr`` (a tracker or a port; the magic sent and answered)."""
    s = socket.create_connection(("127.0.0.1", tr if isinstance(tr, int) else tr.port), timeout=5)
    s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
    assert struct.unpack("<i", base.recvall(s, 4))[0] == base.RPC_TRACKER_MAGIC
    return s


def _call(s: socket.socket, msg) -> object:
    base.sendjson(s, msg)
    return base.recvjson(s)


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the tracker closed ``s`` (an end of file or a reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        return s.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _silent(s: socket.socket, timeout: float = 0.3) -> bool:
    """True when nothing arrives on ``s`` within ``timeout`` (a request still waiting)."""
    s.settimeout(timeout)
    try:
        s.recv(1, socket.MSG_PEEK)
        return False
    except TimeoutError:
        return True


@pytest.fixture
def tracker():
    tr = rpc.Tracker(port=9600, port_end=9700, tvm_protocol=True)
    yield tr
    tr.terminate()


# --------------------------------------------------------------------------- item 12: base
def test_base_has_tvms_names_and_values():
    assert rpc.base is base
    assert (base.RPC_MAGIC, base.RPC_TRACKER_MAGIC) == (0xFF271, 0x2F271)
    assert (base.RPC_CODE_SUCCESS, base.RPC_CODE_DUPLICATE, base.RPC_CODE_MISMATCH) == (
        0xFF271,
        0xFF272,
        0xFF273,
    )
    assert base.RPC_SESS_MASK == 128
    codes = {k: getattr(C, k) for k in dir(C) if k.isupper()}
    assert codes == {
        "FAIL": -1, "SUCCESS": 0, "PING": 1, "STOP": 2, "PUT": 3, "REQUEST": 4,
        "UPDATE_INFO": 5, "SUMMARY": 6, "GET_PENDING_MATCHKEYS": 7,
    }  # fmt: skip
    key = base.random_key("rasp3b")
    prefix, rand = base.split_random_key(key)
    assert prefix == "rasp3b" and 0 <= float(rand) < 1
    assert base.random_key("a", delimiter="@").startswith("a@")
    assert base.split_random_key("a:b:0.5") == ["a:b", "0.5"]
    taken = {base.random_key("k") for _ in range(5)}
    assert base.random_key("k", cmap=taken) not in taken


def test_base_json_framing_and_its_bound():
    a, b = socket.socketpair()
    try:
        base.sendjson(a, [C.REQUEST, "key", "", 1])
        assert base.recvjson(b) == [4, "key", "", 1]
        a.sendall(struct.pack("<i", 0x7FFFFFFF))
        with pytest.raises(rpc.errors.ProtocolError, match="at most 1048576"):
            base.recvjson(b)
        a.sendall(struct.pack("<i", 3) + b"{x}")
        with pytest.raises(rpc.errors.ProtocolError, match="not JSON"):
            base.recvjson(b)
        a.close()
        with pytest.raises(OSError, match="connection reset"):
            base.recvall(b, 4)
    finally:
        a.close()
        b.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    with pytest.raises(RuntimeError, match="Failed to connect"):
        base.connect_with_retry(("127.0.0.1", port), timeout=0, retry_period=0)


# --------------------------------------------------------------------------- item 13: layout
def test_text_summary_is_tvms_and_reads_tvms_layout():
    """format_summary prints a summary of TVM's own tracker (no extra fields) as TVM does."""
    tvm_summary = {
        "server_info": [
            {"key": "server:rasp3b", "addr": ["10.0.0.2", 9090]},
            {"key": "server:android", "addr": ["10.0.0.3", "9091"]},
            {"key": "server:rasp3b", "addr": ["10.0.0.4", 9090]},
        ],
        "queue_info": {
            "rasp3b": {"free": 1, "pending": 3},
            "android": {"free": 0, "pending": 0},
            "gone": {"free": 0, "pending": 0},
        },
    }
    expected = (
        "Server List\n"
        "------------------------------\n"
        "server-address           key\n"
        "------------------------------\n"
        "10.0.0.3:9091            server:android\n"
        "10.0.0.2:9090            server:rasp3b\n"
        "10.0.0.4:9090            server:rasp3b\n"
        "------------------------------\n"
        "\n"
        "Queue Status\n"
        "-------------------------------\n"
        "key       total  free  pending\n"
        "-------------------------------\n"
        "android   1      0     0      \n"
        "rasp3b    2      1     3      \n"
        "-------------------------------\n"
    )
    assert format_summary(tvm_summary) == expected


# --------------------------------------------------------------------------- item 16: protocol
def test_tvm_servers_and_clients_are_matched(tracker):
    """UPDATE_INFO + PUT register a slot; REQUEST waits for it; both summaries agree."""
    client = _conn(tracker)
    other = _conn(tracker)
    server = _conn(tracker)
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    try:
        assert _call(client, [C.PING]) == C.SUCCESS
        # requests wait until a server of their key registers; higher priority first
        base.sendjson(client, [C.REQUEST, "board", "", 0])
        base.sendjson(other, [C.REQUEST, "board", "", 5])
        assert _wait(lambda: ts.summary()["queue_info"].get("board", {}).get("pending") == 2)
        assert _silent(client) and _silent(other)
        info = {"key": "server:board", "addr": [None, 9123]}
        assert _call(server, [C.UPDATE_INFO, info]) == C.SUCCESS
        assert _call(server, [C.PUT, "board", [9123, "board:0.25"], None]) == C.SUCCESS
        assert base.recvjson(other) == [C.SUCCESS, ["127.0.0.1", 9123, "board:0.25"]]
        assert _silent(client)
        assert _call(server, [C.GET_PENDING_MATCHKEYS]) == []
        # the session ended: the server puts a new match key (its custom address this time)
        assert _call(server, [C.PUT, "board", [9123, "board:0.5"], "10.1.2.3"]) == C.SUCCESS
        assert base.recvjson(client) == [C.SUCCESS, ["10.1.2.3", 9123, "board:0.5"]]
        assert _call(server, [C.PUT, "board", [9123, "board:0.75"], None]) == C.SUCCESS
        assert _call(server, [C.GET_PENDING_MATCHKEYS]) == ["board:0.75"]
        tvm_side = _call(client, [C.SUMMARY])
        ours = ts.summary()
        assert tvm_side == [C.SUCCESS, ours]
        entry = {"addr": ["127.0.0.1", 9123], "key": "server:board", "free": True, "protocol": "tvm"}  # fmt: skip
        assert ours == {
            "server_info": [entry],
            "queue_info": {"board": {"free": 1, "pending": 0, "total": 1}},
        }
        assert "127.0.0.1:9123           server:board\n" in ts.text_summary()
        # STOP is refused (the tracker is stopped by its owner), and it keeps serving
        assert _call(client, [C.STOP, "guess"]) == C.FAIL
        assert _call(client, [C.PING]) == C.SUCCESS
    finally:
        for s in (client, other, server):
            s.close()
        ts.close()


def test_dead_clients_and_servers_give_their_slots_back(tracker):
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    q = lambda: ts.summary()["queue_info"].get("k", {})  # noqa: E731
    try:
        gone = _conn(tracker)
        base.sendjson(gone, [C.REQUEST, "k", "", 9])
        assert _wait(lambda: q().get("pending") == 1)
        gone.close()  # its request leaves the queue at once: it takes no slot
        assert _wait(lambda: q() == {})
        server = _conn(tracker)
        assert _call(server, [C.UPDATE_INFO, {"key": "server:k", "addr": [None, "9124"]}]) == 0
        assert _call(server, [C.PUT, "k", [9124, "k:0.1"], None]) == C.SUCCESS
        assert q() == {"free": 1, "pending": 0, "total": 1}
        # the C++ tvm_rpc reports its port as a string: listed as a number
        assert ts.summary()["server_info"][0]["addr"] == ["127.0.0.1", 9124]
        server.close()  # the server died: its slot is not handed out any more
        # (its key stays listed with nothing free, as TVM's tracker lists it)
        assert _wait(
            lambda: (
                ts.summary()
                == {"server_info": [], "queue_info": {"k": {"free": 0, "pending": 0, "total": 0}}}
            )
        )
        client = _conn(tracker)
        base.sendjson(client, [C.REQUEST, "k", "", 1])
        assert _silent(client)
        client.close()
    finally:
        ts.close()


def test_the_cpp_tvm_rpc_messages(tracker):
    """The exact text the C++ tvm_rpc sends (apps/cpp_rpc/rpc_tracker_client.h) is understood."""

    def send_bytes(s: socket.socket, text: str) -> bytes:  # its SendBytes, then RecvBytes
        s.sendall(struct.pack("<i", len(text)) + text.encode())
        (n,) = struct.unpack("<i", base.recvall(s, 4))
        return base.recvall(s, n)

    s = _conn(tracker)
    try:
        assert send_bytes(s, '[5, {"key": "server:cpp", "addr": [null, "9128"]}]') == b"0"
        assert send_bytes(s, '[3, "cpp", [9128, "cpp:0.123"], null]') == b"0"
        assert b'"cpp:0.123"' in send_bytes(s, "[7]")  # it searches the text for its key
        with rpc.connect_tracker("127.0.0.1", tracker.port) as ts:
            assert ts.summary()["queue_info"]["cpp"] == {"free": 1, "pending": 0, "total": 1}
    finally:
        s.close()


def _bogus_messages() -> list[tuple[str, bytes]]:
    def msg(value) -> bytes:
        body = (value if isinstance(value, str) else json.dumps(value)).encode()
        return struct.pack("<i", len(body)) + body

    return [
        ("a 2 GiB size", struct.pack("<i", 0x7FFFFFFF)),
        ("a negative size", struct.pack("<i", -5)),
        ("a zero size", struct.pack("<i", 0)),
        ("not JSON", msg("{not json")),
        ("not UTF-8", struct.pack("<i", 2) + b"\xff\xfe"),
        ("deep nesting", msg("[" * 200_000)),
        ("a huge number", msg("[" + "9" * 10_000 + "]")),
        ("a dict", msg({"code": 1})),
        ("an empty list", msg([])),
        ("a string code", msg(["1"])),
        ("a bool code", msg([True])),
        ("an unknown code", msg([99])),
        ("PUT without a slot", msg([C.PUT, "k"])),
        ("PUT with a number key", msg([C.PUT, 5, [9000, "m"]])),
        ("PUT with port 0", msg([C.PUT, "k", [0, "m"]])),
        ("PUT with port 70000", msg([C.PUT, "k", [70000, "m"]])),
        ("PUT with a long key", msg([C.PUT, "k" * 300, [9000, "m"]])),
        ("PUT with a long match key", msg([C.PUT, "k", [9000, "m" * 600]])),
        ("PUT with a number host", msg([C.PUT, "k", [9000, "m"], 127001])),
        ("REQUEST with a text priority", msg([C.REQUEST, "k", "", "high"])),
        ("REQUEST without a priority", msg([C.REQUEST, "k", ""])),
        ("REQUEST with a priority beyond a float", msg(f'[4, "k", "", 1{"0" * 400}]')),
        ("UPDATE_INFO with a list", msg([C.UPDATE_INFO, ["server:k"]])),
        ("UPDATE_INFO with a bad addr", msg([C.UPDATE_INFO, {"addr": [None, "x"]}])),
    ]


def test_bogus_messages_close_only_that_connection(tracker):
    """Each malformed message closes its connection; the tracker and its slots stay as they were."""
    server = _conn(tracker)
    assert _call(server, [C.UPDATE_INFO, {"key": "server:keep", "addr": [None, 9125]}]) == 0
    assert _call(server, [C.PUT, "keep", [9125, "keep:0.1"], None]) == C.SUCCESS
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    before = ts.summary()
    try:
        for what, data in _bogus_messages():
            s = _conn(tracker)
            s.sendall(data)
            assert _closed(s), what
            s.close()
        # a wrong magic (first byte TVM's) ends the handshake
        s = socket.create_connection(("127.0.0.1", tracker.port), timeout=5)
        s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC + 256))
        assert _closed(s)
        s.close()
        assert ts.summary() == before
        assert _call(server, [C.PING]) == C.SUCCESS
        assert _call(server, [C.GET_PENDING_MATCHKEYS]) == ["keep:0.1"]
    finally:
        server.close()
        ts.close()


def test_a_message_that_never_ends_is_dropped(monkeypatch):
    monkeypatch.setattr(tvm_tracker, "MESSAGE_TIMEOUT", 0.3)  # the tracker's fork inherits it
    tr = rpc.Tracker(port=9600, port_end=9700, tvm_protocol=True)
    try:
        s = _conn(tr)
        s.sendall(struct.pack("<i", 100) + b"[1,")
        t0 = time.monotonic()
        assert _closed(s)
        assert time.monotonic() - t0 < 3
        s.close()
        s = _conn(tr)
        time.sleep(0.5)  # idle between messages is fine: a client waits for a server that long
        assert _call(s, [C.PING]) == C.SUCCESS
        s.close()
    finally:
        tr.terminate()


def test_per_connection_caps(tracker):
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    try:
        s = _conn(tracker)
        for i in range(tvm_tracker.MAX_PUTS_PER_LINK):
            assert _call(s, [C.PUT, "many", [9000, f"m{i}"], None]) == C.SUCCESS
        assert ts.summary()["queue_info"]["many"]["free"] == tvm_tracker.MAX_PUTS_PER_LINK
        base.sendjson(s, [C.PUT, "many", [9000, "one-too-many"], None])
        assert _closed(s)
        s.close()
        assert _wait(
            lambda: ts.summary()["queue_info"]["many"] == {"free": 0, "pending": 0, "total": 0}
        )
        s = _conn(tracker)
        for _ in range(tvm_tracker.MAX_REQUESTS_PER_LINK + 1):
            base.sendjson(s, [C.REQUEST, "few", "", 1])
        assert _closed(s)
        s.close()
        assert _wait(lambda: "few" not in ts.summary()["queue_info"])
    finally:
        ts.close()


def test_tvm_links_cannot_crowd_out_ours():
    """TVM links (who prove nothing) have a cap of their own, apart from authenticated links."""
    from disco_rpc import tracker as T

    lst = socket.create_server(("127.0.0.1", 0))
    r, w = os.pipe()
    kwargs = {"watch_fd": r, "max_links": 2, "max_tvm_links": 2, "tvm_protocol": True}
    th = threading.Thread(target=T.serve_tracker, args=(lst,), kwargs=kwargs, daemon=True)
    th.start()
    port = lst.getsockname()[1]
    held = [_conn(port) for _ in range(2)]
    try:
        third = socket.create_connection(("127.0.0.1", port), timeout=5)
        third.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        assert _closed(third)  # refused: two TVM links already
        third.close()
        with rpc.connect_tracker("127.0.0.1", port) as ts:  # ours still get in
            assert ts.summary() == {"server_info": [], "queue_info": {}}
        assert _call(held[0], [C.PING]) == C.SUCCESS
    finally:
        for s in held:
            s.close()
        os.close(w)
        th.join(10)
        os.close(r)
        lst.close()


def test_worlds_apart_and_our_protocol_unchanged(tracker):
    """Our servers and clients work on a TVM-mode tracker; a TVM client never gets our server."""
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="mixed")
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    tvm_client = _conn(tracker)
    try:
        base.sendjson(tvm_client, [C.REQUEST, "mixed", "", 1])
        assert _wait(lambda: ts.summary()["queue_info"]["mixed"]["pending"] == 1)
        assert _silent(tvm_client)  # our server is free, but it cannot speak TVM's protocol
        with ts.request("mixed") as sess:
            assert sess.get_function("tvmtrk.add")(2, 3) == 5
        tvm_server = _conn(tracker)
        assert _call(tvm_server, [C.PUT, "mixed", [9126, "mixed:0.1"], None]) == C.SUCCESS
        assert base.recvjson(tvm_client) == [C.SUCCESS, ["127.0.0.1", 9126, "mixed:0.1"]]
        want = {"free": 1, "pending": 0, "total": 1}  # ours; the TVM slot went to the TVM client
        assert _wait(lambda: ts.summary()["queue_info"]["mixed"] == want), ts.summary()
        tvm_server.close()
    finally:
        tvm_client.close()
        ts.close()
        srv.terminate()


def test_a_tvm_peer_sees_only_tvms_world_and_cannot_skew_ours(tracker):
    """A TVM peer proves nothing: its SUMMARY leaves our servers out, and the slots it
    PUTs under our key do not count as servers our clients could get (red team, finding 3)."""
    srv = rpc.Server(port=9400, port_end=9500, tracker_addr=tracker.addr, key="ours")
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    peer = _conn(tracker)
    try:
        assert _wait(lambda: "ours" in ts.summary()["queue_info"])
        status, seen = _call(peer, [C.SUMMARY])
        assert status == C.SUCCESS
        assert seen["server_info"] == [] and "ours" not in seen["queue_info"]
        for i in range(3):  # fake slots under our key, at an address of the peer's choosing
            assert _call(peer, [C.PUT, "ours", [6666, f"ours:{i}"], None]) == C.SUCCESS
        q = ts.summary()["queue_info"]["ours"]
        assert q["free"] == 4 and q["tvm"]["free"] == 3  # TVM's layout counts all; "tvm" says which
        assert ts.pool_text("ours") == (
            "the tracker has 1 server(s) for key 'ours': 1 free, 0 request(s) waiting"
        )
        other = _conn(tracker)
        assert _call(other, [C.UPDATE_INFO, {"key": "server:only-tvm", "addr": ["127.0.0.1", 9]}]) == C.SUCCESS  # fmt: skip
        assert _call(other, [C.PUT, "only-tvm", [9, "only-tvm:0"], None]) == C.SUCCESS
        assert ts.summary()["queue_info"]["only-tvm"] == {"free": 1, "pending": 0, "total": 1}
        assert ts.pool_text("only-tvm") == "the tracker has no server registered for key 'only-tvm'"
        other.close()
    finally:
        peer.close()
        ts.close()
        srv.terminate()


def test_tvm_protocol_is_opt_in():
    tr = rpc.Tracker(port=9600, port_end=9700)
    try:
        s = socket.create_connection(("127.0.0.1", tr.port), timeout=5)
        s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        s.settimeout(1)
        got = b""
        try:  # our handshake waits for the rest of its hello, then gives up: no TVM answer
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        assert struct.pack("<i", base.RPC_TRACKER_MAGIC) not in got
        s.close()
    finally:
        tr.terminate()
    # TVM's protocol has no authentication: beyond loopback a token is not enough
    with pytest.raises(disco.InsecureBindError, match="TVM protocol"):
        rpc.Tracker(host="0.0.0.0", port=9600, port_end=9700, token="secret", tvm_protocol=True)


def test_tvm_protocol_beside_tls_and_a_token(tls_files):
    """Our links keep their TLS and token on a TVM-mode tracker; TVM's links need neither."""
    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    cctx = ssl.create_default_context(cafile=cert)
    tr = rpc.Tracker(port=9600, port_end=9700, token="tok", ssl_context=sctx, tvm_protocol=True)
    try:
        s = _conn(tr)
        assert _call(s, [C.PUT, "tls", [9127, "tls:0.1"], None]) == C.SUCCESS
        with rpc.connect_tracker("127.0.0.1", tr.port, token="tok", ssl_context=cctx) as ts:
            assert ts.summary()["queue_info"]["tls"] == {"free": 1, "pending": 0, "total": 0}
        with pytest.raises(rpc.RPCError):  # the token is still required of our clients
            rpc.connect_tracker("127.0.0.1", tr.port, token="wrong", ssl_context=cctx).summary()
        assert _call(s, [C.PING]) == C.SUCCESS
        s.close()
    finally:
        tr.terminate()


def test_cli_tvm_protocol():
    proc = subprocess.Popen(
        [sys.executable, "-m", "disco_rpc", "tracker", "--tvm-protocol", "--port", "9600", "--port-end", "9700"],  # fmt: skip
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "tracker listening" in line, line
        s = socket.create_connection(("127.0.0.1", int(line.rsplit(":", 1)[1])), timeout=5)
        s.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        assert struct.unpack("<i", base.recvall(s, 4))[0] == base.RPC_TRACKER_MAGIC
        assert _call(s, [C.SUMMARY]) == [C.SUCCESS, {"server_info": [], "queue_info": {}}]
        s.close()
    finally:
        proc.terminate()
        proc.wait(10)
    out = subprocess.run(
        [sys.executable, "-m", "disco_rpc", "tracker", "--tvm-protocol", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "DISCO_TOKEN": "secret"},
    )  # fmt: skip
    assert out.returncode != 0 and "TVM protocol" in out.stderr, out.stderr


# --------------------------------------------------------------------------- the real TVM
_TVM_CLIENT = textwrap.dedent(
    """
    import gc, json, runpy, sys
    from tvm import rpc
    from tvm.rpc import base

    port, key = int(sys.argv[1]), sys.argv[2]
    codes = {k: getattr(base.TrackerCode, k) for k in dir(base.TrackerCode) if k.isupper()}
    print(json.dumps({"magic": [base.RPC_MAGIC, base.RPC_TRACKER_MAGIC], "codes": codes}), flush=True)
    t = rpc.connect_tracker("127.0.0.1", port)
    remote = t.request(key, session_timeout=60)  # held until the server registers
    echo = remote.get_function("testing.echo")
    out = {"echo": echo(42), "summary": t.summary(), "text": t.text_summary()}
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the test reads the tracker's summary from its side meanwhile
    del echo, remote
    gc.collect()  # the session ends: the server puts a new match key
    sys.argv = ["query_rpc_tracker", "--port", str(port)]
    runpy.run_module("tvm.exec.query_rpc_tracker", run_name="__main__")
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("tvm") is None,
    reason="apache-tvm is not installed (scripts/test.sh installs it: pip install apache-tvm)",
)
@pytest.mark.timeout(180)
def test_real_tvm_server_and_client(tracker, tmp_path):
    """TVM's rpc_server registers with our tracker, TVM's client gets a session through it."""
    key = "tvm-board"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "tvm.exec.rpc_server", f"--tracker=127.0.0.1:{tracker.port}",
         f"--key={key}", "--host=127.0.0.1", "--port=9750", "--port-end=9850"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    # started at once, beside the server: TVM's import takes seconds, and the request waits
    client = subprocess.Popen(
        [sys.executable, "-c", _TVM_CLIENT, str(tracker.port), key],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    ts = rpc.connect_tracker("127.0.0.1", tracker.port)
    try:
        first = client.stdout.readline()
        assert first, client.stderr.read()
        names = json.loads(first)
        assert names["magic"] == [base.RPC_MAGIC, base.RPC_TRACKER_MAGIC]
        assert names["codes"] == {k: getattr(C, k) for k in dir(C) if k.isupper()}
        line = client.stdout.readline()
        assert line, client.stderr.read() + (tmp_path / "server.log").read_text()
        got = json.loads(line)
        assert got["echo"] == 42
        ours = ts.summary()  # the session is on: both sides see the same
        assert got["summary"] == ours
        assert ours["queue_info"][key] == {"free": 0, "pending": 0, "total": 1}
        (entry,) = ours["server_info"]
        assert entry["key"] == f"server:{key}" and entry["protocol"] == "tvm"
        assert got["text"] == ts.text_summary()
        client.stdin.write("\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, err
        assert f"Tracker address 127.0.0.1:{tracker.port}" in out and key in out
        # the session ended: TVM's server is back in the pool
        assert _wait(lambda: ts.summary()["queue_info"].get(key, {}).get("free") == 1)
        # the server dies: it leaves the tracker at once
        os.killpg(server.pid, signal.SIGKILL)
        assert _wait(
            lambda: (
                ts.summary()
                == {"server_info": [], "queue_info": {key: {"free": 0, "pending": 0, "total": 0}}}
            )
        )
    finally:
        ts.close()
        for proc in (client, server):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        log.close()


def test_a_priority_beyond_a_float_is_bogus_not_a_crash():
    """An int priority a float cannot hold (JSON allows it) is a bogus message, not an OverflowError."""  # fmt: skip
    world = tvm_tracker.TVMWorld(threading.Lock())
    a, b = socket.socketpair()
    try:
        link = tvm_tracker.TVMLink(a, ("127.0.0.1", 1))
        with pytest.raises(tvm_tracker._Bogus):
            tvm_tracker._handle(link, world, [C.REQUEST, "k", "", 10**400], lambda n: {})
        assert not world.queues
    finally:
        a.close()
        b.close()


class _StuckSocket:
    """A socket whose sends block until released: a client that does not read."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sending = threading.Event()
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sending.set()
        self.release.wait(10)
        self.sent.append(data)

    def shutdown(self, how: int) -> None:
        pass


def test_a_client_that_does_not_read_never_holds_the_trackers_lock():
    """Redteam: a TVM client that reads its replies a trickle at a time (its own thread blocked
    in a send, holding its send lock) must not stall the lock both worlds share when a
    server's PUT matches its request: matches are sent with the lock released."""
    lock = threading.Lock()
    world = tvm_tracker.TVMWorld(lock)
    stuck = _StuckSocket()
    client = tvm_tracker.TVMLink(stuck, ("127.0.0.1", 1))
    server = tvm_tracker.TVMLink(_StuckSocket(), ("127.0.0.1", 2))
    server.sock.release.set()
    with lock:
        world.add(client)
        world.add(server)
        world.request(client, "k", 1)
        world.put(server, "k", "127.0.0.1", 9000, "k:0.5")
        assert world.outbox and not server.values  # matched, not yet sent
    t = threading.Thread(target=world.deliver, daemon=True)
    t.start()
    assert stuck.sending.wait(5)
    assert lock.acquire(timeout=1), "the lock is held while a send to a stuck client blocks"
    lock.release()
    stuck.release.set()
    t.join(5)
    assert not t.is_alive()
    assert json.loads(stuck.sent[0][4:]) == [C.SUCCESS, ["127.0.0.1", 9000, "k:0.5"]]


def test_a_match_that_cannot_be_sent_gives_the_slot_back():
    lock = threading.Lock()
    world = tvm_tracker.TVMWorld(lock)
    a, b = socket.socketpair()
    b.close()
    gone = tvm_tracker.TVMLink(a, ("127.0.0.1", 1))
    server = tvm_tracker.TVMLink(_StuckSocket(), ("127.0.0.1", 2))
    server.sock.release.set()
    try:
        with lock:
            world.add(gone)
            world.add(server)
            world.request(gone, "k", 1)
            world.put(server, "k", "127.0.0.1", 9000, "k:0.5")
        world.deliver()
        with lock:
            assert [v.matchkey for v in world.free["k"]] == ["k:0.5"]
            assert world.pending_matchkeys(server) == ["k:0.5"]
    finally:
        a.close()
