"""A worker's shared-memory arena: arrays its peers can read and write in place.

With the ``shm`` CCL initialised, ``disco.empty`` on a worker hands out large arrays
from the worker's arena, a ``memfd`` that every peer maps. A collective whose
arrays all live in arenas then moves data straight between the workers' arrays,
with no staging copies (see :meth:`ShmCCL.allreduce`).

Allocation is first-fit over a free list, page-aligned; an array's block returns to
the list when the array (and every view of it) is gone, and the pages of large
blocks go back to the system.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["Arena", "open_peer"]

_PAGE = mmap.PAGESIZE
_RETURN_PAGES = 1 << 20  # blocks at least this large give their pages back when freed


def _default_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - not Linux
        return 1 << 34


class Arena:
    """This worker's arena (sparse: pages exist only once written)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = (size or _default_size()) // _PAGE * _PAGE
        self.fd = os.memfd_create("disco-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.bytes = np.frombuffer(self.map, np.uint8)
        self.base = self.bytes.ctypes.data
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """An uninitialised array in the arena, or None when it is full."""
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        need = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, size - need)
                    break
            else:
                return None
        arr = self.bytes[off : off + nbytes].view(dtype).reshape(shape)
        weakref.finalize(arr, self._release, off, need)
        return arr

    def _release(self, off: int, size: int) -> None:
        if size >= _RETURN_PAGES:
            try:
                self.map.madvise(mmap.MADV_REMOVE, off, size)
            except (OSError, ValueError, AttributeError):
                pass
        with self._lock:
            i = bisect.bisect(self._free, (off, size))
            self._free.insert(i, (off, size))
            # Coalesce with the neighbours.
            if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
                size += self._free.pop(i + 1)[1]
                self._free[i] = (off, size)
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                prev_off, prev_size = self._free.pop(i - 1)
                self._free[i - 1] = (prev_off, prev_size + size)

    def offset_of(self, arr: Any) -> int:
        """Where a C-contiguous array lives in this arena, or -1."""
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
            return -1
        off = arr.ctypes.data - self.base
        if 0 <= off and off + arr.nbytes <= self.size:
            return off
        return -1

    def close(self) -> None:
        self.bytes = None  # type: ignore[assignment]  # closed: nothing reads it any more
        try:
            self.map.close()
        except BufferError:  # arrays are still alive; the process exit frees them
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def open_peer(pid: int, fd: int, size: int) -> np.ndarray:
    """Map a peer's arena (``/proc/<pid>/fd/<fd>``) as a flat uint8 array."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        m = mmap.mmap(f, size)
    finally:
        os.close(f)
    return np.frombuffer(m, np.uint8)
