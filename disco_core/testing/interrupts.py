"""Ctrl-C placed inside a chosen function, for tests of what an interrupt leaves behind.

:func:`interrupt_on_entry` makes SIGINT "arrive" (``_thread.interrupt_main``, which
runs the installed handler as a real signal does) as the main thread enters a given
function; Python handles it at that function's next check for signals, so the
interrupt lands inside it, as a real one landing there would.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

__all__ = ["interrupt_on_entry", "interrupt_after_c_call"]


@contextlib.contextmanager
def interrupt_on_entry(
    code: CodeType,
    when: Callable[[FrameType], bool] = lambda frame: True,
    times: int = 1,
    signum: int | None = None,
) -> Iterator[list[int]]:
    """While the block runs, signal SIGINT as the main thread enters ``code`` (and
    ``when(frame)`` holds), ``times`` times at most; yields a list that counts them.

    With ``signum``, a real signal of that number is sent to the main thread instead
    (``signal.pthread_kill``): its handler runs inside ``code``, and ends a blocking
    wait there, as a signal from outside would.
    """
    fired: list[int] = []
    main = threading.main_thread()

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code and len(fired) < times and when(frame):
            fired.append(1)
            if signum is None:
                _thread.interrupt_main()
            else:
                signal.pthread_kill(threading.get_ident(), signum)
        return None

    if threading.current_thread() is not main:
        raise RuntimeError("interrupt_on_entry runs on the main thread")
    sys.settrace(tracer)
    try:
        yield fired
    finally:
        sys.settrace(None)


@contextlib.contextmanager
def interrupt_after_c_call(when: Callable[[Any], bool], times: int = 1) -> Iterator[list[int]]:
    """While the block runs, signal SIGINT as a built-in function ``f`` for which
    ``when(f)`` holds returns to the main thread (``times`` times at most): Python
    handles it there, after the call did its work and before its caller's next step."""
    fired: list[int] = []

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_return" and len(fired) < times and when(arg):
            fired.append(1)
            _thread.interrupt_main()

    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("interrupt_after_c_call runs on the main thread")
    sys.setprofile(profiler)
    try:
        yield fired
    finally:
        sys.setprofile(None)
