"""disco_core.net: the security policy, sealed records and capped framing."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import warnings

import numpy as np
import pytest

import disco_core as disco
from disco_core import protocol, wire_values
from disco_core.channels.base import WorkerLink
from disco_core.errors import (
    FrameLimitError,
    InsecureBindError,
    IntegrityError,
    UntrustedValueError,
)
from disco_core.net import security
from disco_core.net.framing import FrameReader, frame_head
from disco_core.net.io import SocketTransport
from disco_core.net.protect import LARGE_RECORD, SEND_RECORD_BYTES, SealedTransport
from disco_core.net.security import Handshake, check_bind, is_loopback, resolve_token

pytestmark = pytest.mark.timeout(30)


# ----------------------------------------------------------------------------- policy
def test_resolve_token(monkeypatch):
    monkeypatch.delenv("DISCO_TOKEN", raising=False)
    assert resolve_token(None) is None
    assert resolve_token("") is None
    assert resolve_token("s3") == b"s3"
    monkeypatch.setenv("DISCO_TOKEN", "env")
    assert resolve_token(None) == b"env"
    assert resolve_token(b"arg") == b"arg"
    with pytest.raises(TypeError, match="token must be str or bytes"):
        resolve_token(3)


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", True),
        ("127.5.5.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_check_bind_refuses_open_address_without_token_or_tls():
    with pytest.raises(InsecureBindError, match="refusing to listen on every interface"):
        check_bind("", token=None, tls=False, what="test service")
    with pytest.raises(InsecureBindError, match="0.0.0.0"):
        check_bind("0.0.0.0", token=None, tls=False)
    check_bind("0.0.0.0", token=b"t", tls=False)
    check_bind("0.0.0.0", token=None, tls=True)
    with pytest.warns(RuntimeWarning, match="neither a token nor TLS that requires client"):
        check_bind("0.0.0.0", token=None, tls=False, allow_insecure_bind=True)


def test_check_bind_counts_tls_only_when_it_requires_client_certificates():
    """Server-side TLS alone encrypts and lets anyone in: an attacker without the token
    or a certificate ran code on such a server, which the policy had let listen on any
    address (an attacker check). It stands in for a token only with client certificates."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # verify_mode CERT_NONE
    with pytest.raises(InsecureBindError, match="TLS does not require client certificates"):
        check_bind("0.0.0.0", token=None, tls=ctx)
    check_bind("0.0.0.0", token=b"t", tls=ctx)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    with pytest.raises(InsecureBindError, match="TLS does not require client certificates"):
        check_bind("0.0.0.0", token=None, tls=ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    check_bind("0.0.0.0", token=None, tls=ctx)
    with pytest.raises(InsecureBindError, match="anyone who reaches it could run code"):
        check_bind("0.0.0.0", token=None, tls=None)


def test_check_bind_warns_once_on_loopback_without_token(monkeypatch):
    monkeypatch.setattr(security, "_warned_loopback", set())
    with pytest.warns(RuntimeWarning, match="without a token"):
        check_bind("127.0.0.1", token=None, tls=False, what="svc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_bind("127.0.0.1", token=None, tls=False, what="svc")  # once only
        check_bind("127.0.0.1", token=b"t", tls=False, what="other")


# ----------------------------------------------------------------------------- handshake
def _pair(token_c=b"tok", token_s=b"tok", hello=b"hello", reply=b"reply"):
    c = Handshake(token_c, "client", b"test/1")
    s = Handshake(token_s, "server", b"test/1")
    c.bind(hello, reply)
    s.bind(hello, reply)
    return c, s


def test_handshake_proofs_are_mutual_and_bound():
    c, s = _pair()
    assert s.verify(c.proof()) and c.verify(s.proof())
    assert not c.verify(c.proof()), "a reflected proof must not pass"
    wrong_c, s2 = _pair(token_c=b"other")
    assert not s2.verify(wrong_c.proof())
    c3, s3 = _pair(hello=b"hello2")  # a relay that altered a hello
    c4, _ = _pair()
    assert not s3.verify(c4.proof())
    assert c.keys().send == s.keys().recv and c.keys().recv == s.keys().send
    assert c.keys().send != c.keys().recv
    assert c3.keys().send != c.keys().send
    with pytest.raises(ValueError, match="needs a token"):
        Handshake(b"", "client", b"x")


def test_a_proof_checks_a_token_guess_only_through_scrypt():
    """A proof seen on the wire (or asked for by a fake peer) lets a guess of the token
    be checked offline. Keyed with the token itself, an attacker check tried 265,000
    guesses a second on one core and found the README's example token at once; the
    proof is now keyed with scrypt of the token, which a guess must pay for too."""
    import hashlib
    import hmac

    from disco_core.net import security

    c, s = _pair(token_c=b"s3cret", token_s=b"s3cret")
    proof = c.proof()
    msg = security._VERSION + b" proof client\0" + c.transcript

    def checks(key: bytes) -> bool:
        return hmac.compare_digest(hmac.new(key, msg, hashlib.sha256).digest(), proof)

    assert not checks(b"s3cret")  # the cheap guess no longer checks out
    stretched = hashlib.scrypt(
        b"s3cret", salt=b"disco-net/2 token", n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32
    )
    assert security.stretch_token(b"s3cret") == stretched and checks(stretched)
    assert s.verify(proof)
    raw = Handshake(stretched, "client", b"test/1", stretch=False)  # an already random secret
    raw.bind(b"hello", b"reply")
    assert raw.proof() == proof


# ----------------------------------------------------------------------------- sealed records
class _Tap:
    """A transport that also keeps every byte it sent (to replay or alter them)."""

    def __init__(self, sock):
        self.inner = SocketTransport(sock)
        self.sent: list[bytes] = []

    def send_parts(self, parts):
        self.sent.append(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
        self.inner.send_parts(parts)

    def recv_into(self, view):
        return self.inner.recv_into(view)


@pytest.fixture
def sealed_pair():
    a, b = socket.socketpair()
    c, s = _pair()
    tap = _Tap(a)
    yield SealedTransport(tap, c.keys()), SealedTransport(SocketTransport(b), s.keys()), tap, a
    a.close()
    b.close()


def _recv(t, n):
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        got += t.recv_into(view[got:])
    return bytes(out)


@pytest.mark.parametrize("size", [1, 100, LARGE_RECORD - 1, LARGE_RECORD, 3 * LARGE_RECORD + 7])
def test_sealed_round_trip(sealed_pair, size):
    tx, rx, _, _ = sealed_pair
    data = os.urandom(size)
    t = threading.Thread(target=tx.send_parts, args=([b"H", memoryview(data)],))
    t.start()
    assert _recv(rx, size + 1) == b"H" + data
    t.join()


def test_sealed_array_is_received_in_place(sealed_pair):
    tx, rx, _, _ = sealed_pair
    src = np.arange(200_000, dtype=np.float32)
    dst = np.empty_like(src)
    t = threading.Thread(target=tx.send_parts, args=([src],))
    t.start()
    view = memoryview(dst.view(np.uint8).reshape(-1))
    got = 0
    while got < view.nbytes:
        got += rx.recv_into(view[got:])
    t.join()
    np.testing.assert_array_equal(src, dst)


def _record_lengths(stream: bytes) -> list[int]:
    """The payload lengths of the sealed records in ``stream`` (as sent)."""
    lengths, pos = [], 0
    while pos < len(stream):
        (n,) = struct.unpack_from("<Q", stream, pos)
        lengths.append(n)
        pos += 8 + n + 16
    assert pos == len(stream)
    return lengths


def test_a_large_send_puts_its_head_alone_then_records_of_at_most_max_send(sealed_pair):
    """The head (the small parts before the first large one) is a small record of its
    own, verified whole before the peer sizes anything from it; the rest leaves in
    records of at most ``max_send`` bytes, so the peer never holds more than that
    unverified (an outside check: a relay without the token declared a 1 TiB buffer)."""
    tx, rx, tap, _ = sealed_pair
    head, route = os.urandom(40), os.urandom(12)
    data = np.frombuffer(os.urandom(3 * SEND_RECORD_BYTES + 5), np.uint8)
    small = os.urandom(100)
    t = threading.Thread(target=tx.send_parts, args=([route, head, data, small],))
    t.start()
    assert _recv(rx, 52 + data.nbytes + 100) == route + head + data.tobytes() + small
    t.join()
    lengths = _record_lengths(b"".join(tap.sent))
    assert lengths == [52, SEND_RECORD_BYTES, SEND_RECORD_BYTES, SEND_RECORD_BYTES, 105]
    tap.sent.clear()
    tx.send_parts([head, os.urandom(LARGE_RECORD - 100)])  # under LARGE_RECORD: one record
    _recv(rx, LARGE_RECORD - 60)
    assert _record_lengths(b"".join(tap.sent)) == [LARGE_RECORD - 60]
    with pytest.raises(ValueError, match="max_send must be at least"):
        SealedTransport(tap, _pair()[0].keys(), max_send=LARGE_RECORD - 1)


@pytest.mark.parametrize("attack", ["alter", "replay", "inject", "reorder", "truncate_tag"])
def test_sealed_refuses_tampering(sealed_pair, attack):
    tx, rx, tap, raw = sealed_pair
    tx.send_parts([b"first record"])
    tx.send_parts([b"second record"])
    first, second = tap.sent
    assert _recv(rx, 12) == b"first record"
    _recv(rx, 13)
    if attack == "alter":
        tx.send_parts([b"third record"])
        third = bytearray(tap.sent[-1])
        _recv(rx, 12)  # the real one; then a copy with one bit flipped
        third[10] ^= 1
        raw.sendall(third)
    elif attack == "replay":
        raw.sendall(first)
    elif attack == "inject":
        raw.sendall(struct.pack("<Q", 5) + b"evil!" + bytes(16))
    elif attack == "reorder":
        # a record sealed for a later position arrives now
        tx._out.seq += 1
        tx.send_parts([b"skipped one"])
    elif attack == "truncate_tag":
        raw.sendall(struct.pack("<Q", 4) + b"abcd" + bytes(3))
        raw.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            _recv(rx, 4)
        return
    forged_len = {"alter": 12, "replay": 12, "inject": 5, "reorder": 11}[attack]
    with pytest.raises(IntegrityError, match="integrity check"):
        _recv(rx, forged_len)
    with pytest.raises(IntegrityError):  # and the connection stays refused
        rx.recv_into(bytearray(4))


def test_sealed_caps_the_declared_record_length(sealed_pair):
    _, rx, _, raw = sealed_pair
    rx.max_record = 1 << 20
    raw.sendall(struct.pack("<Q", 1 << 40))
    with pytest.raises(FrameLimitError, match="record of 1099511627776 bytes"):
        rx.recv_into(bytearray(4))


def test_sealed_clean_end_of_stream(sealed_pair):
    _, rx, _, raw = sealed_pair
    raw.shutdown(socket.SHUT_WR)
    assert rx.recv_into(bytearray(4)) == 0


# ----------------------------------------------------------------------------- framing
def test_frame_reader_caps_before_allocating():
    r, w = os.pipe()
    try:
        os.write(w, struct.pack("<QII", 10, 1 << 30, 0))
        with pytest.raises(FrameLimitError, match="buffers"):
            FrameReader(r).read()
        os.write(w, struct.pack("<QII", 1 << 50, 0, 0))
        with pytest.raises(FrameLimitError, match="header"):
            FrameReader(r).read()
        os.write(w, struct.pack("<QII", 4, 1, 0) + struct.pack("<Q", 1 << 30))
        with pytest.raises(FrameLimitError, match="at most 1048576"):
            FrameReader(r, max_frame=1 << 20).read()
    finally:
        os.close(r)
        os.close(w)


def test_frame_reader_round_trip():
    r, w = os.pipe()
    try:
        frame = wire_values.encode_for_network(("x", np.arange(5000)))
        os.write(w, frame_head(*frame, flags=1))
        for m in frame[1]:
            os.write(w, m)
        header, buffers, flags = FrameReader(r).read()
        assert flags == 1
        value = wire_values.decode_untrusted(header, buffers)
        np.testing.assert_array_equal(value[1], np.arange(5000))
    finally:
        os.close(r)
        os.close(w)


def test_read_frame_head_checks_the_count_before_reading_the_lengths():
    from disco_core.net.framing import read_frame_head

    asked = []

    def take(n):
        asked.append(n)
        return struct.pack("<QII", 4, 1 << 30, 0)

    with pytest.raises(FrameLimitError, match="buffers"):
        read_frame_head(take)
    assert asked == [16]  # the 8 GiB of lengths were never asked for
    data = memoryview(struct.pack("<QII", 3, 2, 7) + struct.pack("<2Q", 5, 6))
    pos = 0

    def take_ok(n):
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    assert read_frame_head(take_ok) == (3, (5, 6), 7)


def test_worker_argv_options():
    from disco_core.net.spawn import worker_argv

    plain = worker_argv("disco_core.worker", 1, 4, 1, 5, 6)
    assert plain[-4:] == ["--cmd-fd", "5", "--reply-fd", "6"]
    socket_worker = worker_argv("m", 2, 4, 1, 5, 6, untrusted=True, reply_key_fd=9)
    assert socket_worker[-3:] == ["--untrusted", "--reply-key-fd", "9"]


# ----------------------------------------------------------------------------- untrusted values
@pytest.mark.parametrize(
    "value",
    [
        (1, 2.5, "s", b"b", None, True, 1 + 2j, [1, (2,)], {"k": {1, 2}}, 1 << 80),
        np.arange(10_000, dtype=np.float64).reshape(100, 100),
        np.arange(6.0).reshape(2, 3).T,  # Fortran order, kept
        np.arange(4, dtype=">i4"),  # the other byte order, kept
        np.array(["ab", "c"]),
        np.float32(1.5),
        np.dtype("int8"),
        np.float16,
        disco.Device("cpu", 0),
        protocol.RegRef(7),
        disco.WorkerError(1, "ValueError", "bad", "Traceback..."),
        disco.WorkerDiedError([1, 2], "killed", given_up=True),
        frozenset({1}),
        bytearray(b"x"),
    ],
)
def test_decode_untrusted_accepts_data(value):
    header, buffers = wire_values.encode_for_network(value)
    out = wire_values.decode_untrusted(header, [bytearray(b) for b in buffers])
    assert type(out) is type(value)
    if isinstance(value, np.ndarray):
        assert out.dtype == value.dtype and np.array_equal(out, value)
        assert out.flags.f_contiguous == value.flags.f_contiguous and out.flags.writeable
    elif isinstance(value, Exception):
        assert str(out) == str(value)
    elif not isinstance(value, protocol.RegRef):
        assert out == value


_ML_DTYPES = [
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e4m3b11fnuz", "int4", "uint4",
]  # fmt: skip


@pytest.mark.parametrize("name", _ML_DTYPES)
def test_every_ml_dtypes_array_crosses_a_network_link(name):
    """float8_e5m2 is kind "f" in ml_dtypes 0.6 (the others "V"), and its ``dt.str``
    "<f1" is no NumPy dtype: it was refused "cannot send dtype float8_e5m2 ...:
    ml_dtypes ... cross one" (an outside check). Arrays, dtypes and scalars cross."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    kind = getattr(ml_dtypes, name, None)
    if kind is None:
        pytest.skip(f"this ml_dtypes has no {name}")
    dt = np.dtype(kind)
    for value in (np.arange(6).astype(dt).reshape(2, 3), dt, dt.type(1)):
        header, buffers = wire_values.encode_for_network(value)
        out = wire_values.decode_untrusted(header, [bytearray(b) for b in buffers])
        if isinstance(value, np.ndarray):
            assert out.dtype == dt and out.tobytes() == value.tobytes()
        elif isinstance(value, np.dtype):
            assert out == dt
        else:
            assert type(out) is dt.type and out.tobytes() == value.tobytes()


def test_a_large_array_is_rebuilt_in_its_buffer_not_copied():
    a = np.arange(1 << 16, dtype=np.float32)
    header, buffers = wire_values.encode_for_network(("reply", a))
    assert len(buffers) == 1 and len(header) < 100  # the data is not in the header
    assert np.shares_memory(np.frombuffer(buffers[0], np.uint8), a)  # sent from its memory
    received = bytearray(buffers[0])
    out = wire_values.decode_untrusted(header, [received])[1]
    assert np.shares_memory(out, np.frombuffer(received, np.uint8)) and out.flags.writeable


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_decode_untrusted_refuses_pickles_objects_and_garbage():
    with pytest.raises(UntrustedValueError, match="not a Disco network frame.*a pickle"):
        wire_values.decode_untrusted(pickle.dumps(_Evil()))
    with pytest.raises(UntrustedValueError, match="malformed"):
        wire_values.decode_untrusted(wire_values.MAGIC + b"garbage")
    # a type name nobody registered is refused, and nothing is imported for it
    import sys

    name = b"antigravity.fly"
    ext = wire_values.MAGIC + bytes([21, len(name)]) + name + bytes([0])
    with pytest.raises(UntrustedValueError, match="unknown type b'antigravity.fly'"):
        wire_values.decode_untrusted(ext)
    assert "antigravity" not in sys.modules
    # a frame with a buffer no value uses, or a value after the value, is refused
    header, _ = wire_values.encode_for_network(1)
    with pytest.raises(UntrustedValueError, match="buffers no value refers to"):
        wire_values.decode_untrusted(header, [bytearray(8)])
    with pytest.raises(UntrustedValueError, match="bytes after the value"):
        wire_values.decode_untrusted(header + b"\x00")


def test_decode_untrusted_refuses_keys_of_one_hash(monkeypatch):
    """Int hashes are not randomised: many keys of one hash would make the rebuild quadratic."""
    step = (1 << 61) - 1  # ints that differ by this share a hash
    colliding = {i * step: 0 for i in range(100)}
    with pytest.raises(disco.DiscoValueError, match="keys of one hash value"):
        wire_values.encode_for_network(colliding)  # our sender refuses it; a peer may not:
    monkeypatch.setattr(wire_values, "_check_sendable_keys", lambda keys: None)
    header, _ = wire_values.encode_for_network(colliding)
    with pytest.raises(UntrustedValueError, match="keys of one hash value"):
        wire_values.decode_untrusted(header)
    header, _ = wire_values.encode_for_network({i: 0 for i in range(100)})  # distinct: fine
    assert len(wire_values.decode_untrusted(header)) == 100


class _Plain:
    """A user's class, harmless but not data: no network peer rebuilds it."""


class _RemoteLink(WorkerLink):
    """A link whose workers decode untrusted; a command ``check_untrusted`` refuses never
    reaches it."""

    untrusted = True

    def send(self, out):
        raise AssertionError("a checked command is not sent")

    def close(self, deadline):
        pass


def test_a_value_a_network_peer_would_refuse_is_refused_before_it_leaves():
    """``check_untrusted``: a command for a link whose workers decode untrusted is
    refused (DiscoTypeError, naming the type) when a value in it cannot cross a network
    link; other links, and commands of plain values, are not looked at."""
    from disco_core.channels.base import Outgoing, check_untrusted

    class Local(_RemoteLink):
        untrusted = False

    ok = Outgoing(
        (protocol.CALL_PACKED, 1, 2, (np.arange(3), [1, (2.5, "s")], disco.Device("cpu", 0)))
    )
    bad = Outgoing((protocol.CALL_PACKED, 1, 2, ([1, _Plain()],)))
    check_untrusted(ok, [_RemoteLink()])
    assert ok.frame_for(_RemoteLink()) is ok.wire_frame and ok.frame_for(Local()) is ok.frame
    check_untrusted(bad, [Local()])  # a pipe to a process this one started: anything pickled
    with pytest.raises(disco.DiscoTypeError, match=r"cannot send \S*_Plain over a network link"):
        check_untrusted(bad, [Local(), _RemoteLink()])
    with pytest.raises(disco.DiscoTypeError, match=r"cannot send \S*_Evil over a network link"):
        wire_values.encode_for_network(_Evil())
    with pytest.raises(disco.DiscoTypeError, match="cannot send dtype"):
        wire_values.encode_for_network(np.zeros(2, dtype=[("a", "i4")]))


def test_a_value_a_network_peer_would_refuse_for_its_memory_is_refused_before_it_leaves():
    """A long list of empty sets (or 0-d arrays) takes more memory per byte than a
    receiver allows: a remote worker refused the command and exited (exit code 3, the
    session over). ``check_untrusted`` rebuilds a large header as the worker would, and
    the mistake is a DiscoValueError at the call."""
    from disco_core.channels.base import Outgoing, check_untrusted

    costly = Outgoing((protocol.CALL_PACKED, 1, 2, ([set() for _ in range(100_000)],)))
    with pytest.raises(disco.DiscoValueError, match="more than 24 bytes of memory per byte"):
        check_untrusted(costly, [_RemoteLink()])
    fine = Outgoing((protocol.CALL_PACKED, 1, 2, ([{i} for i in range(100_000)],)))
    check_untrusted(fine, [_RemoteLink()])
    # A header of at most 2 KiB is not rebuilt: the dearest value per byte fits its floor.
    small = [frozenset()] * ((wire_values._REBUILD_CHECK_FROM - 16) // 5)
    header, buffers = wire_values.encode_for_network(small)
    assert len(header) <= wire_values._REBUILD_CHECK_FROM
    assert wire_values.decode_untrusted(header, buffers) == small
    for item in (np.array(True), np.array(1, np.int8), set(), b"", {}):
        size = len(wire_values.encode_for_network([item, item])[0]) - len(
            wire_values.encode_for_network([item])[0]
        )
        empty = len(wire_values.encode_for_network([])[0])
        dear = [item] * ((wire_values._REBUILD_CHECK_FROM - empty) // size)
        header, buffers = wire_values.encode_for_network(dear)
        assert (
            wire_values._REBUILD_CHECK_FROM - size < len(header) <= wire_values._REBUILD_CHECK_FROM
        )
        wire_values.decode_untrusted(header, buffers)  # not refused


def test_small_record_is_checked_before_any_byte_is_handed_over(sealed_pair):
    """A small record is read whole and verified first; what the caller did not take waits."""
    tx, rx, tap, raw = sealed_pair
    tx.send_parts([b"0123456789"])
    one = bytearray(3)
    assert rx.recv_into(memoryview(one)) == 3 and bytes(one) == b"012"
    assert rx.pending == 7 and rx.record_left == 0  # verified, held
    assert _recv(rx, 7) == b"3456789" and rx.pending == 0
    tx.send_parts([b"abcdefghij"])
    forged = bytearray(tap.sent[-1])
    _recv(rx, 10)
    forged[-20] ^= 1  # the first payload byte of a replayed copy, altered
    raw.sendall(forged)
    with pytest.raises(IntegrityError):
        rx.recv_into(memoryview(bytearray(1)))  # not even one byte of it comes out


def test_absorb_counts_bytes_moved_around_the_transport(sealed_pair):
    """A caller that moves a large record's payload itself (a splice) feeds it to absorb()."""
    tx, rx, tap, raw = sealed_pair
    data = os.urandom(3 * LARGE_RECORD)
    t = threading.Thread(target=tx.send_parts, args=([data],))
    t.start()
    head = _recv(rx, 100)
    assert rx.record_left == len(data) - 100
    rest = bytearray()
    while len(rest) < len(data) - 100:  # read around the seal, as a splice would
        rest += rx.inner.sock.recv(len(data) - 100 - len(rest))
    t.join()
    with pytest.raises(ValueError):
        rx.absorb(rest + b"x")  # more than the record holds
    rx.absorb(rest[:-1])
    rx.absorb(rest[-1:])  # the last byte: the tag is read and checked here
    assert head + bytes(rest) == data and rx.record_left == 0
    # the same with one byte changed on the way: the check fails
    t = threading.Thread(target=tx.send_parts, args=([data],))
    t.start()
    _recv(rx, 100)
    rest = bytearray()
    while len(rest) < len(data) - 100:
        rest += rx.inner.sock.recv(len(data) - 100 - len(rest))
    t.join()
    rest[5] ^= 1
    with pytest.raises(IntegrityError):
        rx.absorb(rest)


def test_begin_record_starts_the_next_record_for_a_caller_that_splices(sealed_pair):
    """begin_record() reads the next record's head: a large one's payload is then the
    caller's to move (absorb), a small one is read whole and checked (pending)."""
    tx, rx, tap, raw = sealed_pair
    big, small = os.urandom(2 * LARGE_RECORD), b"tail"
    t = threading.Thread(target=lambda: (tx.send_parts([big]), tx.send_parts([small])))
    t.start()
    assert rx.begin_record() == len(big) and rx.record_left == len(big)
    assert rx.begin_record() == len(big)  # under way: nothing more is read
    rest = bytearray()
    while len(rest) < len(big):
        rest += rx.inner.sock.recv(len(big) - len(rest))
    rx.absorb(rest)
    assert rx.begin_record() == 0 and rx.pending == len(small)  # small: held, verified
    assert rx.begin_record() == 0  # bytes held: nothing more is read
    assert _recv(rx, len(small)) == small and bytes(rest) == big
    t.join()


# ----------------------------------------------------------------------------- relay
def test_relay_reseals_between_two_protected_links():
    from disco_core.net.relay import relay

    c_sock, m1 = socket.socketpair()  # client <-> middle
    m2, s_sock = socket.socketpair()  # middle <-> server
    c1, s1 = _pair(hello=b"link1")
    c2, s2 = _pair(hello=b"link2")
    client = SealedTransport(SocketTransport(c_sock), c1.keys())
    mid_in = SealedTransport(SocketTransport(m1), s1.keys())
    mid_out = SealedTransport(SocketTransport(m2), c2.keys())
    server = SealedTransport(SocketTransport(s_sock), s2.keys())
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("moved", relay(mid_in, mid_out, b"", b"")), daemon=True
    )
    t.start()
    data = os.urandom(3 * LARGE_RECORD + 11)
    sender = threading.Thread(target=client.send_parts, args=([data],))
    sender.start()
    assert _recv(server, len(data)) == data
    sender.join()
    server.send_parts([b"answer"])
    assert _recv(client, 6) == b"answer"
    c_sock.shutdown(socket.SHUT_WR)
    t.join(10)
    assert not t.is_alive()
    assert result["moved"] == (len(data), 6)
    for s in (c_sock, m1, m2, s_sock):
        s.close()


def test_relay_ends_on_a_forged_record_and_forwards_buffered_bytes():
    from disco_core.net.relay import relay

    c_sock, m1 = socket.socketpair()
    m2, s_sock = socket.socketpair()
    c1, s1 = _pair()
    mid_in = SealedTransport(SocketTransport(m1), s1.keys())
    mid_out = SocketTransport(m2)
    done = threading.Event()

    def run():
        relay(mid_in, mid_out, b"", b"early")
        done.set()

    threading.Thread(target=run, daemon=True).start()
    client = SealedTransport(SocketTransport(c_sock), c1.keys())
    assert _recv(client, 5) == b"early"  # owed to the client, sent first (sealed)
    c_sock.sendall(struct.pack("<Q", 5) + b"evil!" + bytes(16))
    assert done.wait(10), "the relay must end on a record that fails its check"
    s_sock.settimeout(0.2)
    with pytest.raises((TimeoutError, socket.timeout)):
        s_sock.recv(5)  # nothing of the forged record reached the server
    for s in (c_sock, m1, m2, s_sock):
        s.close()


def test_relay_holds_a_large_record_until_its_tag_checks():
    """A forged large record never reaches the other link, not even in part."""
    from disco_core.net.relay import relay

    c_sock, m1 = socket.socketpair()
    m2, s_sock = socket.socketpair()
    _c1, s1 = _pair(hello=b"in")
    c2, s2 = _pair(hello=b"out")
    mid_in = SealedTransport(SocketTransport(m1), s1.keys())
    mid_out = SealedTransport(SocketTransport(m2), c2.keys())
    server = SealedTransport(SocketTransport(s_sock), s2.keys())
    done = threading.Event()
    threading.Thread(target=lambda: (relay(mid_in, mid_out), done.set()), daemon=True).start()
    data = os.urandom(4 * LARGE_RECORD)
    forged = struct.pack("<Q", len(data)) + data + bytes(16)  # a tag nobody without keys has
    c_sock.sendall(forged)
    assert done.wait(10), "the relay ends on the forged record"
    s_sock.settimeout(0.3)
    with pytest.raises((TimeoutError, socket.timeout)):
        server.recv_into(bytearray(16))  # not one byte of it was sealed anew for the server
    for s in (c_sock, m1, m2, s_sock):
        s.close()


def test_decode_untrusted_builds_no_array_of_a_declared_size():
    """A few bytes must not make an array of any size: its data comes with it, or nothing."""
    header, _ = wire_values.encode_for_network(np.zeros(2, np.float64))  # 16 bytes inline
    big = header.replace(struct.pack("<Q", 2), struct.pack("<Q", 1 << 33), 1)  # 64 GiB declared
    with pytest.raises(UntrustedValueError, match="truncated"):
        wire_values.decode_untrusted(big)
    header, buffers = wire_values.encode_for_network(np.zeros(1024, np.float64))  # out of band
    big = header.replace(struct.pack("<Q", 1024), struct.pack("<Q", 1 << 33), 1)
    with pytest.raises(UntrustedValueError, match="expected 68719476736"):
        wire_values.decode_untrusted(big, [bytearray(b) for b in buffers])
    # object arrays of plain values cross, rebuilt item by item
    obj = np.array([1, "x", (2, 3)], dtype=object)
    out = wire_values.decode_untrusted(*wire_values.encode_for_network(obj))
    assert out.dtype == object and list(out) == [1, "x", (2, 3)]
    pairs = np.empty(2, dtype=object)  # items that are sequences stay items
    pairs[0], pairs[1] = (1, 2), (3, 4)
    out = wire_values.decode_untrusted(*wire_values.encode_for_network(pairs))
    assert out.shape == (2,) and list(out) == [(1, 2), (3, 4)]


def test_an_unfilled_bytearray_is_a_bytearray_of_that_size():
    """The receive buffers skip bytearray(n)'s zeros (35 ms for 64 MiB on a VM)."""
    from disco_core.spi import unfilled_bytearray

    buf = unfilled_bytearray(1 << 20)
    assert type(buf) is bytearray and len(buf) == 1 << 20
    buf[:3] = b"abc"
    assert bytes(buf[:3]) == b"abc"
    assert unfilled_bytearray(0) == bytearray()
    with pytest.raises(ValueError, match="negative"):
        unfilled_bytearray(-1)


def test_a_large_unfilled_bytearray_asks_for_huge_pages():
    """A 64 MiB download into 4 KiB pages spent 32 ms in page faults on the VM (half its
    time); the buffer asks for transparent huge pages, as NumPy's arrays do. Where the
    kernel gives them on request (THP "always" or "madvise"), the touched buffer holds
    some; where it never does, the buffer is still a plain, whole bytearray."""
    import ctypes
    import re

    from disco_core.spi import unfilled_bytearray

    n = 32 << 20
    buf = unfilled_bytearray(n)
    assert type(buf) is bytearray and len(buf) == n
    memoryview(buf)[:] = b"\x07" * n  # the first touch, as a receive would
    assert buf[0] == buf[n - 1] == 7
    addr = ctypes.addressof((ctypes.c_char * n).from_buffer(buf))
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        mode = "[never]"
    huge_kib = 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                lo, hi = int(m[1], 16), int(m[2], 16)
                inside = lo < addr + n and addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                huge_kib += int(line.split()[1])
    if "[never]" in mode:
        assert huge_kib == 0
    else:
        assert huge_kib >= 2048, f"no huge page in the buffer (THP {mode.strip()})"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity API here")
def test_readers_poll_unless_both_sides_are_pinned_to_one_cpu():
    """Two processes pinned to the same single CPU do not poll for each other's frames:
    the peer would run only when the poller sleeps. Pinned to different CPUs, or not
    pinned, or on another kernel, they do; a peer's malformed placement changes nothing."""
    from disco_core.net.io import may_poll_beside, placement

    before = os.sched_getaffinity(0)
    try:
        cpu = min(before)
        os.sched_setaffinity(0, {cpu})
        kernel, cpus = placement()
        assert cpus == [cpu] and len(kernel) == 32
        assert may_poll_beside([kernel, [cpu]]) is False
        assert may_poll_beside([kernel, [cpu + 1]]) is True
        assert may_poll_beside(["0" * 32, [cpu]]) is True  # another machine's CPU 0
        for junk in (None, [], [kernel], [kernel, cpu], [1, [cpu]], [kernel, "0"], "x" * 99):
            assert may_poll_beside(junk) is True
        if len(before) > 1:
            os.sched_setaffinity(0, before)
            assert may_poll_beside([kernel, [cpu]]) is True  # this side may run elsewhere
            assert may_poll_beside([kernel, sorted(before)]) is True
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.timeout(60)
def test_a_network_worker_that_cannot_read_a_command_says_so_and_exits():
    """A command a network worker refuses (a peer that skipped the sender's check) ends
    it, with the reason on its stderr: it said "its reply link to the controller is
    gone" (UntrustedValueError is a ConnectionError), and only with logging on."""
    import subprocess
    import sys

    cmd_r, cmd_w = os.pipe()
    reply_r, reply_w = os.pipe()
    argv = [sys.executable, "-m", "disco_core.worker", "--worker-id", "1", "--num-workers", "2",
            "--cmd-fd", str(cmd_r), "--reply-fd", str(reply_w), "--untrusted"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DISCO_LOG_LEVEL"}
    proc = subprocess.Popen(argv, pass_fds=(cmd_r, reply_w), stderr=subprocess.PIPE, env=env, text=True)  # fmt: skip
    os.close(cmd_r)
    os.close(reply_w)
    try:
        costly = wire_values.encode_for_network((protocol.CALL_PACKED, 2, 1, ([set()] * 100_000,)))  # fmt: skip
        protocol.write_frame(cmd_w, costly)
        assert proc.wait(30) == 3
        err = proc.stderr.read()
        assert "disco worker 1: exiting: a command from the controller could not be read" in err, (
            err
        )
        assert "more memory in containers" in err and "reply link" not in err, err
    finally:
        proc.kill()
        proc.wait()
        os.close(cmd_w)
        os.close(reply_r)


def test_the_sender_refuses_or_mends_what_a_receiver_refuses_whatever_the_size():
    """Headers of at most 2 KiB are not rebuilt by the sender, and a receiver refused
    some of them: keys sharing a hash, an empty string scalar (``<U0``), a time without
    a unit, ``np.str_`` itself. A remote worker sent one exited (outside check 58)."""
    colliding = {2.0 ** (61 * k): None for k in range(-8, 9)}
    colliding.update({i + 0.5: None for i in range(20)})  # > 32 keys: checked
    header, _ = wire_values.encode_for_network(list(range(5)))
    assert len(header) < 2048
    for bad, words in (
        (colliding, "keys of one hash value"),
        (set(colliding), "keys of one hash value"),
        (np.timedelta64(5), "time without a unit"),
        (np.zeros(2, "M8"), "time without a unit"),
    ):
        with pytest.raises(disco.DiscoValueError, match=words):
            wire_values.encode_for_network([bad])
    # a larger dict is not checked by the encoder (+75 % on a dict of 100,000 keys) but by
    # the sender's rebuild of its header, over 2 KiB
    step = (1 << 61) - 1
    big = {i * step: 0 for i in range(-4, 5)} | {i: 0 for i in range(1000)}
    frame = wire_values.encode_for_network([big])
    assert len(frame[0]) > 2048
    with pytest.raises(disco.DiscoValueError, match="keys of one hash value"):
        wire_values.check_rebuildable(frame)
    for fine in (np.str_(""), np.bytes_(b""), np.zeros(2, "U0"), np.dtype("U"), np.dtype("S"),
                 np.str_, np.bytes_, np.array(["NaT"], "M8"), np.timedelta64(5, "s")):  # fmt: skip
        header, buffers = wire_values.encode_for_network([fine])
        (back,) = wire_values.decode_untrusted(header, buffers)
        if isinstance(fine, np.ndarray):
            assert np.array_equal(back, fine) or np.isnat(back).all() and np.isnat(fine).all()
        else:
            assert back == fine
