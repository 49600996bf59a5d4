"""The command protocol: TVM's nine actions, value (de)serialisation and framing.

Commands are plain tuples ``(action, *fields)``. In-process workers receive them as
Python objects (after :func:`isolate` gives each worker its own copy of mutable
values); workers in other processes receive them as frames: a header plus its
out-of-band buffers, written straight from the array's memory to the file
descriptor and read straight into the receiving array's memory, so large arrays
are never copied on the way. Over a pipe from a process this one started, the
header is a pickle (protocol 5; :func:`encode`, :func:`decode`); over a network
link it is :mod:`disco_core.wire_values`' tagged format, and nothing is unpickled.

Frame layout on a byte stream (all little endian)::

    u64 header_len | u32 num_buffers | u32 flags | u64 buffer_len * num_buffers
    header (pickle or tagged) | buffer 0 | buffer 1 | ...
"""

from __future__ import annotations

import collections
import contextvars
import copyreg
import enum
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import DiscoTypeError, DiscoValueError
from .net.framing import FrameReader, read_frame
from .net.framing import frame_head as _frame_head
from .net.io import write_all

__all__ = [
    "Action",
    "RegRef",
    "Frame",
    "encode",
    "decode",
    "isolate",
    "write_frame",
    "read_frame",
    "FrameReader",
    "OOB_THRESHOLD",
    "FLAG_BATCH",
    "frame_head",
    "write_all",
    "register_ref_type",
    "isolate_command",
]

#: Buffers at least this large travel out of band (never copied into the pickle).
OOB_THRESHOLD = 4096


class Action(enum.IntEnum):
    """TVM's ``DiscoAction`` codes, in TVM's order."""

    SHUTDOWN = 0
    KILL_REG = 1
    GET_GLOBAL_FUNC = 2
    CALL_PACKED = 3
    SYNC_WORKER = 4
    COPY_FROM_WORKER0 = 5
    COPY_TO_WORKER0 = 6
    DEBUG_GET_FROM_REMOTE = 7
    DEBUG_SET_REGISTER = 8


# Plain ints for the hot path (an IntEnum is slower to compare and to pickle).
#: ``(SYNC_WORKER, worker_id)`` is TVM's; ``(SYNC_WORKER, worker_id, token)`` (token: a
#: ``bytes``) is a fence: the worker answers ``token`` at once, and the controller drops
#: every answer of that worker that comes before it (``ReplyHub``).
SHUTDOWN, KILL_REG, GET_GLOBAL_FUNC, CALL_PACKED, SYNC_WORKER = 0, 1, 2, 3, 4
COPY_FROM_WORKER0, COPY_TO_WORKER0, DEBUG_GET_FROM_REMOTE, DEBUG_SET_REGISTER = 5, 6, 7, 8
#: Not TVM's (so not an :class:`Action`): the controller's answer to a worker's
#: rendezvous store request, ``(STORE_REPLY, seq, ok, value)`` (``disco_core.store``),
#: sent to that worker only. Far from TVM's codes, so that a new one of TVM's fits.
STORE_REPLY = 16


class RegRef:
    """A register named inside a command; the worker replaces it by the register's value."""

    __slots__ = ("reg_id",)

    def __init__(self, reg_id: int) -> None:
        self.reg_id = reg_id

    def __repr__(self) -> str:
        return f"RegRef({self.reg_id})"

    def __reduce__(self):
        return (RegRef, (self.reg_id,))


Frame = tuple[bytes, list]  # (header, out-of-band buffers)


#: Handle types (DRef and subclasses) pickled as the register they name.
_REF_TYPES: set[type] = set()
_DISPATCH = collections.ChainMap({}, copyreg.dispatch_table)

#: ``flags`` bit of a frame holding a tuple of commands rather than one.
FLAG_BATCH = 1


#: The session whose command is being encoded (``Outgoing(..., owner=)``). A handle of
#: another session nested in an argument is refused; let through, its register number
#: read whatever this session held under it (outside check).
SENDER: contextvars.ContextVar[Any] = contextvars.ContextVar("disco_sender", default=None)


def _check_owner(obj: Any) -> None:
    owner = SENDER.get()
    if owner is not None and getattr(obj, "session", owner) is not owner:
        raise DiscoValueError(f"{obj!r}, inside an argument, belongs to another session")


def _reduce_ref(obj: Any):
    _check_owner(obj)
    return (RegRef, (obj.reg_id,))


def register_ref_type(cls: type) -> type:
    """Make ``cls`` (a handle with ``reg_id``) travel as a :class:`RegRef`."""
    _REF_TYPES.add(cls)
    _SHARED_TYPES.add(cls)
    _DISPATCH.maps[0][cls] = _reduce_ref
    return cls


class _WorkerPickler(pickle.Pickler):
    """A pickler that refuses what a worker process cannot rebuild: anything of the
    controller's ``__main__`` (a class or function defined in the script), which a
    worker process, whose ``__main__`` is its entrypoint, does not have. Unchecked,
    the worker failed to read the command and ended, and the session with it.

    ``reducer_override`` is not asked about ints, strs, tuples, lists and dicts: the
    common values cost nothing more.
    """

    def reducer_override(self, obj: Any) -> Any:
        named = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)  # fmt: skip
        if getattr(named, "__module__", None) == "__main__":
            raise DiscoTypeError(
                f"cannot send {named.__qualname__} (defined in the script, __main__) to a "
                "worker process: worker processes do not run the script; define it in a "
                "module that they import (import_python_module, or on their sys.path)"
            )
        return NotImplemented


def encode(obj: Any, *, for_worker_process: bool = False) -> Frame:
    """Serialise ``obj``; handles become :class:`RegRef`; large buffers stay out of band.

    ``for_worker_process``: refuse (``DiscoTypeError``) a value that names the
    controller's ``__main__``, which a worker process cannot rebuild.
    """
    buffers: list = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        m = pb.raw()
        if m.nbytes < OOB_THRESHOLD:
            return True  # small: in band
        buffers.append(m)
        return False

    f = io.BytesIO()
    pickler = _WorkerPickler if for_worker_process else pickle.Pickler
    p = pickler(f, protocol=5, buffer_callback=keep)
    p.dispatch_table = _DISPATCH  # consulted only for non-builtin types: ints and tuples stay fast
    p.dump(obj)
    return f.getvalue(), buffers


def decode(header: bytes | bytearray | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Inverse of :func:`encode`; out-of-band buffers become the arrays' memory.

    Only for frames from a process this one started itself over a pipe (the
    process channel). A frame that crosses a socket is never a pickle: it is
    encoded by :func:`disco_core.wire_values.encode_for_network` and rebuilt by
    :func:`disco_core.wire_values.decode_untrusted`.
    """
    return pickle.loads(header, buffers=buffers)


_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), np.dtype, np.generic, RegRef)


_SHARED_TYPES = {int, float, complex, bool, str, bytes, type(None), RegRef}


def isolate_command(cmd: tuple) -> tuple:
    """:func:`isolate` the values of a command (the other fields are ints and strs)."""
    action = cmd[0]
    if action == CALL_PACKED:
        shared = _SHARED_TYPES
        for v in cmd[3]:
            if type(v) not in shared:
                return (action, cmd[1], cmd[2], isolate(cmd[3]))
        return cmd
    if action == DEBUG_SET_REGISTER:
        return (action, cmd[1], cmd[2], isolate(cmd[3]))
    return cmd


def isolate(value: Any) -> Any:
    """Give an in-process worker its own copy of ``value``, as a pipe would.

    Immutable values are shared; arrays are copied; DRefs become :class:`RegRef`.
    Anything else goes through a pickle round trip, so that in-process and
    out-of-process workers accept and reject the same values.
    """
    t = type(value)
    if t in _IMMUTABLE or isinstance(value, _IMMUTABLE):
        return value
    if t is tuple:
        return tuple([isolate(v) for v in value])
    if t is list:
        return [isolate(v) for v in value]
    if t in _REF_TYPES:
        _check_owner(value)
        return value  # handles are resolved by the worker, like RegRef
    if t is np.ndarray:
        return value.copy()
    if getattr(t, "__module__", "").startswith("disco_core.device"):
        return value
    if t is dict:
        return {isolate(k): isolate(v) for k, v in value.items()}
    return decode(*encode(value))


# --------------------------------------------------------------------------- framing
def frame_head(frame: Frame, flags: int = 0) -> bytes:
    """The bytes of a frame before its out-of-band buffers (prefix, lengths, header)."""
    return _frame_head(frame[0], frame[1], flags)


def write_frame(fd: int, frame: Frame, flags: int = 0) -> None:
    """Write one frame to a blocking file descriptor; buffers are written in place."""
    write_all(fd, frame_head(frame, flags))
    for m in frame[1]:
        write_all(fd, m)


def describe_command(cmd: tuple, func_name: Callable[[int], str] | None = None) -> str:
    """A short human description of a command, for error messages.

    Never a store answer's value (a rendezvous secret): ``<N bytes>`` stands for it.
    """
    if cmd[0] == STORE_REPLY:
        value = cmd[3] if len(cmd) > 3 else None
        shown = f"<{len(value)} bytes>" if isinstance(value, bytes) else type(value).__name__
        return f"store_reply(seq={cmd[1]!r}, ok={cmd[2]!r}, {shown})"
    action = Action(cmd[0])
    if action is Action.CALL_PACKED and func_name is not None:
        return f"call_packed({func_name(cmd[2])})"
    return action.name.lower()
