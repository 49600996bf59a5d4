"""The NCCL CCL (also serves RCCL): one implementation, two registered names.

Controller side (:meth:`NCCLCCL.rendezvous`): checks the device ids and creates the
NCCL unique ids that reach every worker through the control plane (it needs NCCL
for that, not a GPU). Worker side: binds the worker to its GPU, builds the global
communicator with ``ncclCommInitRank`` and its group's communicator with
``ncclCommSplit``, as TVM does (where NCCL or CuPy lacks it, from a unique id of
its own), and runs every operation on the worker's current CUDA stream, so it is
ordered with the user's own kernels. Communicators are destroyed exactly once.

Every collective first all-gathers a small descriptor of each member's arguments
(see :mod:`disco_core.ccl.validate`), so a mismatched call fails on every member
with the same :class:`~disco_core.errors.CCLError` instead of corrupting memory or
hanging in NCCL; ``init_ccl("nccl", validate=False)`` skips that exchange.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from disco_core import CCLError, DiscoError, DiscoTypeError
from disco_core.spi import (
    CCL,
    Device,
    RemoteStore,
    Rendezvous,
    StoreTimeoutError,
    dtype_name,
    validate,
)

from . import backend

__all__ = ["NCCLCCL", "NCCLRendezvous", "nccl_dtype", "reduce_op", "check_device_ids"]

# NCCL's enum values (nccl.h); CuPy exposes the same numbers as NCCL_* constants.
_DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}  # fmt: skip
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

# Aborts requested by the controller, seen by the workers living in its process
# (worker 0). Workers in other processes ask the session's rendezvous store, which the
# session aborts when it loses a worker, every ``_STORE_POLL_S`` while they wait in NCCL.
_ABORTED: dict[int, str] = {}
_STORE_POLL_S = 0.25
_HOT_POLL = 50e-6  # seconds a wait polls its stream before it starts to sleep
_NEXT_TOKEN = iter(range(1, 1 << 62))
_TOKEN_LOCK = threading.Lock()


def nccl_dtype(dtype: Any) -> int:
    """NCCL's datatype code for a NumPy/CuPy dtype; ``CCLError`` for one NCCL lacks."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = dtype_name(dtype if isinstance(dtype, np.dtype) else np.dtype(dtype))
    code = _DTYPES.get(name)
    if code is None:
        raise CCLError(
            f"NCCL has no datatype for {name}; supported: {', '.join(sorted(_DTYPES))} "
            "(bool and int16 are not NCCL types: cast first)"
        )
    return code


def reduce_op(op: str) -> int:
    """NCCL's reduction code for ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``."""
    try:
        return _OPS[op]
    except KeyError:
        raise CCLError(f"unsupported op {op!r}; expected one of {', '.join(_OPS)}") from None


def check_device_ids(
    device_ids: Sequence[int], workers_per_node: int, device_count: int | None
) -> tuple[int, ...]:
    """The GPU of each local worker, validated (distinct, existing), as TVM expects them.

    With no ids, worker ``w`` uses GPU ``w``. ``device_count`` None (the controller
    sees no GPU; the workers are elsewhere) leaves the existence check to the workers.
    """
    ids = tuple(int(d) for d in device_ids) or tuple(range(workers_per_node))
    if len(ids) != workers_per_node:
        raise CCLError(
            f"init_ccl: {len(ids)} device ids given for {workers_per_node} workers per node; "
            "give one GPU per worker (or none for 0..N-1)"
        )
    if len(set(ids)) != len(ids):
        raise CCLError(
            f"init_ccl: device ids {list(ids)} repeat a GPU; NCCL needs one GPU per worker"
        )
    bad = [d for d in ids if d < 0 or (device_count is not None and d >= device_count)]
    if bad:
        where = f"on this machine ({device_count} visible)" if device_count else "(ids are >= 0)"
        raise CCLError(f"init_ccl: no GPU {bad} {where}")
    return ids


def _on_gpu(method: Callable) -> Callable:
    """Run ``method`` with this worker's GPU current.

    CuPy's current device is per thread, and worker 0's commands run on its own
    thread or on the controller's thread (whichever synchronises first); the
    controller's thread keeps whatever device the user made current.
    """

    @functools.wraps(method)
    def on_gpu(self: NCCLCCL, *args: Any) -> Any:
        with self.cupy.cuda.Device(self.gpu):
            return method(self, *args)

    return on_gpu


def _asks_store(ctx: Any) -> bool:
    """Whether a worker learns of an abort from the session's store: one in a process
    of its own (the store is then a client over the channel), not worker 0."""
    return isinstance(getattr(ctx, "store", None), RemoteStore)


class NCCLRendezvous(Rendezvous):
    """The controller's half: unique ids for the communicators, and the abort flag."""

    def __init__(self, payload: dict) -> None:
        super().__init__(payload)
        self.token = payload["token"]

    def abort(self, reason: str) -> None:
        _ABORTED[self.token] = reason

    def close(self) -> None:
        _ABORTED.pop(self.token, None)


class NCCLCCL(CCL):
    """NCCL collectives on CuPy arrays, one GPU per worker.

    Options (``init_ccl("nccl", *device_ids, validate=True)``):

    validate : bool
        Exchange argument descriptors before each collective (default True).
    """

    name: ClassVar[str] = "nccl"

    @classmethod
    def rendezvous(
        cls, channel: Any, device_ids: Sequence[int] = (), **options: Any
    ) -> NCCLRendezvous:
        unknown = set(options) - {"validate"}
        if unknown:
            raise DiscoTypeError(f"init_ccl({cls.name!r}): unknown options {sorted(unknown)}")
        nodes = max(1, getattr(channel, "num_nodes", 1))
        per_node = channel.num_workers // nodes
        # the call's own mistakes first (how many ids, a GPU twice): without CuPy they
        # were hidden behind "needs CuPy" (outside check)
        check_device_ids(device_ids, per_node, None)
        # The controller makes the unique ids (as TVM's does) and needs NCCL for
        # that, but not a GPU: a session's GPUs may all be on other nodes.
        cupy, nccl = backend.load(cls.name, need_gpu=False)
        # This machine's GPUs say what exists only when the workers run here;
        # elsewhere each worker checks its own id against its own machine.
        local = nodes == 1 and getattr(channel, "shares_memory", True)
        count = backend.device_count(cupy) if local else None
        if local and count is None:
            backend.load(cls.name)  # raises, saying what is missing (driver, device)
        ids = check_device_ids(device_ids, per_node, count)
        groups = channel.num_groups
        # Group communicators: ncclCommSplit of the global one where NCCL has it (as
        # TVM), else each group initialises its own from an id made here. Ids are
        # only made when used: each one keeps a bootstrap thread waiting in NCCL.
        split = groups > 1 and backend.can_split(nccl)
        with _TOKEN_LOCK:
            token = next(_NEXT_TOKEN)
        payload = {
            "token": token,
            "device_ids": ids,
            "world_uid": backend.uid_bytes(nccl.get_unique_id()),
            "split": split,
            "group_uids": (
                [backend.uid_bytes(nccl.get_unique_id()) for _ in range(groups)]
                if groups > 1 and not split
                else None
            ),
            "validate": bool(options.get("validate", True)),
        }
        return NCCLRendezvous(payload)

    @classmethod
    def preflight(
        cls, ctx: Any, payload: dict, device_ids: Sequence[int] = (), **options: Any
    ) -> None:
        """This worker's own checks, run on every worker before any enters NCCL's init.

        ``ncclCommInitRank`` waits for every rank: a worker that failed afterwards
        (no CuPy on its node, a GPU its machine lacks) would leave the others waiting.
        """
        cupy, nccl = backend.load(cls.name)
        cls._own_gpu(ctx, payload, cupy, nccl)

    @classmethod
    def _own_gpu(cls, ctx: Any, payload: dict, cupy: Any, nccl: Any) -> int:
        ids = payload["device_ids"]
        gpu = ids[ctx.worker_id % len(ids)]
        count = backend.device_count(cupy) or 0
        if gpu >= count:
            raise CCLError(
                f"init_ccl({cls.name!r}): worker {ctx.worker_id} was given GPU {gpu}, "
                f"but its machine has {count} visible"
            )
        if payload["split"] and not backend.can_split(nccl):
            raise CCLError(
                f"init_ccl({cls.name!r}): worker {ctx.worker_id}'s NCCL or CuPy has no "
                "ncclCommSplit (NCCL >= 2.18.1, CuPy >= 13), the controller's has: "
                "install the same versions everywhere"
            )
        return gpu

    def __init__(
        self, ctx: Any, payload: dict, device_ids: Sequence[int] = (), **options: Any
    ) -> None:
        super().__init__(ctx, payload, device_ids)
        self.cupy, self.nccl = backend.load(self.name)
        self.gpu = self._own_gpu(ctx, payload, self.cupy, self.nccl)
        self.cupy.cuda.Device(self.gpu).use()
        ctx.device = Device("rocm" if self.name == "rccl" else "cuda", self.gpu)
        self.token = payload["token"]
        self.validate = payload["validate"]
        self._closed = False
        self._asks_store = _asks_store(ctx)
        self._next_ask = 0.0
        self.world, self.group = self._watched(self._make_communicators, payload)

    def _abort_reason(self) -> str | None:
        """Why the session aborted (a worker died, init_ccl failed), or None.

        Worker 0 reads its process's flag; a worker in another process asks the
        session's store at most every ``_STORE_POLL_S`` (a round trip to the
        controller): a peer's death leaves it waiting in NCCL, where no command
        reaches it, and shutdown then waited its whole timeout before killing it.
        """
        reason = _ABORTED.get(self.token)
        if reason is not None or not self._asks_store:
            return reason
        now = time.monotonic()
        if now < self._next_ask:
            return None
        self._next_ask = now + _STORE_POLL_S
        try:
            self.ctx.store.wait([f"disco-nccl-never-{self.token}"], timeout=0)
        except StoreTimeoutError:
            return None  # not aborted
        except DiscoError as exc:
            return str(exc)
        return None

    def _make_communicators(self, payload: dict) -> tuple[Any, Any]:
        ctx = self.ctx
        world = backend.communicator(
            self.nccl, ctx.num_workers, payload["world_uid"], ctx.worker_id
        )
        if ctx.num_groups == 1:
            return world, world
        if payload["split"]:
            return world, world.commSplit(ctx.group_id, ctx.local_rank)
        group = backend.communicator(
            self.nccl, ctx.group_size, payload["group_uids"][ctx.group_id], ctx.local_rank
        )
        return world, group

    def _watched(self, build: Callable, payload: dict) -> Any:
        """Run ``build`` (NCCL's initialisation, which waits for every rank) on a helper
        thread, and give up when the session aborts.

        ``ncclCommInitRank`` has no timeout: a peer that died while the others wait in
        it would keep them there, and worker 0 runs on the controller's thread. The
        helper stays blocked in NCCL then (a daemon thread); the session fails.
        """
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                with self.cupy.cuda.Device(self.gpu):  # NCCL binds the current device
                    box["value"] = build(payload)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        name = f"disco-{self.name}-init-{self.ctx.worker_id}"
        threading.Thread(target=run, name=name, daemon=True).start()
        self._next_ask = time.monotonic() + _STORE_POLL_S
        while not done.wait(0.02):
            reason = self._abort_reason()
            if reason is not None:
                raise CCLError(
                    f"init_ccl({self.name!r}) on worker {self.ctx.worker_id} aborted: {reason}"
                )
        if "error" in box:
            raise box["error"]
        return box["value"]

    # ------------------------------------------------------------------ helpers
    def _comm(self, in_group: bool):
        if self._closed:
            raise CCLError(f"the {self.name} CCL of worker {self.ctx.worker_id} is closed")
        return self.group if in_group else self.world

    @property
    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def _gpu_array(self, x: Any, what: str) -> str:
        """An error text when ``x`` is not a contiguous CuPy array on this worker's GPU."""
        if x is None or isinstance(x, validate.MissingValue):
            return ""
        if not isinstance(x, self.cupy.ndarray):
            return (
                f"{what} must be a CuPy array on {self.ctx.device} (got {type(x).__name__}); "
                "allocate it with session.empty"
            )
        if x.device.id != self.gpu:
            return f"{what} is on GPU {x.device.id}, but this worker uses GPU {self.gpu}"
        if not x.flags.c_contiguous:
            return f"{what} must be C-contiguous"
        name = dtype_name(x.dtype)
        if name not in _DTYPES:
            return f"NCCL has no datatype for {name} ({what})"
        return ""

    def _agree(self, comm: Any, op: str, src: Any, dst: Any, members: Sequence[int]) -> None:
        """Exchange descriptors over NCCL; raise the same error on every member."""
        err = self._gpu_array(src, "src") or self._gpu_array(dst, "dst")
        desc = validate.describe(op, src, dst, error=err)
        if not self.validate:
            if desc.status:
                raise CCLError(f"{op.split(':')[0]}: {desc.error}")
            return
        if len(members) == 1:
            # Alone there is nobody to agree with, and the exchange would wait for the
            # stream (everything queued on it) and copy to and from the GPU: ~100 us.
            validate.check(op, [desc], members)
            return
        cp = self.cupy
        mine = cp.asarray(np.frombuffer(validate.pack(desc), np.uint8))
        everyone = cp.empty(len(members) * validate.DESC_BYTES, np.uint8)
        comm.allGather(
            mine.data.ptr, everyone.data.ptr, validate.DESC_BYTES, _DTYPES["uint8"], self._stream
        )
        self._wait_stream(op.split(":")[0])
        raw = everyone.get().tobytes()
        descs = [validate.unpack(raw[k * validate.DESC_BYTES :]) for k in range(len(members))]
        validate.check(op, descs, members)

    # ------------------------------------------------------------------ collectives
    @_on_gpu
    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        comm = self._comm(in_group)
        self._agree(comm, f"allreduce:{op}", src, dst, self.members(in_group))
        comm.allReduce(
            src.data.ptr, dst.data.ptr, src.size, nccl_dtype(src.dtype), reduce_op(op), self._stream
        )

    @_on_gpu
    def allgather(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        self._agree(comm, "allgather", src, dst, self.members(in_group))
        comm.allGather(src.data.ptr, dst.data.ptr, src.size, nccl_dtype(src.dtype), self._stream)

    @_on_gpu
    def broadcast(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        root = self._rank(in_group) == 0
        self._agree(comm, "broadcast", src if root else None, dst, self.members(in_group))
        send = src.data.ptr if root else dst.data.ptr
        comm.broadcast(send, dst.data.ptr, dst.size, nccl_dtype(dst.dtype), 0, self._stream)

    @_on_gpu
    def scatter(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        rank, members = self._rank(in_group), self.members(in_group)
        self._agree(comm, "scatter", src if rank == 0 else None, dst, members)
        dt, count = nccl_dtype(dst.dtype), dst.size
        self.nccl.groupStart()
        try:
            if rank == 0:
                flat = src.reshape(-1)
                for r in range(1, len(members)):
                    comm.send(flat[r * count :].data.ptr, count, dt, r, self._stream)
            else:
                comm.recv(dst.data.ptr, count, dt, 0, self._stream)
        finally:
            self.nccl.groupEnd()
        if rank == 0:
            dst.reshape(-1)[...] = src.reshape(-1)[:count]

    @_on_gpu
    def gather(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        rank, members = self._rank(in_group), self.members(in_group)
        self._agree(comm, "gather", src, dst if rank == 0 else None, members)
        dt, count = nccl_dtype(src.dtype), src.size
        self.nccl.groupStart()
        try:
            if rank == 0:
                flat = dst.reshape(-1)
                for r in range(1, len(members)):
                    comm.recv(flat[r * count :].data.ptr, count, dt, r, self._stream)
            else:
                comm.send(src.data.ptr, count, dt, 0, self._stream)
        finally:
            self.nccl.groupEnd()
        if rank == 0:
            dst.reshape(-1)[:count] = src.reshape(-1)

    @_on_gpu
    def barrier(self, in_group: bool = False) -> None:
        comm = self._comm(in_group)
        self._agree(comm, "barrier", None, None, self.members(in_group))
        one = self.cupy.ones(1, np.int32)
        comm.allReduce(one.data.ptr, one.data.ptr, 1, _DTYPES["int32"], _OPS["sum"], self._stream)
        self.synchronize()

    # ------------------------------------------------------------------ point to point
    def _peer(self, peer: Any, what: str) -> int:
        n = self.ctx.num_workers
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < n:
            raise CCLError(
                f"{what}: peer {peer!r} is out of range: the worker ids of this session are 0..{n - 1}"
            )
        if peer == self.ctx.worker_id:
            raise CCLError(f"{what}: worker {peer} cannot send to or receive from itself")
        return int(peer)

    @_on_gpu
    def send(self, buf: Any, peer: int) -> None:
        peer = self._peer(peer, "send_to_worker")
        comm = self._comm(False)
        err = self._gpu_array(buf, "buf") or (
            "buf: " + buf.reason if isinstance(buf, validate.MissingValue) else ""
        )
        desc = validate.describe_send(None if err else buf, error=err)
        head = self.cupy.asarray(np.frombuffer(validate.pack(desc), np.uint8))
        comm.send(head.data.ptr, validate.DESC_BYTES, _DTYPES["uint8"], peer, self._stream)
        if desc.status:  # (also a buf of None: nothing follows the header)
            raise CCLError(f"send_to_worker: {desc.error}")
        comm.send(buf.data.ptr, buf.size, nccl_dtype(buf.dtype), peer, self._stream)

    @_on_gpu
    def recv(self, buf: Any, peer: int) -> None:
        peer = self._peer(peer, "recv_from_worker")
        comm = self._comm(False)
        head = self.cupy.empty(validate.DESC_BYTES, np.uint8)
        comm.recv(head.data.ptr, validate.DESC_BYTES, _DTYPES["uint8"], peer, self._stream)
        self._wait_stream("recv_from_worker")
        theirs = validate.unpack(head.get().tobytes())
        gpu_err = self._gpu_array(buf, "buf")
        err = validate.check_p2p(peer, theirs, validate.describe_recv(buf, error=gpu_err))
        if theirs.status:
            raise CCLError(f"recv_from_worker: {err}")  # nothing follows the header
        target = buf
        if err:  # still take the message off the wire, so the sender is not left hanging
            # NCCL wants the sender's datatype and count on the receiving side too.
            dtype, _, nbytes = theirs.src
            count = nbytes // np.dtype(dtype).itemsize
            target = self.cupy.empty(count, dtype)
            comm.recv(target.data.ptr, count, nccl_dtype(dtype), peer, self._stream)
            raise CCLError(f"recv_from_worker: {err}")
        comm.recv(target.data.ptr, target.size, nccl_dtype(target.dtype), peer, self._stream)

    # ------------------------------------------------------------------ lifecycle
    def _rank(self, in_group: bool) -> int:
        return self.ctx.local_rank if in_group else self.ctx.worker_id

    @_on_gpu
    def synchronize(self) -> None:
        """Wait for the current stream; fail (and abort NCCL) when the session aborted."""
        self._wait_stream("synchronize")

    def _wait_stream(self, what: str) -> None:
        """Wait until the current stream is done, never for ever.

        A peer that died leaves NCCL's kernels waiting on the GPU, and a blocking
        ``stream.synchronize()`` (or ``.get()``) with them: worker 0, which runs on the
        controller's thread, would hang the controller. So poll (hot for a few
        microseconds, then backing off to 1 ms), and when the session aborts (a
        worker died) abort the communicators, which ends those kernels.
        """
        stream = self.cupy.cuda.get_current_stream()
        if stream.done:
            return
        clock = time.perf_counter
        hot = clock() + _HOT_POLL
        while clock() < hot:
            if stream.done:
                return
        delay = 1e-5
        self._next_ask = time.monotonic() + _STORE_POLL_S  # short waits never ask
        while not stream.done:
            reason = self._abort_reason()
            if reason is not None:
                self._abort()
                raise CCLError(f"{self.name} {what} aborted: {reason}")
            if hasattr(self.world, "check_async_error"):
                self.world.check_async_error()
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _comms(self) -> list[Any]:
        """Each communicator once (the group one may be the world one)."""
        return list({id(c): c for c in (self.world, self.group) if c is not None}.values())

    def _abort(self) -> None:
        for comm in self._comms():
            try:
                comm.abort()
            except Exception:
                pass
        self._closed = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for comm in self._comms():  # each once: TVM destroyed a shared one twice
            comm.destroy()
