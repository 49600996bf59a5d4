"""The interface every collective communication library (CCL) implements.

A CCL has two halves:

* the controller half, :meth:`CCL.rendezvous`, runs once in ``Session.init_ccl``
  and makes what the workers need to meet (a shared-memory segment, an NCCL
  unique id, MPI port names). It returns a :class:`Rendezvous` whose ``payload``
  reaches every worker, and which the session aborts when a worker dies and
  closes at shutdown;
* the worker half, an instance of the CCL class on every worker, runs the
  operations. A CCL whose construction waits for every worker (NCCL's
  ``ncclCommInitRank``) also overrides :meth:`CCL.preflight`: the session runs it on
  every worker, and raises what failed, before any worker starts waiting.

The contract every implementation honours (``disco_core.testing.ccl_kit`` checks it):

* collectives are called on every member of the communicator (all workers, or the
  worker's group when ``in_group``), in the same order;
* when any member's arguments are wrong (a missing array, mismatched shape or
  dtype, a size that does not divide, an unknown ``op``), **every** member raises a
  :class:`~disco_core.errors.CCLError` that names the problem, at once; nobody waits
  for a peer that gave up (:mod:`disco_core.ccl.validate` exchanges a descriptor of
  each member's arguments and runs the same check everywhere);
* a member whose buffer is a failed register (a
  :class:`~disco_core.worker.MissingValue`: the command that should have made it
  raised on that worker) still takes part: it publishes that failure in its
  descriptor, and every member raises, instead of the others waiting for it;
* an operation that waits longer than the CCL's timeout raises
  :class:`~disco_core.errors.CCLTimeoutError`; an aborted rendezvous (a dead peer)
  makes waiting members raise promptly;
* after a timeout no operation completes any more: the session calls
  :meth:`CCL.poison` on every worker before it reports the timeout to the user, so
  no member can complete a later collective against what a timed-out member
  abandoned.

Argument conventions follow TVM's ``disco`` builtins: ``src`` and ``dst`` are
arrays (NumPy on cpu), ``None`` where TVM passes an empty ``Optional``; the
"root" of a communicator is its first worker (worker 0, or the group's first).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import _interrupts

if TYPE_CHECKING:  # pragma: no cover
    from ..channels.base import Channel
    from ..worker import WorkerContext

__all__ = ["CCL", "Rendezvous", "REDUCE_OPS", "average_in_place"]

#: Reduction operators, in TVM's ``ReduceKind`` order.
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")


def average_in_place(total: Any, n: int) -> None:
    """Turn ``total``, the members' sum in its own dtype, into their ``avg``, in place.

    Floating dtypes: ``total / n`` rounded to the dtype. Integer dtypes follow
    NCCL's ``ncclAvg`` (a sum, then a division by the member count): the quotient
    truncated toward zero, exactly (no detour through floating point, which would
    round large ``int64`` values).

    Parameters
    ----------
    total : numpy.ndarray
        The sum (wrapped in the dtype, as the CCL computed it); overwritten.
    n : int
        The number of members.
    """
    dt = total.dtype
    if dt.kind not in "iu":
        np.true_divide(total, n, out=total, casting="unsafe")
        return
    if n == 1:
        return
    if n > np.iinfo(dt).max:  # |total| < n: every quotient truncates to zero
        total[...] = 0
        return
    d = dt.type(n)
    # total - fmod(total, n) is an exact multiple of n nearer zero (no overflow),
    # so the floor division that follows is exact and truncates toward zero.
    np.subtract(total, np.fmod(total, d), out=total)
    np.floor_divide(total, d, out=total)


class Rendezvous:
    """The controller's half of a CCL: what workers need to meet, and its clean-up.

    Parameters
    ----------
    payload : object
        Picklable data sent to every worker's CCL constructor.
    """

    def __init__(self, payload: Any = None) -> None:
        self.payload = payload

    def abort(self, reason: str) -> None:
        """Make every worker waiting fail promptly: in a collective, or in its constructor.

        The session calls it when a worker dies, when one worker's CCL constructor
        fails (the others may be waiting for it to join), and at shutdown. A CCL
        whose constructor waits for its peers must watch for it there too.
        """

    def workers_lost(self, worker_ids: Sequence[int], reason: str) -> None:
        """Workers died, stopped answering or were given up: by default :meth:`abort`.

        The session calls it, rather than ``abort``, when it loses workers (once per
        loss, from the thread that noticed it, so it must not block). A CCL whose
        surviving workers wait where the controller cannot reach them overrides it to
        tell them, knowing whom not to address (``mpi`` sends them its alarm).

        Parameters
        ----------
        worker_ids : sequence of int
            The workers lost this time.
        reason : str
            Why, as the session reports it.
        """
        self.abort(f"worker(s) {list(worker_ids)} died: {reason}")

    def close(self) -> None:
        """Release what :meth:`CCL.rendezvous` made (called once, at shutdown)."""


#: The operations that wait for other workers (see ``CCL.__init_subclass__``).
WAITING_OPS = (
    "allreduce",
    "allgather",
    "broadcast",
    "scatter",
    "gather",
    "send",
    "recv",
    "barrier",
)


def _hands_over_first(op: Callable) -> Callable:
    """``op``, after the worker's ``ctx.hand_over()`` (when it has one)."""

    @functools.wraps(op)
    def waiting_op(self: CCL, *args: Any, **kwargs: Any) -> Any:
        ctx = self.ctx
        hand_over = getattr(ctx, "hand_over", None)  # a test's stand-in ctx may lack it
        tracer = getattr(ctx, "tracer", None)
        try:
            if tracer is not None:  # a trace is on (disco_core.tracing): record the operation
                return tracer.collective(self, op, hand_over, args, kwargs)
            if hand_over is not None:
                hand_over()
            return op(self, *args, **kwargs)
        except BaseException as exc:
            cut_short(self, op.__name__, exc)
            raise

    waiting_op.__disco_hands_over__ = True  # type: ignore[attr-defined]
    return waiting_op


def cut_short(ccl: CCL, op: str, exc: BaseException) -> None:
    """``ccl``'s operation ``op`` was left by ``exc``: if that is not the operation's
    own error but an interrupt (Ctrl-C's ``KeyboardInterrupt``, or a signal handler's
    exception such as a ``SIGALRM`` timeout's, in worker 0, whose commands run on the
    controller's thread), tell it (:meth:`CCL.interrupted`, whose own failure is
    dropped: ``exc`` goes on). An error is the operation's own: every member met it,
    or its peers fail in their turn; nothing to do."""
    if isinstance(exc, Exception) and not _interrupts.raised_by_signal_handler(exc):
        return
    try:
        ccl.interrupted(f"{op} on worker {ccl.ctx.worker_id} was cut short ({type(exc).__name__})")
    except Exception:  # noqa: BLE001, S110 - the interrupt is what the caller must see
        pass


class CCL(abc.ABC):
    """The worker's half of a collective library.

    Every operation that waits for other workers (``WAITING_OPS``) first calls
    ``ctx.hand_over()`` when the worker has one: a worker in the controller's
    process may run on the controller's own thread while the channel still holds
    back the other workers' commands (it writes them in batches), and they must
    have them before anyone waits for them. Subclasses get this by themselves
    (``__init_subclass__`` wraps their operations), so a plugin cannot forget it.

    Parameters
    ----------
    ctx : WorkerContext
        The worker this instance serves (id, group, device).
    payload : object
        The ``payload`` of the :class:`Rendezvous` the controller made.
    device_ids : tuple of int
        The ``init_ccl`` device ids.
    **options
        The ``init_ccl`` keyword options.
    """

    #: The registered name (``"shm"``, ``"mpi"``, ...).
    name: ClassVar[str] = "?"

    #: Why every operation is refused (set by :meth:`poison`); empty while usable.
    poisoned: str = ""

    def __init__(
        self, ctx: WorkerContext, payload: Any, device_ids: Sequence[int] = (), **options: Any
    ) -> None:
        self.ctx = ctx

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in WAITING_OPS:
            op = getattr(cls, name, None)  # also one inherited from a mixin that is no CCL
            if callable(op) and not getattr(op, "__disco_hands_over__", False):
                if not getattr(op, "__isabstractmethod__", False):
                    setattr(cls, name, _hands_over_first(op))

    @classmethod
    def rendezvous(cls, channel: Channel, device_ids: Sequence[int], **options: Any) -> Rendezvous:
        """Controller side: prepare the meeting of the workers (see :class:`Rendezvous`)."""
        return Rendezvous()

    @classmethod
    def preflight(
        cls, ctx: WorkerContext, payload: Any, device_ids: Sequence[int], **options: Any
    ) -> None:
        """Worker side, before any worker constructs its CCL: raise what would fail here.

        A CCL whose construction blocks until every worker has joined (NCCL's
        ``ncclCommInitRank``, for one) overrides this with the checks that can fail on
        one worker only (a missing library, a device the machine lacks): the session
        runs it on every worker, and raises their errors, before any of them starts
        waiting for the others. The default does nothing and costs nothing.
        """

    # ---- helpers ---------------------------------------------------------------------
    def members(self, in_group: bool) -> range:
        """Global worker ids of the communicator this worker uses for ``in_group``."""
        ctx = self.ctx
        if not in_group:
            return range(ctx.num_workers)
        start = ctx.group_id * ctx.group_size
        return range(start, start + ctx.group_size)

    # ---- collectives -------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce(self, src: Any, dst: Any, op: str, in_group: bool) -> None:
        """``dst = reduce(op, src of every member)`` on every member."""

    @abc.abstractmethod
    def allgather(self, src: Any, dst: Any, in_group: bool) -> None:
        """``dst = concatenate(src of every member, axis 0)`` on every member."""

    @abc.abstractmethod
    def broadcast(self, src: Any, dst: Any, in_group: bool) -> None:
        """``dst = src of the root`` on every member (``src`` may be None elsewhere)."""

    @abc.abstractmethod
    def scatter(self, src: Any, dst: Any, in_group: bool) -> None:
        """Member ``r`` of ``n`` gets the ``r``-th of ``n`` equal pieces of the root's ``src``."""

    @abc.abstractmethod
    def gather(self, src: Any, dst: Any, in_group: bool) -> None:
        """The root's ``dst`` gets every member's ``src`` concatenated (``dst`` may be None elsewhere)."""

    @abc.abstractmethod
    def send(self, buf: Any, peer: int) -> None:
        """Send ``buf`` to worker ``peer`` (global id)."""

    @abc.abstractmethod
    def recv(self, buf: Any, peer: int) -> None:
        """Receive into ``buf`` (in place) what worker ``peer`` sent."""

    @abc.abstractmethod
    def barrier(self, in_group: bool = False) -> None:
        """Wait until every member arrived."""

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> Any | None:
        """An array for ``disco.empty`` that this CCL moves faster, or None (the default).

        The ``shm`` CCL hands out large arrays from shared memory its peers map, so
        collectives on them need no staging copies.
        """
        return None

    def synchronize(self) -> None:
        """Wait for this worker's queued device work (GPU streams); a no-op on the CPU.

        Called when the controller synchronises with the worker (``sync_worker_0``).
        """

    def interrupted(self, reason: str) -> None:
        """An operation of this worker was left half done by an exception that is not its
        error (Ctrl-C's ``KeyboardInterrupt``, or a signal handler's exception, in worker
        0, which runs on the controller's thread): its peers may wait for it until their
        timeout, and its next operation would meet theirs out of step.

        The default refuses every later operation (:meth:`poison`). A CCL that can make
        its peers' waits fail at once does that too (``shm`` aborts its segment: every
        member's wait fails with :class:`~disco_core.errors.CCLError` naming
        ``reason``).
        """
        self.poison(reason)

    def call_failed(self, call: int, error: str) -> None:
        """This worker's ``call_packed`` number ``call`` (:attr:`WorkerContext.calls
        <disco_core.worker.WorkerContext>`, the same on every worker) raised ``error``.

        Peers that wait for this worker in an operation of that same call will never
        see it come. The default does nothing: they wait until their timeout. A CCL
        that can end their waits does so, naming ``error`` (``shm`` fails each such
        wait at once and gives its segment up, as for a timeout; ``mpi`` sends each
        member a notice, and gives the CCL up where a member waited).
        """

    def poison(self, reason: str) -> None:
        """Refuse every later operation: a member's operation failed beyond repair.

        The session calls it on every worker (through the ``disco.ccl_poison``
        builtin) when a worker reported a :class:`~disco_core.errors.CCLTimeoutError`,
        before the user sees that error: a member that gave up left an operation
        behind that its peers could otherwise still match. The built-in collectives
        then raise :class:`~disco_core.errors.CCLError` naming ``reason``; a CCL that
        keeps its own broken state may override this to set it too.
        """
        self.poisoned = reason

    def close(self) -> None:
        """Release this worker's resources (called once, at shutdown)."""
