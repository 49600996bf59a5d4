"""Give freed heap memory back to the operating system after a session ends.

Each session runs worker 0 (all workers in a ThreadedSession) and a few helpers
on threads of the controller's process, and glibc gives threads malloc arenas of
their own; NumPy arrays of a few MiB come from those arenas once glibc's dynamic
mmap threshold has risen past their size. When a session ends, the freed memory
stays in the arenas: a controller that opens sessions one after another grows by
tens of MiB (measured here: 68 -> 77 MiB over 40 ProcessSessions of 4 workers with
8 MiB arrays, 61 -> 84 MiB with ThreadedSessions) and then stays flat. It is not
a leak, but a long-lived controller should not keep it: :func:`release_free_memory`
calls glibc's ``malloc_trim(0)``, which returns free pages of every arena (and the
top of the main heap) to the system. It lowered the ProcessSession loop above to
59 -> 67 MiB. It does nothing where the C library has no ``malloc_trim`` (musl,
macOS, Windows).
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["release_free_memory"]

_TRIM = None
if sys.platform.startswith("linux"):
    try:
        _TRIM = ctypes.CDLL(None).malloc_trim
        _TRIM.argtypes = [ctypes.c_size_t]
        _TRIM.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc
        _TRIM = None


def release_free_memory() -> bool:
    """Return the C heap's free memory to the system (glibc); True when it did."""
    if _TRIM is None:
        return False
    try:
        return bool(_TRIM(0))
    except Exception:  # noqa: BLE001 - never let a clean-up break a shutdown
        return False
