"""Descriptors of collective arguments, exchanged so every member agrees on errors.

Before moving data, every member of a collective publishes a small fixed-size
descriptor of its arguments (:func:`describe`); after exchanging them every member
runs the same :func:`check` on the same descriptors and therefore raises the same
:class:`~disco_core.errors.CCLError`, or none. Nobody waits for a peer that gave up.
Any CCL can reuse this: the ``shm`` CCL exchanges descriptors through shared
memory, an MPI CCL would allgather them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..device import as_dtype, dtype_name
from ..errors import CCLError, DiscoTypeError
from ..worker import MissingValue

__all__ = [
    "Desc",
    "describe",
    "describe_send",
    "describe_recv",
    "pack",
    "unpack",
    "check",
    "check_p2p",
    "p2p_order_lost",
    "flat_bytes",
    "DESC_BYTES",
    "MAX_NDIM",
]

#: The most dimensions a described array may have.
MAX_NDIM = 8
_FMT = struct.Struct("<ii q 32s q i 16s 8q q i 16s 8q q 120s")
#: Bytes in a packed descriptor (what each member sends its peers per collective).
DESC_BYTES = 512
assert _FMT.size <= DESC_BYTES


@dataclass
class Desc:
    """What one member passed to a collective.

    Attributes
    ----------
    status : int
        0: this member found nothing wrong; 1: it found ``error`` itself (a failed
        register, a strided array, an unknown ``op``): every member then raises it.
    error : str
        That problem, or "".
    op : str
        The operation, as :func:`check` knows it (see there); must agree across members.
    extra : int
        Op-specific (a peer id for point-to-point).
    src, dst : tuple or None
        ``(dtype name, shape, nbytes)`` of each array, or None where the member
        passed none (the non-roots' ``src`` of scatter and ``dst`` of gather may be
        None: :func:`check` allows exactly that).
    """

    status: int  # 0: fine; 1: this member found an error (see ``error``)
    error: str
    op: str  # "allreduce:sum", "allgather", ... (must agree across members)
    extra: int  # op-specific (peer id, ...)
    # (dtype name, shape, nbytes) or None when absent. Any: the checks index them once
    # need() has ruled None out, which a type checker cannot follow.
    src: Any
    dst: Any


def _array_info(x: Any, name: str) -> tuple[tuple | None, str]:
    if x is None:
        return None, ""
    if isinstance(x, MissingValue):
        return None, f"{name}: {x.reason}"
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
            try:
                shape, dtype, nbytes = tuple(x.shape), np.dtype(x.dtype), x.nbytes
            except Exception:
                return None, f"{name}: cannot read the array's shape and dtype"
            return (dtype_name(dtype), shape, nbytes), ""
        return None, f"{name} must be an array, got {type(x).__name__}"
    if x.ndim > MAX_NDIM:
        return None, f"{name} has {x.ndim} dimensions; collectives support at most {MAX_NDIM}"
    if x.dtype.hasobject or x.dtype.kind in "OUSMmV":
        # objects (pointers into this process), strings, dates and structured dtypes
        # are refused as worker arrays are (their names alone do not tell two apart:
        # every 64-byte structured dtype is "void512"); ml_dtypes' types pass
        try:
            as_dtype(x.dtype)
        except DiscoTypeError as exc:
            return None, f"{name}: {exc}"
    if not x.dtype.isnative:
        # the descriptors name dtypes ("float32" either way) and the data moves as bytes
        return None, (
            f"{name} is in the other byte order ({x.dtype.str!r}); collectives take arrays "
            f"in this machine's: arr.astype(arr.dtype.newbyteorder('='))"
        )
    return (dtype_name(x.dtype), tuple(x.shape), x.nbytes), ""


def describe(op: str, src: Any, dst: Any, extra: int = 0, error: str = "") -> Desc:
    """Describe one member's arguments; ``error`` is a problem the member found itself.

    Every member describes its call, the descriptors are exchanged (:func:`pack` /
    :func:`unpack`: :data:`DESC_BYTES` each), and every member runs :func:`check` on
    all of them. Check nothing locally before the exchange and raise nothing: put a
    problem this member sees (a failed register, an unknown op) into ``error``, so
    that every member raises it together and nobody waits for this one.
    """
    src_info, e1 = _array_info(src, "src")
    dst_info, e2 = _array_info(dst, "dst")
    if not error:
        error = e1 or e2
    if not error and isinstance(dst, np.ndarray) and not dst.flags.c_contiguous:
        error = "dst must be a C-contiguous array"
    if not error and isinstance(dst, np.ndarray) and not dst.flags.writeable:
        error = "dst is read-only"
    return Desc(1 if error else 0, error, op, extra, src_info, dst_info)


def describe_send(buf: Any, error: str = "") -> Desc:
    """The descriptor a point-to-point send puts in front of its message (its ``src``).

    A collective's ``None`` is an argument it does not use; a send's is a mistake (a
    register that holds nothing on this worker, e.g. a ``worker0_only`` one): an
    error in the descriptor, so that the receiver raises it too instead of waiting.
    """
    if buf is None and not error:
        error = _NOTHING.format("src")
    return describe("p2p", buf, None, error=error)


def describe_recv(buf: Any, error: str = "") -> Desc:
    """A point-to-point receive's own descriptor (its ``dst``), for :func:`check_p2p`;
    ``None`` is an error, as for :func:`describe_send` (the receiver still drains the
    message)."""
    if buf is None and not error:
        error = _NOTHING.format("dst")
    return describe("p2p", None, buf, error=error)


_NOTHING = "{} must be an array, got None (a register that holds nothing on this worker, e.g. a worker0_only one)"  # fmt: skip


def _pack_arr(info: tuple | None) -> tuple:
    if info is None:
        return (-1, b"", *([0] * MAX_NDIM), 0)
    dtype, shape, nbytes = info
    return (len(shape), dtype.encode()[:16], *shape, *([0] * (MAX_NDIM - len(shape))), nbytes)


def pack(d: Desc) -> bytes:
    """``d`` as :data:`DESC_BYTES` bytes (the op and error texts cut to 32 and 120 bytes)."""
    s = _pack_arr(d.src)
    t = _pack_arr(d.dst)
    return _FMT.pack(
        d.status, 0, d.extra, d.op.encode()[:32], 0,
        s[0], s[1], *s[2:2 + MAX_NDIM], s[-1],
        t[0], t[1], *t[2:2 + MAX_NDIM], t[-1],
        d.error.encode()[:120],
    ).ljust(DESC_BYTES, b"\0")  # fmt: skip


def unpack(raw: bytes | memoryview) -> Desc:
    """The :class:`Desc` that :func:`pack` made (a peer's bytes: nothing is unpickled)."""
    v = _FMT.unpack_from(raw)
    status, _, extra, op, _ = v[:5]

    def arr(i: int) -> tuple | None:
        ndim, dtype = v[i], v[i + 1]
        if ndim < 0:
            return None
        shape = tuple(v[i + 2 : i + 2 + ndim])
        return (dtype.rstrip(b"\0").decode(), shape, v[i + 2 + MAX_NDIM])

    src = arr(5)
    dst = arr(5 + 3 + MAX_NDIM)
    err = v[-1].rstrip(b"\0").decode(errors="replace")
    return Desc(status, err, op.rstrip(b"\0").decode(), extra, src, dst)


def _fmt(info: tuple | None) -> str:
    return "nothing" if info is None else f"{info[0]}{list(info[1])}"


def check(op: str, descs: Sequence[Desc], members: Sequence[int]) -> None:
    """Raise the same :class:`CCLError` on every member when the call is inconsistent.

    ``descs[i]`` belongs to global worker ``members[i]``; ``members[0]`` is the root.
    ``op`` is one of ``"allreduce:<op>"`` (``<op>`` in ``REDUCE_OPS``), ``"allgather"``,
    ``"broadcast"``, ``"scatter"``, ``"gather"``, ``"barrier"``; point-to-point calls use
    :func:`check_p2p`. The root-only buffers are checked on the root only (scatter's
    ``src``, gather's ``dst``, broadcast's ``src``). A mismatch of ``op`` comes first,
    then any member's own ``error``, then the arrays: every member raises the same.
    """
    name = op.split(":")[0]
    for w, d in zip(members, descs):
        if d.op != descs[0].op:  # (not ``op``: every member names the same two workers)
            raise CCLError(
                f"{name}: collective mismatch: worker {members[0]} called {descs[0].op}, worker {w} called {d.op}"
            )
    bad = [(w, d.error) for w, d in zip(members, descs) if d.status]
    if bad:
        text = "; ".join(f"worker {w}: {e}" for w, e in bad[:4])
        raise CCLError(f"{name} failed: {text}")
    n = len(members)
    root = descs[0]

    def same(attr: str, what: str, sel=lambda i: i) -> None:
        ref = sel(getattr(root, attr))
        for w, d in zip(members, descs):
            if sel(getattr(d, attr)) != ref:
                raise CCLError(
                    f"{name}: {what} differ across workers: worker {members[0]} has "
                    f"{_fmt(getattr(root, attr))}, worker {w} has {_fmt(getattr(d, attr))}"
                )

    def need(cond: bool, text: str) -> None:
        if not cond:
            raise CCLError(f"{name}: {text}")

    def dtype_size(info):
        return None if info is None else (info[0], info[2])

    if name == "barrier":
        return
    if name == "allreduce":
        for w, d in zip(members, descs):
            need(d.src is not None and d.dst is not None, f"worker {w} passed no src or dst array")
            need(
                d.src[:2] == d.dst[:2],
                f"worker {w}: dst {_fmt(d.dst)} does not match src {_fmt(d.src)}",
            )
        same("src", "src arrays")
        kind = np.dtype(_dtype(root.src[0])).kind
        if op.endswith(":avg"):
            need(
                kind != "b",
                f"op 'avg' needs a numeric dtype, got {root.src[0]} (bool has no average)",
            )
        return
    if name == "allgather":
        for w, d in zip(members, descs):
            need(d.src is not None and d.dst is not None, f"worker {w} passed no src or dst array")
            need(
                d.src[0] == d.dst[0],
                f"worker {w}: dst dtype {d.dst[0]} differs from src dtype {d.src[0]}",
            )
            need(
                d.dst[2] == n * d.src[2],
                f"worker {w}: dst {_fmt(d.dst)} must hold {n} x src {_fmt(d.src)}",
            )
        same("src", "src arrays")
        return
    if name == "broadcast":
        need(root.src is not None, f"worker {members[0]} (the root) passed no src array")
        for w, d in zip(members, descs):
            need(d.dst is not None, f"worker {w} passed no dst array")
            need(
                dtype_size(d.dst) == dtype_size(root.src),
                f"worker {w}: dst {_fmt(d.dst)} does not match the root's src {_fmt(root.src)}",
            )
        return
    if name == "scatter":
        need(root.src is not None, f"worker {members[0]} (the root) passed no src array")
        for w, d in zip(members, descs):
            need(d.dst is not None, f"worker {w} passed no dst array")
            need(
                d.dst[0] == root.src[0],
                f"worker {w}: dst dtype {d.dst[0]} differs from the root's src dtype {root.src[0]}",
            )
        same("dst", "dst arrays", lambda i: i and (i[0], i[2]))
        need(
            root.src[2] == n * root.dst[2],
            f"the root's src {_fmt(root.src)} must split into {n} pieces of dst {_fmt(root.dst)} (size not divisible or wrong)",
        )
        return
    if name == "gather":
        need(root.dst is not None, f"worker {members[0]} (the root) passed no dst array")
        for w, d in zip(members, descs):
            need(d.src is not None, f"worker {w} passed no src array")
            need(
                d.src[0] == root.dst[0],
                f"worker {w}: src dtype {d.src[0]} differs from the root's dst dtype {root.dst[0]}",
            )
        same("src", "src arrays", lambda i: i and (i[0], i[2]))
        need(
            root.dst[2] == n * root.src[2],
            f"the root's dst {_fmt(root.dst)} must hold {n} x src {_fmt(root.src)}",
        )
        return
    raise CCLError(f"unknown collective {op!r}")


def p2p_order_lost(sent_in: int, sender_failed: int, call: int, receiver_failed: int) -> str:
    """Which end's failure may have shifted a pair's order, for a receive of call
    ``call`` that meets a message sent in call ``sent_in``: ``"sender"``, ``"receiver"``
    or ``""`` (the message is this receive's). ``sender_failed`` and
    ``receiver_failed``: each end's last failed call then (0: none).

    Sends and receives pair in order, and a send or receive that a failed call skipped
    shifts it: the message may be another receive's when either end failed in a call
    from ``min(sent_in, call) - 1`` on (a send or receive of the same or an adjacent
    command may have been skipped). That holds for a message of the receive's own call
    too: in a pipeline that receives in each command what the command before sent, and
    sends the next, a skipped send left the next command's message in front (an outside
    check). Pairs further apart than adjacent commands are not told apart.
    """
    low = min(sent_in, call) - 1
    if sender_failed and sender_failed >= low:
        return "sender"
    if receiver_failed and receiver_failed >= low:
        return "receiver"
    return ""


def check_p2p(peer: int, theirs: Desc, mine: Desc) -> str:
    """Why a point-to-point message cannot be received (or ``""``).

    ``theirs`` is the descriptor the sender put in front of the message (its ``src``),
    ``mine`` the receiver's (its ``dst``). A receiver that gets a non-empty answer
    still takes the message off the wire before it raises, so the sender is freed.
    """
    if theirs.status:
        return f"worker {peer} failed to send: {theirs.error}"
    if mine.status:
        return mine.error
    if theirs.src[0] != mine.dst[0] or theirs.src[2] != mine.dst[2]:
        return (
            f"worker {peer} sent {theirs.src[0]}{list(theirs.src[1])} but the receive buffer is "
            f"{mine.dst[0]}{list(mine.dst[1])}"
        )
    return ""


def _dtype(name: str) -> np.dtype:
    from ..device import as_dtype

    return as_dtype(name)


def flat_bytes(arr: np.ndarray) -> np.ndarray:
    """A flat ``uint8`` view of a C-contiguous array (no copy)."""
    return arr.reshape(-1).view(np.uint8)
