"""The ``disco.*`` worker functions, registered in the global function registry.

They keep TVM's names (also reachable as ``runtime.disco.*``) and argument order,
e.g. ``disco.allreduce(src, op, in_group, dst)``. Inside a user function they can
be called directly: they act on the worker the function runs on.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import plugins
from .ccl.base import REDUCE_OPS
from .device import as_array, as_device, as_dtype, as_shape
from .device import empty as _alloc
from .errors import CCLError, PluginNotFoundError
from .registry import register_func
from .tracing import recorder as _trace_recorder
from .tracing import worker_side as _trace_worker
from .worker import current

__all__ = ["collective"]


def collective(func: Callable) -> Callable:
    """Mark a worker function as a collective.

    A collective still runs when one of its register arguments holds no value (it
    receives a :class:`~disco_core.worker.MissingValue`), so the worker takes part and
    every peer raises the same error instead of waiting for it.
    """
    func._disco_collective = True  # type: ignore[attr-defined]
    return func


def _builtin(name: str):
    def deco(func: Callable) -> Callable:
        register_func(f"disco.{name}", func, override=True)
        register_func(f"runtime.disco.{name}", func, override=True)
        return func

    return deco


def _ccl():
    ctx = current()
    if ctx.ccl is None:
        raise CCLError(
            f"no CCL is initialised on worker {ctx.worker_id}; call session.init_ccl('shm') (or 'mpi', 'nccl') first"
        )
    if ctx.ccl.poisoned:
        raise CCLError(
            f"the {ctx.ccl.name} CCL is unusable after an earlier failure ({ctx.ccl.poisoned}); "
            "start a new session"
        )
    return ctx.ccl


@_builtin("worker_id")
def worker_id() -> int:
    """The global id of the calling worker."""
    return current().worker_id


@_builtin("worker_rank")
def worker_rank() -> int:
    """The global rank of the calling worker (as in TVM, equal to its id)."""
    return current().worker_id


@_builtin("world_size")
def world_size() -> int:
    """The number of workers in the session."""
    return current().num_workers


@_builtin("group_id")
def group_id() -> int:
    """The group of the calling worker."""
    return current().group_id


@_builtin("device")
def device():
    """The calling worker's default device."""
    return current().device


@_builtin("empty")
def empty(shape, dtype, device=None, worker0_only: bool = False, in_group: bool = True):
    """Allocate an array; with ``worker0_only`` only on worker 0 / the group roots (else None)."""
    ctx = current()
    is_root = ctx.is_group_root if in_group else ctx.worker_id == 0
    if worker0_only and not is_root:
        return None
    dev = as_device(device) or ctx.device
    if ctx.ccl is not None and dev.device_type == "cpu":
        arr = ctx.ccl.alloc(as_shape(shape), as_dtype(dtype))
        if arr is not None:
            return arr
    return _alloc(shape, dtype, dev)


@_builtin("register_count")
def register_count() -> int:
    """How many registers hold a value on the calling worker (for leak checks)."""
    return len(current().registers)


@_builtin("import_python_module")
def import_python_module(module_name: str) -> None:
    """Import a Python module on the calling worker (the functions it registers appear)."""
    importlib.import_module(module_name)


# TVM's Session.import_python_module calls this name.
register_func("runtime.disco._import_python_module", import_python_module, override=True)


@_builtin("load_module")
def load_module(path: str, device=None):
    """Load a module file with the loader registered for its suffix."""
    loader = plugins.lookup("loader", os.path.splitext(path)[1])
    return loader(path, as_device(device) or current().device)


@_builtin("module_get_function")
def module_get_function(module: Any, name: str):
    """``module[name]``: a function of a loaded module."""
    lookup_error: BaseException | None = None
    try:
        func = module[name]
    except (KeyError, TypeError, IndexError) as exc:
        lookup_error = exc
        func = getattr(module, name, None)
    if func is None or not callable(func):
        # The loader's own message (a KeyError listing what the module has) says more.
        said = f": {lookup_error}" if isinstance(lookup_error, KeyError) else ""
        raise AttributeError(f"module {module!r} has no function {name!r}{said}")
    return func


@_builtin("init_ccl")
def init_ccl(name: str, payload: Any, device_ids: tuple, options: dict) -> None:
    ctx = current()
    if ctx.ccl is not None:
        raise CCLError(f"worker {ctx.worker_id} already has a CCL ({ctx.ccl.name})")
    cls = plugins.lookup("ccl", name)
    ctx.ccl = cls(ctx, payload, tuple(device_ids), **dict(options))
    _trace_worker.hook_ccl(ctx)  # a trace that runs records it like one made before


@_builtin("ccl_preflight")
def ccl_preflight(name: str, payload: Any, device_ids: tuple, options: dict) -> None:
    """Check that this worker has the CCL, and run its own checks (:meth:`CCL.preflight`).

    ``Session.init_ccl`` runs it on every worker before any constructs its CCL, so a
    worker whose environment lacks the plugin fails alone and at once.
    """
    ctx = current()
    try:
        cls = plugins.lookup("ccl", name)
    except PluginNotFoundError as exc:
        raise PluginNotFoundError(
            f"init_ccl({name!r}): worker {ctx.worker_id} does not have this CCL, although "
            f"the controller does: install the plugin where this worker runs. {exc}"
        ) from None
    cls.preflight(ctx, payload, tuple(device_ids), **dict(options))


@_builtin("ccl_discard")
def ccl_discard() -> None:
    """Close and drop this worker's CCL (``init_ccl`` failed elsewhere: it may be retried)."""
    ctx = current()
    ccl, ctx.ccl = ctx.ccl, None
    if ccl is not None:
        ccl.close()


@_builtin("ccl_poison")
def ccl_poison(reason: str) -> None:
    """Make this worker's CCL refuse every later operation (see :meth:`CCL.poison`)."""
    ccl = current().ccl
    if ccl is not None and not ccl.poisoned:
        ccl.poison(str(reason))


# ---------------------------------------------------------------------------- collectives
def _arr(x: Any) -> Any:
    """Arrays from other libraries (torch, anything with ``__dlpack__``) as NumPy/CuPy views."""
    if x is None or isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        return x
    try:
        return as_array(x)
    except (TypeError, RuntimeError, BufferError):
        return x


def _op_name(op: Any) -> str:
    # TVM passes the ReduceKind as an int (or a 1-tuple); we take names too.
    if isinstance(op, (tuple, list)) and len(op) == 1:
        op = op[0]
    if isinstance(op, int) and 0 <= op < len(REDUCE_OPS):
        return REDUCE_OPS[op]
    return op


@_builtin("allreduce")
@collective
def allreduce(src, op, in_group, dst) -> None:
    _ccl().allreduce(_arr(src), _arr(dst), _op_name(op), bool(in_group))


@_builtin("allgather")
@collective
def allgather(src, in_group, dst) -> None:
    _ccl().allgather(_arr(src), _arr(dst), bool(in_group))


@_builtin("broadcast_from_worker0")
@collective
def broadcast_from_worker0(src, in_group, dst) -> None:
    _ccl().broadcast(_arr(src), _arr(dst), bool(in_group))


@_builtin("scatter_from_worker0")
@collective
def scatter_from_worker0(src, in_group, dst) -> None:
    _ccl().scatter(_arr(src), _arr(dst), bool(in_group))


@_builtin("gather_to_worker0")
@collective
def gather_to_worker0(src, in_group, dst) -> None:
    _ccl().gather(_arr(src), _arr(dst), bool(in_group))


@_builtin("share_with_group_roots")
@collective
def share_with_group_roots(buf) -> None:
    """Copy worker 0's ``buf`` into ``buf`` of every other group's first worker.

    Point to point over the CCL; the other workers do nothing. ``Session.broadcast``
    and ``Session.scatter`` use it with ``in_group=True`` so that every group starts
    from the host data that entered through worker 0.
    """
    ctx = current()
    if ctx.num_groups == 1 or not ctx.is_group_root:
        return
    ccl = _ccl()
    if ctx.worker_id == 0:
        for g in range(1, ctx.num_groups):
            ccl.send(_arr(buf), g * ctx.group_size)
    else:
        ccl.recv(_arr(buf), 0)


@_builtin("barrier")
@collective
def barrier(in_group: bool = False) -> None:
    _ccl().barrier(bool(in_group))


@_builtin("send_to_worker")
@collective
def send_to_worker(buf, receiver_id: int) -> None:
    """Send ``buf`` to worker ``receiver_id``."""
    _ccl().send(_arr(buf), receiver_id)


@_builtin("recv_from_worker")
@collective
def recv_from_worker(buf, sender_id: int) -> None:
    """Receive into ``buf`` (in place) from worker ``sender_id``."""
    _ccl().recv(_arr(buf), sender_id)


@_builtin("recv_from_worker0")
@collective
def recv_from_worker0(buf) -> None:
    """Receive into ``buf`` what worker 0 sent with ``send_to_worker``; a no-op on worker 0."""
    if current().worker_id != 0:
        _ccl().recv(_arr(buf), 0)


@_builtin("send_to_next_group")
@collective
def send_to_next_group(buf) -> None:
    """Send ``buf`` to the worker of the same rank in the next group."""
    ctx = current()
    peer = ctx.worker_id + ctx.group_size
    if peer >= ctx.num_workers:
        raise CCLError(
            f"send_to_next_group: worker {ctx.worker_id} is in the last group; there is no next group"
        )
    _ccl().send(_arr(buf), peer)


@_builtin("recv_from_prev_group")
@collective
def recv_from_prev_group(buf) -> None:
    """Receive into ``buf`` from the worker of the same rank in the previous group."""
    ctx = current()
    peer = ctx.worker_id - ctx.group_size
    if peer < 0:
        raise CCLError(
            f"recv_from_prev_group: worker {ctx.worker_id} is in the first group; there is no previous group"
        )
    _ccl().recv(_arr(buf), peer)


# ---------------------------------------------------------------------------- tracing
# disco_core.tracing.session_trace sends these; they are not part of TVM's set.
@_builtin("trace_start")
def trace_start(capacity: int) -> None:
    """Start recording this worker's commands and collectives (a ring of ``capacity`` events)."""
    _trace_worker.start(current(), int(capacity))


@_builtin("trace_stop")
def trace_stop() -> dict | None:
    """Stop recording; return this worker's events (plain values, see ``Recorder.export``)."""
    return _trace_worker.stop(current())


@_builtin("trace_clock")
def trace_clock() -> tuple[int, str]:
    """This worker's clock (``time.perf_counter_ns``) and what identifies that clock
    (``Recorder.clock_identity``), for the controller's offset measurement."""
    return _trace_recorder.now(), _trace_recorder.clock_identity()
