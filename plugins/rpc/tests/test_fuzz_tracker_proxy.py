"""Seeded fuzzing of what the tracker and the proxy parse from a peer (issue 13).

The proxy's first hello is read before any authentication (a client's is never
authenticated by the proxy at all); a token-less tracker serves anyone's
requests. Whatever arrives, the parsers must end in a bounded number of bytes,
raise nothing, and leave the tracker's state consistent.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_rpc import auth, wire
from disco_rpc import tracker as T
from disco_rpc.proxy import PROXY_SERVER_KEY, _FirstHello

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=300,
    derandomize=True,  # seeded: the same cases in every CI run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_HEAD = struct.Struct("<8sII")
#: The most the first hello may read: the header, the longest key, the nonce, a MAC.
_MOST = _HEAD.size + auth.MAX_KEY_BYTES + 32 + 32


def _drive(machine: _FirstHello, data: bytes) -> tuple[int, bytes]:
    """Feed ``data`` as the accept loop does (exactly ``want`` bytes a step)."""
    used, out = 0, b""
    while machine.want and used + machine.want <= len(data):
        assert 0 < machine.want <= _MOST
        chunk = data[used : used + machine.want]
        used += len(chunk)
        out += machine.step(chunk)
    return used, out


def _hellos():
    """Hellos that are nearly right: the magic, any version, a key length near the bounds."""
    keys = st.one_of(
        st.just(PROXY_SERVER_KEY.encode()),
        st.binary(max_size=64),
        st.just(b"k" * auth.MAX_KEY_BYTES),
    )
    return st.builds(
        lambda magic, version, key, declared, nonce, tail: (
            _HEAD.pack(magic, version, len(key) if declared is None else declared)
            + key
            + nonce
            + tail  # fmt: skip
        ),
        st.sampled_from([auth.MAGIC, b"DISCORPX", b"\0" * 8]),
        st.integers(0, 2**32 - 1),
        keys,
        st.one_of(st.none(), st.integers(0, 2**32 - 1)),
        st.binary(min_size=0, max_size=40),
        st.binary(max_size=64),
    )


@FUZZ
@given(st.one_of(st.binary(max_size=5000), _hellos()), st.sampled_from([None, b"proxy-token"]))
def test_proxy_first_hello(data, token):
    m = _FirstHello(token)
    used, out = _drive(m, data)
    assert used <= _MOST
    if m.want:  # it waits for more: only while the data ran out
        assert used + m.want > len(data)
        assert not m.ok
        return
    if m.ok and not m.backend:  # a client's hello, kept as it came, to forward
        assert m.raw == data[:used] and out == b""
        assert m.hello is not None and len(m.hello[1]) <= auth.MAX_KEY_BYTES
    if m.backend:
        assert m.hello[1] == PROXY_SERVER_KEY.encode()
        assert out[:8] == auth.MAGIC  # the backend is answered as by a server
        if token is not None:
            # nobody proves a token by chance: the MAC stage needs the server's fresh nonce
            assert not m.ok


# --------------------------------------------------------------------------- tracker requests
def _values():
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.text(max_size=300),
        st.binary(max_size=64),
    )
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=5).map(tuple), max_leaves=12)


def _requests():
    op = st.integers(0, 12)
    key = st.sampled_from(["k", "other", "é" * 130, "x" * (T.MAX_KEY_BYTES + 1)])
    put = st.tuples(key, st.sampled_from(["127.0.0.1", "", "h" * 300]), st.integers(-5, 70000), st.one_of(st.none(), st.text(max_size=8)))  # fmt: skip
    req = st.tuples(key, st.integers(-(2**70), 2**70))
    value = st.one_of(_values(), put, req, st.text(max_size=40))
    return st.lists(st.tuples(op, value), max_size=40)


class _Sock:
    def shutdown(self, how):
        pass


class _Transport:
    sock = _Sock()


class _Conn:
    """A link's connection: replays ``frames``, then the peer closes; records what is sent."""

    def __init__(self, frames):
        self.frames = list(frames)
        self.sent = []
        self.t = _Transport()

    def recv(self):
        if not self.frames:
            raise EOFError("the peer closed the connection")
        op, value = self.frames.pop(0)
        return wire.REQUEST, op, value

    def send(self, kind, op, value):
        wire.encode(value)  # what is sent must be encodable
        self.sent.append((kind, op, value))

    def close(self):
        pass


@FUZZ
@given(_requests(), st.sampled_from([T.REGISTRANT_KEY, T.CLIENT_KEY]))
def test_tracker_requests(frames, role):
    state = T.TrackerState(match_timeout=10.0)
    other = T._Link(_Conn([]), ("127.0.0.1", 2), T.REGISTRANT_KEY)
    with state.lock:  # a server of key "k" registered by someone else
        state.put(other, "k", ("127.0.0.1", 9000))
    conn = _Conn(frames)
    link = T._Link(conn, ("127.0.0.1", 1), role)
    T._serve_link(link, state)  # returns at the end of the frames, whatever they were
    for kind, _op, _value in conn.sent:
        assert kind in (wire.REPLY, wire.ERROR)
    # the link is gone: none of its requests or servers is left
    assert not link.waiting
    assert all(w.link is not link for q in state.queues.values() for _p, _s, w in q)
    assert all(e.link is other for e in state.servers.values())
    assert set(state.by_key) <= {"k"}
    s = state.summary()
    assert wire.frame_size(*wire.encode(s)) < 4096
    assert all(len(k.encode("utf-8", "surrogatepass")) <= T.MAX_KEY_BYTES for k in s["queue_info"])


@FUZZ
@given(
    st.sampled_from([auth.VERSION, auth.VERSION + 1, 0]),
    st.binary(min_size=32, max_size=32),
    st.binary(max_size=80),
    st.sampled_from([None, b"proxy-token"]),
)
def test_proxy_backend_hello(version, nonce, rest, token):
    """A backend's hello is answered as a server answers; no MAC but the right one passes."""
    kb = PROXY_SERVER_KEY.encode()
    data = _HEAD.pack(auth.MAGIC, version, len(kb)) + kb + nonce + rest
    m = _FirstHello(token)
    used, out = _drive(m, data)
    assert m.backend and out[:8] == auth.MAGIC and used <= _MOST
    if version != auth.VERSION:
        assert m.want == 0 and not m.ok
    elif token is None:
        assert m.want == 0 and m.ok and used == len(data) - len(rest)
    else:
        assert not m.ok  # a random MAC, or still waiting for one
