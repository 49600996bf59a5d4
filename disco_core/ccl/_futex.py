"""Linux futexes on shared memory, through ``syscall(2)`` (ctypes releases the GIL).

Waiters sleep on a 32-bit "bell" word; whoever changes the state they wait for
writes a new value into the bell and wakes it. Every write of a bell is unique
(writer rank in the low bits, a counter above), so a waiter that read an old value
can never sleep through a change; sleeps are also bounded, so aborts and timeouts
are noticed promptly.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from typing import Any

__all__ = ["available", "wait", "wake", "address_of"]

_SYS_FUTEX = {
    "x86_64": 202,
    "amd64": 202,
    "aarch64": 98,
    "arm64": 98,
    "ppc64le": 221,
    "s390x": 238,
}.get(platform.machine().lower())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall: Any = None  # libc's syscall(2) where futexes work
_raw_syscall: Any = None
if sys.platform.startswith("linux") and _SYS_FUTEX is not None:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
    _syscall.argtypes = [
        ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    _raw_syscall = _libc["syscall"]  # a pointer of its own, without argtypes: see wake()
    _raw_syscall.restype = ctypes.c_long


def available() -> bool:
    """True where futexes can be used (Linux on a known architecture)."""
    return _syscall is not None


def address_of(buffer, offset: int) -> int:
    """The address of ``buffer[offset]`` (``buffer`` is a writable mmap)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer, offset))


def wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected``, at most ``timeout`` s."""
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0)


#: (addr, count) -> syscall(2) with its arguments converted once: a collective wakes
#: its bell every time, and ctypes' conversion through ``argtypes`` cost ~0.5 us of a
#: ~1.3 us wake
_wakers: dict[tuple[int, int], Any] = {}


def wake(addr: int, count: int = 0x7FFFFFFF) -> None:
    """Wake up to ``count`` waiters sleeping on the word at ``addr``."""
    waker = _wakers.get((addr, count))
    if waker is None:
        if len(_wakers) >= 4096:  # addresses of segments long gone
            _wakers.clear()
        assert _SYS_FUTEX is not None  # wake() is called only where available()
        # a function without argtypes takes ready ctypes objects as they are
        waker = _wakers[addr, count] = functools.partial(
            _raw_syscall, ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr),
            ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(count), None, None, ctypes.c_int(0),
        )  # fmt: skip
    waker()
