"""The ``mpi`` channel: a session whose workers are the ranks of an MPI job.

Run ``mpiexec -n N python script.py`` (or ``disco-mpi run -n N script.py``, or
``srun``); in the script, every rank executes the same top-level code and creates
the session the same way::

    sess = disco.Session.create("mpi")        # or disco_mpi.MPISession()

On rank 0 this returns the session (rank 0 hosts the controller and worker 0, in
a thread). On ranks 1..N-1 the call never returns: the rank becomes worker ``rank``,
runs the commands rank 0 sends over MPI, and exits the process (``MPI_Finalize``,
exit code 0) when the session shuts down. So code before the session is created
runs on every rank (define and register worker functions there); code after it
runs on rank 0 only.

Commands and replies are the core's frames in its network format (a tagged
header plus out-of-band buffers: nothing is unpickled, since MPI traffic may cross
sockets) sent as MPI messages on a private duplicate of ``MPI_COMM_WORLD``.
``init_ccl("mpi")`` then uses ``MPI_COMM_WORLD`` itself (rank ``w`` is worker ``w``).

A rank that dies ends the whole MPI job (that is what ``mpiexec`` and ``srun`` do;
MPI cannot recover a communicator after a member died), so rank 0 does not hang.
A rank that stops answering without dying (stopped, frozen, or a thread holding its
GIL) is found by its heartbeats, as the other channels' workers are: each rank sends
one whenever it sent nothing for a second, and rank 0 raises
:class:`~disco_core.WorkerUnresponsiveError` for it after ``DISCO_LIVENESS_TIMEOUT``
of silence while it waits. MPI cannot finalize a job with such a member, and the
launcher waits for every rank: rank 0 then ends the job with ``MPI_Abort`` when its
program exits (exit code 1), after saying why.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
import time
from typing import Any

from disco_core import DiscoError, DiscoValueError, FrameLimitError, WorkerError
from disco_core.spi import (
    FLAG_BATCH,
    HeartbeatSender,
    LinkChannel,
    Outgoing,
    ThreadWorkerLink,
    Worker,
    WorkerLink,
    check_frame,
    decode_untrusted,
    encode_for_network,
    frame_head,
    liveness_timeout,
    unfilled_bytearray,
    worker_spin_seconds,
)

from . import _runtime

__all__ = ["MPIChannel", "MPISession", "rank", "world_size"]

_CMD_TAG = 21
_REPLY_TAG = 22
_BUF_TAG = 23
_PREFIX = struct.Struct("<QII")


def rank() -> int:
    """This process's rank in ``MPI_COMM_WORLD`` (initialises MPI)."""
    return _runtime.mpi(finalize=True).COMM_WORLD.Get_rank()


def world_size() -> int:
    """The number of ranks in ``MPI_COMM_WORLD`` (initialises MPI)."""
    return _runtime.mpi(finalize=True).COMM_WORLD.Get_size()


def _send_frame(comm: Any, dest: int, tag: int, frame: tuple, flags: int, reqs: list) -> None:
    """Post a frame: its head (prefix, lengths, header) then each out-of-band buffer."""
    MPI = _runtime.mpi()
    head = frame_head(frame, flags)
    reqs.append((comm.Isend([head, MPI.BYTE], dest, tag), head))
    for m in frame[1]:
        data = bytes(m)  # the caller's array may change as soon as we return
        reqs.append((comm.Isend([data, MPI.BYTE], dest, _BUF_TAG), data))


#: Seconds a frame's buffer may come after its head (the sender posts them together).
_BUFFER_WAIT = 10.0


def _probe_buffer(comm: Any, src: int, status: Any, deadline: float) -> Any:
    """The next buffer message of ``src``, which its frame's head announced.

    A head that declares buffers that never come left the one reply reader
    waiting for good, and every rank's replies with it (an outside check): past
    ``deadline`` (``time.monotonic()``: :data:`_BUFFER_WAIT` seconds after the head,
    for all of a frame's buffers) it is a :class:`FrameLimitError`.
    """
    msg = comm.Improbe(src, _BUF_TAG, status)
    if msg is not None:  # the common case: it came with the head
        return msg
    pause = 1e-4
    while True:
        time.sleep(pause)
        msg = comm.Improbe(src, _BUF_TAG, status)
        if msg is not None:
            return msg
        if time.monotonic() > deadline:
            raise FrameLimitError(
                f"rank {src} announced buffers that did not come within {_BUFFER_WAIT:g} s"
            )
        pause = min(pause * 2, 0.01)


#: The longest sleep between two looks for a message once the spin is over: what a rank
#: that sat idle adds, at most, to the wait for its next command.
_MAX_PAUSE = 5e-4
#: The same for rank 0's reply reader while the controller waits for a reply.
_MAX_PAUSE_AWAITED = 1e-4


def _wait_message(comm: Any, source: int, tag: int, status: Any, awaited: Any = None) -> Any:
    """The next message from ``source`` with ``tag`` (as ``Mprobe`` gives it), found by
    looking (``Improbe``): for ``DISCO_WORKER_SPIN_US`` yielding the CPU, then sleeping
    from 20 us up to :data:`_MAX_PAUSE` between looks (:data:`_MAX_PAUSE_AWAITED` while
    ``awaited()``, when given, says someone waits for it).

    MPICH's blocking probe polls inside the library for good, holding a CPU and its
    lock (rank 0's sends waited for it): a round trip to a rank took about 200 us on
    two CPUs, and 8.4 ms with both ranks on one, where the pollers took turns by
    time slices (``plugins/mpi/bench_mpi_channel.py``).
    """
    spin_until = time.perf_counter() + worker_spin_seconds()
    pause = 0.0
    while True:
        if pause:
            time.sleep(pause)
            cap = _MAX_PAUSE_AWAITED if awaited is not None and awaited() else _MAX_PAUSE
            pause = min(pause * 2, cap)
        else:
            os.sched_yield()  # (the GIL too: rank 0's reader shares it with the caller)
            if time.perf_counter() > spin_until:
                pause = 2e-5
        msg = comm.Improbe(source, tag, status)
        if msg is None and pause:
            # MPICH (5.0) shows a message that came during a sleep only at the second
            # probe after it (the first runs the progress that takes it in): without this
            # look, each hop after an idle spell waited a sleep more (an outside check:
            # the first call after idle took about 2 ms, not 0.5)
            msg = comm.Improbe(source, tag, status)
        if msg is not None:
            return msg


def _recv_frame(comm: Any, source: int, tag: int, awaited: Any = None) -> tuple[Any, int, bytes, list, int]:  # fmt: skip
    """Receive one frame (blocking); returns (source, tag, header, buffers, flags).

    Its head is checked against the core's frame limits (``check_frame``), and
    each buffer is sized from the message that actually came, which must match
    its declared length: nothing is allocated from a length alone.

    Raises
    ------
    FrameLimitError
        The head is malformed or over a limit, or a buffer is not as declared.
    """
    MPI = _runtime.mpi()
    status = MPI.Status()
    msg = comm.Improbe(source, tag, status)
    if msg is None:
        msg = _wait_message(comm, source, tag, status, awaited)
    head = bytearray(status.Get_count(MPI.BYTE))
    msg.Recv([head, MPI.BYTE])
    src = status.Get_source()
    if len(head) < _PREFIX.size:
        raise FrameLimitError(f"a frame head of {len(head)} bytes from rank {src}")
    hlen, nbuf, flags = _PREFIX.unpack_from(head)
    check_frame(hlen, nbuf)
    start = _PREFIX.size + 8 * nbuf
    if len(head) != start + hlen:
        raise FrameLimitError(
            f"a frame head of {len(head)} bytes from rank {src} declares {start + hlen}"
        )
    lens = struct.unpack_from(f"<{nbuf}Q", head, _PREFIX.size) if nbuf else ()
    check_frame(hlen, nbuf, lens)
    header = bytes(head[start:])
    buffers = []
    deadline = time.monotonic() + _BUFFER_WAIT  # one wait for all of the frame's buffers
    for n in lens:
        part = _probe_buffer(comm, src, status, deadline)
        got = status.Get_count(MPI.BYTE)
        if got != n:
            part.Recv([bytearray(got), MPI.BYTE])  # taken off the queue all the same
            raise FrameLimitError(f"a buffer of {got} bytes from rank {src}, declared {n}")
        out = unfilled_bytearray(n)  # filled whole by the receive
        part.Recv([out, MPI.BYTE])
        buffers.append(out)
    return src, status.Get_tag(), header, buffers, flags


class MPIRankLink(WorkerLink):
    """Rank 0's link to worker ``rank`` (another MPI process)."""

    untrusted = True  # the rank rebuilds commands with decode_untrusted
    heartbeats = True  # a rank beats (HeartbeatSender) when its MPI is THREAD_MULTIPLE

    def __init__(self, comm: Any, worker_id: int) -> None:
        self.worker_ids = (worker_id,)
        self.comm = comm
        self.lock = threading.Lock()
        self.pending: list = []

    def send(self, out: Outgoing) -> None:
        with self.lock:
            if self.pending:
                MPI = _runtime.mpi()
                done = MPI.Request.Testall([r for r, _ in self.pending])
                if done:
                    self.pending.clear()
            _send_frame(
                self.comm, self.worker_ids[0], _CMD_TAG, out.wire_frame, out.flags, self.pending
            )

    def close(self, deadline: float) -> None:
        pass


class MPIChannel(LinkChannel):
    """Worker 0 in a thread of rank 0; worker ``r`` is MPI rank ``r``.

    Call it on every rank: on ranks other than 0 it runs the worker and exits.

    Parameters
    ----------
    num_workers : int, optional
        Must equal the MPI job's size when given (default: the job's size).
    num_groups : int
        Number of worker groups; must divide the number of workers.
    """

    kind = "mpi"

    def __init__(self, num_workers: int | None = None, num_groups: int = 1) -> None:
        MPI = _runtime.mpi(finalize=True)
        world = MPI.COMM_WORLD
        size, me = world.Get_size(), world.Get_rank()
        if num_workers is not None and num_workers != size:
            raise DiscoError(
                f"the 'mpi' channel has one worker per MPI rank: num_workers={num_workers} but "
                f"the job has {size} ranks (start it with mpiexec -n {num_workers})"
            )
        if num_groups < 1 or size % num_groups:
            raise DiscoValueError(
                f"num_workers ({size}) must be a multiple of num_groups ({num_groups})"
            )
        comm = world.Dup()  # collective: every rank creates the channel
        nodes = len(set(world.allgather(MPI.Get_processor_name())))
        # Every rank is past MPI_Init (and attached to MPICH's shared segment): its
        # name is no longer needed, and a job that is killed leaves nothing behind.
        _runtime.release_shm(all_attached=True)
        if me != 0:
            _serve(comm, me, size, num_groups)  # never returns
        super().__init__(size, num_groups)
        self.comm = comm
        self.num_nodes = nodes
        self.shares_memory = nodes == 1
        links: list[WorkerLink] = [ThreadWorkerLink(0, size, num_groups, self.hub)]
        links += [MPIRankLink(comm, r) for r in range(1, size)]
        self._set_links(links)
        # the ranks started with the job and send no "ready": one from a rank would be
        # taken for its next answer (an outside check)
        self.hub.ready.update(range(size))
        self._here = set(range(1, size))  # the ranks that have not said goodbye
        self._reader = threading.Thread(
            target=self._read_replies, name="disco-mpi-replies", daemon=True
        )
        self._reader.start()

    def _read_replies(self) -> None:
        """Deliver the other ranks' replies until each has said goodbye.

        Whatever stops this thread (a malformed frame, a failed receive) ends the
        session's links to the ranks still here, with the reason: a reader that
        died silently left every caller waiting for good.
        """
        here = self._here
        try:
            while here:
                src, _, header, buffers, flags = _recv_frame(
                    self.comm, _runtime.mpi().ANY_SOURCE, _REPLY_TAG, self._awaited
                )
                try:
                    msg = decode_untrusted(header, buffers)  # MPI traffic may cross sockets
                except Exception as exc:  # noqa: BLE001 - a whole frame this rank does not accept
                    msg = (
                        "fail",
                        WorkerError(
                            src, type(exc).__name__, f"the worker's reply was refused: {exc}"
                        ),
                    )
                if type(msg) is tuple and msg and msg[0] == "bye":
                    here.discard(src)  # (once per rank: another's goodbye ends nothing)
                    continue
                self.hub.deliver(src, msg)  # (it drops what is not a message)
        except Exception as exc:  # noqa: BLE001 - whatever stops this reader ends the links
            if not self.hub.closing:
                self.hub.mark_dead(
                    sorted(here), f"the replies of MPI ranks could not be read any more: {exc!r}"
                )

    def close(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        super().close(timeout)
        # the goodbyes of the ranks still answering (one declared dead says none)
        while self._here - self.hub.dead.keys() and time.monotonic() < deadline:
            self._reader.join(0.01)
            if not self._reader.is_alive():
                break
        MPI = _runtime.mpi()
        lost = set()
        for link in self.links:
            if isinstance(link, MPIRankLink):
                rank_ = link.worker_ids[0]
                with link.lock:
                    # a command a busy rank has not taken yet is waited for (as before);
                    # one to a stopped rank never is taken: given up once it is silent
                    while link.pending and not MPI.Request.Testall([r for r, _ in link.pending]):
                        if self._silent(rank_, link.liveness):
                            lost.add(rank_)
                            break
                        time.sleep(0.001)
                    else:
                        link.pending.clear()
        # A rank that stopped answering never reaches MPI_Finalize, and the launcher
        # waits for it: the job would never end. (One only slow to say goodbye, still
        # beating, is waited for at the finalize, as before.)
        gone = sorted(lost | {r for r in self._here if self._silent(r, liveness_timeout())})
        if gone:
            _runtime.abort_at_exit(
                f"the session ended without an answer from MPI rank(s) {gone} "
                f"({self.hub.dead.get(gone[0], 'silent for longer than DISCO_LIVENESS_TIMEOUT')})"
            )
            return
        try:
            self.comm.Free()
        except Exception:
            pass

    def _awaited(self) -> bool:
        """Whether a thread of the controller waits for a reply now."""
        return self.hub.waiting > 0

    def _input_waiting(self, link: WorkerLink, worker_id: int) -> bool:
        """True when a message of ``worker_id`` waits unread: the one reply reader may be
        held by another rank's large reply (a rank stopped in the middle of sending
        one), and the messages of the others, heartbeats included, then wait behind
        it; their ranks are not silent (an outside check blamed them too)."""
        if not isinstance(link, MPIRankLink):
            return super()._input_waiting(link, worker_id)
        try:
            waiting = bool(self.comm.Iprobe(worker_id, _REPLY_TAG))
        except Exception:  # noqa: BLE001 - a communicator being freed: not a sign of life
            return False
        if waiting:
            self.hub.touch(worker_id)
        return waiting

    def _silent(self, rank_: int, liveness: float) -> bool:
        """Whether ``rank_`` is dead or stopped answering (its heartbeats stopped)."""
        hub = self.hub
        if rank_ in hub.dead:
            return True
        if not liveness or rank_ not in hub.beating:
            return False
        if time.monotonic() - hub.seen[rank_] <= liveness:
            return False
        return not self._input_waiting(self._link_of[rank_], rank_)  # (behind another's)


def _serve(comm: Any, me: int, size: int, num_groups: int) -> None:
    """Run worker ``me`` until the session shuts down, then end the process."""
    reqs: list = []
    MPI = _runtime.mpi()

    def post(msg: tuple) -> None:
        _send_frame(comm, 0, _REPLY_TAG, encode_for_network(msg), 0, reqs)
        MPI.Request.Waitall([r for r, _ in reqs])
        reqs.clear()

    # Heartbeats go from a thread of their own, beside the worker's MPI calls (a
    # collective that waits for a stopped peer included): only with THREAD_MULTIPLE.
    beats = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    send = HeartbeatSender(post) if beats else None
    worker = Worker(me, size, num_groups, send or post)
    if send is not None:
        send.start()

    def commands():
        while True:
            _, _, header, buffers, flags = _recv_frame(comm, 0, _CMD_TAG)
            # MPI traffic may cross sockets: the network format, never unpickled
            if flags & FLAG_BATCH:
                yield from decode_untrusted(header, buffers)
            else:
                yield decode_untrusted(header, buffers)

    code = 0
    try:
        worker.run(commands().__next__)
    except BaseException:  # noqa: BLE001 - the loop itself broke
        import traceback

        traceback.print_exc()
        code = 1
    try:
        if send is not None:
            send(("bye", None))
            send.lock.acquire()  # no heartbeat after the goodbye (the communicator goes)
        else:
            post(("bye", None))
        comm.Free()
        MPI.Finalize()
    except Exception as exc:
        print(f"disco-mpi worker {me}: finalize failed: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    _exit_with_c_atexit(code)


def _exit_with_c_atexit(code: int) -> None:
    """End the process without Python's teardown but with the C library's exit handlers.

    MPICH sends the PMI ``finalize`` message to its process manager from a C atexit
    handler, not from ``MPI_Finalize``: a rank ended with ``os._exit`` never sends
    it, and Hydra then sometimes (about one job in eight) kills the whole job with
    SIGKILL. Python's own teardown is skipped on purpose: the worker's daemon
    threads may still sit in MPI calls.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.exit.argtypes = [ctypes.c_int]
        libc.exit(code)
    finally:  # no C library to call: the old way
        os._exit(code)


def MPISession(num_groups: int = 1, num_workers: int | None = None):
    """A :class:`disco_core.Session` over the ``mpi`` channel (call it on every rank)."""
    from disco_core import Session

    return Session(MPIChannel(num_workers=num_workers, num_groups=num_groups))
