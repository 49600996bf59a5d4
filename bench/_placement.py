"""CPU placements for the benchmarks, and the machine's physical floor in each.

A ratio measured under one scheduler placement is not a result: on a small
machine the same code is fast when the controller and a worker happen to share
a CPU and slow when they do not (or the other way round). Every comparison is
therefore run in three placements, and a target is met only when it holds in
all of them:

``unpinned``
    No affinity: the kernel places every thread.
``one-cpu``
    The controller, its threads and every worker process on CPU 0.
``split``
    The controller process (all its threads: worker 0, reader threads, a peer's
    C++ threads) on CPU 0, every worker process on the other CPUs.

Worker processes inherit the affinity of the thread that spawns them, so a
placement pins this process to the *worker* CPUs while sessions are created
(:meth:`Placement.spawning`) and then moves every thread of this process to the
*controller* CPUs. Threads are moved one by one (``/proc/self/task``), because
``sched_setaffinity(0, ...)`` moves only the calling thread.

Usage::

    for p in placements():
        with p:
            with p.spawning():
                sess = disco.ProcessSession(2)
            ...  # measure
            sess.shutdown()
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

__all__ = [
    "PLACEMENTS",
    "Placement",
    "placements",
    "floor",
    "forked_peer",
    "load_average",
    "pin_rank",
]

PLACEMENTS = ("unpinned", "one-cpu", "split")


def _all_cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


_ALL = sorted(_all_cpus())


def _set_process(cpus: set[int]) -> None:
    """Move every thread of this process (Python's and native ones) onto ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended


class Placement:
    """One CPU placement; a context manager that applies it to this process.

    Attributes
    ----------
    name : str
        One of :data:`PLACEMENTS`.
    controller_cpus, worker_cpus : set of int
        Where the controller's threads and the worker processes run.
    """

    def __init__(self, name: str) -> None:
        if name not in PLACEMENTS:
            raise ValueError(f"unknown placement {name!r}; expected one of {PLACEMENTS}")
        self.name = name
        cpus = set(_ALL)
        if name == "unpinned" or len(cpus) < 2:
            self.controller_cpus = self.worker_cpus = cpus
            if name != "unpinned":
                self.controller_cpus = self.worker_cpus = {_ALL[0]}
        elif name == "one-cpu":
            self.controller_cpus = self.worker_cpus = {_ALL[0]}
        else:  # split
            self.controller_cpus = {_ALL[0]}
            self.worker_cpus = cpus - {_ALL[0]}

    @property
    def usable(self) -> bool:
        """False for ``split`` on a machine (or cgroup) with a single CPU."""
        return self.name != "split" or len(_ALL) >= 2

    def describe(self) -> str:
        if self.name == "unpinned":
            return f"unpinned ({len(_ALL)} CPUs)"
        c = ",".join(map(str, sorted(self.controller_cpus)))
        w = ",".join(map(str, sorted(self.worker_cpus)))
        return f"{self.name} (controller on CPU {c}, workers on CPU {w})"

    def __enter__(self) -> Placement:
        _set_process(self.controller_cpus)
        return self

    def __exit__(self, *exc: object) -> None:
        _set_process(set(_ALL))

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Inside: this process is on the worker CPUs, so processes started now inherit them.

        On leaving, every thread of this process (those started inside too) moves
        to the controller CPUs.
        """
        _set_process(self.worker_cpus)
        try:
            yield
        finally:
            _set_process(self.controller_cpus)

    def move(self, cpus: set[int]) -> None:
        """Move every thread of this process onto ``cpus`` (until the next move)."""
        _set_process(set(cpus))

    def rank_cpus(self, rank: int) -> set[int]:
        """The CPUs of rank ``rank`` of a peer that runs every rank as a process
        (MPI, gloo): rank 0 where the controller would be, the others where workers are."""
        if rank == 0:
            return set(self.controller_cpus)
        return set(self.worker_cpus)


def placements(names: list[str] | None = None) -> list[Placement]:
    """The placements to run (all of :data:`PLACEMENTS` by default), usable ones only."""
    out = [Placement(n) for n in (names or PLACEMENTS)]
    return [p for p in out if p.usable]


def pin_rank(rank: int) -> None:
    """Pin this process as rank ``rank`` of the placement named in ``$BENCH_PLACEMENT``.

    Called by peer programs (``peer_mpi.py``, ``peer_gloo.py``) at start-up.
    """
    name = os.environ.get("BENCH_PLACEMENT")
    if name:
        _set_process(Placement(name).rank_cpus(rank))


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


# ---------------------------------------------------------------------------- the floor
def _pipe_ping_pong(p: Placement, reps: int) -> float:
    """Median round trip of one byte between two processes over a pair of pipes."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    with p.spawning():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(a_w)
            os.close(b_r)
            while os.read(a_r, 1):
                os.write(b_w, b"y")
        finally:
            os._exit(0)
    os.close(a_r)
    os.close(b_w)
    try:
        times = _round_trips(a_w, b_r, reps)
    finally:
        os.close(a_w)
        os.close(b_r)
        os.waitpid(pid, 0)
    return statistics.median(times[reps // 10 :])


def _round_trips(out_fd: int, in_fd: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` round trips of one byte: out on ``out_fd``, back on ``in_fd``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        os.write(out_fd, b"x")
        os.read(in_fd, 1)
        times.append(time.perf_counter() - t0)
    return times


def thread_wakeup(reps: int = 5000) -> float:
    """Seconds one thread of this process takes to wake another that sleeps: half the
    median round trip of a byte through two pipes between two threads (each read
    sleeps, with the GIL let go). A 2-thread collective cannot beat it: a member whose
    peer has not arrived lets go of the GIL, and the peer that takes it over has been
    asleep on it. On a VM a wake-up of an idle vCPU costs tens of microseconds; on one
    CPU it is a context switch."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()

    def echo() -> None:
        for _ in range(reps):
            os.read(r1, 1)
            os.write(w2, b"x")

    peer = threading.Thread(target=echo, daemon=True)
    peer.start()
    try:
        times = _round_trips(w1, r2, reps)
        peer.join()
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    return statistics.median(times) / 2


def forked_peer(p: Placement, serve: Callable[[socket.socket], None]) -> tuple[socket.socket, int]:  # fmt: skip
    """A process forked where ``p`` puts the workers, connected to this one over
    loopback TCP (``TCP_NODELAY`` on both ends): it runs ``serve(its socket)``, then
    exits. Returns this end's socket and the process's pid (the caller closes the
    socket, then waits for the pid)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    with p.spawning():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            lst.close()
            c = socket.create_connection(("127.0.0.1", port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            serve(c)
        finally:
            os._exit(0)
    conn, _ = lst.accept()
    lst.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn, pid


def _echo_bytes(c: socket.socket) -> None:
    while c.recv(1):
        c.sendall(b"y")


def _socket_ping_pong(p: Placement, reps: int) -> float:
    """Median round trip of one byte between two processes over loopback TCP."""
    conn, pid = forked_peer(p, _echo_bytes)
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
        os.waitpid(pid, 0)
    return statistics.median(times[reps // 10 :])


def _memcpy(nbytes: int = 64 << 20, reps: int = 7) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def floor(p: Placement, reps: int = 2000) -> dict[str, float]:
    """The physical floor under placement ``p`` (call inside ``with p:``).

    Returns
    -------
    dict
        ``pipe_rt_s`` and ``socket_rt_s``: median one-byte round trips between two
        processes (this one on the controller CPUs, the other on the worker CPUs);
        ``memcpy_GBps``: ``np.copyto`` of 64 MiB.
    """
    return {
        "pipe_rt_s": _pipe_ping_pong(p, reps),
        "socket_rt_s": _socket_ping_pong(p, reps),
        "memcpy_GBps": _memcpy() / 1e9,
    }
