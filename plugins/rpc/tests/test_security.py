"""Security: tokens, TLS, binding, bounded and malformed frames."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import struct
import subprocess

import numpy as np
import pytest

import disco_core as disco
import disco_rpc as rpc
from disco_rpc import auth, wire

pytestmark = pytest.mark.timeout(60)


@disco.register_func("sectest.add", override=True)
def _add(a, b):
    return a + b


@pytest.fixture(scope="module")
def token_server():
    srv = rpc.Server(port=9950, port_end=9999, token="s3cret", key="board")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def small_server():
    srv = rpc.Server(port=10000, port_end=10050, max_message_bytes=1 << 20)
    yield srv
    srv.terminate()


def test_token_required(token_server, monkeypatch):
    monkeypatch.delenv("DISCO_TOKEN", raising=False)
    with pytest.raises(rpc.RPCAuthError, match="requires a token"):
        rpc.connect("127.0.0.1", token_server.port, key="board")
    with pytest.raises(rpc.RPCAuthError, match="wrong token"):
        rpc.connect("127.0.0.1", token_server.port, key="board", token="guess")
    with pytest.raises(rpc.RPCAuthError, match="key mismatch"):
        rpc.connect("127.0.0.1", token_server.port, key="other", token="s3cret")
    with rpc.connect("127.0.0.1", token_server.port, key="board", token="s3cret") as s:
        assert s.get_function("sectest.add")(1, 2) == 3
    monkeypatch.setenv("DISCO_TOKEN", "s3cret")
    with rpc.connect("127.0.0.1", token_server.port, key="board") as s:
        assert s.get_function("sectest.add")(2, 2) == 4


def test_unauthenticated_frames_are_never_read(token_server):
    """A peer that skips authentication and sends a frame gets dropped."""
    sock = socket.create_connection(("127.0.0.1", token_server.port))
    sock.settimeout(5)
    sock.sendall(struct.pack("<8sII", b"DISCORPC", 1, 5) + b"board" + os.urandom(32))
    reply = sock.recv(64)
    assert reply[:8] == b"DISCORPC" and reply[13] == 1  # auth required
    meta, bufs = wire.encode(((), ("sectest.add",)))
    frame = struct.pack("<BBHII", 1, 2, 0, len(meta), 0) + bytes(meta)
    sock.sendall(frame[:32])  # parsed as a (wrong) MAC, nothing more
    data = sock.recv(64)
    assert data[:1] == bytes([auth.AUTH_FAILED])
    assert sock.recv(64) == b""  # closed
    sock.close()


def test_refuse_public_bind(monkeypatch):
    monkeypatch.delenv("DISCO_TOKEN", raising=False)
    with pytest.raises(rpc.RPCError, match="refusing to listen"):
        rpc.Server(host="0.0.0.0", port=10050, port_end=10100)
    srv = rpc.Server(host="0.0.0.0", port=10050, port_end=10100, token="t")
    try:
        with rpc.connect("127.0.0.1", srv.port, token="t") as s:
            assert s.get_function("sectest.add")(1, 1) == 2
    finally:
        srv.terminate()
    srv = rpc.Server(host="0.0.0.0", port=10050, port_end=10100, allow_insecure_bind=True)
    srv.terminate()


def test_oversized_frame(small_server):
    s = rpc.connect("127.0.0.1", small_server.port)
    s.upload(b"x" * (512 << 10), "ok.bin")
    with pytest.raises(rpc.RPCError):
        s.upload(b"x" * (2 << 20), "big.bin")
    with rpc.connect("127.0.0.1", small_server.port) as s2:  # still serving
        assert s2.get_function("sectest.add")(1, 2) == 3
    # the client bounds what it accepts, too
    with rpc.connect("127.0.0.1", small_server.port, max_message_bytes=1 << 16) as s3:
        x = rpc.tensor(np.zeros(1 << 15), device=s3.cpu())
        with pytest.raises(rpc.RPCError, match="over the limit"):
            x.numpy()


def _raw_session(port):
    """A socket past the handshake and INIT of a token-less server."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(5)
    conn = wire.Conn(wire.SocketTransport(sock))
    auth.client_handshake(conn, "", None)
    conn.send(wire.REQUEST, 1, ((), (0.0, [])))
    kind, _op, _info = conn.recv()
    assert kind == wire.REPLY
    return sock, conn


def _frame(meta: bytes, op=2, lens=()):
    head = struct.pack("<BBHII", 1, op, 0, len(meta), len(lens))
    return head + b"".join(struct.pack("<Q", n) for n in lens) + meta


@pytest.mark.parametrize(
    "frame",
    [
        _frame(b"\xff"),  # unknown tag
        _frame(bytes([wire.T_TUPLE]) + struct.pack("<I", 1000)),  # truncated container
        _frame(bytes([wire.T_STR]) + struct.pack("<I", 50) + b"abc"),  # truncated string
        _frame(bytes([wire.T_STR, 0xFF, 0xFF, 0xFF, 0x7F])),  # huge length, no bytes
        _frame(bytes([wire.T_BUF]) + struct.pack("<I", 3), lens=(4,)) + b"abcd",  # bad index
        _frame(bytes([wire.T_TUPLE, 2, 0, 0, 0, wire.T_NONE, wire.T_NONE])),  # not (frees, args)
        _frame(bytes([wire.T_TUPLE]) * 200),  # deep nesting, truncated
        _frame(
            bytes([wire.T_ARRAY]) + struct.pack("<I", 0) + b"\x06object\x01" + struct.pack("<Q", 1),
            lens=(8,),
        )
        + b"x" * 8,  # fmt: skip
        _frame(bytes([wire.T_NONE]), op=200),  # unknown op
    ],
)
def test_malformed_frames_answered(small_server, frame):
    sock, conn = _raw_session(small_server.port)
    sock.sendall(frame)
    kind, _op, value = conn.recv()
    assert kind == wire.ERROR and isinstance(value[0], str)
    # the same connection is still in sync and serves a good request
    conn.send(wire.REQUEST, 2, ((), ("sectest.add",)))
    kind, _op, value = conn.recv()
    assert kind == wire.REPLY and isinstance(value, wire.HandleRef)
    sock.close()


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"DISCORPC" + struct.pack("<II", 1, 1 << 30),  # absurd key length
        b"DISCORPC\x01\x00",  # truncated hello, then hang up
        os.urandom(4096),
    ],
)
def test_garbage_handshakes(small_server, data):
    sock = socket.create_connection(("127.0.0.1", small_server.port))
    sock.settimeout(5)
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    sock.close()
    with rpc.connect("127.0.0.1", small_server.port) as s:
        assert s.get_function("sectest.add")(1, 2) == 3


def test_oversized_declaration_drops(small_server):
    sock, conn = _raw_session(small_server.port)
    sock.sendall(_frame(b"\x00", lens=(1 << 40,)))
    kind, _op, value = conn.recv()
    assert kind == wire.ERROR and "limit" in value[1]
    assert sock.recv(16) == b""
    sock.close()
    with rpc.connect("127.0.0.1", small_server.port) as s:
        assert s.get_function("sectest.add")(1, 2) == 3


def test_truncated_frame_then_hangup(small_server):
    sock, _conn = _raw_session(small_server.port)
    meta = bytes(wire.encode(((), ("sectest.add",)))[0])
    sock.sendall(_frame(meta)[:-3])
    sock.close()
    with rpc.connect("127.0.0.1", small_server.port) as s:
        assert s.get_function("sectest.add")(1, 2) == 3


def test_decoder_never_builds_objects():
    # object dtypes and unknown tags are refused by the decoder itself
    from disco_rpc.errors import ProtocolError

    for meta in (b"\x0d\x00\x00\x00\x00\x06object\x00", b"\x63", b""):
        with pytest.raises(ProtocolError):
            wire.decode(meta, (0,))


# --------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    try:
        from cryptography import x509  # noqa: F401

        have_crypto = True
    except ImportError:
        have_crypto = False
    if not have_crypto and not shutil.which("openssl"):
        pytest.skip("neither the cryptography package nor the openssl CLI is available")
    cert, key = d / "cert.pem", d / "key.pem"
    r = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        capture_output=True,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {r.stderr.decode()[:200]}")
    return str(cert), str(key)


def test_tls(tls_files):
    cert, key = tls_files
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    srv = rpc.Server(port=10100, port_end=10150, ssl_context=sctx, token="tok")
    try:
        cctx = ssl.create_default_context(cafile=cert)
        with rpc.connect("127.0.0.1", srv.port, ssl_context=cctx, token="tok") as s:
            assert s.get_function("sectest.add")(1, 2) == 3
            x = rpc.tensor(np.arange(1 << 18, dtype="float32"), device=s.cpu())
            np.testing.assert_array_equal(x.numpy(), np.arange(1 << 18, dtype="float32"))
            s.upload(b"y" * (1 << 20), "f")
            assert len(s.download("f")) == 1 << 20
        with pytest.raises(rpc.RPCError):  # plain TCP to a TLS server
            rpc.connect("127.0.0.1", srv.port, token="tok", connect_timeout=3)
        with pytest.raises((rpc.RPCError, ssl.SSLError)):  # a certificate it does not trust
            rpc.connect("127.0.0.1", srv.port, ssl_context=ssl.create_default_context(), token="tok")  # fmt: skip
    finally:
        srv.terminate()
    # TLS alone is enough to listen beyond loopback
    srv = rpc.Server(host="0.0.0.0", port=10100, port_end=10150, ssl_context=sctx)
    srv.terminate()
