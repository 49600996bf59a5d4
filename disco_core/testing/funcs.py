"""Worker-side functions used by the conformance kits (``testing.*`` global functions).

The kits call ``session.import_python_module("disco_core.testing.funcs")`` so that
every worker, in whatever process or machine it runs, registers these names.

The functions that end a worker (``testing.die``) take the controller's pid and
refuse to act in that process, so that a mistake can never take the test run down
with it (worker 0 always lives in the controller's process).
"""

from __future__ import annotations

import builtins
import ctypes
import faulthandler
import os
import signal
import time
import zlib
from typing import Any

import numpy as np

from ..registry import register_func
from ..worker import current

__all__ = ["DLPackOnly", "describe"]


def _reg(name: str):
    def deco(func):
        register_func(f"testing.{name}", func, override=True)
        return func

    return deco


@_reg("echo")
def echo(value: Any) -> Any:
    """Return the argument itself (its register then holds it)."""
    return value


@_reg("in_ccl_memory")
def in_ccl_memory(arr: Any) -> bool:
    """Whether ``arr`` lives in memory the worker's CCL handed out (the shm arena)."""
    arena = getattr(current().ccl, "arena", None)
    return arena is not None and arena.offset_of(arr) >= 0


@_reg("echo_args")
def echo_args(*args: Any) -> tuple:
    """Return every argument as a tuple."""
    return args


def describe(value: Any) -> Any:
    """The type structure of ``value``, as plain strings (tuples and lists kept)."""
    if type(value) is tuple:
        return tuple(describe(v) for v in value)
    if type(value) is list:
        return [describe(v) for v in value]
    if isinstance(value, np.ndarray):
        return f"ndarray[{value.dtype}]{list(value.shape)}"
    return type(value).__name__


@_reg("describe")
def describe_args(*args: Any) -> Any:
    """``describe`` of every argument, as the worker received them."""
    return describe(args)


@_reg("add")
def add(a: Any, b: Any) -> Any:
    return a + b


@_reg("context")
def context() -> dict:
    """The facts ``disco_core.worker.current()`` gives a user function."""
    ctx = current()
    return {
        "worker_id": ctx.worker_id,
        "num_workers": ctx.num_workers,
        "num_groups": ctx.num_groups,
        "group_id": ctx.group_id,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "pid": os.getpid(),
    }


@_reg("getenv")
def getenv(name: str) -> str | None:
    """The worker process's environment variable ``name``."""
    return os.environ.get(name)


@_reg("pid")
def pid() -> int:
    return os.getpid()


def machine_identity() -> tuple[str, str]:
    """(boot id, host name): what tells two machines apart (containers included)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return boot, os.uname().nodename


@_reg("machine")
def machine(controller_pid: int, memfd: int, token: bytes) -> dict:
    """Where this worker runs: its machine, and whether it maps the controller's memory.

    ``memfd`` is a memory file of the controller's holding ``token``; a worker that
    shares memory with the controller opens it through ``/proc`` (as the ``shm`` CCL
    does) and reads the token back.
    """
    try:
        with open(f"/proc/{int(controller_pid)}/fd/{int(memfd)}", "rb") as f:
            sees = f.read(len(token)) == token
    except OSError:
        sees = False
    return {"machine": machine_identity(), "pid": os.getpid(), "shares_memory": sees}


@_reg("mutate")
def mutate(arr: np.ndarray) -> np.ndarray:
    """Add ``worker_id + 1`` to ``arr`` in place and return it."""
    arr += current().worker_id + 1
    return arr


@_reg("fill")
def fill(arr: Any, value: Any) -> None:
    """Set every element of ``arr`` (a register's array) to ``value``, in place."""
    arr[...] = value


@_reg("arange")
def arange(n: int, dtype: str = "float32") -> np.ndarray:
    """``arange(n) * (worker_id + 1)``: a different array on every worker."""
    return np.arange(n, dtype=dtype) * (current().worker_id + 1)


@_reg("checksum")
def checksum(arr: np.ndarray) -> tuple:
    """``(shape, dtype, crc32 of the bytes)``, to compare large arrays cheaply."""
    a = np.ascontiguousarray(arr)
    return (tuple(a.shape), a.dtype.str, zlib.crc32(a.view(np.uint8).reshape(-1).data))


@_reg("new_list")
def new_list() -> list:
    return []


@_reg("append")
def append(lst: list, item: Any) -> int:
    """Append to a list held in a register (in place); return its new length."""
    lst.append(item)
    return len(lst)


@_reg("make_dict")
def make_dict() -> dict:
    ctx = current()
    return {"worker": ctx.worker_id, "nested": [1, (2, 3)], "text": "é"}


@_reg("raise")
def raise_(exc_type: str = "ValueError", message: str = "raised on purpose") -> None:
    """Raise ``builtins.<exc_type>(message)`` on every worker."""
    raise getattr(builtins, exc_type)(message)


@_reg("raise_on")
def raise_on(
    worker_id: int, exc_type: str = "ValueError", message: str = "raised on purpose"
) -> int:
    """Raise on one worker only; return the worker id elsewhere."""
    me = current().worker_id
    if me == worker_id:
        raise getattr(builtins, exc_type)(f"{message} (worker {me})")
    return me


@_reg("sleep")
def sleep(seconds: float, only_worker: int | None = None) -> None:
    """Sleep (on every worker, or on ``only_worker``)."""
    if only_worker is None or current().worker_id == only_worker:
        time.sleep(seconds)


@_reg("bump_calls")
def bump_calls(calls: int) -> None:
    """Set this worker's call count (every worker alike): a stand-in for that many
    earlier calls, e.g. past the 24 bits of a shm arrival word."""
    current().calls = calls


@_reg("raise_or_allreduce")
def raise_or_allreduce(bad: int, in_group: bool = False) -> Any:
    """Raise on worker ``bad``; an allreduce (sum of ones) on every other worker: a call
    whose peers wait in a collective for a worker that will never come."""
    from ..builtins import allreduce

    if current().worker_id == bad:
        raise RuntimeError(f"worker {bad} fails before the collective")
    x = np.ones(4, "float32")
    y = np.empty_like(x)
    allreduce(x, "sum", in_group, y)
    return y


@_reg("p2p_pair")
def p2p_pair(sender: int, receiver: int, value: float, fail: int = -1, slow: float = 0.0, part: str = "both", n: int = 4) -> Any:  # fmt: skip
    """``sender`` sends ``n`` floats of ``value`` to ``receiver``, which returns what it
    took (after ``slow`` seconds); worker ``fail`` raises before its part instead. ``part``
    "send" or "recv" makes a call of that half alone (a pair across two calls); "pipe"
    a step of a pipeline: both halves, the receive taking what the call before sent."""
    from ..builtins import recv_from_worker, send_to_worker

    me = current().worker_id
    if me == fail:
        raise RuntimeError(f"worker {me} fails before its point-to-point part")
    if me == sender and part != "recv":
        send_to_worker(np.full(n, value, "float32"), receiver)
    elif me == receiver and part != "send":
        time.sleep(slow)
        got = np.zeros(n, "float32")
        recv_from_worker(got, sender)
        return got
    return None


@_reg("p2p_refused")
def p2p_refused(kind: str) -> Any:
    """Worker 1 sends an array that a send refuses ("byteorder": ``>i4``; "ndim": 9
    dimensions; "object": Python objects); worker 0 receives into an array of the same
    dtype and shape (of ``int32`` for "object") and returns it (it must raise instead)."""
    from ..builtins import recv_from_worker, send_to_worker

    arr = {
        "byteorder": lambda: np.arange(4, dtype=">i4"),
        "ndim": lambda: np.zeros((1,) * 8 + (4,), "<i4"),
        "object": lambda: np.array([1, "a"], dtype=object),
    }[kind]()
    me = current().worker_id
    if me == 1:
        send_to_worker(arr, 0)
    elif me == 0:
        got = np.zeros(2, "<i4") if kind == "object" else np.zeros_like(arr)
        recv_from_worker(got, 1)
        return got
    return None


@_reg("send_then_raise")
def send_then_raise(sender: int, receiver: int, value: float, delay: float = 0.0) -> Any:
    """``sender`` sends 4 floats of ``value`` to ``receiver`` after ``delay`` seconds, then
    raises (a failed call, after its send); ``receiver`` returns what it took."""
    from ..builtins import recv_from_worker, send_to_worker

    me = current().worker_id
    if me == sender:
        time.sleep(delay)
        send_to_worker(np.full(4, value, "float32"), receiver)
        raise RuntimeError(f"worker {me} fails after its send")
    if me == receiver:
        got = np.zeros(4, "float32")
        recv_from_worker(got, sender)
        return got
    return None


@_reg("allreduce_unless")
def allreduce_unless(skip: int, in_group: bool = False) -> Any:
    """An allreduce (sum of ones; of the group with ``in_group``) on every worker but
    ``skip``, which returns None: code that differs between workers, so that ``skip``'s
    next collective meets this one."""
    from ..builtins import allreduce

    if current().worker_id == skip:
        return None
    x = np.ones(4, "float32")
    y = np.empty_like(x)
    allreduce(x, "sum", in_group, y)
    return y


_INPLACE = 8 << 20  # float16 elements (16 MiB): arena arrays, the in-place allreduce


@_reg("inplace_overflow")
def inplace_overflow() -> float:
    """An in-place allreduce of two arena arrays in which only the upper half overflows,
    with NumPy told to raise on it: the member that reduces that half raises inside the
    operation while its peers still write into its arrays."""
    from ..builtins import allreduce, empty

    x, y = empty((_INPLACE,), "float16"), empty((_INPLACE,), "float16")
    x[: _INPLACE // 2], x[_INPLACE // 2 :] = 1.0, 6e4
    y[...] = 0
    old = np.seterr(over="raise")
    try:
        allreduce(x, "sum", False, y)
    finally:
        np.seterr(**old)
    return float(y[0])


@_reg("arena_victim")
def arena_victim(wait: float) -> int:
    """Two fresh arena arrays (the blocks an earlier call freed) set to 7, read back after
    ``wait`` seconds: how many elements someone else changed meanwhile."""
    from ..builtins import empty

    a, b = empty((_INPLACE,), "float16"), empty((_INPLACE,), "float16")
    a[...] = 7
    b[...] = 7
    time.sleep(wait)
    return int((a != 7).sum() + (b != 7).sum())


@_reg("wait_for_file")
def wait_for_file(path: str, only_worker: int | None = None, timeout: float = 30.0) -> bool:
    """Wait (on every worker, or on ``only_worker``) until ``path`` exists, ``timeout``
    seconds at most: a worker kept busy until the test lets it go. True if it came."""
    if only_worker is not None and current().worker_id != only_worker:
        return True
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


@_reg("unpicklable")
def unpicklable() -> Any:
    """A value that cannot cross a process boundary."""
    import threading

    return threading.Lock()


@_reg("die")
def die(mode: str, worker_id: int, controller_pid: int, delay: float = 0.0) -> None:
    """End worker ``worker_id``'s process: ``mode`` is ``"exit"``, ``"sigkill"`` or ``"segfault"``.

    Does nothing on other workers, and refuses to act in the controller's process.
    """
    me = current().worker_id
    if me != worker_id:
        return
    if os.getpid() == controller_pid:
        raise RuntimeError(
            f"testing.die: worker {me} runs in the controller's process; refusing to end it"
        )
    if delay:
        time.sleep(delay)
    if mode == "exit":
        os._exit(17)
    elif mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    elif mode == "segfault":
        # An intended crash: no faulthandler report (a worker forked from a pytest
        # process inherits pytest's) to be mistaken for a real one in test logs.
        faulthandler.disable()
        ctypes.string_at(0)
        os._exit(99)  # not reached
    else:
        raise ValueError(f"testing.die: unknown mode {mode!r}")


class DLPackOnly:
    """An array known only through ``__dlpack__`` (stands for a torch tensor)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


from . import store_funcs as _store_funcs  # noqa: E402, F401  # registers testing.store_*
