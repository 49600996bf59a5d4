"""Seeded fuzzing of the core parsers a peer reaches before (or without) authentication.

Every parser must either return a value or raise one of its documented errors,
never hang, crash the process or allocate what a peer merely declared. The
plugins fuzz their own handshakes on top of these (plugins/*/tests/test_fuzz*.py).
"""

from __future__ import annotations

import os
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_core import wire_values
from disco_core.errors import FrameLimitError, IntegrityError, UntrustedValueError
from disco_core.net.framing import PREFIX, FrameReader
from disco_core.net.io import SocketTransport
from disco_core.net.protect import SealedTransport
from disco_core.net.security import Handshake

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=300,
    derandomize=True,  # seeded: the same cases in every CI run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _feed(data: bytes):
    """A reader over ``data`` followed by end of stream."""
    r, w = os.pipe()
    os.write(w, data) if data else None
    os.close(w)
    return r


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=512),
        st.builds(
            lambda h, n, f, rest: PREFIX.pack(h, n, f) + rest,
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1),
            st.binary(max_size=256),
        ),
    )
)
def test_frame_reader_never_trusts_declared_sizes(data):
    r = _feed(data)
    try:
        FrameReader(r, max_frame=1 << 20).read()
    except (EOFError, FrameLimitError):
        pass
    finally:
        os.close(r)


@FUZZ
@given(st.binary(max_size=2048))
def test_decode_untrusted_only_returns_or_refuses(data):
    for header in (data, wire_values.MAGIC + data):  # the second reaches the parser
        try:
            wire_values.decode_untrusted(header, [bytearray(16)])
        except UntrustedValueError:
            pass


_PLAIN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.complex_numbers(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.lists(kids, max_size=5).map(tuple)
        | st.dictionaries(st.text(max_size=5) | st.integers(), kids, max_size=5)
    ),
    max_leaves=30,
)


@FUZZ
@given(_PLAIN)
def test_the_network_format_gives_back_what_it_was_given(value):
    out = wire_values.decode_untrusted(*wire_values.encode_for_network(value))
    assert out == value and type(out) is type(value)


import numpy as np  # noqa: E402

from disco_core.errors import DiscoError  # noqa: E402

_UNITS = ["", "[s]", "[ns]", "[D]", "[generic]"]
_NUMPY = st.one_of(
    st.sampled_from(["<U", "|S"]).flatmap(
        lambda kind: st.integers(0, 3).flatmap(
            lambda n: st.text(max_size=n).map(
                lambda t, kind=kind, n=n: np.array(
                    t if kind == "<U" else t.encode("utf-8", "ignore")[:n], f"{kind}{n}"
                )[()]
            )
        )
    ),
    st.builds(
        lambda t, n: np.array(["NaT", n], "m8" + t), st.sampled_from(_UNITS), st.integers(-5, 5)
    ),  # fmt: skip
    st.builds(lambda t: np.array(["NaT"], "M8" + t), st.sampled_from(_UNITS)),
    st.builds(
        lambda u, n: np.timedelta64(n, u) if u else np.timedelta64(n),
        st.sampled_from(["", "s", "ms"]),
        st.integers(-5, 5),
    ),  # fmt: skip
    st.sampled_from([np.str_, np.bytes_, np.dtype("U"), np.dtype("S"), np.dtype("M8"), np.float16]),
    st.lists(st.text(max_size=3), max_size=4).map(lambda xs: np.array(xs, dtype=str)),
    st.integers(0, 40).map(
        lambda n: {(i * ((1 << 61) - 1)) if i < 10 else i: None for i in range(n)}
    ),  # fmt: skip
    st.integers(0, 40).map(
        lambda n: (
            {2.0 ** (61 * k) for k in range(-min(n, 8), min(n, 9))} | {i + 0.5 for i in range(n)}
        )
    ),  # fmt: skip
)
_SENDABLE = st.recursive(
    _PLAIN | _NUMPY,
    lambda kids: st.lists(kids, max_size=4) | st.lists(kids, max_size=4).map(tuple),
    max_leaves=12,
)


@FUZZ
@given(_SENDABLE)
def test_what_the_sender_lets_go_the_receiver_takes(value):
    """The sender refuses at the call (a DiscoError) what a network receiver would refuse,
    or the receiver rebuilds it: a value in between ended a remote worker (outside check
    58 found keys of one hash value, ``np.str_("")``, a time without a unit, ``np.str_``)."""
    try:
        frame = wire_values.encode_for_network(value)
        wire_values.check_rebuildable(frame)
    except DiscoError:
        return
    wire_values.decode_untrusted(*frame)  # must not raise


@FUZZ
@given(_PLAIN, st.data())
def test_a_cut_or_changed_network_frame_is_refused_or_is_data(value, data):
    """A frame cut short or with one byte changed is refused, or rebuilds plain data."""
    header, _ = wire_values.encode_for_network(value)
    at = data.draw(st.integers(0, len(header) - 1))
    for bad in (header[:at], header[:at] + bytes([header[at] ^ 0xFF]) + header[at + 1 :]):
        try:
            wire_values.decode_untrusted(bad)
        except UntrustedValueError:
            pass


@FUZZ
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=4), st.data())
def test_sealed_transport_refuses_every_change(records, data):
    """Any change to the sealed byte stream is refused; an unchanged stream passes."""
    c = Handshake(b"token", "client", b"fuzz")
    s = Handshake(b"token", "server", b"fuzz")
    c.bind(b"a", b"b")
    s.bind(b"a", b"b")
    wire = bytearray()

    class Capture:
        def send_parts(self, parts):
            for p in parts:
                wire.extend(bytes(memoryview(p).cast("B")))

    tx = SealedTransport(Capture(), c.keys())
    for rec in records:
        tx.send_parts([rec])
    original = bytes(wire)
    pos = data.draw(st.integers(0, len(original) - 1))
    flip = data.draw(st.integers(1, 255))
    mutated = bytearray(original)
    mutated[pos] ^= flip
    a, b = socket.socketpair()
    try:
        a.sendall(bytes(mutated))
        a.shutdown(socket.SHUT_WR)
        rx = SealedTransport(SocketTransport(b), s.keys(), max_record=1 << 16)
        got = bytearray()
        view = memoryview(bytearray(4096))
        with pytest.raises((IntegrityError, FrameLimitError, EOFError)):
            while True:
                n = rx.recv_into(view)
                if not n:
                    break
                got += view[:n]
        # never the whole stream: a changed stream is refused before its end is handed over
        assert len(got) < len(b"".join(records)) or bytes(got) != b"".join(records)
    finally:
        a.close()
        b.close()


def test_sealed_stream_unchanged_passes():
    c = Handshake(b"token", "client", b"fuzz")
    s = Handshake(b"token", "server", b"fuzz")
    c.bind(b"a", b"b")
    s.bind(b"a", b"b")
    a, b = socket.socketpair()
    try:
        tx = SealedTransport(SocketTransport(a), c.keys())
        rx = SealedTransport(SocketTransport(b), s.keys())
        tx.send_parts([b"one"])
        tx.send_parts([struct.pack("<I", 7)])
        buf = bytearray(7)
        got = 0
        while got < 7:
            got += rx.recv_into(memoryview(buf)[got:])
        assert bytes(buf) == b"one" + struct.pack("<I", 7)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("dtype", ["<U2", ">U2"])
@pytest.mark.parametrize("shape", [(), (3,), (40_000,)])  # a scalar, inline, out of band
def test_a_string_past_the_last_code_point_is_refused(dtype, shape):
    """NumPy builds a string array from any bytes; a character past U+10FFFF failed
    only when read (a SystemError, out of the decoder's refusals: an outside check)."""
    import numpy as np

    value = np.full(shape, "ab", dtype) if shape else np.array("ab", dtype)[()]
    header, buffers = wire_values.encode_for_network(("reply", value))
    good = wire_values.decode_untrusted(header, buffers)[1]
    assert np.all(good == value) and (not shape or good.dtype == np.dtype(dtype))
    # (a NumPy scalar is in native order whatever it was made from)
    order = "little" if dtype[0] == "<" or not shape else "big"
    a, bad = (ord("a")).to_bytes(4, order), (0x110000).to_bytes(4, order)
    if buffers:
        buffers = [bytearray(buffers[0])]
        buffers[0][-8:-4] = bad
    else:
        at = bytes(header).rindex(a)
        header = bytes(header)[:at] + bad + bytes(header)[at + 4 :]
    with pytest.raises(UntrustedValueError, match="past U\\+10FFFF"):
        wire_values.decode_untrusted(header, buffers)


def test_a_frame_costs_a_bounded_multiple_of_its_size_in_memory():
    """Headers of empty sets, or of 0-d arrays, made 47 and 29 times their size in
    memory (outside checks): containers, strings, bytes and arrays may take at most
    ``_BUDGET_PER_BYTE`` bytes per header byte; ordinary values (up to about 19 times)
    still cross."""
    import numpy as np

    for costly in ([frozenset()] * 100_000, [np.array(True)] * 100_000):
        header, buffers = wire_values.encode_for_network(costly)
        with pytest.raises(UntrustedValueError, match="more memory in containers"):
            wire_values.decode_untrusted(header, buffers)
    for fine in (
        [frozenset()] * 100,  # within the floor
        {f"key{i}": i for i in range(100_000)},
        [{"a": 1, "b": (2, 3)}] * 10_000,
        {i: (i, "x") for i in range(10_000)},
        [{"a": i, "b": True} for i in range(10_000)],  # (refused by an earlier budget)
        {"a": [{"k": None}] * 500},
        {i: {i} for i in range(10_000)},
        set(range(100_000)),  # 19 times its header in memory: it must cross all the same
        {f"k{i}" for i in range(100_000)},
        [f"name {i}" for i in range(100_000)],
        [(i, None, "x") for i in range(100_000)],
    ):
        header, buffers = wire_values.encode_for_network(fine)
        assert wire_values.decode_untrusted(header, buffers) == fine
    arrays = [np.arange(i % 7, dtype=np.float32) for i in range(2_000)]
    header, buffers = wire_values.encode_for_network(arrays)
    back = wire_values.decode_untrusted(header, buffers)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back))


@pytest.mark.parametrize("code", [b"<M8", b"<m8"])
def test_a_time_without_a_unit_is_nat_or_refused(code):
    """NumPy builds a unitless datetime64 or timedelta64 holding any value, and printing
    it fails later (an outside check): only NaT crosses."""
    import numpy as np

    head = wire_values.MAGIC + bytes([wire_values.T_ARRAY, len(code)]) + code
    head += bytes([1]) + struct.pack("<Q", 2) + bytes([0, 0])
    for body in (struct.pack("<qq", 1, 2), struct.pack("<qq", np.iinfo(np.int64).min, 5)):
        with pytest.raises(UntrustedValueError, match="without a unit that is not NaT"):
            wire_values.decode_untrusted(head + body)
    scalar = wire_values.MAGIC + bytes([wire_values.T_SCALAR, len(code)]) + code
    with pytest.raises(UntrustedValueError, match="not NaT"):
        wire_values.decode_untrusted(scalar + struct.pack("<q", 5))
    nat = wire_values.decode_untrusted(head + struct.pack("<qq", *[np.iinfo(np.int64).min] * 2))
    assert np.isnat(nat).all() and repr(nat)


@pytest.mark.parametrize("code", [b"<M8[0s]", b"<m8[0ns]", b"|M8[0Y]"])
def test_a_time_unit_of_zero_is_refused(code):
    """A datetime64 of unit ``[0s]`` is built, then fails when compared or printed
    (OverflowError: an outside check)."""
    head = wire_values.MAGIC + bytes([wire_values.T_SCALAR, len(code)]) + code
    with pytest.raises(UntrustedValueError, match="bad dtype"):
        wire_values.decode_untrusted(head + struct.pack("<q", 5))
