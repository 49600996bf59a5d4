"""The shm CCL's futexes (``disco_core.ccl._futex``) on a real shared mapping."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from disco_core.ccl import _futex

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not _futex.available(), reason="futexes are Linux-only"),
]


def test_a_wake_ends_a_sleep_at_once_and_a_changed_word_is_not_slept_on():
    """wake() calls syscall(2) with arguments converted once per address; a wrong
    conversion (a pointer cut to 32 bits) would fail silently and leave sleepers to
    their timeout."""
    m = mmap.mmap(-1, 4096)
    word = memoryview(m).cast("i")
    addr = _futex.address_of(m, 64)
    for i in range(5):
        word[16] = i
        took: dict[str, float] = {}

        def sleeper(expected: int = i, took: dict[str, float] = took) -> None:
            t0 = time.monotonic()
            _futex.wait(addr, expected, 5.0)
            took["s"] = time.monotonic() - t0

        t = threading.Thread(target=sleeper)
        t.start()
        time.sleep(0.05)  # asleep by now
        word[16] = i + 100
        _futex.wake(addr)
        t.join(10)
        assert took["s"] < 1.0, f"woken after {took['s']:.2f} s: the wake missed"
    t0 = time.monotonic()
    _futex.wait(addr, 12345, 5.0)  # the word holds another value: no sleep
    assert time.monotonic() - t0 < 1.0
