"""The tagged codec of the frames that cross a network link: nothing is unpickled.

Pipes from a process this one started carry pickles (:func:`disco_core.protocol.encode`):
fast, and as general as Python. A frame that crosses a socket (the ``socket``,
``rpc`` and ``mpi`` channels, both ways) is encoded by :func:`encode_for_network`
and rebuilt by :func:`decode_untrusted`, a parser of a small tagged format that
can only make data:

- ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
  ``bytearray``, and ``tuple``, ``list``, ``dict``, ``set`` and ``frozenset`` of them;
- NumPy arrays (numeric, bool, ``ml_dtypes``, fixed-width strings, dates, and
  object arrays of the values above), NumPy scalars, dtypes and scalar types;
- register references (:class:`~disco_core.protocol.RegRef`; a session's
  handles travel as one), and the types registered with :func:`register_wire_type`
  (devices and worker errors by the core, the shm CCL's layout by it).

A subclass of a built-in container or number travels as that built-in (a
``namedtuple`` as a ``tuple``, an ``IntEnum`` as an ``int``); any other type is a
:class:`~disco_core.errors.DiscoTypeError` at the sender, before a byte leaves.

Arrays of :data:`~disco_core.protocol.OOB_THRESHOLD` bytes or more travel as the
frame's out-of-band buffers: written from the array's memory, read into the
receiver's (a ``bytearray`` that becomes the array's memory), never copied on the way.

Header layout: ``0xDC 0x01`` (magic and version), then one value; each value is
a tag byte and its fields (little endian). Every count and length a peer declares is
checked against the bytes that are really there before anything is made of it;
containers nest at most :data:`MAX_DEPTH` deep; a dict or set whose keys share a
hash more than a few times is refused (int hashes are not randomised, and such
keys would make the rebuild quadratic).
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .device import Device, as_dtype
from .errors import (
    DiscoTypeError,
    DiscoValueError,
    UntrustedValueError,
    WorkerDiedError,
    WorkerError,
)
from .protocol import _REF_TYPES, OOB_THRESHOLD, Frame, RegRef, _check_owner

__all__ = [
    "MAGIC",
    "MAX_DEPTH",
    "encode_for_network",
    "decode_untrusted",
    "check_rebuildable",
    "register_wire_type",
]

#: The first two bytes of every header (magic and version). A frame of another
#: format, such as a pickle from an older release, is refused by name, not parsed.
MAGIC = b"\xdc\x01"
#: Deepest nesting of containers (and registered types' fields) either side accepts.
MAX_DEPTH = 100

(
    T_NONE, T_FALSE, T_TRUE, T_INT, T_BIGINT, T_FLOAT, T_COMPLEX, T_STR, T_BYTES,
    T_BYTEARRAY, T_TUPLE, T_LIST, T_DICT, T_SET, T_FROZENSET, T_ARRAY, T_OBJARRAY,
    T_SCALAR, T_DTYPE, T_SCALAR_TYPE, T_REGREF, T_EXT,
) = range(22)  # fmt: skip

#: Where an array's data is: in the header after its shape, or an out-of-band buffer.
_INLINE, _OUT_OF_BAND = 0, 1

_q = struct.Struct("<q")
_d = struct.Struct("<d")
_dd = struct.Struct("<dd")
_I = struct.Struct("<I")
_Q = struct.Struct("<Q")
_TQ = struct.Struct("<Bq")
_TI = struct.Struct("<BI")
_TD = struct.Struct("<Bd")
_TDD = struct.Struct("<Bdd")
_q_from = _q.unpack_from
_d_from = _d.unpack_from
_dd_from = _dd.unpack_from
_I_from = _I.unpack_from
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


# --------------------------------------------------------------------------- registry
class _WireType:
    __slots__ = ("name", "to_plain", "from_plain", "subclasses")

    def __init__(self, name: bytes, to_plain: Callable, from_plain: Callable, subclasses: bool) -> None:  # fmt: skip
        self.name, self.to_plain, self.from_plain = name, to_plain, from_plain
        self.subclasses = subclasses


_BY_TYPE: dict[type, _WireType] = {}
_BY_NAME: dict[bytes, _WireType] = {}


def register_wire_type(
    cls: type,
    name: str,
    to_plain: Callable[[Any], Any],
    from_plain: Callable[[Any], Any],
    *,
    subclasses: bool = False,
) -> None:
    """Let values of ``cls`` cross a network link.

    Parameters
    ----------
    cls : type
        The type.
    name : str
        Its name on the wire (ASCII, at most 255 characters), the same on both sides.
    to_plain : callable
        ``to_plain(obj)``: a value this codec already carries (a tuple of plain values).
    from_plain : callable
        ``from_plain(value)``: ``obj`` again. It receives what a peer sent, so it must
        check every field and build data only; ``TypeError`` and ``ValueError`` (and
        ``DiscoError``) it raises are refusals of the frame.
    subclasses : bool
        Instances of subclasses of ``cls`` travel the same way (rebuilt as ``cls``).
    """
    raw = name.encode("ascii")
    if not 0 < len(raw) < 256:
        raise DiscoValueError(f"wire type name {name!r} must have 1 to 255 characters")
    if raw in _BY_NAME and _BY_NAME[raw] is not _BY_TYPE.get(cls):
        raise DiscoValueError(f"wire type name {name!r} is already registered")
    entry = _WireType(raw, to_plain, from_plain, subclasses)
    _BY_TYPE[cls] = entry
    _BY_NAME[raw] = entry


def _wire_type_of(t: type) -> _WireType | None:
    entry = _BY_TYPE.get(t)
    if entry is not None:
        return entry
    for base in t.__mro__[1:]:
        entry = _BY_TYPE.get(base)
        if entry is not None and entry.subclasses:
            return entry
    return None


# --------------------------------------------------------------------------- dtypes
#: Standard NumPy dtypes travel by ``dtype.str`` (byte order kept); ml_dtypes' by name.
_DTYPE_STR = re.compile(r"[<>|][biufcSUMm][0-9]{1,9}(\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,40}")
_DTYPE_CODES: dict[np.dtype, bytes] = {}
_DTYPES: dict[bytes, np.dtype] = {}
_MAX_CACHED = 4096


def _dtype_code(dt: np.dtype) -> bytes:
    code = _DTYPE_CODES.get(dt)
    if code is not None:
        return code
    if dt.type.__module__.startswith("ml_dtypes") and dt.fields is None:
        # by name: most are kind "V", but float8_e5m2 is "f" with dt.str "<f1", which
        # NumPy cannot parse back
        code = dt.name.encode()
    elif dt.fields is None and dt.kind in "biufcSUMm":
        code = dt.str.encode()
    else:
        raise DiscoTypeError(
            f"cannot send dtype {dt} over a network link: numeric, bool, ml_dtypes, "
            "fixed-width string and datetime dtypes cross one"
        )
    if len(_DTYPE_CODES) < _MAX_CACHED:
        _DTYPE_CODES[dt] = code
    return code


def _parse_dtype(code: bytes, data: bool = True) -> np.dtype:
    """The dtype of ``code``; ``data``: of values that come with it (an array, a scalar),
    so never of size 0 (a dtype or a scalar type alone may be ``<U0``: ``np.str_``)."""
    dt = _DTYPES.get(code)
    if dt is not None:
        return dt
    text = code.decode("ascii")
    try:
        if _DTYPE_STR.fullmatch(text):
            dt = np.dtype(text)
        elif _DTYPE_NAME.fullmatch(text):
            dt = as_dtype(text)  # bfloat16, float8_e4m3fn...: ml_dtypes
            if not dt.type.__module__.startswith("ml_dtypes"):
                raise ValueError("not an ml_dtypes name")
        else:
            raise ValueError("not a dtype code")
    except (TypeError, ValueError, SyntaxError, OverflowError) as exc:
        # (DiscoTypeError is a TypeError; NumPy's parser may raise SyntaxError)
        raise _Malformed(f"bad dtype {text[:40]!r}: {exc}") from None
    if not data and dt.itemsize == 0 and dt.kind in "SU":
        return dt  # (not cached: the cache is of dtypes that may carry data)
    if dt.hasobject or dt.itemsize == 0 or (dt.kind in "mM" and np.datetime_data(dt)[1] == 0):
        # (a time unit of 0 seconds, say, fails only when its values are compared or shown)
        raise _Malformed(f"bad dtype {text[:40]!r}")
    if len(_DTYPES) < _MAX_CACHED:
        _DTYPES[code] = dt
    return dt


# --------------------------------------------------------------------------- encoding
def encode_for_network(obj: Any) -> Frame:
    """Encode ``obj`` for a peer that rebuilds it with :func:`decode_untrusted`.

    Returns
    -------
    header : bytes
        The tagged header.
    buffers : list of memoryview
        The out-of-band buffers (views of the arrays' memory), as
        :func:`disco_core.protocol.encode` returns them.

    Raises
    ------
    DiscoTypeError
        ``obj`` holds a value of a type that cannot cross a network link (named).
    DiscoValueError
        ``obj`` is nested more than :data:`MAX_DEPTH` deep, or holds a handle of
        another session.
    """
    out = bytearray(MAGIC)
    bufs: list = []
    _enc(obj, out, bufs, 0)
    return bytes(out), bufs


def _refuse(v: Any) -> DiscoTypeError:
    t = type(v)
    return DiscoTypeError(
        f"cannot send {t.__module__}.{t.__qualname__} over a network link: only plain values "
        "(None, bool, int, float, complex, str, bytes, tuples, lists, dicts, sets), NumPy "
        "arrays, scalars and dtypes, devices and the session's handles cross one"
    )


def _enc(v: Any, out: bytearray, bufs: list, depth: int) -> None:
    t = type(v)
    if t is tuple or t is list:  # commands are tuples of ints, strs and tuples
        if depth >= MAX_DEPTH:
            raise DiscoValueError(f"value nested more than {MAX_DEPTH} deep for a network link")
        out += _TI.pack(T_TUPLE if t is tuple else T_LIST, len(v))
        for x in v:
            tx = type(x)
            if tx is int and _INT64_MIN <= x <= _INT64_MAX:
                out += _TQ.pack(T_INT, x)
            elif x is None:
                out.append(T_NONE)
            elif tx is RegRef:
                out += _TQ.pack(T_REGREF, x.reg_id)
            else:
                _enc(x, out, bufs, depth + 1)
    elif t is int:
        if _INT64_MIN <= v <= _INT64_MAX:
            out += _TQ.pack(T_INT, v)
        else:
            b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            out += _TI.pack(T_BIGINT, len(b))
            out += b
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        out += _TI.pack(T_STR, len(b))
        out += b
    elif v is None:
        out.append(T_NONE)
    elif t is bool:
        out.append(T_TRUE if v else T_FALSE)
    elif t is float:
        out += _TD.pack(T_FLOAT, v)
    elif t is RegRef:
        out += _TQ.pack(T_REGREF, v.reg_id)
    elif t in _REF_TYPES:
        _check_owner(v)  # a handle of another session would read this one's register
        out += _TQ.pack(T_REGREF, v.reg_id)
    elif t is np.ndarray:
        _enc_array(v, out, bufs, depth)
    elif t is bytes or t is bytearray:
        out += _TI.pack(T_BYTES if t is bytes else T_BYTEARRAY, len(v))
        out += v
    elif t is complex:
        out += _TDD.pack(T_COMPLEX, v.real, v.imag)
    elif t is dict or t is set or t is frozenset:
        if depth >= MAX_DEPTH:
            raise DiscoValueError(f"value nested more than {MAX_DEPTH} deep for a network link")
        if _HASH_CHECK_FROM < len(v) <= _MOST_KEYS_UNDER_CHECK:
            _check_sendable_keys(v)  # (in a header the sender rebuilds: checked there)
        if t is dict:
            out += _TI.pack(T_DICT, len(v))
            for k, x in v.items():
                _enc(k, out, bufs, depth + 1)
                _enc(x, out, bufs, depth + 1)
        else:
            out += _TI.pack(T_SET if t is set else T_FROZENSET, len(v))
            for k in v:
                _enc(k, out, bufs, depth + 1)
    else:
        _enc_other(v, t, out, bufs, depth)


def _enc_other(v: Any, t: type, out: bytearray, bufs: list, depth: int) -> None:
    """Registered types, NumPy's scalars and dtypes, and subclasses of the built-ins."""
    entry = _wire_type_of(t)
    if entry is not None:
        if depth >= MAX_DEPTH:
            raise DiscoValueError(f"value nested more than {MAX_DEPTH} deep for a network link")
        out.append(T_EXT)
        out.append(len(entry.name))
        out += entry.name
        _enc(entry.to_plain(v), out, bufs, depth + 1)
    elif isinstance(v, np.generic):
        arr = _sendable(np.asarray(v))
        code = _dtype_code(arr.dtype)
        out.append(T_SCALAR)
        out.append(len(code))
        out += code
        out += arr.tobytes()
    elif isinstance(v, np.dtype):
        code = _dtype_code(v)
        out.append(T_DTYPE)
        out.append(len(code))
        out += code
    elif isinstance(v, type) and issubclass(v, np.generic):
        code = _dtype_code(np.dtype(v))
        out.append(T_SCALAR_TYPE)
        out.append(len(code))
        out += code
    elif isinstance(v, np.ndarray):  # a subclass (np.matrix, a masked array's data)
        _enc_array(np.asarray(v), out, bufs, depth)
    elif isinstance(v, bool):
        out.append(T_TRUE if v else T_FALSE)
    elif isinstance(v, int):  # IntEnum, ...
        _enc(int(v), out, bufs, depth)
    elif isinstance(v, float):
        _enc(float(v), out, bufs, depth)
    elif isinstance(v, complex):
        _enc(complex(v), out, bufs, depth)
    elif isinstance(v, str):
        _enc(str(v), out, bufs, depth)
    elif isinstance(v, (bytes, memoryview)):
        _enc(bytes(v), out, bufs, depth)
    elif isinstance(v, bytearray):
        _enc(bytearray(v), out, bufs, depth)
    elif isinstance(v, tuple):  # a namedtuple
        _enc(tuple(v), out, bufs, depth)
    elif isinstance(v, list):
        _enc(list(v), out, bufs, depth)
    elif isinstance(v, dict):  # OrderedDict, defaultdict
        _enc(dict(v), out, bufs, depth)
    elif isinstance(v, (set, frozenset)):
        _enc((set if isinstance(v, set) else frozenset)(v), out, bufs, depth)
    else:
        raise _refuse(v)


def _enc_array(a: np.ndarray, out: bytearray, bufs: list, depth: int) -> None:
    dt = a.dtype
    if dt.hasobject:
        if dt.fields is not None:
            raise DiscoTypeError("cannot send a structured array with objects over a network link")
        if depth >= MAX_DEPTH:
            raise DiscoValueError(f"value nested more than {MAX_DEPTH} deep for a network link")
        out += _TI.pack(T_OBJARRAY, a.ndim)
        for d in a.shape:
            out += _Q.pack(d)
        _enc(a.reshape(-1).tolist() if a.ndim else [a.item()], out, bufs, depth + 1)
        return
    if dt.kind in "SUmM":
        a = _sendable(a)
    code = _dtype_code(a.dtype)
    order = 0
    if not a.flags.c_contiguous:
        if a.flags.f_contiguous:
            order = 1  # sent as is, rebuilt in Fortran order (as a pickle does)
        else:
            a = np.ascontiguousarray(a)  # a strided view: its elements, packed once
    out.append(T_ARRAY)
    out.append(len(code))
    out += code
    out.append(a.ndim)
    for d in a.shape:
        out += _Q.pack(d)
    out.append(order)
    flat = (a.T if order else a).reshape(-1).view(np.uint8)
    if flat.nbytes < OOB_THRESHOLD:
        out.append(_INLINE)
        out += flat.data
    else:
        out.append(_OUT_OF_BAND)
        out += _I.pack(len(bufs))
        bufs.append(flat.data)


def _sendable(a: np.ndarray) -> np.ndarray:
    """``a`` as a receiver accepts it, or a Disco error saying why not.

    Refused here because :func:`decode_untrusted` refuses them (a remote worker that
    cannot read a command cannot skip it, and ends: an outside check): a time without a
    unit that is not NaT, a character past U+10FFFF. An empty string dtype (``<U0``,
    ``|S0``: ``np.str_("")``) is widened to one character, which reads back as ``''``.
    """
    dt = a.dtype
    if dt.kind in "SU" and dt.itemsize == 0:
        return a.astype(f"{dt.byteorder if dt.byteorder in '<>' else ''}{dt.kind}1")
    if dt.kind in "UmM" and a.size:
        try:
            _checked_text(a.reshape(-1))
        except _Malformed as exc:
            raise DiscoValueError(
                f"cannot send {dt} data over a network link: {exc} (a receiver refuses it)"
                + ("; give the time a unit, e.g. np.timedelta64(5, 's')" if dt.kind in "mM" else "")
            ) from None
    return a


def _check_sendable_keys(keys: Any) -> None:
    """The receiver's check of a large dict's or set's keys, made by the sender."""
    try:
        _check_hashes(keys)
    except _Malformed as exc:
        raise DiscoValueError(
            f"cannot send this dict or set over a network link: {exc} (a receiver refuses "
            "keys that share a hash: they make a dict take quadratic time)"
        ) from None


# --------------------------------------------------------------------------- decoding
class _Malformed(ValueError):
    """A frame this codec does not accept (the message says why)."""


class _OverBudget(_Malformed):
    """A well-formed frame whose values would take more memory than its size allows."""


class _Reads:
    """The out-of-band buffers of one frame, each taken by exactly one array."""

    __slots__ = ("buffers", "used", "budget")

    def __init__(self, buffers: Sequence[Any], budget: int = 0) -> None:
        self.buffers = buffers
        self.used = [False] * len(buffers)
        #: bytes of memory this frame's values may still take (see ``_BUDGET_PER_BYTE``)
        self.budget = budget

    def charge(self, obj: Any) -> Any:
        """``obj`` (a container or an array just made), once its memory is within the budget."""
        self.spend(sys.getsizeof(obj))
        return obj

    def spend(self, nbytes: int) -> None:
        """Count ``nbytes`` of memory about to be made against the frame's budget."""
        self.budget -= nbytes
        if self.budget < 0:
            raise _OverBudget(
                "more memory in containers, strings and arrays than a frame of its size "
                f"may make ({_BUDGET_PER_BYTE} bytes per byte of its header)"
            )

    def take(self, idx: int, nbytes: int) -> Any:
        if idx >= len(self.buffers) or self.used[idx]:
            raise _Malformed(f"bad buffer index {idx}")
        buf = self.buffers[idx]
        if memoryview(buf).nbytes != nbytes:
            raise _Malformed(
                f"buffer {idx} holds {memoryview(buf).nbytes} bytes, expected {nbytes}"
            )
        self.used[idx] = True
        return buf


#: The memory a frame's containers, strings, bytes, arrays and registered types may
#: take, per byte of its header (plus :data:`_BUDGET_FLOOR`). An empty set is 216
#: bytes of memory and 5 of a frame, a 0-d array about 250 and 9, a dict's entry of a
#: register and True about 240 and 10: headers of them cost 47, 29 and 28 times their
#: size (outside checks). What is not counted (numbers, None, registers) costs at
#: most about 5 times its bytes. 24, not 16: ordinary values take up to about 19 times
#: their header (a set of 100,000 ints, a list of small dicts with str keys), and they
#: must cross (a receiver refuses a frame past its budget: a remote worker then exits).
_BUDGET_PER_BYTE = 24
_BUDGET_FLOOR = 1 << 16
#: What an array costs besides its data (the decoder makes two array objects).
_ARRAY_COST = 256
#: What a dict's pair costs while the dict is made (a 2-tuple in a list), and an entry
#: of the table that checks the keys' hashes: spent before they are made (a frame of
#: them is refused before), given back once the dict is (a frame of many small dicts
#: is not charged as if all their pairs lived at once: an outside check).
_PAIR_COST = 72
_HASH_CHECK_COST = 48
#: What a set's key costs while the set is made (its place in a list).
_KEY_COST = 8

#: Dicts and sets with more keys than this are checked for keys that share a hash.
_HASH_CHECK_FROM = 32
_MAX_SHARED_HASH = 8


def _check_hashes(keys: Any) -> None:
    # sorted, not counted in a dict: a list of the hashes is half the memory
    hashes = sorted(map(hash, keys))
    run = 1
    for i in range(1, len(hashes)):
        if hashes[i] == hashes[i - 1]:
            run += 1
            if run > _MAX_SHARED_HASH:
                raise _Malformed(f"more than {_MAX_SHARED_HASH} keys of one hash value")
        else:
            run = 1


def _span(meta: bytes, p: int, n: int) -> int:
    e = p + n
    if e > len(meta):
        raise _Malformed("truncated value")
    return e


def _count(meta: bytes, p: int) -> int:
    """A container's declared length, which cannot exceed the bytes left (one each, at least)."""
    n = _I_from(meta, p)[0]
    if n > len(meta) - p - 4:
        raise _Malformed("container longer than its frame")
    return n


def _value(meta: bytes, p: int, depth: int, r: _Reads) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise _Malformed(f"value nested more than {MAX_DEPTH} deep")
    tag = meta[p]
    p += 1
    if tag == T_INT:
        return _q_from(meta, p)[0], p + 8
    if tag == T_TUPLE or tag == T_LIST:
        n = _count(meta, p)
        p += 4
        r.budget -= 64 + 8 * n  # the container and its pointers (spend(), inline: hot)
        if r.budget < 0:
            r.spend(0)
        items = []
        for _ in range(n):
            t = meta[p]  # plain ints, None and registers inline: most of a command
            if t == T_INT:
                items.append(_q_from(meta, p + 1)[0])
                p += 9
            elif t == T_NONE:
                items.append(None)
                p += 1
            elif t == T_REGREF:
                items.append(RegRef(_q_from(meta, p + 1)[0]))
                p += 9
            else:
                v, p = _value(meta, p, depth + 1, r)
                items.append(v)
        return (tuple(items) if tag == T_TUPLE else items), p
    if tag == T_STR:
        e = _span(meta, p + 4, _I_from(meta, p)[0])
        return r.charge(meta[p + 4 : e].decode("utf-8", "surrogatepass")), e
    if tag == T_NONE:
        return None, p
    if tag == T_REGREF:
        return RegRef(_q_from(meta, p)[0]), p + 8
    if tag == T_FALSE:
        return False, p
    if tag == T_TRUE:
        return True, p
    if tag == T_FLOAT:
        return _d_from(meta, p)[0], p + 8
    if tag == T_ARRAY:
        r.spend(_ARRAY_COST)  # (its data: inline, counted in the header; else out of band)
        return _array(meta, p, r)
    if tag == T_BYTES or tag == T_BYTEARRAY:
        e = _span(meta, p + 4, _I_from(meta, p)[0])
        r.spend(64 + e - p)
        b = meta[p + 4 : e]
        return (b if tag == T_BYTES else bytearray(b)), e
    if tag == T_DICT:
        n = _count(meta, p)
        p += 4
        # what the making takes (the pairs, the hash check's table) is spent before it is
        # made and given back once the dict is: only the dict's own memory stays counted
        passing = n * (_PAIR_COST + (_HASH_CHECK_COST if n > _HASH_CHECK_FROM else 0))
        r.spend(passing)
        pairs = []
        for _ in range(n):
            k, p = _value(meta, p, depth + 1, r)
            x, p = _value(meta, p, depth + 1, r)
            pairs.append((k, x))
        if n > _HASH_CHECK_FROM:
            _check_hashes([k for k, _ in pairs])  # before the dict is built
        d = dict(pairs)
        r.budget += passing
        return r.charge(d), p
    if tag == T_SET or tag == T_FROZENSET:
        n = _count(meta, p)
        p += 4
        passing = n * (_KEY_COST + (_HASH_CHECK_COST if n > _HASH_CHECK_FROM else 0))
        r.spend(passing)  # (as for a dict)
        keys = []
        for _ in range(n):
            k, p = _value(meta, p, depth + 1, r)
            keys.append(k)
        if n > _HASH_CHECK_FROM:
            _check_hashes(keys)
        made = set(keys) if tag == T_SET else frozenset(keys)
        r.budget += passing
        return r.charge(made), p
    if tag == T_COMPLEX:
        re_, im = _dd_from(meta, p)
        return complex(re_, im), p + 16
    if tag == T_BIGINT:
        e = _span(meta, p + 4, _I_from(meta, p)[0])
        return int.from_bytes(meta[p + 4 : e], "little", signed=True), e
    if tag == T_SCALAR:
        e = _span(meta, p + 1, meta[p])
        dt = _parse_dtype(meta[p + 1 : e])
        end = _span(meta, e, dt.itemsize)
        return r.charge(_checked_text(np.frombuffer(meta, dt, 1, e))[0].copy()), end
    if tag == T_DTYPE or tag == T_SCALAR_TYPE:
        e = _span(meta, p + 1, meta[p])
        dt = _parse_dtype(meta[p + 1 : e], data=False)
        return (dt if tag == T_DTYPE else dt.type), e
    if tag == T_OBJARRAY:
        r.spend(_ARRAY_COST)  # (its items: a list, counted as one)
        return _object_array(meta, p, depth, r)
    if tag == T_EXT:
        e = _span(meta, p + 1, meta[p])
        entry = _BY_NAME.get(meta[p + 1 : e])
        if entry is None:
            raise _Malformed(f"unknown type {meta[p + 1 : e][:40]!r}")
        fields, p = _value(meta, e, depth + 1, r)
        try:
            return r.charge(entry.from_plain(fields)), p
        except _Malformed:
            raise
        except Exception as exc:  # noqa: BLE001 - a registered type's check refused the fields
            raise _Malformed(f"bad {entry.name.decode()}: {type(exc).__name__}: {exc}") from None
    raise _Malformed(f"unknown value tag {tag}")


def _shape(meta: bytes, p: int, ndim: int) -> tuple[tuple[int, ...], int, int]:
    """An array's shape at ``meta[p:]``, its number of elements and where it ends."""
    if ndim > 64:
        raise _Malformed(f"array of {ndim} dimensions")
    e = _span(meta, p, 8 * ndim)
    shape = struct.unpack_from(f"<{ndim}Q", meta, p)
    count = 1
    for d in shape:
        count *= d
    return shape, count, e


def _array(meta: bytes, p: int, r: _Reads) -> tuple[np.ndarray, int]:
    e = _span(meta, p + 1, meta[p])
    dt = _parse_dtype(meta[p + 1 : e])
    shape, count, p = _shape(meta, e + 1, meta[e])
    order, where = meta[p], meta[p + 1]
    p += 2
    nbytes = count * dt.itemsize  # (a Python int: a declared shape cannot overflow it)
    if where == _INLINE:
        end = _span(meta, p, nbytes)
        flat = np.frombuffer(meta, dt, count, p).copy() if count else np.empty(0, dt)
    elif where == _OUT_OF_BAND:
        end = p + 4
        flat = np.frombuffer(r.take(_I_from(meta, p)[0], nbytes), dt)  # its memory, not a copy
    else:
        raise _Malformed("bad array storage")
    if order > 1:
        raise _Malformed("bad array order")
    return _checked_text(flat).reshape(shape, order="F" if order else "C"), end


_MAX_CODE_POINT = 0x10FFFF


def _checked_text(flat: np.ndarray) -> np.ndarray:
    """``flat`` (1-d), once a string array's characters are all code points, and a
    time array without a unit holds only NaT.

    NumPy builds such arrays from any bytes, but a character past U+10FFFF, or a
    unitless time that is not NaT, fails only when it is read or printed (a
    ``SystemError`` or ``ValueError``, far from the frame that brought it: outside
    checks).
    """
    dt = flat.dtype
    if dt.kind == "U" and flat.size:
        units = flat.view(np.dtype("u4").newbyteorder(dt.byteorder))
        if int(units.max()) > _MAX_CODE_POINT:
            raise _Malformed("a string with a character past U+10FFFF")
    elif dt.kind in "mM" and flat.size and np.datetime_data(dt)[0] == "generic":
        # a time without a unit is NaT or nothing: anything else fails when printed
        if not np.isnat(flat).all():
            raise _Malformed("a time without a unit that is not NaT")
    return flat


def _object_array(meta: bytes, p: int, depth: int, r: _Reads) -> tuple[np.ndarray, int]:
    shape, count, p = _shape(meta, p + 4, _I_from(meta, p)[0])
    items, p = _value(meta, p, depth + 1, r)
    if type(items) is not list or len(items) != count:
        raise _Malformed("object array whose items do not match its shape")
    arr = np.empty(count, dtype=object)
    for i, x in enumerate(items):  # one by one: a slice would broadcast items that are sequences
        arr[i] = x
    return arr.reshape(shape), p


#: Headers up to this size always rebuild within their budget (an empty set, the
#: dearest value per byte, costs 43 times its 5 bytes: a header of 2 KiB costs at most
#: about 88 KiB, under 24 x 2 KiB + the 64 KiB floor); larger ones are checked.
_REBUILD_CHECK_FROM = 2048


#: More distinct keys than this cannot fit in a header that is not rebuilt (a key takes 5
#: bytes at least, a tag and a length or a tag and 8 bytes, but for None, True and
#: False), so the encoder checks the keys' hashes only of dicts and sets up to this size:
#: a larger one is checked by the rebuild (checking every dict of 100,000 keys at the
#: encoder cost +75 % of encoding it).
_MOST_KEYS_UNDER_CHECK = _REBUILD_CHECK_FROM // 5 + 3


def check_rebuildable(frame: Frame) -> None:
    """Refuse a frame made by :func:`encode_for_network` that a receiver would refuse
    for the memory its values take (more than ``24`` bytes per byte of its header).

    A sender calls it before a command leaves (:func:`disco_core.spi.check_untrusted`):
    a remote worker that cannot read a command cannot skip it, and ends. Headers of
    at most 2 KiB pass at once; a larger one is rebuilt here, as the receiver would.

    Raises
    ------
    DiscoValueError
        The value takes too much memory for its encoded size (a long list of empty
        sets, say): it names the limit and what to send instead.
    """
    header, buffers = frame
    if len(header) <= _REBUILD_CHECK_FROM:
        return
    try:
        _rebuild(bytes(header), buffers)
    except _OverBudget:
        raise DiscoValueError(
            f"cannot send this value over a network link: rebuilt on the other side it would "
            f"take more than {_BUDGET_PER_BYTE} bytes of memory per byte of its encoded form "
            f"({len(header)} bytes), the limit that keeps a small message from taking much "
            "memory on its receiver (many empty sets or 0-d arrays in one value do); send "
            "the data as a NumPy array, or in smaller values"
        ) from None
    except _Malformed as exc:  # what the encoder does not check itself
        raise DiscoValueError(
            f"cannot send this value over a network link: a receiver would refuse it: {exc}"
        ) from None


def _rebuild(meta: bytes, buffers: Sequence[Any]) -> Any:
    r = _Reads(buffers, _BUDGET_PER_BYTE * len(meta) + _BUDGET_FLOOR)
    value, end = _value(meta, 2, 0, r)
    if end != len(meta):
        raise _Malformed("bytes after the value")
    if not all(r.used):
        raise _Malformed("buffers no value refers to")
    return value


def decode_untrusted(header: bytes | bytearray | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Rebuild a frame made by :func:`encode_for_network`; nothing is unpickled.

    Arrays that came out of band keep their buffer as memory (writable when the
    buffer is, as the ``bytearray`` a frame reader fills is).

    Raises
    ------
    UntrustedValueError
        The frame is not one of this codec's, is truncated or malformed, or names a
        type that is not registered.
    """
    meta = header if type(header) is bytes else bytes(header)
    if meta[:2] != MAGIC:
        raise UntrustedValueError(
            "refused a frame from a network peer: not a Disco network frame"
            + (" (a pickle: is the peer an older release of Disco?)" if meta[:1] == b"\x80" else "")
        )
    try:
        value = _rebuild(meta, buffers)
    except _Malformed as exc:
        raise UntrustedValueError(f"refused a malformed value from a network peer: {exc}") from None
    except (IndexError, struct.error):
        raise UntrustedValueError("refused a malformed value from a network peer: truncated value") from None  # fmt: skip
    except (UnicodeDecodeError, ValueError, TypeError, OverflowError, MemoryError) as exc:
        raise UntrustedValueError(
            f"refused a malformed value from a network peer ({type(exc).__name__}: {exc})"
        ) from None
    return value


# --------------------------------------------------------------------------- the core's types
def _device_from(fields: Any) -> Device:
    code, dev_id = fields
    if type(code) is not int or type(dev_id) is not int:
        raise TypeError("a device is two ints")
    return Device(code, dev_id)


def _worker_error_from(fields: Any) -> WorkerError:
    worker_id, exc_type, message, tb, others = fields
    if type(worker_id) is not int or not all(type(s) is str for s in (exc_type, message, tb)):
        raise TypeError("a worker error is an int, three strs and a list of worker errors")
    if type(others) is not list or not all(isinstance(e, WorkerError) for e in others):
        raise TypeError("a worker error's others must be worker errors")
    return WorkerError(worker_id, exc_type, message, tb, others)


def _died_from(fields: Any) -> WorkerDiedError:
    ids, reason, given_up = fields
    if type(ids) is not list or not all(type(i) is int for i in ids) or type(reason) is not str:
        raise TypeError("a worker death is a list of ints and a str")
    return WorkerDiedError(ids, reason, given_up=bool(given_up))


register_wire_type(Device, "Device", lambda d: (d.device_type_code, d.device_id), _device_from)
register_wire_type(
    WorkerError,
    "WorkerError",
    lambda e: (e.worker_id, e.exc_type, e.remote_message, e.remote_traceback, list(e.others)),
    _worker_error_from,
    subclasses=True,  # the typed ones made at run time (WorkerDiscoTypeError, ...)
)
register_wire_type(
    WorkerDiedError,
    "WorkerDiedError",
    lambda e: (list(e.worker_ids), e.reason, e.given_up),
    _died_from,
    subclasses=True,
)
