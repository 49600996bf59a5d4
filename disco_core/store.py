"""The rendezvous store: keys every worker of a session can set, read and wait for.

The role ``torch.distributed``'s Store plays: a CCL's workers meet through it
during ``init_ccl`` (one publishes an address, the others wait for it), without
a directory server of their own. Every worker reaches it as
``disco_core.worker.current().store``.

The controller holds the data (:class:`ControllerStore`). Workers in the
controller's process call it directly; workers in other processes send a
``("store", seq, op, key, arg)`` message up their reply path and read their
command stream until the answer, the command ``(STORE_REPLY, seq, ok, value)``
(:class:`RemoteStore`). The controller answers from its own thread, never the
thread that reads the replies, so a slow worker pipe cannot stop the replies.

Values are secrets as far as logs go: no log record, repr or error message of
this module holds one.
"""

from __future__ import annotations

import abc
import collections
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import protocol as P
from .errors import DiscoError, DiscoTypeError, DiscoValueError, StoreTimeoutError
from .settings import env_seconds

__all__ = [
    "Store",
    "ControllerStore",
    "RemoteStore",
    "NoStore",
    "StoreTimeoutError",
    "store_timeout",
    "MAX_KEY_CHARS",
    "MAX_VALUE_BYTES",
    "MAX_TOTAL_BYTES",
]

logger = logging.getLogger("disco_core.store")

#: Longest key, in characters.
MAX_KEY_CHARS = 256
#: Largest value, in bytes (a rendezvous payload, not a data channel).
MAX_VALUE_BYTES = 1 << 20
#: The most the store holds, in bytes of values, all keys together: it lives in the
#: controller's memory, so workers cannot exhaust it.
MAX_TOTAL_BYTES = 256 << 20

_OPS = ("set", "get", "wait", "add")


def store_timeout() -> float:
    """Seconds a ``get``/``wait`` waits by default: ``$DISCO_STORE_TIMEOUT``, default 60."""
    return env_seconds("DISCO_STORE_TIMEOUT", 60.0)


def _check_key(key: Any, what: str = "key") -> str:
    if type(key) is not str:
        raise DiscoTypeError(f"store {what} must be a str, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_CHARS:
        raise DiscoValueError(
            f"store {what} must be 1 to {MAX_KEY_CHARS} characters long, got {len(key)}"
        )
    return key


def _check_keys(keys: Any) -> tuple[str, ...]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise DiscoTypeError(
            f"store wait() takes a sequence of str keys, got {type(keys).__name__}"
        )
    return tuple(_check_key(k, "key in keys") for k in keys)


def _check_value(value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise DiscoTypeError(f"store value must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) > MAX_VALUE_BYTES:
        raise DiscoValueError(
            f"store value is {len(value)} bytes, over the limit of {MAX_VALUE_BYTES} "
            "(the store carries rendezvous payloads, not data)"
        )
    return value


#: Counters (``add``) stay within a signed 64-bit integer.
_COUNTER_LIMIT = 1 << 63


def _check_amount(amount: Any) -> int:
    if type(amount) is not int:  # bool too: add(key, True) is a mistake
        raise DiscoTypeError(f"store add() amount must be an int, got {type(amount).__name__}")
    if not -_COUNTER_LIMIT <= amount < _COUNTER_LIMIT:
        raise DiscoValueError("store add() amount must fit in a signed 64-bit integer")
    return amount


def _check_timeout(timeout: Any) -> float:
    if timeout is None:
        return store_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise DiscoTypeError(
            f"store timeout must be a number of seconds, got {type(timeout).__name__}"
        )
    if not timeout >= 0:  # NaN too
        raise DiscoValueError(f"store timeout must be >= 0 seconds, got {timeout!r}")
    return float(timeout)


def _timeout_error(missing: Sequence[str], timeout: float) -> StoreTimeoutError:
    names = ", ".join(repr(k) for k in missing[:8]) + (" ..." if len(missing) > 8 else "")
    return StoreTimeoutError(
        f"rendezvous store: key{'s' if len(missing) > 1 else ''} {names} not set within "
        f"{timeout:g} s (DISCO_STORE_TIMEOUT or timeout=)",
        tuple(missing),
    )


class Store(abc.ABC):
    """A session's rendezvous store, as a worker sees it (``current().store``).

    Keys are non-empty str of at most :data:`MAX_KEY_CHARS` characters; values
    bytes of at most :data:`MAX_VALUE_BYTES`. There is one store per session:
    a CCL prefixes its keys (with a uuid it puts in its rendezvous payload,
    say). Waits end after ``timeout`` seconds (default ``$DISCO_STORE_TIMEOUT``,
    60) with :class:`StoreTimeoutError`, and at once with a
    :class:`~disco_core.errors.DiscoError` naming the reason when the store is
    aborted (a worker died, ``init_ccl`` failed, the session shuts down).
    """

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value`` (replacing any value) and wake its waiters."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until some worker sets it.

        Raises
        ------
        StoreTimeoutError
            ``key`` was not set within ``timeout`` seconds.
        DiscoError
            The store was aborted.
        """

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Wait until every one of ``keys`` is set.

        Raises
        ------
        StoreTimeoutError
            Naming the keys still missing after ``timeout`` seconds.
        DiscoError
            The store was aborted.
        """

    @abc.abstractmethod
    def add(self, key: str, amount: int = 1) -> int:
        """Add ``amount`` to the counter ``key`` (0 when unset) atomically; the new value.

        The counter is stored as its decimal digits (``get`` returns ``b"3"``),
        so ``add(key, 1)`` by every worker, then ``wait`` on a key the last one
        sets, is a barrier.
        """


class NoStore(Store):
    """The store of a worker whose channel carries none: every call says so."""

    def __init__(self, reason: str = "this worker's channel has no rendezvous store") -> None:
        self.reason = reason

    def _refuse(self) -> Any:
        raise DiscoError(self.reason)

    def set(self, key: str, value: bytes) -> None:
        self._refuse()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._refuse()

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._refuse()

    def add(self, key: str, amount: int = 1) -> int:
        return self._refuse()

    def __repr__(self) -> str:
        return f"<NoStore: {self.reason}>"


class _Waiter:
    """A remote worker's ``get``/``wait`` that the controller answers later."""

    __slots__ = ("worker_id", "seq", "op", "keys", "deadline", "timeout", "done")

    def __init__(self, worker_id: int, seq: int, op: str, keys: tuple[str, ...], timeout: float) -> None:  # fmt: skip
        self.worker_id, self.seq, self.op, self.keys = worker_id, seq, op, keys
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.done = False

    def __lt__(self, other: _Waiter) -> bool:  # for the deadline heap
        return self.deadline < other.deadline


class ControllerStore(Store):
    """The store's data, held by the controller; thread-safe.

    Workers of the controller's process use it through :meth:`client`; the
    channel's reply hub hands the other workers' ``("store", ...)`` messages
    to :meth:`handle`, which never blocks.

    Parameters
    ----------
    reply : callable, optional
        ``reply(worker_id, command)`` sends a ``STORE_REPLY`` command to one
        worker (the channel's targeted send). Called only from this store's
        own thread, started at the first remote request.
    """

    def __init__(self, reply: Callable[[int, tuple], None] | None = None) -> None:
        self._reply = reply
        self._data: dict[str, bytes] = {}
        self._bytes = 0  # the values' total size (MAX_TOTAL_BYTES)
        # Taken with ``with self._lock`` (a C lock's own __enter__), never ``with
        # self._cond``: Condition.__enter__ is Python code, where a signal handler's
        # exception raised as the acquire returned left the lock taken for good (outside
        # check: a shutdown hung on it in a SIGALRM storm)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._aborted: str | None = None
        self._aborts = 0  # how many aborts so far: a wait that spans one fails, reset or not
        self._last_reason = ""
        self._final = False
        self._waiters: dict[str, list[_Waiter]] = collections.defaultdict(list)
        self._deadlines: list[_Waiter] = []  # a heap
        self._outbox: collections.deque[tuple[int, tuple]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        state = f"aborted: {self._aborted}" if self._aborted else "open"
        return f"<ControllerStore {len(self._data)} key(s), {state}>"

    # ------------------------------------------------------------------ the API
    def set(self, key: str, value: bytes) -> None:
        key, value = _check_key(key), _check_value(value)
        with self._lock:
            self._raise_if_aborted()
            self._set_locked(key, value)

    def add(self, key: str, amount: int = 1) -> int:
        key, amount = _check_key(key), _check_amount(amount)
        with self._lock:
            self._raise_if_aborted()
            return self._add_locked(key, amount)

    def get(self, key: str, timeout: float | None = None, before_wait: Callable[[], None] | None = None) -> bytes:  # fmt: skip
        key = _check_key(key)
        value = self._wait_local((key,), _check_timeout(timeout), before_wait)
        assert value is not None  # one key, set
        return value

    def wait(self, keys: Sequence[str], timeout: float | None = None, before_wait: Callable[[], None] | None = None) -> None:  # fmt: skip
        self._wait_local(_check_keys(keys), _check_timeout(timeout), before_wait)

    def client(self, hand_over: Callable[[], None]) -> Store:
        """This store as a worker of the controller's process uses it.

        ``hand_over`` (the worker's ``ctx.hand_over``) runs before every wait:
        the peers that will set the key may have commands still held back.
        """
        return _LocalClient(self, hand_over)

    # ------------------------------------------------------------------ the session's
    def abort(self, reason: str, final: bool = False) -> None:
        """Make every waiting and later call fail with ``reason`` (the first reason stays).

        ``final``: :meth:`reset` does not undo it (a channel that carries no store).
        """
        with self._lock:
            self._final = self._final or final
            if self._aborted is None:
                self._aborted = self._last_reason = str(reason)
            self._aborts += 1
            waiters = self._drop_waiters_locked()
            for w in waiters:
                self._answer_locked(w.worker_id, w.seq, False, ("abort", self._aborted))
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget every key and an abort, for a new try (``init_ccl`` after a failure)."""
        with self._lock:
            if self._closed or self._final:
                return
            self._data.clear()
            self._bytes = 0
            self._aborted = None

    def close(self, reason: str = "the session is shutting down") -> None:
        """Abort with ``reason``, forget every key, and stop the answering thread."""
        self.abort(reason)
        with self._lock:
            self._data.clear()
            self._bytes = 0
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)

    @property
    def aborted(self) -> str | None:
        """Why the store was aborted (None while it works)."""
        return self._aborted

    def handle(self, worker_id: int, msg: tuple) -> None:
        """Serve a remote worker's ``("store", seq, op, key, arg)`` message; never blocks.

        Called by the reply hub's reader thread. A malformed message is
        answered with an error when it has a usable ``seq``, dropped otherwise.
        """
        try:
            seq = msg[1] if len(msg) == 5 else None
            if type(seq) is not int:
                logger.warning("rendezvous store: dropped a malformed message from worker %d", worker_id)  # fmt: skip
                return
            _, _, op, key, arg = msg
            with self._lock:
                self._start_locked()
                try:
                    self._serve_locked(worker_id, seq, op, key, arg)
                except (DiscoTypeError, DiscoValueError) as exc:
                    self._answer_locked(worker_id, seq, False, ("value", str(exc)))
                except DiscoError as exc:
                    self._answer_locked(worker_id, seq, False, ("abort", str(exc)))
                except Exception as exc:  # the asker is answered whatever went wrong
                    logger.exception("rendezvous store: failed to serve worker %d", worker_id)
                    why = f"the store could not serve this request ({type(exc).__name__})"
                    self._answer_locked(worker_id, seq, False, ("value", why))
        except Exception:  # the reader thread must go on whatever happens here
            logger.exception("rendezvous store: failed to serve worker %d", worker_id)

    # ------------------------------------------------------------------ internals
    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise DiscoError(f"rendezvous store aborted: {self._aborted}")

    def _set_locked(self, key: str, value: bytes) -> None:
        total = self._bytes - len(self._data.get(key, b"")) + len(value)
        if total > MAX_TOTAL_BYTES:
            raise DiscoValueError(
                f"store set({key!r}): the store would hold {total} bytes, over its limit of "
                f"{MAX_TOTAL_BYTES} (it is for rendezvous data, not a data channel)"
            )
        self._bytes = total
        self._data[key] = value
        self._cond.notify_all()
        waiters = self._waiters.pop(key, None)
        if waiters:
            for w in waiters:
                self._try_answer_locked(w)

    def _add_locked(self, key: str, amount: int) -> int:
        old = self._data.get(key, b"0")
        try:
            total = int(old.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise DiscoValueError(
                f"store add(): key {key!r} holds a value that is not a counter"
            ) from None
        if not -_COUNTER_LIMIT <= total < _COUNTER_LIMIT:
            raise DiscoValueError(f"store add(): counter {key!r} would leave the 64-bit range")
        self._set_locked(key, str(total).encode("ascii"))
        return total

    def _wait_local(self, keys: tuple[str, ...], timeout: float, before_wait: Callable[[], None] | None) -> bytes | None:  # fmt: skip
        """Wait until every key is set; the first key's value (read under the same lock)."""
        cond, lock, data = self._cond, self._lock, self._data
        with lock:
            self._raise_if_aborted()
            if all(k in data for k in keys):
                return data[keys[0]] if keys else None
            aborts = self._aborts
        if before_wait is not None:
            before_wait()  # the peers' commands go out before this worker blocks
        deadline = time.monotonic() + timeout
        with lock:
            while True:
                if self._aborts != aborts:  # aborted while waiting (and maybe reset since)
                    raise DiscoError(f"rendezvous store aborted: {self._last_reason}")
                missing = [k for k in keys if k not in data]
                if not missing:
                    return data[keys[0]] if keys else None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _timeout_error(missing, timeout)
                cond.wait(min(left, threading.TIMEOUT_MAX))  # timeout=inf waits for ever

    def _serve_locked(self, worker_id: int, seq: int, op: Any, key: Any, arg: Any) -> None:
        if op not in _OPS:
            raise DiscoValueError(f"rendezvous store: unknown operation {op!r}")
        if op == "wait":
            keys = _check_keys(key)
        else:
            keys = (_check_key(key),)
        self._raise_if_aborted()
        if op == "set":
            self._set_locked(keys[0], _check_value(arg))
            self._answer_locked(worker_id, seq, True, None)
        elif op == "add":
            self._answer_locked(worker_id, seq, True, self._add_locked(keys[0], _check_amount(arg)))
        else:
            w = _Waiter(worker_id, seq, op, keys, _check_timeout(arg))
            if not self._try_answer_locked(w):
                for k in keys:
                    if k not in self._data:
                        self._waiters[k].append(w)
                heapq.heappush(self._deadlines, w)
                self._cond.notify_all()  # the thread's next deadline may be sooner

    def _try_answer_locked(self, w: _Waiter) -> bool:
        """Answer ``w`` if all its keys are set; True when answered."""
        if w.done:
            return True
        data = self._data
        if any(k not in data for k in w.keys):
            return False
        w.done = True
        self._answer_locked(w.worker_id, w.seq, True, data[w.keys[0]] if w.op == "get" else None)
        return True

    def _drop_waiters_locked(self) -> list[_Waiter]:
        out = [w for w in self._deadlines if not w.done]
        for w in out:
            w.done = True
        self._deadlines.clear()
        self._waiters.clear()
        return out

    def _answer_locked(self, worker_id: int, seq: int, ok: bool, value: Any) -> None:
        self._outbox.append((worker_id, (P.STORE_REPLY, seq, ok, value)))
        self._cond.notify_all()

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._serve, name="disco-store", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """The answering thread: sends the outbox, and the timeouts when they fall due."""
        cond, lock = self._cond, self._lock
        while True:
            with lock:
                while True:
                    self._expire_locked()
                    if self._outbox:
                        batch = list(self._outbox)
                        self._outbox.clear()
                        break
                    if self._closed:
                        return
                    heap = self._deadlines
                    left = heap[0].deadline - time.monotonic() if heap else None
                    cond.wait(None if left is None else min(max(0.0, left), threading.TIMEOUT_MAX))
            for worker_id, cmd in batch:
                try:
                    if self._reply is not None:
                        self._reply(worker_id, cmd)
                except Exception as exc:  # a dead worker: its waiters are gone with it
                    logger.debug(
                        "rendezvous store: no answer to worker %d (%s)",
                        worker_id,
                        type(exc).__name__,
                    )

    def _expire_locked(self) -> None:
        heap, now = self._deadlines, time.monotonic()
        while heap and (heap[0].done or heap[0].deadline <= now):
            w = heapq.heappop(heap)
            if w.done:
                continue
            w.done = True
            for k in w.keys:
                lst = self._waiters.get(k)
                if lst is not None and w in lst:
                    lst.remove(w)
                    if not lst:
                        del self._waiters[k]
            missing = [k for k in w.keys if k not in self._data]
            self._answer_locked(w.worker_id, w.seq, False, ("timeout", w.timeout, tuple(missing)))


class _LocalClient(Store):
    """A worker of the controller's process: the data directly, its peers handed over first."""

    __slots__ = ("_store", "_hand_over")

    def __init__(self, store: ControllerStore, hand_over: Callable[[], None]) -> None:
        self._store, self._hand_over = store, hand_over

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._store.get(key, timeout, self._hand_over)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._store.wait(keys, timeout, self._hand_over)

    def add(self, key: str, amount: int = 1) -> int:
        return self._store.add(key, amount)

    def __repr__(self) -> str:
        return f"<rendezvous store client of {self._store!r}>"


class RemoteStore(Store):
    """A worker in another process: requests up the reply path, answers in the command stream.

    Used from the worker's own thread only, in the function a command runs:
    the answer is read from the worker's command stream, which has one reader.

    Parameters
    ----------
    send : callable
        The worker's ``send(message)`` to the controller.
    read_reply : callable
        ``read_reply(match)``: the worker reads its command stream until a
        command for which ``match(cmd)`` is true, and returns it; the commands
        read meanwhile run after the current one, in order
        (:meth:`~disco_core.worker.Worker.read_until`).
    """

    def __init__(self, send: Callable[[tuple], None], read_reply: Callable[[Callable[[tuple], bool]], tuple]) -> None:  # fmt: skip
        self._send, self._read = send, read_reply
        self._seq = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "<rendezvous store client (remote)>"

    def _request(self, op: str, key: Any, arg: Any) -> Any:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._send(("store", seq, op, key, arg))
            cmd = self._read(lambda c: len(c) == 4 and c[1] == seq)
        _, _, ok, value = cmd
        if ok is True:
            return value
        # An error: ("timeout", seconds, missing keys), ("abort", reason) or ("value", text).
        if type(value) is not tuple or not value or value[0] not in ("timeout", "abort", "value"):
            raise DiscoError("rendezvous store: a malformed answer from the controller")
        if value[0] == "timeout" and len(value) == 3:
            missing = [k for k in value[2] if type(k) is str] if type(value[2]) is tuple else []
            raise _timeout_error(missing or ["?"], float(value[1]))
        text = str(value[1]) if len(value) > 1 else "?"
        if value[0] == "value":
            raise DiscoValueError(text)
        raise DiscoError(
            text if text.startswith("rendezvous store") else f"rendezvous store aborted: {text}"
        )

    def set(self, key: str, value: bytes) -> None:
        self._request("set", _check_key(key), _check_value(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        value = self._request("get", _check_key(key), _check_timeout(timeout))
        if type(value) is not bytes:
            raise DiscoError("rendezvous store: a malformed answer from the controller")
        return value

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._request("wait", _check_keys(keys), _check_timeout(timeout))

    def add(self, key: str, amount: int = 1) -> int:
        value = self._request("add", _check_key(key), _check_amount(amount))
        if type(value) is not int:
            raise DiscoError("rendezvous store: a malformed answer from the controller")
        return value
