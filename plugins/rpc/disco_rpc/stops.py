"""Steps that a stop (SIGTERM, Ctrl-C) must not cut in half: the stop waits, then
arrives.

One way for every such step of the rpc services: a scratch folder made and its owner
told where it is, a session process forked. The stop signals' handlers are swapped
for ones that only note the signal, and the signal is raised again as the step ends.
Masking the signals instead is exact only in a process without other threads: one
that does not block them takes the signal, and the main thread runs its handler all
the same, possibly inside the step (Python's fork hooks printed the service's
``SystemExit`` as ignored and dropped it: an attacker check, 6 times in 10).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["StopsHeld", "stops_held"]

_STOPS = (signal.SIGTERM, signal.SIGINT)


class StopsHeld:
    """The handlers and signal mask in place before :func:`stops_held`, and the stops
    that came since."""

    def __init__(self, before: dict, mask: set | None, came: list[int]) -> None:
        self._before = before
        self._mask = mask
        self._came = came

    def forget(self) -> None:
        """In a process forked inside the block: the handlers back, the parent's held
        stops dropped (they were the parent's to take, and it takes them), then this
        process's own (sent since the fork, held by the mask) delivered."""
        self._restore_handlers()
        self._came.clear()
        self._unmask()

    def _restore_handlers(self) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)
        self._before = {}

    def _unmask(self) -> None:
        if self._mask is not None:
            mask, self._mask = self._mask, None
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (pending ones run here)

    def _end(self) -> None:
        self._unmask()  # stops pending for this thread reach the noting handlers...
        self._restore_handlers()
        for signum in dict.fromkeys(self._came):
            signal.raise_signal(signum)  # ...and go to their own ones, now the step is done


@contextlib.contextmanager
def stops_held() -> Iterator[StopsHeld]:
    """Inside: SIGTERM and SIGINT wait, and go to their handlers as the block ends (from
    the main thread, which runs Python's handlers). Outside the main thread nothing is
    held: no Python handler runs on that thread, so none can cut its step.

    The handlers are swapped for noting ones, and the stops are masked on this thread
    too: a process forked inside the block (one thread) keeps a stop sent to it
    pending until :meth:`StopsHeld.forget`, rather than noting it and dropping it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield StopsHeld({}, None, [])
        return
    came: list[int] = []
    before = {s: signal.signal(s, lambda signum, _frame: came.append(signum)) for s in _STOPS}
    held = StopsHeld(before, None, came)
    try:
        held._mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        yield held
    finally:
        held._end()
