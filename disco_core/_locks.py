"""Locks that an interrupt cannot leave taken.

Python runs a signal handler (Ctrl-C's ``KeyboardInterrupt``, a handler's own
exception) between two bytecodes of the main thread, also between ``lock.acquire()``
returning and the ``try`` whose ``finally`` releases the lock. The lock then stays
taken for good, and the next thread that needs it waits for ever (an outside check
hung worker 0 that way, interrupting synchronising calls at random microseconds).

The locks guarded here are :class:`threading.RLock` objects, which know their owner:
a block that takes one catches what escapes it and calls :func:`release_if_left`.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _interrupts

__all__ = ["release_if_left", "owned"]


def owned(lock: Any) -> bool:
    """Whether the calling thread holds ``lock`` (a :class:`threading.RLock`)."""
    return bool(lock._is_owned())


@_interrupts.protect()
def release_if_left(lock: Any, owned_before: bool = False) -> None:
    """After an exception escaped a block that takes ``lock`` (an RLock) and releases it
    in a ``finally``: release it if the exception came before that ``try`` began.

    ``owned_before``: whether this thread held the lock already when the block began
    (it is re-entrant); then the block's taking it cannot be told apart, and nothing is
    released.
    """
    try:
        if not owned_before and lock._is_owned():
            lock.release()
    finally:  # a second Ctrl-C landing here waited (it left the lock taken)
        _interrupts.deliver()


# (a guard against a platform whose RLock lacks the method: fail at import, not later)
assert hasattr(threading.RLock(), "_is_owned")
