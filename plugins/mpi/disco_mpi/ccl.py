"""The ``mpi`` CCL: collectives and point-to-point through MPI (mpi4py).

How the workers meet
--------------------
* Workers that are MPI ranks already (the ``mpi`` channel, ``mpiexec -n N``) use
  ``MPI_COMM_WORLD``: rank ``w`` is worker ``w``.
* Workers that are not (``ProcessSession``, ``SocketSession``...) join one
  communicator by themselves: the controller opens an MPI port (``MPI_Open_port``)
  and sends its name in the rendezvous payload; worker 0 (in the controller's
  process) accepts ``N-1`` times, each worker process connects once and then takes
  part in the remaining accepts, and every ``MPI_Comm_accept``/``connect`` result is
  merged (``MPI_Intercomm_merge``) into a growing intracommunicator, finally
  reordered by worker id (``MPI_Comm_split``). Worker processes that were not
  started by a launcher first borrow one (:mod:`disco_mpi._runtime`), because
  MPICH cannot connect two singletons.

Groups are ``MPI_Comm_split`` sub-communicators of that world; point-to-point
messages travel on a duplicate of the world (``MPI_Comm_dup``), so they never match
a collective, and MPI's ordering per (sender, tag, communicator) keeps every
message pair (descriptor, data) together.

Every operation first exchanges the fixed-size argument descriptors of
:mod:`disco_core.ccl.validate` (an ``MPI_Iallgather``), so a mismatched call raises
the same :class:`~disco_core.errors.CCLError` on every member instead of hanging.

Waiting
-------
Operations are non-blocking MPI calls completed by polling ``MPI_Test``. A wait that
exceeds ``timeout`` raises :class:`~disco_core.errors.CCLTimeoutError`; in worker 0
(in the controller's process) a wait stops at once when the session learns that a
worker died. **MPI cannot recover a communicator** after a member died or an
operation was abandoned: the CCL then refuses every further operation, and the
session must be shut down (the controller raises ``WorkerDiedError``).

Reduction order
---------------
``sum``/``prod``/``min``/``max`` use MPI's built-in operations for the dtypes MPI
knows (integers, float32/64, complex64/128, bool as logical or/and). Integer,
bool, ``min`` and ``max`` results are exact whatever the order. For floating
``sum``/``prod``/``avg``, MPI chooses the reduction order and bracketing (MPICH:
recursive doubling or reduce-scatter + allgather), so results may differ in the last
bits from NumPy's left fold in rank order; with two members they are identical. Pass
``init_ccl("mpi", ordered=True)`` to get results bit-identical to
``functools.reduce(ufunc, [x0, x1, ...])``: members then allgather every contribution
and fold them locally in rank order (n times the traffic). ``float16`` and
``bfloat16`` (with ``ml_dtypes``), which MPI has no type for, complex ``prod``
(MPI's complex multiply rounds differently from NumPy's) and complex ``min``/``max``
(which MPI has not; NumPy orders complex numbers lexicographically) reduce through a
user-defined MPI operation applying the NumPy ufunc in the array's own dtype.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from disco_core import (
    CCLError,
    CCLTimeoutError,
    DiscoError,
    DiscoTypeError,
    DiscoValueError,
)
from disco_core.spi import (
    CCL,
    NoStore,
    Rendezvous,
    StoreTimeoutError,
    average_in_place,
    validate,
)

from . import _runtime

__all__ = ["MPICCL", "MPIRendezvous"]

_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}
_DEFAULT_TIMEOUT = 300.0
_CONNECT_TIMEOUT = 60.0
#: Waiting: spin on ``MPI_Test`` (as a blocking MPI call does: MPI moves data only
#: while someone polls) for ``_SPIN_S`` plus ``_SPIN_PER_BYTE`` per byte moved (the
#: time the transfer could take at 100 MB/s), then sleep between tests with pauses
#: growing up to ``_MAX_PAUSE`` and never above ``elapsed / _PAUSE_DIVISOR``: a
#: late peer then costs no busy CPU, and an abort is still noticed within ~1 ms.
_SPIN_S = 0.01
_SPIN_PER_BYTE = 1e-8
_MAX_PAUSE = 0.001
_PAUSE_DIVISOR = 64
#: Point-to-point messages (a head, then the data) go with a pair of tags of their
#: CCL's own, from 16 on (every MPI allows tags up to 32767 at least): worker 0 lives in
#: the controller's process, whose MPI gives a freed communicator's context to the next
#: one made, so a message left unreceived by an earlier session's CCL matched a receive
#: of the next one (an earlier session's value, taken as this one's).
_P2P_TAGS = 16000
_ALARM_TAG = 13
_ALARM_BYTES = 512
#: A member's call failed (its call number, its collectives so far, its error): peers
#: waiting in a collective it never entered fail at once (see ``call_failed``).
_FAILED_TAG = 14
#: call, world and group collectives, the CCL's mark; then the point-to-point messages
#: it had sent to the notice's receiver and taken from it, and the last call it ended
#: (a second notice follows at the end of the next call: see ``_pair_gone``)
_FAILED_HEAD = struct.Struct("<qqq8sqqq")
#: A member whose collective waits past the spin tells every other member once where it
#: is (its call, its world and group collectives so far, the CCL's mark): a peer waiting
#: in a collective of an earlier call that it never entered sees it went on (see
#: ``_went_on``), as when it skipped one and its next collective is on the other
#: communicator (world or group), which no exchange of calls can meet.
_WHERE_TAG = 15
_WHERE = struct.Struct("<qqq8s")
_WHERE_AFTER = 0.05  # seconds of a collective's wait before it says where it waits
_WHERE_DRAIN = 64  # collectives between two takings of those messages (bounds MPI's queue)
#: An alarm's text starts with it when the member gave up for another reason than a
#: timeout (a failed call's notice, a skipped collective): the others raise CCLError.
_NOT_A_TIMEOUT = "\x00"
#: Each member's descriptor exchange starts with the call it is of (see ``_exchange``).
_CALL = struct.Struct("<q")
#: A point-to-point message's head starts with the call it was sent in, its sender's
#: last failed call (see ``recv``) and its CCL's mark (two CCLs' tags may collide).
_P2P_HEAD = struct.Struct("<qq8s")
#: How often a joining worker asks the session's store whether init_ccl was aborted.
_STORE_POLL_S = 0.25
_UNRECOVERABLE = (
    "MPI cannot recover a communicator after a failed or abandoned operation: "
    "shut the session down and start a new one"
)

_USER_OPS: _UserOps | None = None

#: Aborts of rendezvous made in this process, by token (read by worker 0's CCL).
_ABORTS: dict[str, str] = {}

#: Tokens of rendezvous whose workers all joined (worker 0's CCL, in this process,
#: records it). The ports of one that did not may still have peers half-way through
#: MPI_Comm_connect: MPICH crashes a later MPI_Comm_accept of this process if such a
#: port is closed, so it is left open (a few bytes) instead.
_JOINED: set[str] = set()

#: Join threads of this process: while one is blocked in Accept (a worker died or
#: froze during init_ccl, and MPI cannot cancel the wait) MPI in this process is stuck
#: (a later Open_port waits for ever), so a later init_ccl("mpi") refuses at once. Every
#: one is listed from its start: the session may report a lost worker before worker
#: 0's constructor gave up its join (an init_ccl again on that session hung).
_JOINS: list[threading.Thread] = []

#: Requests given up on (a timeout, an abort) and the CCLs that were broken at close,
#: kept for the life of the process: MPI may still write into their buffers, which
#: must therefore never be freed (a freed receive buffer is a segfault later).
_ABANDONED: list[Any] = []

#: Worker 0's CCL of each rendezvous made in this process, by token: through it the
#: rendezvous tells the surviving workers when others are lost (see
#: ``MPIRendezvous.workers_lost``).
_WORKER0: weakref.WeakValueDictionary[str, MPICCL] = weakref.WeakValueDictionary()


class MPIRendezvous(Rendezvous):
    """The controller's half: an MPI port (unless the workers are MPI ranks already)."""

    def __init__(self, payload: dict, ports: Sequence[str] = ()) -> None:
        super().__init__(payload)
        self.ports = list(ports)
        self.token = payload["token"]
        self.lost: set[int] = set()

    def abort(self, reason: str) -> None:
        _ABORTS[self.token] = reason

    def workers_lost(self, worker_ids: Sequence[int], reason: str) -> None:
        """Stop worker 0's wait and tell the surviving workers, through MPI.

        The survivors may wait in a collective with a lost worker, where only MPI
        reaches them: without the alarm they would not read the shutdown command, and
        ``shutdown()`` would wait its whole timeout before killing them.
        """
        super().workers_lost(worker_ids, reason)  # abort(), in the session's words
        self.lost.update(worker_ids)
        ccl = _WORKER0.get(self.token)
        if ccl is not None:
            ccl.tell_survivors(_ABORTS[self.token], frozenset(self.lost))

    def close(self) -> None:
        ports, self.ports = self.ports, []
        if ports and self.token not in _JOINED:
            return  # peers may still be connecting to them: see _JOINED
        _JOINED.discard(self.token)
        for port in ports:
            try:
                _runtime.mpi().Close_port(port)
            except Exception:
                pass


def _native_types(MPI: Any) -> dict[str, Any]:
    table = {
        "int8": MPI.INT8_T, "int16": MPI.INT16_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
        "uint8": MPI.UINT8_T, "uint16": MPI.UINT16_T, "uint32": MPI.UINT32_T,
        "uint64": MPI.UINT64_T, "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
        "complex64": MPI.C_FLOAT_COMPLEX, "complex128": MPI.C_DOUBLE_COMPLEX,
        "bool": MPI.C_BOOL,
    }  # fmt: skip
    return {k: v for k, v in table.items() if v != MPI.DATATYPE_NULL}


class _UserOps:
    """User-defined MPI operations for dtypes MPI has no type for (float16, bfloat16).

    One table per process: mpi4py allows a limited number of user-defined operations,
    so they are made once and shared by every session of the process.
    """

    def __init__(self, MPI: Any) -> None:
        self.MPI = MPI
        self.types: dict[int, Any] = {}
        self.ops: dict[tuple[str, str], Any] = {}

    def datatype(self, itemsize: int) -> Any:
        t = self.types.get(itemsize)
        if t is None:
            t = self.types[itemsize] = self.MPI.BYTE.Create_contiguous(itemsize).Commit()
        return t

    def op(self, dtype: np.dtype, name: str) -> Any:
        key = (dtype.str, name)
        op = self.ops.get(key)
        if op is None:
            ufunc = _UFUNCS[name]

            def apply(inbuf, inoutbuf, datatype, dtype=dtype, ufunc=ufunc):
                a = np.frombuffer(inbuf, dtype=dtype)
                b = np.frombuffer(inoutbuf, dtype=dtype)
                # MPI: inoutbuf = inbuf op inoutbuf, inbuf from the lower ranks.
                ufunc(a, b, out=b)

            # Declared non-commutative: MPI then keeps the operands in rank order.
            op = self.ops[key] = self.MPI.Op.Create(apply, commute=False)
        return op


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _overlap(src: np.ndarray, dst: np.ndarray) -> int:
    """0: disjoint buffers; 1: the very same buffer (in place); 2: partly overlapping."""
    if src is dst:
        return 1
    if not np.may_share_memory(src, dst):
        return 0
    same = _address(src) == _address(dst) and src.nbytes == dst.nbytes
    return 1 if same and dst.flags.c_contiguous else 2


class MPICCL(CCL):
    """Collectives through MPI.

    Options (``session.init_ccl("mpi", timeout=..., ordered=..., connect_timeout=...)``):

    timeout : float
        Seconds an operation waits for its peers before :class:`CCLTimeoutError`
        (default 300, or ``DISCO_CCL_TIMEOUT``).
    ordered : bool
        Reduce floating ``sum``/``prod``/``avg`` in rank order, bit-identical to NumPy
        (default False: MPI's own, faster, order).
    connect_timeout : float
        Seconds the workers have to join one communicator (default 60).
    """

    name = "mpi"

    @classmethod
    def rendezvous(
        cls, channel: Any, device_ids: Sequence[int] = (), **options: Any
    ) -> MPIRendezvous:
        unknown = set(options) - {"timeout", "ordered", "connect_timeout"}
        if unknown:
            raise DiscoTypeError(f"init_ccl('mpi'): unknown options {sorted(unknown)}")
        if device_ids:  # (they were ignored: GPUs asked for, and CPU collectives given)
            raise DiscoValueError(
                f"init_ccl('mpi'): the mpi CCL moves host arrays and takes no device ids, got "
                f"{tuple(device_ids)}; device ids are for GPU CCLs (init_ccl('nccl', ...))"
            )
        timeout = float(
            options.get("timeout", os.environ.get("DISCO_CCL_TIMEOUT", _DEFAULT_TIMEOUT))
        )
        connect_timeout = float(options.get("connect_timeout", _CONNECT_TIMEOUT))
        if timeout <= 0 or connect_timeout <= 0:
            raise DiscoValueError("init_ccl('mpi'): timeout and connect_timeout must be > 0")
        payload = {
            "token": uuid.uuid4().hex,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
            "ordered": bool(options.get("ordered", False)),
        }
        ports: list[str] = []
        if getattr(channel, "kind", "") == "mpi":
            payload["mode"] = "world"
        elif getattr(channel, "kind", "") == "threaded":
            raise CCLError(
                "the 'mpi' CCL needs one process per worker; a ThreadedSession runs every "
                "worker in one process: use ProcessSession, the 'mpi' channel, or the 'shm' CCL"
            )
        elif channel.num_workers == 1:
            payload["mode"] = "self"
        else:
            _JOINS[:] = [t for t in _JOINS if t.is_alive()]
            if _JOINS:
                raise CCLError(
                    "init_ccl('mpi'): MPI in this process is stuck: an earlier init_ccl('mpi') "
                    "lost a worker while it joined, and MPI cannot cancel the wait for it "
                    f"({len(_JOINS)} join thread(s) still blocked in MPI_Comm_accept). Run "
                    "further MPI sessions from a new controller process, or use the 'shm' CCL"
                )
            MPI = _runtime.mpi()
            if not _runtime.thread_level_ok(MPI):
                raise CCLError(
                    "the MPI library gives no thread support (MPI_THREAD_SERIALIZED or better "
                    "is needed, because worker 0 runs in a thread of the controller's process)"
                )
            # One port per joining worker: worker k connects to ports[k] while the
            # workers 0..k-1 accept on it, so no port ever has two connectors at once
            # (concurrent connects to one port crash MPICH 5.0 with UCX).
            ports = [MPI.Open_port() for _ in range(channel.num_workers)]
            payload["mode"] = "connect"
            payload["ports"] = ports
        return MPIRendezvous(payload, ports)

    def __init__(
        self, ctx: Any, payload: dict, device_ids: Sequence[int] = (), **options: Any
    ) -> None:
        super().__init__(ctx, payload, device_ids)
        self.token = payload["token"]
        self._mark = hashlib.blake2b(str(self.token).encode(), digest_size=8).digest()
        self._failed_call = 0  # this worker's last failed call (point-to-point heads carry it)
        tag = 16 + 2 * (int.from_bytes(self._mark[:4], "little") % _P2P_TAGS)
        self._desc_tag, self._data_tag = tag, tag + 1
        self._given_up: dict[int, str] = {}  # senders whose messages to this worker (see recv)
        self._given_up_to: dict[int, str] = {}  # receivers whose sends from here were (send)
        #: point-to-point messages (heads) of this CCL sent to and taken from each peer
        #: (a failed call's notice carries them: see _pair_gone)
        self._p2p_sent = [0] * ctx.num_workers
        self._p2p_taken = [0] * ctx.num_workers
        self.timeout = float(payload["timeout"])
        self.ordered = bool(payload["ordered"])
        self.broken = ""
        self._me = ctx.worker_id
        self._n = ctx.num_workers
        mode = payload["mode"]
        connect_timeout = float(payload["connect_timeout"])
        MPI = self.MPI = _runtime.mpi(borrow=mode == "connect", timeout=connect_timeout)
        if mode == "world":
            world = MPI.COMM_WORLD.Dup()
            if world.Get_size() != self._n or world.Get_rank() != self._me:
                raise CCLError(
                    f"MPI_COMM_WORLD has {world.Get_size()} ranks (this is rank "
                    f"{world.Get_rank()}) but the session has {self._n} workers (this is {self._me})"
                )
        elif mode == "self":
            world = MPI.COMM_SELF.Dup()
        else:
            world = self._join(payload["ports"], connect_timeout, ctx.store)
            if self._me == 0:
                _JOINED.add(self.token)
            _runtime.release_shm()  # any segment made since MPI_Init (one VCI: none)
        self.world = world
        self.p2p = world.Dup()
        # A member that times out tells the others on this communicator: they must not
        # complete their next collective against the operation it abandoned.
        self.alarm = world.Dup()
        self._alarm_in = bytearray(_ALARM_BYTES)
        self._alarm_req = self.alarm.Irecv([self._alarm_in, MPI.BYTE], MPI.ANY_SOURCE, _ALARM_TAG)
        self._notice_in = bytearray(_ALARM_BYTES)
        self._alarm_out: list[Any] = []
        self._alarm_timed_out = True  # (see _break)
        self._out_bufs: list[bytes] = []  # what the requests of _alarm_out send
        if ctx.num_groups > 1:
            self.group = world.Split(ctx.group_id, self._me)
        else:
            self.group = world
        size = self._n // ctx.num_groups
        self._group_members = range(ctx.group_id * size, (ctx.group_id + 1) * size)
        #: collectives entered, per communicator (the same on every member)
        self._seq = {id(self.world): 0, id(self.group): 0}
        #: failed-call notices of peers: peer -> (call, world and group collectives, error,
        #: messages it had sent to this worker and taken from it, the last call it ended)
        self._notices: dict[int, tuple[int, int, int, str, int, int, int]] = {}
        self._failure_head = (0, 0, 0, b"")  # call, world, group, error of the last failure
        #: where peers said they wait (see _WHERE_TAG): peer -> (call, world, group)
        self._where: dict[int, tuple[int, int, int]] = {}
        self._exchanges = 0  # collectives entered, on any communicator
        self.native = _native_types(MPI)
        global _USER_OPS
        if _USER_OPS is None:
            _USER_OPS = _UserOps(MPI)
        self.user_ops = _USER_OPS
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
        self._bool_ops = {"sum": MPI.LOR, "prod": MPI.LAND, "min": MPI.LAND, "max": MPI.LOR}
        # Descriptor exchange buffers, per communicator: (size, out, in, out spec, in spec).
        self._xch: dict[int, tuple] = {}
        for c in (self.world, self.group):
            size = c.Get_size()
            out = bytearray(_CALL.size + validate.DESC_BYTES)
            inbuf = bytearray(size * len(out))
            self._xch[id(c)] = (size, out, inbuf, [out, MPI.BYTE], [inbuf, MPI.BYTE])
        self._desc_cache: dict[tuple, bytes] = {}  # packed descriptors of plain arrays
        self._checked: set[tuple[int, bytes]] = set()  # (members, descriptor) found consistent
        self._plans: dict[tuple, tuple[Any, str]] = {}  # (dtype, op) -> _plan()
        if self._me == 0:
            _WORKER0[self.token] = self

    # ------------------------------------------------------------------ joining
    def _join(self, ports: Sequence[str], timeout: float, store: Any) -> Any:
        """Accept/connect + merge until every worker is in one intracommunicator.

        Worker 0 (in the controller's process) stops waiting when the rendezvous is
        aborted; the other workers ask the session's ``store``, which the session
        aborts when a worker fails in ``init_ccl`` or dies: a worker waiting in
        ``MPI_Comm_accept`` for one whose MPI launcher was lost would otherwise wait
        the whole ``timeout`` (a chaos check: 60 s, then blamed for it).
        """
        MPI = self.MPI
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                n, me = self._n, self._me
                if me == 0:
                    comm = MPI.COMM_SELF
                else:
                    inter = MPI.COMM_SELF.Connect(ports[me])
                    comm = inter.Merge(True)
                    inter.Free()
                while comm.Get_size() < n:
                    inter = comm.Accept(ports[comm.Get_size()], root=0)
                    merged = inter.Merge(False)
                    inter.Free()
                    if comm is not MPI.COMM_SELF:
                        comm.Free()
                    comm = merged
                result["comm"] = comm.Dup()
                if comm is not MPI.COMM_SELF:
                    comm.Free()
            except BaseException as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        t = threading.Thread(target=run, name=f"disco-mpi-join-{self._me}", daemon=True)
        _JOINS.append(t)
        t.start()
        deadline = time.monotonic() + timeout
        ask_store = self._me != 0 and not isinstance(store, NoStore)
        next_ask = time.monotonic() + _STORE_POLL_S
        while t.is_alive():
            t.join(0.05)
            reason = _ABORTS.get(self.token)
            if reason:
                raise CCLError(f"init_ccl('mpi') aborted: {reason}")
            if ask_store and time.monotonic() > next_ask:
                try:
                    store.wait([f"disco-mpi-never-{self.token}"], timeout=0)
                except StoreTimeoutError:
                    pass  # not aborted: the join goes on
                except DiscoError as aborted:
                    raise CCLError(f"init_ccl('mpi') aborted: {aborted}") from None
                next_ask = time.monotonic() + _STORE_POLL_S
            if time.monotonic() > deadline:
                raise CCLTimeoutError(
                    f"init_ccl('mpi'): the workers did not join one MPI communicator within "
                    f"{timeout:.0f} s (init_ccl('mpi', connect_timeout=...))"
                )
        if "error" in result:
            exc = result["error"]
            raise CCLError(
                f"init_ccl('mpi'): joining the MPI communicator failed: {type(exc).__name__}: {exc}"
            ) from exc
        comm = result["comm"]
        if comm.Get_rank() != self._me or comm.Get_size() != self._n:
            raise CCLError("init_ccl('mpi'): the joined communicator has the wrong shape")
        return comm

    # ------------------------------------------------------------------ waiting
    def _wait(self, req: Any, what: str, nbytes: int = 0, entered: Any = None, pair: tuple[int, bool] | None = None) -> None:  # fmt: skip
        """Complete ``req`` (an MPI request, or a list of them) by polling ``MPI_Test``.

        Spins first, as a blocking MPI call would (``_SPIN_S``, longer for large
        transfers: ``nbytes``); then sleeps between tests with growing pauses, so a
        peer that is late costs no busy CPU, while a dead peer or an abort is still
        noticed within about a millisecond. ``entered``: the communicator of the
        collective this wait is the first step of (its descriptor exchange), which a
        member whose call failed before it will never enter (``_notices``). ``pair``:
        ``(peer, sending)`` for a point-to-point send to or receive from ``peer``, which
        fails once ``peer`` failed without what is waited for (:meth:`_pair_gone`).
        """
        if type(req) is list:
            reqs, testall = req, self.MPI.Request.Testall

            def test() -> bool:
                return testall(reqs)

        else:
            test = req.Test
        for _ in range(200):
            if test():
                return
        monotonic = time.monotonic
        start = monotonic()
        deadline = start + self.timeout
        spin_until = start + _SPIN_S + nbytes * _SPIN_PER_BYTE
        pause = 0.0
        token = self.token
        told = entered is None  # (where this member waits: said once, see _WHERE_AFTER)
        while True:
            for _ in range(100):
                if test():
                    return
            now = monotonic()
            reason = _ABORTS.get(token)
            if reason:
                self.broken = reason
                _ABANDONED.append(req)
                raise CCLError(f"{what} aborted: {reason}; {_UNRECOVERABLE}")
            if self._alarmed():  # a member timed out: this collective has, for all
                _ABANDONED.append(req)
                error = CCLTimeoutError if self._alarm_timed_out else CCLError
                raise error(f"{what}: {self.broken}; {_UNRECOVERABLE}")
            self._take_notices()
            if self._notices:
                if pair is not None and pair[0] in self._notices:
                    self._pair_gone(req, *pair)
                    if test():  # (a receive's cancel came too late: its message is in)
                        return
                gone = self._settle_notices(entered, self._seq.get(id(entered), 0))
                if gone:
                    _ABANDONED.append(req)
                    self._break(gone, timed_out=False)
                    raise CCLError(f"{what.partition(':')[0]}: {gone}; {_UNRECOVERABLE}")
            if now > deadline:
                _ABANDONED.append(req)
                self._break(f"{what} timed out on worker {self._me} after {self.timeout:g} s")
                raise CCLTimeoutError(
                    f"{what}: waited {self.timeout:.0f} s for the other workers "
                    f"(raise it with init_ccl('mpi', timeout=...) or DISCO_CCL_TIMEOUT); "
                    f"{_UNRECOVERABLE}"
                )
            if now > spin_until:
                if not told and now - start > _WHERE_AFTER:
                    told = True
                    self._tell_where()
                if entered is not None:
                    gone = self._went_on(entered, what)
                    if gone:
                        _ABANDONED.append(req)
                        self._break(gone, timed_out=False)
                        raise CCLError(f"{what.partition(':')[0]}: {gone}; {_UNRECOVERABLE}")
                pause = min(pause * 1.5 + 2e-5, _MAX_PAUSE, (now - start) / _PAUSE_DIVISOR)
                time.sleep(pause)

    def _break(self, reason: str, timed_out: bool = True) -> None:
        """Mark the CCL unusable here and tell every other member (see ``_alarmed``);
        ``timed_out`` False: not a timeout, so the members raise ``CCLError``."""
        self.broken = reason
        self._alarm_timed_out = timed_out
        msg = (reason if timed_out else _NOT_A_TIMEOUT + reason).encode()[:_ALARM_BYTES]
        self._send_all(msg, _ALARM_TAG, 0.1)

    def _push_alarm(self, seconds: float) -> None:
        """Drive the alarm's sends (MPI moves data only while this process calls MPI)."""
        deadline = time.monotonic() + seconds
        try:
            while self._alarm_out and not self.MPI.Request.Testall(self._alarm_out):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.0002)
            self._alarm_out.clear()
            self._out_bufs.clear()
        except Exception:  # noqa: BLE001 - a dead peer: nothing more to do
            self._alarm_out.clear()
            _ABANDONED.append(self._out_bufs)  # (MPI may still read them)
            self._out_bufs = []

    def tell_survivors(self, reason: str, lost: frozenset[int]) -> None:
        """(Worker 0, on the thread that noticed the loss.) Send the alarm to every
        member not in ``lost``, so that one waiting in a collective fails at once.

        Only with ``MPI_THREAD_MULTIPLE``: worker 0's own thread may be inside MPI.
        Nothing is sent to a lost member (UCX may end a process that addresses a
        dead peer), and the sends are driven on a short-lived thread of their own,
        since the caller must not block.
        """
        MPI = self.MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return
        if not self.broken:
            self.broken = reason  # also keeps the communicators alive at close()
        peers = [p for p in range(self._n) if p != self._me and p not in lost]
        msg = bytearray(reason.encode()[:_ALARM_BYTES])
        alarm = self.alarm

        def send() -> None:
            reqs: list[Any] = []
            _ABANDONED.append((msg, reqs))  # MPI may read msg for as long as it likes
            try:
                for peer in peers:
                    reqs.append(alarm.Isend([msg, MPI.BYTE], peer, _ALARM_TAG))
                deadline = time.monotonic() + 1.0
                while not MPI.Request.Testall(reqs) and time.monotonic() < deadline:
                    time.sleep(0.0002)
            except Exception:  # noqa: BLE001 - another lost peer: the rest were told
                pass

        threading.Thread(target=send, daemon=True, name="disco-mpi-alarm").start()

    def poison(self, reason: str) -> None:
        super().poison(reason)
        if not self.broken:
            self.broken = reason

    def _alarmed(self) -> bool:
        """True (and ``broken`` set) once another member has announced a failure."""
        if self.broken:
            return True
        status = self.MPI.Status()
        if not self._alarm_req.Test(status):
            return False
        text = bytes(self._alarm_in[: status.Get_count(self.MPI.BYTE)]).decode(errors="replace")
        if text.startswith(_NOT_A_TIMEOUT):
            text, self._alarm_timed_out = text[len(_NOT_A_TIMEOUT) :], False
        self.broken = text or f"worker {status.Get_source()} failed"
        return True

    def _probed(self, tag: int) -> Iterator[tuple[int, bytes]]:
        """``(peer, bytes)`` of each message with ``tag`` waiting on the alarm's
        communicator, from another member.

        Probed for, then received from their sender: a receive posted in advance from
        any source (as the alarm's) never matched worker 1's notice to worker 0 of a
        ProcessSession (MPICH 5 with UCX, dynamic processes: 4 of 4 tries), though a
        probe saw it waiting.
        """
        MPI = self.MPI
        status = MPI.Status()
        while (message := self.alarm.Improbe(MPI.ANY_SOURCE, tag, status)) is not None:
            peer = status.Get_source()
            n = status.Get_count(MPI.BYTE)
            buf = self._notice_in if n <= len(self._notice_in) else bytearray(n)
            message.Recv([buf, n, MPI.BYTE])  # (this very message, whatever its source)
            if 0 <= peer < self._n and peer != self._me:
                yield peer, bytes(buf[:n])

    def _take_notices(self) -> None:
        """Take in the failed-call notices that came (see ``call_failed``)."""
        for peer, data in self._probed(_FAILED_TAG):
            if len(data) >= _FAILED_HEAD.size:
                call, world, group, mark, sent, taken, ended = _FAILED_HEAD.unpack_from(data)
                if mark != self._mark:
                    # A notice of an earlier session's CCL, still on its way when that
                    # one freed its communicator: MPICH gives a freed communicator's
                    # context to the next one made, where it matched (an invalid rank
                    # from a session of 4 workers raised in the next session's CCL of 3).
                    continue
                error = data[_FAILED_HEAD.size :].decode(errors="replace")
                self._notices[peer] = (call, world, group, error, sent, taken, ended)

    # ------------------------------------------------------------------ failed calls
    def call_failed(self, call: int, error: str) -> None:
        """Tell every peer that this worker's call ``call`` failed, with how many
        collectives it entered: a peer waiting in a later one fails at once, naming
        ``error``, rather than at its timeout (TVM waits for ever), and gives the CCL
        up (its exchange cannot be withdrawn). If this worker's next collective comes
        first, the exchange finds the calls differ (``_exchange``)."""
        self._failed_call = call
        if self.broken or self._n == 1:
            return
        text = error.encode("utf-8", "replace")[: _ALARM_BYTES - _FAILED_HEAD.size]
        self._failure_head = (call, self._seq[id(self.world)], self._seq[id(self.group)], text)
        self._send_notices(call)
        # the end of the next call is told too: a peer waiting for a message of that
        # call learns that none came (see _pair_gone)
        self.ctx.on_call_end = self._next_call_ended

    def _send_notices(self, ended: int) -> None:
        """Send each peer the notice of this worker's last failed call, with the
        point-to-point messages sent to and taken from it, and the last call ended."""
        call, world, group, text = self._failure_head
        sent, taken, mark = self._p2p_sent, self._p2p_taken, self._mark
        head = functools.partial(_FAILED_HEAD.pack, call, world, group, mark)
        msgs = {
            peer: head(sent[peer], taken[peer], ended) + text
            for peer in range(self._n)
            if peer != self._me
        }
        self._send_each(msgs, _FAILED_TAG, 0.05)  # (MPI moves it only while it is tested here)

    def _next_call_ended(self, call: int) -> None:
        if call == self._failed_call:
            return  # (the failed call itself: its notice went out)
        if self.ctx.on_call_end == self._next_call_ended:
            self.ctx.on_call_end = None
        if call == self._failed_call + 1 and not self.broken:
            try:
                self._send_notices(call)
            except Exception:  # noqa: BLE001, S110 - a peer waiting then meets its timeout
                pass

    def _send_all(self, msg: bytes, tag: int, push: float) -> None:
        """Send ``msg`` with ``tag`` on the alarm's communicator to every other member,
        driving the sends for up to ``push`` seconds (see ``_push_alarm``)."""
        self._send_each({peer: msg for peer in range(self._n) if peer != self._me}, tag, push)

    def _send_each(self, msgs: dict[int, bytes], tag: int, push: float) -> None:
        """Send ``msgs[peer]`` to each ``peer`` with ``tag`` on the alarm's communicator,
        driving the sends for up to ``push`` seconds (see ``_push_alarm``)."""
        for peer, msg in msgs.items():
            self._out_bufs.append(msg)  # (alive until MPI has sent it)
            try:
                self._alarm_out.append(self.alarm.Isend([msg, self.MPI.BYTE], peer, tag))
            except Exception:  # noqa: BLE001 - a dead peer; the others still hear it
                pass
        self._push_alarm(push)

    def _tell_where(self) -> None:
        """Tell every other member where this one waits (see ``_WHERE_TAG``)."""
        if self._n > 1:
            msg = _WHERE.pack(self.ctx.calls, self._seq[id(self.world)], self._seq[id(self.group)], self._mark)  # fmt: skip
            self._send_all(msg, _WHERE_TAG, 0.0)

    def _went_on(self, comm: Any, what: str) -> str:
        """Why a member of ``comm`` will never enter this collective (its number
        ``self._seq``), from where the members said they wait: one waiting in a later
        call that had entered fewer of ``comm``'s collectives skipped it (it entered
        this one before it went on otherwise, and said so with its count)."""
        self._take_where()
        call, seq = self.ctx.calls, self._seq[id(comm)]
        for peer, (theirs, world, group) in self._where.items():
            if theirs <= call:
                continue
            if comm is self.world:
                entered = world
            elif peer in self._group_members:
                entered = group
            else:
                continue
            if entered < seq:
                failed, *_rest = self._notices.get(peer, (0,))
                error = self._notices[peer][3] if failed >= call else ""
                return (
                    f"worker {peer} went on to a collective of call {theirs} without reaching "
                    f"this {what.partition(':')[0]} of call {call}: " + (
                        f"it failed in call {failed} ({error})" if error else
                        "the workers ran different collectives (it skipped one, or this "
                        f"worker, {self._me}, ran one more)"
                    )
                )  # fmt: skip
        return ""

    def _take_where(self) -> None:
        """Take in the messages of where peers wait (see ``_WHERE_TAG``), keeping the
        latest of each."""
        for peer, data in self._probed(_WHERE_TAG):
            if len(data) == _WHERE.size:
                call, world, group, mark = _WHERE.unpack_from(data)
                if mark == self._mark:  # (not an earlier session's CCL's: see _take_notices)
                    self._where[peer] = (call, world, group)

    def _settle_notices(self, comm: Any, seq: int) -> str:
        """Forget the notices of calls before the one before this one; return why a member of
        ``comm`` will never enter its collective number ``seq`` ("" when none is known
        to: ``comm`` None, or not entered yet and ``seq`` the next). A member that failed
        in this call or a later one, before that collective, will not come."""
        call = self.ctx.calls
        gone = ""
        for peer, (failed, world, group, error, *_p2p) in list(self._notices.items()):
            if failed < call:
                if failed < call - 1:  # (one of the call before still tells a point-to-
                    del self._notices[peer]  # point wait of this one: see _pair_gone)
                continue
            if comm is None or gone:
                continue
            if comm is self.world:
                theirs = world
            elif peer in self._group_members:
                theirs = group
            else:
                continue
            if theirs < seq:
                when = "the same call" if failed == call else "a later call"
                gone = f"worker {peer} failed in {when} before it entered this collective ({error})"  # fmt: skip
        return gone

    def _comm(self, in_group: bool, collective: bool = True) -> Any:
        if self._alarm_out:
            self._push_alarm(0.0)
        if self._alarmed():
            raise CCLError(f"the mpi CCL is unusable after an earlier failure ({self.broken})")
        comm = self.group if in_group else self.world
        self._take_notices()
        if collective and self._notices:
            gone = self._settle_notices(comm, self._seq[id(comm)] + 1)
            if gone:  # (not entered: those that did fail in it, and say so)
                raise CCLError(gone)
        return comm

    def _describe(self, op: str, src: Any, dst: Any, err: str = "") -> bytes:
        """This member's packed descriptor; cached for plain arrays (the hot path)."""
        if (
            err
            or (src is not None and type(src) is not np.ndarray)
            or (dst is not None and type(dst) is not np.ndarray)
        ):
            return validate.pack(validate.describe(op, src, dst, error=err))
        if dst is None:
            dkey = None
        else:
            flags = dst.flags
            dkey = (dst.dtype, dst.shape, flags.c_contiguous, flags.writeable)
        key = (op, None if src is None else (src.dtype, src.shape), dkey)
        packed = self._desc_cache.get(key)
        if packed is None:
            if len(self._desc_cache) > 256:
                self._desc_cache.clear()
            packed = self._desc_cache[key] = validate.pack(validate.describe(op, src, dst))
        return packed

    def _exchange(self, comm: Any, mine: bytes, op: str) -> None:
        """Allgather everyone's descriptor and run the same check on every member."""
        n, out, inbuf, sspec, rspec = self._xch[id(comm)]
        call = self.ctx.calls
        out[:] = _CALL.pack(call) + mine
        self._seq[id(comm)] += 1
        self._exchanges += 1
        if self._exchanges % _WHERE_DRAIN == 0:  # (a member that never waits long takes
            self._take_where()  # the others' messages too, so MPI's queue stays short)
        self._wait(comm.Iallgather(sspec, rspec), op, entered=comm)
        if self._alarmed():  # matched what a member that failed left behind
            raise CCLError(f"{op} aborted: {self.broken}; {_UNRECOVERABLE}")
        uniform = inbuf == out * n
        key = (n, mine)  # (a call checked within a group is not checked for the world)
        if uniform and key in self._checked:
            return  # the same call as one already checked, by every member alike
        size = len(out)
        start = self._me - comm.Get_rank()
        calls = [_CALL.unpack_from(inbuf, k * size)[0] for k in range(n)]
        if calls != [call] * n:
            # A member skipped a collective, after a call of it failed: this exchange is
            # of two collectives, and every member sees it (nothing is left pending).
            late, early = max(calls), min(calls)
            skipped = [start + k for k, c in enumerate(calls) if c == late]
            behind = [start + k for k, c in enumerate(calls) if c != late]
            self._break(
                f"worker(s) {skipped} reached this {op.partition(':')[0]} from call {late}, "
                f"worker(s) {behind} from call {early}: the first skipped a collective "
                "(after a call of theirs failed, or in code that differs between workers), "
                "so the members are out of step",
                timed_out=False,
            )
            raise CCLError(f"{op.partition(':')[0]}: {self.broken}; {_UNRECOVERABLE}")
        raw = [bytes(inbuf[k * size + _CALL.size : (k + 1) * size]) for k in range(n)]
        validate.check(op, [validate.unpack(r) for r in raw], range(start, start + n))
        if uniform:
            if len(self._checked) > 256:
                self._checked.clear()
            self._checked.add(key)

    # ------------------------------------------------------------------ collectives
    def barrier(self, in_group: bool = False) -> None:
        comm = self._comm(in_group)
        self._exchange(comm, self._describe("barrier", None, None), "barrier")

    def _reduction(self, dt: np.dtype, op: str) -> tuple[Any, Any]:
        """The MPI datatype and operation that reduce ``dt`` with ``op``."""
        mtype = self.native.get(dt.name)
        if dt.kind == "c" and op in ("prod", "min", "max"):
            # MPI's complex product rounds differently from NumPy's, and MPI has no
            # complex min/max (NumPy orders complex numbers lexicographically)
            mtype = None
        if mtype is not None:
            table = self._bool_ops if dt == np.bool_ else self._ops
            return mtype, table["sum" if op == "avg" else op]
        return self.user_ops.datatype(dt.itemsize), self.user_ops.op(dt, op)

    def _plan(self, dt: np.dtype, op: str) -> tuple[Any, str]:
        """How to reduce ``dt`` with ``op``: (MPI datatype and op, or None to fold in
        rank order; an error), cached (``dtype.name`` alone costs microseconds)."""
        key = (dt, op)
        plan = self._plans.get(key)
        if plan is None:
            floating = dt.kind in "fc" or dt.name == "bfloat16"
            if self.ordered and op in ("sum", "prod", "avg") and floating:
                plan = (None, "")
            else:
                try:
                    plan = (self._reduction(dt, op), "")
                except Exception as exc:  # every member learns it in the exchange
                    plan = (None, f"cannot reduce {dt.name} with MPI: {type(exc).__name__}: {exc}")
            self._plans[key] = plan
        return plan

    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        comm = self._comm(in_group)
        err = "" if op in _UFUNCS else f"unknown op {op!r}"
        name = f"allreduce:{op}"
        n = comm.Get_size()
        reduction = None  # None: ordered (gather everything, fold in rank order)
        if not err and isinstance(src, np.ndarray) and n > 1:
            reduction, err = self._plan(src.dtype, op)
        self._exchange(comm, self._describe(name, src, dst, err), name)
        src = np.ascontiguousarray(src)
        if src.size == 0:
            return
        MPI = self.MPI
        same = _overlap(src, dst)
        if n == 1:
            if same != 1:
                np.copyto(dst, src)
        elif reduction is None:  # ordered: gather everything, fold in rank order
            parts = np.empty((n, *src.shape), src.dtype)
            self._wait(
                comm.Iallgather([src, src.nbytes, MPI.BYTE], [parts, src.nbytes, MPI.BYTE]),
                "allreduce",
                parts.nbytes,
            )
            ufunc = _UFUNCS[op]
            acc = parts[0]
            for k in range(1, n):
                ufunc(acc, parts[k], out=acc)
            np.copyto(dst, acc)
        else:
            mtype, mop = reduction
            if same == 1:
                sbuf = MPI.IN_PLACE  # src is dst: no copy, and MPI forbids aliased buffers
            else:
                sbuf = [src.copy() if same else src, src.size, mtype]
            req = comm.Iallreduce(sbuf, [dst, dst.size, mtype], mop)
            self._wait(req, "allreduce", dst.nbytes)
        if op == "avg":
            average_in_place(dst, n)  # integers: truncated toward zero, as NCCL's ncclAvg

    def allgather(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        self._exchange(comm, self._describe("allgather", src, dst), "allgather")
        src = np.ascontiguousarray(src)
        B = self.MPI.BYTE
        nbytes = src.nbytes
        sbuf: Any = [src, nbytes, B]
        if nbytes and np.may_share_memory(src, dst):
            if _address(src) == _address(dst) + comm.Get_rank() * nbytes:
                sbuf = self.MPI.IN_PLACE  # src is this member's own slot of dst
            else:
                sbuf = [src.copy(), nbytes, B]
        self._wait(comm.Iallgather(sbuf, [dst, nbytes, B]), "allgather", dst.nbytes)

    def gather(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        root = comm.Get_rank() == 0
        self._exchange(comm, self._describe("gather", src, dst if root else None), "gather")
        src = np.ascontiguousarray(src)
        B = self.MPI.BYTE
        nbytes = src.nbytes
        sbuf: Any = [src, nbytes, B]
        rbuf = None
        if root:
            rbuf = [dst, nbytes, B]
            if nbytes and np.may_share_memory(src, dst):
                same = _address(src) == _address(dst)  # the root's slot is the first
                sbuf = self.MPI.IN_PLACE if same else [src.copy(), nbytes, B]
        self._wait(comm.Igather(sbuf, rbuf, root=0), "gather", nbytes * comm.Get_size())

    def broadcast(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        root = comm.Get_rank() == 0
        self._exchange(comm, self._describe("broadcast", src if root else None, dst), "broadcast")
        B = self.MPI.BYTE
        if root:
            src = np.ascontiguousarray(src)
            same = _overlap(src, dst)
            if same == 1:  # in place: nothing to copy
                self._wait(comm.Ibcast([dst, dst.nbytes, B], root=0), "broadcast", dst.nbytes)
                return
            if same:  # partly overlapping: copy first, then send from dst
                np.copyto(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))
                self._wait(comm.Ibcast([dst, dst.nbytes, B], root=0), "broadcast", dst.nbytes)
                return
            req = comm.Ibcast([src, src.nbytes, B], root=0)
            # The copy overlaps with the transfer (the receivers pull the data).
            np.copyto(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))
            self._wait(req, "broadcast", dst.nbytes)
        else:
            self._wait(comm.Ibcast([dst, dst.nbytes, B], root=0), "broadcast", dst.nbytes)

    def scatter(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        root = comm.Get_rank() == 0
        self._exchange(comm, self._describe("scatter", src if root else None, dst), "scatter")
        B = self.MPI.BYTE
        nbytes = dst.nbytes
        rbuf: Any = [dst, nbytes, B]
        sbuf = None
        if root:
            src = np.ascontiguousarray(src)
            sbuf = [src, nbytes, B]
            if nbytes and np.may_share_memory(src, dst):
                if _address(src) == _address(dst):  # dst is the root's own (first) slot
                    rbuf = self.MPI.IN_PLACE
                else:
                    sbuf = [src.copy(), nbytes, B]
        self._wait(comm.Iscatter(sbuf, rbuf, root=0), "scatter", nbytes * comm.Get_size())

    # ------------------------------------------------------------------ point to point
    def _check_peer(self, peer: Any, what: str) -> int:
        n = self._n
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise CCLError(f"{what}: the peer must be a worker id (int), got {peer!r}")
        if not 0 <= peer < n:
            raise CCLError(f"{what}: worker {peer} is out of range for {n} workers")
        if peer == self._me:
            raise CCLError(f"{what}: worker {peer} cannot send to or receive from itself")
        return int(peer)

    def send(self, buf: Any, peer: int) -> None:
        self._comm(False, collective=False)
        peer = self._check_peer(peer, "send_to_worker")
        if peer in self._given_up_to:
            raise CCLError(f"send_to_worker: {self._given_up_to[peer]}")
        desc = validate.describe_send(buf)
        call = _P2P_HEAD.pack(self.ctx.calls, self._failed_call, self._mark)
        head = np.frombuffer(call + validate.pack(desc), np.uint8).copy()
        reqs = [self.p2p.Isend([head, self.MPI.BYTE], peer, self._desc_tag)]
        self._p2p_sent[peer] += 1
        if desc.status:
            self._wait(reqs, "send_to_worker", pair=(peer, True))
            raise CCLError(f"send_to_worker: {desc.error}")
        data = np.ascontiguousarray(buf)
        if data.nbytes:
            reqs.append(self.p2p.Isend([data, data.nbytes, self.MPI.BYTE], peer, self._data_tag))
        self._wait(reqs, "send_to_worker", data.nbytes, pair=(peer, True))

    def recv(self, buf: Any, peer: int) -> None:
        self._comm(False, collective=False)
        peer = self._check_peer(peer, "recv_from_worker")
        if peer in self._given_up:
            raise CCLError(f"recv_from_worker: {self._given_up[peer]}")
        MPI = self.MPI
        mine = validate.describe_recv(buf)
        head = np.zeros(_P2P_HEAD.size + validate.DESC_BYTES, np.uint8)
        while True:
            self._wait(self.p2p.Irecv([head, MPI.BYTE], peer, self._desc_tag), "recv_from_worker", pair=(peer, False))  # fmt: skip
            raw = head.tobytes()
            sent_in, sender_failed, mark = _P2P_HEAD.unpack_from(raw)
            theirs = validate.unpack(memoryview(raw)[_P2P_HEAD.size :])
            nbytes = 0 if theirs.status else theirs.src[2]
            if mark == self._mark:
                self._p2p_taken[peer] += 1
                break
            if nbytes:  # an earlier CCL's message, on the same tags: dropped
                self._recv_data(np.empty(nbytes, np.uint8), peer, nbytes)
        foreign = self._foreign_message(peer, sent_in, sender_failed)
        error = foreign or validate.check_p2p(peer, theirs, mine)
        if nbytes:
            self._recv_data(np.empty(nbytes, np.uint8) if error else buf, peer, nbytes)
        if foreign:  # which receive the message is for cannot be told: give the pair up
            self._given_up[peer] = (
                f"the messages from worker {peer} to worker {self._me} were given up after a "
                f"failed call ({foreign}); start a new session to pair them again"
            )
            raise CCLError(f"recv_from_worker: {self._given_up[peer]}")
        if error:  # the whole message was drained, so the sender is free
            raise CCLError(f"recv_from_worker: {error}")

    def _pair_gone(self, req: Any, peer: int, sending: bool) -> None:
        """For a send to (``sending``) or a receive from ``peer`` waiting on ``req``,
        with a notice of ``peer``'s failed call in hand: raise once ``peer`` failed in
        this worker's call or a later one, or failed in the call before and ended this
        one, without taking this send's message (it had taken fewer than were sent to
        it) or without sending this receive's (it had sent no more than were taken
        from it). Its notice says how many it had taken
        and sent, so a message still on its way is never given up for; and what it
        sends after a failed call in or after this one is not this receive's anyway
        (:func:`~disco_core.ccl.validate.p2p_order_lost`). A receive's request is
        cancelled (its message may have just come: then it goes on); a send's is left
        to MPI (kept alive), and the pair is given up: the receive that meets it drains
        it, and later sends to ``peer`` fail at once, as do later receives from it."""
        failed, _world, _group, error, sent, taken, ended = self._notices[peer]
        call = self.ctx.calls
        if failed < call and not (failed == call - 1 and ended >= call):
            return
        if sending:
            if taken >= self._p2p_sent[peer]:
                return  # (it took this message: the transfer is finishing)
            why = f"worker {peer} failed in call {failed}{self._and_ended(failed, call)} without taking this worker's message of call {call} ({error})"  # fmt: skip
            self._given_up_to[peer] = f"sends from worker {self._me} to worker {peer} were given up: {why}; start a new session"  # fmt: skip
            _ABANDONED.append(req)
            raise CCLError(f"send_to_worker: {self._given_up_to[peer]}")
        if sent > self._p2p_taken[peer]:
            return  # (a message it sent is on its way)
        req.Cancel()
        status = self.MPI.Status()
        req.Wait(status)
        if not status.Is_cancelled():
            return  # (the message came after all: the caller's test() finds it done)
        why = f"worker {peer} failed in call {failed}{self._and_ended(failed, call)} without sending the message of call {call} ({error})"  # fmt: skip
        self._given_up[peer] = (
            f"the messages from worker {peer} to worker {self._me} were given up: {why}; "
            "start a new session to pair them again"
        )
        raise CCLError(f"recv_from_worker: {self._given_up[peer]}")

    @staticmethod
    def _and_ended(failed: int, call: int) -> str:
        return f" and ended call {call}" if failed < call else ""

    def _recv_data(self, target: Any, peer: int, nbytes: int) -> None:
        self._wait(
            self.p2p.Irecv([target, nbytes, self.MPI.BYTE], peer, self._data_tag),
            "recv_from_worker",
            nbytes,
        )

    def _foreign_message(self, peer: int, sent_in: int, sender_failed: int) -> str:
        """Why a message that ``peer`` sent in its call ``sent_in`` may be another
        receive's ("" when it is this one's; ``sender_failed`` 0: it never failed; the
        rule: :func:`disco_core.ccl.validate.p2p_order_lost`). Such a message is
        drained, and every later receive from ``peer`` fails at once (the pair is given
        up; the other pairs and the collectives are not)."""
        call = self.ctx.calls
        lost = validate.p2p_order_lost(sent_in, sender_failed, call, self._failed_call)
        if lost == "sender":
            return (
                f"the message from worker {peer} is of its call {sent_in}, and worker "
                f"{peer} failed in its call {sender_failed}: it may have skipped the send "
                f"meant for this receive (call {call}), so this message may be another's"
            )
        if lost == "receiver":
            return (
                f"the message from worker {peer} is of its call {sent_in}, and this worker "
                f"(worker {self._me}) failed in its call {self._failed_call}: it may have "
                f"skipped the receive meant for that message, so it may be another's"
            )
        return ""

    def close(self) -> None:
        if self.ctx.on_call_end == self._next_call_ended:
            self.ctx.on_call_end = None
        if self.broken:
            # Pending operations may still use the communicators and write into this
            # CCL's buffers (the alarm's receive, the descriptor exchange): keep it all.
            _ABANDONED.append(self)
            return
        try:
            self._alarm_req.Cancel()
            self._alarm_req.Wait()
        except Exception:
            pass
        comms = {id(c): c for c in (self.group, self.p2p, self.alarm, self.world)}
        for c in comms.values():
            try:
                c.Free()
            except Exception:
                pass
