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

__all__ = ["release_if_left", "release_to", "owned", "counts"]


def owned(lock: Any) -> int:
    """How many times the calling thread holds ``lock`` (a :class:`threading.RLock`): 0
    when it does not. Where the RLock cannot tell its count (Python 3.10), 1 for any."""
    if _COUNTS:
        return lock._recursion_count()
    return int(lock._is_owned())


@_interrupts.protect()
def release_if_left(lock: Any, owned_before: int = 0) -> None:
    """After an exception escaped a block that takes ``lock`` (an RLock) and releases it
    in a ``finally``: release it if the exception came before that ``try`` began.

    ``owned_before``: :func:`owned` as the block began. The lock was left taken when
    this thread now holds it more times than that: re-entered, a leak kept one count,
    and the outer block's release left the lock taken for good (an outside check hung
    a session that way: an interrupt right after the hand-over of commands re-took a
    link's lock). Where the count cannot be told (Python 3.10), a lock held before is
    never released here.
    """
    try:
        if owned(lock) > owned_before:
            lock.release()
    finally:  # a second Ctrl-C landing here waited (it left the lock taken)
        _interrupts.deliver()


def counts(locks: list[Any]) -> list[int]:
    """:func:`owned` of each of ``locks``, at once."""
    if _COUNTS:
        return [lock._recursion_count() for lock in locks]
    return [int(lock._is_owned()) for lock in locks]


@_interrupts.protect()
def release_to(held: list[tuple[Any, int]]) -> None:
    """Release each ``(lock, count)`` of ``held`` (RLocks, in that order) until this
    thread holds it ``count`` times (:func:`owned` before it took them): for a step that
    takes several locks, whatever an exception cut (between an acquire and any note of
    it, or between two releases: a lock left taken hung the session)."""
    try:
        for lock, count in held:
            while owned(lock) > count:
                lock.release()
    finally:
        try:  # cut by a signal handler's exception: finish the releases
            for lock, count in held:
                while owned(lock) > count:
                    lock.release()
        finally:
            _interrupts.deliver()


_COUNTS = hasattr(threading.RLock(), "_recursion_count")

# (a guard against a platform whose RLock lacks the method: fail at import, not later)
assert hasattr(threading.RLock(), "_is_owned")
