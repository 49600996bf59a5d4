"""Impostors and relays (issue 13, findings 1-3): each attack, scripted on loopback, fails.

- Finding 1: a client that holds a token refuses a peer that proves nothing.
- Finding 2: a fake backend at a proxy relays a real client's handshake to the real
  server and then sends its own upload and ``load_module``: the server runs nothing.
  A relay on a direct connection that flips or replays one record is caught.
- Finding 3: behind a proxy, unauthenticated hellos get no session process and do
  not keep legitimate clients out.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_rpc import auth, wire
from disco_rpc.handler import OP_INIT, OP_LISTDIR, OP_LOAD_MODULE, OP_PING, OP_UPLOAD
from disco_rpc.proxy import P_ACK, P_PAIRED, register_with_proxy

pytestmark = pytest.mark.timeout(60)

TOKEN = "victim-secret"
_REC = struct.Struct("<Q")
_REPLY_BYTES = 8 + 4 + 1 + 1 + 32
_STATUS_BYTES = 1 + 32


@disco.register_func("imp.add", override=True)
def _add(a, b):
    return a + b


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _read_hello(sock: socket.socket) -> bytes:
    head = _recv_exact(sock, 16)
    keylen = struct.unpack("<I", head[12:16])[0]
    return head + _recv_exact(sock, keylen + 32)


def _read_record(sock: socket.socket) -> bytes:
    head = _recv_exact(sock, 8)
    (n,) = _REC.unpack(head)
    return head + _recv_exact(sock, n + 16)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` within ``seconds`` (whatever it sends first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


# --------------------------------------------------------------------------- finding 1
class _NoAuthImpostor(threading.Thread):
    """Listens on loopback and answers every hello with "OK, no authentication required"."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.after_hello: list[bytes] = []

    def run(self) -> None:
        while True:
            try:
                c, _ = self.lst.accept()
            except OSError:
                return
            try:
                c.settimeout(5)
                _read_hello(c)
                c.sendall(struct.pack("<8sIBB32s", b"DISCORPC", auth.VERSION, 0, 0, os.urandom(32)))
                data = c.recv(1 << 16)  # whatever the client says next, if anything
                self.after_hello.append(data)
            except OSError:
                pass
            finally:
                c.close()


def test_client_with_token_refuses_server_that_proves_nothing():
    """Finding 1: "auth not required" is a refusal for a client that holds a token."""
    imp = _NoAuthImpostor()
    imp.start()
    try:
        with pytest.raises(rpc.RPCAuthError, match="requires no authentication"):
            rpc.connect("127.0.0.1", imp.port, token=TOKEN, connect_timeout=5)
        # the "rpc" Disco channel, too: nothing the impostor sends is ever decoded
        with pytest.raises(rpc.RPCAuthError, match="requires no authentication"):
            disco.Session.create("rpc", servers=[("127.0.0.1", imp.port)], token=TOKEN)
        # the client hung up without sending a single frame
        assert all(d == b"" for d in imp.after_hello), imp.after_hello
    finally:
        imp.lst.close()
    assert issubclass(rpc.RPCAuthError, disco.errors.AuthenticationError)


def test_fake_server_at_a_token_less_tracker_is_refused(monkeypatch):
    """Finding 1 through a tracker: an impostor registers under the key; the client refuses it."""
    from disco_rpc.tracker import Registration

    monkeypatch.delenv("DISCO_TOKEN", raising=False)
    imp = _NoAuthImpostor()
    imp.start()
    tr = rpc.Tracker(port=9600, port_end=9700)
    reg = None
    try:
        reg = Registration(tr.addr, "gpu", ("127.0.0.1", imp.port))
        ts = rpc.connect_tracker(*tr.addr, server_token=TOKEN)
        try:
            with pytest.raises(rpc.RPCError, match="requires no authentication"):
                ts.request("gpu", max_retry=1, wait_timeout=10)
        finally:
            ts.close()
        assert all(d == b"" for d in imp.after_hello), imp.after_hello
    finally:
        if reg is not None:
            reg.close()
        tr.terminate()
        imp.lst.close()


def test_client_with_token_refuses_token_less_server(monkeypatch):
    monkeypatch.delenv("DISCO_TOKEN", raising=False)
    srv = rpc.Server(port=10150, port_end=10200)
    try:
        with pytest.raises(rpc.RPCAuthError, match="requires no authentication"):
            rpc.connect("127.0.0.1", srv.port, token=TOKEN)
        with rpc.connect("127.0.0.1", srv.port) as s:  # no token, no proof asked: fine
            assert s.get_function("imp.add")(1, 2) == 3
    finally:
        srv.terminate()


# --------------------------------------------------------------------------- finding 2
def _marker_module(tmp_path) -> tuple[bytes, str]:
    marker = str(tmp_path / "pwned")
    code = f"open({marker!r}, 'w').write('the attacker ran code on the server')\n"
    return code.encode(), marker


def _plain_frames(code: bytes) -> bytes:
    """The attacker's own INIT, upload of ``evil.py`` and ``load_module``, as plain frames."""
    out = bytearray()
    for op, value in ((OP_INIT, ((), (0.0, []))), (OP_UPLOAD, ((), ("evil.py", len(code))))):
        meta, _ = wire.encode(value)
        out += struct.pack("<BBHII", wire.REQUEST, op, 0, len(meta), 0) + bytes(meta)
    out += struct.pack("<BBHIIQ", wire.CHUNK_FRAME, OP_UPLOAD, 0, 0, 1, len(code)) + code
    out += struct.pack("<BBHII", wire.CHUNK_FRAME, OP_UPLOAD, wire.FLAG_END, 0, 0)
    meta, _ = wire.encode(((), ("evil.py", None)))
    out += struct.pack("<BBHII", wire.REQUEST, OP_LOAD_MODULE, 0, len(meta), 0) + bytes(meta)
    return bytes(out)


def _sealed_frames(code: bytes) -> bytes:
    """The same frames sealed under keys of the attacker's guessing (it lacks the token)."""
    from disco_core.net.security import SessionKeys

    class _Capture:
        def __init__(self) -> None:
            self.data = bytearray()

        def send_parts(self, parts: list) -> None:
            for p in parts:
                self.data += bytes(p)

    cap = _Capture()
    link = wire.SealedLink(cap, SessionKeys(send=os.urandom(64), recv=os.urandom(64)))
    frames = _plain_frames(code)
    link.send_parts([frames])
    return bytes(cap.data)


@pytest.mark.parametrize("injection", ["plain", "sealed-with-guessed-keys"])
def test_fake_backend_relays_handshake_then_injects(tmp_path, injection):
    """Finding 2, scripted: the attacker has no token, yet sits between client and server.

    1. It registers at the (token-less) proxy as a backend under the victim's key,
       before the real server, so the proxy pairs the next client with it.
    2. A real client arrives; the attacker reads its hello and opens its own
       connection to the proxy with that hello: the proxy pairs it with the real server.
    3. It passes the server's reply, the client's proof and the server's proof across:
       the handshake completes, end to end, between the real client and the real server.
    4. It relays the client's first (sealed, valid) record, then sends its own upload
       of a Python file and ``load_module``.
    The server must drop the connection and run nothing: no marker file.
    """
    code, marker = _marker_module(tmp_path)
    work = tmp_path / "work"
    px = rpc.Proxy(port=9800, port_end=9900, wait=5.0)
    attacker_backend = register_with_proxy("127.0.0.1", px.port, "victim", None, None, "evil0")
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="victim", token=TOKEN, work_dir=str(work))  # fmt: skip
    client_result: dict = {}

    def client() -> None:
        try:
            with rpc.connect("127.0.0.1", px.port, key="victim", token=TOKEN, connect_timeout=10) as s:  # fmt: skip
                client_result["value"] = s.get_function("imp.add")(1, 2)
        except Exception as exc:  # noqa: BLE001 - the client's fate is checked below
            client_result["error"] = exc

    to_server = None
    try:
        t = threading.Thread(target=client, daemon=True)
        t.start()
        # 1-2: the client lands on the attacker's fake backend
        attacker_backend.t.sock.settimeout(10)
        _k, op, _v = attacker_backend.recv()
        assert op == P_PAIRED
        attacker_backend.send(wire.REPLY, P_ACK, None)
        from_client = attacker_backend.t.sock
        from_client.settimeout(10)
        hello = _read_hello(from_client)
        to_server = socket.create_connection(("127.0.0.1", px.port), timeout=10)
        to_server.sendall(hello)
        # 3: relay the handshake across
        reply = _recv_exact(to_server, _REPLY_BYTES)
        assert reply[13] == 1  # the real server asks for proof
        from_client.sendall(reply)
        to_server.sendall(_recv_exact(from_client, 32))  # the client's proof
        status = _recv_exact(to_server, _STATUS_BYTES)
        assert status[0] == auth.OK  # the relayed proof was accepted...
        from_client.sendall(status)  # ...and the client accepts the server's
        # 4: the client's INIT (a valid sealed record) goes through, then the injection
        to_server.sendall(_read_record(from_client))
        to_server.sendall(_plain_frames(code) if injection == "plain" else _sealed_frames(code))
        assert _closed_within(to_server, 10), "the server kept the connection open"
    finally:
        if to_server is not None:
            to_server.close()
        attacker_backend.close()
        t.join(15)
        srv.terminate()
        px.terminate()
    assert not os.path.exists(marker), "the server ran the attacker's module"
    assert not (work / "evil.py").exists(), "the attacker's upload was left in place"
    assert not work.exists() or os.listdir(work) == []
    assert "value" not in client_result  # the client never got a session through the attacker


# --------------------------------------------------------------------------- relays
class _Mitm(threading.Thread):
    """A TCP relay between a client and a server on loopback that parses records.

    It passes the handshake through (``keylen`` sizes the client's hello), then
    calls ``c2s(i, record)`` / ``s2c(i, record)`` for the ``i``-th sealed record of
    each direction; the hook returns the bytes to forward in its place.
    """

    def __init__(self, server_port: int, keylen: int, c2s=None, s2c=None) -> None:
        super().__init__(daemon=True)
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.server_port = server_port
        self.keylen = keylen
        self.hooks = {"c2s": c2s or (lambda i, r: r), "s2c": s2c or (lambda i, r: r)}
        self.socks: list[socket.socket] = []

    def _pump(self, src: socket.socket, dst: socket.socket, way: str, head: list[int]) -> None:
        try:
            for n in head:
                dst.sendall(_recv_exact(src, n))
            i = 0
            while True:
                dst.sendall(self.hooks[way](i, _read_record(src)))
                i += 1
        except OSError:
            pass
        except EOFError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def run(self) -> None:
        c, _ = self.lst.accept()
        s = socket.create_connection(("127.0.0.1", self.server_port))
        self.socks += [c, s]
        hello = 16 + self.keylen + 32
        a = threading.Thread(target=self._pump, args=(c, s, "c2s", [hello, 32]), daemon=True)
        b = threading.Thread(target=self._pump, args=(s, c, "s2c", [_REPLY_BYTES, _STATUS_BYTES]), daemon=True)  # fmt: skip
        a.start()
        b.start()
        a.join()
        b.join()

    def close(self) -> None:
        self.lst.close()
        for s in self.socks:
            s.close()


def _flip(record: bytes, at: int = 8 + 5) -> bytes:
    r = bytearray(record)
    r[at] ^= 0x01
    return bytes(r)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("shared-work")
    srv = rpc.Server(port=10200, port_end=10250, token=TOKEN, work_dir=str(work))
    srv.work = work
    yield srv
    srv.terminate()


def _through(mitm: _Mitm) -> rpc.RPCSession:
    mitm.start()
    return rpc.connect("127.0.0.1", mitm.port, token=TOKEN, connect_timeout=5)


def test_relay_flips_a_byte_of_a_request(token_server):
    """A relay alters one byte of the client's 3rd record: the server drops the session."""
    mitm = _Mitm(token_server.port, 0, c2s=lambda i, r: _flip(r) if i == 2 else r)
    try:
        s = _through(mitm)
        f = s.get_function("imp.add")  # record 1 (record 0 was INIT)
        with pytest.raises(rpc.RPCError, match="lost the connection"):
            f(1, 2)  # record 2: altered on the way, the server hangs up without answering
    finally:
        mitm.close()


def test_relay_flips_a_byte_of_a_reply(token_server):
    """A relay alters one byte of a reply: the client raises IntegrityError and hangs up."""
    mitm = _Mitm(token_server.port, 0, s2c=lambda i, r: _flip(r) if i == 1 else r)
    try:
        s = _through(mitm)
        with pytest.raises(rpc.RPCError, match="IntegrityError") as info:
            s.get_function("imp.add")
        assert isinstance(info.value.__cause__, disco.errors.IntegrityError)
        assert "altered the stream" in str(info.value) and "died" not in str(info.value)
    finally:
        mitm.close()


def test_a_frame_put_inside_a_download_is_named_a_broken_protocol(tmp_path):
    """Something on an unsealed link puts a heartbeat frame inside a download's file
    stream: the client says the protocol was broken (it said "the server process died
    or dropped the session", outside check)."""
    srv = rpc.Server(port=10200, port_end=10250, liveness_timeout=0)
    lst = socket.create_server(("127.0.0.1", 0))
    armed = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, meddle: bool) -> None:
        passed = 0
        try:
            while data := src.recv(1 << 16):
                if meddle and armed.is_set() and passed < (1 << 20) <= passed + len(data):
                    data = data[:100] + wire.HEARTBEAT_FRAME + data[100:]
                if meddle and armed.is_set():
                    passed += len(data)
                dst.sendall(data)
        except OSError:
            pass

    def run() -> None:
        c, _ = lst.accept()
        s = socket.create_connection(("127.0.0.1", srv.port))
        threading.Thread(target=pump, args=(c, s, False), daemon=True).start()
        threading.Thread(target=pump, args=(s, c, True), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    try:
        with rpc.connect("127.0.0.1", lst.getsockname()[1]) as s:
            s.upload(os.urandom(16 << 20), "big.bin")
            armed.set()
            with pytest.raises(rpc.RPCError, match="broke the protocol") as info:
                s.download("big.bin", target=str(tmp_path / "big.bin"))
            assert "died" not in str(info.value)
            assert not (tmp_path / "big.bin").exists()
    finally:
        lst.close()
        srv.terminate()


def test_relay_replays_a_request(token_server):
    """A relay sends one of the client's records twice: the copy is refused, the session dropped."""
    mitm = _Mitm(token_server.port, 0, c2s=lambda i, r: r + r if i == 1 else r)
    try:
        s = _through(mitm)
        f = s.get_function("imp.add")  # answered once; its replay ends the session
        with pytest.raises(rpc.RPCError, match="lost the connection"):
            for _ in range(50):  # the server drops the link as soon as it reads the copy
                f(1, 2)
                time.sleep(0.02)
    finally:
        mitm.close()


def test_relay_reorders_requests(token_server):
    """Two records swapped by a relay: the first out of order fails its check, the session ends."""
    held: list[bytes] = []

    def swap(i: int, r: bytes) -> bytes:
        if i == 1:
            held.append(r)
            return b""
        return r + held.pop() if i == 2 else r

    mitm = _Mitm(token_server.port, 0, c2s=swap)
    mitm.start()
    try:
        conn = rpc.client.open_conn("127.0.0.1", mitm.port, token=TOKEN, connect_timeout=5)
        conn.t.settimeout(10)
        conn.send(wire.REQUEST, OP_INIT, ((), (0.0, [])))  # record 0
        assert conn.recv()[0] == wire.REPLY
        conn.send(wire.REQUEST, OP_PING, ((), ()))  # record 1: held back
        conn.send(wire.REQUEST, OP_LISTDIR, ((), (".",)))  # record 2: goes first
        with pytest.raises((EOFError, ConnectionError)):
            conn.recv()  # no answer to either: the server hung up
        conn.close()
    finally:
        mitm.close()


def test_altered_upload_leaves_no_file(token_server):
    """An upload whose last chunk is altered on the way leaves neither file nor part file."""
    data = os.urandom(3 << 20)

    large = []

    def flip_last_chunk(i: int, r: bytes) -> bytes:
        # the request, the chunk's head, then its bytes in records of 1 MiB: alter the last
        if len(r) >= 1 << 20:
            large.append(i)
            if len(large) == 3:
                return _flip(r, len(r) - 100)
        return r

    mitm = _Mitm(token_server.port, 0, c2s=flip_last_chunk)
    try:
        s = _through(mitm)
        with pytest.raises(rpc.RPCError):
            s.upload(data, "big.bin")
    finally:
        mitm.close()
    assert len(large) == 3, large  # the altered record was sent
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.listdir(token_server.work):
        time.sleep(0.05)
    assert os.listdir(token_server.work) == []
    with rpc.connect("127.0.0.1", token_server.port, token=TOKEN) as s:  # still serving
        s.upload(data, "big.bin")
        assert bytes(s.download("big.bin")) == data
        s.remove("big.bin")


def test_sealed_session_moves_large_data(token_server, tmp_path):
    """Frames larger than one record (a 20 MiB tensor) and chunked files both ways."""
    with rpc.connect("127.0.0.1", token_server.port, token=TOKEN) as s:
        assert isinstance(s._conn.t, wire.SealedLink)
        arr = np.random.default_rng(0).random(20 << 17)  # 20 MiB
        x = rpc.tensor(arr, device=s.cpu())
        np.testing.assert_array_equal(x.numpy(), arr)
        blob = os.urandom((17 << 20) + 5)
        s.upload(blob, "blob.bin")
        assert bytes(s.download("blob.bin")) == blob
        src = tmp_path / "src.bin"  # from a file and into one (spliced, then checked)
        src.write_bytes(blob[: 9 << 20])
        s.upload(str(src), "from_file.bin")
        s.download("from_file.bin", target=str(tmp_path / "back.bin"))
        assert (tmp_path / "back.bin").read_bytes() == blob[: 9 << 20]
        s.remove("blob.bin")
        s.remove("from_file.bin")


def test_chained_session_with_tokens_on_both_links():
    """The outer server re-seals between two sealed links (only whole verified records pass)."""
    inner = rpc.Server(port=10250, port_end=10300, key="inner", token="in-secret")
    outer = rpc.Server(port=10250, port_end=10300, token="out-secret")
    try:
        args = ["rpc.Connect", "127.0.0.1", inner.port, "inner", False, {"token": "in-secret"}]
        with rpc.connect("127.0.0.1", outer.port, token="out-secret", session_constructor_args=args) as s:  # fmt: skip
            assert s.get_function("imp.add")(2, 3) == 5
            arr = np.arange(3 << 20, dtype="float32")  # 12 MiB: several records
            np.testing.assert_array_equal(rpc.tensor(arr, device=s.cpu()).numpy(), arr)
    finally:
        outer.terminate()
        inner.terminate()


# --------------------------------------------------------------------------- finding 3
def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_unauthenticated_hellos_through_proxy_get_no_process():
    """Finding 3: a hello every second through the proxy, never a proof: no session process,
    and legitimate clients are served all along."""
    px = rpc.Proxy(port=9800, port_end=9900, wait=5.0)
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="nat", token=TOKEN)
    stop = threading.Event()
    idle: list[socket.socket] = []
    replies: list[bytes] = []

    def attacker() -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", px.port), timeout=5)
                s.sendall(auth.pack_hello(auth.VERSION, b"nat", os.urandom(32)))
                idle.append(s)
                reply = _recv_exact(s, _REPLY_BYTES)
                while reply == auth.held_notice():  # held while the server serves another
                    reply = _recv_exact(s, _REPLY_BYTES)
                replies.append(reply)  # then never a proof
            except OSError:
                pass
            stop.wait(1.0)

    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    try:
        time.sleep(2.5)  # a few hellos are pending
        assert _children(srv.pid) == []  # none of them got a process
        for _ in range(3):
            t0 = time.monotonic()
            with rpc.connect("127.0.0.1", px.port, key="nat", token=TOKEN, connect_timeout=10) as s:  # fmt: skip
                assert s.get_function("imp.add")(1, 1) == 2
                assert len(_children(srv.pid)) == 1  # the legitimate session's
            assert time.monotonic() - t0 < 5
            time.sleep(0.5)
        # each was asked for proof, or (its hello read after a legitimate session began) told
        # that the server is taken, to come again: neither lets it in
        assert len(replies) >= 3
        assert all((r[12], r[13]) in ((auth.OK, 1), (auth.SERVER_TAKEN, 0)) for r in replies)
        assert any(r[13] == 1 for r in replies)
    finally:
        stop.set()
        t.join(5)
        for s in idle:
            s.close()
        srv.terminate()
        px.terminate()


def test_clients_arriving_together_through_a_proxy_keep_the_server_alive():
    """Several legitimate clients through a proxy at once (an outside check found the server
    process died when one client's session started while others were mid-handshake)."""
    px = rpc.Proxy(port=9800, port_end=9900, wait=10.0)
    srv = rpc.Server(host="127.0.0.1", port=px.port, is_proxy=True, key="crowd", token=TOKEN)
    results: list[str] = []

    def one() -> None:
        try:
            with rpc.connect("127.0.0.1", px.port, key="crowd", token=TOKEN, connect_timeout=12) as s:  # fmt: skip
                s.get_function("imp.add")(1, 1)
                time.sleep(0.05)
            results.append("ok")
        except Exception as exc:  # a client may be let go; the server must live on
            results.append(f"{type(exc).__name__}: {exc}")

    try:
        for _ in range(4):
            ts = [threading.Thread(target=one) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(40)
            assert os.waitpid(srv.pid, os.WNOHANG)[0] == 0, f"the server process exited: {results}"
        with rpc.connect("127.0.0.1", px.port, key="crowd", token=TOKEN, connect_timeout=12) as s:
            assert s.get_function("imp.add")(2, 3) == 5  # and it still serves
        assert results.count("ok") >= 4, results
    finally:
        srv.terminate()
        px.terminate()


def test_a_fake_server_s_answers_of_the_wrong_kind_are_rpc_errors(token_server, monkeypatch):
    """An attacker check: a fake server (or bytes altered on a link without a token)
    answering get_function with another object raised a raw AttributeError."""
    sess = rpc.connect("127.0.0.1", token_server.port, token=TOKEN)
    try:
        real = sess._request
        wrong = {"get": 5, "listdir": ["ok", 7], "load": "a str"}
        ops = {rpc.client.OP_GET_FUNC: "get", OP_LISTDIR: "listdir", OP_LOAD_MODULE: "load"}

        def fake(op, *args):
            return wrong[ops[op]] if op in ops else real(op, *args)

        monkeypatch.setattr(sess, "_request", fake)
        with pytest.raises(rpc.RPCError, match="not a RemoteFunction"):
            sess.get_function("imp.add")
        with pytest.raises(rpc.RPCError, match="not str"):
            sess.listdir_names(".")
        with pytest.raises(rpc.RPCError, match="not a RemoteModule"):
            sess.load_module("x.py")
    finally:
        sess.close()


@pytest.mark.parametrize(
    "ticket",
    [("127.0.0.1",), None, "xxx", (5, 9091, "t"), ("h", "abc", "t"), ("h", 70000, "t"), {"a": 1}],
)
def test_a_fake_tracker_s_ticket_is_checked(ticket, monkeypatch):
    """An attacker check: a fake tracker's answer to a request raised raw ValueErrors
    and TypeErrors in the client."""
    tr = rpc.Tracker(port=10300, port_end=10350)
    try:
        ts = rpc.connect_tracker(*tr.addr)
        monkeypatch.setattr(ts, "_call", lambda op, value, timeout=None: ticket)
        with pytest.raises(rpc.RPCError, match="no \\(host, port, ticket\\)"):
            ts.request("k", max_retry=1)
        ts.close()
    finally:
        tr.terminate()


ALLOC_SCRIPT = r"""
import os, resource, socket, struct, sys, threading
from disco_core.net.protect import SealedTransport
from disco_core.net.security import SessionKeys
from disco_rpc import wire

class Capture:
    def __init__(self):
        self.data = bytearray()
    def send_parts(self, parts):
        for p in parts:
            self.data += bytes(p)

keys = SessionKeys(send=os.urandom(64), recv=os.urandom(64))
mirror = SessionKeys(send=keys.recv, recv=keys.send)
cap = Capture()
arr = bytes(100_000)  # a bytes value: its buffer was zero-filled at the declared size
if sys.argv[1] == "this-sender":
    wire.Conn(wire.SealedLink(cap, keys)).send(wire.REQUEST, 1, arr)
    first = struct.unpack_from("<Q", cap.data)[0]
    print("FIRST RECORD", first)
else:  # a sender that seals the head with the data: the head's record is large
    conn = wire.Conn(SealedTransport(cap, keys))
    meta, bufs = wire.encode(arr)
    head = wire._HEAD.pack(wire.REQUEST, 1, 0, len(meta), 1) + struct.pack("<Q", len(arr))
    conn.t.send_parts([head + meta + b"".join(bytes(b) for b in bufs)])  # one large part
    first = None
# on the way, the declared buffer length becomes 3 GiB
at = 8 + wire._HEAD_SIZE
stream = bytearray(cap.data)
assert struct.unpack_from("<Q", stream, at)[0] == len(arr)
struct.pack_into("<Q", stream, at, 3 << 30)
a, b = socket.socketpair()
threading.Thread(target=lambda: (a.sendall(stream), a.close()), daemon=True).start()
rx = wire.Conn(wire.SealedLink(wire.SocketTransport(b), mirror))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    rx.recv()
    print("RESULT accepted")
except Exception as exc:
    print("RESULT", type(exc).__name__)
grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print("GREW_MB", grown_mb)
"""


@pytest.mark.parametrize("sender", ["this-sender", "head-with-data"])
def test_an_altered_buffer_length_is_caught_before_anything_is_allocated(sender):
    """An attacker check (F2): a relay rewrote a sealed frame's declared buffer length
    to 2 GiB, and the server zero-filled 2 GiB before the record's tag failed. A large
    frame's head now travels in a record of its own, and a head that shares its record
    with data is verified before anything is sized from it."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", ALLOC_SCRIPT, sender],
        capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out = r.stdout
    assert r.returncode == 0, (out + r.stderr)[-3000:]
    if sender == "this-sender":
        first = int(out.split("FIRST RECORD ")[1].split()[0])
        assert first < 1024, out  # the head alone
    assert "RESULT IntegrityError" in out, out
    assert int(out.split("GREW_MB ")[1].split()[0]) < 500, out


def test_a_forged_worker_frame_sizes_no_memory(monkeypatch):
    """The ``"rpc"`` channel's frames (:class:`disco_rpc.channel.LinkFrames`): a record
    injected on the path whose frame head declares a 512 GiB buffer fails its tag
    before anything is sized from it (an outside check: the socket channel's reader
    allocated such a buffer first; this reader shared the pattern)."""
    import types

    from disco_core.net import framing
    from disco_core.net.security import SessionKeys
    from disco_rpc.worker_host import LinkFrames

    sizes: list[int] = []
    real = framing.unfilled_bytearray
    monkeypatch.setattr(framing, "unfilled_bytearray", lambda n: sizes.append(n) or real(1))
    a, b = socket.socketpair()
    keys = SessionKeys(send=os.urandom(64), recv=os.urandom(64))
    t = wire.SealedLink(wire.SocketTransport(b), keys)
    frames = LinkFrames(types.SimpleNamespace(t=t, take_buffered=lambda: b""))
    head = framing.PREFIX.pack(2, 1, 0) + struct.pack("<Q", 512 << 30) + b"hh"
    payload = head + bytes(200_000 - len(head))  # a large record: read before its tag
    a.sendall(struct.pack("<Q", len(payload)) + payload + os.urandom(16))
    b.settimeout(10)
    try:
        with pytest.raises(disco.IntegrityError):
            frames.read()
        assert sizes == []
    finally:
        a.close()
        b.close()


def test_a_forged_request_head_sizes_no_header(monkeypatch):
    """A record injected on the path whose RPC head declares a 4 GiB header: the head's
    record is verified before the header is sized from it (an outside check: 4 GiB of
    address space reserved, or a bare MemoryError where it could not be)."""
    from disco_core.net.security import SessionKeys

    sizes: list[int] = []
    real = wire.unfilled_bytearray
    monkeypatch.setattr(wire, "unfilled_bytearray", lambda n: sizes.append(n) or real(n))
    a, b = socket.socketpair()
    rx = wire.Conn(wire.SealedLink(wire.SocketTransport(b), SessionKeys(os.urandom(64), os.urandom(64))))  # fmt: skip
    head = wire._HEAD.pack(wire.REQUEST, 1, 0, (4 << 30) - 100, 0)
    payload = head + os.urandom(200_000 - len(head))  # a large record: read before its tag
    a.sendall(struct.pack("<Q", len(payload)) + payload + os.urandom(16))
    b.settimeout(10)
    try:
        with pytest.raises(disco.IntegrityError):
            rx.recv()
        assert all(n < 1 << 20 for n in sizes), sizes
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("sealed_by", ["attacker", "peer"])
def test_an_oversize_head_is_blamed_on_whoever_wrote_it(sealed_by):
    """A head over the receiver's limit, at the start of a large record: written on the
    path (no valid tag) it is an IntegrityError, not the peer's oversize frame (which
    named the peer, or a release mismatch, for an attacker's bytes); sealed by the peer
    it is the peer's FrameTooLargeError."""
    from disco_core.net.security import SessionKeys

    keys = SessionKeys(os.urandom(64), os.urandom(64))
    a, b = socket.socketpair()
    rx = wire.Conn(wire.SealedLink(wire.SocketTransport(b), keys), max_message_bytes=1 << 20)
    head = wire._HEAD.pack(wire.REQUEST, 1, 0, 8 << 20, 0)  # an 8 MiB header, over 1 MiB
    payload = head + os.urandom(200_000 - len(head))  # a large record: read before its tag
    if sealed_by == "peer":
        tx = wire.SealedLink(wire.SocketTransport(a), SessionKeys(send=keys.recv, recv=keys.send))
        tx.send_parts([payload])
    else:
        a.sendall(struct.pack("<Q", len(payload)) + payload + os.urandom(16))
    b.settimeout(10)
    try:
        expected = disco.IntegrityError if sealed_by == "attacker" else wire.FrameTooLargeError
        with pytest.raises(expected):
            rx.recv()
    finally:
        a.close()
        b.close()
