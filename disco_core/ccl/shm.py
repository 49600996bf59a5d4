"""The ``shm`` CCL: collectives through shared memory on one machine.

Every worker maps one ``memfd`` segment made by the controller (no name in
``/dev/shm``, so nothing is left behind even when everything crashes). Data moves
worker to worker through it; the controller and the control pipes never see it.

Segment layout::

    header | per communicator (all workers; each group): bell, arrival counters,
           |     2 x n descriptors, 2 x n data slots (double-buffered by round)
           | per ordered worker pair: a mailbox (counters; a ring of 8 pieces, each a
           |     head and ``mailbox_bytes / 8`` of data)
    | per worker: the call it failed in (``CCL.call_failed``), its rounds then, the error

Each collective runs in rounds of at most ``slot_bytes`` per member. In a round,
members write their part, arrive (a counter only they write), and wait for the
others' arrivals on a futex. The first round also carries every member's
descriptor of its arguments, so mismatched calls fail on every member at once.

Reduction order: ``allreduce`` combines contributions in rank order,
``((x0 op x1) op x2) ...``, elementwise in the array's own dtype (NumPy ufuncs),
so results are bit-identical to ``functools.reduce(ufunc, xs)`` in NumPy; ``avg``
divides the sum by the member count (on integers truncated toward zero, as NCCL's
``ncclAvg``: :func:`~disco_core.ccl.base.average_in_place`).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CCLError, CCLTimeoutError, DiscoTypeError, DiscoValueError
from . import _arena, _futex, validate
from .base import CCL, Rendezvous, average_in_place

__all__ = ["ShmCCL", "ShmRendezvous", "Layout", "abort_segment"]

_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}
_LINE = 64
_HEADER = 4096
_ABORT_TEXT = 256  # header offset of the abort reason
_FAILS = 16  # header int32 (byte 64): calls that failed on any worker (0: none yet)
_FAIL_TEXT = 40  # byte offset of the error's text in a worker's failure record
_LOST = 3  # word of a worker's failure record: 1 once the session lost that worker
_DONE = 4  # word of a worker's failure record: its last call ended, once one failed
_FAIL_BYTES = 256  # a worker's failure record
# A member's arrival word: the round it arrived at, above the low bits of the call it
# arrived from (WorkerContext.calls): one word, so that a reader never sees the round
# of one arrival with the call of the next (a member may be a round ahead)
_CALL_BITS = 24
_CALL_MASK = (1 << _CALL_BITS) - 1
_DEFAULT_SLOT = 1 << 20
_DEFAULT_MBOX = 1 << 20
# Pieces a pair's mailbox holds: that many small sends to one worker return before it
# takes any (two workers that each send twice to the other before receiving waited for
# the timeout with one), and a large message streams with the receiver copying one
# piece while the sender writes the next
_MB_SLOTS = 8
_MB_BATCH = _MB_SLOTS // 2  # pieces copied at a time: half the ring (see ShmCCL.send)
# a piece's head: its call, its sender's last failed call (a line); the descriptor
_MB_HEAD = _LINE + validate.DESC_BYTES
_DEFAULT_TIMEOUT = 300.0
_SMALL = 64 << 10  # allreduce at most this large takes the one-round path
_DIR_ENTRY = 32
_ARENA_MIN = 256 << 10  # disco.empty puts arrays at least this large in the arena
_CHUNK = 256 << 10  # bytes reduced at a time in place (stays in cache)
# Seconds of polling without yielding the core, before polling with sched_yield. None:
# a yield costs nothing when no one else wants the core, and gives it to the peer when
# it shares ours. 4 KiB allreduce between 2 processes, measured inside the workers on a
# 2-vCPU VM (two runs each): unpinned 14.0/18.9 us with 20 us of hot polling, 14.2/16.5
# without; one CPU 61/51 against 30/30; controller and workers split 11.3/14.9 against
# 12.8/11.5.
_HOT_SPIN = 0.0


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


def _number(raw: Any, what: str) -> float:
    """``raw`` as a float, or a :class:`DiscoValueError` naming ``what`` (an option, a variable)."""
    try:
        return float(raw)
    except TypeError:
        raise DiscoTypeError(f"{what} must be a number of seconds, got {raw!r}") from None
    except ValueError:
        raise DiscoValueError(f"{what} must be a number of seconds, got {raw!r}") from None


def _spin_us() -> float:
    """``$DISCO_SHM_SPIN_US`` (200): microseconds a wait polls before it sleeps; a bad
    value warns, naming it, and gives the default (it is read on every worker)."""
    raw = os.environ.get("DISCO_SHM_SPIN_US", "").strip()
    if not raw:
        return 200.0
    try:
        value = float(raw)
        if not 0 <= value < 1e9:
            raise ValueError
        return value
    except ValueError:
        warnings.warn(
            f"DISCO_SHM_SPIN_US={raw!r} is not a number of microseconds >= 0; using 200",
            RuntimeWarning,
            stacklevel=2,
        )
        return 200.0


class Layout:
    """Offsets of everything in the segment (identical in every process)."""

    def __init__(self, num_workers: int, num_groups: int, slot_bytes: int, mbox_bytes: int) -> None:
        self.num_workers, self.num_groups = num_workers, num_groups
        self.slot_bytes, self.mbox_bytes = slot_bytes, mbox_bytes
        gsize = num_workers // num_groups
        comms = [tuple(range(num_workers))]
        if num_groups > 1:
            comms += [tuple(range(g * gsize, (g + 1) * gsize)) for g in range(num_groups)]
        self.comms = comms
        self.dir_off = _HEADER  # per worker: its arena's (pid, fd, size)
        off = _align(self.dir_off + num_workers * _DIR_ENTRY)
        self.comm_offsets = []
        self.loc_offsets = []  # per comm: 2 x n x (src offset, dst offset) in arenas
        for members in comms:
            n = len(members)
            ctl = off
            desc = ctl + _LINE * (1 + n)
            loc = desc + 2 * n * validate.DESC_BYTES
            data = _align(loc + 2 * n * 16)
            self.comm_offsets.append((ctl, desc, data))
            self.loc_offsets.append(loc)
            off = data + 2 * n * slot_bytes
        self.mbox_base = off
        # (rounded up: the ring holds at least mailbox_bytes, and 8 messages of at most
        # mailbox_bytes / 8 each)
        self.mbox_piece = -(-mbox_bytes // (_MB_SLOTS * _LINE)) * _LINE
        self.mbox_stride = _align(3 * _LINE + _MB_SLOTS * (_MB_HEAD + self.mbox_piece))
        off += num_workers * num_workers * self.mbox_stride
        # per worker: the call it failed in, its rounds then, the error's start
        self.fail_off = off
        self.size = _align(off + num_workers * _FAIL_BYTES)

    def mailbox(self, sender: int, receiver: int) -> int:
        return self.mbox_base + (sender * self.num_workers + receiver) * self.mbox_stride

    def record(self, worker: int) -> int:
        """The first word (an index of the segment's 8-byte words) of ``worker``'s
        failure record."""
        return (self.fail_off + worker * _FAIL_BYTES) // 8


def abort_segment(segment: mmap.mmap, layout: Layout, reason: str, timed_out: bool = False) -> None:
    """Mark the segment aborted (every member's next wait or collective fails) and wake all.

    ``timed_out`` makes the members fail with :class:`CCLTimeoutError` rather than
    :class:`CCLError`.
    """
    words = memoryview(segment).cast("i")
    try:
        if words[0]:
            return  # the first reason stays
        text = reason.encode()[: _HEADER - _ABORT_TEXT - 1]
        segment[_ABORT_TEXT : _ABORT_TEXT + len(text) + 1] = text + b"\0"
        words[0] = 2 if timed_out else 1
        _ring_all(segment, layout, words)
    finally:
        words.release()


def _ring_all(segment: mmap.mmap, layout: Layout, words: memoryview) -> None:
    """Change every bell of the segment and wake its sleepers (they look again)."""
    bells = [ctl for ctl, _, _ in layout.comm_offsets]
    n = layout.num_workers
    bells += [layout.mailbox(s, r) for s in range(n) for r in range(n)]
    for bell in bells:
        words[bell // 4] = words[bell // 4] + 1
        _futex.wake(_futex.address_of(segment, bell))


class ShmRendezvous(Rendezvous):
    """The controller's half: creates the segment, aborts waits, frees it at shutdown."""

    def __init__(self, layout: Layout, options: dict) -> None:
        self.layout = layout
        self.fd = os.memfd_create("disco-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, layout.size)
            self.map = mmap.mmap(self.fd, layout.size)
        except (OSError, OverflowError, ValueError) as exc:
            os.close(self.fd)
            raise CCLError(
                f"init_ccl('shm'): its segment of {layout.size} bytes cannot be made "
                f"({exc}): slot_bytes={layout.slot_bytes}, mailbox_bytes={layout.mbox_bytes} "
                f"for {layout.num_workers} workers; give smaller ones"
            ) from None
        # the layout as its four ints: plain values cross any link (the rpc channel's workers
        # rebuild commands from a network format that makes no object of this module)
        fields = (layout.num_workers, layout.num_groups, layout.slot_bytes, layout.mbox_bytes)
        super().__init__({"pid": os.getpid(), "fd": self.fd, "layout": fields, **options})

    def abort(self, reason: str) -> None:
        if not self.map.closed:
            abort_segment(self.map, self.layout, reason)

    def workers_lost(self, worker_ids: Sequence[int], reason: str) -> None:
        # said per worker first: a member that waits for its peers to leave its arrays
        # (ShmCCL._leave_after_peers) stops waiting for one that is gone
        if not self.map.closed:
            q = memoryview(self.map).cast("q")
            try:
                for w in worker_ids:
                    if 0 <= w < self.layout.num_workers:
                        q[self.layout.record(w) + _LOST] = 1
            finally:
                q.release()
        super().workers_lost(worker_ids, reason)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still alive; the fd close below frees it later
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


class _Comm:
    """One communicator as seen by one member: its counters, descriptors and slots."""

    def __init__(self, ccl: ShmCCL, index: int) -> None:
        layout = ccl.layout
        self.members = layout.comms[index]
        self.n = len(self.members)
        self.rank = self.members.index(ccl.ctx.worker_id)
        ctl, desc, data = layout.comm_offsets[index]
        self.bell = ctl // 4
        self.bell_addr = ccl.base_addr + ctl
        self.arrive = [(ctl + _LINE * (1 + i)) // 8 for i in range(self.n)]
        # the next word of each member's line: 1 while it may sleep in a barrier
        self.asleep = [a + 1 for a in self.arrive]
        self.desc_off = desc
        self.loc = layout.loc_offsets[index] // 8
        self.data_off = data
        self.slot = layout.slot_bytes
        self.views: list | None = None  # the two parities' slots, made on first use
        self.round = 0  # identical on every member: barriers so far
        self.chunks = 0  # identical on every member: data rounds so far (buffer parity)
        self.parity = 0
        self.q = ccl.q

    # methods, not closures made per barrier (two a collective) nor kept ones (a cycle
    # through this object would keep the slots' views, and so the map, past close())
    def ready(self) -> bool:
        """Whether every member has arrived at the current round."""
        q, target = self.q, self.round << _CALL_BITS
        for idx in self.arrive:
            if q[idx] < target:
                return False
        return True

    def late(self) -> list[int]:
        """The members that have not arrived at the current round."""
        q = self.q
        target = self.round << _CALL_BITS
        return [self.members[k] for k, idx in enumerate(self.arrive) if q[idx] < target]


class ShmCCL(CCL):
    """Collectives through a shared-memory segment on one machine.

    Options (``session.init_ccl("shm", timeout=..., slot_bytes=..., mailbox_bytes=...)``):

    timeout : float
        Seconds a collective waits for its peers before :class:`CCLTimeoutError`
        (default 300, or ``DISCO_CCL_TIMEOUT``).
    slot_bytes : int
        Bytes each member moves per round (default 1 MiB).
    mailbox_bytes : int
        Size of each worker pair's point-to-point mailbox (default 1 MiB), a ring of
        8 pieces: up to 8 sends of at most ``mailbox_bytes / 8`` each (or one of at
        most ``mailbox_bytes``) return before the receiver takes any.
    """

    name = "shm"

    @classmethod
    def rendezvous(
        cls, channel: Any, device_ids: Sequence[int] = (), **options: Any
    ) -> ShmRendezvous:
        if getattr(channel, "num_nodes", 1) > 1 or not getattr(channel, "shares_memory", True):
            raise CCLError(
                "the 'shm' CCL needs every worker on one machine; this session spans "
                f"{getattr(channel, 'num_nodes', '?')} nodes: use init_ccl('mpi') (pip install ./plugins/mpi) "
                "or init_ccl('nccl') (pip install ./plugins/nccl), from a clone of the Disco "
                "repository (not yet on PyPI)"
            )
        if not _futex.available():
            raise CCLError(
                "the 'shm' CCL needs Linux futexes (Linux on x86-64, aarch64, ppc64le or s390x)"
            )
        unknown = set(options) - {"timeout", "slot_bytes", "mailbox_bytes", "arena_bytes"}
        if unknown:
            raise DiscoTypeError(f"init_ccl('shm'): unknown options {sorted(unknown)}")
        if device_ids:  # (they were ignored: GPUs asked for, and CPU collectives given)
            raise DiscoValueError(
                f"init_ccl('shm'): the shm CCL runs on the CPU and takes no device ids, got "
                f"{tuple(device_ids)}; device ids are for GPU CCLs (init_ccl('nccl', ...))"
            )
        if "timeout" in options:
            timeout = _number(options["timeout"], "init_ccl('shm'): timeout")
        else:
            timeout = _number(os.environ.get("DISCO_CCL_TIMEOUT", _DEFAULT_TIMEOUT), "DISCO_CCL_TIMEOUT")  # fmt: skip
        opts: dict[str, Any] = {"arena_bytes": options.get("arena_bytes"), "timeout": timeout}
        slot = int(options.get("slot_bytes", _DEFAULT_SLOT))
        mbox = int(options.get("mailbox_bytes", _DEFAULT_MBOX))
        for name, value, ok, rule in (
            ("slot_bytes", slot, slot >= 4096, ">= 4096"),
            ("mailbox_bytes", mbox, mbox >= 4096, ">= 4096"),
            (
                "timeout" if "timeout" in options else "timeout (DISCO_CCL_TIMEOUT)",
                opts["timeout"],
                opts["timeout"] > 0,
                "> 0 seconds",
            ),  # NaN too
        ):
            if not ok:
                raise DiscoValueError(f"init_ccl('shm'): {name} must be {rule}, got {value}")
        slot -= slot % 64
        return ShmRendezvous(Layout(channel.num_workers, channel.num_groups, slot, mbox), opts)

    def __init__(
        self, ctx: Any, payload: dict, device_ids: Sequence[int] = (), **options: Any
    ) -> None:
        super().__init__(ctx, payload, device_ids)
        self.layout = Layout(*payload["layout"])
        self.timeout = payload["timeout"]
        # Poll (yielding the core) this long before sleeping on the futex: waking a
        # sleeper costs tens of microseconds. Threads too: each poll's sched_yield lets
        # go of the GIL, so the peer it waits for runs meanwhile (4 KiB allreduce of two
        # threads: 29 -> 14 us on one CPU, 50-56 -> 38-40 us on two).
        self.spin = _spin_us() * 1e-6
        fd = os.open(f"/proc/{payload['pid']}/fd/{payload['fd']}", os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, self.layout.size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.map, dtype=np.uint8)
        self.q = memoryview(self.map).cast("q")
        self.i = memoryview(self.map).cast("i")
        self.base_addr = _futex.address_of(self.map, 0)
        self._stamp = 0
        self._checked: set[tuple[int, bytes]] = set()  # (members, descriptor) found consistent
        self._desc_cache: dict[tuple, bytes] = {}
        self._send_descs: dict[tuple, bytes] = {}  # (dtype, shape): a send's packed descriptor
        #: small allreduces already run, by their arrays: what each call would rebuild
        #: (views of the arrays and of the slots, the descriptor), see _allreduce_again
        self._small: dict[tuple, tuple] = {}
        #: arrays whose memory a frozen peer may still write into (_leave_after_peers)
        self._kept: list[tuple] = []
        self.broken = ""
        self._world_comm = _Comm(self, 0)
        #: per worker, the word of its world line where it says the call of its latest
        #: collective, in full (see _barrier)
        self._latest = [a + 2 for a in self._world_comm.arrive]
        self._my_latest = self._latest[ctx.worker_id]
        self._group_comm = (
            self._world_comm if len(self.layout.comms) == 1 else _Comm(self, 1 + ctx.group_id)
        )
        me = ctx.worker_id
        self.arena = _arena.Arena(payload.get("arena_bytes"))
        entry = (self.layout.dir_off + me * _DIR_ENTRY) // 8
        self.q[entry : entry + 3] = (
            np.array([os.getpid(), self.arena.fd, self.arena.size], np.int64).view(np.uint8).data
        ).cast("q")
        self._peers: dict[int, np.ndarray] = {me: self.arena.bytes}
        self._sent = [0] * self.layout.num_workers  # per receiver: chunks posted to its mailbox
        self._recvd = [0] * self.layout.num_workers  # per sender: chunks consumed
        self._failed_call = 0  # this worker's last call that raised (0: none)
        self._me = me

    # ------------------------------------------------------------------ arenas
    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """Large arrays come from this worker's arena, where peers reach them in place."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < _ARENA_MIN or self.arena is None:
            return None
        return self.arena.empty(shape, dtype)

    def _peer_arena(self, worker: int) -> np.ndarray:
        arena = self._peers.get(worker)
        if arena is None:
            entry = (self.layout.dir_off + worker * _DIR_ENTRY) // 8
            pid, fd, size = self.q[entry], self.q[entry + 1], self.q[entry + 2]
            arena = self._peers[worker] = _arena.open_peer(pid, fd, size)
        return arena

    def _locate(self, comm: _Comm, src: Any, dst: Any) -> None:
        """Publish where this member's src and dst live (arena offsets, or -1)."""
        at = comm.loc + (comm.parity * comm.n + comm.rank) * 2
        self.q[at] = self.arena.offset_of(src)
        self.q[at + 1] = self.arena.offset_of(dst)

    def _locations(self, comm: _Comm) -> list[tuple[int, int]]:
        at = comm.loc + comm.parity * comm.n * 2
        q = self.q
        return [(q[at + 2 * k], q[at + 2 * k + 1]) for k in range(comm.n)]

    # ------------------------------------------------------------------ waiting
    def _ring(self, bell: int, addr: int, sleepers: list[int] | None = None) -> None:
        """Write a new value into the bell; wake its sleepers (if ``sleepers``, the words
        where the members say they sleep, says there may be any: a wake is a syscall,
        ~1 us, on every collective otherwise)."""
        self._stamp = (self._stamp + 1) & 0x3FFFFFF
        self.i[bell] = (self._stamp << 5) | (self._me & 31)
        if sleepers is not None:
            q = self.q
            for idx in sleepers:
                if q[idx]:
                    break
            else:
                return
        _futex.wake(addr)

    def interrupted(self, reason: str) -> None:
        """Abort the segment: the peers waiting for this member fail now, not at their
        timeout (a Ctrl-C, or a signal handler's exception, in worker 0's allreduce held
        worker 1 for 300 s)."""
        self.broken = self.broken or reason
        abort_segment(self.map, self.layout, reason)

    def call_failed(self, call: int, error: str) -> None:
        """Say in the segment that this worker's call ``call`` failed: a peer that waits
        for it in an operation of that call fails at once (:meth:`_check_round`)."""
        self._failed_call = call  # (point-to-point messages carry it: see send)
        if self.map.closed or self.broken:
            return  # (a failure this CCL caused, or knows of: the segment says so already)
        # from now on say how far this worker got: a receive whose sender failed the
        # call before knows, once the sender ended its call, that no message comes
        self.ctx.on_call_end = self._publish_call_end
        at = self.layout.record(self._me)
        text = error.encode("utf-8", "replace")[: _FAIL_BYTES - _FAIL_TEXT - 1]
        start = at * 8 + _FAIL_TEXT
        self.map[start : start + len(text) + 1] = text + b"\0"
        self.q[at + 1] = self._world_comm.round
        self.q[at + 2] = self._group_comm.round
        self.q[at] = call  # last: a peer that sees it sees the rest
        self.i[_FAILS] += 1
        _ring_all(self.map, self.layout, self.i)

    def _publish_call_end(self, call: int) -> None:
        if not self.map.closed:
            self.q[self.layout.record(self._me) + _DONE] = call

    def _failure(self, w: int) -> tuple[int, int, int, str]:
        """Worker ``w``'s last failed call: ``(call, world round, group round, error)``
        (call 0: none)."""
        at = self.layout.record(w)
        q = self.q
        call = q[at]
        if not call:
            return 0, 0, 0, ""
        start = at * 8 + _FAIL_TEXT
        error = bytes(self.map[start : at * 8 + _FAIL_BYTES]).split(b"\0", 1)[0].decode(errors="replace")  # fmt: skip
        return call, q[at + 1], q[at + 2], error

    def _give_up(self, what: str, reason: str) -> None:
        """This wait cannot end well: give the segment up (every member's wait fails)."""
        self.broken = reason
        abort_segment(self.map, self.layout, reason)
        raise CCLError(
            f"{what.partition(':')[0]}: {reason}; the shm CCL of this session is unusable now"
        )

    def _check_arrivals(self, what: str, comm: _Comm) -> None:
        """Every member has arrived at this round of ``comm``: whether all from this
        member's call (one read a member when they did, the usual case), or else
        whether the round can end (:meth:`_check_round`). Checked whether or not a call
        failed: code that differs between workers (one skips a collective, or runs
        one more) pairs two different collectives otherwise, and each member's value
        would be a mix of them (the mpi CCL checks the same way)."""
        q = self.q
        mine = q[comm.arrive[comm.rank]]
        for idx in comm.arrive:
            if q[idx] != mine:
                self._check_round(what, comm)
                return

    def _check_round(self, what: str, comm: _Comm) -> None:
        """Whether this round of ``comm`` can end.

        Every member's arrival word carries the call it arrived from
        (:attr:`WorkerContext.calls`, the same on every worker at the same collective).
        A member at this round from another call skipped a collective (after a call
        of it failed, or in code that differs between workers), or ran one more: its
        arrival is not this round's, and using its data would be wrong data (an
        outside check: 101 for 100 + 100). A member already a round further took part
        in this one. A member that has not arrived and has failed in this call or a
        later one, before this round, will never come.
        """
        call, me, r = self.ctx.calls, self._me, comm.round
        q = self.q
        op = what.partition(":")[0]
        for k, w in enumerate(comm.members):
            if w == me:
                continue
            word = q[comm.arrive[k]]
            arrived = word >> _CALL_BITS
            if arrived > r:
                continue  # past this round (it took part), and on to the next one
            if arrived == r:
                theirs = word & _CALL_MASK
                mine = call & _CALL_MASK
                if theirs != mine:
                    # after a failure between the two calls, the one from the later
                    # call skipped a collective (an older failure is not the cause)
                    skipped = w if theirs > mine else me
                    failed, _wr, _gr, error = self._failure(skipped)
                    failed &= _CALL_MASK
                    self._give_up(what, (
                        f"worker {w} reached this {op} from another call ({theirs}, worker "
                        f"{me}'s is {mine}): worker {skipped} skipped a collective after a "
                        "call of it failed" + (f" ({error})" if error else "")
                        if min(theirs, mine) <= failed < max(theirs, mine) else
                        f"worker {w} reached this {op} from call {theirs}, worker {me} from "
                        f"call {mine}: the workers ran different collectives (one skipped "
                        "a collective, or ran one more)"
                    ))  # fmt: skip
                continue
            failed, world, group, error = self._failure(w)
            if failed >= call and (world if comm is self._world_comm else group) < r:
                self._give_up(what, (
                    f"worker {w} failed in the same call without finishing its part of this {op} ({error})"
                    if failed == call
                    else f"worker {w} went past this call without reaching this {op} (it "
                    f"failed in a later one: {error})"
                ))  # fmt: skip

    def _check_gone_past(self, what: str, comm: _Comm) -> None:
        """Give up once a member that has not arrived at this round of ``comm`` has
        entered a collective of a later call (on any communicator): it skipped this one
        (code that differs between workers; a skip on the same communicator is seen
        by :meth:`_check_arrivals`). Its call is read in full, then its arrival again:
        a member writes its arrival before it goes on, so one that arrived meanwhile
        and went on is never taken for one that skipped (an outside check found that
        race, and 24-bit call numbers that wrapped, in an earlier version)."""
        q, call = self.q, self.ctx.calls
        target = comm.round << _CALL_BITS
        for k, w in enumerate(comm.members):
            idx = comm.arrive[k]
            if q[idx] >= target:
                continue
            theirs = q[self._latest[w]]
            if theirs > call and q[idx] < target:
                op = what.partition(":")[0]
                failed, _wr, _gr, error = self._failure(w)
                if failed == call:  # (as _check_round says it, which may come first)
                    self._give_up(what, f"worker {w} failed in the same call without finishing its part of this {op} ({error})")  # fmt: skip
                self._give_up(what, (
                    f"worker {w} went on to a collective of call {theirs} without reaching "
                    f"this {op} of call {call}: " + (
                        f"it failed in call {failed} ({error})" if call < failed < theirs else
                        "the workers ran different collectives (it skipped one, or this "
                        f"worker, {self._me}, ran one more)"
                    )
                ))  # fmt: skip

    def _check_abort(self, what: str) -> None:
        if self.i[0]:
            reason = (
                bytes(self.map[_ABORT_TEXT:_HEADER]).split(b"\0", 1)[0].decode(errors="replace")
            )
            self.broken = reason or "aborted"
            error = CCLTimeoutError if self.i[0] == 2 else CCLError
            raise error(f"{what} aborted: {self.broken}")

    def _wait(self, ready, bell: int, addr: int, what: str, waiting_for, asleep: int | None = None, comm: _Comm | None = None, pair: tuple[int, int, bool, int] | None = None) -> None:  # fmt: skip
        """Wait until ``ready()``; sleep on the futex at ``addr`` between checks.

        ``asleep``: the word (of ``self.q``) where this member says it may sleep, for
        wakers that ring with ``sleepers`` (:meth:`_ring`). When a collective's round
        of ``comm`` is ready, the calls the members arrived from are compared
        (:meth:`_check_arrivals`); once a call failed on any worker, the round is also
        checked whenever the wait looks again (:meth:`_check_round`: a member that
        failed may never come). ``pair``, for a point-to-point wait
        (``(peer, sent_i, sending, head_word)``), is checked likewise (:meth:`_pair_gone`): the
        peer may have failed past the point of sending (or taking) what is waited for.
        """
        if ready():
            if comm is not None:
                self._check_arrivals(what, comm)
            return
        if self.spin:
            # Poll (hot for _HOT_SPIN, then yielding the core), then sleep on the futex.
            clock = time.perf_counter
            start = clock()
            hot, until = start + _HOT_SPIN, start + self.spin
            while clock() < hot:
                if ready():
                    if comm is not None:
                        self._check_arrivals(what, comm)
                    return
            while clock() < until:
                os.sched_yield()
                if ready():
                    if comm is not None:
                        self._check_arrivals(what, comm)
                    return
        deadline = time.monotonic() + self.timeout
        if asleep is None:
            return self._sleep(ready, bell, addr, what, waiting_for, deadline, 0.05, comm, pair)
        # Said before the bell is read: a waker that rings after this read wakes us. A
        # waker whose check raced this store (a CPU may let its read pass its store)
        # can miss it: the first sleep is short, so that costs at most 2 ms.
        self.q[asleep] = 1
        try:
            self._sleep(ready, bell, addr, what, waiting_for, deadline, 0.002, comm, pair)
        finally:
            self.q[asleep] = 0

    def _sleep(self, ready, bell: int, addr: int, what: str, waiting_for, deadline: float, first: float, comm: _Comm | None = None, pair: tuple[int, int, bool, int] | None = None) -> None:  # fmt: skip
        what = what.partition(":")[0]  # "allreduce:sum" -> "allreduce"
        words = self.i
        nap = first
        while True:
            seen = words[bell]
            fails = comm if words[_FAILS] else None  # (see _wait)
            if ready():
                if comm is not None:
                    self._check_arrivals(what, comm)
                return
            if fails is not None:
                self._check_round(what, fails)
            if comm is not None:
                self._check_gone_past(what, comm)
            if pair is not None and words[_FAILS]:
                self._pair_gone(*pair, ready)
            self._check_abort(what)
            now = time.monotonic()
            if now > deadline:
                # Our arrival is already counted, so the peers could never tell this
                # collective from the next one: the CCL is done for, for everyone.
                late = waiting_for()
                self.broken = f"{what} on worker {self._me} timed out waiting for worker(s) {late}"
                abort_segment(self.map, self.layout, self.broken, timed_out=True)
                raise CCLTimeoutError(
                    f"{what}: waited {self.timeout:g} s for worker(s) {late} "
                    "(raise it with init_ccl('shm', timeout=...) or DISCO_CCL_TIMEOUT); "
                    "the shm CCL of this session is unusable now"
                )
            _futex.wait(addr, seen, min(nap, deadline - now))
            nap = 0.05

    def _barrier(self, comm: _Comm, what: str) -> None:
        """Arrive at the end of this round and wait for every member (``what``: the
        operation, as errors name it; an ``op:detail`` is cut at the colon then)."""
        comm.round += 1
        q, call = self.q, self.ctx.calls
        # the call in full first, in this worker's word of the world's: a peer waiting
        # in another communicator's collective sees that this worker went past it
        # (_check_gone_past); then the round, and the call it is of, in one word: read
        # together (see _check_round)
        q[self._my_latest] = call
        q[comm.arrive[comm.rank]] = (comm.round << _CALL_BITS) | (call & _CALL_MASK)
        self._ring(comm.bell, comm.bell_addr, comm.asleep)
        self._wait(comm.ready, comm.bell, comm.bell_addr, what, comm.late, comm.asleep[comm.rank], comm)  # fmt: skip

    def _slots(self, comm: _Comm) -> np.ndarray:
        """Start a data round: its slots, shape ``(n, slot_bytes)``.

        Rounds alternate between two buffers, so a member that runs ahead into the
        next round never overwrites data a slower member is still reading.
        """
        comm.parity = parity = comm.chunks % 2
        comm.chunks += 1
        views = comm.views
        if views is None:
            size = comm.n * comm.slot
            starts = (comm.data_off, comm.data_off + size)
            views = comm.views = [self.buf[a : a + size].reshape(comm.n, comm.slot) for a in starts]
        return views[parity]

    def _describe(self, op: str, src: Any, dst: Any, err: str = "") -> bytes:
        """This member's packed descriptor; cached for plain arrays (the hot path)."""
        if err or type(src) is not np.ndarray or type(dst) is not np.ndarray:
            return validate.pack(validate.describe(op, src, dst, error=err))
        flags = dst.flags
        key = (op, src.dtype, src.shape, dst.dtype, dst.shape, flags.c_contiguous, flags.writeable)
        packed = self._desc_cache.get(key)
        if packed is None:
            if len(self._desc_cache) > 256:
                self._desc_cache.clear()
            packed = self._desc_cache[key] = validate.pack(validate.describe(op, src, dst))
        return packed

    def _exchange(self, comm: _Comm, mine: bytes, op: str) -> None:
        """Publish this member's descriptor, end the round, check everyone's."""
        size = validate.DESC_BYTES
        start = comm.desc_off + comm.parity * comm.n * size
        at = start + comm.rank * size
        self.map[at : at + size] = mine
        self._barrier(comm, op)
        everyone = self.map[start : start + comm.n * size]
        uniform = everyone == mine * comm.n
        # keyed by the communicator's size too: a call checked within a group of 2 is
        # not checked for the 4 workers of the world (an outside check: an allgather
        # whose dst held 2 x src got past, and failed as a bare ValueError)
        key = (comm.n, mine)
        if uniform and key in self._checked:
            return  # the same call as one already checked, by every member alike
        raw = [everyone[k * size : (k + 1) * size] for k in range(comm.n)]
        validate.check(op, [validate.unpack(r) for r in raw], comm.members)
        if uniform:
            if len(self._checked) > 256:
                self._checked.clear()
            self._checked.add(key)

    def _comm(self, in_group: bool) -> _Comm:
        if self.i[0] and not self.broken:
            self._check_abort("collective")
        if self.broken:
            raise CCLError(
                f"the shm CCL is unusable after an earlier failure ({self.broken}); start a new session"
            )
        return self._group_comm if in_group else self._world_comm

    # ------------------------------------------------------------------ collectives
    def barrier(self, in_group: bool = False) -> None:
        comm = self._comm(in_group)
        self._slots(comm)
        self._exchange(comm, self._describe("barrier", None, None), "barrier")

    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        comm = self._comm(in_group)
        again = self._small.get((id(src), id(dst), op, in_group))
        if (
            again is not None and again[0] is src and again[1] is dst
            and src.shape == again[2] and dst.shape == again[3] and src.dtype is again[4]
            and dst.dtype is again[5] and src.strides == again[6] and dst.strides == again[7]
            and dst.flags.writeable
        ):  # fmt: skip
            return self._allreduce_again(comm, again)
        err = "" if op in _UFUNCS else f"unknown op {op!r}"
        name = f"allreduce:{op}"
        ufunc: Any = _UFUNCS.get(op)
        n, rank = comm.n, comm.rank
        # None where this member's arrays are unusable: the exchange raises before any use
        src_b: Any = None
        dst_b: Any = None
        total = 0
        if isinstance(src, np.ndarray) and isinstance(dst, np.ndarray) and not err:
            src_c = np.ascontiguousarray(src)
            src_b, total = validate.flat_bytes(src_c), src_c.nbytes
            dst_b = validate.flat_bytes(dst) if dst.flags.c_contiguous else None
        itemsize = src.dtype.itemsize if isinstance(src, np.ndarray) else 1
        if n == 1 and src_b is not None and dst_b is not None:
            # A communicator of one (a group of one, a session of one): the checks
            # every call gets, then the sum is the array itself.
            self._slots(comm)
            self._exchange(comm, self._describe(name, src, dst), name)
            if src_b.ctypes.data != dst_b.ctypes.data:
                dst_b[:total] = src_b
            return
        if src_b is not None and dst_b is not None and 0 < total <= min(comm.slot, _SMALL):
            # Small: one round trip. Every member reduces the whole array itself,
            # in rank order, straight into its dst (no second barrier).
            slots = self._slots(comm)
            slots[rank, :total] = src_b
            mine = self._describe(name, src, dst)
            self._exchange(comm, mine, name)
            out = dst_b.view(src.dtype)
            parts = [slots[k, :total].view(src.dtype) for k in range(n)]
            if n == 1:
                out[...] = parts[0]
            else:
                ufunc(parts[0], parts[1], out=out)
                for k in range(2, n):
                    ufunc(out, parts[k], out=out)
            if op == "avg":
                average_in_place(out, n)
            if type(src) is np.ndarray and type(dst) is np.ndarray and src_c is src and n > 1:
                self._remember_small(comm, src, dst, op, in_group, mine, name, total, out, ufunc)
            return
        # Large (or invalid): agree on the call and on where every array lives first.
        self._slots(comm)
        self._locate(comm, src, dst)
        self._exchange(comm, self._describe(name, src, dst, err), name)
        if total == 0:
            return
        locs = self._locations(comm)
        if all(s >= 0 and d >= 0 for s, d in locs):
            self._allreduce_in_place(comm, locs, total, src.dtype, ufunc, op, (src, dst))
            return
        # Staged: rounds of at most slot_bytes through the shared slots.
        chunk = comm.slot - comm.slot % itemsize
        off = 0
        while off < total:
            slots = self._slots(comm)
            c = min(chunk, total - off)
            slots[rank, :c] = src_b[off : off + c]
            self._barrier(comm, "allreduce")
            count = c // itemsize
            lo = (count * rank // n) * itemsize
            hi = (count * (rank + 1) // n) * itemsize
            if hi > lo:
                acc = slots[0, lo:hi].view(src.dtype)
                for k in range(1, n):
                    ufunc(acc, slots[k, lo:hi].view(src.dtype), out=acc)
                if op == "avg":
                    average_in_place(acc, n)
            self._barrier(comm, "allreduce")
            dst_b[off : off + c] = slots[0, :c]
            off += c

    def _remember_small(self, comm: _Comm, src: np.ndarray, dst: np.ndarray, op: str, in_group: bool, mine: bytes, name: str, total: int, out: np.ndarray, ufunc: Any) -> None:  # fmt: skip
        """Keep what a small allreduce of these very arrays needs again: a call in a
        loop then costs a copy in, the exchange and one ufunc per peer (~12 NumPy
        calls fewer). The arrays are held (so their ids stay theirs) and checked by
        identity, shapes, dtypes, strides (``arr.dtype = ...`` and ``arr.strides = ...``
        change an array in place) and writeability on every use; at most 32 are kept."""
        if len(self._small) >= 32:
            self._small.clear()
        n, rank, slot = comm.n, comm.rank, comm.slot
        size = n * slot
        mv = memoryview(self.map)
        rows, parts = [], []
        for start in (comm.data_off, comm.data_off + size):
            rows.append(mv[start + rank * slot : start + rank * slot + total])
            parts.append(tuple(
                self.buf[start + k * slot : start + k * slot + total].view(src.dtype)
                for k in range(n)
            ))  # fmt: skip
        src_bytes = memoryview(validate.flat_bytes(src))  # type: ignore[arg-type]  # (of bytes: bfloat16 has no buffer format)
        self._small[(id(src), id(dst), op, in_group)] = (
            src, dst, src.shape, dst.shape, src.dtype, dst.dtype, src.strides, dst.strides,
            src_bytes, rows, parts, out, ufunc, op == "avg", mine, name,
        )  # fmt: skip

    def _allreduce_again(self, comm: _Comm, again: tuple) -> None:
        """A small allreduce of arrays :meth:`_remember_small` kept: the same steps as
        the first call (copy in, exchange, reduce in rank order), from kept views."""
        _, _, _, _, _, _, _, _, src_bytes, rows, parts, out, ufunc, avg, mine, name = again
        comm.parity = parity = comm.chunks % 2
        comm.chunks += 1
        rows[parity][:] = src_bytes
        self._exchange(comm, mine, name)
        mine_parts = parts[parity]
        ufunc(mine_parts[0], mine_parts[1], out=out)
        for k in range(2, comm.n):
            ufunc(out, mine_parts[k], out=out)
        if avg:
            average_in_place(out, comm.n)

    def _allreduce_in_place(self, comm: _Comm, locs: list, total: int, dtype, ufunc, op, arrays: tuple) -> None:  # fmt: skip
        """Every array is in an arena: member r reduces piece r of every src straight
        into piece r of every dst (no staging copies), then all meet once more."""
        n, rank = comm.n, comm.rank
        srcs, dsts = [], []
        for worker, (s_off, d_off) in zip(comm.members, locs):
            arena = self._peer_arena(worker)
            srcs.append(arena[s_off : s_off + total].view(dtype))
            dsts.append(arena[d_off : d_off + total].view(dtype))
        count = total // dtype.itemsize
        lo, hi = count * rank // n, count * (rank + 1) // n
        step = max(1, _CHUNK // dtype.itemsize)
        tmp = np.empty(min(step, max(hi - lo, 1)), dtype)
        try:
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                t = tmp[: b - a]
                if n == 1:
                    t[...] = srcs[0][a:b]
                else:
                    ufunc(srcs[0][a:b], srcs[1][a:b], out=t)
                    for k in range(2, n):
                        ufunc(t, srcs[k][a:b], out=t)
                if op == "avg":
                    average_in_place(t, n)
                for d in dsts:  # all reads of this piece are done: src may be dst
                    d[a:b] = t
        except BaseException as exc:
            # This member's part failed (an error of the reduction, Ctrl-C on worker 0):
            # its peers still read and write its arrays until the round's end, and they
            # were freed and reused by its next call (an outside check: millions of
            # elements of that call's arrays overwritten)
            self._leave_after_peers(comm, exc, arrays)
            raise
        self._barrier(comm, "allreduce")  # nobody returns while others still use its arrays

    def _leave_after_peers(self, comm: _Comm, exc: BaseException, arrays: tuple) -> None:
        """This member's share failed: give the segment up (its peers' results lack that
        share: they must fail, not return them; a re-check caught a first version that
        arrived instead), then wait until every peer reached the round's end, or is
        lost, whatever aborts: their writes into this member's arrays end there. At
        most the CCL's timeout; past it (a frozen peer), ``arrays`` are kept for the
        CCL's life, so that their memory never goes to another array while a peer may
        still write into it. An interrupt (or a signal handler's exception) meanwhile
        is raised once the wait is over."""
        reason = f"worker {self._me}'s share of this allreduce raised {type(exc).__name__}: {exc}"
        self.broken = self.broken or reason
        abort_segment(self.map, self.layout, reason)
        target = (comm.round + 1) << _CALL_BITS  # the peers' arrival at the round's end
        record = self.layout.record
        q, words = self.q, self.i
        deadline = time.monotonic() + self.timeout
        pending: BaseException | None = None
        while True:
            try:
                seen = words[comm.bell]
                if all(
                    w == self._me or q[idx] >= target or q[record(w) + _LOST]
                    for idx, w in zip(comm.arrive, comm.members)
                ):
                    break
                if time.monotonic() >= deadline:
                    self._kept.append(arrays)
                    break
                _futex.wait(comm.bell_addr, seen, 0.01)
            except BaseException as err:  # noqa: BLE001 - raised below, once the wait is over
                pending = pending or err
        if pending is not None:
            raise pending

    def allgather(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        self._gather_like("allgather", comm, src, dst, to_all=True)

    def gather(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        self._gather_like("gather", comm, src, dst, to_all=False)

    def _gather_like(self, name: str, comm: _Comm, src: Any, dst: Any, to_all: bool) -> None:
        rank, n = comm.rank, comm.n
        receives = to_all or rank == 0
        src_b: Any = (
            validate.flat_bytes(np.ascontiguousarray(src)) if isinstance(src, np.ndarray) else None
        )
        dst_b: Any = None
        if receives and isinstance(dst, np.ndarray) and dst.flags.c_contiguous:
            dst_b = validate.flat_bytes(dst)
        piece = src_b.nbytes if src_b is not None else 0
        off, first = 0, True
        while first or off < piece:
            slots = self._slots(comm)
            c = min(comm.slot, piece - off)
            if c > 0:
                slots[rank, :c] = src_b[off : off + c]
            if first:
                self._exchange(comm, self._describe(name, src, dst if receives else None), name)
                first = False
            else:
                self._barrier(comm, name)
            if c > 0 and receives:
                for k in range(n):
                    dst_b[k * piece + off : k * piece + off + c] = slots[k, :c]
            off += c
            if c <= 0:
                break

    def broadcast(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        root = comm.rank == 0
        src_b: Any = (
            validate.flat_bytes(np.ascontiguousarray(src))
            if root and isinstance(src, np.ndarray)
            else None
        )
        dst_b: Any = (
            validate.flat_bytes(dst)
            if isinstance(dst, np.ndarray) and dst.flags.c_contiguous
            else None
        )
        total = dst_b.nbytes if dst_b is not None else 0
        if comm.n == 1 and src_b is not None and dst_b is not None and src_b.nbytes == total:
            # A communicator of one: the checks every call gets, then a copy (if any).
            self._slots(comm)
            self._exchange(comm, self._describe("broadcast", src, dst), "broadcast")
            if src_b.ctypes.data != dst_b.ctypes.data:
                dst_b[:] = src_b
            return
        cap = comm.n * comm.slot
        off, first = 0, True
        while first or off < total:
            slots = self._slots(comm).reshape(-1)
            c = min(cap, total - off)
            if root and c > 0 and src_b is not None and src_b.nbytes == total:
                slots[:c] = src_b[off : off + c]
            if first:
                self._exchange(
                    comm, self._describe("broadcast", src if root else None, dst), "broadcast"
                )
                first = False
            else:
                self._barrier(comm, "broadcast")
            if c > 0:
                if root:
                    if src_b.ctypes.data != dst_b.ctypes.data:
                        dst_b[off : off + c] = src_b[off : off + c]
                else:
                    dst_b[off : off + c] = slots[:c]
            off += c
            if c <= 0:
                break

    def scatter(self, src: Any, dst: Any, in_group: bool) -> None:
        comm = self._comm(in_group)
        root, n = comm.rank == 0, comm.n
        src_b: Any = (
            validate.flat_bytes(np.ascontiguousarray(src))
            if root and isinstance(src, np.ndarray)
            else None
        )
        dst_b: Any = (
            validate.flat_bytes(dst)
            if isinstance(dst, np.ndarray) and dst.flags.c_contiguous
            else None
        )
        piece = dst_b.nbytes if dst_b is not None else 0
        ok_src = src_b is not None and src_b.nbytes == n * piece
        off, first = 0, True
        while first or off < piece:
            slots = self._slots(comm)
            c = min(comm.slot, piece - off)
            if root and c > 0 and ok_src:
                for k in range(1, n):
                    slots[k, :c] = src_b[k * piece + off : k * piece + off + c]
            if first:
                self._exchange(
                    comm, self._describe("scatter", src if root else None, dst), "scatter"
                )
                first = False
            else:
                self._barrier(comm, "scatter")
            if c > 0:
                if root:
                    dst_b[off : off + c] = src_b[off : off + c]
                else:
                    dst_b[off : off + c] = slots[comm.rank, :c]
            off += c
            if c <= 0:
                break

    # ------------------------------------------------------------------ point to point
    def _check_peer(self, peer: Any, what: str) -> int:
        n = self.layout.num_workers
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise CCLError(f"{what}: the peer must be a worker id (int), got {peer!r}")
        if not 0 <= peer < n:
            raise CCLError(f"{what}: worker {peer} is out of range for {n} workers")
        if peer == self._me:
            raise CCLError(f"{what}: worker {peer} cannot send to or receive from itself")
        return int(peer)

    def _mbox(self, sender: int, receiver: int) -> tuple[int, int, int, int, int]:
        """The mailbox of ``sender`` -> ``receiver``: its bell (an index of ``self.i``)
        and that bell's address, its ``sent`` and ``acked`` piece counters (indices of
        ``self.q``), and the byte offset of its first piece's head."""
        base = self.layout.mailbox(sender, receiver)
        return base // 4, self.base_addr + base, (base + _LINE) // 8, (base + 2 * _LINE) // 8, base + 3 * _LINE  # fmt: skip

    def _piece(self, heads: int, k: int) -> tuple[int, int]:
        """Piece ``k`` (a count of pieces sent) of the mailbox whose first head is at
        ``heads``: the byte offsets of its head and of its data."""
        slot = k % _MB_SLOTS
        return heads + slot * _MB_HEAD, heads + _MB_SLOTS * _MB_HEAD + slot * self.layout.mbox_piece  # fmt: skip

    # Sends and receives pair in order. Once a call failed on one end of a pair, a send
    # or a receive it skipped shifts that order: a receive took the message of the
    # sender's next call as its value (an outside check: 6 of 6), or the message meant
    # for a receive that never ran. Each piece's head carries the call it was sent in
    # and the sender's last failed call then (its first two words; the message's
    # descriptor follows in its first piece). Where such a message may belong to
    # another receive (:func:`validate.p2p_order_lost`), the pair's mailbox is given up
    # (every later send and receive between them fails at once, naming why).
    _MB_BROKEN = 1  # word after ``sent``: 1 once the pair was given up
    # Words where an end says it may sleep (``_wait``'s ``asleep``), each on the line
    # that end writes: the sender's after ``sent``, the receiver's after ``acked``. A
    # wake is a syscall (~1-2 us on each send and receive otherwise).
    _MB_SENDER_ASLEEP, _MB_RECEIVER_ASLEEP = 2, 1

    def _send_desc(self, buf: Any) -> tuple[bytes, str]:
        """The packed descriptor a send of ``buf`` puts in front of its message, and
        its error (``""``: none); cached for plain arrays, by dtype and shape (all it
        depends on), so a receive can also tell at a glance whether a message is what
        its own buffer expects."""
        key = None
        if type(buf) is np.ndarray:
            key = (buf.dtype, buf.shape)
            packed = self._send_descs.get(key)
            if packed is not None:
                return packed, ""
        desc = validate.describe_send(buf)
        packed = validate.pack(desc)
        if key is not None and not desc.status:
            if len(self._send_descs) > 256:
                self._send_descs.clear()
            self._send_descs[key] = packed
        return packed, desc.error

    def send(self, buf: Any, peer: int) -> None:
        if self.broken:
            self._comm(False)
        peer = self._check_peer(peer, "send_to_worker")
        bell, addr, sent_i, acked_i, heads = self._mbox(self._me, peer)
        q = self.q
        if q[sent_i + self._MB_BROKEN]:
            raise CCLError(f"send_to_worker: {self._pair_given_up(self._me, peer)}")
        packed, refused = self._send_desc(buf)
        src_b: Any = validate.flat_bytes(np.ascontiguousarray(buf)) if not refused else None
        total = src_b.nbytes if src_b is not None else 0
        cap = self.layout.mbox_piece
        pieces = max(1, -(-total // cap))  # (an empty or refused message: its head alone)
        call, failed = self.ctx.calls, self._failed_call
        done = 0
        while done < pieces:
            posted = self._sent[peer]
            head, data = self._piece(heads, posted)

            def ready(oldest: int = posted - _MB_SLOTS) -> bool:
                return q[acked_i] > oldest  # (the piece this one replaces was taken)

            # (until ready, this head is the oldest piece's, which the receiver must take)
            self._wait(ready, bell, addr, "send_to_worker", lambda: [peer], sent_i + self._MB_SENDER_ASLEEP, pair=(peer, sent_i, True, head // 8))  # fmt: skip
            # the pieces there is room for, up to half the ring (the receiver copies
            # one half while this copies into the other), in one copy
            slot = posted % _MB_SLOTS
            k = min(q[acked_i] + _MB_SLOTS - posted, _MB_BATCH - slot % _MB_BATCH, pieces - done)
            if not done:
                self.map[head + _LINE : head + _MB_HEAD] = packed
            at = head // 8
            for _ in range(k):
                q[at] = call
                q[at + 1] = failed
                at += _MB_HEAD // 8
            lo, hi = done * cap, min(total, (done + k) * cap)
            if hi > lo:
                self.buf[data : data + hi - lo] = src_b[lo:hi]
            self._sent[peer] = posted + k
            q[sent_i] = posted + k
            self._ring(bell, addr, [acked_i + self._MB_RECEIVER_ASLEEP])
            if refused:
                raise CCLError(f"send_to_worker: {refused}")
            done += k

    def _pair_given_up(self, sender: int, receiver: int) -> str:
        return (
            f"sends from worker {sender} to worker {receiver} were given up after a failed "
            "call on one of them (which receive a message belonged to could not be told); "
            "start a new session"
        )

    def _give_up_pair(self, sender: int, receiver: int, why: str) -> None:
        """Mark the mailbox of ``sender`` -> ``receiver`` given up, wake both, and raise."""
        bell, addr, sent_i, _acked_i, _heads = self._mbox(sender, receiver)
        self.q[sent_i + self._MB_BROKEN] = 1
        self._ring(bell, addr)
        op = "send_to_worker" if sender == self._me else "recv_from_worker"
        raise CCLError(f"{op}: {why}; {self._pair_given_up(sender, receiver)}")

    def _pair_gone(self, peer: int, sent_i: int, sending: bool, head_word: int, ready) -> None:
        """For a send waiting for room in the mailbox (``sending``; ``head_word``: the
        first word of the oldest piece's head) or a receive waiting for a message, not
        ``ready()``: give the pair up once ``peer`` failed in or after the call it
        waits on (the oldest piece's, or this receive's), or failed in the
        call before it (a send or receive of the adjacent command skipped) and has
        ended that call without what is waited for; raise once ``peer`` gave it up."""
        # The peer's failure record first, then ready(): the peer writes its record
        # after its send (or its taking of the message), so not ready() after the read
        # proves the message was not sent (taken) before the failure. In the other
        # order, a send followed by a failure between the two reads gave a good pair
        # up (an outside check: 1 in ~4,700 calls).
        failed, _w, _g, error = self._failure(peer)
        if ready():
            return
        sender, receiver = (self._me, peer) if sending else (peer, self._me)
        q = self.q
        if q[sent_i + self._MB_BROKEN]:
            op = "send_to_worker" if sending else "recv_from_worker"
            raise CCLError(f"{op}: {self._pair_given_up(sender, receiver)}")
        if not failed:
            return
        call = q[head_word] if sending else self.ctx.calls
        what = f"taking this worker's message of call {call}" if sending else f"sending the message of call {call}"  # fmt: skip
        if failed >= call:
            self._give_up_pair(sender, receiver, f"worker {peer} failed in call {failed} without {what} ({error})")  # fmt: skip
        if failed == call - 1 and q[self.layout.record(peer) + _DONE] >= call and not ready():
            self._give_up_pair(sender, receiver, (
                f"worker {peer} failed in call {failed} and ended call {call} without {what} ({error})"
            ))  # fmt: skip

    def _check_pairing(self, peer: int, head_word: int) -> None:
        """Once some call failed: give the pair up when the message in hand (its first
        piece's head at ``head_word``) may not be this receive's (see the comment above
        ``send``)."""
        q, call = self.q, self.ctx.calls
        theirs = q[head_word]
        sender_failed = q[head_word + 1]
        lost = validate.p2p_order_lost(theirs, sender_failed, call, self._failed_call)
        if lost == "sender":
            _c, _w, _g, error = self._failure(peer)
            self._give_up_pair(peer, self._me, (
                f"this receive (call {call}) met worker {peer}'s message of call {theirs}, "
                f"sent after it failed in call {sender_failed}" + (f" ({error})" if error else "")
            ))  # fmt: skip
        if lost == "receiver":
            self._give_up_pair(peer, self._me, (
                f"this receive (call {call}) met worker {peer}'s message of call {theirs}, "
                f"after worker {self._me} failed in call {self._failed_call}"
            ))  # fmt: skip

    def recv(self, buf: Any, peer: int) -> None:
        if self.broken:
            self._comm(False)
        peer = self._check_peer(peer, "recv_from_worker")
        bell, addr, sent_i, acked_i, heads = self._mbox(peer, self._me)
        q = self.q
        if q[sent_i + self._MB_BROKEN]:
            raise CCLError(f"recv_from_worker: {self._pair_given_up(peer, self._me)}")

        def take() -> tuple[int, int, int]:
            """Wait for the next piece; its head's and data's offsets, and the pieces
            there are from it on."""
            got = self._recvd[peer]

            def ready() -> bool:
                return q[sent_i] > got

            self._wait(ready, bell, addr, "recv_from_worker", lambda: [peer], acked_i + self._MB_RECEIVER_ASLEEP, pair=(peer, sent_i, False, 0))  # fmt: skip
            return (*self._piece(heads, got), q[sent_i] - got)

        head, data, ready_pieces = take()
        if self.i[_FAILS]:
            self._check_pairing(peer, head // 8)
        theirs_packed = self.map[head + _LINE : head + _MB_HEAD]
        # what a send of an array like buf puts there, when it is no refusal (a send of
        # an array in the other byte order packs the same refusal as a receive's
        # buffer like it: an outside check, whose receive took stale bytes as a value)
        like, refused = self._send_desc(buf) if type(buf) is np.ndarray else (b"", "?")
        if not refused and buf.flags.c_contiguous and buf.flags.writeable and theirs_packed == like:  # fmt: skip
            error, total = "", buf.nbytes
        else:
            theirs = validate.unpack(theirs_packed)
            error = validate.check_p2p(peer, theirs, validate.describe_recv(buf))
            total = 0 if theirs.status else theirs.src[2]
        dst_b: Any = validate.flat_bytes(buf) if not error else None
        cap = self.layout.mbox_piece
        pieces = max(1, -(-total // cap))
        done = 0
        while done < pieces:
            if done:
                head, data, ready_pieces = take()
            # the pieces of this message that are there, up to half the ring, in one copy
            got = self._recvd[peer]
            k = min(ready_pieces, _MB_BATCH - got % _MB_BATCH, pieces - done)
            lo, hi = done * cap, min(total, (done + k) * cap)
            if hi > lo and not error:
                dst_b[lo:hi] = self.buf[data : data + hi - lo]
            self._recvd[peer] = got + k
            q[acked_i] = got + k
            self._ring(bell, addr, [sent_i + self._MB_SENDER_ASLEEP])
            done += k
        if error:  # the whole message was drained, so the sender is free
            raise CCLError(f"recv_from_worker: {error}")

    def close(self) -> None:
        if self.ctx.on_call_end == self._publish_call_end:
            self.ctx.on_call_end = None
        self._kept.clear()  # (no later call of this CCL can get their memory now)
        self.arena.close()
        self._peers.clear()
        for kept in self._small.values():
            for row in kept[6]:
                row.release()  # views of the segment: the map closes only without any
        self._small.clear()
        self.q.release()
        self.i.release()
        self.buf = None  # type: ignore[assignment]  # closed: nothing reads it any more
        try:
            self.map.close()
        except BufferError:
            pass
