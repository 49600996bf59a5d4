"""The controller side: :class:`Session`, :class:`DRef`, :class:`DPackedFunc`, :class:`DModule`.

A session broadcasts commands to its workers through a
:class:`~disco_core.channels.base.Channel` and never knows which channel it drives.
Register ids are allocated here: 0 means "discard the result", freed ids are
reused, and dropping the last :class:`DRef` to a register frees it on every worker
(the kill command rides along with the next command, so freeing costs no message
of its own).
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _interrupts, _memory, plugins
from . import protocol as P
from ._interrupts import state as _pending
from ._locks import owned, release_if_left
from .ccl.base import REDUCE_OPS
from .channels.base import ANSWERED, Channel, Outgoing, gather_timeout
from .device import Device, as_array, as_device, as_dtype, as_shape, is_array
from .errors import (
    CCLError,
    DiscoError,
    DiscoFileNotFoundError,
    DiscoModuleNotFoundError,
    DiscoTimeoutError,
    DiscoTypeError,
    DiscoValueError,
    SessionClosedError,
    WorkerDiedError,
    WorkerError,
    WorkerUnresponsiveError,
    is_follow_on,
)
from .host_array import with_numpy_method
from .protocol import register_ref_type
from .settings import shutdown_timeout
from .store import ControllerStore
from .tracing import session_trace
from .tracing.recorder import now as _now  # the trace's clock

logger = logging.getLogger("disco_core.session")

__all__ = [
    "Session",
    "DRef",
    "DPackedFunc",
    "DModule",
    "ThreadedSession",
    "ProcessSession",
    "SocketSession",
]


class DRef:
    """A register on every worker of a session.

    The register is freed on every worker when the last handle to it is dropped:
    the :class:`DRef` itself and any :class:`DPackedFunc` or :class:`DModule`
    wrapped around it (TVM's ``DPackedFunc(dref, session)``) share it.
    """

    __slots__ = ("session", "reg_id", "_owner", "__weakref__")

    def __init__(self, session: Session, reg_id: int) -> None:
        self.session = session
        self.reg_id = reg_id
        self._owner: DRef | None = None  # None: this handle frees the register

    @_interrupts.protect()
    def __del__(self) -> None:
        # A wrapper keeps its owner alive instead: the owner frees the register, once.
        # Ctrl-C waits for the end (Python drops a __del__'s exceptions: the interrupt
        # was lost, and the register with it).
        try:
            if self._owner is None and self.reg_id:
                session = self.session
                if not session._state["closed"]:
                    session._released.append(self.reg_id)
        except (AttributeError, SessionClosedError):  # never fully constructed; session gone
            pass
        finally:
            if _pending.pending:
                _interrupts.deliver_later()

    def debug_get_from_remote(self, worker_id: int = 0) -> Any:
        """Fetch the register's value from one worker (arrays come back as NumPy).

        This is a synchronising call: errors of earlier commands surface here.
        """
        return self.session._debug_get(self, worker_id)

    def debug_copy_from(self, worker_id: int, value: Any) -> None:
        """Copy ``value`` into the array this register holds on one worker (synchronising).

        As in TVM, the data is copied into the existing array, so every alias of it
        on that worker sees the new data; the shape may differ when the number of
        elements is the same (C order, as TVM copies whenever the sizes match), and a
        different size or dtype is an error (:class:`~disco_core.WorkerError` of type ``ValueError``,
        raised here). A register that holds no array (``None``, as on the workers a
        ``worker0_only`` array skips, or any other value) takes ``value`` instead, as
        TVM's ``DiscoWorker::SetRegister`` does; a register that was never set or
        was freed is an error.

        Parameters
        ----------
        worker_id : int
            The worker whose register receives the data.
        value : numpy.ndarray or object
            A host array (anything with ``__dlpack__`` is copied to one first).
        """
        self.session._debug_set(self, worker_id, value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} register {self.reg_id}>"

    def __reduce__(self):
        raise DiscoTypeError(
            "a DRef only has a meaning inside its session; pass it to call_packed instead"
        )


register_ref_type(DRef)


def _flag(where: str, name: str, value: Any) -> bool:
    """``value`` as a flag: True, False (NumPy's too, or the ints 1 and 0); else a
    :class:`DiscoTypeError` that names the call and the parameter (``bool("no")``
    would be True)."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise DiscoTypeError(f"{where}: {name} must be True or False, got {value!r}")


#: Immutable argument types: a call with only these (and handles) is ``shared``.
_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None)})


def _wrap(obj: DRef, dref: Any, session: Any) -> None:
    """``obj`` becomes another handle to ``dref``'s register (TVM's ``Wrapper(dref, session)``)."""
    name = type(obj).__name__
    if not isinstance(dref, DRef):
        order = isinstance(dref, Session)
        hint = " (the arguments are (dref, session), TVM's order)" if order else ""
        raise DiscoTypeError(
            f"{name}(dref, session): dref must be a DRef, got {type(dref).__name__}{hint}"
        )
    if not isinstance(session, Session):
        raise DiscoTypeError(
            f"{name}(dref, session): session must be a disco_core.Session, got {type(session).__name__}"
        )
    if dref.session is not session:
        raise DiscoValueError(f"{name}(dref, session): {dref!r} belongs to another session")
    if not dref.reg_id:
        raise DiscoValueError(f"{name}(dref, session): {dref!r} names no register")
    obj.session = session
    obj.reg_id = dref.reg_id
    # The one handle that frees the register; this one keeps it alive meanwhile.
    obj._owner = dref if dref._owner is None else dref._owner


def _handle(cls: type, session: Session, reg_id: int) -> Any:
    """A new handle of class ``cls`` that owns register ``reg_id`` (internal construction)."""
    obj = cls.__new__(cls)  # type: ignore[call-overload]
    obj.session = session
    obj.reg_id = reg_id
    obj._owner = None
    return obj


class DPackedFunc(DRef):
    """A function in a register on every worker; calling it is ``session.call_packed(self, *args)``.

    Parameters
    ----------
    dref : DRef
        The register holding the function (TVM's order: ``DPackedFunc(dref, session)``).
        Both handles share the register: it is freed when the last one is dropped.
    session : Session
        The session ``dref`` belongs to.
    """

    __slots__ = ()

    def __init__(self, dref: DRef, session: Session) -> None:
        _wrap(self, dref, session)

    def __call__(self, *args: Any) -> DRef:
        return self.session._call(self, args)


class DModule(DRef):
    """A module loaded on every worker; ``module["name"]`` is a :class:`DPackedFunc`.

    Parameters
    ----------
    dref : DRef
        The register holding the module (TVM's order: ``DModule(dref, session)``).
        Both handles share the register: it is freed when the last one is dropped.
    session : Session
        The session ``dref`` belongs to.
    """

    __slots__ = ()

    def __init__(self, dref: DRef, session: Session) -> None:
        _wrap(self, dref, session)

    def __getitem__(self, name: str) -> DPackedFunc:
        if not isinstance(name, str):
            raise DiscoTypeError(f"module function names are str, got {type(name).__name__}")
        session = self.session
        getter = session._get_cached_method("disco.module_get_function")
        return session._call(getter, (self, name), DPackedFunc)


class _SessionFunc(DPackedFunc):
    """A built-in function a session keeps for its own calls (``_get_cached_method``).

    It names its session weakly: the session keeps it, so a strong reference was a
    cycle, and a dropped session that had called ``init_ccl`` kept its worker
    processes, threads and pipes until the garbage collector ran (an outside check:
    12 dropped sessions held 12 worker processes).
    """

    __slots__ = ("_session_ref",)
    _session_ref: weakref.ref[Session]

    @property
    def session(self) -> Session:  # type: ignore[override]  # (DRef.session is a slot)
        session = self._session_ref()
        if session is None:  # (an AttributeError on None, an outside check)
            raise SessionClosedError("the session this function handle belongs to is gone")
        return session

    @classmethod
    def take(cls, func: DRef) -> _SessionFunc:
        """A handle that takes over ``func``'s register (``func`` frees nothing then)."""
        obj = cls.__new__(cls)
        obj._session_ref = weakref.ref(func.session)
        obj.reg_id, func.reg_id = func.reg_id, 0
        obj._owner = None
        return obj


register_ref_type(DPackedFunc)
register_ref_type(DModule)
register_ref_type(_SessionFunc)


#: The most workers a session may have: its controller keeps per-worker state, so a
#: session of 10**9 workers took memory until the process was killed (an outside check).
MAX_WORKERS = 1 << 16


def check_session_shape(num_workers: Any, num_groups: Any) -> None:
    """Validate ``num_workers`` and ``num_groups`` with a clear error."""
    for name, value in (("num_workers", num_workers), ("num_groups", num_groups)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise DiscoTypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise DiscoValueError(f"{name} must be >= 1, got {value}")
        if value > MAX_WORKERS:
            raise DiscoValueError(f"{name} must be at most {MAX_WORKERS}, got {value}")
    if num_workers % num_groups:
        raise DiscoValueError(
            f"num_workers ({num_workers}) must be a multiple of num_groups ({num_groups}): "
            "every group has the same number of workers"
        )


def _close_channel(channel: Channel, state: dict) -> None:
    """Stop a session's workers (also run by the finaliser at interpreter exit)."""
    if state.get("closed"):
        return
    # Dropped (not shut down), the session is closed by its finaliser, whose exceptions
    # Python drops: a Ctrl-C meanwhile, or in the rest of the clean-up, is raised again
    # (not at the interpreter's exit: there Python says it was ignored, as ever)
    dropped = not state.get("shutdown_called") and not _at_exit()
    if dropped:
        _interrupts.redeliver_dropped_interrupts()
    rendezvous = state.get("rendezvous")
    try:
        _begin_close(channel, state)
    finally:
        if state.pop("sigint", False):
            _interrupts.uninstall()
    try:
        channel.close(timeout=shutdown_timeout())
    finally:
        if rendezvous is not None:
            rendezvous.close()
        _memory.release_free_memory()  # the session's threads' malloc arenas
        logger.debug("session shut down: %s channel", channel.kind)
        if dropped:  # (the wait may have taken most of the first window)
            _interrupts.redeliver_dropped_interrupts()


def _native_order(value: Any) -> Any:
    """``value``, a host array in this machine's byte order (a worker's array is:
    collectives move bytes, so ``>f4`` data reduced as ``float32`` was garbage)."""
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return value.astype(value.dtype.newbyteorder("="))
    return value


def _at_exit() -> bool:
    """Whether the interpreter's exit runs this (``weakref.finalize``'s exit function)."""
    exitfunc = weakref.finalize._exitfunc.__code__  # type: ignore[attr-defined]
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is exitfunc:
            return True
        frame = frame.f_back
    return False


@_interrupts.protect(blocking=True)
def _begin_close(channel: Channel, state: dict) -> None:
    """Mark the session closed and tell the workers to stop, as one step: Ctrl-C waits
    for its end (cut after the mark, no worker was told, and a busy worker process
    outlived the session)."""
    try:
        state["closed"] = True
        logger.info("session shutting down: %s channel", channel.kind)
        try:
            channel.send(Outgoing((P.SHUTDOWN,)))
        except Exception:  # dead workers: close() still reaps them
            pass
        store = state.get("store")
        if store is not None:
            # Before the channel closes: a worker waiting in the store gets its answer
            # (an error) and then reads the shutdown command it set aside.
            store.close("the session is shutting down")
        rendezvous = state.get("rendezvous")
        if rendezvous is not None:
            # A worker still waiting in a collective would never read the shutdown
            # command; the session is going away, so make such waits fail now.
            rendezvous.abort("the session is shutting down")
    finally:
        _interrupts.deliver()


def _store_reply(channel: Channel, worker_id: int, cmd: tuple) -> None:
    """Send a rendezvous store answer to the one worker that asked."""
    channel.send(Outgoing(cmd, shared=True), [worker_id])


def _by_worker(errors: list[WorkerError]) -> list[WorkerError]:
    return sorted(errors, key=lambda e: e.worker_id)


def _check_options(factory: Callable, channel: str, options: dict[str, Any]) -> None:
    """Refuse options the channel's factory does not take, naming them (the factory's
    own ``TypeError`` came from deep inside, without the channel's name)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a factory Python cannot inspect: it checks itself
        return
    try:
        signature.bind(**options)
    except TypeError as exc:
        raise DiscoTypeError(f"Session.create({channel!r}, ...): {exc}") from None


def _one_thread_at_a_time(method: Callable) -> Callable:
    """A synchronising method, run by one thread of the controller at a time.

    A worker answers its sync commands in the order they came, and a waiter takes the
    next answer: two threads waiting for the same worker at once would take each
    other's (measured: 926 wrong values in 2 x 2,000 concurrent ``debug_get_from_remote``).
    """

    @functools.wraps(method)
    def one_at_a_time(self: Session, *args: Any, **kwargs: Any) -> Any:
        if _pending.users:  # a session holds Ctrl-C back where it must (disco_core._interrupts)
            _interrupts.reclaim()
        lock = self._sync_lock
        owned_before = owned(lock)  # re-entered (a trace's stop holds it)
        try:
            if not lock.acquire(False):  # another thread's call: wait for it
                self._wait_for_sync_lock()
            try:
                return method(self, *args, **kwargs)
            finally:
                lock.release()
        except BaseException:
            self._abandon_answers()
            release_if_left(lock, owned_before)  # Ctrl-C right after the acquire
            raise

    return one_at_a_time


def _merged(errors: list[WorkerError]) -> WorkerError:
    """One error for several: the first worker's (of its own type), the others attached."""
    # The headline is the first cause, not a register that a cause left empty.
    first = next((e for e in errors if not is_follow_on(e)), errors[0])
    rest = [e for e in errors if e is not first]
    return WorkerError(
        first.worker_id, first.exc_type, first.remote_message, first.remote_traceback, rest
    )


class Session:
    """A controller and its workers. Use one of :class:`ThreadedSession`,
    :class:`ProcessSession`, :class:`SocketSession`, or :meth:`Session.create`.

    Sessions are context managers that shut down on exit.

    Threads of the controller may share a session. Commands are sent under a lock,
    in one order for every worker; a synchronising call (``sync_worker_0``, a
    copy, ``debug_get_from_remote``) waits for the worker's answer to its own
    command, one call at a time, while other threads may go on sending.
    """

    #: While a trace runs, its recorder of sends (``disco_core.tracing.session_trace``):
    #: ``_call`` calls it with the function's register and the send's time, under the
    #: send lock, so a send's place among the records is its place in the command
    #: stream. None (the class's): untraced, one attribute read a call.
    _record_send: Callable[[int, int], None] | None = None

    def __init__(self, channel: Channel) -> None:
        if not isinstance(channel, Channel):
            raise DiscoTypeError(
                f"Session needs a disco_core Channel, got {type(channel).__name__}"
            )
        try:
            check_session_shape(channel.num_workers, channel.num_groups)
        except (TypeError, ValueError):
            channel.close(timeout=1.0)
            raise
        self._channel = channel
        self.num_workers: int = channel.num_workers
        self.num_groups: int = channel.num_groups
        self._next_reg = 1
        self._free_regs: list[int] = []
        self._released: collections.deque[int] = collections.deque()
        self._lock = threading.RLock()
        #: held through a synchronising call: its command and the reply it waits for
        #: (see ``_one_thread_at_a_time``); apart from ``_lock``, so that asynchronous
        #: calls from other threads go on meanwhile
        self._sync_lock = threading.RLock()
        self._cache: dict[str, DPackedFunc] = {}
        self._state: dict[str, Any] = {"closed": False, "rendezvous": None, "ccl": None}
        self._finalizer = weakref.finalize(self, _close_channel, channel, self._state)
        # One rendezvous store per session (``current().store`` on every worker).
        store = ControllerStore(reply=functools.partial(_store_reply, channel))
        self._state["store"] = store
        channel.attach_store(store)
        channel.on_worker_death(
            lambda ids_, reason: store.abort(f"worker(s) {ids_} died: {reason}")
        )
        logger.info(
            "session started: %s channel, %d worker(s) in %d group(s)",
            channel.kind, self.num_workers, self.num_groups,
        )  # fmt: skip
        # Ctrl-C waits for the end of the steps it must not cut (disco_core._interrupts)
        self._state["sigint"] = _interrupts.install()
        if os.environ.get("DISCO_TRACE") and not session_trace.explicit.get():
            try:
                session_trace.start_from_env(self)
            except BaseException:
                self.shutdown()
                raise

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls, channel: str, *, trace: str | os.PathLike | None = None, **options: Any
    ) -> Session:
        """Create a session on any registered channel.

        Parameters
        ----------
        channel : str
            A channel name (``"threaded"``, ``"process"``, ``"socket"``, ``"rpc"``, ...).
        trace : str or os.PathLike, optional
            Trace the whole session into this file (written at ``shutdown``; see
            :func:`disco_core.trace`).
        **options
            Passed to the channel's factory (``num_workers=4``, ``num_groups=1``, ...).
        """
        factory = plugins.lookup("channel", channel)
        _check_options(factory, channel, options)
        if "num_workers" in options:
            check_session_shape(options["num_workers"], options.get("num_groups", 1))
        if trace is None:
            return Session(factory(**options))
        session_trace.Trace.check_path(trace)
        token = session_trace.explicit.set(True)  # this trace, not DISCO_TRACE's
        try:
            session = Session(factory(**options))
        finally:
            session_trace.explicit.reset(token)
        try:
            session_trace.Trace(session, trace).start()
        except BaseException:
            session.shutdown()
            raise
        return session

    def __enter__(self) -> Session:
        if self._state["closed"]:  # as a closed file's: the calls inside would all fail
            raise SessionClosedError("this session has been shut down")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._state["closed"] else "open"
        return f"<{type(self).__name__} {self._channel.kind} workers={self.num_workers} groups={self.num_groups} {state}>"

    # ------------------------------------------------------------------ plumbing
    @property
    def _store(self) -> ControllerStore:
        return self._state["store"]

    @property
    def channel(self) -> Channel:
        """The control-plane channel this session drives."""
        return self._channel

    def _release(self, reg_id: int) -> None:
        # Runs in DRef.__del__, possibly in the middle of another send: only queue it.
        if not self._state["closed"]:
            self._released.append(reg_id)

    def _alloc(self) -> int:
        if self._free_regs:
            return self._free_regs.pop()
        reg = self._next_reg
        self._next_reg += 1
        return reg

    def _check_open(self) -> None:
        if self._state["closed"]:
            raise SessionClosedError("this session has been shut down")

    def _closed_meanwhile(self, exc: WorkerDiedError, worker_id: int) -> None:
        """Raise SessionClosedError (from ``exc``) if another thread shut the session
        down while this one waited: the workers then stop, and that is not a death."""
        if self._state["closed"]:
            raise SessionClosedError(
                f"the session was shut down while waiting for worker {worker_id}"
            ) from exc

    def _wait_for_sync_lock(self) -> None:
        """Take ``_sync_lock`` once another thread's synchronising call is done, unless
        the session is shut down meanwhile (a non-blocking try came first: it is the
        common case, and the cheapest)."""
        while not self._sync_lock.acquire(timeout=0.2):
            self._check_open()

    def _send(
        self,
        cmd: tuple,
        workers: Sequence[int] | None = None,
        by_reference: bool = False,
        shared: bool = False,
        pipelined: bool = False,
    ) -> None:
        """Send ``cmd``; ``shared``: its values are all immutable (see ``Outgoing``);
        ``pipelined``: an answer of an earlier command may be unread, and the caller
        reads it (no fence for it)."""
        if self._state["closed"]:
            raise SessionClosedError("this session has been shut down")
        channel = self._channel
        if channel.backlogged:  # see Channel.backlogged
            channel.catch_up()
        if cmd[0] in ANSWERED:
            hub = getattr(channel, "hub", None)
            if hub is not None:
                ws = range(self.num_workers) if workers is None else workers
                # answers abandoned, or one no wait took (see ReplyHub): fence first,
                # unless the caller reads the earlier answers itself (``pipelined``)
                if hub.unfenced or (not pipelined and hub.open.intersection(ws)):
                    channel.fence([w for w in ws if pipelined is False or w in hub.unfenced])
                hub.open.update(ws)  # before it goes
        with self._lock:
            released = self._released
            if released and workers is None:
                ids = []
                while released:
                    ids.append(released.popleft())
                # The kill rides in the same frame as the command: one write, not two.
                channel.send(
                    Outgoing(
                        (P.KILL_REG, tuple(ids)),
                        cmd,
                        by_reference=by_reference,
                        shared=shared,
                        owner=self,
                    )
                )
                self._free_regs.extend(ids)
            else:
                channel.send(
                    Outgoing(cmd, by_reference=by_reference, shared=shared, owner=self), workers
                )

    def _call(self, func: DRef, args: tuple, cls: type = DRef) -> Any:
        if self._state["closed"]:
            raise SessionClosedError("this session has been shut down")
        if not isinstance(func, DRef) or func.session is not self:
            raise DiscoTypeError(
                f"call_packed: expected a DPackedFunc of this session, got {func!r}"
            )
        shared = True
        for a in args:
            if type(a) in _PLAIN:
                continue
            if isinstance(a, DRef):
                if a.session is not self:
                    raise DiscoValueError(f"call_packed: {a!r} belongs to another session")
            else:
                shared = False  # copied for in-process workers, encoded at once
        if self._channel.backlogged:  # worker 0 is far behind: run its commands first,
            self._channel.catch_up()  # outside the lock (see Channel.backlogged)
        # The hot path of every session: _send() inlined.
        with self._lock:
            # read under the lock: a trace starts (or stops) between two sends
            record = self._record_send
            t0 = _now() if record is not None else 0
            free = self._free_regs
            reg = free.pop() if free else self._alloc()
            cmd = (P.CALL_PACKED, reg, func.reg_id, args)
            released = self._released
            ids: list[int] = []
            try:
                if released:
                    while released:
                        ids.append(released.popleft())
                    # The kill rides in the same frame as the command: one write, not two.
                    cmds: tuple[tuple, ...] = ((P.KILL_REG, tuple(ids)), cmd)
                else:
                    cmds = (cmd,)
                if shared:
                    self._channel.send_shared(cmds)
                else:
                    self._channel.send(Outgoing(*cmds, owner=self))
                free.extend(ids)
            except BaseException as exc:
                free.append(reg)  # (if the call went out, the next owner's result lands after)
                # Freed with a later command, unless they are free already: Ctrl-C can land
                # after the extend above, and a register both free and queued was killed
                # again once a new value took it (a sweep of interrupts lost a function)
                if not (ids and free[-len(ids) - 1 : -1] == ids):
                    released.extendleft(reversed(ids))
                if isinstance(exc, (DiscoError, OSError)) or not isinstance(exc, Exception):
                    raise
                if _interrupts.cut_by_program(exc):
                    raise  # the program's own (SIGALRM's TimeoutError), not the arguments'
                raise DiscoTypeError(
                    f"call_packed: the arguments cannot be sent to the workers: {exc}"
                ) from exc
            if record is not None:
                record(func.reg_id, t0)
        return DRef(self, reg) if cls is DRef else _handle(cls, self, reg)

    def _recv(self, worker_id: int) -> Any:
        """The reply of ``worker_id``; its failure comes merged with the errors that led to it."""
        try:
            return self._channel.recv(worker_id)
        except WorkerError as exc:
            failure = exc
        except WorkerDiedError as exc:
            self._closed_meanwhile(exc, worker_id)
            raise
        # Outside the except block: the merged error is not chained to this one.
        self._raise_pending(failure)
        raise failure

    def _abandon_answers(self) -> None:
        """A synchronising call ends with an exception: answers it asked for may still
        come (one that went out just before Ctrl-C, the others' after a failure), and
        no later call may take them for its own (see ``ReplyHub``)."""
        hub = getattr(self._channel, "hub", None)
        if hub is not None:
            hub.abandon()

    def _raise_pending(self, failure: WorkerError | None = None) -> None:
        """Raise the errors the workers reported so far (merged with ``failure``).

        Reports a worker already sent are delivered first (``Channel.settle``):
        an error surfaces at the first synchronising call that starts after the
        worker reported it, never at a later one by chance of thread timing.
        """
        channel = self._channel
        channel.settle()
        errors = channel.take_errors()
        if not errors:
            if failure is not None:
                raise failure
            return
        if failure is not None:
            errors.append(failure)
        self._gather(errors)

    @_one_thread_at_a_time
    def _gather(
        self,
        errors: list[WorkerError],
        first: WorkerError | None = None,
        owed: Sequence[int] = (),
    ) -> None:
        """Let every worker catch up, then raise one error that reports them all.

        Rare path. Each worker gets a sync, so that one WorkerError reports every
        worker's failure of the same command and none surfaces later at random.
        The wait is bounded (``DISCO_GATHER_TIMEOUT``): workers that have not
        caught up by then are unresponsive, and the session ends for them.
        ``first`` is raised ahead of the others (the cause, not what it caused);
        ``owed`` lists workers whose reply to an earlier sync is still unread.
        """
        try:
            self._gather_all(errors, first, owed)
        except (DiscoError, WorkerError):
            raise
        except BaseException:
            # Interrupted (Ctrl-C, a signal handler's exception) while it gathered: the
            # errors it holds go back to the channel, and the next synchronising call
            # reports them. Dropped here, a command that failed on one worker (itself
            # interrupted on the controller's thread) was never reported, and the
            # workers disagreed without a word (outside check).
            hub = getattr(self._channel, "hub", None)
            if hub is not None:
                hub.errors.extendleft(reversed(errors))
            raise

    def _gather_all(
        self, errors: list[WorkerError], first: WorkerError | None, owed: Sequence[int]
    ) -> None:
        """:meth:`_gather`'s work."""
        channel = self._channel
        limit = gather_timeout()
        deadline = time.monotonic() + limit
        laggards: list[int] = []
        try:
            for w in range(self.num_workers):
                self._send((P.SYNC_WORKER, w), [w], shared=True, pipelined=True)
            for w in range(self.num_workers):
                # ``owed``: workers whose reply to an earlier sync is still to be read
                for _ in range(1 + (w in owed)):
                    try:
                        channel.recv(w, timeout=max(0.0, deadline - time.monotonic()))
                    except WorkerError as exc:
                        errors.append(exc)
                    except DiscoTimeoutError:
                        laggards.append(w)
                        break
        except WorkerUnresponsiveError as exc:
            raise WorkerUnresponsiveError(exc.worker_ids, exc.reason, _by_worker(errors)) from None
        except WorkerDiedError as exc:
            raise exc from _merged(_by_worker(errors))
        channel.settle()
        errors.extend(channel.take_errors())  # (in place: an interruption puts them all back)
        errors[:] = _by_worker(errors)
        if laggards:
            many = len(laggards) > 1
            reason = (
                f"{'they' if many else 'it'} did not catch up within {limit:g} s "
                f"(DISCO_GATHER_TIMEOUT) after worker {errors[0].worker_id} failed: "
                f"{'they are' if many else 'it is'} stuck, frozen or far behind"
            )
            ccl = self._state["ccl"]
            if ccl is not None and ccl != "shm":
                # alive, most likely: waiting in a collective that the failed worker left
                # (a chaos check's Ctrl-C in an mpi allreduce blamed them without a word)
                reason += (
                    f", or waiting in a collective that worker {errors[0].worker_id} left "
                    f"({ccl!r} waits for its own timeout, if any, where shm fails the "
                    "others within seconds)"
                )
            channel.mark_unresponsive(laggards, reason)
            raise WorkerUnresponsiveError(laggards, reason, errors)
        if first is not None:  # the cause, ahead of what it caused
            errors = [first, *(e for e in errors if e is not first)]
        self._poison_ccl_after_timeout(errors)
        raise _merged(errors)

    def _poison_ccl_after_timeout(self, errors: list[WorkerError]) -> None:
        """After a collective timed out anywhere, no worker's CCL may run another one.

        The member that gave up left an operation behind that its peers could still
        match (MPI, NCCL); so before the user sees the error, every worker is told,
        in its command stream, to refuse every later operation (:meth:`CCL.poison`).
        """
        if self._state["ccl"] is None:
            return
        timed_out = [e for e in errors if e.exc_type.rsplit(".", 1)[-1] == "CCLTimeoutError"]
        if timed_out:
            e = timed_out[0]
            reason = f"a collective timed out on worker {e.worker_id}"
            self._send(
                (P.CALL_PACKED, 0, self._get_cached_method("disco.ccl_poison").reg_id, (reason,))
            )

    def _check_worker(self, worker_id: Any) -> int:
        if isinstance(worker_id, bool) or not isinstance(worker_id, (int, np.integer)):
            raise DiscoTypeError(f"worker_id must be an int, got {type(worker_id).__name__}")
        if not 0 <= worker_id < self.num_workers:
            raise DiscoValueError(
                f"worker_id {worker_id} is out of range for {self.num_workers} workers"
            )
        return int(worker_id)

    def _get_cached_method(self, name: str) -> DPackedFunc:
        func = self._cache.get(name)
        if func is None:
            func = self._cache[name] = _SessionFunc.take(self.get_global_func(name))
        return func

    @_one_thread_at_a_time
    def _sync_all(self) -> None:
        """Wait until every worker has run every command so far; raise their errors."""
        for w in range(self.num_workers):
            self._send((P.SYNC_WORKER, w), [w], shared=True)
        for w in range(self.num_workers):
            self._recv(w)
        self._raise_pending()

    # ------------------------------------------------------------------ public API
    def get_global_func(self, name: str) -> DPackedFunc:
        """Get a global function (``disco_core.register_func``) on every worker.

        The name is looked up by each worker, as in TVM, so a function that only
        the workers register (a custom ``entrypoint``, a module imported only
        there) is reachable. Worker 0 lives in the controller's process: when it
        lacks the name it imports the session's custom ``entrypoint`` module, if
        any, and otherwise looks the name up again when the function is called
        (a clear error on worker 0 if it is still missing then).

        Raises
        ------
        WorkerError
            At the next synchronising call, naming the function, when no worker
            has it (a ``ValueError`` on the workers).
        """
        self._check_open()
        if not isinstance(name, str):
            raise DiscoTypeError(f"get_global_func: name must be a str, got {type(name).__name__}")
        # A str subclass is sent as a plain str: the command goes as immutable (unchecked),
        # and a network peer would refuse the subclass, ending its worker (outside check)
        name = str.__str__(name)
        with self._lock:
            reg = self._alloc()
        # Sent outside the lock (the register is this call's alone until it returns):
        # _send may first run a worker 0 that is far behind, and a shutdown from
        # another thread must not wait for that (see Channel.backlogged).
        self._send((P.GET_GLOBAL_FUNC, reg, name), shared=True)
        return _handle(DPackedFunc, self, reg)

    def import_python_module(self, module_name: str) -> None:
        """Import a Python module on every worker (so the functions it registers exist).

        Returns once worker 0, which lives in the controller's process, has imported it:
        an ``ImportError`` is raised right here (a missing module as a
        :class:`~disco_core.errors.DiscoModuleNotFoundError`, which is a
        ``ModuleNotFoundError`` too; what the module's own code raises, as it is). Worker 0 first runs the commands sent
        before (so the import keeps its place in the command order, and their errors
        are raised here); the other workers import it in order with the following
        commands.
        """
        self._check_open()
        if not isinstance(module_name, str) or not module_name:
            raise DiscoTypeError(
                f"import_python_module: module_name must be a module's name (a str), got {module_name!r}"
            )
        if module_name.startswith("."):  # a TypeError, as importlib's own for it
            raise DiscoTypeError(
                f"import_python_module: {module_name!r} is a relative name; give the module's "
                "full name (the workers import it from no package)"
            )
        module_name = str.__str__(module_name)  # a plain str crosses to every worker
        self._sync_worker(0)
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # the module itself imports something missing
            here = os.getcwd()
            first = os.path.abspath(sys.path[0]) if sys.path and sys.path[0] else here
            where = (
                f"; Python looks in {first!r} (the running script's folder), not in the "
                f"current directory {here!r}: add the module's folder to PYTHONPATH"
                if first != here
                else ""
            )
            raise DiscoModuleNotFoundError(
                f"import_python_module({module_name!r}): {exc}. Worker 0 runs in this (the "
                f"controller's) process, so the module must be importable here{where}",
                name=exc.name,
            ) from None
        self.call_packed(self._get_cached_method("disco.import_python_module"), module_name)

    def call_packed(self, func: DRef | str, *args: Any) -> DRef:
        """Call ``func`` on every worker with ``args``; return the result's register at once.

        DRef arguments are replaced on each worker by that worker's register value;
        other values (arrays included) are sent by value to every worker.
        """
        if isinstance(func, str):
            func = self._get_cached_method(func)
        return self._call(func, args)

    def sync_worker_0(self) -> None:
        """Wait until worker 0 has run every command so far; raise pending worker errors."""
        self._sync_worker(0)

    def _sync_worker(self, worker_id: int) -> None:
        """Wait until ``worker_id`` has run every command so far (TVM's ``_sync_worker``,
        which TVM's own tests call); raise pending worker errors."""
        w = self._check_worker(worker_id)
        self._check_open()
        lock = self._sync_lock  # one thread at a time (see _one_thread_at_a_time), inline: hot
        owned_before = owned(lock)
        try:
            if not lock.acquire(False):
                self._wait_for_sync_lock()
            try:
                self._channel.sync(w)
            except WorkerError as exc:
                self._raise_pending(exc)
                raise
            except WorkerDiedError as exc:
                self._closed_meanwhile(exc, w)
                raise
            else:
                self._raise_pending()
            finally:
                lock.release()
        except BaseException:
            self._abandon_answers()
            release_if_left(lock, owned_before)  # Ctrl-C right after the acquire
            raise

    @_one_thread_at_a_time
    def copy_from_worker_0(self, host_array: np.ndarray, remote_array: DRef) -> None:
        """Copy worker 0's ``remote_array`` into ``host_array`` (a synchronising call)."""
        if not isinstance(remote_array, DRef):
            raise DiscoTypeError(
                f"copy_from_worker_0: remote_array must be a DRef, got {type(remote_array).__name__}"
            )
        host = as_array(host_array, "copy_from_worker_0: host_array")
        if not isinstance(host, np.ndarray):
            raise DiscoTypeError("copy_from_worker_0: host_array must be a host (NumPy) array")
        if not host.flags.writeable:
            raise DiscoValueError("copy_from_worker_0: host_array is read-only")
        if remote_array.session is not self:  # (its number names another register here)
            raise DiscoValueError(f"copy_from_worker_0: remote_array {remote_array!r} belongs to another session")  # fmt: skip
        self._send((P.COPY_FROM_WORKER0, remote_array.reg_id, host), [0], by_reference=True)
        self._recv(0)
        self._raise_pending()

    @_one_thread_at_a_time
    def copy_to_worker_0(self, host_array: Any, remote_array: DRef | None = None) -> DRef:
        """Copy a host array into worker 0's ``remote_array`` (allocated when None).

        Returns once worker 0 holds the data, so the host array may change afterwards.
        """
        host = _native_order(as_array(host_array, "copy_to_worker_0: host_array"))
        if remote_array is None:
            remote_array = self.empty(host.shape, host.dtype, worker0_only=True)
        elif not isinstance(remote_array, DRef):
            raise DiscoTypeError(
                f"copy_to_worker_0: remote_array must be a DRef, got {type(remote_array).__name__}"
            )
        elif remote_array.session is not self:  # (its number names another register here)
            raise DiscoValueError(f"copy_to_worker_0: remote_array {remote_array!r} belongs to another session")  # fmt: skip
        self._send((P.COPY_TO_WORKER0, remote_array.reg_id, host), [0], by_reference=True)
        self._recv(0)
        return remote_array

    def empty(
        self,
        shape: Sequence[int],
        dtype: Any,
        device: Device | str | None = None,
        worker0_only: bool = False,
        in_group: bool = True,
    ) -> DRef:
        """Allocate an uninitialised array on every worker (or only on group roots).

        Parameters
        ----------
        shape, dtype
            The array's shape and dtype (checked here).
        device : Device, optional
            Defaults to each worker's own device (its GPU once a GPU CCL is initialised).
        worker0_only : bool
            Allocate only on worker 0 (``in_group=False``) or on each group's first worker.
        """
        dt = as_dtype(dtype)
        shape = as_shape(shape, dt)
        dev = as_device(device)
        func = self._get_cached_method("disco.empty")
        flags = (_flag("empty", "worker0_only", worker0_only), _flag("empty", "in_group", in_group))
        return self._call(func, (shape, dt.name, dev, *flags))

    def load_vm_module(
        self, path: str | os.PathLike, device: Device | str | None = None
    ) -> DModule:
        """Load a module file on every worker through the module-loader plugins.

        The loader is chosen by the file's suffix (``.py`` in the core, ``.pt2`` with torch).
        """
        self._check_open()
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise DiscoTypeError(
                f"load_vm_module: path must be a file's path (str, bytes or os.PathLike), got {type(path).__name__}"
            )
        try:
            path = os.path.abspath(os.fspath(path))
        except TypeError as exc:  # a PathLike whose __fspath__ gives no str or bytes
            raise DiscoTypeError(f"load_vm_module: path {path!r} is no file path: {exc}") from None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        suffix = os.path.splitext(path)[1]
        if not suffix:
            raise DiscoValueError(
                f"load_vm_module: {path} has no file suffix; module loaders are chosen by "
                f"suffix (installed: {', '.join(sorted(plugins.registered('loader')))})"
            )
        plugins.lookup("loader", suffix)  # PluginNotFoundError here, not on the workers
        if not os.path.isfile(path):
            raise DiscoFileNotFoundError(f"load_vm_module: no such file: {path}")
        func = self._get_cached_method("disco.load_module")
        return self._call(func, (path, as_device(device)), DModule)

    # ------------------------------------------------------------------ collectives
    @_one_thread_at_a_time  # two threads' calls: the second finds the first's CCL
    def init_ccl(self, ccl: str, *device_ids: int, **options: Any) -> None:
        """Initialise the collective library ``ccl`` on every worker.

        Parameters
        ----------
        ccl : str
            A registered CCL: ``"shm"`` (core), ``"mpi"``, ``"nccl"``, ``"rccl"``, ...
        *device_ids : int
            The devices the workers bind to (GPU CCLs), as in TVM.
        **options
            CCL-specific options, e.g. ``timeout=`` (seconds) for ``shm``.
        """
        self._check_open()
        # A dead session says so first: "already initialised" would send the user
        # looking for the wrong mistake.
        self._channel.check_alive()
        if self._state["ccl"] is not None:
            raise CCLError(f"a CCL ({self._state['ccl']!r}) is already initialised on this session")
        cls = plugins.lookup("ccl", ccl)
        for d in device_ids:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
                raise DiscoTypeError(f"init_ccl: device ids must be ints, got {d!r}")
        ids = tuple(int(d) for d in device_ids)
        try:
            rendezvous = cls.rendezvous(self._channel, ids, **options)
        except DiscoError:
            raise
        except TypeError as exc:  # an option of the wrong type, as the CCL reads it
            raise DiscoTypeError(f"init_ccl({ccl!r}, options {sorted(options)}): {exc}") from exc
        except ValueError as exc:
            raise DiscoValueError(f"init_ccl({ccl!r}, options {sorted(options)}): {exc}") from exc
        self._state["rendezvous"] = rendezvous
        self._channel.on_worker_death(rendezvous.workers_lost)
        try:
            # Checks first, everywhere (the CCL installed on every worker, then its
            # own preflight): a worker failing inside a blocking initialisation would
            # leave the others waiting in it.
            check = self._get_cached_method("disco.ccl_preflight")
            self.call_packed(check, ccl, rendezvous.payload, ids, options)
            self._sync_all()
            init = self._get_cached_method("disco.init_ccl")
            self.call_packed(init, ccl, rendezvous.payload, ids, options)
            self._sync_aborting(rendezvous)
        except WorkerError as exc:
            self._state["rendezvous"] = None
            rendezvous.abort("init_ccl failed")
            self._store.abort(f"init_ccl failed on worker {exc.worker_id}")
            self._discard_ccl()
            rendezvous.close()
            self._store.reset()  # a new init_ccl starts from an empty store
            raise
        self._state["ccl"] = ccl
        # Never the rendezvous payload: it may hold addresses and secrets of the CCL.
        size = self.num_workers // self.num_groups
        logger.info(
            "CCL %r initialised: %d worker(s) in %d group(s) of %d%s",
            ccl, self.num_workers, self.num_groups, size,
            f", devices {list(ids)}" if ids else "",
        )  # fmt: skip

    def _discard_ccl(self) -> None:
        """After a failed ``init_ccl``: the workers whose CCL was made close it, so that
        ``init_ccl`` may be called again (best effort: the failure is what is raised)."""
        try:
            self.call_packed(self._get_cached_method("disco.ccl_discard"))
            self._sync_all()
        except WorkerError:
            pass

    @_one_thread_at_a_time
    def _sync_aborting(self, rendezvous: Any) -> None:
        """``_sync_all`` that aborts ``rendezvous`` as soon as any worker reports a failure.

        CCL constructors may wait for every peer (NCCL, a TCP mesh): when one worker
        fails in its constructor the others are released through the rendezvous at
        once, instead of waiting for their own timeout, and the first failure
        reported is the one raised (the others' aborts come attached).
        """
        channel = self._channel
        for w in range(self.num_workers):
            self._send((P.SYNC_WORKER, w), [w], shared=True)
        pending = list(range(self.num_workers))
        poll = 0.001
        while True:
            if pending:
                try:
                    channel.recv(pending[0], timeout=poll)  # worker 0 runs on its own thread
                    pending.pop(0)
                    continue
                except DiscoTimeoutError:
                    poll = min(poll * 2, 0.05)
                except WorkerError as exc:
                    rendezvous.abort(
                        f"worker {exc.worker_id} failed in init_ccl: {exc.remote_message}"
                    )
                    self._store.abort(f"worker {exc.worker_id} failed in init_ccl")
                    pending.pop(0)  # that reply was read: it was the failure
                    self._gather([*channel.take_errors(), exc], first=exc, owed=pending)
            else:
                channel.settle()  # every report sent before the last reply is in
            errors = channel.take_errors()
            if errors:
                first = errors[0]
                rendezvous.abort(
                    f"worker {first.worker_id} failed in init_ccl: {first.remote_message}"
                )
                self._store.abort(f"worker {first.worker_id} failed in init_ccl")
                self._gather(errors, first=first, owed=pending)
            if not pending:
                return

    def _collective_ready(self, name: str) -> None:
        if self._state["ccl"] is None:
            self._check_open()
            raise CCLError(
                f"{name}: no CCL is initialised; call session.init_ccl('shm') (or 'mpi', 'nccl') first"
            )

    def _collective(self, name: str, *args: Any) -> None:
        self._collective_ready(name)
        self.call_packed(self._get_cached_method(f"disco.{name}"), *args)

    def _check_buffers(self, name: str, target: str, dst: Any, source: str = "", src: Any = None) -> Any:  # fmt: skip
        """Refuse, at the call, buffers a collective cannot use (before its CCL is asked
        for); returns ``src`` as the workers should get it.

        The target ``dst`` must be a register of this session: a host array would be
        sent to every worker by value, written there and dropped, and the caller's array
        left as it was, silently. The source ``src`` (none when ``source`` is empty) may
        also be a host array, sent by value to every worker as any ``call_packed``
        argument, in this machine's byte order (as ``copy_to_worker_0`` puts one: a
        collective moves bytes, so ``>f4`` data reduced as ``float32`` was garbage);
        anything else (a list, a number) failed only on the workers, at the next sync.
        """
        if type(dst) is DRef and dst.session is self and (not source or (type(src) is DRef and src.session is self)):  # fmt: skip
            return src  # the usual call: two registers of this session
        for param, value, kind in ((target, dst, "DRef"), (source, src, "DRef or an array")):
            if not param:
                continue
            if isinstance(value, DRef):
                if value.session is not self:
                    raise DiscoValueError(f"{name}: {param} {value!r} belongs to another session")
            elif kind == "DRef" or not is_array(value):
                hint = (
                    " (a host array as the target would be written on the workers and "
                    "dropped: pass a register, e.g. from session.empty(), and read it "
                    "with copy_from_worker_0)"
                    if kind == "DRef" and is_array(value)
                    else ""
                )
                raise DiscoTypeError(
                    f"{name}: {param} must be a {kind} of this session, got {type(value).__name__}{hint}"
                )
        return _native_order(src)

    def _host_to_roots(self, name: str, host: np.ndarray, in_group: bool) -> DRef:
        """``host`` on worker 0 (``in_group=False``) or on every group's first worker.

        The data enters once, through worker 0; with several groups worker 0 then
        sends it to the other groups' first workers over the CCL (point to point),
        so every group starts from the same data.
        """
        self._collective_ready(name)
        ref = self.empty(host.shape, host.dtype, worker0_only=True, in_group=in_group)
        self.copy_to_worker_0(host, ref)
        if in_group and self.num_groups > 1:
            self.call_packed(self._get_cached_method("disco.share_with_group_roots"), ref)
        return ref

    def broadcast(self, src: Any, dst: DRef | None = None, in_group: bool = True) -> DRef:
        """Send a host array to every worker; returns ``dst`` (allocated when None).

        Parameters
        ----------
        src : array
            The host array.
        dst : DRef, optional
            Where every worker receives it; allocated with ``src``'s shape and dtype when None.
        in_group : bool
            True (the default): the broadcast runs within each group, from the group's
            first worker, and every group receives the same data. False: one broadcast
            from worker 0 across all workers. Both end with ``src`` on every worker.
        """
        in_group = _flag("broadcast", "in_group", in_group)
        host = as_array(src, "broadcast: src")
        if dst is not None:
            self._check_buffers("broadcast", "dst", dst)
        self._collective_ready("broadcast")
        if dst is None:
            dst = self.empty(host.shape, host.dtype)
        # No staging array: the data goes straight into worker 0's dst (one copy),
        # which then broadcasts in place (to the other groups' roots first).
        sent = False
        try:
            self.copy_to_worker_0(host, dst)
            self._broadcast_from_root(dst, in_group)
            sent = True
        except DiscoError:
            raise  # the copy's own failure, or a death: nothing more to send
        except BaseException:
            # Ctrl-C, a signal handler's exception: the copy may still run on worker 0
            # (cut as it waited), so the broadcast goes all the same, or worker 0 alone
            # held the new data, silently (outside check: 11 of 44 storm runs). Twice,
            # if the cut came after it went: the workers agree either way
            if not sent:
                self._broadcast_from_root(dst, in_group)
            raise
        return dst

    def _broadcast_from_root(self, dst: DRef, in_group: bool) -> None:
        if in_group and self.num_groups > 1:
            self.call_packed(self._get_cached_method("disco.share_with_group_roots"), dst)
        self._collective("broadcast_from_worker0", dst, in_group, dst)

    def broadcast_from_worker0(self, src: DRef, dst: DRef, in_group: bool = True) -> DRef:
        """Broadcast ``src`` of worker 0 (of each group's first worker if ``in_group``) into ``dst``."""
        src = self._check_buffers("broadcast_from_worker0", "dst", dst, "src", src)
        self._collective(
            "broadcast_from_worker0",
            src,
            _flag("broadcast_from_worker0", "in_group", in_group),
            dst,
        )
        return dst

    def scatter(self, src: Any, dst: DRef | None = None, in_group: bool = True) -> DRef:
        """Send one slice of a host array along its first axis to each worker; returns ``dst``.

        Parameters
        ----------
        src : array
            The host array. With ``in_group=True`` (the default) its first dimension is
            the group size and every group gets the same shards: worker ``w`` receives
            ``src[w % group_size]``. With ``in_group=False`` it is ``num_workers`` and
            worker ``w`` receives ``src[w]``. With one group both are the same.
        dst : DRef, optional
            Allocated with shape ``src.shape[1:]`` when None.
        in_group : bool
            Scatter within each group (from its first worker) or across all workers.
        """
        in_group = _flag("scatter", "in_group", in_group)
        host = as_array(src, "scatter: src")
        if dst is not None:
            self._check_buffers("scatter", "dst", dst)
        size = self.num_workers // self.num_groups if in_group else self.num_workers
        if host.ndim == 0 or host.shape[0] != size:
            what = (
                f"the group size ({size}; in_group=True scatters within each group)"
                if in_group and self.num_groups > 1
                else f"the number of workers ({self.num_workers})"
            )
            raise DiscoValueError(
                f"scatter: the first dimension of src must be {what}, got shape {tuple(host.shape)}"
            )
        src_ref = self._host_to_roots("scatter", host, in_group)
        if dst is None:
            dst = self.empty(host.shape[1:], host.dtype)
        self._collective("scatter_from_worker0", src_ref, in_group, dst)
        return dst

    def scatter_from_worker0(self, from_array: DRef, to_array: DRef, in_group: bool = True) -> None:
        """Split ``from_array`` of worker 0 (each group root) evenly into every worker's ``to_array``."""
        from_array = self._check_buffers(
            "scatter_from_worker0", "to_array", to_array, "from_array", from_array
        )
        self._collective(
            "scatter_from_worker0",
            from_array,
            _flag("scatter_from_worker0", "in_group", in_group),
            to_array,
        )

    def gather_to_worker0(self, from_array: DRef, to_array: DRef, in_group: bool = True) -> None:
        """Concatenate every worker's ``from_array`` into ``to_array`` of worker 0 (each group root)."""
        from_array = self._check_buffers(
            "gather_to_worker0", "to_array", to_array, "from_array", from_array
        )
        self._collective(
            "gather_to_worker0",
            from_array,
            _flag("gather_to_worker0", "in_group", in_group),
            to_array,
        )

    def allreduce(self, src: DRef, dst: DRef, op: str = "sum", in_group: bool = True) -> DRef:
        """Reduce ``src`` over the workers (or each group) into ``dst`` on all of them.

        ``op`` is one of ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"avg"``.
        """
        if op not in REDUCE_OPS:
            raise DiscoValueError(
                f"allreduce: unsupported op {op!r}; expected one of {', '.join(REDUCE_OPS)}"
            )
        src = self._check_buffers("allreduce", "dst", dst, "src", src)
        self._collective("allreduce", src, op, _flag("allreduce", "in_group", in_group), dst)
        return dst

    def allgather(self, src: DRef, dst: DRef, in_group: bool = True) -> DRef:
        """Concatenate every worker's ``src`` along the first axis into ``dst`` on all of them."""
        src = self._check_buffers("allgather", "dst", dst, "src", src)
        self._collective("allgather", src, _flag("allgather", "in_group", in_group), dst)
        return dst

    # ------------------------------------------------------------------ debug + shutdown
    @_one_thread_at_a_time
    def _debug_get(self, ref: DRef, worker_id: int) -> Any:
        w = self._check_worker(worker_id)
        self._send((P.DEBUG_GET_FROM_REMOTE, ref.reg_id, w), [w])
        value = self._recv(w)
        self._raise_pending()
        return with_numpy_method(value)  # arrays also have TVM's .numpy()

    @_one_thread_at_a_time
    def _debug_set(self, ref: DRef, worker_id: int, value: Any) -> None:
        w = self._check_worker(worker_id)
        if not isinstance(value, np.ndarray) and hasattr(value, "__dlpack__"):
            value = np.array(as_array(value), copy=True)
        try:
            self._send((P.DEBUG_SET_REGISTER, ref.reg_id, w, value), [w])
        except (DiscoError, OSError):
            raise
        except Exception as exc:  # a value that cannot be sent (as call_packed says it)
            raise DiscoTypeError(
                f"debug_copy_from: the value cannot be sent to worker {w}: {exc}"
            ) from exc
        self._recv(w)

    def shutdown(self) -> None:
        """Stop every worker and free everything; a second call does nothing.

        A trace that is on (:func:`disco_core.trace`, ``trace=``, ``DISCO_TRACE``) is
        written first.
        """
        if self._state["closed"]:
            return
        running = self._state.get("trace")
        try:
            if running is not None:
                try:
                    # bounded as the rest of a shutdown: a worker busy for good is left out
                    running.stop(within=shutdown_timeout())
                except WorkerError as exc:  # the file is written; a traced command had failed
                    logger.warning("trace %s written; a command sent while tracing failed: %s", running.path, exc)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - shutting down must go on
                    logger.warning("the trace %s could not be written: %s", running.path, exc)
        finally:  # Ctrl-C in the trace's stop: the workers are still stopped
            with self._lock:
                self._state["shutdown_called"] = True  # its Ctrl-C is raised here
                self._finalizer()
                self._cache.clear()

    @property
    def is_closed(self) -> bool:
        return bool(self._state["closed"])


class ThreadedSession(Session):
    """A session whose workers are all threads of the controller's process.

    Parameters
    ----------
    num_workers : int
        Number of workers.
    num_groups : int
        Number of worker groups; must divide ``num_workers``.
    """

    def __init__(self, num_workers: int, num_groups: int = 1) -> None:
        check_session_shape(num_workers, num_groups)
        super().__init__(
            plugins.lookup("channel", "threaded")(num_workers=num_workers, num_groups=num_groups)
        )


class _Default(str):
    """A default string told apart (by identity) from the same string passed explicitly."""

    __slots__ = ()


#: ``ProcessSession``'s default entrypoint: its signature shows the value, and an
#: entrypoint given both ways (TVM's older positional form and ``entrypoint=``) is
#: still told apart from this default.
_DEFAULT_ENTRYPOINT = _Default("disco_core.worker")


class ProcessSession(Session):
    """Worker 0 is a thread of the controller; workers 1..N-1 are child processes.

    Parameters
    ----------
    num_workers : int
        Number of workers.
    num_groups : int
        Number of worker groups; must divide ``num_workers``. A str here is taken as
        the ``entrypoint`` (``ProcessSession(num_workers, entrypoint)``, the form of
        TVM's older documentation).
    entrypoint : str
        The module the children run as ``python -m <entrypoint>``; it must end by
        calling :func:`disco_core.worker.main` (under ``if __name__ == "__main__"``:
        worker 0 imports it when it lacks a global function, see
        :meth:`Session.get_global_func`). Default ``"disco_core.worker"``.
    """

    def __init__(
        self,
        num_workers: int,
        num_groups: int | str = 1,
        entrypoint: str = _DEFAULT_ENTRYPOINT,
    ) -> None:
        if isinstance(num_groups, str):
            # ProcessSession(num_workers, entrypoint): the form of TVM's older documentation.
            if entrypoint is not _DEFAULT_ENTRYPOINT:
                raise DiscoTypeError(
                    "ProcessSession: the entrypoint was given twice (as the second argument "
                    "and as entrypoint=); use ProcessSession(num_workers, num_groups, entrypoint)"
                )
            entrypoint, num_groups = num_groups, 1
        check_session_shape(num_workers, num_groups)
        if not isinstance(entrypoint, str) or not entrypoint:
            raise DiscoTypeError("entrypoint must be a module name")
        factory = plugins.lookup("channel", "process")
        super().__init__(
            factory(num_workers=num_workers, num_groups=num_groups, entrypoint=str(entrypoint))
        )


class SocketSession(Session):
    """A session across machines (provided by the disco-socket plugin).

    Parameters
    ----------
    num_nodes : int
        Number of machines, the controller's included.
    num_workers_per_node : int
        Workers on each machine.
    num_groups : int
        Number of worker groups.
    host, port
        Where the controller listens for node agents (``disco-socket join HOST PORT``).
    **options
        Passed to the socket channel (token, ssl_context, timeout, ...).
    """

    def __init__(
        self,
        num_nodes: int,
        num_workers_per_node: int,
        num_groups: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        **options: Any,
    ) -> None:
        factory = plugins.lookup("channel", "socket")
        # each count by its own name: "num_workers must be >= 1" named neither (outside check)
        for name, value in (("num_nodes", num_nodes), ("num_workers_per_node", num_workers_per_node)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise DiscoTypeError(f"SocketSession: {name} must be an int, got {type(value).__name__}")  # fmt: skip
            if value < 1:
                raise DiscoValueError(f"SocketSession: {name} must be >= 1, got {value}")
        check_session_shape(num_nodes * num_workers_per_node, num_groups)
        try:  # an unknown keyword came from deep inside, as the channel's TypeError
            inspect.signature(factory).bind(num_nodes=num_nodes, num_workers_per_node=num_workers_per_node, num_groups=num_groups, host=host, port=port, **options)  # fmt: skip
        except TypeError as exc:
            raise DiscoTypeError(f"SocketSession: {exc}") from None
        except ValueError:  # a factory Python cannot inspect: it checks itself
            pass
        super().__init__(
            factory(
                num_nodes=num_nodes,
                num_workers_per_node=num_workers_per_node,
                num_groups=num_groups,
                host=host,
                port=port,
                **options,
            )
        )


_ = WorkerDiedError  # re-exported for type checkers reading this module
