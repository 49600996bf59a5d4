"""The client side: sessions, remote functions, modules, devices and tensors."""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import secrets
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from disco_core import (
    DiscoFileNotFoundError,
    DiscoPermissionError,
    DiscoTypeError,
    DiscoValueError,
    FrameLimitError,
    IntegrityError,
)
from disco_core.spi import (
    Device,
    as_dtype,
    as_shape,
    may_poll_beside,
    placement,
    to_host,
    unfilled_bytearray,
)
from disco_core.spi import interrupts as _interrupts

from . import handler, protocol, service, wire
from .auth import open_conn
from .errors import (
    ProtocolError,
    RPCAttributeError,
    RPCError,
    RPCSessionTimeoutError,
    StreamAbortedError,
    TransferError,
)
from .handler import SessionHandler
from .popen import PipeChild
from .protocol import (
    BEATS_ALWAYS,
    BEATS_IDLE,
    BEATS_NONE,
    ERROR,
    OP_CALL,
    OP_DEV_EXIST,
    OP_DEV_SYNC,
    OP_DOWNLOAD,
    OP_EMPTY,
    OP_GET_FUNC,
    OP_INIT,
    OP_LINK,
    OP_LISTDIR,
    OP_LOAD_MODULE,
    OP_MOD_FUNC,
    OP_NAMES,
    OP_PING,
    OP_REMOVE,
    OP_SYSTEM_LIB,
    OP_TENSOR,
    OP_TENSOR_GET,
    OP_TENSOR_SET,
    OP_UPLOAD,
    OP_UPLOAD_CHECK,
    REPLY,
    REQUEST,
)
from .wire import FileSource, HandleRef

__all__ = [
    "BenchmarkResult",
    "RPCSession",
    "LocalSession",
    "PopenSession",
    "RemoteFunction",
    "RemoteModule",
    "RemoteTensor",
    "RemoteDevice",
    "RemoteObject",
    "connect",
    "tensor",
    "empty",
]

logger = logging.getLogger("disco_rpc.client")
Progress = Callable[[int, int], Any]
#: Uploads larger than this (bytes, one chunk) first ask the server whether it accepts
#: the target (``OP_UPLOAD_CHECK``): a refusal then costs one round trip, not the whole
#: body, and the round trip is under 1 % of sending more than a chunk. Smaller ones go
#: at once: a refused one costs at most a chunk.
CHECK_UPLOADS_ABOVE = protocol.CHUNK
_PLAIN = (int, float, str, bool, bytes, type(None), complex)


# --------------------------------------------------------------------------- remote objects
class RemoteObject:
    """An object that lives on the server; freed there when the last local reference goes."""

    __slots__ = ("_rpc_sess", "_rpc_ref", "__weakref__")

    def __init__(self, sess: RPCSession, ref: HandleRef) -> None:
        # the handle first: an __init__ cut by a signal handler's exception between the
        # two leaves nothing for __del__ to free (the handle goes with the session)
        self._rpc_ref = HandleRef(ref.kind, ref.hid)
        self._rpc_sess = sess

    def __del__(self) -> None:
        sess = getattr(self, "_rpc_sess", None)
        if sess is not None:
            sess._frees.append(self._rpc_ref.hid)

    def __repr__(self) -> str:
        return f"<remote object #{self._rpc_ref.hid}>"


class RemoteFunction(RemoteObject):
    """A function on the server; calling it runs it there and returns its result."""

    __slots__ = ("name",)

    def __init__(self, sess: RPCSession, ref: HandleRef, name: str = "") -> None:
        super().__init__(sess, ref)
        self.name = name or str(ref.info or "")

    def __call__(self, *args: Any) -> Any:
        return self._rpc_sess._request(OP_CALL, self, args)

    def __repr__(self) -> str:
        return f"<RemoteFunction {self.name}>"


class RemoteModule(RemoteObject):
    """A module loaded on the server; ``module["fn"]`` is a :class:`RemoteFunction`."""

    __slots__ = ("type_key",)

    def __init__(self, sess: RPCSession, ref: HandleRef) -> None:
        super().__init__(sess, ref)
        self.type_key = str(ref.info or "")

    def get_function(self, name: str, restype: str | None = None) -> RemoteFunction:
        """Look up a function; ``restype`` sets a C function's result type (shared libraries).

        Raises
        ------
        RPCAttributeError
            The module has no function ``name`` (an :class:`RPCError` and, as in
            TVM, an ``AttributeError``).
        """
        if not isinstance(name, str):
            raise DiscoTypeError(f"get_function: name must be a str, got {type(name).__name__} {name!r}")  # fmt: skip
        try:
            fn = _expect(
                self._rpc_sess._request(OP_MOD_FUNC, self, name, restype),
                RemoteFunction,
                f"get_function({name!r})",
            )
        except RPCError as exc:
            if not exc.exc_type.endswith("KeyError"):
                raise
            # TVM's message (tvm_ffi.Module.get_function), then the server's reason
            err = RPCAttributeError(
                f"Module has no function '{name}' (remote {exc.exc_type}: {exc.remote_message})"
            )
            err.exc_type, err.remote_traceback = exc.exc_type, exc.remote_traceback
            raise err from None
        fn.name = name
        return fn

    def __getitem__(self, name: str) -> RemoteFunction:
        return self.get_function(name)

    def time_evaluator(self, func_name: str, dev: Any, number: int = 10, repeat: int = 1, min_repeat_ms: float = 0, limit_zero_time_iterations: int = 100, cooldown_interval_ms: float = 0, repeats_to_cooldown: int = 1, cache_flush_bytes: int = 0, f_preproc: str = "", *, restype: str | None = None) -> Callable[..., BenchmarkResult]:  # fmt: skip
        """A callable that runs ``func_name`` on the server and times it there, as TVM's.

        ``evaluator(*args)`` calls the function once to warm up, then ``repeat``
        times runs it ``number`` times in a row (more when a repeat lasts under
        ``min_repeat_ms``), synchronising ``dev`` after each repeat, and returns a
        :class:`BenchmarkResult` of the per-call seconds of each repeat. A repeat
        whose measured time is exactly zero (a clock too coarse for it) is run
        again with the same ``number``, at most ``limit_zero_time_iterations``
        times, as TVM's. ``f_preproc`` names a global function of the server,
        called with the same arguments before each repeat (TVM's
        ``"cache_flush_cpu_non_first_arg"`` evicts the arrays after the first
        from the CPU caches); ``cache_flush_bytes`` copies an array of that size on
        ``dev`` before each timed run. Arguments are sent once; remote tensors are
        passed by reference. ``restype`` sets the result type of a C function
        (shared libraries and ``system_lib()``).

        Raises
        ------
        RPCError
            ``f_preproc`` names no global function of the server (raised here).
        DiscoValueError
            ``cache_flush_bytes`` is negative.
        """
        try:
            cache_flush_bytes = operator.index(cache_flush_bytes)
        except TypeError:
            raise DiscoTypeError(
                f"time_evaluator: cache_flush_bytes must be an int, got {type(cache_flush_bytes).__name__}"  # fmt: skip
            ) from None
        if cache_flush_bytes < 0:
            raise DiscoValueError(
                f"time_evaluator: cache_flush_bytes must be >= 0, got {cache_flush_bytes}"
            )
        f_preproc = f_preproc or ""
        if not isinstance(f_preproc, str):
            raise DiscoTypeError(
                "time_evaluator: f_preproc must be the name of a global function of the "
                f"server (a str), got {type(f_preproc).__name__}"
            )
        sess = self._rpc_sess
        if f_preproc:
            sess.get_function(f_preproc)  # a name the server lacks fails here, as in TVM
        d = Device(dev.device_type, dev.device_id) if dev is not None else None
        module = self
        # sent only when used, so a server of an earlier release still times plain calls
        extra = (int(cache_flush_bytes), f_preproc) if cache_flush_bytes or f_preproc else ()

        def evaluator(*args: Any) -> BenchmarkResult:
            res = sess._request(
                protocol.OP_TIME_EVAL, module, func_name, d, int(number), int(repeat),
                float(min_repeat_ms or 0), int(limit_zero_time_iterations),
                float(cooldown_interval_ms or 0), int(repeats_to_cooldown or 1), restype, args,
                *extra,
            )  # fmt: skip
            return BenchmarkResult(res)

        evaluator.__name__ = f"time_evaluator({func_name})"
        return evaluator

    def __repr__(self) -> str:
        return f"<RemoteModule {self.type_key} #{self._rpc_ref.hid}>"


class BenchmarkResult:
    """Timing results (seconds per call, one per repeat), as ``tvm.runtime.BenchmarkResult``."""

    def __init__(self, results: Any) -> None:
        self.results = tuple(float(r) for r in results)
        arr = np.asarray(self.results, dtype="float64")
        self.mean = float(arr.mean()) if arr.size else float("nan")
        self.median = float(np.median(arr)) if arr.size else float("nan")
        self.min = float(arr.min()) if arr.size else float("nan")
        self.max = float(arr.max()) if arr.size else float("nan")
        self.std = float(arr.std()) if arr.size else float("nan")

    def __repr__(self) -> str:
        return (
            f"BenchmarkResult(min={self.min:.6g}, mean={self.mean:.6g}, "
            f"median={self.median:.6g}, max={self.max:.6g}, std={self.std:.6g}, "
            f"{len(self.results)} repeats)"
        )

    def __str__(self) -> str:
        ms = 1e3
        return (
            "Execution time summary:\n"
            f" mean (ms)   median (ms)    max (ms)     min (ms)     std (ms)\n"
            f" {self.mean * ms:9.4f}   {self.median * ms:9.4f}    {self.max * ms:9.4f}    "
            f"{self.min * ms:9.4f}    {self.std * ms:9.4f}"
        )


def _expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is a ``kind``; an RPCError otherwise (the server answered with a
    value of another kind: a fake server, or bytes altered on a link without a token)."""
    if not isinstance(value, kind):
        wanted = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise RPCError(f"{what}: the server answered with a {type(value).__name__}, not a {wanted}")
    return value


class RemoteDevice(Device):
    """A device of the server (``sess.cpu(0)``); arrays made on it live there."""

    __slots__ = ("_rpc_sess",)

    def __init__(self, sess: RPCSession, device_type: Any, device_id: int | None = None) -> None:
        super().__init__(device_type, device_id)
        self._rpc_sess = sess

    def sync(self) -> None:
        """Wait until the remote device has finished its queued work."""
        self._rpc_sess._request(OP_DEV_SYNC, Device(self.device_type, self.device_id))

    @property
    def exist(self) -> bool:
        """Whether the server has this device."""
        return bool(self._rpc_sess._request(OP_DEV_EXIST, Device(self.device_type, self.device_id)))

    def __repr__(self) -> str:
        # TVM's form: the session's index in this process's session table
        return f"remote[{self._rpc_sess._tbl_index}]:{self.device_type}({self.device_id})"

    __str__ = __repr__


class RemoteTensor(RemoteObject):
    """An array that lives on a remote device; pass it to remote functions by reference."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, sess: RPCSession, ref: HandleRef) -> None:
        super().__init__(sess, ref)
        shape, dtype, dev = ref.info
        self.shape = tuple(shape)
        self.dtype = str(dtype)
        self.device = RemoteDevice(sess, dev.device_type, dev.device_id)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def numpy(self) -> np.ndarray:
        """Copy the contents back into a new NumPy array."""
        return self._rpc_sess._request(OP_TENSOR_GET, self)

    asnumpy = numpy

    def copyfrom(self, source: Any) -> RemoteTensor:
        """Overwrite the contents with ``source`` (an array of the same size and dtype)."""
        arr = np.asarray(to_host(source))
        if arr.dtype != as_dtype(self.dtype):
            try:
                arr = arr.astype(self.dtype)
            except (TypeError, ValueError) as exc:  # an object or string array, say
                raise DiscoTypeError(
                    f"copyfrom: cannot convert a {arr.dtype} array to this tensor's "
                    f"{self.dtype}: {exc}"
                ) from None
        self._rpc_sess._request(OP_TENSOR_SET, self, arr)
        return self

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        return f"<RemoteTensor shape={self.shape} dtype={self.dtype} device={self.device!r}>"


# --------------------------------------------------------------------------- sessions
class _SessionTable:
    """The per-process table of sessions whose index a remote device prints, as TVM's.

    A session takes the lowest free index; its index becomes free again when the
    session object is gone (not when it is closed: its devices may still be printed).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: list[weakref.ref] = []

    def insert(self, sess: RPCSession) -> int:
        with self.lock:
            for i, ref in enumerate(self.slots):
                if ref() is None:
                    self.slots[i] = weakref.ref(sess)
                    return i
            self.slots.append(weakref.ref(sess))
            return len(self.slots) - 1


_SESSIONS = _SessionTable()


#: ``$DISCO_RPC_WATCH_SERVER``: "1" turns on the client's watch of its server (off by default).
WATCH_SERVER_ENV = "DISCO_RPC_WATCH_SERVER"
#: The largest liveness bound taken from a server, in seconds (a day).
MAX_BOUND = 86400.0


def watch_server_enabled() -> bool:
    """Whether new sessions watch their server (``$DISCO_RPC_WATCH_SERVER`` is 1, true, yes or on)."""
    return os.environ.get(WATCH_SERVER_ENV, "").strip().lower() in ("1", "true", "yes", "on")


#: The shortest silence of a watched server that ends a call, in seconds (else 1.5 x its
#: liveness_timeout): README, "Liveness".
QUIET_FLOOR = 3.0


class RPCSession:
    """A session with an RPC server; made by :func:`connect`, :class:`LocalSession`, ...

    Every member follows ``tvm.rpc.RPCSession``. A session is a context manager;
    :meth:`close` ends it (the server then deletes its work folder, unless the
    server keeps a shared ``work_dir``).
    """

    _label = "rpc"

    def __init__(self, conn: wire.Conn | None, session_timeout: float = 0, label: str = "rpc", enable_logging: bool = False) -> None:  # fmt: skip
        self._conn: wire.Conn = conn  # type: ignore[assignment]  # None: a LocalSession, which sends nothing
        self._lock = threading.RLock()
        self._frees: list[int] = []
        self._closed = False
        self._closed_why = ""  # what closed the session, when not close() or the server
        #: False from a request's start until its reply is read whole: a call that an
        #: exception (Ctrl-C, a signal handler's) ended in between may have left a reply
        #: to come, and the next call first puts the connection back in step (_resync)
        self._in_step = True
        self._label = label
        self._timeout = float(session_timeout or 0)
        self._server_timeout = 0.0
        self._start = time.monotonic()
        self._logging = enable_logging
        # weak values: a strong cache would make a cycle (a remote function refers to its
        # session), so a dropped session would stay open, its server busy, until the
        # garbage collector ran (a tracker request for that key waited for ever)
        self._funcs: weakref.WeakValueDictionary[str, RemoteFunction] = (
            weakref.WeakValueDictionary()
        )
        self.info: dict = {}
        self._tbl_index = _SESSIONS.insert(self)  # TVM's name for it
        # liveness: requests are sent under _send_lock, so the heartbeat thread can
        # slip a heartbeat between them (README, "Liveness")
        self._send_lock = threading.Lock()
        self._sends = 0  # requests sent; the heartbeat thread beats when it stands still
        self._beat_seen = -1
        self._beat_every = 0.0  # seconds between heartbeats; 0: none
        self._beat_mutex = threading.Lock()  # a heartbeat being written, or the end of them
        #: the server's side of liveness: a server that sends heartbeats while a call runs
        #: (it promised them in INIT's reply) and sends nothing for this many seconds is
        #: taken for frozen or gone (0: not watched; see _arm_deadline)
        self._quiet = 0.0
        self._busy = False  # a request is under way (the heartbeat thread's deadline check)

    # -- plumbing ---------------------------------------------------------------
    def _wrap(self, ref: HandleRef) -> Any:
        kind = ref.kind
        if kind == HandleRef.TENSOR:
            return RemoteTensor(self, ref)
        if kind == HandleRef.FUNC:
            return RemoteFunction(self, ref)
        if kind == HandleRef.MODULE:
            return RemoteModule(self, ref)
        return RemoteObject(self, ref)

    def _export(self, v: Any) -> HandleRef | None:
        """The handle a remote object travels as; another session's objects are refused."""
        ref = getattr(v, "_rpc_ref", None)
        if ref is None:
            return None
        owner = v._rpc_sess
        if owner is not self:
            # two sessions of one server have one label: "of ... not to ..." said it twice
            theirs, mine = owner._label, self._label
            if theirs == mine:
                theirs, mine = f"{theirs} (another session of that server)", "this one"
            raise DiscoValueError(
                f"{type(v).__name__} #{ref.hid} belongs to the RPC session {theirs}, "
                f"not to {mine}: a remote object can only be passed to functions of "
                "the session that made it (copy it through the client, e.g. .numpy())"
            )
        return ref

    def _request(self, op: int, *args: Any) -> Any:
        return self._exchange(op, args)

    def _exchange(self, op: int, args: tuple, send_stream=None, recv_stream=None) -> Any:
        """Send one request and read its reply.

        ``send_stream(conn)`` sends a file stream after the request (and returns a
        local error to raise once the reply is in); ``recv_stream(conn, value)``
        reads the stream a REPLY announces and returns the result.
        """
        if self._closed:
            why = f": {self._closed_why}" if self._closed_why else ""
            raise RPCError(f"the RPC session {self._label} is closed{why}")
        with self._lock:
            if self._closed:  # again: closed by another thread's call while this one waited
                why = f": {self._closed_why}" if self._closed_why else ""
                raise RPCError(f"the RPC session {self._label} is closed{why}")
            if self._timeout:
                self._arm_deadline(op)
            conn = self._conn
            if not self._in_step:
                self._busy = True
                try:
                    self._resync(conn)
                finally:
                    self._busy = False
            frees: Any = self._frees
            if frees:
                self._frees = []
            else:  # (a collected object's handle may join the list meanwhile: not this call's)
                frees = ()
            try:
                if op == OP_CALL and not frees:  # (the round trip of every remote call)
                    meta, bufs = wire.encode_call(args[0], args[1], self._export)
                else:
                    meta, bufs = wire.encode((tuple(frees), args), self._export)
                conn.check_size(meta, bufs)  # nothing sent yet: the session stays usable
            except BaseException:
                self._frees[:0] = frees
                raise
            t0 = time.perf_counter() if self._logging else 0.0
            local_error = None
            waiting = False  # for the reply
            self._in_step = False  # until the reply is read whole (set last, below)
            self._busy = True
            try:
                with self._send_lock:  # no heartbeat inside a frame or a file stream
                    self._sends += 1
                    conn.send_encoded(REQUEST, op, meta, bufs)
                    if send_stream is not None:
                        local_error = send_stream(conn)
                waiting = True
                kind, _op, value = conn.recv(on_handle=self._wrap)
                if kind == REPLY and recv_stream is not None:
                    value = recv_stream(conn, value)
                waiting = False
            except StreamAbortedError as exc:  # the server's file failed; still in sync
                self._in_step = True
                raise RPCError(f"the server could not send the whole file: {exc}") from None
            except (ProtocolError, EOFError, OSError) as exc:
                if not _interrupts.cut_by_program(exc):
                    self._fail(op, exc, sending=not waiting)
                self._interrupted(op, exc, waiting, recv_stream is not None)
                raise
            except BaseException as exc:  # Ctrl-C, a signal handler's exception
                self._interrupted(op, exc, waiting, recv_stream is not None)
                raise
            finally:
                self._busy = False
            if _op != op:  # (a reply of its own op always comes: _resync saw to that)
                self._out_of_step(
                    f"the reply to a {OP_NAMES.get(op, op)} came as a {OP_NAMES.get(_op, _op)} one"
                )
            self._in_step = True
            if self._logging:
                logger.info(
                    "%s %s: %.1f us", self._label, OP_NAMES.get(op, op),
                    (time.perf_counter() - t0) * 1e6,
                )  # fmt: skip
        if local_error is not None:  # the cause of the server's error, if any
            raise local_error
        if kind == ERROR:
            raise _remote_error(value)
        if kind != REPLY:
            self._fail(op, ProtocolError(f"unexpected frame kind {kind}"))
        return value

    def _interrupted(self, op: int, exc: BaseException, waiting: bool, stream: bool) -> None:
        """An exception of the program's (Ctrl-C, a signal handler's) ended a call.

        While the call waited for its reply or read it, the connection can be put back
        in step: the next call does it first (:meth:`_resync`), so every later call
        still gets its own answer. A request cut in the middle leaves the server's
        side out of step for good, and a download's file stream is not waited out: the
        session is closed, and says why.
        """
        if waiting and not stream:
            return
        where = "reply" if waiting else "request"
        self._closed_why = (
            f"{type(exc).__name__}({str(exc)[:80]!r}) cut the {where} of an RPC "
            f"{OP_NAMES.get(op, op)} in the middle, and the connection could not be kept in "
            "step; connect again"
        )
        self._shutdown_transport()

    def _resync(self, conn: wire.Conn) -> None:
        """Drop what an interrupted call left to come: send a ping with a fresh random
        token, and drop every byte up to its answer.

        Whatever was or was not read before (a reply read whole as the interruption
        came, one cut in the middle, or bytes taken by a read whose count was lost:
        Python runs a signal handler as a C call returns, before its result is
        stored), the token's answer ends what is owed, so nothing is waited for that
        may never come and no earlier reply is taken for a later call's. The bytes are
        searched for that answer, not read as frames: a stream that goes on from the
        middle of a frame could read as a plausible head and wait for good (outside
        check, with a crafted payload). Handles in the replies dropped are not freed
        until the session ends. Interrupted itself, it starts over with a new token at
        the next call.
        """
        token = os.urandom(16)
        meta, bufs = wire.encode(((), (token,)), None)
        answer, _ = wire.encode(token, None)  # the server's echo, byte for byte (no buffers)
        marker = bytes(protocol.FRAME_HEAD.pack(REPLY, OP_PING, 0, len(answer), 0)) + bytes(answer)
        try:
            with self._send_lock:
                self._sends += 1
                conn.send_encoded(REQUEST, OP_PING, meta, bufs)
        except BaseException as exc:
            if isinstance(exc, (EOFError, OSError)) and not _interrupts.cut_by_program(exc):  # fmt: skip
                self._fail(OP_PING, exc)
            self._interrupted(OP_PING, exc, False, False)
            raise
        deadline = self._start + self._timeout + 0.5 if self._timeout else None
        try:
            conn.drop_through(marker, conn.max + (1 << 20), deadline)
        except (IntegrityError, FrameLimitError) as exc:
            # a sealed link's records out of step (a lost count inside the record layer,
            # say): nothing that follows can be trusted
            self._out_of_step(f"{type(exc).__name__}: {exc}")
        except (EOFError, OSError) as exc:
            if not _interrupts.cut_by_program(exc):
                self._fail(OP_PING, exc)
            raise  # (cut by the program: the next call starts over, with a new token)
        self._in_step = True

    def _out_of_step(self, what: str) -> NoReturn:
        self._closed_why = (
            f"after an interrupted call the connection was out of step ({what}); connect again"
        )
        self._shutdown_transport()
        raise RPCError(f"the RPC session {self._label} is closed: {self._closed_why}")

    def _arm_deadline(self, op: int) -> None:
        """Bound this request's waits: each read or write that waits for the server
        gives up after ``_quiet`` seconds (a watched server sends heartbeats while a
        call runs), and none outlasts ``session_timeout`` (with half a second for the
        server's own end of the session to arrive first). A wait given up raises a
        ``TimeoutError`` (``BlockingIOError`` from the kernel's) that :meth:`_fail` explains. The heartbeat thread also ends
        a call whose session outlived its ``session_timeout`` by a second: a peer
        that trickles bytes never lets a single wait run out.
        """
        if not self._timeout:
            return  # (the kernel bounds each wait by _quiet: limit_waits in _init)
        left = self._timeout - (time.monotonic() - self._start)
        if left <= 0:
            self._fail(op, TimeoutError("deadline passed"))
        self._conn.t.settimeout(min(left + 0.5, self._quiet) if self._quiet else left + 0.5)

    def _check_deadline(self) -> None:
        """End a call still running a second past ``session_timeout`` (the heartbeat thread).

        The socket is shut down; the call's wait ends at once and raises
        :class:`RPCSessionTimeoutError`.
        """
        if not self._timeout or not self._busy or self._closed:
            return
        over = time.monotonic() - self._start - self._timeout
        if over < 1.0:
            return
        logger.warning(
            "ending the RPC session %s: a call ran %.1f s past its session_timeout of %g s",
            self._label, over, self._timeout,
        )  # fmt: skip
        try:
            self._conn.t.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass

    def _fail(self, op: int, exc: BaseException, sending: bool = False):
        elapsed = time.monotonic() - self._start
        liveness = self._beat_every * 4  # the server's liveness_timeout (0: none)
        self._shutdown_transport()
        what = OP_NAMES.get(op, str(op))
        if self._timeout and elapsed >= self._timeout * 0.95:
            raise RPCSessionTimeoutError(
                f"RPC session timed out: it ran {elapsed:.2f} s, past its session_timeout of "
                f"{self._timeout:g} s, and the server ended it (during {what}); "
                "connect again with a larger session_timeout"
            ) from None
        if self._server_timeout and elapsed >= self._server_timeout * 0.95:
            raise RPCSessionTimeoutError(
                f"RPC session timed out: it ran {elapsed:.2f} s, past the server's session time "
                f"limit of {self._server_timeout:g} s (Server(session_timeout=...)), and the server "
                f"ended it (during {what})"
            ) from None
        if self._quiet and isinstance(exc, (TimeoutError, BlockingIOError)):
            what_not = (
                "took none of what this client sent" if sending else "sent nothing"
            )  # fmt: skip
            text = (
                f"the RPC server {self._label} {what_not} for {self._quiet:g} s during {what}, "
                "though it sends heartbeats while a call runs: it is frozen (stopped, or a "
                "thread of its held the GIL), or its host or the network is gone (the bound "
                f"is 1.5 times its liveness_timeout of {liveness:g} s, at least "
                f"{QUIET_FLOOR:g} s); the session is closed, connect again"
            )
            self._closed_why = text
            raise RPCError(text) from exc
        if isinstance(exc, IntegrityError):
            why = (
                "a sealed record failed its check: something between this client and the "
                "server altered the stream"
            )
        elif isinstance(exc, (ProtocolError, FrameLimitError)):
            why = (
                "the server broke the protocol: a server of another release, or something "
                "between this client and the server altered the stream"
            )
        else:
            why = "the server process died or dropped the session"
            stalled = _HEARTBEATS.stalled(max(5.0, liveness)) if liveness else 0.0
            if liveness and stalled > liveness / 2:  # with the beats' spacing: silent > liveness
                why = (
                    f"probably because this process could not run for {stalled:.1f} s (stopped, "
                    "suspended, or a thread held the GIL): the server heard nothing from it for "
                    f"its liveness_timeout of {liveness:g} s, took this client for frozen and "
                    "ended the session"
                )
        text = (
            f"lost the connection to the RPC server {self._label} during {what}: "
            f"{type(exc).__name__}: {exc} ({why})"
        )
        self._closed_why = text  # what the later calls say too
        raise RPCError(text) from exc

    def _shutdown_transport(self) -> None:
        self._closed = True
        self._stop_heartbeats()
        _HEARTBEATS.wake()  # its thread ends now if this was the last session
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass

    def _init(self, session_timeout: float, constructor_args: Any) -> None:
        args = list(constructor_args) if constructor_args else []
        limit = self._conn.max if self._conn is not None else None
        beats = self._beats()
        where = placement()
        # heartbeats from the server while a call runs (sockets; a pipe's child ends with us),
        # asked for only where the user turned the watch on (README, "Liveness": a buffering
        # relay such as an ssh tunnel can hold back a request longer than the bound)
        want = beats != BEATS_NONE and watch_server_enabled()
        self.info = self._request(OP_INIT, float(session_timeout or 0), args, limit, beats, where, want) or {}  # fmt: skip
        if self._conn is not None and self.info.get("max_message_bytes"):
            self._conn.peer_max = int(self.info["max_message_bytes"])
        if self._conn is not None and not may_poll_beside(self.info.get("placement")):
            wire.stop_polling(self._conn)
        self._server_timeout = float(self.info.get("server_timeout") or 0)
        liveness = float(self.info.get("liveness_timeout") or 0)
        if not math.isfinite(liveness) or liveness > MAX_BOUND:
            liveness = 0.0  # (from the server: a bound no timer takes is no bound)
        call_beats = self.info.get("call_beats")
        if not isinstance(call_beats, (int, float)) or isinstance(call_beats, bool):
            call_beats = 0.0  # none promised (an older or a foreign server), or malformed
        if want and liveness > 0 and 0 < call_beats <= liveness:
            # a freeze shorter than liveness_timeout never ends a call: its silence is at
            # most that plus one beat's spacing (a loaded server's checks slip, so 1.5x);
            # at least QUIET_FLOOR: a server starved of CPU for under a second at the
            # smallest bound ended calls (outside check, niced server beside CPU hogs)
            self._quiet = max(1.5 * liveness, 4.0 * call_beats, QUIET_FLOOR)
            if not self._timeout:  # (else _arm_deadline bounds each request's waits)
                self._conn.t.limit_waits(self._quiet)
            # the server beats while it reads a request too: a write that waits for room
            # while they arrive waits on (a relay on a slow link holds back what it took)
            link = getattr(self._conn.t, "inner", self._conn.t)
            if type(link) is wire.SocketTransport and service.can_watch(self._conn):
                link.heard_within = functools.partial(service.beat_within, self._conn)
        if beats and liveness > 0:
            self._beat_every = liveness / 4
            _HEARTBEATS.add(self)
        elif self._timeout and self._conn is not None:
            _HEARTBEATS.add(self)  # no beats, but its thread holds session_timeout's deadline

    # -- liveness -------------------------------------------------------------------
    def _link_type(self) -> type:
        """The type of the transport under the seal (a sealed link wraps a socket or TLS)."""
        t = getattr(self._conn, "t", None)
        return type(getattr(t, "inner", t))

    def _beats(self) -> int:
        """The heartbeats this session can send (told to the server in INIT)."""
        t = self._link_type()
        if t is wire.SocketTransport:
            return BEATS_ALWAYS
        if t is wire.SSLTransport:
            # OpenSSL forbids writing while another thread reads: only between calls
            return BEATS_IDLE
        return BEATS_NONE  # pipes: the server ends with this process anyway

    def _heartbeat(self) -> None:
        """Send a heartbeat if nothing was sent since the last look (the heartbeat thread)."""
        sends = self._sends
        if sends != self._beat_seen:
            self._beat_seen = sends  # a request went out meanwhile: that was the sign of life
            return
        # on TLS, _lock: no request may be waiting for its reply (a reader in OpenSSL)
        lock = self._lock if self._link_type() is wire.SSLTransport else self._send_lock
        if not lock.acquire(blocking=False):
            return  # sending now (on TLS: in a call), which the server hears as well
        try:
            with self._beat_mutex:
                if not self._beat_every or self._sends != sends:
                    return
                poll = select.poll()
                poll.register(self._conn.t.sock.fileno(), select.POLLOUT)
                if poll.poll(0):  # room for a few bytes: never block the shared thread
                    self._conn.send_heartbeat()
        except (OSError, ValueError):
            pass  # a broken connection: the next request reports it
        finally:
            lock.release()

    def _stop_watching_server(self) -> None:
        """Its waits on the server are no longer bounded by the server's heartbeats (the
        socket is about to carry the core's frames of a Disco worker, which has its own
        liveness: a worker's command may run for long with nothing on the wire)."""
        if self._quiet:
            self._quiet = 0.0
            if not self._timeout:
                self._conn.t.limit_waits(None)
            link = getattr(self._conn.t, "inner", self._conn.t)
            if getattr(link, "heard_within", None) is not None:
                link.heard_within = None

    def _stop_heartbeats(self) -> None:
        """No heartbeat from now on (one being written is finished first)."""
        with self._beat_mutex:
            self._beat_every = 0.0

    def close(self) -> None:
        """End the session; the server deletes its work folder. A second call does nothing."""
        if not self._closed:
            self._shutdown_transport()

    def __enter__(self) -> RPCSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self._label} ({state})>"

    # -- TVM's members ------------------------------------------------------------
    def system_lib(self) -> RemoteModule:
        """The server's system library: its global functions and loaded libraries.

        ``lib["name"]`` or ``lib.get_function("name", restype="int64")`` (a C symbol
        of a library the server loaded, with its result type).
        """
        return self._request(protocol.OP_SYSTEM_LIB)

    def get_function(self, name: str) -> RemoteFunction:
        """A global function of the server (``disco_core.register_func`` there)."""
        if not isinstance(name, str):
            raise DiscoTypeError(f"get_function: name must be a str, got {type(name).__name__} {name!r}")  # fmt: skip
        fn = self._funcs.get(name)
        if fn is None:
            fn = _expect(
                self._request(OP_GET_FUNC, name), RemoteFunction, f"get_function({name!r})"
            )
            fn.name = name
            self._funcs[name] = fn
        return fn

    def device(self, dev_type: Any, dev_id: int = 0) -> RemoteDevice:
        """A device of the server, e.g. ``sess.device("cuda", 0)`` or ``sess.device(2, 0)``."""
        return RemoteDevice(self, dev_type, dev_id)

    def upload(self, data: Any, target: str | None = None, *, progress: Progress | None = None) -> None:  # fmt: skip
        """Copy a local file (a path) or ``bytes`` into the session's work folder.

        The contents stream in chunks that fit the server's ``max_message_bytes``, so
        a file of any size goes through; ``progress(done_bytes, total_bytes)`` is
        called after each chunk (once with ``(0, 0)`` for an empty file). The remote
        file appears (atomically) only when all of it arrived.
        """
        if isinstance(data, (bytes, bytearray, memoryview)):
            if not target:
                raise DiscoValueError("upload(bytes) needs target= (the remote file name)")
            view = memoryview(data).cast("B")
            self._upload(target, view, view.nbytes, progress)
            return
        try:
            path = os.fspath(data)
        except TypeError:
            raise DiscoTypeError(
                f"upload: data must be a local file's path or bytes, got {type(data).__name__}"
            ) from None
        if not target:
            target = os.path.basename(path)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise DiscoFileNotFoundError(f"upload: no local file {path!r}") from None
        except IsADirectoryError:
            raise DiscoValueError(f"upload: {path!r} is a folder; upload its files one by one") from None  # fmt: skip
        except PermissionError:
            raise DiscoPermissionError(f"upload: the local file {path!r} cannot be read") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            self._upload(target, FileSource(f, size), size, progress)

    def _upload(self, target: str, source: Any, size: int, progress: Progress | None) -> None:
        if size > CHECK_UPLOADS_ABOVE:
            self._check_upload(target)

        def send(conn: wire.Conn) -> Any:
            return conn.send_stream(OP_UPLOAD, source, size, progress)

        self._exchange(OP_UPLOAD, (target, size), send_stream=send)

    def _check_upload(self, target: str) -> None:
        """Have the server refuse ``target`` now, before a large body is sent for nothing."""
        try:
            self._request(OP_UPLOAD_CHECK, target)
        except RPCError as exc:
            # a server that predates the check: the upload itself will say
            if "unknown operation" not in str(exc) and "not supported by the minimal" not in str(
                exc
            ):
                raise

    def download(self, path: str, *, target: str | None = None, progress: Progress | None = None) -> Any:  # fmt: skip
        """Return the contents of a remote file, or stream them into the local file ``target``.

        The contents come back as a ``bytearray``, as TVM's. With ``target`` they are
        written to a temporary file beside it, renamed to ``target`` once complete (a
        failed download leaves ``target`` untouched), and ``target`` is returned.
        ``progress(done_bytes, total_bytes)`` is called after each chunk (once with
        ``(0, 0)`` for an empty file).
        """
        return self._fetch(OP_DOWNLOAD, path, target, progress)

    def _fetch(self, op: int, path: str, target: str | None, progress: Progress | None) -> Any:
        if target is None:

            def into_memory(conn: wire.Conn, size: int) -> bytearray:
                # TVM's type; the socket fills it whole, in place (no zeros written first)
                out = unfilled_bytearray(int(size))
                conn.recv_stream(op, int(size), into=memoryview(out), progress=progress)
                return out

            return self._exchange(op, (path,), recv_stream=into_memory)

        _check_local_target(os.fspath(target))

        def into_file(conn: wire.Conn, size: int) -> str:
            with _replacing(os.fspath(target)) as f:
                conn.recv_stream(op, int(size), sink=f, progress=progress)
            return target

        return self._exchange(op, (path,), recv_stream=into_file)

    def remove(self, path: str) -> None:
        """Remove a remote file or folder (inside the work folder)."""
        self._request(OP_REMOVE, path)

    def listdir(self, path: str = ".") -> str:
        """The names in a remote folder of the work folder, sorted and joined by ``,`` (TVM's).

        ``""`` for an empty folder; :meth:`listdir_names` gives the list.
        """
        return ",".join(self.listdir_names(path))

    def listdir_names(self, path: str = ".") -> list[str]:
        """The names in a remote folder of the work folder, as a sorted list."""
        names = _expect(self._request(OP_LISTDIR, path), (list, tuple), "listdir")
        if not all(type(n) is str for n in names):
            raise RPCError("listdir: the server answered with names that are not str")
        return list(names)

    def load_module(self, path: str, device: Any = None) -> RemoteModule:
        """Load an uploaded module: ``.py`` through the core's loaders, ``.so`` through ctypes,
        ``.tar`` of object files linked first."""
        dev = Device(device.device_type, device.device_id) if device is not None else None
        return _expect(self._request(OP_LOAD_MODULE, path, dev), RemoteModule, "load_module")

    def download_linked_module(self, path: str) -> bytearray:
        """Link an uploaded ``.tar`` of object files with the server's ``cc``; return the ``.so``
        as a ``bytearray`` (TVM's type)."""
        return self._fetch(OP_LINK, path, None, None)

    def ping(self) -> None:
        """One empty round trip."""
        self._request(OP_PING)

    def cpu(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("cpu", dev_id)

    def cuda(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("cuda", dev_id)

    def cl(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("opencl", dev_id)

    def vulkan(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("vulkan", dev_id)

    def metal(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("metal", dev_id)

    def rocm(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("rocm", dev_id)

    def ext_dev(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("ext_dev", dev_id)

    def hexagon(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("hexagon", dev_id)

    def webgpu(self, dev_id: int = 0) -> RemoteDevice:
        return self.device("webgpu", dev_id)


class _replacing:
    """A binary file written beside ``target`` under a temporary name, renamed onto
    ``target`` when the block succeeds and removed when it fails."""

    def __init__(self, target: str) -> None:
        folder, name = os.path.split(os.path.abspath(target))
        self.target = target
        self.tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.part")

    def __enter__(self) -> Any:
        # read-write: a sealed stream spliced in is read back into its MAC
        fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type: Any, *_exc: Any) -> None:
        self.file.close()
        try:
            if exc_type is None:
                os.replace(self.tmp, self.target)
                return
        except BaseException:
            self._discard()  # (the target changed meanwhile: a folder made there, say)
            raise
        self._discard()

    def _discard(self) -> None:
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def _check_local_target(target: str) -> None:
    """Refuse a download target that cannot be written, before anything is asked of the server."""
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        raise DiscoValueError(f"download: the local target {target!r} is a folder; name a file")
    if target.endswith((os.sep, "/")):  # a folder meant, which is not there
        raise DiscoFileNotFoundError(
            f"download: the local folder {target!r} does not exist; nothing was downloaded"
        )
    if not os.path.isdir(folder):
        raise DiscoFileNotFoundError(
            f"download: the local folder {folder!r} does not exist (target {target!r}); "
            "nothing was downloaded"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DiscoPermissionError(
            f"download: the local folder {folder!r} is not writable (target {target!r}); "
            "nothing was downloaded"
        )


def _remote_error(value: Any) -> RPCError:
    try:
        exc_type, message, tb = value
    except (TypeError, ValueError):
        return RPCError(f"malformed error reply from the server: {value!r}")
    if exc_type in ("TimeoutError", "disco_rpc.errors.RPCSessionTimeoutError"):
        return RPCSessionTimeoutError(str(message), str(exc_type), str(tb))
    return RPCError(str(message), str(exc_type), str(tb))


def _copy_file(src: Any, dst: Any, size: int, progress: Progress | None) -> None:
    """Copy ``size`` bytes between open binary files in chunks, reporting progress."""
    done = 0
    if progress is not None and size == 0:
        progress(0, 0)
    while done < size:
        chunk = src.read(min(wire.CHUNK, size - done))
        if not chunk:
            raise TransferError(f"the file ended {size - done} bytes early")
        dst.write(chunk)
        done += len(chunk)
        if progress is not None:
            progress(done, size)


class LocalSession(RPCSession):
    """The RPC interface over this very process: no server, same behaviour.

    Values cross as they would over a wire (arrays are copied, byte strings come
    back as ``bytes``), so code written against a remote session runs unchanged.

    Parameters
    ----------
    work_dir : str, optional
        A folder used as the work folder and kept; by default a new folder,
        deleted when the session is closed, dropped, or at the latest when the
        interpreter exits.
    """

    def __init__(self, work_dir: str | None = None) -> None:
        super().__init__(None, label="local")
        self._handler = SessionHandler(work_dir)
        # not a __del__: remote functions cached in the session refer back to it
        self._finalizer = weakref.finalize(self, self._handler.close)
        self.info = {"pid": os.getpid(), "local": True, "work_dir": self._handler.work}

    def _to_server(self, v: Any) -> Any:
        t = type(v)
        if t in _PLAIN:
            return v
        ref = getattr(v, "_rpc_ref", None)
        if ref is not None:
            self._export(v)  # the same check as over a wire
            return self._handler.resolve(ref)
        if t is tuple or t is list:
            return t(self._to_server(x) for x in v)
        if t is dict:
            return {self._to_server(k): self._to_server(x) for k, x in v.items()}
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, Device):
            return Device(v.device_type, v.device_id)
        if isinstance(v, (bytearray, memoryview)):
            return bytes(v)  # byte strings arrive as bytes, as over a wire
        wire.encode(v)  # the same TypeError a wire would give
        return v

    def _to_client(self, v: Any) -> Any:
        t = type(v)
        if t in _PLAIN:
            return v
        if t is tuple or t is list:
            return t(self._to_client(x) for x in v)
        if t is dict:
            return {k: self._to_client(x) for k, x in v.items()}
        if isinstance(v, (bytearray, memoryview)):
            return bytes(v)
        ref = self._handler.export(v)
        return self._wrap(ref) if ref is not None else v

    def _request(self, op: int, *args: Any) -> Any:
        if self._closed:
            raise RPCError("the local RPC session is closed")
        h = self._handler
        with self._lock:
            frees = self._frees
            if frees:
                self._frees = []
                h.free(frees)
            sargs = self._to_server(args)
            try:
                if op == OP_CALL:
                    result = sargs[0](*sargs[1])
                elif op == OP_TENSOR_GET:
                    return np.array(h.op_tensor_get(*sargs), copy=True)
                elif op == OP_INIT:
                    return {}
                else:
                    result = h.ops[op](*sargs)
                return self._to_client(result)
            except Exception as exc:
                if _interrupts.raised_by_signal_handler(exc):
                    raise  # the program's own, as in any local call (SIGALRM's TimeoutError)
                raise _remote_error(handler.error_value(exc)) from None

    def _upload(self, target: str, source: Any, size: int, progress: Progress | None) -> None:
        def fill(f: Any) -> None:
            if type(source) is FileSource:
                _copy_file(source.file, f, size, progress)
                return
            f.write(source)
            if progress is not None:
                progress(size, size)

        with self._lock:
            try:
                self._handler.write_upload(self._handler.upload_target(target), fill)
            except Exception as exc:
                if _interrupts.raised_by_signal_handler(exc):
                    raise  # the program's own, as in any local call (SIGALRM's TimeoutError)
                raise _remote_error(handler.error_value(exc)) from None

    def _fetch(self, op: int, path: str, target: str | None, progress: Progress | None) -> Any:
        h = self._handler
        if target is not None:
            _check_local_target(os.fspath(target))
        with self._lock:
            try:
                src = h.op_download(path) if op == OP_DOWNLOAD else h.op_link(path)
            except Exception as exc:
                if _interrupts.raised_by_signal_handler(exc):
                    raise  # the program's own, as in any local call (SIGALRM's TimeoutError)
                raise _remote_error(handler.error_value(exc)) from None
        with src.file:
            if target is None:
                data = bytearray(src.size)
                got = src.file.readinto(data)
                if got != src.size:
                    raise TransferError(f"the file ended {src.size - got} bytes early")
                if progress is not None:
                    progress(len(data), len(data))
                return data
            with _replacing(os.fspath(target)) as f:
                _copy_file(src.file, f, src.size, progress)
        return target

    def _shutdown_transport(self) -> None:
        self._closed = True
        self._finalizer()


class PopenSession(RPCSession):
    """A server started as a child process and spoken to over two pipes, as TVM's.

    Parameters
    ----------
    binary : str, bytes or list of str
        A path to an executable (a :func:`disco_rpc.with_minrpc` output, or any
        program that serves the protocol), the bytes of one, or a path to a Python
        file (run with this interpreter): as TVM's ``rpc.CreatePipeClient``, it gets
        the numbers of its two pipe ends (read, write) as its last two arguments,
        and the same pipes as its stdin and stdout. A list is a full command, run as
        given, that serves on its stdin/stdout (``[sys.executable, "-m",
        "disco_rpc", "stdio"]``, a program calling :func:`disco_rpc.serve_stdio`).
    max_message_bytes : int
        The largest frame accepted from the server.
    startup_timeout : float
        Seconds the program has to answer the handshake.

    Raises
    ------
    RPCError
        The binary is missing, not executable, exits before it serves, or does not
        answer the handshake (a ``RuntimeError``, as TVM raises); the child is not
        left running.
    """

    def __init__(self, binary: Any, *, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, startup_timeout: float = 60.0) -> None:  # fmt: skip
        self._child = None
        # The session's folders are made (and removed) here, not by the child: a child
        # that ends abruptly (os._exit, a signal) cannot clean up after itself.
        self._child = child = PipeChild(binary, max_message_bytes=max_message_bytes)
        self._proc = child.proc
        super().__init__(child.conn, label=f"popen:{child.label}")
        try:
            child.handshake(startup_timeout)
            child.conn.t.settimeout(startup_timeout)
            self._init(0, None)
            child.conn.t.settimeout(None)
        except BaseException as exc:
            child.kill()  # not a working server: no grace period
            self.close()
            if isinstance(exc, RPCError):
                raise
            if isinstance(exc, TimeoutError):
                raise RPCError(
                    f"{child.argv!r} did not answer the session's start within {startup_timeout:g} s"
                ) from None
            raise RPCError(f"the server {child.argv!r} did not start: {exc}") from exc

    def _fail(self, op: int, exc: BaseException, sending: bool = False):
        # a pipe that closed: the process is exiting, give it a moment to be reaped
        code = self._child.exit_code(1.0)  # type: ignore[union-attr]  # started
        if code is not None and not self._closed:
            self._shutdown_transport()
            raise RPCError(
                f"the RPC server process {self._label} exited with code {code} during "
                f"{OP_NAMES.get(op, op)}"
            ) from exc
        return super()._fail(op, exc, sending)

    def _shutdown_transport(self) -> None:
        self._closed = True
        self._stop_heartbeats()
        _HEARTBEATS.wake()
        if self._child is not None:
            self._child.close()


class _Heartbeats:
    """One thread that keeps every open session's server hearing from this process.

    Every ``min(interval)`` seconds it looks at each registered session (held
    weakly) and sends a heartbeat frame on those that sent nothing since the last
    look: a few bytes every ``liveness_timeout / 4`` seconds of silence, nothing on
    the call path. It also ends a call that runs past its session's ``session_timeout``
    (:meth:`RPCSession._check_deadline`), beats or not. It ends when no session is
    left, and starts again with the next.
    """

    def __init__(self) -> None:
        self.sessions: weakref.WeakSet = weakref.WeakSet()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.woke = time.monotonic()  # when the thread last ran
        self.stall = (0.0, 0.0)  # the last time it could not run on time: (seconds, when it ended)

    def add(self, sess: RPCSession) -> None:
        with self.cond:
            self.sessions.add(sess)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="disco-rpc-heartbeats", daemon=True)  # fmt: skip
                self.woke = time.monotonic()
                self.thread.start()
            self.cond.notify()

    def wake(self) -> None:
        """Look at the sessions now (one closed: the thread ends when none is left)."""
        with self.cond:
            self.cond.notify()

    def _run(self) -> None:
        wait = 0.0
        while True:
            now = time.monotonic()
            if wait and now - self.woke > 2 * wait:  # this process was stopped, or starved
                self.stall = (now - self.woke, now)
            self.woke = now
            with self.cond:
                # sessions that beat, and those whose session_timeout it holds
                live = [s for s in self.sessions if s._beat_every or (s._timeout and not s._closed)]
                if not live:
                    self.thread = None
                    return
                wait = min(s._beat_every or 1.0 for s in live)
            for sess in live:
                try:
                    if sess._beat_every:
                        sess._heartbeat()
                    sess._check_deadline()
                except Exception:  # one session's trouble must not stop the others' beats
                    logger.debug("heartbeat on %s failed", sess._label, exc_info=True)
            del live, sess
            with self.cond:
                self.cond.wait(wait)

    def stalled(self, within: float) -> float:
        """Seconds this process could not send heartbeats, now or in the last ``within`` s."""
        now = time.monotonic()
        current = now - self.woke if self.thread is not None else 0.0
        seconds, ended = self.stall
        return max(current, seconds if now - ended < within else 0.0)

    def after_fork(self) -> None:
        """In a forked child: the parent's sessions are not this process's to keep alive."""
        self.sessions = weakref.WeakSet()
        self.cond = threading.Condition()
        self.thread = None


_HEARTBEATS = _Heartbeats()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HEARTBEATS.after_fork)


def _seconds(value: Any, name: str, zero_ok: bool = False) -> float:
    """``value`` as seconds (> 0, or >= 0 with ``zero_ok``), or a Disco error naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise DiscoTypeError(f"{name} must be a number of seconds, got {value!r}") from None
    if not (seconds >= 0 if zero_ok else seconds > 0) or math.isinf(seconds):
        rule = ">= 0 (0: no limit)" if zero_ok else "> 0"
        raise DiscoValueError(f"{name} must be a number of seconds {rule}, got {value!r}")
    return seconds


def check_connect_args(session_timeout: Any = 0, **connect_args: Any) -> float:
    """Check :func:`connect`'s options before anything is asked of a server or a tracker
    (a tracker's server was held for a request whose options were refused after it);
    return ``session_timeout`` as seconds (``None`` or 0: no limit, as TVM's)."""
    seconds = 0.0 if session_timeout is None else _seconds(session_timeout, "session_timeout", zero_ok=True)  # fmt: skip
    timeout = connect_args.get("connect_timeout")
    if timeout is not None:
        _seconds(timeout, "connect_timeout")
    ssl_context = connect_args.get("ssl_context")
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise DiscoTypeError(f"ssl_context must be an ssl.SSLContext, got {type(ssl_context).__name__}")  # fmt: skip
    if "max_message_bytes" in connect_args:
        wire.check_message_limit(connect_args["max_message_bytes"])
    token = connect_args.get("token")
    if token is not None and not isinstance(token, (str, bytes, bytearray)):
        raise DiscoTypeError(f"token must be str or bytes, not {type(token).__name__}")
    return seconds


def connect(url: str, port: int, key: str = "", session_timeout: float = 0, session_constructor_args: list | None = None, enable_logging: bool = False, *, token: Any = None, ssl_context: Any = None, max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES, connect_timeout: float = 10.0) -> RPCSession:  # fmt: skip
    """Connect to an RPC server, as ``tvm.rpc.connect``.

    Parameters
    ----------
    url, port : str, int
        The server's address.
    key : str
        Must match the server's key (a server without a key accepts any).
    session_timeout : float
        Seconds after which the server ends the session (0: never); a call running
        then raises :class:`RPCSessionTimeoutError`.
    session_constructor_args : list, optional
        ``["rpc.Connect", host, port, key, enable_logging, *init]`` makes the server
        relay this session to another server, as TVM's (``init``: the inner
        session's own constructor, so chains nest). The inner server's token goes in
        a dict right after ``enable_logging``: ``[..., False, {"token": "..."}]``.
        ``["rpc.LocalSession"]`` is the default.
    enable_logging : bool
        Log every request and its duration on the ``disco_rpc.client`` logger.
    token : str or bytes, optional
        The shared secret (default ``$DISCO_TOKEN``): both sides prove they hold it
        and every frame is then sealed. A server that does not prove it, e.g. one
        that answers "no authentication required", is refused (:class:`RPCAuthError`).
    ssl_context : ssl.SSLContext, optional
        Speak TLS (a client context, e.g. ``ssl.create_default_context(cafile=...)``).
    max_message_bytes : int
        The largest frame accepted from the server.
    connect_timeout : float
        Seconds to connect and complete the handshake.
    """
    if isinstance(port, str) and port.strip().isdigit():
        port = int(port)  # (as before: "9091" was taken)
    port = service._port("port", port)
    if not isinstance(
        key, str
    ):  # (it failed deep inside, "'int' object has no attribute 'encode'")
        raise DiscoTypeError(f"connect: key must be a str, got {type(key).__name__} {key!r}")
    session_timeout = check_connect_args(
        session_timeout,
        token=token,
        ssl_context=ssl_context,
        max_message_bytes=max_message_bytes,
        connect_timeout=connect_timeout,
    )
    conn = open_conn(
        url,
        port,
        key,
        token=token,
        ssl_context=ssl_context,
        max_message_bytes=max_message_bytes,
        connect_timeout=connect_timeout,
    )
    sess = RPCSession(conn, session_timeout, f"{url}:{port}", enable_logging)
    try:
        sess._init(session_timeout, session_constructor_args)
    except BaseException:
        sess.close()
        raise
    return sess


# --------------------------------------------------------------------------- arrays
def _remote_dev(device: Any) -> RemoteDevice:
    if not isinstance(device, RemoteDevice):
        raise DiscoTypeError(
            f"device must be a remote device (sess.cpu(0), sess.cuda(0), ...), got {device!r}"
        )
    return device


def tensor(arr: Any, device: RemoteDevice) -> RemoteTensor:
    """Copy a host array to a remote device (like ``tvm.runtime.tensor``)."""
    dev = _remote_dev(device)
    host = np.asarray(to_host(arr))
    as_dtype(host.dtype)
    made = dev._rpc_sess._request(OP_TENSOR, host, Device(dev.device_type, dev.device_id))
    return _on_asked_device(_expect(made, RemoteTensor, "tensor"), dev)


def empty(shape: Any, dtype: Any = "float32", device: RemoteDevice | None = None) -> RemoteTensor:
    """An uninitialised array on a remote device."""
    dev = _remote_dev(device)
    dt = as_dtype(dtype)
    made = dev._rpc_sess._request(
        OP_EMPTY, as_shape(shape, dt), dt, Device(dev.device_type, dev.device_id)
    )
    return _on_asked_device(_expect(made, RemoteTensor, "empty"), dev)


def _on_asked_device(made: RemoteTensor, dev: RemoteDevice) -> RemoteTensor:
    """``made`` as on the device asked for: the server's host memory is one for every
    ``cpu(n)``, and a NumPy array names no number, so ``cpu(3)`` came back as ``cpu(0)``
    (TVM's keeps ``cpu(3)``; an outside check)."""
    if made.device.device_type == dev.device_type == "cpu":
        made.device = dev
    return made


_ = (OP_PING, OP_LISTDIR, OP_REMOVE, OP_LOAD_MODULE, OP_SYSTEM_LIB, OP_INIT, OP_DEV_SYNC)
