"""The control plane: the :class:`Channel` interface every channel implements.

A channel carries commands from the controller to its workers and replies back.
The :class:`~disco_core.Session` only ever talks to this interface; it never knows
whether its workers are threads, processes or other machines.

Most channels are a list of *links* (one per worker, or one per remote node that
relays to several workers) plus a :class:`ReplyHub` where replies and asynchronous
error reports arrive. :class:`LinkChannel` implements the interface on top of
them; :class:`ThreadWorkerLink` is the in-process link every session uses for
worker 0.
"""

from __future__ import annotations

import _thread
import abc
import collections
import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import queue
import select
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident as _get_ident  # one lookup less on every drain
from typing import Any, cast

from .. import _interrupts, protocol
from .._interrupts import state as _held
from .._locks import counts as lock_counts
from .._locks import owned, release_if_left, release_to
from ..errors import (
    DiscoError,
    DiscoTimeoutError,
    SessionClosedError,
    WorkerDiedError,
    WorkerError,
    WorkerUnresponsiveError,
)
from ..net.io import STALL_CHECK
from ..protocol import FLAG_BATCH, Frame, encode, frame_head, isolate, isolate_command, write_all
from ..settings import env_seconds, env_seconds_or_default
from ..store import ControllerStore, NoStore
from ..wire_values import check_rebuildable, encode_for_network
from ..worker import Worker, set_current

logger = logging.getLogger("disco_core.channels")

__all__ = [
    "Channel",
    "Outgoing",
    "ANSWERED",
    "ReplyHub",
    "WorkerLink",
    "BatchingLink",
    "LinkChannel",
    "ThreadWorkerLink",
    "ReaderGate",
    "check_untrusted",
    "liveness_timeout",
    "gather_timeout",
]


def liveness_timeout() -> float:
    """Seconds a process or socket worker may send nothing while the controller waits.

    ``$DISCO_LIVENESS_TIMEOUT``, default 10; 0 turns the check off. Workers send a
    heartbeat whenever they have sent nothing for a second, so only a worker that
    is stopped, frozen, swapped out or holding the GIL that long goes silent.
    """
    return env_seconds("DISCO_LIVENESS_TIMEOUT", 10.0)


def gather_timeout() -> float:
    """Seconds the controller gathers the workers' reports after a failure.

    ``$DISCO_GATHER_TIMEOUT``, default 60: long enough for collectives that are
    legitimately slow; a worker that has not caught up by then is unresponsive. A
    bad value is refused when a session starts (:meth:`LinkChannel._set_links`);
    here, in the middle of a failure's report, it warns and gives the default: an
    error about the setting raised there lost the workers' own (an outside check).
    """
    return env_seconds_or_default("DISCO_GATHER_TIMEOUT", 60.0) or 60.0


#: Pickles for worker processes: a value of the controller's ``__main__`` is refused.
_encode_for_workers = functools.partial(encode, for_worker_process=True)


class Outgoing:
    """One command on its way to several workers; encoded at most once.

    Parameters
    ----------
    cmds : tuple of tuple
        The commands, in order (usually one; freed registers ride along with the next).
    by_reference : bool
        In-process workers get ``cmd`` itself rather than a private copy (used for
        the host arrays of ``copy_to/from_worker_0``, which worker 0 reads or writes
        in place).
    shared : bool
        Every value in the commands is immutable (ints, strs, handles...): in-process
        workers may take them as they are, and a channel may encode them later,
        together with the commands that follow (:meth:`LinkChannel.send`).
    """

    __slots__ = ("cmds", "by_reference", "shared", "owner", "_frame", "_wire_frame")

    def __init__(
        self, *cmds: tuple, by_reference: bool = False, shared: bool = False, owner: Any = None
    ) -> None:
        self.cmds = cmds
        self.by_reference = by_reference
        self.shared = shared
        #: The session sending the commands. A handle of another session nested in a
        #: value is refused as they are encoded (``protocol.SENDER``); None checks nothing.
        self.owner = owner
        self._frame: Frame | None = None
        self._wire_frame: Frame | None = None

    @property
    def flags(self) -> int:
        return FLAG_BATCH if len(self.cmds) > 1 else 0

    def _encoded(self, encoder: Callable[[Any], Frame]) -> Frame:
        """The command(s) as one frame by ``encoder``, a handle of another session refused."""
        cmds = self.cmds if len(self.cmds) > 1 else self.cmds[0]
        if self.shared or self.owner is None:
            # the hot path (batches of plain commands): no handle nested in a value
            return encoder(cmds)
        token = protocol.SENDER.set(self.owner)
        try:
            return encoder(cmds)
        finally:
            protocol.SENDER.reset(token)

    @property
    def frame(self) -> Frame:
        """The serialised command(s) (pickle header + out-of-band buffers), one frame."""
        if self._frame is None:
            self._frame = self._encoded(encode if self.shared else _encode_for_workers)
        return self._frame

    @property
    def wire_frame(self) -> Frame:
        """The command(s) as one frame in the tagged network format.

        For a link that crosses a network (:attr:`WorkerLink.untrusted`), whose
        workers rebuild it with :func:`~disco_core.wire_values.decode_untrusted`,
        which unpickles nothing.

        Raises
        ------
        DiscoTypeError
            A value in the commands cannot cross a network link (it names the type).
        """
        if self._wire_frame is None:
            self._wire_frame = self._encoded(encode_for_network)
        return self._wire_frame

    def frame_for(self, link: WorkerLink) -> Frame:
        """:attr:`wire_frame` for a link whose workers decode untrusted, else :attr:`frame`."""
        return self.wire_frame if link.untrusted else self.frame

    def local(self) -> tuple:
        """The commands for an in-process worker: its own copy of every mutable value."""
        if self.by_reference or self.shared:
            return self.cmds
        token = protocol.SENDER.set(self.owner)
        try:
            return tuple([isolate_command(c) for c in self.cmds])
        finally:
            protocol.SENDER.reset(token)


def _reads_pickles(link: WorkerLink) -> bool:
    """Whether ``link``'s workers are processes that rebuild commands from pickles."""
    return not link.in_process and not link.untrusted


def check_untrusted(out: Outgoing, links: Iterable[WorkerLink]) -> None:
    """Refuse ``out`` for ``links`` when one of them has :attr:`WorkerLink.untrusted`
    workers and a value in it cannot cross a network link.

    Such a worker cannot skip a command it cannot read (what follows may use the
    register it never filled): it ends, and the session with it. Checked here, before
    any link gets the command (by encoding it: :attr:`Outgoing.wire_frame`), the
    mistake is a :class:`DiscoTypeError` at the call, and a value that the worker would
    refuse for the memory it takes (:func:`~disco_core.wire_values.check_rebuildable`)
    a :class:`DiscoValueError`. Values that are all plain
    (``out.shared``) need no check.
    """
    if out.shared or not any(link.untrusted for link in links):
        return
    check_rebuildable(out.wire_frame)  # encoding raises DiscoTypeError, naming the type


class Channel(abc.ABC):
    """The control plane of one session.

    Attributes
    ----------
    num_workers, num_groups : int
        The session's shape.
    num_nodes : int
        How many machines the workers span (1 for threaded and process channels).
    shares_memory : bool
        True when every worker runs on the controller's machine (the ``shm`` CCL
        needs it).
    """

    num_workers: int
    num_groups: int
    num_nodes: int = 1
    shares_memory: bool = True
    kind: str = "?"
    #: True when a worker of the controller's process has more commands waiting than
    #: it may (``PENDING_COMMANDS``): the session then calls :meth:`catch_up` before
    #: its next send, outside its own lock (a shutdown from another thread goes on).
    backlogged: bool = False

    def catch_up(self) -> None:
        """Run what the workers of the controller's process have waiting, on this thread.

        The default does nothing (a channel whose workers all live elsewhere: a full
        pipe or socket makes the controller wait instead).
        """

    @abc.abstractmethod
    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        """Send a command to ``workers`` (all when None), in order, without waiting."""

    @abc.abstractmethod
    def recv(self, worker_id: int, timeout: float | None = None) -> Any:
        """Wait for the next reply of ``worker_id``.

        Parameters
        ----------
        timeout : float, optional
            Give up after this many seconds (the controller gathering reports
            after a failure); None waits as long as the workers live.

        Raises
        ------
        WorkerError
            The worker answered with the failure of the synchronous command.
        WorkerDiedError
            A worker of the session died (or stopped answering:
            :class:`WorkerUnresponsiveError`) while waiting.
        DiscoTimeoutError
            ``timeout`` passed with no reply.
        """

    def send_shared(self, cmds: tuple[tuple, ...]) -> None:
        """Send commands whose values are all immutable to every worker, without waiting.

        The hot path of every session (``call_packed``). The default is
        :meth:`send`; a channel may take the commands as they are, without an
        :class:`Outgoing` (see :meth:`LinkChannel.send_shared`).
        """
        self.send(Outgoing(*cmds, shared=True))

    def sync(self, worker_id: int) -> None:
        """Wait until ``worker_id`` has run every command sent to it so far.

        What TVM's ``SyncWorker`` command does, and the default is that command
        and its reply. A channel may do it faster for a worker in this process.
        Raises as :meth:`recv` does.
        """
        self.send(Outgoing((protocol.SYNC_WORKER, worker_id), shared=True), [worker_id])
        self.recv(worker_id)

    def fence(self, worker_ids: Iterable[int]) -> None:
        """Before a command that ``worker_ids`` answer: make sure no wait takes an answer
        that an earlier, abandoned call asked for (see :class:`ReplyHub`).

        The session calls it only for a channel with a ``hub`` whose ``unfenced``
        workers are not empty; :class:`LinkChannel` implements it. The default does
        nothing (a channel without a hub keeps its own order).
        """

    def settle(self, timeout: float = 1.0) -> None:
        """Deliver every reply and error report the workers have already sent.

        Called before the controller looks at the pending errors, so that an
        error a worker reported before the controller's wait ended is never left
        in a pipe or a reader's buffer. Waits at most ``timeout`` seconds.
        Channels whose workers deliver synchronously need not override it.
        """

    #: True when every worker reaches the session's rendezvous store (``ctx.store``).
    has_store: bool = False

    def attach_store(self, store: ControllerStore) -> None:
        """Let every worker reach ``store``, the session's rendezvous store.

        Called once by the :class:`~disco_core.Session`, before any command. The
        default attaches nothing: the workers' ``ctx.store`` says there is none.
        """

    def mark_unresponsive(self, worker_ids: Sequence[int], reason: str) -> None:
        """End the session for ``worker_ids``, which stopped answering (as if they died)."""
        raise NotImplementedError(f"{type(self).__name__} cannot mark workers unresponsive")

    @abc.abstractmethod
    def take_errors(self) -> list[WorkerError]:
        """Remove and return the asynchronous errors reported so far."""

    @abc.abstractmethod
    def check_alive(self) -> None:
        """Raise :class:`WorkerDiedError` when a worker is known to be dead."""

    @abc.abstractmethod
    def on_worker_death(self, callback: Callable[[list[int], str], None]) -> None:
        """Call ``callback(worker_ids, reason)`` (once) when workers die."""

    @abc.abstractmethod
    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker (the shutdown command has been sent); kill laggards."""


#: The commands a worker answers (one ``reply`` or ``fail`` each, in order).
ANSWERED = frozenset(
    {
        protocol.SYNC_WORKER,
        protocol.COPY_FROM_WORKER0,
        protocol.COPY_TO_WORKER0,
        protocol.DEBUG_GET_FROM_REMOTE,
        protocol.DEBUG_SET_REGISTER,
    }
)


def _worker_error(worker_id: int, payload: Any, kind: str) -> WorkerError:
    """``payload`` of a ``fail`` or ``error`` message, if it is a worker error.

    Anything else (from a peer across a network: a forged ``WorkerDiedError``, a
    value that is not an exception, an error in another worker's name) becomes a
    worker error of the sender's that says so: it is raised at the caller as a
    failure of that worker, never as itself, and the errors of later calls stay
    readable (outside checks).
    """
    if isinstance(payload, WorkerError):
        if payload.worker_id == worker_id and not payload.others:
            return payload  # (a worker reports its own error; others are joined here)
        if payload.worker_id != worker_id:
            what = f"an error in the name of worker {payload.worker_id}"
        else:
            what = "an error carrying other workers' errors"
    else:
        what = f"a {kind!r} message without a worker error in it (it held a value of type {type(payload).__name__})"  # fmt: skip
    return WorkerError(
        worker_id, "UntrustedValueError", f"worker {worker_id} sent {what}: the message was refused"
    )


class ReplyHub:
    """Where replies and asynchronous error reports of all workers arrive.

    A worker answers each of its synchronous commands (``ANSWERED``) with
    exactly one ``reply`` or ``fail``, in order, and a wait takes the next one.
    A synchronous call left by an exception (Ctrl-C's ``KeyboardInterrupt``, a
    signal handler's error, a failure), or a worker given up on, may leave
    answers in flight that nobody will take: :meth:`abandon` marks those workers,
    and the next answered command to each is preceded by a fence
    (:meth:`LinkChannel.fence`, ``protocol.SYNC_WORKER``), whose answer is a fresh
    random token. Waits drop every answer of that worker until the token comes
    back. Once, after Ctrl-C, every later reply of a worker was the previous
    call's; counting the answers asked for instead missed the commands that went
    out just before an interrupt, and a fence needs no count.
    """

    _WAKE = ("wake", None, 0)

    def __init__(self, num_workers: int) -> None:
        self.replies: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_workers)]
        #: workers whose next answered command must be preceded by a fence (see above)
        self.unfenced: set[int] = set()
        #: The workers sent an answered command whose answer no wait has taken yet.
        #: Marked before the send and cleared as a wait takes the answer, so the next
        #: command finds a wait that was given up without relying on any clean-up (a
        #: second Ctrl-C can land in the clean-up itself, an outside check found).
        self.open: set[int] = set()
        #: per worker, the token of the fence whose answer the waits drop answers
        #: until (None: no fence under way)
        self.fences: list[bytes | None] = [None] * num_workers
        #: workers a write to failed (raised as WorkerDiedError before the readers,
        #: which mark them dead, may have seen the end of their output)
        self.write_failed: set[int] = set()
        self.errors: collections.deque[WorkerError] = collections.deque()
        self.dead: dict[int, str] = {}
        #: workers declared dead because they stopped answering (a subset of ``dead``)
        self.unresponsive: set[int] = set()
        self.given_up: set[int] = set()  # alive, but their command streams were cut
        #: workers that said they send heartbeats (their first ``alive`` message): only
        #: they are judged by their silence (a worker of an older version never beats)
        self.beating: set[int] = set()
        #: workers whose ``ready`` message came (a second one is dropped)
        self.ready: set[int] = set()
        self._drops: dict[tuple[int, str], int] = {}  # messages dropped, per worker and sort
        #: ``time.monotonic()`` of the last sign of life of each worker
        self.seen = [time.monotonic()] * num_workers
        #: how many controller threads wait for a reply right now
        self.waiting = 0
        self.closing = False
        #: Whether the channel is closed (a wait still going then raises).
        self.is_shut = False
        self._death_callbacks: list[Callable[[list[int], str], None]] = []
        self._lock = threading.Lock()

    def shut(self) -> None:
        """The channel is closed: every wait still going (another thread's) raises."""
        self.is_shut = True
        for q in self.replies:
            q.put(self._WAKE)

    def _dropped(self, worker_id: int, what: str) -> None:
        """Log a message dropped from ``worker_id``: the first of each sort per worker
        (a peer sending thousands must not flood the log), then every 1000th."""
        key = (worker_id, what)
        n = self._drops[key] = self._drops.get(key, 0) + 1
        if n == 1 or n % 1000 == 0:
            logger.warning("dropped %s from worker %d (%d so far)", what, worker_id, n)

    def deliver(self, worker_id: int, msg: tuple) -> None:
        self.seen[worker_id] = time.monotonic()
        if type(msg) is not tuple or not msg or type(msg[0]) is not str:
            # a peer's garbage must not end the reader (a kind that is an array cannot
            # even be compared: an outside check)
            self._dropped(worker_id, "a malformed message")
            return
        kind = msg[0]
        payload = msg[1] if len(msg) > 1 else None
        if kind == "reply":
            self.replies[worker_id].put((kind, payload, 1))
        elif kind == "fail":  # raised by the wait: a worker error and nothing else
            self.replies[worker_id].put((kind, _worker_error(worker_id, payload, kind), 1))
        elif kind == "error":
            self.errors.append(_worker_error(worker_id, payload, kind))
        elif kind == "alive":  # a heartbeat is only a sign of life, and says the worker sends them
            self.beating.add(worker_id)
        elif kind == "store":  # a rendezvous store request: answered by the store's own thread
            self.store_handler(worker_id, msg)
        elif kind == "ready":  # once: a later one would be taken for an answer
            if worker_id in self.ready:
                self._dropped(worker_id, "a second ready message")
            else:
                self.ready.add(worker_id)
                self.replies[worker_id].put((kind, payload, 0))
        else:  # nothing waits for it (a peer's garbage: an outside check)
            self._dropped(worker_id, "a message of unknown kind")

    def abandon(self, worker_ids: Iterable[int] | None = None) -> None:
        """Nobody waits for the answers of ``worker_ids`` (None: every worker) still to
        come: drop them (the next answered command to each is fenced)."""
        self.unfenced.update(range(len(self.replies)) if worker_ids is None else worker_ids)

    def store_handler(self, worker_id: int, msg: tuple) -> None:
        """Serve a worker's ``("store", ...)`` request; never blocks (the reader thread calls it).

        Replaced by :meth:`LinkChannel.attach_store` with the session's store's
        ``handle``; until then a request has nobody to answer it.
        """
        logger.warning(
            "worker %d asked the rendezvous store, but its channel has none attached", worker_id
        )

    def touch(self, worker_id: int) -> None:
        """A sign of life that is not a whole message (bytes of a large frame)."""
        self.seen[worker_id] = time.monotonic()

    def on_death(self, callback: Callable[[list[int], str], None]) -> None:
        """Call ``callback(worker_ids, reason)`` when workers die (at once if some already did)."""
        with self._lock:
            self._death_callbacks.append(callback)
            dead = dict(self.dead)
        if dead and not self.closing:
            try:
                callback(sorted(dead), "; ".join(sorted(set(dead.values()))))
            except Exception:  # as in mark_dead: a failing abort must not hide the death
                pass

    def mark_dead(self, worker_ids: Iterable[int], reason: str, unresponsive: bool = False, given_up: bool = False) -> None:  # fmt: skip
        """Record dead (or ``unresponsive``, or alive but ``given_up``: see
        :class:`~disco_core.errors.WorkerDiedError`) workers, wake every waiter, run the
        death callbacks once."""
        ids = [w for w in worker_ids if w not in self.dead]
        if not ids or self.closing:
            return
        with self._lock:
            for w in ids:
                self.dead[w] = reason
            if unresponsive:
                self.unresponsive.update(ids)
            if given_up:
                self.given_up.update(ids)
            callbacks = list(self._death_callbacks)
        for cb in callbacks:
            try:
                cb(ids, reason)
            except Exception:  # a failing abort must not hide the death
                pass
        for q in self.replies:
            q.put(self._WAKE)

    def died_error(self) -> WorkerDiedError:
        reasons = sorted(set(self.dead.values()))
        dead = set(self.dead)
        if self.given_up >= dead:  # alive, maybe busy: neither dead nor silent
            return WorkerDiedError(sorted(dead), "; ".join(reasons), given_up=True)
        if self.unresponsive >= dead:
            return WorkerUnresponsiveError(sorted(dead), "; ".join(reasons))
        return WorkerDiedError(sorted(dead), "; ".join(reasons))

    def wait(
        self,
        worker_id: int,
        poll: Callable[[], None],
        interval: float = 0.2,
        deadline: float | None = None,
        despite_others: bool = False,
    ) -> Any:
        """The next reply of ``worker_id``; ``despite_others``: raise for its own death
        only (by default every wait raises once any worker of the session is dead)."""
        q = self.replies[worker_id]
        while True:
            if self.dead and (not despite_others or worker_id in self.dead):
                raise self.died_error()
            if self.is_shut:
                raise SessionClosedError(
                    f"the session was shut down while waiting for worker {worker_id}"
                )
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DiscoTimeoutError(f"worker {worker_id} did not answer in time")
            try:
                kind, payload, number = q.get(
                    timeout=interval if deadline is None else min(interval, max(left, 0.001))
                )
            except queue.Empty:
                poll()
                continue
            if number:  # an answer
                fence = self.fences[worker_id]
                if fence is not None:  # answers nobody waits for, until the fence's own
                    if kind == "reply" and type(payload) is bytes and payload == fence:
                        self.fences[worker_id] = None
                    continue
                self.open.discard(worker_id)
                if kind == "fail":
                    raise payload
                return payload
            if kind == "ready":
                return payload
            # "wake": loop to look at self.dead

    def take_errors(self) -> list[WorkerError]:
        out = []
        while self.errors:
            out.append(self.errors.popleft())
        return out


class WorkerLink(abc.ABC):
    """The controller's connection to one worker (or one node of workers)."""

    worker_ids: tuple[int, ...]

    #: True when :meth:`send` may keep commands back until :meth:`flush`.
    buffered: bool = False

    #: True when the channel may hold this link's commands back and hand them over
    #: in batches (encoded once for every such link, :meth:`LinkChannel.send`).
    defers: bool = False

    #: True for a worker in the controller's process (:class:`ThreadWorkerLink`).
    in_process: bool = False

    #: Whether the workers behind this link are across a network. They then get
    #: frames in the tagged network format (:attr:`Outgoing.wire_frame`), never
    #: pickles, and the channel refuses, at the call, a command holding a value that
    #: format cannot carry.
    untrusted: bool = False

    #: True when the workers behind this link send heartbeats (worker processes do):
    #: the channel then declares them unresponsive after ``DISCO_LIVENESS_TIMEOUT``
    #: seconds of silence while the controller waits.
    heartbeats: bool = False

    #: The channel's hub and liveness timeout (set by ``LinkChannel._set_links``).
    hub: ReplyHub | None = None
    liveness: float = 0.0
    #: ``time.monotonic()`` when a write to this link that has not ended began (None:
    #: none under way); links whose writes can block keep it (:class:`BatchingLink`).
    #: The liveness watch reads it for every link whose workers send heartbeats: a
    #: plugin's link without it killed the watch (an outside check).
    writing_since: float | None = None

    def input_fd(self, worker_id: int) -> int | None:
        """The descriptor ``worker_id``'s replies arrive on (None: unknown).

        Bytes waiting there are a sign of life the reader has not taken yet.
        """
        return None

    def report_silence(self, worker_ids: Sequence[int], timeout: float) -> bool:
        """The liveness watch is about to call ``worker_ids`` (of this link) unresponsive.

        A link that knows better (the whole node behind it fell silent, not its
        workers) reports that itself, through the hub, and returns True; the default
        returns False and the workers are named.
        """
        return False

    @abc.abstractmethod
    def send(self, out: Outgoing) -> None:
        """Deliver a command to every worker behind this link (possibly buffered)."""

    def flush(self) -> None:
        """Deliver every buffered command now."""

    def poll(self) -> str | None:
        """Return a reason when the link's workers are known dead, else None."""
        return None

    @abc.abstractmethod
    def close(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for the workers to stop; kill them then."""


def write_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a write's own failure (the other end is gone), rather than an
    exception a signal handler of the program raised in the middle of the write.

    The system's errors carry an errno; ``TimeoutError("...")`` raised by a ``SIGALRM``
    handler is an ``OSError`` too, without one, and was taken for a dead worker.
    """
    if isinstance(exc, (DiscoError, EOFError)):
        return True
    return isinstance(exc, OSError) and exc.errno is not None


class BatchingLink(WorkerLink):
    """A link to workers in other processes, whose small commands leave in batches.

    Small commands wait in an outbox and leave together (one write, one wake-up of
    the worker); the channel flushes the outbox before it waits for any reply, and
    within ``FLUSH_DELAY`` otherwise. A frame with out-of-band buffers leaves at
    once: those buffers are views of the caller's arrays, which may change next.

    Subclasses say where bytes go: by default ``write_all`` to the file descriptor
    ``out_fd`` (a pipe, a socket); ``_write`` and ``_write_views`` may be
    overridden, and ``_died`` turns a failed write into the error to raise.
    """

    #: An outbox this large is flushed at once.
    OUTBOX_BYTES = 1 << 16
    out_fd: int
    defers = True

    def __init__(self) -> None:
        # Re-entrant: a hand-over holds it while it seals the batch into this outbox.
        self.lock = threading.RLock()
        self.outbox: list[bytes] = []
        self.outbox_bytes = 0

    def send(self, out: Outgoing) -> None:
        frame = out.frame_for(self)
        self.send_head(frame_head(frame, out.flags), frame[1])

    #: A frame (its buffers too) or a batch of at least this many bytes, sent from the main
    #: thread, is written by a helper thread (``_write_whole``: Ctrl-C cannot cut it).
    WHOLE_BYTES = 1 << 20

    def send_head(self, head: bytes, buffers: Sequence[Any]) -> None:
        """Send a frame's ``head`` (with any routing prefix) and its out-of-band ``buffers``."""
        try:
            with self.lock:
                if buffers:
                    self._write_frame_locked(head, buffers)
                else:
                    self.outbox.append(head)
                    self.outbox_bytes += len(head)
                    if self.outbox_bytes >= self.OUTBOX_BYTES and not self.hold:
                        self._flush_locked()
        except OSError as exc:
            if not write_failed(exc):
                raise  # the program's own (a signal handler's TimeoutError)
            raise self._gone(exc) from None

    @_interrupts.protect(blocking=True)
    def _write_frame_locked(self, head: bytes, buffers: Sequence[Any]) -> None:
        """Write what the outbox holds, then a frame with out-of-band buffers, whole:
        Ctrl-C waits for the end (half a frame hung the worker), and a second one while
        the write blocks gives the workers up."""
        writing = False
        try:
            self._flush_locked()
            total = len(head) + sum(memoryview(b).nbytes for b in buffers)
            writing = True
            self._write_timed(lambda: self._write_views(head, buffers), total)
            writing = False
        except BaseException as exc:
            self._write_ended_by(exc, writing)
            raise
        finally:
            _interrupts.deliver()

    def _write_timed(self, write: Callable[[], None], nbytes: int) -> None:
        """``write()`` of ``nbytes``, its start kept in :attr:`writing_since` (the liveness
        watch); from the main thread, 1 MiB or more goes through :meth:`_write_whole`."""
        self.writing_since = time.monotonic()
        try:
            if nbytes >= self.WHOLE_BYTES and threading.current_thread() is threading.main_thread():
                self._write_whole(write, nbytes)
            else:
                write()
        finally:
            self.writing_since = None

    def _write_whole(self, write: Callable[[], None], nbytes: int) -> None:
        """``write()`` (of ``nbytes``) on a helper thread, so that Ctrl-C cannot cut it.

        Python runs signal handlers on the main thread only. Half a frame in the
        stream made the worker read the next commands as the rest of its payload:
        it never answered, and its heartbeats kept it "alive" (a hang). An
        interrupt while the frame is written waits for its end, then goes on; a
        second one gives the link's workers up (the session ends for them, as for
        workers that died): their command stream is cut.
        """
        # (an Event: waited for with a bare C lock instead, the test of a Ctrl-C while small
        # commands wait for room lost its warning in 2 runs of 10; its own lock, which a
        # handler's exception could leave taken, is left as a known limit)
        done = threading.Event()
        finished: list[bool] = []  # set before done is: it tells, whatever cut a wait
        failed: list[BaseException] = []

        def writer() -> None:
            try:
                write()
            except BaseException as exc:  # raised on the caller's thread below
                failed.append(exc)
            finally:
                finished.append(True)
                done.set()

        interrupted: BaseException | None = None
        # the warning comes once the write has held the interrupt for WARN_AFTER, as a
        # protected step's does: most writes end first (outside check: it came at once)
        warn_at: float | None = None
        try:
            # The bare C call, not Thread.start (Python code that waits for the thread
            # to run): an interrupt raised there came with the writer running, and the
            # frame on its way (outside check: the link's lock went while it wrote)
            _thread.start_new_thread(writer, ())
        except RuntimeError:  # no thread could start: nothing was written
            raise
        except BaseException as exc:  # Ctrl-C, a signal handler's error: after the start
            interrupted = exc
            warn_at = time.monotonic() + _interrupts.WARN_AFTER
        while not finished:
            try:
                if warn_at is None:
                    done.wait()
                elif not done.wait(max(0.0, warn_at - time.monotonic())):
                    warn_at = None
                    self._warn_finishing(nbytes, interrupted)
            except BaseException as exc:  # Ctrl-C, a signal handler's error
                if finished:
                    interrupted = interrupted or exc  # the write is whole: nothing cut
                    break
                # (a first Ctrl-C may have been held back by a protected caller, which
                # warned: this one is then the second)
                if interrupted is not None or (isinstance(exc, KeyboardInterrupt) and _interrupts.state.escalated):  # fmt: skip
                    self._cut(exc)
                    done.wait(max(1.0, 4 * STALL_CHECK))
                    raise
                interrupted = exc
                warn_at = time.monotonic() + _interrupts.WARN_AFTER
        if failed:
            raise failed[0]
        if interrupted is not None:
            interrupted._disco_whole = True  # type: ignore[attr-defined]  # the frame is whole: nothing cut
            raise interrupted

    def _warn_finishing(self, nbytes: int, exc: BaseException | None) -> None:
        logger.warning(
            "%s came while a command (%d bytes) is written to worker(s) %s: "
            "finishing it first; a second one gives these workers up",
            type(exc).__name__, nbytes, list(self.worker_ids),
        )  # fmt: skip

    def _write_ended_by(self, exc: BaseException, writing: bool) -> None:
        """A protected write step raised ``exc``; ``writing``: in the middle of the bytes.

        A second Ctrl-C gives the workers up (:meth:`_cut_if_second`), and so does any
        other exception that cut the bytes in the middle (:meth:`_cut_by_foreign`).
        """
        if isinstance(exc, KeyboardInterrupt):
            self._cut_if_second(exc)
        if writing:
            self._cut_by_foreign(exc)

    def _cut_if_second(self, exc: KeyboardInterrupt) -> None:
        """:meth:`_cut` if ``exc`` is a second Ctrl-C during a protected write (it was
        raised at once: what was being written is cut)."""
        if _interrupts.state.escalated:
            self._cut(exc)

    def _cut_by_foreign(self, exc: BaseException) -> None:
        """An exception cut a write between two of its steps: give the workers up.

        A signal handler of the program (``SIGALRM`` raising ``TimeoutError``, a handler
        of its own for ``SIGINT``) raises in the main thread wherever it runs; inside a
        write, part of a frame, or a batch taken from the outbox, may never reach the
        worker. Neither the program's exception nor a failure of the write itself (the
        worker is gone: reported as such) is hidden: the workers are marked dead with
        this reason, so that the next call says what happened instead of hanging on a
        half frame or reading results of commands that never ran.
        """
        if getattr(exc, "_disco_whole", False) or write_failed(exc):
            return  # (raised after the frame was written whole: see _write_whole)
        hub = self.hub
        if hub is None or any(w in hub.dead for w in self.worker_ids):
            return
        hub.mark_dead(
            self.worker_ids,
            f"{type(exc).__name__}({str(exc)[:80]!r}) was raised in the middle of a write to "
            "it (by a signal handler of the program?): its command stream was cut",
            given_up=True,
        )

    def _cut(self, exc: BaseException) -> None:
        """A second interrupt during :meth:`_write_whole`: the workers are given up."""
        hub = self.hub
        reason = (
            f"a second interrupt ({type(exc).__name__}) cut the command being written "
            "to it: its command stream was lost"
        )
        if hub is not None:  # (unresponsive: a worker left inside a frame is killed at shutdown)
            hub.mark_dead(self.worker_ids, reason, unresponsive=True, given_up=True)
        self.give_up_at = 0.0  # a write waiting on a full pipe ends (_stalled)

    #: ``time.monotonic()`` when the write in progress began (None: not writing). The
    #: liveness watch judges the workers of a link whose write does not end.
    writing_since: float | None = None

    def _gone(self, exc: OSError) -> WorkerDiedError:
        """The error for a failed write: the hub's verdict if it has one (unresponsive)."""
        hub = self.hub
        if hub is not None and any(w in hub.dead for w in self.worker_ids):
            return hub.died_error()
        error = self._died(exc)
        if hub is not None:  # (not mark_dead here: its callbacks may send, and a lock is held)
            hub.write_failed.update(error.worker_ids)
        return error

    @property
    def buffered(self) -> bool:  # type: ignore[override]  # read-only here
        return bool(self.outbox)

    #: True while a hand-over fills the outbox, which must then not write (and block) by itself.
    hold = False

    def flush(self) -> None:
        try:
            with self.lock:
                self._flush_locked()
        except OSError as exc:
            if not write_failed(exc):
                raise  # the program's own (a signal handler's TimeoutError)
            raise self._gone(exc) from None

    def room(self) -> int | None:
        """Bytes ``out_fd`` takes now without blocking (a pipe's free space), or None if unknown."""
        if type(self)._write is not BatchingLink._write:
            return None  # a link that writes elsewhere (a socket, sealed records)
        try:
            size = fcntl.fcntl(self.out_fd, _F_GETPIPE_SZ)
            queued = struct.unpack("i", fcntl.ioctl(self.out_fd, termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            return None
        return size - queued

    def flush_if_room(self) -> bool:
        """Write the outbox only if that cannot block on a full pipe; True when all is written.

        For a worker of the controller's process about to wait for its peers
        (``ctx.hand_over``): a full pipe means a peer is not reading (it may be
        waiting for this very worker), so blocking there could never end.
        """
        lock = self.lock
        owned_before = owned(lock)
        try:
            if not lock.acquire(timeout=0.002):
                return False  # another thread is writing: it hands the commands over
            try:
                if not self.outbox:
                    return True
                room = self.room()
                if room is not None and self.outbox_bytes > room:
                    return False
                # Room unknown (a socket, whose buffers are large): write now, as flush()
                # does; through the flusher thread it could wait for the GIL for milliseconds.
                self._flush_locked()
                return True
            except OSError as exc:
                if not write_failed(exc):
                    raise  # the program's own (a signal handler's TimeoutError)
                raise self._gone(exc) from None
            finally:
                lock.release()
        except BaseException:
            release_if_left(lock, owned_before)  # Ctrl-C right after the acquire
            raise

    @_interrupts.protect(blocking=True)
    def _flush_locked(self) -> None:
        # Ctrl-C waits for the write's end (disco_core._interrupts): half a batch in
        # the pipe hung the worker, and a batch taken from the outbox and not written
        # was lost. A second Ctrl-C while the write blocks gives the workers up.
        writing = False
        try:
            if self.outbox:
                data = b"".join(self.outbox) if len(self.outbox) > 1 else self.outbox[0]
                writing = True  # from here, the batch is only in ``data``
                self.outbox.clear()
                self.outbox_bytes = 0
                # a large value pickled into a command (a long list) is as large a frame
                self._write_timed(lambda: self._write(data), len(data))
                writing = False
        except BaseException as exc:
            self._write_ended_by(exc, writing)
            raise
        finally:
            _interrupts.deliver()

    def _write(self, data: bytes) -> None:
        write_all(self.out_fd, data, self._stalled)

    def _write_views(self, head: bytes, buffers: Sequence[Any]) -> None:
        write_all(self.out_fd, head, self._stalled)
        for m in buffers:
            write_all(self.out_fd, m, self._stalled)

    #: Give up on a write blocked past this ``time.monotonic()`` (set as the channel closes).
    give_up_at: float | None = None

    def _stalled(self) -> None:
        """A write to a non-blocking ``out_fd`` finds it full: give up when the workers are gone.

        They are gone when they died, were declared unresponsive, or have sent
        nothing (not even a heartbeat) for the liveness timeout; a worker that
        is only busy keeps its heartbeat, and the write waits for it.
        """
        hub = self.hub
        ids = self.worker_ids
        if hub is not None and any(w in hub.dead for w in ids):
            raise hub.died_error()
        reason = self.poll()
        if reason:
            raise self._died(BrokenPipeError(reason))
        if hub is None:
            return
        now = time.monotonic()
        if self.give_up_at is not None and now > self.give_up_at:
            raise WorkerDiedError(ids, "its commands were not taken before the shutdown timeout")
        idle = now - max(hub.seen[w] for w in ids)
        beating = all(w in hub.beating for w in ids)
        if beating and self.liveness and idle > self.liveness and not hub.closing:
            hub.mark_dead(
                ids,
                f"it took no command and sent nothing for {idle:.1f} s "
                f"(DISCO_LIVENESS_TIMEOUT={self.liveness:g} s): stopped, frozen or swapped out",
                unresponsive=True,
            )
            raise hub.died_error()

    @abc.abstractmethod
    def _died(self, exc: OSError) -> WorkerDiedError:
        """The error to raise when a write failed with ``exc`` (the workers are gone)."""


class ThreadWorkerLink(WorkerLink):
    """A worker running in a thread of the controller's process.

    Commands wait in a deque. When the controller needs this worker's reply it
    runs the pending commands itself, on its own thread (under the same lock, so
    the order is kept): a synchronising call costs no thread switch at all.
    Sending does not wake the worker's thread either: a wake-up is a futex call
    and a fight for the GIL with the controller, tens of microseconds on a busy
    small machine, for every command. The channel wakes it (``wake``) when
    commands have waited ``FLUSH_DELAY`` with no synchronising call to run them,
    or when the controller is about to wait for another worker, so asynchronous
    commands still start promptly and run in the background.
    """

    in_process = True
    hub: ReplyHub  # set before any command runs

    def __init__(self, worker_id: int, num_workers: int, num_groups: int, hub: ReplyHub) -> None:
        self.worker_ids = (worker_id,)
        self.pending: collections.deque = collections.deque()
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()
        # an RLock for its owner (disco_core._locks), never taken twice by one thread
        self.lock = threading.RLock()
        self.stopped = False
        #: the thread running this worker's commands now (its ident), None between batches
        self.runner: int | None = None
        deliver = hub.deliver

        def reply(msg: tuple) -> None:
            # The controller gets its own copy, as it would through a pipe.
            if msg[0] == "reply" and msg[1] is not None:
                msg = ("reply", isolate(msg[1]))
            deliver(worker_id, msg)

        self.worker = Worker(worker_id, num_workers, num_groups, reply)
        self.hub = hub
        self.thread = threading.Thread(
            target=self._run, name=f"disco-worker-{worker_id}", daemon=True
        )
        self.thread.start()

    def _drain(self) -> None:
        pending, worker = self.pending, self.worker
        outer = self.runner
        self.runner = _get_ident()
        try:
            while pending and not self.stopped:
                # execute reads the trace's recorders for each command: a trace that
                # starts or stops within the batch swaps them (held for the batch, the
                # rest of it went unnumbered: outside check)
                if not worker.execute(pending[0], pending):  # (popped inside: see execute)
                    self.stopped = True
        finally:
            self.runner = outer
            if pending and not self.stopped:
                # Left by an exception (Ctrl-C in a collective the controller's thread
                # ran): the commands behind it were not woken for (see flush), so the
                # worker's thread runs them now, as before (outside check)
                self.tokens.put(None)

    def _run(self) -> None:
        set_current(self.worker.ctx)
        wid = self.worker_ids[0]
        logger.info("worker %d started (thread %s)", wid, threading.current_thread().name)
        try:
            while not self.stopped:
                self.tokens.get()
                with self.lock:
                    self._drain()
        except BaseException as exc:  # noqa: BLE001 - the loop itself broke
            self.stopped = True
            self.hub.mark_dead(
                self.worker_ids, f"worker thread stopped: {type(exc).__name__}: {exc}"
            )
            logger.info("worker %d stopped: %s: %s", wid, type(exc).__name__, exc)
            return
        logger.info("worker %d stopped", wid)

    def run_pending(self, poll: Callable[[], None], sync: bool = False) -> None:
        """Run the queued commands on the calling (controller) thread.

        ``sync``: then do what a ``SyncWorker`` command does (the CCL's
        ``synchronize``), raising its failure as a :class:`WorkerError`; this
        waits for a command the worker's own thread is running, too.
        """
        if not self.pending and not sync:
            return
        lock = self.lock
        owned_before = owned(lock)
        try:
            while not lock.acquire(timeout=0.2):
                poll()  # the worker thread is busy; meanwhile notice dead peers
            try:
                previous = set_current(self.worker.ctx)
                try:
                    self._drain()
                    if sync and not self.stopped:
                        self.worker.synchronize()
                finally:
                    set_current(previous)
            finally:
                lock.release()
        except BaseException:
            release_if_left(
                lock, owned_before
            )  # Ctrl-C right after the acquire (disco_core._locks)
            raise

    def send(self, out: Outgoing) -> None:
        self.pending.extend(out.local())

    @property
    def buffered(self) -> bool:  # type: ignore[override]
        return bool(self.pending)

    def flush(self) -> None:
        """Wake the worker's thread to run what is pending (if anything is).

        Not when the calling thread is the one running this worker's commands (a
        collective of worker 0 that the controller's thread runs, handing over): it
        looks at ``pending`` again after the command under way, and wakes the
        worker's thread itself if an exception ends its run first (``_drain``).
        Woken, the worker's thread only waited for the lock that thread holds, and
        took the GIL from it twice on the way (a sync with an allreduce of a
        1-worker session: ~3 thread switches a step).
        """
        if self.pending and self.runner != _get_ident():
            self.tokens.put(None)

    def poll(self) -> str | None:
        if not self.thread.is_alive() and not self.stopped and not self.hub.closing:
            return "worker thread stopped"
        return None

    def close(self, deadline: float) -> None:
        self.tokens.put(None)
        self.thread.join(max(0.0, deadline - time.monotonic()))


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _gil_keeping_poll() -> Any:
    """libc's ``poll`` called with the GIL held (``ctypes.PyDLL``); None where unavailable.

    :meth:`ReaderGate.quiet` polls with a zero timeout after every synchronising
    call. ``select.poll`` releases the GIL around the call, which hands it to
    any thread that is waiting for it (worker 0's, woken by every command) and
    costs two thread switches, more than the rest of ``sync_worker_0``. A zero
    timeout never blocks, so keeping the GIL is safe.
    """
    try:
        func = ctypes.PyDLL(None).poll
    except (OSError, AttributeError):
        return None
    func.restype = ctypes.c_int
    return func


_POLL_NOW = _gil_keeping_poll()


class ReaderGate:
    """Lets the controller wait until a reader thread has delivered what was sent to it.

    A reader thread holds ``lock`` while it reads and delivers messages, and
    lets go of it only with its buffers empty, before it blocks for more bytes
    (or says, through ``buffered``, that it still holds some).
    :meth:`settled` takes the lock (so no reader is in the middle of a message)
    and polls the reader's descriptors: when none is readable, every byte that
    reached them before the call has been delivered.

    Parameters
    ----------
    fds : iterable of int
        The descriptors the reader thread reads (more with :meth:`add`).
    """

    _READY = select.POLLIN | select.POLLHUP | select.POLLERR

    def __init__(self, fds: Iterable[int] = ()) -> None:
        # an RLock for its owner (disco_core._locks), never taken twice by one thread
        self.lock = threading.RLock()
        self._fds: list[int] = []
        self._buffered: list[Callable[[], Any]] = []
        self._pollfds: Any = None
        self._args: tuple = ()
        for fd in fds:
            self.add(fd)

    def add(self, fd: int, buffered: Callable[[], Any] | None = None) -> None:
        """Watch ``fd``; ``buffered()`` is true while the reader holds bytes not yet delivered.

        A reader that lets go of ``lock`` between messages (rather than only
        before it blocks) must say so through ``buffered``.
        """
        self._fds.append(fd)
        if buffered is not None:
            self._buffered.append(buffered)
        self._rebuild()

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed: its number may be reused)."""
        if fd in self._fds:
            self._fds.remove(fd)
            self._rebuild()

    def _rebuild(self) -> None:
        n = len(self._fds)
        self._pollfds = (_PollFd * n)(*[_PollFd(fd, self._READY, 0) for fd in self._fds])
        self._args = (self._pollfds, ctypes.c_ulong(n), ctypes.c_int(0))

    def _ready(self) -> bool:
        """True when a watched descriptor has bytes (or its end) waiting; never blocks."""
        if not self._fds:
            return False
        pollfds, nfds, zero = self._args
        if _POLL_NOW is not None:
            if _POLL_NOW(pollfds, nfds, zero) <= 0:
                return False
            events = [p.revents for p in pollfds]
        else:  # no libc poll to call: the standard one (it lets go of the GIL)
            return bool(select.select(self._fds, [], [], 0)[0])
        return any(ev and not ev & select.POLLNVAL for ev in events)

    def quiet(self) -> bool:
        """True when nothing is left undelivered right now (one ``poll``; never waits).

        Runs after every synchronising call, so it is kept to a lock and a poll.
        """
        lock = self.lock
        owned_before = owned(lock)
        try:
            if not lock.acquire(False):
                return False  # the reader is delivering
            try:
                if self._fds and self._ready():
                    return False
                for buffered in self._buffered:
                    if buffered():
                        return False
                return True
            finally:
                lock.release()
        except BaseException:
            release_if_left(
                lock, owned_before
            )  # Ctrl-C right after the acquire (disco_core._locks)
            raise

    def settled(self, deadline: float) -> bool:
        """Wait until nothing is left undelivered, or until ``deadline``; True when settled."""
        owned_before = owned(self.lock)
        while True:
            try:
                if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    return False
                try:
                    ready = self._ready() or any(b() for b in self._buffered)
                finally:
                    self.lock.release()
            except BaseException:
                release_if_left(self.lock, owned_before)  # Ctrl-C right after the acquire
                raise
            if not ready:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)  # lets the reader thread take the bytes


_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)

#: Longest time a buffered command waits before it is written out
#: (``DISCO_FLUSH_DELAY`` seconds; 0 writes every command at once).
FLUSH_DELAY = env_seconds_or_default("DISCO_FLUSH_DELAY", 0.0005)


#: Most commands held back in a channel's batch before it is handed to the links.
BATCH_COMMANDS = 256

#: Most commands a worker of the controller's process may have waiting: past it, the
#: controller runs them itself before it goes on (as a full pipe makes it wait for a
#: worker in another process), so a program that never syncs keeps its memory bounded
#: (about 200 bytes a command).
PENDING_COMMANDS = 1 << 14


class _FlushFollows(threading.local):
    """Per thread: True while a send is followed at once by this thread's own flush
    (``LinkChannel.sync``), so ``_mark_dirty`` need not wake the flusher thread. A
    thread-local, not a parameter of ``send``: subclasses override ``send``."""

    on = False


_flush_follows = _FlushFollows()


class LinkChannel(Channel):
    """A :class:`Channel` made of links, one per worker or per node.

    Commands whose values are all immutable (``Outgoing.shared``: nearly every
    ``call_packed``) and that go to every worker are not encoded one by one: they
    wait in one batch for all the deferring links (:attr:`WorkerLink.defers`), and
    leave as one frame, encoded once for all of them, with one write per link.
    The batch is handed over before any other command to those links (so each
    link's order is kept), before the controller waits for a worker in another
    process, before a worker of this process waits for the others (a CCL
    operation calls ``ctx.hand_over``, which is :meth:`hand_over`), when it holds
    ``BATCH_COMMANDS``, and within ``FLUSH_DELAY`` seconds otherwise (a
    flusher thread, which also wakes in-process workers that have commands
    waiting), so asynchronous commands always start promptly. A sync with a
    worker of this process (worker 0) runs its commands on the calling thread
    and hands nothing over: it costs no system call and no thread switch.
    """

    def _cut_for(self, exc: BaseException) -> None:
        """Give every worker up if ``exc`` came from a signal handler of the program.

        Called as ``exc`` leaves one of this channel's steps that Ctrl-C waits for:
        a handler's exception is not held back, and cut there a command may have
        reached some workers and not others; later calls would read diverging
        registers without a word.
        """
        if self.hub.dead:
            return  # a link's cut said it already
        # KeyboardInterrupt: Disco's Ctrl-C handler never raises inside these steps, so
        # it came from another handler (signal.default_int_handler leaves no frame)
        if not isinstance(exc, KeyboardInterrupt) and not _interrupts.cut_by_program(exc):  # fmt: skip
            return  # the step's own error says what happened
        self.hub.mark_dead(
            range(self.num_workers),
            f"{type(exc).__name__}({str(exc)[:80]!r}), raised by a signal handler of the "
            "program, cut the hand-over of commands to the workers: they may no longer "
            "agree on what ran",
            given_up=True,
        )

    def __init__(self, num_workers: int, num_groups: int) -> None:
        # the settings a session reads later, refused before any worker is started (a
        # session refused after its links were made left its worker threads behind)
        liveness_timeout()
        env_seconds("DISCO_GATHER_TIMEOUT", 60.0)
        self.num_workers = num_workers
        self.num_groups = num_groups
        self.hub = ReplyHub(num_workers)
        self.links: list[WorkerLink] = []
        self._link_of: list[WorkerLink] = []
        self._wake_flusher: queue.SimpleQueue = queue.SimpleQueue()
        self._flusher: threading.Thread | None = None
        self._flush_due = False
        self._stopping = False
        self._closed = threading.Event()
        #: one gate per reader thread, and :meth:`settle` waits for each (see :class:`ReaderGate`)
        self.gates: list[ReaderGate] = []
        self._watcher: threading.Thread | None = None
        #: shared commands for every deferring link, oldest first. Always the same
        #: list: senders only extend it (atomic under the GIL), sealers cut from its
        #: front under ``_seal_lock``, so no sender ever takes a lock for it.
        self._batch: list[tuple] = []
        # an RLock for its owner (disco_core._locks), never taken twice by one thread
        self._seal_lock = threading.RLock()
        self._deferring: list[BatchingLink] = []  # links that take the batch
        self._direct: list[WorkerLink] = []  # the others: they get every command at once
        self._pendings: list[collections.deque] = []  # the in-process workers' queues
        self._direct_others: list[WorkerLink] = []  # direct links not in this process
        self._untrusted = False  # some link's workers decode untrusted (set with the links)
        self._deferring_network = self._deferring_pickle = False  # (set with the links)
        self._pickles = False  # some link's workers are processes that read pickles
        # A subclass with its own send() (it looks at every command) gets every one there.
        self._fast_shared = type(self).send is LinkChannel.send
        # Until a session attaches its store (a channel that wraps this one may not pass
        # attach_store through), a worker's store request is answered with why: a worker
        # process waiting for an answer must never wait for ever.
        refusing = ControllerStore(reply=self._store_reply)
        refusing.abort(
            f"no rendezvous store is attached to this {self.kind} channel (a channel that "
            "wraps it must pass attach_store through)",
            final=True,
        )
        self.hub.store_handler = refusing.handle  # type: ignore[method-assign]

    #: The workers of the controller's process call the store directly; the others send
    #: ``("store", ...)`` up their reply path to the hub, and read the answer, a
    #: command sent to them alone, from their command stream (``Worker.run``). A
    #: subclass whose workers run no ``Worker.run`` loop sets it False.
    has_store = True

    def _store_reply(self, worker_id: int, cmd: tuple) -> None:
        self.send(Outgoing(cmd, shared=True), [worker_id])

    def attach_store(self, store: ControllerStore) -> None:
        if not self.has_store:
            reason = f"the {self.kind} channel has no rendezvous store"
            store.abort(reason, final=True)  # a request that comes anyway is answered with why
            local = None
        else:
            local = store.client(self.hand_over)
        self.hub.store_handler = store.handle  # type: ignore[method-assign]
        for link in self.links:
            if isinstance(link, ThreadWorkerLink):
                link.worker.ctx.store = local if local is not None else NoStore(reason)

    def wait_ready(self, worker_ids: Iterable[int], deadline: float, what: str = "workers") -> None:
        """Wait for the ``ready`` message of each of ``worker_ids`` until ``deadline``.

        Raises :class:`~disco_core.errors.DiscoTimeoutError` (a ``TimeoutError``, naming
        ``DISCO_START_TIMEOUT``) past the deadline,
        and :class:`WorkerDiedError` ("failed to start: ...") when one of them died.
        """
        limit = max(0.0, deadline - time.monotonic())

        def poll() -> None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise DiscoTimeoutError(
                    f"{what} did not start within {limit:g} s (DISCO_START_TIMEOUT)"
                )

        for w in worker_ids:
            try:
                self.hub.wait(w, poll, interval=0.05)
            except WorkerDiedError as exc:
                raise WorkerDiedError(exc.worker_ids, f"failed to start: {exc.reason}") from None

    def _flush_loop(self) -> None:
        while True:
            now = self._wake_flusher.get()
            if self._stopping:
                return
            if not now:
                # inf, or anything past time.sleep's own limit, would raise and end
                # this thread: an hour is as good as never between two kicks
                time.sleep(min(FLUSH_DELAY, 3600.0))
                self._flush_due = False
            self._kick()

    def _kick_now(self) -> None:
        """Let the flusher thread hand everything over at once (it may block; the caller must not)."""
        if self._flusher is None:
            self._start_flusher()
        self._wake_flusher.put(True)

    @_interrupts.protect()
    def _start_flusher(self) -> None:
        """Start the flusher thread, once. Ctrl-C waits for its start: made and not
        started, it would have held every later batch back for good."""
        try:
            if self._flusher is None:
                flusher = threading.Thread(target=self._flush_loop, name="disco-flush", daemon=True)  # fmt: skip
                flusher.start()
                self._flusher = flusher
        finally:
            _interrupts.deliver()

    def _kick(self) -> None:
        """:meth:`flush`, for the flusher thread: a dead worker is marked, not raised."""
        for link in self.links:  # in-process workers first: a full pipe may wait for them
            if type(link) is ThreadWorkerLink:
                link.flush()
        try:
            self._seal()
        except WorkerDiedError as exc:
            self.hub.mark_dead(exc.worker_ids, exc.reason)
        for link in self.links:
            if link.buffered:
                try:
                    link.flush()
                except WorkerDiedError as exc:
                    self.hub.mark_dead(exc.worker_ids, exc.reason)

    def _mark_dirty(self) -> None:
        if _flush_follows.on:  # this thread flushes right after its send (see sync)
            return
        if FLUSH_DELAY <= 0:
            self._kick()
            return
        if self._flusher is None:
            self._start_flusher()
        self._flush_due = True
        self._wake_flusher.put(None)

    def flush(self) -> None:
        """Hand every held-back command to its workers now (wake-ups, then writes).

        The workers of this process are woken first: a write to a full pipe
        may wait for a peer that waits for them. :meth:`hand_over` is the
        variant that never blocks.
        """
        for link in self.links:  # in-process workers first: a full pipe may wait for them
            if type(link) is ThreadWorkerLink:
                link.flush()
        self._seal()
        for link in self.links:
            if link.buffered:
                link.flush()

    @_interrupts.protect()
    def hand_over(self) -> None:
        """``ctx.hand_over`` of the workers in this process: :meth:`flush` that never blocks.

        The caller is a worker about to wait for its peers. It wakes the other
        in-process workers, and writes to the others what fits in their pipes now;
        when a pipe is full or another thread is writing (a peer not reading may be
        waiting for this very worker), the flusher thread hands the rest over.

        One step that Ctrl-C waits for (it never blocks): cut between a lock's
        acquire and its note in ``held``, the lock stayed taken, and the flusher and
        the next send waited for each other for good (re-check: about 1 in 100-150
        interrupted collectives of a 2-process session).
        """
        try:
            self._hand_over()
        finally:
            _interrupts.deliver()

    def _hand_over(self) -> None:
        for link in self.links:
            if type(link) is ThreadWorkerLink:
                link.flush()
        deferring = self._deferring
        if not self._batch and not any(link.buffered for link in deferring):
            return
        # Seal lock, then every link's lock (the order _seal takes them): a thread
        # stuck writing holds one, and then the flusher takes over.
        locks: list[Any] = [self._seal_lock, *[link.lock for link in deferring]]
        before = lock_counts(locks)
        if before[0]:  # this thread is sealing already: never re-entered
            self._kick_now()
            return
        held = []
        done = False
        try:
            for lock in locks:
                if not lock.acquire(timeout=0.002):
                    done = True
                    self._kick_now()
                    return
                held.append(lock)
            for link in deferring:
                link.hold = True
            try:
                self._seal_locked()
            finally:
                for link in deferring:
                    link.hold = False
            for link in deferring:
                if link.buffered and not link.flush_if_room():
                    done = True
                    self._kick_now()
                    return
            done = True
        finally:
            # Cut by an exception (a program's signal handler: Ctrl-C waits, hand_over
            # is protected), down to what this thread held before: one raised between
            # an acquire and its note in ``held``, or between two releases, left a lock
            # taken, and the flusher and the next send waited for each other for good
            # (outside check: SIGALRM storms on worker 0's collectives)
            try:
                if done:
                    for lock in reversed(held):
                        lock.release()
                else:
                    release_to(list(zip(reversed(locks), reversed(before))))
            except BaseException:
                release_to(list(zip(reversed(locks), reversed(before))))
                raise

    def _seal(self) -> None:
        """Hand the batch of shared commands to every deferring link (encoded once)."""
        batch = self._batch
        if not batch:
            return
        with self._seal_lock:  # cut and handed over at once: two sealers keep the order
            self._seal_locked()

    @_interrupts.protect()
    def _seal_locked(self) -> None:
        # Ctrl-C waits for its end (disco_core._interrupts): cut between the links, a
        # batch went to some workers and not to others, and a later call failed there
        # or read an older value (a lost batch held a register's release and its reuse)
        queueing = False
        current: WorkerLink | None = None
        try:
            batch = self._batch
            n = len(batch)
            if n:
                out = Outgoing(*batch[:n], shared=True)
                # encoded before the batch lets go of the commands, for every kind of link
                if self._deferring_pickle:
                    out.frame  # noqa: B018
                if self._deferring_network:
                    out.wire_frame  # noqa: B018
                queueing = True
                del batch[:n]  # a sender's extend meanwhile went after these n
                for link in self._deferring:
                    current = link
                    link.send(out)
                queueing = False
        except BaseException as exc:
            # (an interrupt that the last link's write finished despite cut nothing)
            if queueing and not (current is self._deferring[-1] and getattr(exc, "_disco_whole", False)):  # fmt: skip
                self._cut_for(exc)
            raise
        finally:
            _interrupts.deliver()

    def _set_links(self, links: list[WorkerLink]) -> None:
        # In-process links first: a pipe that blocks must never delay worker 0.
        self.links = sorted(links, key=lambda link: not isinstance(link, ThreadWorkerLink))
        # only BatchingLinks defer
        self._deferring = [cast(BatchingLink, link) for link in self.links if link.defers]
        self._direct = [link for link in self.links if not link.defers]
        self._pendings = [link.pending for link in self._direct if type(link) is ThreadWorkerLink]
        self._direct_others = [link for link in self._direct if type(link) is not ThreadWorkerLink]
        # links whose workers decode untrusted: a command with a value other than plain
        # ones is checked before it goes (check_untrusted), only when there are some
        self._untrusted = any(link.untrusted for link in links)
        self._pickles = any(_reads_pickles(link) for link in links)
        self._deferring_network = any(link.untrusted for link in self._deferring)
        self._deferring_pickle = any(not link.untrusted for link in self._deferring)
        for link in self.links:
            if isinstance(link, ThreadWorkerLink):
                link.worker.ctx.hand_over = self.hand_over
        by_worker: dict[int, WorkerLink] = {}
        for link in links:
            for w in link.worker_ids:
                by_worker[w] = link
        missing = set(range(self.num_workers)) - set(by_worker)
        if missing:
            raise DiscoError(f"channel has no link for workers {sorted(missing)}")
        self._link_of = [by_worker[w] for w in range(self.num_workers)]
        timeout = liveness_timeout()
        for link in links:
            if link.hub is None:
                link.hub = self.hub
            link.liveness = timeout
        self._start_watch()

    # ------------------------------------------------------------------ liveness
    def _start_watch(self) -> None:
        """Watch the heartbeats of the workers behind links that send them."""
        timeout = liveness_timeout()
        watched = [link for link in self.links if link.heartbeats]
        if not timeout or not watched or self._watcher is not None:
            return
        self._watcher = threading.Thread(
            target=self._watch_loop, args=(timeout, watched), name="disco-liveness", daemon=True
        )
        self._watcher.start()

    def _watch_loop(self, timeout: float, links: list[WorkerLink]) -> None:
        hub = self.hub
        tick = min(0.5, timeout / 4)
        last = time.monotonic()
        while not self._closed.wait(tick):
            now = time.monotonic()
            seen = hub.seen
            if now - last > max(1.0, timeout / 2):
                # This process was not running (stopped, suspended, starved): the
                # workers' silence is ours, so their clocks start again.
                for w in range(len(seen)):
                    seen[w] = max(seen[w], now)
            last = now
            if hub.closing:
                continue
            # Judged: every worker while the controller waits; otherwise the workers of
            # a link whose write does not end (a stopped reader, its buffers full).
            judged = (
                links
                if hub.waiting
                else [
                    link
                    for link in links
                    if link.writing_since is not None and now - link.writing_since > tick
                ]
            )
            silent = []
            for link in judged:
                quiet = [
                    w
                    for w in link.worker_ids
                    if w in hub.beating
                    and w not in hub.dead
                    and now - seen[w] > timeout
                    and not self._input_waiting(link, w)
                ]
                if quiet and not link.report_silence(quiet, timeout):
                    silent += quiet
            if silent:
                idle = now - max(seen[w] for w in silent)
                many = len(silent) > 1
                hub.mark_dead(
                    silent,
                    f"nothing arrived from {'them' if many else 'it'} for {idle:.1f} s, "
                    f"more than DISCO_LIVENESS_TIMEOUT={timeout:g} s (a stopped, frozen or "
                    "swapped-out process, or one holding the GIL that long)",
                    unresponsive=True,
                )
                for link in links:  # a write stuck on them ends (their link is cut)
                    kill = getattr(link, "kill", None)
                    if kill is not None and link.writing_since is not None:
                        if set(link.worker_ids) & set(silent):
                            kill()

    def _input_waiting(self, link: WorkerLink, worker_id: int) -> bool:
        """True when bytes from ``worker_id`` wait unread (a busy reader is no silent worker)."""
        fd = link.input_fd(worker_id)
        if fd is None:
            return False
        try:
            ready, _, _ = select.select([fd], [], [], 0)
        except (OSError, ValueError):
            return True  # closed under us: the reader reports the end
        if ready:
            self.hub.touch(worker_id)
        return bool(ready)

    def mark_unresponsive(self, worker_ids: Sequence[int], reason: str) -> None:
        self.hub.mark_dead(worker_ids, reason, unresponsive=True)

    def settle(self, timeout: float = 1.0) -> None:
        deadline = None
        for gate in self.gates:
            if gate.quiet():  # the common case: one poll per reader thread
                continue
            if deadline is None:
                deadline = time.monotonic() + timeout
            if not gate.settled(deadline):
                return

    @_interrupts.protect()
    def send_shared(self, cmds: tuple[tuple, ...]) -> None:
        # Ctrl-C waits for the end (disco_core._interrupts): cut between two workers'
        # queues, a command went to some workers and not to the others
        queueing = False
        try:
            if not self._fast_shared:
                return self.send(Outgoing(*cmds, shared=True))
            # No encoding, no write, no wake-up now: the batch leaves as one frame.
            batch = self._batch
            queueing = True
            if self._deferring:
                batch += cmds
            for pending in self._pendings:
                pending.extend(cmds)  # in-process workers take immutable values as they are
                if len(pending) > PENDING_COMMANDS:  # caught up at the next send, when every
                    self.backlogged = True  # queue has this command (it may be a collective)
            if self._direct_others:
                out = Outgoing(*cmds, shared=True)
                for link in self._direct_others:
                    link.send(out)
            queueing = False
            if len(batch) >= BATCH_COMMANDS:
                self.flush()
            elif not self._flush_due:
                self._mark_dirty()
        except BaseException as exc:
            if queueing:
                self._cut_for(exc)
            raise
        finally:
            if _held.pending:  # (the hot path: one attribute read)
                _interrupts.deliver()

    @_interrupts.protect()
    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        # Ctrl-C waits for the end, as in send_shared (a write that blocks is protected
        # on its own, where a second Ctrl-C gives the workers up)
        queueing = False
        current: WorkerLink | None = None
        try:
            if workers is None:
                if out.shared:
                    return self.send_shared(out.cmds)
                targets: Sequence[WorkerLink] = self.links
            elif len(workers) == 1:
                targets = (self._link_of[workers[0]],)
            else:
                targets = list({id(self._link_of[w]): self._link_of[w] for w in workers}.values())
            if self._untrusted and not out.shared:
                check_untrusted(out, targets)
            if (
                self._pickles
                and not out.shared
                and (workers is None or any(_reads_pickles(link) for link in targets))
            ):
                # encoded before any link gets it: a value a worker process could not
                # rebuild is a DiscoTypeError here, not a command worker 0 alone ran.
                # Only then: a command for worker 0 alone (copy_to_worker_0) is never
                # pickled, and pickling it anyway (about 10 us, the array out of band)
                # took process copies of 1 MiB from 36 to 24 GB/s.
                out.frame  # noqa: B018
            if any(link.defers for link in targets):
                # What was sent before goes first, also when another thread (the flusher,
                # a worker's hand_over) has cut the batch and is still writing it out.
                with self._seal_lock:
                    self._seal_locked()
                    queueing = True
                    for link in targets:
                        current = link
                        link.send(out)
                    queueing = False
            else:
                queueing = True
                for link in targets:
                    current = link
                    link.send(out)
                queueing = False
            for link in targets:
                if type(link) is ThreadWorkerLink and len(link.pending) > PENDING_COMMANDS:
                    self.backlogged = True
            if not self._flush_due:
                self._mark_dirty()
        except BaseException as exc:
            # (an interrupt that the last link's write finished despite cut nothing)
            if queueing and len(targets) > 1 and not (current is targets[-1] and getattr(exc, "_disco_whole", False)):  # fmt: skip
                self._cut_for(exc)
            raise
        finally:
            if _held.pending:
                _interrupts.deliver()

    def catch_up(self) -> None:
        """Run the commands of every in-process worker that has too many waiting
        (``PENDING_COMMANDS``) on this thread, as a sync with it would."""
        self.backlogged = False
        hub = self.hub
        hub.waiting += 1  # it may wait in a collective: the liveness watch judges silence
        try:
            for link in self.links:
                if type(link) is ThreadWorkerLink and len(link.pending) > PENDING_COMMANDS:
                    link.run_pending(self.check_alive)
        finally:
            hub.waiting -= 1

    def recv(self, worker_id: int, timeout: float | None = None) -> Any:
        link = self._link_of[worker_id]
        inline = timeout is None and type(link) is ThreadWorkerLink
        if not inline:
            # The worker waited for may itself wait for the others (a collective).
            self.flush()
        # else: the worker's commands run right here, on this thread, and the others'
        # stay held back (no write, no wake-up) unless it waits for them: the CCL
        # calls ctx.hand_over() first. A sync then costs no system call at all.
        hub = self.hub
        hub.waiting += 1  # the liveness watch judges silence only while someone waits
        try:
            if not inline:
                # An in-process worker's commands then run on its own thread: a
                # function that hangs there cannot hold the controller past the bound.
                deadline = None if timeout is None else time.monotonic() + timeout
                return hub.wait(worker_id, self.check_alive, deadline=deadline)
            link.run_pending(self.check_alive)  # type: ignore[attr-defined]  # inline: in-process
            return hub.wait(worker_id, self.check_alive)
        except DiscoError:
            raise  # an answer, a death, a timeout the caller asked for: nothing to drop
        except BaseException:
            hub.abandon()  # Ctrl-C: the call's answers must not be taken for the next one's
            raise
        finally:
            hub.waiting -= 1

    def sync(self, worker_id: int) -> None:
        link = self._link_of[worker_id]
        if type(link) is not ThreadWorkerLink:
            hub = self.hub
            if hub.unfenced or worker_id in hub.open:
                self.fence((worker_id,))
            hub.open.add(worker_id)  # before it goes (see ReplyHub.open)
            # The wait right after flushes first (this link is not in-process): the
            # flusher thread is not woken for this command (two wake-ups of this
            # process a sync, ~9 us of a 68 us sync with a worker process on one CPU).
            _flush_follows.on = True
            try:
                self.send(Outgoing((protocol.SYNC_WORKER, worker_id), shared=True), [worker_id])
            finally:
                _flush_follows.on = False
            try:
                self.recv(worker_id)
            except BaseException:
                # (Ctrl-C, a death) perhaps before the wait flushed: the flusher sends
                # what is held back, as it would have without the flag
                if not self._flush_due:
                    self._mark_dirty()
                raise
            return
        # A worker of this process syncs right here: no command, no reply to queue.
        hub = self.hub
        if hub.dead:
            raise hub.died_error()
        hub.waiting += 1  # the liveness watch judges silence only while someone waits
        try:
            link.run_pending(self.check_alive, sync=True)
        finally:
            hub.waiting -= 1
        if hub.dead:
            raise hub.died_error()
        if link.stopped:
            self.check_alive()
            raise WorkerDiedError([worker_id], "worker thread stopped")

    def take_errors(self) -> list[WorkerError]:
        return self.hub.take_errors()

    def check_alive(self) -> None:
        self._mark_dead_links()
        if self.hub.dead:
            raise self.hub.died_error()

    def _mark_dead_links(self) -> None:
        for link in self.links:
            reason = link.poll()
            if reason:
                self.hub.mark_dead(link.worker_ids, reason)

    def fence(self, worker_ids: Iterable[int]) -> None:
        """Before an answered command to ``worker_ids``: fence those whose answers were
        abandoned (see :class:`ReplyHub`), so that no wait takes one of those for its own.

        Costs nothing to wait for: the fence goes out ahead of the command, and the
        command's wait drops what comes before the fence's answer.
        """
        hub = self.hub
        for w in worker_ids:
            if w in hub.unfenced or w in hub.open:
                hub.unfenced.add(w)  # (an interrupt below: fenced next time, too)
                token = os.urandom(16)
                hub.fences[w] = token  # first: an interrupt after the send still drops
                self.send(Outgoing((protocol.SYNC_WORKER, w, token), shared=True), [w])
                hub.unfenced.discard(w)

    def recv_despite_deaths(self, worker_id: int, timeout: float) -> Any:
        """The next reply of ``worker_id`` while it lives, whichever other workers died.

        :meth:`recv` raises for every worker once one is dead (the session's state
        is lost); this is for fetching what the live ones still hold (a trace's
        events, ``disco_core.tracing``).

        Raises
        ------
        WorkerDiedError
            ``worker_id`` itself is dead.
        WorkerError
            Its reply is a failure (of this command or an earlier one).
        DiscoTimeoutError
            No reply within ``timeout`` seconds.
        """
        self._link_of[worker_id].flush()  # its own link only: a dead one's may raise
        hub = self.hub
        hub.waiting += 1
        try:
            deadline = time.monotonic() + timeout
            return hub.wait(worker_id, self._mark_dead_links, deadline=deadline, despite_others=True)  # fmt: skip
        finally:
            hub.waiting -= 1

    def on_worker_death(self, callback: Callable[[list[int], str], None]) -> None:
        self.hub.on_death(callback)

    def close(self, timeout: float = 5.0) -> None:
        give_up_at = time.monotonic() + timeout
        for link in self.links:
            # a full pipe to a stopped worker holds nothing
            link.give_up_at = give_up_at  # type: ignore[attr-defined]
        try:
            self.flush()
        except WorkerDiedError:
            pass
        self._stopping = True
        self._closed.set()
        self._wake_flusher.put(None)
        self.hub.closing = True
        deadline = time.monotonic() + timeout
        for link in self.links:
            kill = getattr(link, "kill", None)
            if kill is not None and self.hub.unresponsive.intersection(link.worker_ids):
                kill()  # it answers nothing, so it would not stop either
        try:
            for link in self.links:
                try:
                    link.close(deadline)
                except Exception:
                    pass
        except BaseException:
            # Ctrl-C cut the wait short: a worker still busy would run on, unstopped,
            # until this process exits; and one killed (or ending by itself) must be
            # reaped, or it stays a zombie (outside check: 4 of 150 interrupted
            # shutdowns): a thread waits for them, started by one C call
            reap = []
            for link in self.links:
                kill = getattr(link, "kill", None)
                if kill is not None:
                    with contextlib.suppress(Exception):
                        kill()
                reaper = getattr(link, "reap", None)
                if reaper is not None:
                    reap.append(reaper)
            if reap:
                _thread.start_new_thread(_reap_all, (reap,))
            raise
        finally:
            self.hub.shut()


def _reap_all(reapers: list[Callable[[], None]]) -> None:
    """Run each link's ``reap`` (wait for its killed worker process), in a thread."""
    for reap in reapers:
        with contextlib.suppress(Exception):
            reap()
