"""Worker functions of the chaos suite (``chaos.*``): a bounded hang for ThreadedSession workers.

A hung thread cannot be killed, so every hang waits on an :class:`threading.Event`
with a timeout; the suite sets the event when the iteration ends, so no thread
outlives its test.
"""

from __future__ import annotations

import threading

import disco_core as disco

#: key -> the event that ends the hang of that key
_EVENTS: dict[str, threading.Event] = {}
_LOCK = threading.Lock()


def event(key: str) -> threading.Event:
    with _LOCK:
        ev = _EVENTS.get(key)
        if ev is None:
            ev = _EVENTS[key] = threading.Event()
        return ev


def release(key: str) -> None:
    with _LOCK:
        ev = _EVENTS.pop(key, None)
    if ev is not None:
        ev.set()


@disco.register_func("chaos.hang", override=True)
def hang(worker_id: int, key: str, timeout: float) -> None:
    """On worker ``worker_id`` only: wait until ``release(key)`` or ``timeout`` seconds."""
    if disco.worker.current().worker_id == worker_id:
        event(key).wait(timeout)
