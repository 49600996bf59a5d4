"""Ctrl-C held back for the few steps of the controller that must not be cut.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread,
also at the first instruction of a function. Some steps of the controller leave the
session broken when cut there: handing a batch of commands to the worker processes
(cut, some workers got it and others not: a later call failed or, worse, read an
older value), writing a frame to a pipe or a sealed socket (half a frame: the worker
hung, or the session's authentication broke), releasing a lock after an interrupt
(a second interrupt left it taken: a hang).

While a session lives, SIGINT's handler is :func:`_on_sigint` (when Python's own was
in place; a program's own handler is left alone). It looks at the frames the main
thread is in: inside a *protected* function (:func:`protect`), reached through
Disco's own code and the standard library's only, the interrupt is noted and the function raises it as it
returns (:func:`deliver`, in its ``finally``); anywhere else, ``KeyboardInterrupt`` is raised at once,
as Python's handler does. User code called from a protected function is not held
back (the walk stops at the first frame outside Disco and the standard library), nor
is a command a worker runs (:func:`barrier`). Protection costs nothing on
the way in: a protected function only checks :data:`state` as it returns.

A protected function that may block (a write to a worker's full pipe) is marked so:
there, a second Ctrl-C raises at once, and the function gives the link up (its
command stream is cut), so that a worker that never reads cannot make Ctrl-C wait
for ever. A second one within :data:`MERGE_WINDOW` of the first is the same press.

An interrupt that lands after a protected function's last look for one is raised
by a watcher thread's SIGINT once the main thread is outside every protected
function (:func:`_poke`), a millisecond or two later.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any, TypeVar

__all__ = [
    "sigint_blocked",
    "protect",
    "barrier",
    "deliver",
    "deliver_later",
    "redeliver_dropped_interrupts",
    "raised_by_signal_handler",
    "cut_by_program",
    "install",
    "uninstall",
    "installed",
    "state",
]

logger = logging.getLogger("disco_core")

F = TypeVar("F", bound=Callable[..., Any])


class _State:
    """What the handler noted. ``pending``: an interrupt held back, to raise when the
    outermost protected function returns; ``escalated``: a second one, raised inside a
    function that may block (the function cuts what it was writing); ``poked``: the
    next SIGINT is :func:`_poke`'s, not the user's."""

    __slots__ = ("pending", "escalated", "users", "poked", "poking", "held_at")

    def __init__(self) -> None:
        self.pending = False
        self.held_at = 0.0  # when the interrupt pending was held back (time.monotonic)
        self.escalated = False
        self.users = 0  # sessions alive that installed the handler
        self.poked = False
        self.poking = False  # a _poke thread watches the main thread


state = _State()
#: protected code objects -> whether the function may block (a second Ctrl-C raises there)
_PROTECTED: dict[CodeType, bool] = {}
#: code objects where the walk stops: a worker running a command (a function, a
#: collective waiting for its peers) is interruptible, whoever called it
_BARRIERS: set[CodeType] = set()
#: How many frames the handler looks at: protected steps are shallow.
_DEPTH = 12
_lock = threading.Lock()
_MAIN: int = threading.main_thread().ident or 0


def protect(blocking: bool = False) -> Callable[[F], F]:
    """Mark a function whose run must not be cut by Ctrl-C (see the module's text).

    The function must end with ``deliver()`` in a ``finally`` (or as it returns), so
    that an interrupt held back reaches the program once it is done.

    Parameters
    ----------
    blocking : bool
        The function may wait for long (a write to a pipe): a second Ctrl-C while one
        is held back raises at once, with :attr:`_State.escalated` set.
    """

    def mark(func: F) -> F:
        _PROTECTED[func.__code__] = blocking
        return func

    return mark


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Inside: SIGINT is blocked for the main thread at the system's level, and a Ctrl-C
    pressed meanwhile arrives (from Python's handler or Disco's) as the block ends.

    For steps that start processes and threads before any session, and so before
    :func:`protect` can hold anything back (a session's constructor): cut between a
    worker's start and its registration, the worker was never stopped. Threads and
    processes started inside inherit the block (a worker process ignores SIGINT
    anyway; the controller's own threads never handle it). Elsewhere than the main
    thread, or without ``pthread_sigmask``, it does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def barrier(func: F) -> F:
    """Mark a function that runs code which must stay interruptible (a worker running a
    command): a protected function that called it does not hold Ctrl-C back for it."""
    _BARRIERS.add(func.__code__)
    return func


def deliver() -> None:
    """Raise an interrupt held back, as Python would have: called last by a protected
    function (in its ``finally``). While an outer protected function still runs, that
    one raises it. Only the main thread's protected functions hold interrupts back,
    so only the main thread raises them."""
    if state.pending and threading.get_ident() == _MAIN:
        if _protected_frame(sys._getframe(2)) is not None:  # 1: the protected function
            return
        state.pending = False
        raise KeyboardInterrupt


def _code_of(handler: Any) -> CodeType | None:
    """The code object a signal handler runs first (None for the built-in ones)."""
    for _ in range(8):  # functools.partial of a bound method of ...
        code = getattr(handler, "__code__", None)
        if code is not None:
            return code
        inner = getattr(handler, "__func__", None) or getattr(handler, "func", None)
        if inner is None:
            if not callable(handler):  # SIG_DFL, SIG_IGN, None
                return None
            return getattr(type(handler).__call__, "__code__", None)  # an object's __call__
        handler = inner
    return None


def cut_by_program(exc: BaseException) -> bool:
    """Whether ``exc``, leaving one of Disco's own steps (which call no code of the
    program), came from the program: its traceback runs through a signal handler of
    the program or through any code that is neither Disco's nor the standard
    library's (a handler that removed itself before it raised, as one-shot timeouts
    do, or what it called). A built-in handler (``signal.default_int_handler``)
    leaves no frame: callers look at ``KeyboardInterrupt`` themselves.
    """
    tb = exc.__traceback__
    while tb is not None:
        if not _ours_or_stdlib(tb.tb_frame):
            return True
        tb = tb.tb_next
    return raised_by_signal_handler(exc)


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside one of the program's Python signal handlers
    (``SIGALRM`` raising ``TimeoutError``, say): its traceback runs through a handler
    now in place, or through a function run as a signal handler that is no longer in
    place (a one-shot timeout's handler puts the old one back before it raises; see
    :func:`_runs_as_handler`). Disco's own Ctrl-C handler does not count (it raises
    only where nothing is cut).
    """
    codes = set()
    for sig in signal.valid_signals():
        try:
            code = _code_of(signal.getsignal(sig))
        except (OSError, ValueError):
            continue
        if code is not None and code is not _on_sigint.__code__:
            codes.add(code)
    tb = exc.__traceback__
    caller: FrameType | None = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code in codes or (caller is not None and _runs_as_handler(frame, caller)):
            return True
        caller = frame
        tb = tb.tb_next
    return False


def _runs_as_handler(frame: FrameType, caller: FrameType) -> bool:
    """Whether ``frame`` is a signal handler's run: Python calls a handler with the
    signal's number and the frame it interrupted (``caller``, the traceback's entry
    before), two positional arguments side by side (after a bound method's ``self`` or
    a partial's own, before any defaulted ones, or in ``*args``); an ordinary call
    hardly ever passes its caller's own frame. A handler that deleted or rebound them is
    not told."""
    code = frame.f_code
    if code is _on_sigint.__code__:
        return False
    count = code.co_argcount
    try:
        values = frame.f_locals
        args = [values.get(name) for name in code.co_varnames[:count]]
        if code.co_flags & _CO_VARARGS:
            extra = values.get(code.co_varnames[count + code.co_kwonlyargcount])
            if type(extra) is tuple:
                args.extend(extra)
    except Exception:  # noqa: BLE001 - an odd frame: not a handler we can tell
        return False
    for k in range(1, len(args)):
        if args[k] is caller:
            signum = args[k - 1]
            if isinstance(signum, int) and signum in _SIGNALS:
                return True
    return False


_CO_VARARGS = 0x04  # inspect.CO_VARARGS (inspect itself is slow to import)
_SIGNALS = frozenset(int(sig) for sig in signal.valid_signals())


def deliver_later() -> None:
    """:func:`deliver` for a function whose exceptions Python drops (``__del__``): the
    interrupt is raised at the next bytecode the main thread runs outside protection."""
    if state.pending and threading.get_ident() == _MAIN:
        state.pending = False
        _thread.interrupt_main()


def redeliver_dropped_interrupts(seconds: float = 5.0) -> None:
    """For the next ``seconds``, a ``KeyboardInterrupt`` that Python drops in the main
    thread is raised again in the program's own code.

    Python drops what a ``weakref.finalize`` callback or a ``__del__`` raises (it goes
    to ``sys.unraisablehook``, which prints it as ignored), and the Ctrl-C with it: an
    outside check lost 5 of 5 pressed while a dropped session waited for its busy
    workers, and 2 of 60 that landed in another callback of the same clean-up (the
    ``WeakSet`` of ``threading._dangling``, as the session's threads died). A session
    closed by its finaliser calls this as it starts and as it ends. Meanwhile such an
    interrupt is not printed but signalled again (SIGINT, from a thread, a millisecond
    later: the hook runs inside the clean-up); landing in another callback, it comes
    back and goes again, until it is raised where the program runs. Only while SIGINT's
    handler is Python's or Disco's: a program's own handler, or an ignored SIGINT,
    gets what Python would do.
    """
    global _redeliver_until, _previous_unraisablehook
    if threading.get_ident() != _MAIN:
        return  # a signal's exception is raised in the main thread only
    _redeliver_until = max(_redeliver_until, time.monotonic() + seconds)
    if sys.unraisablehook is not _unraisablehook:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _unraisablehook


_redeliver_until = 0.0
_previous_unraisablehook: Callable[[Any], Any] = sys.__unraisablehook__
_in_hook = threading.local()


def _unraisablehook(unraisable: Any) -> None:
    if getattr(_in_hook, "on", False):
        # a program's hook that chains to the one it replaced, which was this one
        # (installed again after it): the loop ends here (outside check)
        sys.__unraisablehook__(unraisable)
        return
    _in_hook.on = True
    try:
        if (
            isinstance(unraisable.exc_value, KeyboardInterrupt)
            and threading.get_ident() == _MAIN
            and time.monotonic() < _redeliver_until
            and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint)
        ):
            # not here (this hook runs Python code in the same clean-up): a moment later
            _thread.start_new_thread(_signal_main_later, ())
            return
        _previous_unraisablehook(unraisable)
    finally:
        _in_hook.on = False


def _signal_main_later() -> None:
    time.sleep(POKE_INTERVAL)
    with contextlib.suppress(Exception):
        signal.pthread_kill(_MAIN, signal.SIGINT)


def _signal_main_now() -> None:
    """Hand an interrupt to the handler in place as a real Ctrl-C would: a SIGINT to the
    main thread, which also ends a blocking call there. ``_thread.interrupt_main`` only
    runs the handler at the next bytecode: a main thread in ``time.sleep(5)`` got it
    5 s late (a fresh-clone run, once). A handler that is not Python code (SIG_IGN,
    SIG_DFL) gets nothing, as from ``interrupt_main``."""
    if callable(signal.getsignal(signal.SIGINT)):
        with contextlib.suppress(Exception):
            signal.pthread_kill(_MAIN, signal.SIGINT)


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[k], "") for k in ("stdlib", "platstdlib") if k in paths})


_STDLIB = _stdlib_dirs()


def _ours_or_stdlib(frame: FrameType) -> bool:
    """Whether ``frame`` runs Disco's code or the standard library's (which a protected
    step calls: ``logging``, ``queue``, ``threading``): the walk goes on through it."""
    if frame.f_globals.get("__name__", "").startswith("disco_"):
        return True
    filename = frame.f_code.co_filename
    if filename.startswith("<frozen "):
        return True
    return filename.startswith(_STDLIB) and "site-packages" not in filename


def _protected_frame(frame: FrameType | None) -> bool | None:
    """Whether ``frame`` (the main thread's) is inside a protected function reached
    through Disco's code only: None if not, else whether that function may block."""
    found: bool | None = None
    for _ in range(_DEPTH):
        if frame is None:
            break
        code = frame.f_code
        if code in _BARRIERS:
            break
        blocking = _PROTECTED.get(code)
        if blocking is not None:
            found = blocking if found is None else (found or blocking)
        elif not _ours_or_stdlib(frame):
            break  # user code (or a library's) runs here: interruptible
        frame = frame.f_back
    return found


#: Seconds after the first Ctrl-C held back in a step that may block within which a
#: second one is merged with it, not taken for "give the worker up" (outside check: two
#: SIGINTs 60-300 us apart ended a process session around writes of a few KiB).
MERGE_WINDOW = 0.25
#: Seconds between two looks of :func:`_poke` at the main thread.
POKE_INTERVAL = 0.001
#: Seconds a write to a worker may hold a Ctrl-C back before the watcher warns that it
#: does, and that a second Ctrl-C gives the worker up: :data:`MERGE_WINDOW`, so that any
#: press after the warning does (an earlier one is merged with the first).
WARN_AFTER = MERGE_WINDOW


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if state.poked:  # _poke's: the held interrupt, if the main thread left protection
        state.poked = False
        if state.pending and _protected_frame(frame) is None:
            state.pending = False
            raise KeyboardInterrupt
        return
    blocking = _protected_frame(frame)
    if blocking and state.pending and time.monotonic() - state.held_at < MERGE_WINDOW:
        return  # the same press (a burst, a key bounce): not yet a second Ctrl-C
    if blocking is None or (blocking and state.pending):
        state.pending = False
        state.escalated = blocking is not None
        raise KeyboardInterrupt
    first = not state.pending
    if first:
        state.held_at = time.monotonic()
    # A write that holds it back is told by the watcher thread (_poke), once the write
    # has waited WARN_AFTER: most writes end within microseconds (an outside check saw
    # a warning said here for 10 % of a Ctrl-C storm's presses), and logging here could
    # be cut by a second Ctrl-C
    state.pending = True
    if not state.poking:
        state.poking = True
        _thread.start_new_thread(_poke, ())  # one C call: no Python frame in the way


def _poke() -> None:
    """While an interrupt is held back, look at the main thread every millisecond; once
    it is outside every protected function, signal SIGINT to it again (the handler
    then raises it). A protected function delivers its interrupt as it returns, but
    one that came after its last look at :data:`state` (outside check: 4 in ~10,000)
    waited for the next Disco call; a real signal also ends a blocking call there."""
    try:
        while True:
            writing_since = 0.0  # when the main thread was first seen in a write (0: not)
            warned = False
            while state.pending:
                time.sleep(POKE_INTERVAL)
                if not state.pending:
                    break  # raised meanwhile (the main thread may be ending its session)
                frame = sys._current_frames().get(_MAIN)
                if frame is None:
                    state.pending = state.poking = False
                    return  # the main thread ended
                if signal.getsignal(signal.SIGINT) is not _on_sigint:
                    # Python's own handler is back, or the program's took over: the
                    # interrupt goes to it now, not later as a stale one (re-check),
                    # unless a poke already went (that one reaches it)
                    sent = state.poked
                    state.pending = state.poked = state.poking = False
                    if not sent:
                        _signal_main_now()
                    return
                if not state.poked and not _inside_protected(frame):
                    state.poked = True
                    signal.pthread_kill(_MAIN, signal.SIGINT)
                elif not warned:
                    # The held interrupt waits for a write (a step that may block): say
                    # so once it has waited WARN_AFTER, whenever that write began
                    if _protected_frame(frame):
                        now = time.monotonic()
                        writing_since = writing_since or now
                        if now - writing_since >= WARN_AFTER and state.pending:
                            warned = True
                            logger.warning(
                                "interrupted while commands are written to a worker: "
                                "finishing that first; interrupt again to give the worker up"
                            )
                    else:
                        writing_since = 0.0
                del frame
            state.poking = False
            if not state.pending:
                return
            state.poking = True  # one more was held back as this thread was ending
    except Exception:  # noqa: BLE001 - the interpreter is ending: nothing to deliver to
        state.poking = False


def _inside_protected(frame: FrameType | None) -> bool:
    """Whether any frame of the main thread's stack (``frame`` and its callers) runs a
    protected function, whatever runs inside it (a worker's command, user code): the
    protected function will deliver the interrupt itself."""
    while frame is not None:
        if frame.f_code in _PROTECTED:
            return True
        frame = frame.f_back
    return False


def install() -> bool:
    """Hold Ctrl-C back in protected functions while a session lives: called as one is
    made; True when it did (then :func:`uninstall` as the session ends). Only from the
    main thread and only over Python's own handler: a program's own handler stays."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        try:
            current = signal.getsignal(signal.SIGINT)
            if current is not _on_sigint:
                if current is not signal.default_int_handler:
                    return False
                signal.signal(signal.SIGINT, _on_sigint)
                state.poked = False  # a poke another handler took is no business of ours
        except (ValueError, OSError):  # no signals here (an embedded interpreter)
            return False
        state.users += 1
        return True


def uninstall() -> None:
    """A session that :func:`install` counted ended: with the last one, Python's own
    handler again (unless the program replaced ours, or this is not the main thread:
    ours then stays, and behaves as Python's outside Disco)."""
    with _lock:
        state.users = max(0, state.users - 1)
        if state.users or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGINT) is _on_sigint:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        except (ValueError, OSError):
            pass


def reclaim() -> None:
    """Take SIGINT again where Python's own handler came back while sessions live
    (Jupyter's kernel puts it back before each cell runs); called by synchronising
    calls. Ours behaves as Python's outside Disco's protected steps."""
    if state.users and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, _on_sigint)
        except ValueError:  # not the main thread: the main thread's next call does it
            pass


def installed() -> bool:
    """Whether Ctrl-C is held back in protected functions now."""
    try:
        return signal.getsignal(signal.SIGINT) is _on_sigint
    except (ValueError, OSError):
        return False
