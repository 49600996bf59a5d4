"""The tagged value encoding alone (``wire.encode`` / ``wire.decode``), no sockets.

The decoder is the first code that reads a peer's bytes on every request, so it is
checked as an attacker would use it: any value round-trips exactly, every strict
prefix of a valid encoding and any random bytes end in a ``ProtocolError`` (never
another exception), and nesting is bounded.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_rpc import wire
from disco_rpc.errors import ProtocolError
from disco_rpc.protocol import MAX_DEPTH

pytestmark = pytest.mark.timeout(120)

SEEDED = settings(
    max_examples=300,
    derandomize=True,  # the same cases in every CI run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too (T_BIGINT)
    | st.floats(allow_nan=False)
    | st.complex_numbers(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40)
    | st.binary(min_size=wire.INLINE_BYTES, max_size=wire.INLINE_BYTES + 3)  # out of band
    | st.sampled_from(["float32", "int8", "uint64", "complex128"]).map(
        lambda d: np.arange(5, dtype=d).reshape(5, 1)
    )
    | st.just(())  # inline in a container (a request's frees)
    # remote objects: a client's carry no info (decoded inline in a container)
    | st.builds(
        wire.HandleRef,
        st.sampled_from([wire.HandleRef.FUNC, wire.HandleRef.MODULE, wire.HandleRef.TENSOR]),
        st.integers(0, 2**64 - 1),
        st.none() | st.text(max_size=5),
    )
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.tuples(inner, inner)
        | st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.integers() | st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=20,
)


def _round_trip(value):
    meta, bufs = wire.encode(value)
    lens = [wire._buffer_size(b) for b in bufs]
    out, fills, has_bytes = wire.decode(bytes(meta), lens)
    assert [i for i, _ in fills] == list(range(len(bufs)))
    for (_i, view), buf in zip(fills, bufs):
        view[:] = memoryview(buf).cast("B")  # what Conn.recv reads into them
    return wire._freeze(out) if has_bytes else out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and (a == b).all()  # fmt: skip
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, wire.HandleRef):
        return (a.kind, a.hid, a.info) == (b.kind, b.hid, b.info)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


@SEEDED
@given(_values)
def test_every_value_round_trips_exactly(value):
    assert _same(_round_trip(value), value)


@SEEDED
@given(_values)
def test_every_strict_prefix_is_a_protocol_error(value):
    meta = bytes(wire.encode(value)[0])
    lens = [wire._buffer_size(b) for b in wire.encode(value)[1]]
    for cut in range(len(meta)):
        with pytest.raises(ProtocolError):
            wire.decode(meta[:cut], lens)


@SEEDED
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_a_protocol_error(data):
    try:
        wire.decode(data, (8, 8))
    except ProtocolError:
        pass  # the only exception a peer's bytes may cause


@pytest.mark.parametrize(
    "name", [b",ool", b"(" + b"9" * 5000 + b",)i4", b"[(]", b"\xff", b"i4," * 4000]
)
def test_a_dtype_name_numpy_cannot_parse_is_a_protocol_error(name):
    """An attacker check: NumPy parses a name with a comma as Python, and a SyntaxError
    escaped the decoder (a tracker's link thread died of it, a server dropped the
    session instead of answering ProtocolError)."""
    meta = bytes(wire.encode(np.dtype("int8"))[0])
    head = meta[: len(meta) - len(b"int8") - 4]  # the tag; then a u32 length, the name
    with pytest.raises(ProtocolError, match="bad dtype"):
        wire.decode(head + len(name).to_bytes(4, "little") + name, ())


def test_buffer_lengths_may_be_any_sequence_or_iterable():
    meta, bufs = wire.encode((np.arange(3, dtype="int8"), bytes(wire.INLINE_BYTES)))
    lens = [wire._buffer_size(b) for b in bufs]
    for given_lens in (lens, tuple(lens), iter(lens), np.array(lens)):
        value, fills, _ = wire.decode(bytes(meta), given_lens)
        assert [i for i, _ in fills] == [0, 1]
    with pytest.raises(ProtocolError):
        wire.decode(bytes(meta), iter(lens[:1]))


def test_handles_are_resolved_by_the_callback():
    ref = wire.HandleRef(wire.HandleRef.FUNC, 7, "f")
    meta = bytes(wire.encode(((), (ref, (1, None))))[0])
    seen = []
    value, _, _ = wire.decode(meta, (), lambda r: seen.append((r.kind, r.hid, r.info)) or "obj")
    assert value == ((), ("obj", (1, None)))
    assert seen == [(wire.HandleRef.FUNC, 7, "f")]


def test_a_call_request_decodes_as_sent():
    """A call's request, ``(frees, (function, args))``, takes the decoder's inline steps
    (an empty tuple, a handle without info, ints): the callback still sees each handle,
    and every strict prefix is still refused."""
    fn = wire.HandleRef(wire.HandleRef.FUNC, 3)
    for frees in ((), (5, 6)):
        meta = bytes(wire.encode((frees, (fn, (1, (), None, fn))))[0])
        seen: list = []

        def resolve(r, seen=seen):
            seen.append((r.kind, r.hid, r.info))
            return "f"

        value, _, _ = wire.decode(meta, (), resolve)
        assert value == (frees, ("f", (1, (), None, "f")))
        assert seen == [(wire.HandleRef.FUNC, 3, None)] * 2
        for cut in range(len(meta)):
            with pytest.raises(ProtocolError):
                wire.decode(meta[:cut], (), lambda r: "f")


def _general(meta: bytes, lens):
    """What the decoder's general path makes of ``meta`` (the call request's shortcut
    bypassed), or the exception type it raises."""
    r = wire._Reads(lens, None)
    try:
        value, end = wire._value(meta, 0, 0, r)
    except ProtocolError:
        return ProtocolError
    except Exception:  # (decode turns these into ProtocolError)
        return ProtocolError
    if end != len(meta) or (lens and not all(r.used)):
        return ProtocolError
    return value


@SEEDED
@given(_values, st.data())
def test_the_call_shortcut_decodes_as_the_general_path(args, data):
    """``decode`` takes a shortcut for ``((), (handle, args))``; every such request, and
    every byte of it changed or cut, decodes to what the general path makes of it."""
    fn = wire.HandleRef(wire.HandleRef.FUNC, data.draw(st.integers(0, 2**64 - 1)))
    meta, bufs = wire.encode(((), (fn, args)))
    lens = [wire._buffer_size(b) for b in bufs]
    meta = bytes(meta)
    cases = [meta, meta[: data.draw(st.integers(0, len(meta)))]]
    at = data.draw(st.integers(0, len(meta) - 1))
    cases.append(meta[:at] + bytes([data.draw(st.integers(0, 255))]) + meta[at + 1 :])
    for case in cases:
        want = _general(case, lens)
        try:
            got = wire.decode(case, lens)[0]
        except ProtocolError:
            got = ProtocolError
        if want is ProtocolError or got is ProtocolError:
            assert got is want
        else:  # (buffers are not filled here: their destinations are compared)
            assert _skeleton(got) == _skeleton(want)


@SEEDED
@given(st.integers(-(2**63), 2**63 - 1) | st.none(), st.binary(min_size=1, max_size=1), st.binary(min_size=9, max_size=9))  # fmt: skip
def test_the_scalar_shortcuts_encode_and_decode_as_the_general_path(value, one, nine):
    """A result that is an int or None is encoded, and a 1- or 9-byte value decoded,
    without the general path's steps: the same bytes, the same values, the same refusals."""
    out: bytearray = bytearray()
    wire._enc(value, out, [], None, 0)
    meta, bufs = wire.encode(value)
    assert (bytes(meta), bufs, type(meta)) == (bytes(out), [], bytearray)
    for case in (bytes(meta), one, nine, bytes([wire.T_INT]) + nine[1:], bytes([wire.T_NONE])):
        want = _general(case, ())
        try:
            got = wire.decode(case, ())[0]
        except ProtocolError:
            got = ProtocolError
        assert got == want and type(got) is type(want)


def _skeleton(v):
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape)
    if isinstance(v, bytearray):
        return ("buffer", len(v))
    if isinstance(v, wire.HandleRef):
        return ("handle", v.kind, v.hid, v.info)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *map(_skeleton, v))
    if isinstance(v, dict):
        return ("dict", *((_skeleton(k), _skeleton(x)) for k, x in v.items()))
    if isinstance(v, float) and math.isnan(v):
        return ("nan",)
    return (type(v).__name__, v)


class _Remote:
    """A client's remote object: travels as its handle."""

    def __init__(self, ref):
        self._rpc_ref = ref


@SEEDED
@given(_values, st.integers(0, 2**64 - 1), st.none() | st.text(max_size=5))
def test_a_call_is_encoded_as_the_general_path_encodes_it(args, hid, info):
    fn = _Remote(wire.HandleRef(wire.HandleRef.FUNC, hid, info))
    for call_args in ((args,), (args, fn), ()):
        want_meta, want_bufs = wire.encode(((), (fn, call_args)))
        meta, bufs = wire.encode_call(fn, call_args)
        assert bytes(meta) == bytes(want_meta)
        assert [bytes(b) for b in bufs] == [bytes(b) for b in want_bufs]
    assert bytes(wire.encode_call(7, (1,))[0]) == bytes(wire.encode(((), (7, (1,))))[0])


def test_nesting_is_bounded_both_ways():
    deep: object = 1
    for _ in range(MAX_DEPTH + 2):
        deep = (deep,)
    with pytest.raises(ValueError, match="nested too deeply"):
        wire.encode(deep)
    # a peer's frame nested past the bound: refused, not a RecursionError
    meta = (bytes([wire.T_TUPLE]) + (1).to_bytes(4, "little")) * (MAX_DEPTH + 5) + bytes([wire.T_NONE])  # fmt: skip
    with pytest.raises(ProtocolError, match="nested too deeply"):
        wire.decode(meta)


def test_trailing_and_unreferenced_buffers_are_refused():
    meta = bytes(wire.encode(5)[0])
    with pytest.raises(ProtocolError, match="trailing"):
        wire.decode(meta + b"\x00")
    with pytest.raises(ProtocolError, match="no value refers"):
        wire.decode(meta, (4,))


def test_dict_keys_that_share_a_hash_are_refused_in_linear_time():
    """An attacker check: int hashes are not randomised, so keys k*(2**61-1)+1 all hash
    to 1 and a dict of them decoded in quadratic time (1 MiB: 18 s of a tracker's CPU)."""
    flood = {k * (2**61 - 1) + 1: None for k in range(4000)}
    meta, bufs = wire.encode(flood)
    with pytest.raises(ProtocolError, match="keys of one hash value"):
        wire.decode(bytes(meta), [wire._buffer_size(b) for b in bufs])
    plain = {k: k for k in range(4000)}  # distinct hashes: as before
    meta, bufs = wire.encode(plain)
    assert wire.decode(bytes(meta), [wire._buffer_size(b) for b in bufs])[0] == plain
