"""``init_ccl("threads")``: collectives for workers that are threads of one process.

Every worker's half (:class:`ThreadCCL`) meets its peers on a :class:`Board`, an
object the controller's half (:meth:`ThreadCCL.rendezvous`) made in the same
process. A collective is one *exchange*: each member posts a descriptor of its
arguments and a copy of its data, waits until every member has posted, checks
everyone's descriptors with the same code (so every member raises the same
error, or none does) and only then computes its own result from the copies.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from disco_core import CCLError, CCLTimeoutError, DiscoValueError
from disco_core.spi import CCL, REDUCE_OPS, Rendezvous, average_in_place, validate

__all__ = ["Board", "BoardRendezvous", "ThreadCCL"]

_BOARDS: dict[str, Board] = {}  # the live boards of this process, by their key
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}


class _Round:
    """One collective of one communicator: the members' posts, by rank."""

    def __init__(self, n: int) -> None:
        self.posts: list[Any] = [None] * n
        self.arrived = self.taken = 0


class Board:
    """Where the workers of one session meet: rounds of collectives, and mailboxes.

    Parameters
    ----------
    timeout : float
        Seconds an operation waits for its peers before it fails everywhere.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cond = threading.Condition()
        self.rounds: dict[tuple, _Round] = {}  # (members, sequence number) -> round
        self.mail: defaultdict[tuple[int, int], deque] = defaultdict(deque)  # (from, to)
        self.broken = ""  # why every operation fails from now on; "" while usable
        self.timed_out = False

    def abort(self, reason: str, timed_out: bool = False) -> None:
        """Make every operation, waiting or future, fail (a peer died, or timed out)."""
        with self.cond:
            if not self.broken:
                self.broken, self.timed_out = reason, timed_out
            self.cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str, late: Callable[[], list]) -> None:
        """Wait, holding ``cond``, until ``ready()``; raise if the board breaks first."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self.broken:
                raise (CCLTimeoutError if self.timed_out else CCLError)(f"{what}: {self.broken}")
            if ready():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                # What we posted stays behind, so no later operation could be matched
                # safely: the board breaks for every member.
                self.abort(f"waited {self.timeout:g} s for worker(s) {late()}", timed_out=True)
            else:
                self.cond.wait(left)

    def exchange(self, members: tuple[int, ...], seq: int, rank: int, post: Any, what: str) -> list:
        """Post this member's ``post`` for round ``seq``; return every member's, by rank."""
        key = (members, seq)
        with self.cond:
            rnd = self.rounds.setdefault(key, _Round(len(members)))
            rnd.posts[rank] = post
            rnd.arrived += 1
            self.cond.notify_all()

            def late() -> list[int]:
                return [w for w, p in zip(members, rnd.posts) if p is None]

            self._wait(lambda: rnd.arrived == len(members), what, late)
            rnd.taken += 1
            if rnd.taken == len(members):  # the last reader clears the round
                del self.rounds[key]
            return rnd.posts

    def put(self, sender: int, receiver: int, post: Any) -> None:
        """Leave ``post`` in the mailbox from ``sender`` to ``receiver``; never waits."""
        with self.cond:
            self.mail[(sender, receiver)].append(post)
            self.cond.notify_all()

    def take(self, sender: int, receiver: int, what: str) -> Any:
        """The oldest post from ``sender`` to ``receiver``; waits for one."""
        with self.cond:
            box = self.mail[(sender, receiver)]
            self._wait(lambda: bool(box), what, lambda: [sender])
            return box.popleft()


class BoardRendezvous(Rendezvous):
    """The controller's half: a new :class:`Board`, whose key is the payload."""

    def __init__(self, timeout: float) -> None:
        super().__init__(payload=uuid.uuid4().hex)
        self.board = _BOARDS[self.payload] = Board(timeout)

    def abort(self, reason: str) -> None:
        self.board.abort(reason)

    def close(self) -> None:
        self.board.abort("the session is closed")
        _BOARDS.pop(self.payload, None)


class ThreadCCL(CCL):
    """The worker's half. ``init_ccl("threads", timeout=60.0)``."""

    name = "threads"

    @classmethod
    def rendezvous(
        cls, channel: Any, device_ids: Sequence[int] = (), timeout: float = 60.0
    ) -> Rendezvous:
        if not timeout > 0:
            raise DiscoValueError(f"init_ccl('threads'): timeout must be positive, got {timeout!r}")
        return BoardRendezvous(float(timeout))

    @classmethod
    def preflight(cls, ctx: Any, payload: Any, device_ids: Sequence[int], **options: Any) -> None:
        # A worker in another process cannot see the board: say so on that worker,
        # before any worker starts waiting for its peers.
        if payload not in _BOARDS:
            raise CCLError(
                f"the threads CCL needs workers that are threads of the controller's process "
                f"(ThreadedSession); worker {ctx.worker_id} runs in process {os.getpid()}"
            )

    def __init__(self, ctx: Any, payload: Any, device_ids: Sequence[int] = (), **options: Any):
        super().__init__(ctx, payload, device_ids)
        self.board = _BOARDS[payload]
        self.seq: defaultdict[tuple, int] = defaultdict(int)  # rounds taken, per communicator

    def _round(self, op: str, src: Any, dst: Any, in_group: bool, data: bool, error: str = ""):
        """Exchange descriptors (and copies of ``src`` when ``data``); check them everywhere."""
        members = tuple(self.members(in_group))
        rank = members.index(self.ctx.worker_id)
        desc = validate.describe(op, src, dst, error=error)
        # A copy, since our caller may change src as soon as we return. A member whose
        # arguments are wrong (a failed register) still posts: its peers must not wait.
        copy = np.array(src, order="C") if data and not desc.status else None
        self.seq[members] += 1
        posts = self.board.exchange(members, self.seq[members], rank, (desc, copy), op)
        validate.check(op, [d for d, _ in posts], members)  # the same verdict on every member
        return [x for _, x in posts], rank

    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        error = "" if op in REDUCE_OPS else f"unknown op {op!r}, expected one of {REDUCE_OPS}"
        xs, _ = self._round(f"allreduce:{op}", src, dst, in_group, True, error)
        with np.errstate(all="ignore"):  # integers wrap around, as in every CCL
            total = np.asarray(functools.reduce(_UFUNCS[op], xs))  # in rank order
        if op == "avg":
            average_in_place(total, len(xs))
        dst[...] = total.reshape(dst.shape)

    def allgather(self, src: Any, dst: Any, in_group: bool) -> None:
        xs, _ = self._round("allgather", src, dst, in_group, True)
        validate.flat_bytes(dst)[:] = np.concatenate([validate.flat_bytes(x) for x in xs])

    def broadcast(self, src: Any, dst: Any, in_group: bool) -> None:
        root = self.ctx.worker_id == self.members(in_group)[0]
        xs, _ = self._round("broadcast", src, dst, in_group, root)
        validate.flat_bytes(dst)[:] = validate.flat_bytes(xs[0])

    def scatter(self, src: Any, dst: Any, in_group: bool) -> None:
        root = self.ctx.worker_id == self.members(in_group)[0]
        xs, rank = self._round("scatter", src, dst, in_group, root)
        k = dst.nbytes
        validate.flat_bytes(dst)[:] = validate.flat_bytes(xs[0])[rank * k : (rank + 1) * k]

    def gather(self, src: Any, dst: Any, in_group: bool) -> None:
        xs, rank = self._round("gather", src, dst, in_group, True)
        if rank == 0:
            validate.flat_bytes(dst)[:] = np.concatenate([validate.flat_bytes(x) for x in xs])

    def barrier(self, in_group: bool = False) -> None:
        self._round("barrier", None, None, in_group, False)

    def _peer(self, peer: Any, what: str) -> int:
        n = self.ctx.num_workers
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < n:
            raise CCLError(f"{what}: peer {peer!r} is out of range (workers 0..{n - 1})")
        if peer == self.ctx.worker_id:
            raise CCLError(f"{what}: worker {peer} cannot {what} to or from itself")
        return int(peer)

    def send(self, buf: Any, peer: int) -> None:
        peer = self._peer(peer, "send")
        desc = validate.describe_send(buf)
        # Posted even when buf is a failed register: the receiver learns why, and fails too.
        self.board.put(self.ctx.worker_id, peer, (desc, None if desc.status else np.array(buf)))
        if desc.status:
            raise CCLError(f"send to worker {peer}: {desc.error}")

    def recv(self, buf: Any, peer: int) -> None:
        peer = self._peer(peer, "recv")
        mine = validate.describe_recv(buf)
        theirs, data = self.board.take(peer, self.ctx.worker_id, f"recv from worker {peer}")
        error = validate.check_p2p(peer, theirs, mine)  # after taking it: the sender is free
        if error:
            raise CCLError(f"recv from worker {peer}: {error}")
        validate.flat_bytes(buf)[:] = validate.flat_bytes(np.ascontiguousarray(data))
