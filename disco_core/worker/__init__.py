"""The worker: register file and command loop; ``python -m disco_core.worker``.

The same :class:`Worker` runs in a thread of the controller's process (worker 0,
and every worker of a ThreadedSession) and in child processes. User functions ask
the worker they run on for its facts with :func:`current`.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _interrupts, registry
from .. import protocol as P
from ..commandline import configure_from_env
from ..device import Device, as_array, to_host
from ..errors import FOLLOW_ON_NOTE, DiscoError, UntrustedValueError, WorkerError
from ..protocol import (
    _REF_TYPES,
    FLAG_BATCH,
    FrameReader,
    RegRef,
    decode,
    encode,
    write_frame,
)
from ..store import NoStore, RemoteStore, Store
from ..wire_values import decode_untrusted, encode_for_network
from ._poll_first import reader_of, spin_seconds

__all__ = [
    "WorkerContext",
    "Worker",
    "current",
    "set_current",
    "MissingValue",
    "main",
    "command_stream",
    "HeartbeatSender",
]

_local = threading.local()
logger = logging.getLogger("disco_core.worker")
#: Set by :func:`main`: the workers of this process are not in the controller's process.
_IN_WORKER_PROCESS = False


@dataclass
class WorkerContext:
    """Facts about the worker a function runs on (``disco_core.worker.current()``).

    Attributes
    ----------
    worker_id : int
        Global id, 0 .. num_workers-1.
    num_workers, num_groups : int
        The session's shape.
    device : Device
        The worker's default device (``cpu:0``; a CCL such as nccl binds a GPU).
    ccl : CCL or None
        The collective library, once ``init_ccl`` ran.
    extra : dict
        Facts a channel adds; ``"entrypoint"``: on worker 0, the module the session's
        worker processes run (the ``process`` and ``socket`` channels set it).
    hand_over : callable
        Hands every command the controller's channel holds back to the other
        workers (on workers in the controller's process; elsewhere it does
        nothing). The CCL calls it before an operation that waits for them (see
        ``CCL``): a worker that runs on the controller's thread must never wait
        for a peer whose commands are still held back. A user function that
        waits for another worker by other means calls it first, too.
    tracer : object or None
        While a trace is on (:func:`disco_core.trace`), the recorder of this worker's
        events (a ``disco_core.tracing.recorder.Recorder``); the CCL's operations
        record themselves in it.
    worker : Worker or None
        The :class:`Worker` that runs this context (None for a stand-in).
    calls : int
        The ``call_packed`` commands this worker has begun, the one running included:
        the same count on every worker at the same call, as every worker runs every
        call. A CCL uses it to tell that a peer failed in the very call it waits in
        (:meth:`~disco_core.ccl.base.CCL.call_failed`).
    on_call_end : callable or None
        Called with :attr:`calls` as each ``call_packed`` command ends, returned or
        raised, when set (by a CCL that must publish how far this worker got: the shm
        CCL, once a call of this worker failed). None otherwise: one test a call.
    store : Store
        The session's rendezvous store (:class:`disco_core.store.Store`): keys
        every worker can set, read and wait for, during ``init_ccl`` and in any
        worker function. On a channel that carries none, every call raises a
        :class:`~disco_core.errors.DiscoError` that says so.
    """

    worker_id: int
    num_workers: int
    num_groups: int
    device: Device = field(default_factory=lambda: Device("cpu", 0))
    ccl: Any = None
    registers: dict = field(default_factory=dict, repr=False)
    extra: dict = field(default_factory=dict)
    hand_over: Callable[[], None] = field(default=lambda: None, repr=False)
    store: Store = field(default_factory=NoStore, repr=False)
    tracer: Any = field(default=None, repr=False)
    worker: Any = field(default=None, repr=False, compare=False)
    calls: int = field(default=0, repr=False, compare=False)
    on_call_end: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    @property
    def group_size(self) -> int:
        return self.num_workers // self.num_groups

    @property
    def group_id(self) -> int:
        return self.worker_id // self.group_size

    @property
    def local_rank(self) -> int:
        """Rank within the worker's group."""
        return self.worker_id % self.group_size

    @property
    def is_group_root(self) -> bool:
        return self.local_rank == 0

    @property
    def world_size(self) -> int:
        return self.num_workers


def current() -> WorkerContext:
    """The context of the worker running the calling function.

    Raises
    ------
    DiscoError
        When called outside a worker (e.g. in the controller's own code).
    """
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise DiscoError("disco_core.worker.current() called outside a Disco worker")
    return ctx


def set_current(ctx: WorkerContext | None) -> WorkerContext | None:
    """Make ``ctx`` the calling thread's worker context; return the previous one."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    return previous


class MissingValue:
    """Stands for an argument whose register holds no value.

    Collective functions receive it instead of an exception, so that the worker still
    takes part in the collective (every peer then raises the same error instead of
    waiting for it).
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"MissingValue({self.reason!r})"


class _Failed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


_ABSENT = object()
_CALL_PACKED, _KILL_REG = P.CALL_PACKED, P.KILL_REG  # module globals: the hot path's tests
# the trace's clock, disco_core.tracing.recorder.now (a layer above: not imported)
_now = time.perf_counter_ns


class Worker:
    """One worker: a register file and the interpreter of the command stream.

    Parameters
    ----------
    worker_id, num_workers, num_groups : int
        The worker's place in the session.
    send : callable
        ``send(message)`` delivers a message to the controller: ``("reply", value)``,
        ``("fail", WorkerError)`` (a synchronous command failed) or
        ``("error", WorkerError)`` (an asynchronous command failed).
    """

    def __init__(
        self, worker_id: int, num_workers: int, num_groups: int, send: Callable[[tuple], None]
    ) -> None:
        self.ctx = WorkerContext(worker_id, num_workers, num_groups)
        self.ctx.worker = self
        self.regs: dict[int, Any] = self.ctx.registers
        self.send = send
        self._names: dict[int, str] = {}  # register -> global function name, for messages
        self._imported: dict[str, str] = {}  # entrypoint -> why its import failed, or ""
        # The command stream of run(), and the commands read_until() set aside
        self._source: Callable[[], tuple] | None = None
        self._next: Callable[[], tuple] = _no_stream
        self._aside: collections.deque[tuple] = collections.deque()
        self._thread = 0  # the thread that runs run()

    # -- registers --------------------------------------------------------------------
    def get_reg(self, reg_id: int) -> Any:
        value = self.regs.get(reg_id, _ABSENT)
        if value is _ABSENT:
            raise DiscoError(
                f"register {reg_id} holds no value on worker {self.ctx.worker_id} "
                "(never set on this worker, or already freed)"
            )
        if type(value) is _Failed:
            exc = DiscoError(
                f"register {reg_id} holds no value on worker {self.ctx.worker_id} "
                f"{FOLLOW_ON_NOTE}: {value.reason}"
            )
            exc._disco_root = value.reason  # type: ignore[attr-defined]  # a register set from this one keeps the cause
            raise exc
        return value

    def _resolve(self, value: Any, lenient: bool) -> Any:
        t = type(value)
        if t is RegRef or t in _REF_TYPES:
            if not lenient:
                return self.get_reg(value.reg_id)
            try:
                return self.get_reg(value.reg_id)
            except DiscoError as exc:
                return MissingValue(str(exc))
        if t is tuple:
            return tuple([self._resolve(v, lenient) for v in value])
        if t is list:
            return [self._resolve(v, lenient) for v in value]
        if t is dict:
            return {k: self._resolve(v, lenient) for k, v in value.items()}
        return value

    # -- the loop ----------------------------------------------------------------------
    def run(self, next_command: Callable[[], tuple]) -> None:
        """Execute commands from ``next_command()`` until a shutdown command.

        A worker run this way (in a process of its own) reaches the session's
        rendezvous store through its own links (a :class:`~disco_core.store.RemoteStore`).
        """
        self._source = self._next = next_command
        self._thread = threading.get_ident()
        if type(self.ctx.store) is NoStore:
            self.ctx.store = RemoteStore(self.send, self.read_until)
        _local.ctx = self.ctx
        try:
            # self._next is next_command, or for a while the commands read_until set aside
            while self.execute(self._next()):
                pass
        finally:
            _local.ctx = None

    def read_until(self, match: Callable[[tuple], bool]) -> tuple:
        """Read the command stream, while a command runs, up to the answer ``match`` accepts.

        The answer is a ``STORE_REPLY`` command for which ``match(cmd)`` is true.

        Every other command read meanwhile is set aside: :meth:`run` executes
        them after the current command, in the order they came.

        Raises
        ------
        DiscoError
            The worker runs no command stream of its own (not :meth:`run`).
        EOFError
            The controller is gone (the main loop then sees the end, too).
        """
        source = self._source
        if source is None:
            raise DiscoError("this worker reads no command stream of its own (Worker.run)")
        if threading.get_ident() != self._thread:
            # two readers of one stream would tear its frames apart
            raise DiscoError(
                "the rendezvous store of a worker process is used from the worker's own "
                "thread only (in the function a command runs), not from a thread it started"
            )
        aside = self._aside
        while True:
            try:
                cmd = source()
            except BaseException as exc:  # the stream ended: the main loop must end the same way
                self._next = _raiser(exc)
                raise
            if cmd[0] == P.STORE_REPLY and match(cmd):
                return cmd
            aside.append(cmd)
            self._next = self._next_aside

    def _next_aside(self) -> tuple:
        aside = self._aside
        cmd = aside.popleft()
        if not aside:
            self._next = self._source  # type: ignore[assignment]  # set by run()
        return cmd

    #: While a trace runs, its recorders (``disco_core.tracing.worker_side``), put on the
    #: instance: ``_record_call(func_reg, reg, t0)`` after a ``call_packed`` (its start
    #: read before it), and ``_record_other(cmd)``, which runs any other command in
    #: :meth:`_execute_other` and records it. None (the class's): untraced, one
    #: attribute read a command.
    _record_call: Callable[[int, int, int], None] | None = None
    _record_other: Callable[[tuple], bool] | None = None

    @_interrupts.barrier  # a command runs interruptibly, whoever called it
    def execute(self, cmd: tuple, queue: Any = None) -> bool:
        """Execute one command; return False after a shutdown command.

        ``queue``: the deque that ``cmd`` heads (a worker of the controller's process),
        popped here, inside the step that reports a failed call: an exception raised
        between a pop and that step (Ctrl-C, a signal handler's, on the controller's
        thread) lost the call without a word, and the workers disagreed.
        """
        if cmd[0] != _CALL_PACKED:
            if queue is not None:
                queue.popleft()  # (a lost sync is answered by the next fence; see protocol)
            record_other = self._record_other
            return self._execute_other(cmd) if record_other is None else record_other(cmd)
        record = self._record_call
        t0 = _now() if record is not None else 0
        _, reg, func_reg, args = cmd
        self.ctx.calls += 1
        try:
            if queue is not None:
                queue.popleft()
            func = self.regs.get(func_reg, _ABSENT)
            if type(func) is _Failed or func is _ABSENT:
                func = self.get_reg(func_reg)  # raises, naming the register
            if args:
                args = self._resolve(args, getattr(func, "_disco_collective", False))
            result = func(*args)
            if reg:
                self.regs[reg] = result
        except BaseException as exc:  # noqa: BLE001 - everything is reported
            # An interrupt until told otherwise: a second one landing in the long steps
            # below (the check, the report's traceback) left the CCL untold, and the
            # peers waited for their timeout or met the next collective out of step
            # (outside check: 3 in 141 traced storm runs)
            interrupt = True
            try:
                interrupt = isinstance(exc, (KeyboardInterrupt, SystemExit)) or self._interrupts_controller(exc)  # fmt: skip
                self._tell_ccl_call_failed(exc)
                if self.ctx.on_call_end is not None:
                    self.ctx.on_call_end(self.ctx.calls)
                name = self._names.get(func_reg, f"register {func_reg}")
                if reg:
                    root = getattr(exc, "_disco_root", None)  # one cause, however long the chain
                    self.regs[reg] = _Failed(
                        root or f"call_packed({name}) failed with {type(exc).__name__}: {exc}"
                    )
                self._report(exc, f"call_packed({name})")
            finally:
                if interrupt:
                    try:
                        self._cut_collective(func_reg, exc)
                    except BaseException:  # one more interrupt, in the telling itself
                        self._cut_collective(func_reg, exc)
                        raise
            if interrupt:
                if record is not None:
                    record(func_reg, reg, t0)
                raise
        if self.ctx.on_call_end is not None:
            self.ctx.on_call_end(self.ctx.calls)
        if record is not None:
            record(func_reg, reg, t0)
        return True

    def _tell_ccl_call_failed(self, exc: BaseException) -> None:
        """This call raised: peers that wait for this worker in an operation of the same
        call would wait until their timeout (an outside check: 300 s, with the cause
        in the error's tail); the CCL lets them fail at once (``CCL.call_failed``)."""
        ccl = self.ctx.ccl
        if ccl is None:
            return
        try:
            ccl.call_failed(self.ctx.calls, f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001, S110 - the call's own error is what is reported
            pass

    def _cut_collective(self, func_reg: int, exc: BaseException) -> None:
        """An interrupt ended a call of the collective function in ``func_reg`` here,
        maybe before it reached its operation (as its arguments were looked up): tell
        the CCL, as an operation cut in the middle does (``CCL.interrupted``), or the
        peers waited in it for their timeout (outside check: 15 s of 15). Cut as the
        operation returned, the CCL is given up all the same: whether the peers met it
        cannot be told."""
        ccl = self.ctx.ccl
        if ccl is None or not getattr(self.regs.get(func_reg), "_disco_collective", False):
            return
        name = self._names.get(func_reg, f"register {func_reg}")
        try:
            ccl.interrupted(f"{name} on worker {self.ctx.worker_id} was cut short ({type(exc).__name__})")  # fmt: skip
        except Exception:  # noqa: BLE001, S110 - the interrupt is what the caller must see
            pass

    def _execute_other(self, cmd: tuple) -> bool:
        """:meth:`execute` of a command other than ``call_packed``."""
        action = cmd[0]
        if action == _KILL_REG:
            pop, names = self.regs.pop, self._names
            for reg in cmd[1]:
                pop(reg, None)
                if reg in names:  # a freed register names no function any more
                    del names[reg]
        elif action == P.GET_GLOBAL_FUNC:
            _, reg, name = cmd
            fn = registry.get_global_func(name, allow_missing=True)
            if fn is None:
                fn = self._missing_global(name)
            if fn is None:
                text = self._missing_text(name)
                self.regs[reg] = _Failed(text)
                self._report(
                    ValueError(text),
                    f"get_global_func({name!r})",
                    tb=False,
                )
            else:
                self.regs[reg] = fn
                self._names[reg] = name
        elif action == P.SYNC_WORKER:
            if len(cmd) > 2:  # a fence (see protocol.SYNC_WORKER): its token, at once
                token = cmd[2]
                self._sync_op(lambda: token)
            else:
                ccl = self.ctx.ccl
                self._sync_op(ccl.synchronize if ccl is not None else _nothing)
        elif action == P.COPY_FROM_WORKER0:
            _, reg, host = cmd
            self._sync_op(lambda: _copy_into(host, self.get_reg(reg), "copy_from_worker_0"))
        elif action == P.COPY_TO_WORKER0:
            _, reg, host = cmd
            self._sync_op(lambda: _copy_into(self.get_reg(reg), host, "copy_to_worker_0"))
        elif action == P.DEBUG_GET_FROM_REMOTE:
            self._sync_op(lambda: to_host(self.get_reg(cmd[1])))
        elif action == P.DEBUG_SET_REGISTER:
            _, reg, _, value = cmd
            self._sync_op(lambda: self._debug_set(reg, value))
        elif action == P.SHUTDOWN:
            self.close()
            return False
        elif action == P.STORE_REPLY:
            pass  # an answer nobody waits for any more: nothing to do
        else:
            self._report(DiscoError(f"unknown command action {action!r}"), "protocol")
        return True

    def synchronize(self) -> None:
        """What a ``SyncWorker`` command does, for a caller on this worker's thread.

        Raises
        ------
        WorkerError
            The CCL's ``synchronize`` failed (e.g. a GPU stream's error).
        """
        ccl = self.ctx.ccl
        if ccl is not None:
            try:
                ccl.synchronize()
            except Exception as exc:
                raise self._error(exc) from None

    def _missing_text(self, name: str) -> str:
        """Why ``name`` is unknown here; in a worker process, also how to make it known."""
        text = registry.missing_message(name)
        if not _IN_WORKER_PROCESS:
            return text
        return (
            f"{text} on worker {self.ctx.worker_id}, which runs in a process of its own: "
            "a worker process knows only the functions that the modules it imports register, "
            "not those registered by the controller's script (__main__). Define them in a "
            "module and call sess.import_python_module('that_module') before "
            "sess.get_global_func (or start the session with entrypoint='that_module')"
        )

    def _missing_global(self, name: str) -> Callable | None:
        """Worker 0's answer for a global function its process lacks (None: report it).

        Worker 0 runs in the controller's process, which need not register what the
        other workers do: it first imports the session's custom entrypoint module
        (the children run it as ``__main__``), then settles for a function that looks
        the name up again when called. A worker alone in its session has nobody to
        defer to; in a session of threads the others report the missing name.
        """
        ctx = self.ctx
        if ctx.worker_id != 0 or ctx.num_workers == 1:
            return None
        entry = ctx.extra.get("entrypoint")
        if entry and entry != "disco_core.worker" and entry not in self._imported:
            self._imported[entry] = _import_entrypoint(entry)
            fn = registry.get_global_func(name, allow_missing=True)
            if fn is not None:
                return fn
        return _LateBound(name, self._imported.get(entry, "") if entry else "")

    def _debug_set(self, reg: int, value: Any) -> None:
        """``DRef.debug_copy_from``: copy into the register's array, or set a register that holds none."""
        held = self.get_reg(reg)  # never set, freed or failed: an error
        if held is None or not _is_array(held):
            self.regs[reg] = value  # TVM's DiscoWorker::SetRegister assigns a non-array
            return
        if not _is_array(value):
            raise ValueError(
                f"debug_copy_from: register {reg} holds an array "
                f"({as_array(held).dtype}{list(held.shape)}); the value must be an array of "
                f"that shape and dtype, got {type(value).__name__}"
            )
        _copy_into(held, value, "debug_copy_from")

    def _sync_op(self, op: Callable[[], Any]) -> None:
        # Exactly one answer, whatever happens (the controller's waits take answers in
        # order). A worker in the controller's process runs this on the controller's
        # thread, where Ctrl-C may interrupt it: the answer is a failure then, and the
        # interrupt goes on.
        try:
            value = op()
        except BaseException as exc:
            self.send(("fail", self._error(exc)))
            if not isinstance(exc, Exception) or self._interrupts_controller(exc):
                raise
            return
        try:
            self.send(("reply", value))
        except BaseException as exc:  # e.g. a value that cannot be pickled
            self.send(("fail", self._error(exc, "sending the reply")))
            # An interrupt goes on, also a handler's: taken for the reply's own failure,
            # a fence's token was answered by a failure, and the controller, waiting
            # for that token, waited for ever (outside check). Going on, it is seen by
            # the wait, which drops this command's answers (a new fence), whatever went.
            if not isinstance(exc, Exception) or self._interrupts_controller(exc):
                raise

    def _interrupts_controller(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the program's signal handler's, raised while this worker ran
        on the controller's thread (a worker of the controller's process never runs
        :meth:`run`): the program's own exception, which goes on. In a worker process it
        is the command's failure (its function's own timeout, say)."""
        return not self._thread and _interrupts.raised_by_signal_handler(exc)

    def _error(self, exc: BaseException, where: str = "", tb: bool = True) -> WorkerError:
        typ = type(exc)
        name = (
            typ.__qualname__
            if typ.__module__ in ("builtins", "disco_core.errors")
            else f"{typ.__module__}.{typ.__qualname__}"
        )
        text = traceback.format_exc() if tb else ""
        msg = str(exc) if not where else f"{exc} (in {where})"
        return WorkerError(self.ctx.worker_id, name, msg, text)

    def _report(self, exc: BaseException, where: str, tb: bool = True) -> None:
        self.send(("error", self._error(exc, where, tb)))

    def close(self) -> None:
        self.regs.clear()  # first: arrays a CCL handed out are gone before it closes
        ccl, self.ctx.ccl = self.ctx.ccl, None
        if ccl is not None:
            try:
                ccl.close()
            except Exception:  # shutting down: nothing to report to
                pass


def _nothing() -> None:
    return None


def _no_stream() -> tuple:
    raise DiscoError("this worker reads no command stream of its own (Worker.run)")


def _raiser(exc: BaseException) -> Callable[[], tuple]:
    def again() -> tuple:
        raise exc

    return again


def _is_array(value: Any) -> bool:
    """NumPy, CuPy, or anything else with ``__dlpack__`` (torch tensors)."""
    return isinstance(value, np.ndarray) or hasattr(value, "__dlpack__")


def _import_entrypoint(module: str) -> str:
    """Import a session's entrypoint module in worker 0's process; why it failed, or ""."""
    try:
        importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # SystemExit: a main() run outside __main__
        return (
            f"importing the session's entrypoint module {module!r} there failed "
            f"({type(exc).__name__}: {exc}); a main() call belongs under "
            "if __name__ == '__main__'"
        )
    return ""


class _LateBound:
    """Worker 0's stand-in for a global function that only other workers had when asked.

    It looks the name up again when called, so a function registered in the
    controller's process later (an import) still runs.
    """

    __slots__ = ("name", "note")

    def __init__(self, name: str, note: str) -> None:
        self.name, self.note = name, note

    def __call__(self, *args: Any) -> Any:
        fn = registry.get_global_func(self.name, allow_missing=True)
        if fn is None:
            note = f"; {self.note}" if self.note else ""
            raise ValueError(
                f"{registry.missing_message(self.name)} (looked up by worker 0, which runs in "
                "the controller's process; where the other workers have it, register it in "
                f"the controller too, e.g. import the module that defines it there{note})"
            )
        return fn(*args)

    def __repr__(self) -> str:
        return f"<global function {self.name!r}, looked up when called>"


def _same_dtype(a: Any, b: Any) -> bool:
    """The same dtype, or (two NumPy arrays) the same but for the byte order."""
    if a.dtype == b.dtype:
        return True
    return (
        isinstance(a, np.ndarray)
        and isinstance(b, np.ndarray)
        and a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=")
    )


def _copy_into(dst: Any, src: Any, what: str) -> None:
    dst_arr, src_arr = as_array(dst), as_array(src)
    # As TVM's Tensor::CopyFrom, the data is copied whatever the shapes, when it fits
    # exactly (TVM's own tests copy a flat array into a (3, 3, 2) one); the elements
    # are taken in C order. Unlike TVM, the dtypes must match (TVM copies the bytes),
    # up to the byte order of host arrays (a worker's are native; NumPy swaps them).
    if dst_arr.size != src_arr.size or not _same_dtype(dst_arr, src_arr):
        raise ValueError(
            f"{what}: shape/dtype mismatch: destination is {dst_arr.dtype}{list(dst_arr.shape)}, "
            f"source is {src_arr.dtype}{list(src_arr.shape)} (the dtype and the number of "
            "elements must match)"
        )
    if src_arr.shape != dst_arr.shape:
        src_arr = src_arr.reshape(dst_arr.shape)
    if isinstance(dst_arr, np.ndarray) and isinstance(src_arr, np.ndarray):
        np.copyto(dst_arr, src_arr)
    elif isinstance(dst_arr, np.ndarray):
        src_arr.get(out=dst_arr)  # device -> host straight into the host array
    else:
        dst_arr.set(src_arr) if isinstance(src_arr, np.ndarray) else dst_arr.__setitem__(
            Ellipsis, src_arr
        )


# ------------------------------------------------------------------ process entry point
def _watch_parent(parent: int) -> None:
    # The command pipe's EOF ends an idle worker; this ends a busy one whose controller
    # was killed (no child may outlive its session).
    import time

    while True:
        time.sleep(0.25)
        if os.getppid() != parent:
            os._exit(3)


def _replies_lost(exc: OSError) -> None:
    # The controller closed this worker's reply link (it shut down, or gave the worker
    # up): nothing this worker does can reach it again. Its commands may come another
    # way, from a source that never ends them (a socket node's agent, frozen for good).
    logger.info("worker exiting: its reply link to the controller is gone (%s)", exc)
    os._exit(3)


class HeartbeatSender:
    """The worker's one way to the controller: serialised messages, and a heartbeat.

    Every message goes out under one lock. A daemon thread sends ``("alive",
    None)`` whenever nothing else went out for ``interval`` seconds, so the
    controller can tell a busy worker (its heartbeat thread still runs) from a
    stopped or frozen one (``DISCO_LIVENESS_TIMEOUT``). The thread never waits
    for the lock: a message being written is a sign of life already.

    Parameters
    ----------
    send : callable
        ``send(message)`` writes one message to the controller.
    interval : float, optional
        Default: a fifth of ``$DISCO_LIVENESS_TIMEOUT`` (10 s), at most 1 s.
    on_lost : callable, optional
        ``on_lost(exc)`` is called from the heartbeat thread when a heartbeat cannot be
        written (an ``OSError``: the controller closed its end), and the beats stop.
        For a worker whose commands come another way than its replies go (a socket
        node's worker, fed through its agent): nothing else would tell it that the
        controller is gone while the commands' source is frozen. Default: the beats
        just stop (the command loop sees the loss itself).
    """

    def __init__(
        self,
        send: Callable[[tuple], None],
        interval: float | None = None,
        on_lost: Callable[[OSError], None] | None = None,
    ) -> None:
        if interval is None:
            try:
                timeout = float(os.environ.get("DISCO_LIVENESS_TIMEOUT", "") or 10.0)
            except ValueError:
                timeout = 10.0
            interval = min(1.0, timeout / 5) if timeout > 0 else 1.0
        self.interval = max(0.05, float(interval))
        self._send = send
        self._on_lost = on_lost
        self.lock = threading.Lock()
        self.last = time.monotonic()

    def __call__(self, msg: tuple) -> None:
        with self.lock:
            self._send(msg)
            self.last = time.monotonic()

    def start(self) -> HeartbeatSender:
        """Send the first heartbeat now (it tells the controller to expect them), then beat."""
        self(("alive", None))
        threading.Thread(target=self._beat, name="disco-heartbeat", daemon=True).start()
        return self

    def _beat(self) -> None:
        interval, lock = self.interval, self.lock
        while True:
            # due one interval after the last message, so no gap is longer than that
            time.sleep(max(0.01, self.last + interval - time.monotonic()))
            if time.monotonic() - self.last < interval or not lock.acquire(blocking=False):
                continue
            lost: OSError | None = None
            try:
                self._send(("alive", None))
                self.last = time.monotonic()
                continue
            except OSError as exc:  # the link is gone
                lost = exc
            except Exception:  # (a link closed under it: the command loop sees it)
                pass
            finally:
                lock.release()
            if lost is not None and self._on_lost is not None:
                self._on_lost(lost)
            return


def _sealed_sender(
    reply_fd: int, key_fd: int, encoder: Callable[[Any], P.Frame] = encode_for_network
) -> Callable[[tuple], None]:
    """``send(msg)`` that writes each reply frame to ``reply_fd`` as one sealed record.

    The key (64 bytes, the sending half of a handshake's
    :class:`~disco_core.net.security.SessionKeys`) is read from the pipe
    ``key_fd``, which is then closed: it never appears on a command line.
    """
    from ..net.io import PipeTransport
    from ..net.protect import SealedTransport
    from ..net.security import SessionKeys

    key = b""
    while len(key) < 64:
        chunk = os.read(key_fd, 64 - len(key))
        if not chunk:
            raise SystemExit("disco worker: --reply-key-fd held fewer than 64 bytes")
        key += chunk
    os.close(key_fd)
    # Only the sending half is used: nothing is read from the reply connection.
    sealed = SealedTransport(PipeTransport(reply_fd, reply_fd), SessionKeys(send=key, recv=key))

    def send(msg: tuple) -> None:
        frame = encoder(msg)
        sealed.send_parts([P.frame_head(frame), *frame[1]])

    return send


def command_stream(reader: FrameReader, untrusted: bool = False) -> Iterator[tuple]:
    """The commands in the frames ``reader`` reads, batches unpacked, in order.

    ``untrusted``: the frames crossed a socket on their way here (a node agent
    relayed them, or they come straight from one), so they are rebuilt with
    :func:`~disco_core.wire_values.decode_untrusted`, which unpickles nothing.
    """
    load = decode_untrusted if untrusted else decode
    while True:
        header, buffers, flags = reader.read()
        if flags & FLAG_BATCH:
            yield from load(header, buffers)
        else:
            yield load(header, buffers)


def main(argv: list[str] | None = None) -> None:
    """Run a worker process: ``python -m disco_core.worker --worker-id 1 ...``.

    Normally started by :class:`~disco_core.ProcessSession`. A custom ``entrypoint``
    module may do its own set-up and then call this function.
    """
    p = argparse.ArgumentParser(prog="python -m disco_core.worker", description=main.__doc__)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--num-workers", type=int, required=True)
    p.add_argument("--num-groups", type=int, default=1)
    p.add_argument("--cmd-fd", type=int, required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument(
        "--untrusted",
        action="store_true",
        help="commands cross a socket: they and the replies are in the tagged network "
        "format (disco_core.wire_values), never pickles",
    )
    p.add_argument(
        "--reply-key-fd",
        type=int,
        default=None,
        help="a pipe holding the 64-byte key to seal every reply with "
        "(disco_core.net.protect): replies cross a socket that must carry nothing unsealed",
    )
    args = p.parse_args(argv)
    global _IN_WORKER_PROCESS
    _IN_WORKER_PROCESS = True

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    configure_from_env()  # silent unless the controller's user asked for a log level
    extra_path = os.environ.get("DISCO_SYS_PATH")
    if extra_path:
        sys.path[:0] = [p for p in extra_path.split(os.pathsep) if p not in sys.path]
    threading.Thread(
        target=_watch_parent, args=(os.getppid(),), daemon=True, name="disco-parent-watch"
    ).start()

    reply_fd = args.reply_fd
    # replies to a controller behind a socket are never pickles: it unpickles nothing
    network = args.untrusted or args.reply_key_fd is not None
    encoder = encode_for_network if network else encode
    send: Callable[[tuple], None]
    if args.reply_key_fd is None:

        def send(msg: tuple) -> None:
            write_frame(reply_fd, encoder(msg))

    else:
        send = _sealed_sender(reply_fd, args.reply_key_fd, encoder)

    send = HeartbeatSender(send, on_lost=_replies_lost)
    worker = Worker(args.worker_id, args.num_workers, args.num_groups, send)
    reader = FrameReader(args.cmd_fd, read=reader_of(args.cmd_fd, spin_seconds()))
    try:
        send.start()  # the first heartbeat goes before "ready": the controller knows to expect them
        send(("ready", os.getpid()))
    except ConnectionError as exc:  # the controller went away while this worker started
        _replies_lost(exc)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    logger.info(
        "worker %d of %d started (pid %d, module %s)",
        args.worker_id, args.num_workers, os.getpid(),
        spec.name.removesuffix(".__main__") if spec is not None else sys.argv[0],
    )  # fmt: skip

    why = "shutdown command"
    try:
        worker.run(command_stream(reader, args.untrusted).__next__)
    except EOFError:
        why = "its controller is gone (end of the command pipe)"
        worker.close()
    except UntrustedValueError as exc:  # (a ConnectionError too: caught first)
        # A command it cannot read cannot be skipped (a later one may use the register
        # it would have set). The controller refuses such values before they leave
        # (check_untrusted), so this is a peer that did not: say what, not "the reply
        # link is gone", which the ConnectionError below would have said.
        print(f"disco worker {args.worker_id}: exiting: a command from the controller could "
              f"not be read: {exc}", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(3)
    except ConnectionError as exc:  # a reply or report that could not be written
        _replies_lost(exc)
    logger.info("worker %d exiting: %s", args.worker_id, why)
    os._exit(0)
