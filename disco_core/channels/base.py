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

import abc
import collections
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import DiscoError, WorkerDiedError, WorkerError
from ..protocol import FLAG_BATCH, Frame, encode, frame_head, isolate, isolate_command, write_all
from ..worker import Worker, set_current

__all__ = [
    "Channel",
    "Outgoing",
    "ReplyHub",
    "WorkerLink",
    "BatchingLink",
    "LinkChannel",
    "ThreadWorkerLink",
]


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
    """

    __slots__ = ("cmds", "by_reference", "_frame")

    def __init__(self, *cmds: tuple, by_reference: bool = False) -> None:
        self.cmds = cmds
        self.by_reference = by_reference
        self._frame: Frame | None = None

    @property
    def flags(self) -> int:
        return FLAG_BATCH if len(self.cmds) > 1 else 0

    @property
    def frame(self) -> Frame:
        """The serialised command(s) (pickle header + out-of-band buffers), one frame."""
        if self._frame is None:
            self._frame = encode(self.cmds if len(self.cmds) > 1 else self.cmds[0])
        return self._frame

    def local(self) -> tuple:
        """The commands for an in-process worker: its own copy of every mutable value."""
        if self.by_reference:
            return self.cmds
        return tuple([isolate_command(c) for c in self.cmds])


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

    @abc.abstractmethod
    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        """Send a command to ``workers`` (all when None), in order, without waiting."""

    @abc.abstractmethod
    def recv(self, worker_id: int) -> Any:
        """Wait for the next reply of ``worker_id``.

        Raises
        ------
        WorkerError
            The worker answered with the failure of the synchronous command.
        WorkerDiedError
            A worker of the session died while waiting.
        """

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


class ReplyHub:
    """Where replies and asynchronous error reports of all workers arrive."""

    _WAKE = ("wake", None)

    def __init__(self, num_workers: int) -> None:
        self.replies = [queue.SimpleQueue() for _ in range(num_workers)]
        self.errors: collections.deque[WorkerError] = collections.deque()
        self.dead: dict[int, str] = {}
        self.closing = False
        self._death_callbacks: list[Callable[[list[int], str], None]] = []
        self._lock = threading.Lock()

    def deliver(self, worker_id: int, msg: tuple) -> None:
        if msg[0] == "error":
            self.errors.append(msg[1])
        else:
            self.replies[worker_id].put(msg)

    def on_death(self, callback: Callable[[list[int], str], None]) -> None:
        self._death_callbacks.append(callback)

    def mark_dead(self, worker_ids: Iterable[int], reason: str) -> None:
        """Record dead workers, wake every waiter, run the death callbacks once."""
        ids = [w for w in worker_ids if w not in self.dead]
        if not ids or self.closing:
            return
        with self._lock:
            for w in ids:
                self.dead[w] = reason
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
        return WorkerDiedError(sorted(self.dead), "; ".join(reasons))

    def wait(self, worker_id: int, poll: Callable[[], None], interval: float = 0.2) -> Any:
        q = self.replies[worker_id]
        while True:
            if self.dead:
                raise self.died_error()
            try:
                kind, payload = q.get(timeout=interval)
            except queue.Empty:
                poll()
                continue
            if kind == "reply" or kind == "ready":
                return payload
            if kind == "fail":
                raise payload
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


class BatchingLink(WorkerLink):
    """A link to workers in other processes, whose small commands leave in batches.

    Small commands wait in an outbox and leave together (one write, one wake-up of
    the worker); the channel flushes the outbox before it waits for any reply, and
    within ``FLUSH_DELAY`` otherwise. A frame with out-of-band buffers leaves at
    once: those buffers are views of the caller's arrays, which may change next.

    Subclasses say where bytes go: by default ``write_all`` to the file descriptor
    ``out_fd`` (a pipe, a socket); :meth:`_write` and :meth:`_write_views` may be
    overridden, and :meth:`_died` turns a failed write into the error to raise.
    """

    #: An outbox this large is flushed at once.
    OUTBOX_BYTES = 1 << 16
    out_fd: int

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outbox: list[bytes] = []
        self.outbox_bytes = 0

    def send(self, out: Outgoing) -> None:
        frame = out.frame
        self.send_head(frame_head(frame, out.flags), frame[1])

    def send_head(self, head: bytes, buffers: Sequence[Any]) -> None:
        """Send a frame's ``head`` (with any routing prefix) and its out-of-band ``buffers``."""
        try:
            with self.lock:
                if buffers:
                    self._flush_locked()
                    self._write_views(head, buffers)
                else:
                    self.outbox.append(head)
                    self.outbox_bytes += len(head)
                    if self.outbox_bytes >= self.OUTBOX_BYTES:
                        self._flush_locked()
        except OSError as exc:
            raise self._died(exc) from None

    @property
    def buffered(self) -> bool:
        return bool(self.outbox)

    def flush(self) -> None:
        try:
            with self.lock:
                self._flush_locked()
        except OSError as exc:
            raise self._died(exc) from None

    def _flush_locked(self) -> None:
        if self.outbox:
            data = b"".join(self.outbox) if len(self.outbox) > 1 else self.outbox[0]
            self.outbox.clear()
            self.outbox_bytes = 0
            self._write(data)

    def _write(self, data: bytes) -> None:
        write_all(self.out_fd, data)

    def _write_views(self, head: bytes, buffers: Sequence[Any]) -> None:
        write_all(self.out_fd, head)
        for m in buffers:
            write_all(self.out_fd, m)

    @abc.abstractmethod
    def _died(self, exc: OSError) -> WorkerDiedError:
        """The error to raise when a write failed with ``exc`` (the workers are gone)."""


class ThreadWorkerLink(WorkerLink):
    """A worker running in a thread of the controller's process.

    Commands wait in a deque; a token queue wakes the thread. When the controller
    needs this worker's reply it runs the pending commands itself, on its own
    thread (under the same lock, so the order is kept): a synchronising call then
    costs no thread switch at all, while commands still run in the background
    between synchronising calls.
    """

    def __init__(self, worker_id: int, num_workers: int, num_groups: int, hub: ReplyHub) -> None:
        self.worker_ids = (worker_id,)
        self.pending: collections.deque = collections.deque()
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.stopped = False
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
        pending, execute = self.pending, self.worker.execute
        while pending and not self.stopped:
            if not execute(pending.popleft()):
                self.stopped = True

    def _run(self) -> None:
        set_current(self.worker.ctx)
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

    def run_pending(self, poll: Callable[[], None]) -> None:
        """Run the queued commands on the calling (controller) thread."""
        if not self.pending:
            return
        while not self.lock.acquire(timeout=0.2):
            poll()  # the worker thread is busy; meanwhile notice dead peers
        try:
            previous = set_current(self.worker.ctx)
            try:
                self._drain()
            finally:
                set_current(previous)
        finally:
            self.lock.release()

    def send(self, out: Outgoing) -> None:
        self.pending.extend(out.local())
        self.tokens.put(None)

    def poll(self) -> str | None:
        if not self.thread.is_alive() and not self.stopped and not self.hub.closing:
            return "worker thread stopped"
        return None

    def close(self, deadline: float) -> None:
        self.tokens.put(None)
        self.thread.join(max(0.0, deadline - time.monotonic()))


#: Longest time a buffered command waits before it is written out
#: (``DISCO_FLUSH_DELAY`` seconds; 0 writes every command at once).
FLUSH_DELAY = float(os.environ.get("DISCO_FLUSH_DELAY", "0.0005"))


class LinkChannel(Channel):
    """A :class:`Channel` made of links, one per worker or per node.

    Links may buffer small commands; the channel flushes them before it waits for
    a reply, and a flusher thread flushes them within :data:`FLUSH_DELAY` seconds
    otherwise, so asynchronous commands always start promptly.
    """

    def __init__(self, num_workers: int, num_groups: int) -> None:
        self.num_workers = num_workers
        self.num_groups = num_groups
        self.hub = ReplyHub(num_workers)
        self.links: list[WorkerLink] = []
        self._link_of: list[WorkerLink] = []
        self._wake_flusher: queue.SimpleQueue = queue.SimpleQueue()
        self._flusher: threading.Thread | None = None
        self._flush_due = False
        self._stopping = False

    def wait_ready(self, worker_ids: Iterable[int], deadline: float, what: str = "workers") -> None:
        """Wait for the ``ready`` message of each of ``worker_ids`` until ``deadline``.

        Raises :class:`TimeoutError` (naming ``DISCO_START_TIMEOUT``) past the deadline,
        and :class:`WorkerDiedError` ("failed to start: ...") when one of them died.
        """
        limit = max(0.0, deadline - time.monotonic())

        def poll() -> None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} did not start within {limit:.0f} s (DISCO_START_TIMEOUT)"
                )

        for w in worker_ids:
            try:
                self.hub.wait(w, poll, interval=0.05)
            except WorkerDiedError as exc:
                raise WorkerDiedError(exc.worker_ids, f"failed to start: {exc.reason}") from None

    def _flush_loop(self) -> None:
        while True:
            self._wake_flusher.get()
            if self._stopping:
                return
            time.sleep(FLUSH_DELAY)
            self._flush_due = False
            for link in self.links:
                if link.buffered:
                    try:
                        link.flush()
                    except WorkerDiedError as exc:
                        self.hub.mark_dead(exc.worker_ids, exc.reason)

    def _mark_dirty(self) -> None:
        if FLUSH_DELAY <= 0:
            self.flush()
            return
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="disco-flush", daemon=True
            )
            self._flusher.start()
        self._flush_due = True
        self._wake_flusher.put(None)

    def flush(self) -> None:
        """Write out every buffered command now."""
        for link in self.links:
            if link.buffered:
                link.flush()

    def _set_links(self, links: list[WorkerLink]) -> None:
        # In-process links first: a pipe that blocks must never delay worker 0.
        self.links = sorted(links, key=lambda link: not isinstance(link, ThreadWorkerLink))
        by_worker: dict[int, WorkerLink] = {}
        for link in links:
            for w in link.worker_ids:
                by_worker[w] = link
        missing = set(range(self.num_workers)) - set(by_worker)
        if missing:
            raise DiscoError(f"channel has no link for workers {sorted(missing)}")
        self._link_of = [by_worker[w] for w in range(self.num_workers)]

    def send(self, out: Outgoing, workers: Sequence[int] | None = None) -> None:
        if workers is None:
            targets = self.links
        else:
            targets = list({id(self._link_of[w]): self._link_of[w] for w in workers}.values())
        dirty = False
        for link in targets:
            link.send(out)
            dirty = dirty or link.buffered
        if dirty and not self._flush_due:
            self._mark_dirty()

    def recv(self, worker_id: int) -> Any:
        self.flush()
        link = self._link_of[worker_id]
        if type(link) is ThreadWorkerLink:
            link.run_pending(self.check_alive)
        return self.hub.wait(worker_id, self.check_alive)

    def take_errors(self) -> list[WorkerError]:
        return self.hub.take_errors()

    def check_alive(self) -> None:
        for link in self.links:
            reason = link.poll()
            if reason:
                self.hub.mark_dead(link.worker_ids, reason)
        if self.hub.dead:
            raise self.hub.died_error()

    def on_worker_death(self, callback: Callable[[list[int], str], None]) -> None:
        self.hub.on_death(callback)

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.flush()
        except WorkerDiedError:
            pass
        self._stopping = True
        self._wake_flusher.put(None)
        self.hub.closing = True
        deadline = time.monotonic() + timeout
        for link in self.links:
            try:
                link.close(deadline)
            except Exception:
                pass
