"""Tracing a worker's CCL operations on the CCL instance itself (while a trace runs).

Every CCL operation is wrapped by its class (``disco_core.ccl.base``), and that
wrapper records the operation through ``ctx.tracer`` when a trace is on. It takes
any arguments, so it packs them (``*args, **kwargs``), unpacks them again for the
operation, and reads the call's attributes from the tuple: ~1.9 us a collective
on a 2-vCPU VM, more than the whole of a small collective's own Python.

While a trace runs, :func:`install` therefore puts one recording function per
operation on the worker's CCL instance, with the operation's own parameters
(``CCL.allreduce(src, dst, op, in_group)`` and so on): it finds the call's names
and seq counter in one lookup keyed by the buffer's type and dtype and the other
arguments, hands over, runs the class's unwrapped operation and writes one record
(~0.3 us). :func:`uninstall` takes them off again, so an untraced CCL is
untouched. A CCL made while the trace runs (``init_ccl`` after ``DISCO_TRACE`` or
``trace=`` started it) gets them when it is made. An operation whose parameters
differ from the base class's keeps the class's recording wrapper.

The records are the :class:`~disco_core.tracing.recorder.Recorder`'s own
(``K_COLLECTIVE``): the same as the class's wrapper writes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..ccl.base import CCL, WAITING_OPS, cut_short
from .recorder import FAILED, K_COLLECTIVE, OK, Recorder, now

__all__ = ["install", "uninstall"]

#: Entries per operation's cache of names (one per kind of call; the cap bounds a
#: program that makes unboundedly many kinds, e.g. many peers).
_CACHE_CAP = 4096


def install(ccl: Any, rec: Recorder) -> list[str]:
    """Put recording operations on ``ccl`` (an instance); return the names put there."""
    ctx = getattr(ccl, "ctx", None)
    if getattr(ctx, "hand_over", None) is None or not isinstance(ccl, CCL):
        return []  # a stand-in: the class's wrapper records, through ctx.tracer
    done = []
    for name in WAITING_OPS:
        wrapped = getattr(type(ccl), name, None)
        raw = getattr(wrapped, "__wrapped__", None)
        if raw is None or not _same_parameters(raw, getattr(CCL, name)):
            continue
        try:
            setattr(ccl, name, _MAKERS[name](ccl, raw, rec, name))
        except AttributeError:  # __slots__: the class's wrapper records
            continue
        done.append(name)
    return done


def uninstall(ccl: Any, names: list[str]) -> None:
    """Take the recording operations :func:`install` put on ``ccl`` off again."""
    for name in names:
        ccl.__dict__.pop(name, None)


def _same_parameters(op: Callable, base: Callable) -> bool:
    def shape(f: Callable) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    try:
        return shape(op) == shape(base)
    except (TypeError, ValueError):
        return False


def _lookup(rec: Recorder, ccl: Any, name: str, cache: dict) -> Callable:
    """The miss path: the call's ``(name id, attrs id, seq counter)``, cached under
    ``key``, and its bytes (read as the class wrapper reads them)."""

    def miss(key: tuple, args: tuple) -> tuple[tuple, int]:
        (ids, counter), nbytes = rec._new_call(ccl, name, args, {}, None)
        call = (ids[0], ids[1], counter)
        if len(cache) < _CACHE_CAP:
            try:
                cache[key] = call
            except TypeError:  # an unhashable argument: not cached
                pass
        return call, nbytes

    return miss


# One maker per shape of parameters. Each recording function is the hot path of a
# traced collective, every step counted: a lookup (a miss is the slow path), the
# communicator's seq, two clock reads and one record. Its key holds the buffer's
# type, so a cached call's buffer is known to have an integer ``nbytes``. The makers
# repeat those steps rather than share a helper on purpose: one more call, with its
# arguments packed again, would cost ~0.15 us a collective (a third of the hook).


def _make_allreduce(ccl: Any, raw: Callable, rec: Recorder, name: str) -> Callable:
    cache: dict[tuple, tuple] = {}
    miss = _lookup(rec, ccl, name, cache)
    ctx, ring, pack, cap, clock = ccl.ctx, rec._ring, rec._pack, rec.capacity, now

    def allreduce(src: Any, dst: Any, op: str, in_group: bool) -> None:
        try:
            key = (type(src), src.dtype, op, in_group)
            call = cache[key]
            nbytes = src.nbytes
        except (KeyError, TypeError, AttributeError):
            key = (type(src), getattr(src, "dtype", None), op, in_group)
            call, nbytes = miss(key, (src, dst, op, in_group))
        counter = call[2]
        seq = counter[0]
        counter[0] = seq + 1
        ended = OK
        t0 = clock()
        try:
            ctx.hand_over()
            return raw(ccl, src, dst, op, in_group)
        except BaseException as exc:  # Ctrl-C in worker 0's: see cut_short
            ended = FAILED
            cut_short(ccl, name, exc)
            raise
        finally:
            t1 = clock()
            n = rec.count
            pack(ring, (n % cap) * 64, K_COLLECTIVE, call[0], t0, t1, seq, nbytes, ended, call[1])  # fmt: skip
            rec.count = n + 1

    return allreduce


def _make_two_buffers(ccl: Any, raw: Callable, rec: Recorder, name: str) -> Callable:
    """allgather and gather (sized by ``src``), broadcast and scatter (by ``dst``: the
    root's ``src`` is its own)."""
    cache: dict[tuple, tuple] = {}
    miss = _lookup(rec, ccl, name, cache)
    ctx, ring, pack, cap, clock = ccl.ctx, rec._ring, rec._pack, rec.capacity, now
    by_dst = name in ("broadcast", "scatter")

    def collective(src: Any, dst: Any, in_group: bool) -> None:
        buf = dst if by_dst else src
        try:
            key = (type(buf), buf.dtype, in_group)
            call = cache[key]
            nbytes = buf.nbytes
        except (KeyError, TypeError, AttributeError):
            key = (type(buf), getattr(buf, "dtype", None), in_group)
            call, nbytes = miss(key, (src, dst, in_group))
        counter = call[2]
        seq = counter[0]
        counter[0] = seq + 1
        ended = OK
        t0 = clock()
        try:
            ctx.hand_over()
            return raw(ccl, src, dst, in_group)
        except BaseException as exc:  # Ctrl-C in worker 0's: see cut_short
            ended = FAILED
            cut_short(ccl, name, exc)
            raise
        finally:
            t1 = clock()
            n = rec.count
            pack(ring, (n % cap) * 64, K_COLLECTIVE, call[0], t0, t1, seq, nbytes, ended, call[1])  # fmt: skip
            rec.count = n + 1

    collective.__name__ = collective.__qualname__ = name
    return collective


def _make_point_to_point(ccl: Any, raw: Callable, rec: Recorder, name: str) -> Callable:
    cache: dict[tuple, tuple] = {}
    miss = _lookup(rec, ccl, name, cache)
    ctx, ring, pack, cap, clock = ccl.ctx, rec._ring, rec._pack, rec.capacity, now

    def point_to_point(buf: Any, peer: int) -> None:
        try:
            key = (type(buf), buf.dtype, peer)
            call = cache[key]
            nbytes = buf.nbytes
        except (KeyError, TypeError, AttributeError):
            key = (type(buf), getattr(buf, "dtype", None), peer)
            call, nbytes = miss(key, (buf, peer))
        counter = call[2]
        seq = counter[0]
        counter[0] = seq + 1
        ended = OK
        t0 = clock()
        try:
            ctx.hand_over()
            return raw(ccl, buf, peer)
        except BaseException as exc:  # Ctrl-C in worker 0's: see cut_short
            ended = FAILED
            cut_short(ccl, name, exc)
            raise
        finally:
            t1 = clock()
            n = rec.count
            pack(ring, (n % cap) * 64, K_COLLECTIVE, call[0], t0, t1, seq, nbytes, ended, call[1])  # fmt: skip
            rec.count = n + 1

    point_to_point.__name__ = point_to_point.__qualname__ = name
    return point_to_point


def _make_barrier(ccl: Any, raw: Callable, rec: Recorder, name: str) -> Callable:
    cache: dict[tuple, tuple] = {}
    miss = _lookup(rec, ccl, name, cache)
    ctx, ring, pack, cap, clock = ccl.ctx, rec._ring, rec._pack, rec.capacity, now

    def barrier(in_group: bool = False) -> None:
        try:
            key = (in_group,)
            call = cache[key]
        except (KeyError, TypeError):
            call = miss((in_group,), (in_group,))[0]
        counter = call[2]
        seq = counter[0]
        counter[0] = seq + 1
        ended = OK
        t0 = clock()
        try:
            ctx.hand_over()
            return raw(ccl, in_group)
        except BaseException as exc:  # Ctrl-C in worker 0's: see cut_short
            ended = FAILED
            cut_short(ccl, name, exc)
            raise
        finally:
            t1 = clock()
            n = rec.count
            pack(ring, (n % cap) * 64, K_COLLECTIVE, call[0], t0, t1, seq, 0, ended, call[1])
            rec.count = n + 1

    return barrier


_MAKERS: dict[str, Callable[[Any, Callable, Recorder, str], Callable]] = {
    "allreduce": _make_allreduce,
    "allgather": _make_two_buffers,
    "gather": _make_two_buffers,
    "broadcast": _make_two_buffers,
    "scatter": _make_two_buffers,
    "send": _make_point_to_point,
    "recv": _make_point_to_point,
    "barrier": _make_barrier,
}
