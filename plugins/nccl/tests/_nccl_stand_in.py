"""A STAND-IN for CuPy and its NCCL module, for unit tests on machines without a GPU.

This is not CuPy and not NCCL. Its "GPU arrays" are NumPy arrays in host memory
tagged with a device id, behind the part of ``cupy.ndarray``'s interface that Disco
uses (``get``/``set``, ``data.ptr``, ``device.id``, ``__cuda_array_interface__``;
NumPy arrays are refused where CuPy refuses them). Its communicators move bytes
between the threads of one process with the semantics of the NCCL calls that
disco-nccl makes, through the same signatures as ``cupy.cuda.nccl`` (CuPy 14):
every rank of a collective must call it (a rank left waiting raises after
``WAIT`` seconds instead of hanging), sends queue until the matching receive, and
``commSplit`` groups ranks by colour and orders them by key.

The tests that use it (``test_nccl_stand_in.py``) check disco-nccl's own logic on a
multi-worker ThreadedSession: rendezvous, group arithmetic, scatter/gather offsets,
argument agreement, point-to-point framing and the communicator life cycle. The real
thing runs in ``test_nccl_gpu.py`` where a GPU is present.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import types
from collections import defaultdict
from typing import Any

import numpy as np

WAIT = 20.0  # seconds a rank waits for its peers before the stand-in gives up

_DTYPES = {
    0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
    6: np.float16, 7: np.float32, 8: np.float64,
}  # fmt: skip
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
_current = threading.local()


def _device() -> int:
    return getattr(_current, "device", 0)


# --------------------------------------------------------------------- arrays
class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _DeviceId:
    def __init__(self, i: int) -> None:
        self.id = i


class ndarray:
    """Stands in for ``cupy.ndarray``: host memory tagged with a device id."""

    def __init__(self, host: np.ndarray, device: int) -> None:
        self._a = host
        self._device = device

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: _DeviceId(self._device))
    data = property(lambda self: _Ptr(self._a.ctypes.data))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self._a.ctypes.data, False),
            "version": 3,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self._device)  # kDLCUDA, as CuPy says

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._a.__dlpack__()

    def copy(self, order: str = "C") -> ndarray:
        return ndarray(self._a.copy(order=order), self._device)

    def reshape(self, *shape: Any) -> ndarray:
        return ndarray(self._a.reshape(*shape), self._device)

    def __getitem__(self, key: Any) -> Any:
        out = self._a[key]
        return ndarray(out, self._device) if isinstance(out, np.ndarray) else out

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, np.ndarray):
            raise TypeError("stand-in cupy: a NumPy array cannot be assigned to a GPU array")
        self._a[key] = value._a if isinstance(value, ndarray) else value

    def get(self, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self._a.copy()
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("stand-in cupy: get(out=) with another shape or dtype")
        np.copyto(out, self._a)
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray) or arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError("stand-in cupy: set() needs a NumPy array of the same shape and dtype")
        np.copyto(self._a, arr)

    def __repr__(self) -> str:
        return f"stand-in cupy array on gpu {self._device}: {self._a!r}"


ndarray.__module__ = "cupy"  # what Disco's array helpers recognise CuPy arrays by


def empty(shape: Any, dtype: Any = np.float32) -> ndarray:
    return ndarray(np.empty(shape, dtype), _device())


def ones(shape: Any, dtype: Any = np.float32) -> ndarray:
    return ndarray(np.ones(shape, dtype), _device())


class _HostView:
    """What NumPy's from_dlpack needs: the producer's capsule, said to be on the CPU."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._producer.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def from_dlpack(obj: Any) -> ndarray:
    """Stands in for ``cupy.from_dlpack``: a view of a (stand-in) GPU array's memory."""
    kind, device = obj.__dlpack_device__()
    if kind != 2:
        raise TypeError("stand-in cupy.from_dlpack: not a CUDA array")
    return ndarray(np.from_dlpack(_HostView(obj)), device)


def asarray(a: Any) -> ndarray:
    if isinstance(a, ndarray):
        return a
    return ndarray(np.array(a), _device())


class Device:
    """Stands in for ``cupy.cuda.Device``: sets this thread's current device."""

    def __init__(self, i: int = 0) -> None:
        self.id = int(i)
        self._saved: list[int] = []

    def use(self) -> None:
        _current.device = self.id

    def __enter__(self) -> Device:
        self._saved.append(_device())
        _current.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.device = self._saved.pop()


class _Stream:
    ptr = 0
    done = True  # every stand-in operation completes before it returns


# --------------------------------------------------------------------- NCCL
class _Hub:
    """Where the ranks of one communicator meet."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=WAIT)
        self.slots: list[Any] = [None] * size
        self.mail: dict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)


_HUBS: dict[Any, _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub(key: Any, size: int) -> _Hub:
    with _HUBS_LOCK:
        hub = _HUBS.setdefault(key, _Hub(size))
    if hub.size != size:
        raise RuntimeError(f"stand-in NCCL: ranks disagree on the communicator size ({size})")
    return hub


def _memory(ptr: int, count: int, datatype: int) -> np.ndarray:
    dt = np.dtype(_DTYPES[datatype])
    if count == 0:
        return np.empty(0, dt)
    raw = (ctypes.c_uint8 * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dt)


class NcclError(RuntimeError):
    pass


class NcclCommunicator:
    """Stands in for ``cupy.cuda.nccl.NcclCommunicator`` (CuPy 14 signatures)."""

    made: list[NcclCommunicator] = []

    def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:
        if not isinstance(commId, bytes) or len(commId) != 128:
            raise TypeError("stand-in NCCL: commId must be the 128 bytes of get_unique_id()")
        self._setup(ndev, commId, rank)
        self.hub.barrier.wait()  # ncclCommInitRank returns once every rank has joined

    def _setup(self, ndev: int, key: Any, rank: int) -> None:
        if not 0 <= rank < ndev:
            raise NcclError(f"stand-in NCCL: rank {rank} of {ndev}")
        self.ndev, self.key, self.rank = ndev, key, rank
        self.hub = _hub(key, ndev)
        self.device = _device()
        self.destroyed = self.aborted = 0
        self.calls: list[str] = []
        NcclCommunicator.made.append(self)

    def _live(self, what: str) -> _Hub:
        if self.destroyed or self.aborted:
            raise NcclError(f"stand-in NCCL: {what} on a destroyed communicator")
        if _device() != self.device:
            raise NcclError(
                f"stand-in NCCL: {what} with device {_device()} current, communicator is on {self.device}"
            )
        self.calls.append(what)
        return self.hub

    def _gather(self, hub: _Hub, mine: Any) -> list[Any]:
        hub.slots[self.rank] = mine
        hub.barrier.wait()
        return list(hub.slots)

    def size(self) -> int:
        return self.ndev

    def rank_id(self) -> int:
        return self.rank

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
        hub = self._live("allReduce")
        sends = self._gather(hub, sendbuf)
        parts = [_memory(p, count, datatype) for p in sends]
        integer = parts[0].dtype.kind in "iu"
        if op == 4 and not integer:  # ncclAvg on floats is a pre-multiplied sum: sum(x * (1/n))
            scale = parts[0].dtype.type(1.0 / self.ndev)
            parts = [part * scale for part in parts]
        out = parts[0].copy()
        for part in parts[1:]:
            _OPS[op](out, part, out=out)
        if op == 4 and integer:  # on integers a sum, then a C division: truncated toward zero
            d = out.dtype.type(self.ndev)
            out = (out - np.fmod(out, d)) // d
        hub.barrier.wait()  # everyone has read every input before anyone writes
        _memory(recvbuf, count, datatype)[...] = out

    def allGather(self, sendbuf, recvbuf, count, datatype, stream) -> None:
        hub = self._live("allGather")
        sends = self._gather(hub, sendbuf)
        out = np.concatenate([_memory(p, count, datatype) for p in sends])
        hub.barrier.wait()
        _memory(recvbuf, count * self.ndev, datatype)[...] = out

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream) -> None:
        hub = self._live("broadcast")
        sends = self._gather(hub, sendbuff if self.rank == root else None)
        out = _memory(sends[root], count, datatype).copy()
        hub.barrier.wait()
        _memory(recvbuff, count, datatype)[...] = out

    def send(self, sendbuf, count, datatype, peer, stream) -> None:
        hub = self._live("send")
        hub.mail[(self.rank, peer)].put((datatype, _memory(sendbuf, count, datatype).copy()))

    def recv(self, recvbuf, count, datatype, peer, stream) -> None:
        hub = self._live("recv")
        try:
            dt, data = hub.mail[(peer, self.rank)].get(timeout=WAIT)
        except queue.Empty:
            raise NcclError(
                f"stand-in NCCL: rank {self.rank} never got a message from {peer}"
            ) from None
        if dt != datatype or data.size != count:
            # NCCL would corrupt memory or hang here: make the stand-in loud instead.
            raise NcclError(
                f"stand-in NCCL: rank {self.rank} receives {count} x type {datatype}, "
                f"rank {peer} sent {data.size} x type {dt}"
            )
        _memory(recvbuf, count, datatype)[...] = data

    def commSplit(self, color: int, key: int, config: Any = None) -> NcclCommunicator | None:
        hub = self._live("commSplit")
        everyone = self._gather(hub, (color, key))
        hub.barrier.wait()
        if color == -1:
            return None
        mates = sorted((k, r) for r, (c, k) in enumerate(everyone) if c == color)
        comm = NcclCommunicator.__new__(NcclCommunicator)
        comm._setup(len(mates), (self.key, color), mates.index((key, self.rank)))
        return comm

    def check_async_error(self) -> None:
        pass

    def destroy(self) -> None:
        self.destroyed += 1

    def abort(self) -> None:
        self.aborted += 1


def make_modules(gpus: int = 4, split: bool = True, old_ids: bool = False) -> dict[str, Any]:
    """``sys.modules`` entries for ``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl``.

    ``split`` False stands in for an NCCL without ``ncclCommSplit``; ``old_ids`` for a
    CuPy whose ``get_unique_id`` returns a tuple of signed chars.
    """
    NcclCommunicator.made = []
    comm_cls: type = NcclCommunicator
    if old_ids or not split:
        # A class without commSplit at all (hasattr False), taking ids as bytes or tuples.
        def init(self, ndev, commId, rank, config=None):
            want = tuple if old_ids else bytes
            if not isinstance(commId, want) or len(commId) != 128:
                raise TypeError(f"stand-in NCCL: commId must be a {want.__name__} of 128")
            self._setup(ndev, bytes(c & 0xFF for c in commId), rank)
            self.hub.barrier.wait()

        members = {
            k: v
            for k, v in vars(NcclCommunicator).items()
            if k not in ("commSplit", "__init__", "__dict__", "__weakref__")
        }
        comm_cls = type("NcclCommunicator", (), {**members, "__init__": init})
        comm_cls.made = NcclCommunicator.made

    def get_unique_id() -> Any:
        raw = os.urandom(128)
        return tuple(b - 256 if b > 127 else b for b in raw) if old_ids else raw

    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.__dict__.update(
        available=True,
        NcclCommunicator=comm_cls,
        NcclError=NcclError,
        get_unique_id=get_unique_id,
        get_version=lambda: 23203 if split else 21705,
        groupStart=lambda: None,
        groupEnd=lambda: None,
    )
    runtime = types.SimpleNamespace(getDeviceCount=lambda: gpus, is_hip=False)
    cuda = types.ModuleType("cupy.cuda")
    cuda.__dict__.update(
        Device=Device, runtime=runtime, nccl=nccl, get_current_stream=lambda: _Stream()
    )
    cupy = types.ModuleType("cupy")
    cupy.__dict__.update(
        __version__="stand-in",
        ndarray=ndarray,
        empty=empty,
        ones=ones,
        asarray=asarray,
        from_dlpack=from_dlpack,
        cuda=cuda,
    )
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl}
