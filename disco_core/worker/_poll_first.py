"""A worker process's read of its command pipe: poll a moment before it sleeps.

A worker process that has run every command it was given sleeps in ``read`` until
the controller writes more. Waking a sleeping process on another CPU costs tens of
microseconds on a VM (an inter-processor interrupt through the hypervisor): about half
of a sync with a worker process, whose next command often comes right after its
reply. So the read first polls the pipe for ``DISCO_WORKER_SPIN_US`` microseconds
(200 by default), yielding the CPU between polls, and only then blocks.

Polling can only help while another CPU runs the controller. A worker that may run
only on the one CPU its parent (the controller) runs on reads at once, and the poll
stops at the first yield that ran another task (a CPU shared with a busy process, where
polling would only take turns from it). An idle worker polls once, for the spin, then
sleeps: no cost while idle.
"""

from __future__ import annotations

import os
import select
import time
import warnings
from collections.abc import Callable

__all__ = ["DEFAULT_SPIN_US", "spin_seconds", "reader_of"]

#: Microseconds of polling before a worker's read sleeps, unless DISCO_WORKER_SPIN_US says otherwise.
DEFAULT_SPIN_US = 200.0
# A yield that took this long (seconds) ran another task on this CPU: the worker shares
# it (with the controller, on one CPU), where polling only takes turns from the others.
_SHARED = 20e-6


def spin_seconds() -> float:
    """``$DISCO_WORKER_SPIN_US`` in seconds (a bad value warns and gives the default)."""
    raw = os.environ.get("DISCO_WORKER_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US * 1e-6
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:  # NaN fails too
        warnings.warn(
            f"DISCO_WORKER_SPIN_US={raw!r} is not a number of microseconds from 0 to "
            f"1000000; using {DEFAULT_SPIN_US:g}",
            RuntimeWarning,
            stacklevel=2,
        )
        value = DEFAULT_SPIN_US
    return value * 1e-6


def reader_of(fd: int, spin: float) -> Callable[[int], bytes]:
    """``read(n)`` of the blocking descriptor ``fd`` that polls for ``spin`` seconds
    first when nothing is there yet (``spin`` 0: a plain ``os.read``)."""
    if spin <= 0:
        return lambda n: os.read(fd, n)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poll, clock, read, pause = poller.poll, time.perf_counter, os.read, os.sched_yield
    alone = _AloneOnOneCpu()

    def read_after_polling(n: int) -> bytes:
        if not poll(0) and not alone():
            now = clock()
            until = now + spin
            while now < until:
                pause()
                if poll(0):
                    break
                then, now = now, clock()
                if now - then > _SHARED:
                    break  # the yield ran someone else here: leave the CPU to them
        return read(fd, n)

    return read_after_polling


class _AloneOnOneCpu:
    """Whether this process and its parent (the controller, or a node's agent) may run
    on one and the same CPU only, where polling would only take turns from the parent;
    looked at again at most ten times a second (an affinity can change)."""

    def __init__(self) -> None:
        self.parent = os.getppid()
        self.checked = -1.0
        self.answer = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.checked > 0.1:
            self.checked = now
            try:
                cpus = os.sched_getaffinity(0) | os.sched_getaffinity(self.parent)
                self.answer = len(cpus) <= 1
            except (AttributeError, OSError):  # not Linux, or the parent is gone
                self.answer = False
        return self.answer
