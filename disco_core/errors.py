"""Exception types of Disco. Every error the runtime raises is a :class:`DiscoError`."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "DiscoError",
    "WorkerError",
    "WorkerDiedError",
    "WorkerUnresponsiveError",
    "PluginNotFoundError",
    "PluginConflictError",
    "PluginLoadError",
    "SessionClosedError",
    "CCLError",
    "CCLTimeoutError",
    "NetworkError",
    "AuthenticationError",
    "IntegrityError",
    "FrameLimitError",
    "InsecureBindError",
    "UntrustedValueError",
    "DiscoValueError",
    "DiscoTypeError",
    "DiscoKeyError",
    "DiscoFileNotFoundError",
    "DiscoModuleNotFoundError",
    "DiscoPermissionError",
    "DiscoTimeoutError",
    "StoreTimeoutError",
    "UnsupportedPlatformError",
    "FOLLOW_ON_NOTE",
    "is_follow_on",
]


class DiscoError(RuntimeError):
    """Base class of every error raised by Disco."""


class UnsupportedPlatformError(DiscoError):
    """Disco runs on Linux only (memfd_create, futex, splice, /proc); raised on import elsewhere."""


class WorkerError(DiscoError):
    """An exception raised inside a worker, surfaced at the controller.

    When the remote exception is itself a Disco error (``CCLTimeoutError``,
    ``CCLError``, ``DiscoValueError``, a plugin's own ``DiscoError`` subclass), the
    error raised at the controller is also an instance of that type:
    ``except disco.CCLTimeoutError`` catches a collective that timed out on a
    worker, with ``worker_id`` and ``remote_traceback`` still at hand.

    Parameters
    ----------
    worker_id : int
        The worker on which the exception was raised.
    exc_type : str
        The remote exception's type name (``"ValueError"``, ``"numpy.AxisError"``).
    message : str
        The remote exception's message.
    remote_traceback : str
        The formatted traceback, as the worker printed it.
    others : list of WorkerError, optional
        Further errors that were pending at the same synchronising call.
    """

    def __new__(cls, worker_id: int = 0, exc_type: str = "", *args: object, **kwargs: object):
        if cls is WorkerError and exc_type:
            cls = _remote_class(exc_type)
        new = cls.__dict__.get("_base_new")
        return new(cls) if new is not None else super().__new__(cls)

    def __init__(
        self,
        worker_id: int,
        exc_type: str,
        message: str,
        remote_traceback: str = "",
        others: Iterable[WorkerError] = (),
    ) -> None:
        self.worker_id = worker_id
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.others = list(others)
        text = f"worker {worker_id} raised {exc_type}: {message}"
        # Follow-on errors (a register left empty by an earlier failure) would bury the
        # cause: they are counted, not quoted; ``others`` still holds every one.
        causes = [e for e in self.others if not is_follow_on(e)]
        if causes:
            key = _gist(worker_id, exc_type, message)
            same = [
                e.worker_id
                for e in causes
                if _gist(e.worker_id, e.exc_type, e.remote_message) == key
            ]
            parts = (
                [f"the same on worker{'s' if len(same) > 1 else ''} {', '.join(map(str, same))}"]
                if same
                else []
            )
            parts += [
                f"worker {e.worker_id} {e.exc_type}: {e.remote_message}"
                for e in causes
                if _gist(e.worker_id, e.exc_type, e.remote_message) != key
            ][:4]
            text += f"\n(and {len(causes)} more: {'; '.join(parts)})"
        follow = len(self.others) - len(causes)
        if follow:
            text += (
                f"\n({follow} follow-on error{'s' if follow > 1 else ''} not shown: registers "
                "that hold no value because a command above failed; see .others)"
            )
        if remote_traceback:
            text += f"\n--- remote traceback (worker {worker_id}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        # Always rebuilt as WorkerError: __new__ picks the typed subclass again, so a
        # pickle never names a class made at run time.
        return (
            WorkerError,
            (
                self.worker_id,
                self.exc_type,
                self.remote_message,
                self.remote_traceback,
                self.others,
            ),
        )


#: What a worker's message says when a register holds no value because an earlier
#: command failed: the error is a consequence, and its cause was reported on its own.
FOLLOW_ON_NOTE = "because an earlier command failed"


def is_follow_on(error: WorkerError) -> bool:
    """Whether ``error`` only follows from an earlier failure reported on its own."""
    return FOLLOW_ON_NOTE in error.remote_message


def _gist(worker_id: int, exc_type: str, message: str) -> tuple[str, str]:
    """An error's type and message with its worker's id left out (the same error elsewhere)."""
    return exc_type, message.replace(f"worker {worker_id}", "worker *")


_REMOTE_CLASSES: dict[type, type] = {}


def _remote_class(exc_type: str) -> type[WorkerError]:
    """The WorkerError subclass for a remote exception named ``exc_type``.

    ``exc_type`` is the worker's name for its exception's type: the bare name for
    the built-ins and ``disco_core.errors``, ``module.QualName`` otherwise. Only a
    :class:`DiscoError` subclass of a module this process has already imported is
    looked up (nothing is imported or called on behalf of a name that came from
    a worker); anything else stays a plain :class:`WorkerError`.
    """
    module, _, name = exc_type.rpartition(".")
    source = sys.modules.get(module or __name__)
    target = getattr(source, name, None) if source is not None and name.isidentifier() else None
    if (
        not isinstance(target, type)
        or not issubclass(target, DiscoError)
        or issubclass(target, (WorkerError, WorkerDiedError))
    ):
        return WorkerError
    cls = _REMOTE_CLASSES.get(target)
    if cls is None:
        try:
            cls = type(
                f"Worker{target.__name__}",
                (WorkerError, target),
                {"__module__": __name__},
            )
            cls._base_new = staticmethod(_layout_new(cls))  # type: ignore[attr-defined]
        except TypeError:  # a layout no subclass can combine with WorkerError
            cls = WorkerError
        _REMOTE_CLASSES[target] = cls
    return cls


def _layout_new(cls: type) -> Callable[..., Any]:
    """The built-in ``__new__`` that lays out ``cls`` (``OSError``'s for a TimeoutError).

    Python only allows the ``__new__`` of a class's solid base; which one that is
    is not exposed, so the candidates are tried in order.
    """
    for base in cls.__mro__:
        new = base.__dict__.get("__new__")
        if new is None or base.__module__ != "builtins":
            continue
        try:
            new(cls)
        except TypeError:
            continue
        return new
    raise TypeError(f"no built-in __new__ fits {cls.__name__}")


class WorkerDiedError(DiscoError):
    """One or more workers died (killed, crashed, or their node disconnected).

    Parameters
    ----------
    worker_ids : list of int
        The workers that are gone.
    reason : str
        What is known about how they died (exit code, signal, lost connection).
    given_up : bool
        They may still run, but the session gave them up: their command stream was
        cut (a signal handler's exception in the middle of a write), so they can no
        longer be trusted to agree on what ran. The message says so, not "died".
    """

    _what = "died"

    def __init__(self, worker_ids: Iterable[int], reason: str = "", *, given_up: bool = False) -> None:  # fmt: skip
        self.worker_ids = sorted(set(worker_ids))
        self.reason = reason
        self.given_up = given_up
        many = len(self.worker_ids) != 1
        what = ("were given up" if many else "was given up") if given_up else self._what
        text = f"worker{'s' if many else ''} {', '.join(map(str, self.worker_ids))} {what}"
        if reason:
            text += f": {reason}"
        text += "; the session can no longer run commands (shutdown() still works)"
        super().__init__(text)

    def __reduce__(self):
        if self.given_up:
            return (functools.partial(type(self), given_up=True), (self.worker_ids, self.reason))
        return (type(self), (self.worker_ids, self.reason))


class WorkerUnresponsiveError(WorkerDiedError):
    """Workers stopped answering: frozen, stopped, swapped out, or stuck.

    A process or socket worker is unresponsive when nothing (not even its
    once-a-second heartbeat) arrived from it for ``DISCO_LIVENESS_TIMEOUT``
    seconds, judged while the controller waits on a worker or a send to it does
    not end; any worker is when it did not catch up
    within ``DISCO_GATHER_TIMEOUT`` seconds after another worker's failure. The
    session then ends as after a death: ``shutdown()`` kills what does not stop.

    Attributes
    ----------
    errors : list of WorkerError
        The worker errors gathered before giving up on the unresponsive workers.
    """

    _what = "stopped answering"

    def __init__(
        self, worker_ids: Iterable[int], reason: str = "", errors: Iterable[WorkerError] = ()
    ) -> None:
        self.errors = list(errors)
        if self.errors:
            reason += "; before that: " + "; ".join(
                f"worker {e.worker_id} raised {e.exc_type}: {e.remote_message}"
                for e in self.errors[:4]
            )
        super().__init__(worker_ids, reason)

    def __reduce__(self):
        return (type(self), (self.worker_ids, self.reason))


class PluginNotFoundError(DiscoError, LookupError):
    """A channel, CCL or module loader was asked for by a name nobody registered."""


class PluginConflictError(DiscoError):
    """Two plugins registered the same name for the same kind of component."""


class PluginLoadError(DiscoError, ImportError):
    """A plugin's entry point failed to import."""


class SessionClosedError(DiscoError):
    """A session was used after :meth:`Session.shutdown`."""


class CCLError(DiscoError):
    """A collective operation failed (mismatched buffers, no CCL initialised, ...)."""


class CCLTimeoutError(CCLError, TimeoutError):
    """A collective operation waited longer than the CCL's timeout for its peers."""


class NetworkError(DiscoError, ConnectionError):
    """A link to another process or machine broke or misbehaved."""


class AuthenticationError(NetworkError, PermissionError):
    """A peer did not prove that it holds the token (or refused this side's proof)."""


class IntegrityError(NetworkError):
    """A protected record failed its check: it was altered, injected, reordered or replayed.

    The connection it came on must be dropped: nothing after it can be trusted.
    """


class FrameLimitError(NetworkError, ValueError):
    """A peer declared a frame, field or count over the limit this side accepts."""


class InsecureBindError(DiscoError, PermissionError):
    """A service was asked to listen beyond loopback with neither a token nor TLS that
    requires client certificates."""


class UntrustedValueError(NetworkError, ValueError):
    """A frame from a network peer is not a well-formed frame of the network format.

    Frames that cross a socket are in a tagged format (:mod:`disco_core.wire_values`)
    that can hold only plain values, NumPy arrays, dtypes, devices, register
    references and worker errors; nothing from a socket is ever unpickled.
    """


# The standard library's meaning with Disco's base: ``except ValueError`` and
# ``except disco.DiscoError`` both catch a DiscoValueError. Plugins raise these
# (or their own DiscoError subclasses), never a bare built-in exception.
class DiscoValueError(DiscoError, ValueError):
    """A value was wrong (an argument, a setting, a field of a message)."""


class DiscoTypeError(DiscoError, TypeError):
    """An argument or value was of the wrong type."""


class DiscoKeyError(DiscoError, KeyError):
    """A name was not found (a function of a module, an entry of a table)."""

    def __str__(self) -> str:  # KeyError quotes its message; an error message should not
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class DiscoFileNotFoundError(DiscoError, FileNotFoundError):
    """A file that was named does not exist."""


class DiscoModuleNotFoundError(DiscoError, ModuleNotFoundError):
    """A module that was named cannot be imported (``import_python_module``)."""

    def __init__(self, message: str, name: str | None = None) -> None:
        ModuleNotFoundError.__init__(self, message, name=name)


class DiscoPermissionError(DiscoError, PermissionError):
    """An operation is not allowed (a path outside the work folder, a refused bind)."""


class DiscoTimeoutError(DiscoError, TimeoutError):
    """A wait ran past its bound."""


class StoreTimeoutError(DiscoTimeoutError):
    """A rendezvous store's ``get`` or ``wait`` ran past its timeout.

    Attributes
    ----------
    missing : tuple of str
        The keys still not set when the wait gave up.
    """

    def __init__(self, message: str, missing: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)

    def __reduce__(self):
        return (type(self), (str(self), self.missing))
