"""Tracing on a worker: what ``disco.trace_start`` / ``disco.trace_stop`` do there.

Nothing here runs while tracing is off. Starting a trace puts two recorders on
the :class:`~disco_core.worker.Worker` instance, which its ``execute`` calls
(``_record_call`` after a ``call_packed``, ``_record_other`` around any other
command; untraced, they are the class's None: one attribute read a command), recording
operations on its CCL instance (:mod:`~disco_core.tracing.ccl_hooks`), and a
:class:`~disco_core.tracing.recorder.Recorder` in ``ctx.tracer``, which the CCL's
operation wrapper (``disco_core.ccl.base``) looks at once per collective (an
operation the hooks leave to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import protocol as P
from . import ccl_hooks
from .recorder import K_COMMAND, K_COPY, K_MODULE, CommandRing, Recorder, now

__all__ = ["start", "stop", "hook_ccl", "ACTION_NAMES", "MODULE_FUNCTIONS"]

_CALL_PACKED, _KILL_REG = P.CALL_PACKED, P.KILL_REG  # module globals: the hot path's tests

#: The names of the actions other than call_packed, as the trace shows them.
ACTION_NAMES = {
    P.SHUTDOWN: "shutdown",
    P.KILL_REG: "kill_registers",
    P.GET_GLOBAL_FUNC: "get_global_func",
    P.SYNC_WORKER: "sync_worker",
    P.COPY_FROM_WORKER0: "copy_from_worker_0",
    P.COPY_TO_WORKER0: "copy_to_worker_0",
    P.DEBUG_GET_FROM_REMOTE: "debug_get_from_remote",
    P.DEBUG_SET_REGISTER: "debug_set_register",
    P.STORE_REPLY: "store_reply",
}
#: Global functions whose commands are module loads (``cat: "module"``).
MODULE_FUNCTIONS = frozenset(
    {
        "disco.import_python_module",
        "runtime.disco._import_python_module",
        "disco.load_module",
        "runtime.disco.load_module",
        "disco.load_vm_module",
        "runtime.disco.load_vm_module",
    }
)


def start(ctx: Any, capacity: int) -> None:
    """Start recording on the worker of ``ctx`` (a new trace replaces an unfinished one)."""
    stop(ctx)
    rec = Recorder(capacity)
    ctx.tracer = rec
    hook_ccl(ctx)
    worker = ctx.worker
    if worker is not None:
        worker._record_call, worker._record_other = _recorders(worker, rec)


def hook_ccl(ctx: Any) -> None:
    """Record the operations of the worker's CCL through hooks on it (``ccl_hooks``),
    if a trace runs; called when the trace starts and when a CCL is made."""
    rec = ctx.tracer
    if rec is not None and ctx.ccl is not None and (rec.hooked is None or rec.hooked[0] is not ctx.ccl):  # fmt: skip
        rec.hooked = (ctx.ccl, ccl_hooks.install(ctx.ccl, rec))


def stop(ctx: Any) -> dict[str, Any] | None:
    """Stop recording; return the events (:meth:`Recorder.export`), or None if none ran.

    The recorder is let go last: a stop cut short (Ctrl-C in worker 0's, which runs on
    the controller's thread) leaves it in place, and the controller runs the stop
    again to read it (``session_trace``).
    """
    rec = ctx.tracer
    worker = ctx.worker
    if worker is not None:  # the class's None again
        worker.__dict__.pop("_record_call", None)
        worker.__dict__.pop("_record_other", None)
    if rec is None:
        return None
    if rec.hooked is not None:
        ccl_hooks.uninstall(*rec.hooked)
    out = rec.export()
    out["worker"] = ctx.worker_id
    ctx.tracer = None
    return out


def _recorders(worker: Any, rec: Recorder) -> tuple[Callable[[int, int, int], None], Callable[[tuple], bool]]:  # fmt: skip
    """``worker._record_call`` and ``worker._record_other``: each records one command
    (the recorder's add() inlined: this runs once per command)."""
    execute_other = type(worker)._execute_other
    names: dict[int, str] = worker._names
    intern = rec.intern
    commands = rec.commands = CommandRing(rec.capacity)
    ring, step, size, pack = commands.writer()
    clock = now
    action_ids = {a: intern(n) for a, n in ACTION_NAMES.items()}
    # func register -> the record's tag (kind | name id << 8), as the worker names it
    # (``Worker._names``, which only get_global_func changes: its register is
    # forgotten here then)
    tags: dict[int, int] = {}
    offset = 0  # where the next record goes in the ring
    others = 0  # commands other than call_packed so far: a call's seq is index - others
    commands.track(lambda: offset)
    lap = commands.lap

    regs: dict[int, Any] = worker.regs
    held: dict[int, tuple[Any, int]] = {}  # register -> (the function it held, its tag)

    def tag_of(func_reg: int) -> int:
        name = names.get(func_reg)
        if name is None:
            # A function no global name reaches (a loaded module's ``mod["f"]``): named
            # by its own qualified name (it was "register 29": outside check), looked
            # up each time, as its register may be freed and hold another one next
            func = regs.get(func_reg)
            got = held.get(func_reg)
            if got is not None and got[0] is func:
                return got[1]
            qual = getattr(func, "__qualname__", None)
            label = qual if isinstance(qual, str) and qual else f"register {func_reg}"
            tag = K_COMMAND | intern(label[:200]) << 8
            if len(held) < 4096:
                held[func_reg] = (func, tag)
            return tag
        kind = K_MODULE if name in MODULE_FUNCTIONS else K_COMMAND
        tag = tags[func_reg] = kind | intern(name) << 8
        return tag

    def record_call(func_reg: int, reg: int, t0: int) -> None:
        # The hot path of a traced worker, every step counted (a clock read and one
        # six-field pack a command, the start read by ``execute``): no counter but
        # the write offset; the index and seq follow from the record's place.
        nonlocal offset
        t1 = clock()
        tag = tags.get(func_reg)
        if tag is None:
            tag = tag_of(func_reg)
        o = offset
        pack(ring, o, tag, t0, t1, reg, others, _CALL_PACKED)
        o += step
        offset = o if o < size else lap()

    def record_other(cmd: tuple) -> bool:
        nonlocal offset, others
        action = cmd[0]
        if action == _KILL_REG:  # freeing registers rides with most commands: not worth a record
            known = len(names)
            try:
                return execute_other(worker, cmd)
            finally:
                if len(names) != known:  # a function's register was freed (the worker
                    tags.clear()  # forgot its name): what it holds next is named anew
        if action == P.GET_GLOBAL_FUNC:
            tags.pop(cmd[1], None)  # the register names another function from now on
        others += 1
        t0 = clock()
        try:
            return execute_other(worker, cmd)
        finally:
            t1 = clock()
            if action == P.COPY_FROM_WORKER0 or action == P.COPY_TO_WORKER0:
                nbytes = getattr(cmd[2], "nbytes", 0)
                tag, arg = K_COPY | action_ids[action] << 8, int(nbytes)
            else:
                reg = cmd[1] if len(cmd) > 1 else 0
                name_id = action_ids.get(action)
                if name_id is None:
                    name_id = intern(f"action {action}")
                tag, arg = K_COMMAND | name_id << 8, reg if type(reg) is int else 0
            o = offset
            pack(ring, o, tag, t0, t1, arg, -1, action)
            o += step
            offset = o if o < size else lap()

    return record_call, record_other
