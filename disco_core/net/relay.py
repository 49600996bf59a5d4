"""A two-way relay between two transports (a proxy's pairing, a chained session).

Both ends are transports (:mod:`disco_core.net.io`): a relay between two
:class:`~disco_core.net.protect.SealedTransport` checks every record it reads
and seals what it writes under the other link's keys, so a chained session
stays protected on both links; a relay between plain transports (a proxy,
which holds no keys) copies bytes as they are.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

__all__ = ["relay"]

_BUF = 1 << 20


def _pending(t: Any) -> bool:
    """Bytes already read from the socket that ``select`` cannot see.

    A TLS layer's decrypted bytes, or a sealed transport's verified bytes of a
    record the relay has not taken yet.
    """
    if getattr(t, "pending", 0):
        return True
    sock = getattr(t, "sock", None)
    pending = getattr(sock, "pending", None)
    return bool(pending is not None and pending())


def relay(
    a: Any,
    b: Any,
    a_buffered: bytes = b"",
    b_buffered: bytes = b"",
    *,
    idle_timeout: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[int, int]:
    """Copy bytes both ways between transports ``a`` and ``b`` until either side closes.

    Parameters
    ----------
    a, b : transport
        Each has ``fileno()``, ``recv_into(view)`` and ``send_parts(parts)``.
    a_buffered, b_buffered : bytes
        Bytes already read from ``a`` (or ``b``) that are owed to the other side
        (read ahead during a handshake); they are sent first.
    idle_timeout : float, optional
        End the relay when neither side sent anything for this many seconds.
    stop : callable, optional
        Polled about once a second; the relay ends when it returns true.

    Returns
    -------
    tuple of int
        Bytes read from ``a`` (for ``b``) and from ``b`` (for ``a``). Errors on either
        side (a reset, a failed integrity check) end the relay like a close; the
        caller closes both transports.
    """
    moved = {id(a): 0, id(b): 0}
    # bytes of a large sealed record read but not verified yet: they go on only once
    # its tag checked, so nothing forged on one link is sealed anew for the other
    held = {id(a): bytearray(), id(b): bytearray()}
    if a_buffered:
        b.send_parts([a_buffered])
        moved[id(a)] += len(a_buffered)
    if b_buffered:
        a.send_parts([b_buffered])
        moved[id(b)] += len(b_buffered)
    ends = {a.fileno(): (a, b), b.fileno(): (b, a)}
    view = memoryview(bytearray(_BUF))
    wait = 1.0 if stop is not None else idle_timeout
    idle = 0.0
    try:
        while True:
            ready = [fd for fd, (src, _dst) in ends.items() if _pending(src)]
            if not ready:
                ready, _, _ = select.select(list(ends), [], [], wait)
            if not ready:
                idle += wait or 0.0
                if stop is not None and stop():
                    break
                if idle_timeout is not None and idle >= idle_timeout:
                    break
                continue
            idle = 0.0
            for fd in ready:
                src, dst = ends[fd]
                n = src.recv_into(view)
                if not n:
                    return moved[id(a)], moved[id(b)]
                moved[id(src)] += n
                acc = held[id(src)]
                if getattr(src, "record_left", 0):
                    acc += view[:n]
                    continue
                if acc:
                    acc += view[:n]
                    dst.send_parts([acc])
                    held[id(src)] = bytearray()
                else:
                    dst.send_parts([view[:n]])
    except (OSError, EOFError, ValueError):
        pass  # a reset, a closed socket, a record that failed its check: the relay is over
    return moved[id(a)], moved[id(b)]
