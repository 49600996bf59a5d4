"""Worker-side functions of the CCL conformance kit (``ccl_kit.*`` global functions).

:class:`disco_core.testing.ccl_kit.CCLContract` imports this module on every worker
with ``session.import_python_module("disco_core.testing.ccl_funcs")``. The functions
reach the CCL only through the ``disco.*`` built-ins, exactly as user code does, so
every CCL is driven the same way.

:func:`make_input` is also called on the controller: it builds the same
deterministic array a worker builds, so the kit computes its NumPy reference
without moving any data.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from ..builtins import collective
from ..device import as_dtype
from ..registry import get_global_func, register_func
from ..worker import current

__all__ = ["make_input", "FUNCS_MODULE"]

#: The module name the kit passes to ``import_python_module``.
FUNCS_MODULE = "disco_core.testing.ccl_funcs"


# Functions that pass registers on to a collective are marked ``@collective``: a
# register that failed on this worker arrives as a MissingValue, so the worker still
# takes part and its peers fail with it instead of waiting.


def _reg(name: str):
    def deco(func):
        register_func(f"ccl_kit.{name}", func, override=True)
        return func

    return deco


def _on_device(arr: Any) -> Any:
    """``arr`` on this worker's default device: a GPU CCL's workers get GPU arrays."""
    device = current().device
    if arr is None or not device.is_gpu or not isinstance(arr, np.ndarray):
        return arr
    import cupy

    with cupy.cuda.Device(device.device_id):
        return cupy.asarray(arr)


@_reg("replace_on")
def replace_on(arr: Any, worker: int, value: Any) -> Any:
    """``value`` (on the device) on worker ``worker``, ``arr`` unchanged elsewhere.

    The kit makes one worker pass a different array this way (``debug_copy_from``
    copies into the existing array and refuses another shape or dtype).
    """
    return _on_device(value) if current().worker_id == int(worker) else arr


def _call(name: str, *args: Any) -> Any:
    return get_global_func(f"disco.{name}")(*args)


def make_input(shape: Any, dtype: Any, seed: int, worker_id: int) -> np.ndarray:
    """The array worker ``worker_id`` contributes in a test (deterministic).

    Floating values span three decades of magnitude with both signs, so that a
    reduction in another order than rank order gives different bits; integers are
    small enough to be interesting and large enough that products wrap (NumPy wraps
    the same way, so the reference stays exact).
    """
    dt = as_dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(worker_id)])
    count = int(np.prod(shape, dtype=np.int64))
    flat: np.ndarray
    if dt.kind == "b":
        flat = rng.random(count) < 0.5
    elif dt.kind == "u":
        flat = rng.integers(0, 16, count)
    elif dt.kind == "i":
        flat = rng.integers(-9, 10, count)
    else:  # float16, bfloat16, float32, float64
        mag = 10.0 ** rng.uniform(-2.0, 1.0, count)
        sign = np.where(rng.random(count) < 0.5, -1.0, 1.0)
        flat = sign * mag
    return flat.astype(dt).reshape(shape).copy(order="C")


def _is_root(in_group: bool) -> bool:
    ctx = current()
    return ctx.is_group_root if in_group else ctx.worker_id == 0


@_reg("input")
def input_(shape: Any, dtype: str, seed: int, roots_only: bool | None = None) -> Any:
    """This worker's :func:`make_input`; with ``roots_only`` set, None except on the roots.

    ``roots_only`` is the ``in_group`` flag whose roots get an array (the group
    roots for True, worker 0 for False).
    """
    if roots_only is not None and not _is_root(bool(roots_only)):
        return None
    return _on_device(make_input(shape, dtype, seed, current().worker_id))


@_reg("peer")
def peer(kind: str, value: int = 0) -> int:
    """A per-worker peer id: ``next``/``prev`` in a ring, ``pair`` (0-1, 2-3, ...), ``self``,
    ``const`` (``value``), or ``offset`` (own id + ``value``, not wrapped)."""
    ctx = current()
    me, n = ctx.worker_id, ctx.num_workers
    if kind == "next":
        return (me + 1) % n
    if kind == "prev":
        return (me - 1) % n
    if kind == "pair":
        return me ^ 1
    if kind == "self":
        return me
    if kind == "const":
        return int(value)
    if kind == "offset":
        return me + int(value)
    raise ValueError(f"ccl_kit.peer: unknown kind {kind!r}")


@_reg("exchange")
@collective
def exchange(buf: Any, out: Any, send_to: int, recv_from: int) -> None:
    """Send ``buf`` to ``send_to`` and receive ``out`` from ``recv_from`` (-1: skip).

    Even workers send first and odd workers receive first, so rings and pairs never
    deadlock even when a CCL's sends wait for the matching receive.
    """
    me = current().worker_id

    def send() -> None:
        if send_to >= 0:
            _call("send_to_worker", buf, send_to)

    def recv() -> None:
        if recv_from >= 0:
            _call("recv_from_worker", out, recv_from)

    if me % 2 == 0:
        send()
        recv()
    else:
        recv()
        send()


@_reg("send_several")
@collective
def send_several(buf: Any, out: Any, send_to: int, recv_from: int, sends_first: bool) -> None:
    """Send each row of ``buf`` to ``send_to`` and receive as many rows into ``out`` from
    ``recv_from``: with ``sends_first``, every send before any receive, on every worker;
    else even workers send first and odd ones receive first (for CCLs whose sends wait
    for their receives)."""

    def send() -> None:
        for row in buf:
            _call("send_to_worker", row, send_to)

    def recv() -> None:
        for row in out:
            _call("recv_from_worker", row, recv_from)

    if sends_first or current().worker_id % 2 == 0:
        send()
        recv()
    else:
        recv()
        send()


@_reg("send_from_worker0")
@collective
def send_from_worker0(buf: Any) -> None:
    """On worker 0, send ``buf`` to every other worker in turn (a no-op elsewhere)."""
    ctx = current()
    if ctx.worker_id == 0:
        for w in range(1, ctx.num_workers):
            _call("send_to_worker", buf, w)


@_reg("pipeline")
@collective
def pipeline(buf: Any, out: Any) -> None:
    """Send ``buf`` to the next group and receive ``out`` from the previous group."""
    ctx = current()
    if ctx.group_id < ctx.num_groups - 1:
        _call("send_to_next_group", buf)
    if ctx.group_id > 0:
        _call("recv_from_prev_group", out)


@_reg("call_on")
@collective
def call_on(workers: Any, name: str, *args: Any) -> Any:
    """Call the built-in ``disco.<name>(*args)`` only on the listed workers."""
    if current().worker_id in tuple(workers):
        return _call(name, *args)
    return None


@_reg("allreduce_per_worker_op")
@collective
def allreduce_per_worker_op(src: Any, dst: Any, ops: Any, in_group: bool) -> None:
    """``disco.allreduce`` with worker ``w`` passing ``ops[w]`` (to make mismatched calls)."""
    _call("allreduce", src, ops[current().worker_id], in_group, dst)


@_reg("fail_on")
def fail_on(worker_id: int, shape: Any, dtype: str) -> np.ndarray:
    """Raise on ``worker_id``; return an array of ones elsewhere (a register that failed)."""
    if current().worker_id == worker_id:
        raise ValueError(f"ccl_kit.fail_on: failed on purpose on worker {worker_id}")
    return _on_device(np.ones(shape, as_dtype(dtype)))


@_reg("refill")
def refill(arr: Any, seed: int) -> None:
    """Overwrite ``arr`` in place with this worker's :func:`make_input` of ``seed``
    (the same array object, new contents: a CCL that keeps anything per array must
    read it anew)."""
    arr[...] = _on_device(make_input(arr.shape, arr.dtype, seed, current().worker_id))


@_reg("reshaped")
def reshaped(arr: Any, shape: Any) -> Any:
    """A new array with ``arr``'s data in another shape."""
    if not isinstance(arr, np.ndarray) and hasattr(arr, "get"):  # a GPU array
        return arr.reshape(shape).copy(order="C")
    return np.asarray(arr).reshape(shape).copy(order="C")


@_reg("barrier_times")
def barrier_times(in_group: bool, stagger: float) -> tuple:
    """Sleep ``worker_id * stagger`` s, then barrier; return (arrival, departure) times.

    ``time.monotonic`` is one clock for every process of a machine (CLOCK_MONOTONIC).
    """
    me = current().worker_id
    time.sleep(me * stagger)
    arrived = time.monotonic()
    _call("barrier", in_group)
    return arrived, time.monotonic()


@_reg("die_or_call")
@collective
def die_or_call(victim: int, controller_pid: int, delay: float, name: str, *args: Any) -> Any:
    """On worker ``victim``: wait ``delay`` s and ``os._exit``; elsewhere: ``disco.<name>(*args)``.

    Refuses to end the controller's process (worker 0 lives there).
    """
    if current().worker_id == victim:
        if os.getpid() == controller_pid:
            raise RuntimeError("ccl_kit.die_or_call: refusing to end the controller's process")
        time.sleep(delay)
        os._exit(23)
    return _call(name, *args)


@_reg("strided")
def strided(arr: Any) -> Any:
    """Every other element of ``arr`` along axis 0: a view that is not contiguous."""
    return arr[::2]


@_reg("other_byte_order")
def other_byte_order(arr: Any, worker: int) -> Any:
    """On worker ``worker``: ``arr``'s values as a host array in the other byte order
    (``>f4`` on a little-endian machine: the same dtype name, other bytes); ``arr``
    unchanged elsewhere."""
    if current().worker_id != int(worker):
        return arr
    host = arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr
    return np.asarray(host).astype(np.asarray(host).dtype.newbyteorder())


@_reg("dlpack_only")
def dlpack_only(arr: Any) -> Any:
    """``arr`` behind an object that only has ``__dlpack__`` (as a torch tensor is seen)."""
    from .funcs import DLPackOnly

    return DLPackOnly(arr)


@_reg("pid")
def pid() -> int:
    """This worker's process id."""
    return os.getpid()


@_reg("stop_or_call")
@collective
def stop_or_call(victim: int, controller_pid: int, delay: float, name: str, *args: Any) -> Any:
    """On worker ``victim``: wait ``delay`` s and stop itself (SIGSTOP, a frozen peer);
    elsewhere: ``disco.<name>(*args)``. Refuses to stop the controller's process."""
    if current().worker_id == victim:
        if os.getpid() == controller_pid:
            raise RuntimeError("ccl_kit.stop_or_call: refusing to stop the controller's process")
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    return _call(name, *args)


def faulty_ccl_name(base: str, fail_on: int) -> str:
    """The name under which :func:`register_faulty_ccl` registers its CCL."""
    return f"ccl_kit.{base}.fails_on_{int(fail_on)}"


def register_faulty_ccl(base: str, fail_on: int) -> str:
    """Register, in this process, ``base`` with a constructor that fails on worker ``fail_on``.

    Every other worker constructs the real CCL (which may wait for its peers: NCCL
    does), so the kit sees whether ``init_ccl`` surfaces one worker's failure at once.
    Returns the registered name (:func:`faulty_ccl_name`).
    """
    from .. import plugins
    from ..errors import CCLError
    from ..hookspecs import hookimpl

    name = faulty_ccl_name(base, fail_on)
    if name in plugins.registered("ccl"):
        return name
    real = plugins.lookup("ccl", base)

    def __init__(self, ctx, payload, device_ids=(), **options):  # noqa: N807
        if ctx.worker_id == int(fail_on):
            raise CCLError(f"ccl_kit: the constructor fails on purpose on worker {ctx.worker_id}")
        real.__init__(self, ctx, payload, device_ids, **options)

    cls = type(f"FailsOn{int(fail_on)}{real.__name__}", (real,), {"__init__": __init__})

    class _Plugin:
        @staticmethod
        @hookimpl
        def disco_register_ccls():
            return {name: cls}

    plugins.register_plugin(_Plugin, name=name)
    return name


@_reg("register_faulty_ccl")
def register_faulty_ccl_on_worker(base: str, fail_on: int) -> str:
    """:func:`register_faulty_ccl` in this worker's process (a no-op where it exists)."""
    return register_faulty_ccl(base, fail_on)
