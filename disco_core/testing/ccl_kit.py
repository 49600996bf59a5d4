"""The CCL conformance kit: :class:`CCLContract`.

Any collective library (the core's ``shm``; disco-mpi's ``mpi``, disco-nccl's
``nccl``, disco-rccl's ``rccl``; a third party's) subclasses :class:`CCLContract`
and provides one fixture, ``make_session``, returning a factory

    ``make_session(num_workers, num_groups=1, **ccl_options) -> disco_core.Session``

whose session already ran ``init_ccl`` (with ``ccl_options`` passed on). The kit
shuts the sessions down itself; it reuses a healthy session across the tests of a
class (a test that fails, or that breaks its session on purpose, gets a new one).

What the kit checks: every collective of the session (``allreduce`` with every op,
``allgather``, ``broadcast_from_worker0``, ``scatter_from_worker0``,
``gather_to_worker0``, ``send_to_worker``/``recv_from_worker``,
``recv_from_worker0``, ``send_to_next_group``/``recv_from_prev_group``,
``barrier``, and the controller's ``broadcast(array)`` and ``scatter(array)``), in
and across groups of every size dividing ``num_workers``, for every dtype, at
tiny, empty, odd and multi-round sizes, with results **bit-identical** to a NumPy
reference; and the failure cases: mismatched calls, wrong sizes, bad peers, a
failed register, no CCL, a dead worker, a timeout. None may hang, and the session
works afterwards. For a GPU CCL (one that makes the workers' default device a GPU)
the arrays the kit makes live on each worker's GPU (CuPy arrays); results are
compared on the host.

The reference semantics (what every CCL promises):

* ``allreduce`` combines the members' arrays in rank order,
  ``functools.reduce(ufunc, [x0, x1, ...])`` elementwise in the array's dtype
  (``np.add``, ``np.multiply``, ``np.minimum``, ``np.maximum``); ``avg`` is that sum
  divided by the member count in the array's dtype, on integers truncated toward
  zero as NCCL's ``ncclAvg`` does (on bool it is a :class:`~disco_core.errors.CCLError`);
* ``allgather`` and ``gather_to_worker0`` concatenate along axis 0 in rank order;
  ``scatter_from_worker0`` gives member ``r`` the ``r``-th equal piece of the root's
  flat ``src``; ``broadcast_from_worker0`` copies the root's ``src``; the root of a
  communicator is worker 0 (``in_group=False``) or the group's first worker;
* wrong use raises :class:`~disco_core.errors.CCLError` on every member of the
  communicator (surfacing at the controller as :class:`~disco_core.errors.WorkerError`).

The class attributes that tell the kit what a CCL supports are listed in
:class:`CCLContract`'s docstring (``help(CCLContract)``).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import disco_core as disco
from disco_core.testing.ccl_funcs import (
    FUNCS_MODULE,
    faulty_ccl_name,
    make_input,
    register_faulty_ccl,
)
from disco_core.testing.procfs import children_of, shm_in_use
from disco_core.testing.trace_checks import load_trace, worker_events

__all__ = ["CCLContract", "DTYPES", "FUNCS_MODULE", "reference_allreduce", "make_input"]

#: Every dtype the kit knows.
DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
OPS = ("sum", "prod", "min", "max", "avg")
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


# ---------------------------------------------------------------------------- references
def reference_allreduce(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """``functools.reduce(ufunc, xs)`` in the arrays' dtype; ``avg`` = that sum / len(xs).

    On integers ``avg`` is NCCL's: the (wrapped) sum divided by ``len(xs)``,
    truncated toward zero (computed here on Python ints, exactly).
    """
    with np.errstate(all="ignore"):
        acc = functools.reduce(_UFUNCS["sum" if op == "avg" else op], xs)
        acc = np.array(acc, copy=True)
        if op == "avg" and acc.dtype.kind in "iu":
            n = len(xs)
            flat = [abs(v) // n * (1 if v >= 0 else -1) for v in acc.reshape(-1).tolist()]
            acc = np.array(flat, dtype=acc.dtype).reshape(acc.shape)
        elif op == "avg":
            np.true_divide(acc, len(xs), out=acc, casting="unsafe")
    return acc


def _members(worker: int, num_workers: int, num_groups: int, in_group: bool) -> list[int]:
    if not in_group:
        return list(range(num_workers))
    size = num_workers // num_groups
    start = worker // size * size
    return list(range(start, start + size))


def _comms(num_workers: int, num_groups: int, in_group: bool) -> list[list[int]]:
    if not in_group:
        return [list(range(num_workers))]
    size = num_workers // num_groups
    return [list(range(g * size, (g + 1) * size)) for g in range(num_groups)]


def _seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode())


def _bf16_available() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def assert_bits(got: Any, ref: np.ndarray, what: str) -> None:
    """``got`` has ``ref``'s dtype, shape and exact bytes."""
    assert isinstance(got, np.ndarray), f"{what}: expected an array, got {type(got).__name__}"
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype}, expected {ref.dtype}"
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    g = np.ascontiguousarray(got)
    r = np.ascontiguousarray(ref)
    if g.tobytes() == r.tobytes():
        return
    gb = g.reshape(-1).view(np.uint8).reshape(g.size, -1)
    rb = r.reshape(-1).view(np.uint8).reshape(r.size, -1)
    bad = np.flatnonzero((gb != rb).any(axis=1))
    i = int(bad[0])
    pytest.fail(
        f"{what}: {len(bad)} of {g.size} elements differ from the NumPy reference; "
        f"first at flat index {i}: got {g.reshape(-1)[i]!r}, expected {r.reshape(-1)[i]!r}"
    )


def _values(ref: disco.DRef, workers: Sequence[int]) -> dict[int, Any]:
    return {w: ref.debug_get_from_remote(w) for w in workers}


def _put(sess: disco.Session, ref: disco.DRef, worker: int, value: np.ndarray) -> disco.DRef:
    """``ref`` with worker ``worker``'s value replaced by ``value``, on that worker's device."""
    return sess.call_packed("ccl_kit.replace_on", ref, worker, value)


def _sync(sess: disco.Session) -> None:
    """Wait for every worker; raise their pending errors (WorkerError, WorkerDiedError)."""
    ref = sess.call_packed("ccl_kit.peer", "self")
    for w in range(sess.num_workers):
        assert ref.debug_get_from_remote(w) == w


def _default_ops(dtype: str) -> tuple[str, ...]:
    if dtype == "bool":
        return ("min", "max")  # logical and / or
    return OPS


_ALLREDUCE_CASES = [(op, dt) for op in OPS for dt in DTYPES if op in _default_ops(dt)]


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


def session_maker(
    session_cls: Callable[..., disco.Session], ccl: str, **fixed_options: Any
) -> Callable[..., disco.Session]:
    """A ``make_session`` for :class:`CCLContract`: ``session_cls`` with ``ccl`` initialised.

    ``fixed_options`` go to every ``init_ccl`` (e.g. ``ordered=True``), before the
    options a test asks for. A session whose ``init_ccl`` fails is shut down.
    """

    def make(num_workers: int, num_groups: int = 1, **options: Any) -> disco.Session:
        sess = session_cls(num_workers, num_groups=num_groups)
        try:
            sess.init_ccl(ccl, **{**fixed_options, **options})
        except BaseException:
            sess.shutdown()
            raise
        return sess

    # What the construction cases need to start the same session with another CCL.
    make.session_cls = session_cls  # type: ignore[attr-defined]
    make.ccl = ccl  # type: ignore[attr-defined]
    make.fixed_options = dict(fixed_options)  # type: ignore[attr-defined]
    return make


_STILL_WAITING = object()


def _bounded(call: Callable[[], Any], within: float) -> Any:
    """Run ``call`` on a helper thread; its exception (or result), or ``_STILL_WAITING``.

    A case that waits on a broken plugin then fails in ``within`` s, with a message
    that says what was waited for, instead of hanging until the test's timeout.
    """
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(exc)

    t = threading.Thread(target=run, name="ccl-kit-bounded", daemon=True)
    t.start()
    t.join(within)
    return box[0] if box else _STILL_WAITING


def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _resources() -> dict[str, Any]:
    """What this process holds that a session could leak."""
    fds = memfds = 0
    targets: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        fds += 1
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        targets.add(target)
        memfds += target.startswith("/memfd:")
    return {
        "threads": _threads(),
        "fds": fds,
        "memfds": memfds,
        "targets": targets,
        "children": children_of(os.getpid()),
        "shm": _shm_segments(),
    }


def _shm_segments() -> set[str]:
    """The files in /dev/shm (a segment is a file: a folder someone else made there
    while a test ran is not a leak; it failed the kit on a shared machine)."""
    try:
        return {e.name for e in os.scandir("/dev/shm") if e.is_file(follow_symlinks=False)}
    except OSError:
        return set()


def _fd_kind(target: str) -> str:
    """What an open file is, from its ``/proc/self/fd`` link (``socket``, ``pipe``, a path)."""
    kind = target.split(":", 1)[0]
    return kind if kind in ("socket", "pipe", "anon_inode", "/memfd") else target


def _leaks(before: dict[str, Any], fds: bool = True) -> list[str]:
    """What grew since ``before`` (threads, fds, memfds, children, unused /dev/shm segments).

    ``fds=False`` leaves out open files: a library's first use in a process (MPI's
    initialisation) opens some for good, so they are judged after a warm-up only.
    """
    now = _resources()
    out = []
    threads = [t.name for t in threading.enumerate() if t.ident not in before["threads"]]
    if threads:
        out.append(f"threads left running: {threads}")
    for what in ("fds", "memfds") if fds else ():
        if now[what] > before[what]:
            kinds = sorted({_fd_kind(t) for t in now["targets"] - before["targets"]})
            new = f"; new: {', '.join(kinds)}" if kinds else ""
            out.append(
                f"{now[what] - before[what]} more open {what} ({before[what]} -> {now[what]}{new})"
            )
    if now["children"] - before["children"]:
        out.append(f"child processes left: {sorted(now['children'] - before['children'])}")
    new_shm = now["shm"] - before["shm"]
    unused = new_shm - shm_in_use(new_shm)  # segments a live process holds are not ours to judge
    if unused:
        out.append(f"/dev/shm segments left behind: {sorted(unused)}")
    return out


def assert_nothing_left(
    before: dict[str, Any], what: str, within: float = 5.0, fds: bool = True
) -> None:
    """Within ``within`` s, everything made since ``before`` (see :func:`_leaks`) is gone."""
    deadline = time.monotonic() + within
    while True:
        leaks = _leaks(before, fds)
        if not leaks or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaks, f"{what}: " + "; ".join(leaks)


@pytest.mark.timeout(60)
class CCLContract:
    """The contract every CCL honours. Subclass it and provide ``make_session``.

    Class attributes a subclass may set:

    ``num_workers`` (int, default 4)
        The session size of most tests; every divisor is used as a group count.
    ``dtypes`` (tuple of str)
        The dtypes the CCL supports (default: all of :data:`DTYPES`); the others are
        skipped with a reason. ``bfloat16`` is skipped when ml_dtypes is missing.
    ``workers_are_processes`` (bool, default False)
        Workers 1..N-1 run in processes of their own, which the death tests end.
    ``death_timeout`` (float, default 5)
        Seconds within which a worker's death must surface as ``WorkerDiedError``.
    ``supports_empty_arrays`` (bool, default True)
        Whether 0-element arrays are tested.
    ``avg_exact`` (bool, default True)
        ``avg`` of floats is bit-identical to ``sum / n``; when False (NCCL pre-multiplies
        by ``1/n``) it is compared with a tolerance. ``avg`` of integers is always exact.
    ``small_round_options`` (dict or None)
        ``init_ccl`` options that make the CCL move little data per round, so that the
        multi-round tests exercise several rounds with small arrays (``shm``:
        ``{"slot_bytes": 4096, "mailbox_bytes": 4096}``). None: the multi-round tests
        use default options.
    ``multi_round_elements`` (int, default 5003)
        Elements per member in the multi-round tests.
    ``timeout_options`` (dict or None, default ``{"timeout": 1}``)
        ``init_ccl`` options giving a short collective timeout; None skips the timeout tests.
    ``buffered_send_bytes`` (int, default 0)
        Sends up to this size return before the matching receive runs; when positive
        the kit also drives ``send_to_worker``/``recv_from_worker`` straight from the
        controller (every worker sending, then every worker receiving).
    ``buffered_sends`` (int, default 1)
        Small sends (16 bytes) to one worker that return before it receives any;
        from 2 the kit checks that each worker can send that many to the next
        before it receives as many from the one before, in order (below 2, even
        workers send first).
    ``ccl_error_types`` (tuple of str)
        The remote exception type names accepted as "the CCL raised an error".
    ``odd_num_workers`` (int or None, default 3)
        An odd session size the kit also checks the collectives with (``avg`` computed
        as ``x * (1/n)`` is exact for 2 and 4 members, not for 3). None only where the
        hardware has fewer devices (one GPU per worker); the tests then skip and say so.
    ``wrong_use_options`` (dict or None)
        ``init_ccl`` options of the sessions the wrong-use tests run in: a collective
        timeout of a few seconds, so that a CCL which waits instead of refusing a wrong
        call fails its case in seconds. A member that times out there fails the case:
        wrong use must be refused at once, on every member. Default (None):
        ``timeout_options`` with its ``"timeout"`` key set to 5; a CCL whose timeout
        option has another name sets this itself (with ``timeout_options=None`` and no
        ``wrong_use_options``, the wrong-use cases wait as long as the CCL's default).
    ``construction_options`` (dict, default ``{}``)
        ``init_ccl`` options of the construction cases (one worker's constructor fails):
        e.g. a short connect timeout for a CCL whose joining peers cannot be released by
        :meth:`Rendezvous.abort` (they then fail by that timeout, within seconds).
    ``reinit_after_failed_init`` (bool, default True)
        After a failed ``init_ccl``, ``init_ccl`` works again on the same session. False
        for a CCL that cannot (MPI cannot cancel a pending connect: the session must be
        started anew).

    Besides results, the kit checks what a plugin leaves behind: no thread of a
    session, open file, memfd, ``/dev/shm`` segment or child process outlives its
    ``shutdown()`` (across several sessions, and after a peer died or froze in a
    collective), and that one worker failing in the CCL's constructor, or lacking the
    plugin, fails ``init_ccl`` within seconds. Worker 0 runs in the controller's
    process (as in TVM), so what its CCL leaks is what these checks see; the other
    workers' processes end with the session.

    The construction cases need a session with no CCL yet: a ``make_session`` built
    by :func:`session_maker` gives one; otherwise override the ``make_bare_session``
    fixture (``make_bare_session(num_workers) -> (session, ccl name, init_ccl
    options)``).
    """

    num_workers: int = 4
    dtypes: tuple[str, ...] = DTYPES
    workers_are_processes: bool = False
    death_timeout: float = 5.0
    supports_empty_arrays: bool = True
    avg_exact: bool = True
    small_round_options: dict | None = None
    multi_round_elements: int = 5003
    timeout_options: dict | None = {"timeout": 1}
    buffered_send_bytes: int = 0
    buffered_sends: int = 1
    ccl_error_types: tuple[str, ...] = ("CCLError", "CCLTimeoutError")
    odd_num_workers: int | None = 3
    wrong_use_options: dict | None = None
    construction_options: dict = {}  # noqa: RUF012 - read only
    reinit_after_failed_init: bool = True

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def make_session(self) -> Callable[..., disco.Session]:
        """Provided by the subclass: ``make_session(num_workers, num_groups=1, **ccl_options)``."""
        raise NotImplementedError(
            "a CCLContract subclass must define the make_session fixture"
        )  # pragma: no cover

    @pytest.fixture(scope="class")
    @classmethod
    def _ccl_pool(cls):
        pool: dict[tuple, disco.Session] = {}
        yield pool
        for sess in pool.values():
            sess.shutdown()

    @pytest.fixture
    def session(self, make_session, _ccl_pool, request):
        """``session(num_groups=1, num_workers=None, **ccl_options)``: a pooled session."""
        used: list[tuple] = []

        strict = request.node.originalname in self._WRONG_USE

        def get(num_groups: int = 1, num_workers: int | None = None, **options: Any):
            nw = self.num_workers if num_workers is None else num_workers
            if strict:
                options = {**self._wrong_use_options(), **options}
            key = (nw, num_groups, tuple(sorted(options.items())))
            sess = _ccl_pool.get(key)
            if sess is None or sess.is_closed:
                sess = make_session(nw, num_groups, **options)
                assert isinstance(sess, disco.Session)
                assert (sess.num_workers, sess.num_groups) == (nw, num_groups)
                sess.import_python_module(FUNCS_MODULE)
                _ccl_pool[key] = sess
            used.append(key)
            return sess

        failed = request.session.testsfailed
        yield get
        if request.session.testsfailed != failed or request.node.get_closest_marker("xfail"):
            for key in used:  # a failed test may leave its sessions in any state
                sess = _ccl_pool.pop(key, None)
                if sess is not None:
                    sess.shutdown()

    @pytest.fixture
    def fresh_session(self, make_session):
        """``fresh_session(num_workers=None, num_groups=1, **ccl_options)``: not shared."""
        made: list[disco.Session] = []

        def get(num_workers: int | None = None, num_groups: int = 1, **options: Any):
            nw = self.num_workers if num_workers is None else num_workers
            sess = make_session(nw, num_groups, **options)
            made.append(sess)
            sess.import_python_module(FUNCS_MODULE)
            return sess

        yield get
        for sess in made:
            sess.shutdown()

    # ------------------------------------------------------------------ helpers
    def layouts(self) -> list[int]:
        """The group counts the tests run with (every divisor of ``num_workers``)."""
        return _divisors(self.num_workers)

    def grouped(self) -> int:
        """The smallest group count above 1 (1 for a one-worker session)."""
        layouts = self.layouts()
        return layouts[1] if len(layouts) > 1 else 1

    #: Tests that need a peer: point-to-point, or one worker differing from another.
    _NEEDS_TWO = frozenset({
        "test_multi_round", "test_send_recv_ring", "test_send_recv_sizes",
        "test_send_recv_pairs_both_ways", "test_send_recv_builtins_from_controller",
        "test_mismatched_buffers", "test_mismatched_operations", "test_recv_buffer_mismatch",
        "test_collective_on_failed_register", "test_worker_death_during_collective",
        "test_collective_timeout", "test_collective_after_timeout_fails_everywhere",
        "test_send_recv_with_a_register_that_holds_nothing",
        "test_an_array_in_the_other_byte_order",
        "test_several_messages_to_one_worker_arrive_in_order",
    })  # fmt: skip

    #: Tests of wrong calls: they run with :attr:`wrong_use_options` (a short timeout).
    _WRONG_USE = frozenset({
        "test_mismatched_buffers", "test_mismatch_in_one_group_only",
        "test_mismatched_operations", "test_not_an_array", "test_scatter_not_divisible",
        "test_allgather_dst_too_small", "test_gather_root_without_dst",
        "test_avg_of_bool_is_an_error", "test_unknown_reduce_op", "test_self_send",
        "test_out_of_range_peer", "test_recv_buffer_mismatch",
        "test_collective_on_failed_register", "test_no_next_or_previous_group",
        "test_send_recv_with_a_register_that_holds_nothing",
        "test_an_array_in_the_other_byte_order",
    })  # fmt: skip

    def _wrong_use_options(self) -> dict:
        if self.wrong_use_options is not None:
            return dict(self.wrong_use_options)
        if self.timeout_options and "timeout" in self.timeout_options:
            return {**self.timeout_options, "timeout": 5}
        return dict(self.timeout_options or {})

    @pytest.fixture(autouse=True)
    def _enough_workers(self, request):
        """One-worker sessions (one GPU) run every test that needs no peer."""
        if self.num_workers < 2 and request.node.originalname in self._NEEDS_TWO:
            pytest.skip("needs two workers or more (this session has one)")

    def need_dtype(self, dtype: str) -> None:
        if dtype not in self.dtypes:
            pytest.skip(f"{dtype} is not supported by this CCL")
        if dtype == "bfloat16" and not _bf16_available():
            pytest.skip("bfloat16 needs ml_dtypes (pip install ml_dtypes)")

    def reduce_ops(self, dtype: str) -> tuple[str, ...]:
        """The ops tested on ``dtype``: all on numbers; min/max on bool.

        Override to leave out ops the CCL lacks (the others are skipped).
        """
        return _default_ops(dtype)

    def inputs(self, shape: Any, dtype: str, seed: int) -> list[np.ndarray]:
        return [make_input(shape, dtype, seed, w) for w in range(self.num_workers)]

    def check_allreduce(self, got: Any, xs: list[np.ndarray], op: str, what: str) -> None:
        ref = reference_allreduce(xs, op)
        if op == "avg" and not self.avg_exact and ref.dtype.kind not in "iu":
            assert got.dtype == ref.dtype and got.shape == ref.shape, what
            tol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6}.get(str(ref.dtype), 1e-12)
            np.testing.assert_allclose(
                got.astype("float64"), ref.astype("float64"), rtol=tol, atol=tol, err_msg=what
            )
            return
        assert_bits(got, ref, what)

    def expect_ccl_error(
        self, sess: disco.Session, workers: Sequence[int], pattern: str = ""
    ) -> list[disco.WorkerError]:
        """The next sync raises a WorkerError whose CCL errors cover ``workers``.

        ``pattern`` (a case-insensitive regex) must match each of those errors' message.
        A wrong call is refused at once: a worker that timed out instead fails the test.
        """
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerError) as info:
            _sync(sess)
        took = time.monotonic() - t0
        assert took < 30, f"the error took {took:.1f} s to surface"
        return self.check_ccl_error(info.value, workers, pattern)

    def check_ccl_error(
        self,
        exc: disco.WorkerError,
        workers: Sequence[int],
        pattern: str = "",
        timeout_ok: bool = False,
    ) -> list[disco.WorkerError]:
        """``exc`` (and its ``others``) hold a CCL error of each of ``workers`` matching ``pattern``.

        Unless ``timeout_ok``, none of those errors may be a ``CCLTimeoutError``: a
        member that waited for its peers until the timeout did not refuse the call.
        """
        errors = [exc, *exc.others]
        ccl = [e for e in errors if e.exc_type.rsplit(".", 1)[-1] in self.ccl_error_types]
        raised = {e.worker_id for e in ccl}
        summary = "; ".join(
            f"worker {e.worker_id} {e.exc_type}: {e.remote_message}" for e in errors
        )
        assert set(workers) <= raised, (
            f"expected a CCL error on workers {sorted(workers)}, got: {summary}"
        )
        if not timeout_ok:
            waited = sorted(
                e.worker_id
                for e in ccl
                if e.worker_id in workers and e.exc_type.endswith("CCLTimeoutError")
            )
            assert not waited, (
                f"workers {waited} waited for their peers until the collective timed out "
                f"instead of refusing the wrong call at once (every member must check the "
                f"call and fail together): {summary}"
            )
        for e in ccl:
            if e.worker_id in workers and pattern:
                assert re.search(pattern, e.remote_message, re.I), (
                    f"worker {e.worker_id}'s error does not name the problem ({pattern!r}): "
                    f"{e.remote_message}"
                )
        return errors

    def assert_usable(self, sess: disco.Session, seed: int = 7) -> None:
        """The session's CCL still gives right answers (world and each group)."""
        _sync(sess)
        src = sess.call_packed("ccl_kit.input", (5,), "float32", seed)
        dst = sess.empty((5,), "float32")
        xs = self.inputs((5,), "float32", seed)
        for in_group in (False, True):
            sess.allreduce(src, dst, "sum", in_group=in_group)
            for w, got in _values(dst, range(sess.num_workers)).items():
                members = _members(w, sess.num_workers, sess.num_groups, in_group)
                self.check_allreduce(got, [xs[m] for m in members], "sum", "after the error")

    # ------------------------------------------------------------------ allreduce
    @pytest.mark.parametrize(("op", "dtype"), _ALLREDUCE_CASES)
    def test_allreduce(self, session, op, dtype):
        self.need_dtype(dtype)
        if op not in self.reduce_ops(dtype):
            pytest.skip(f"allreduce {op} is not defined on {dtype}")
        shape = (7, 3)
        seed = _seed("allreduce", op, dtype)
        xs = self.inputs(shape, dtype, seed)
        for groups in self.layouts():
            sess = session(groups)
            src = sess.call_packed("ccl_kit.input", shape, dtype, seed)
            dst = sess.empty(shape, dtype)
            for in_group in (True, False):
                assert sess.allreduce(src, dst, op, in_group=in_group) is dst
                for w, got in _values(dst, range(self.num_workers)).items():
                    members = _members(w, self.num_workers, groups, in_group)
                    self.check_allreduce(
                        got,
                        [xs[m] for m in members],
                        op,
                        f"allreduce {op} {dtype} groups={groups} in_group={in_group} worker {w}",
                    )

    @pytest.mark.parametrize(
        ("size", "dtype", "op"),
        [(0, "float32", "sum"), (1, "int8", "max"), (1, "float64", "prod"), (3, "float16", "sum")]
        + [(2, "uint8", "min"), (1001, "float64", "sum"), (1001, "int32", "prod")]
        + [(4099, "float16", "sum"), (257, "int64", "min")],
    )
    def test_allreduce_sizes(self, session, size, dtype, op):
        self.need_dtype(dtype)
        if size == 0 and not self.supports_empty_arrays:
            pytest.skip("this CCL does not take empty arrays")
        seed = _seed("allreduce_sizes", size, dtype, op)
        xs = self.inputs((size,), dtype, seed)
        for groups in dict.fromkeys((1, self.grouped())):
            sess = session(groups)
            src = sess.call_packed("ccl_kit.input", (size,), dtype, seed)
            dst = sess.empty((size,), dtype)
            for in_group in (True, False):
                sess.allreduce(src, dst, op, in_group=in_group)
                for w, got in _values(dst, range(self.num_workers)).items():
                    members = _members(w, self.num_workers, groups, in_group)
                    self.check_allreduce(got, [xs[m] for m in members], op, f"size {size} w{w}")

    def test_allreduce_again_on_the_same_arrays(self, session):
        """The same src and dst registers, over and over, as a training loop does: each
        call reduces the contents src has now (a CCL may keep views of arrays it saw),
        in place or not, with every op in turn."""
        sess = session()
        nw = self.num_workers
        for shape, dtype in (((16,), "float32"), ((3, 5), "int32")):
            src = sess.call_packed("ccl_kit.input", shape, dtype, 0)
            dst = sess.empty(shape, dtype)
            for i, op in enumerate([*self.reduce_ops(dtype), "sum", "sum"]):
                seed = _seed("again", dtype, i)
                sess.call_packed("ccl_kit.refill", src, seed)
                xs = self.inputs(shape, dtype, seed)
                target = src if i % 3 == 2 else dst  # now and then in place
                sess.allreduce(src, target, op, in_group=False)
                for w, got in _values(target, range(nw)).items():
                    self.check_allreduce(got, xs, op, f"call {i} ({op}, {dtype}) worker {w}")

    def test_allreduce_in_place(self, session):
        sess = session()
        seed = _seed("in_place")
        xs = self.inputs((33,), "float32", seed)
        buf = sess.call_packed("ccl_kit.input", (33,), "float32", seed)
        sess.allreduce(buf, buf, "sum", in_group=False)
        ref = reference_allreduce(xs, "sum")
        for w, got in _values(buf, range(self.num_workers)).items():
            assert_bits(got, ref, f"in-place allreduce, worker {w}")

    @pytest.mark.parametrize("kind", [0, 1, 2, 3, 4])
    def test_allreduce_tvm_reduce_kind(self, session, kind):
        """TVM passes ``ReduceKind`` as an int: 0 sum, 1 prod, 2 min, 3 max, 4 avg."""
        sess = session()
        op = OPS[kind]
        seed = _seed("kind", kind)
        xs = self.inputs((6,), "float32", seed)
        src = sess.call_packed("ccl_kit.input", (6,), "float32", seed)
        dst = sess.empty((6,), "float32")
        sess.call_packed("disco.allreduce", src, kind, False, dst)  # TVM's argument order
        for w, got in _values(dst, range(self.num_workers)).items():
            self.check_allreduce(got, xs, op, f"ReduceKind {kind} worker {w}")

    def test_zero_dim_arrays(self, session):
        """0-d arrays: allreduce, broadcast, and allgather into a (n,) array."""
        sess = session()
        nw = self.num_workers
        seed = _seed("0d")
        xs = self.inputs((), "float64", seed)
        src = sess.call_packed("ccl_kit.input", (), "float64", seed)
        dst = sess.empty((), "float64")
        gathered = sess.empty((nw,), "float64")
        sess.allreduce(src, dst, "max", in_group=False)
        for w, got in _values(dst, range(nw)).items():
            assert_bits(got, reference_allreduce(xs, "max"), f"allreduce worker {w}")
        sess.allgather(src, gathered, in_group=False)
        for w, got in _values(gathered, range(nw)).items():
            assert_bits(got, np.stack(xs), f"allgather worker {w}")
        sess.broadcast_from_worker0(src, dst, in_group=False)
        for w, got in _values(dst, range(nw)).items():
            assert_bits(got, xs[0], f"broadcast worker {w}")

    def test_dlpack_arrays(self, session):
        """Registers holding objects known only through ``__dlpack__`` (torch tensors)."""
        sess = session()
        nw = self.num_workers
        seed = _seed("dlpack")
        xs = self.inputs((6,), "float32", seed)
        plain = sess.call_packed("ccl_kit.input", (6,), "float32", seed)
        out = sess.empty((6,), "float32")
        sess.allreduce(
            sess.call_packed("ccl_kit.dlpack_only", plain),
            sess.call_packed("ccl_kit.dlpack_only", out),
            "sum",
            in_group=False,
        )
        for w, got in _values(out, range(nw)).items():
            assert_bits(got, reference_allreduce(xs, "sum"), f"worker {w} (written in place)")

    @pytest.mark.parametrize("which", ["src", "dst"])
    def test_non_contiguous_arrays(self, session, which):
        """A strided view: the right answer, or a CCLError on every member; never wrong data."""
        sess = session()
        nw = self.num_workers
        seed = _seed("strided", which)
        xs = self.inputs((10,), "int32", seed)
        base = sess.call_packed("ccl_kit.input", (10,), "int32", seed)
        if which == "src":
            src, dst = sess.call_packed("ccl_kit.strided", base), sess.empty((5,), "int32")
        else:
            src = sess.call_packed("ccl_kit.input", (5,), "int32", seed)
            xs = self.inputs((5,), "int32", seed)
            holder = sess.empty((10,), "int32")
            dst = sess.call_packed("ccl_kit.strided", holder)
        sess.allreduce(src, dst, "sum", in_group=False)
        try:
            _sync(sess)
        except disco.WorkerError as exc:  # refused: by every member, saying why
            self.check_ccl_error(exc, range(nw), r"contiguous|strided")
        else:
            ref = reference_allreduce([x[::2] if which == "src" else x for x in xs], "sum")
            for w, got in _values(dst, range(nw)).items():
                assert_bits(np.ascontiguousarray(got), ref, f"worker {w}")
        self.assert_usable(sess)

    # ------------------------------------------------------------------ data movement
    def _check_movement(
        self, sess, op: str, dtype: str, piece: tuple, in_group: bool, seed: int, root_only=False
    ) -> None:
        """Run one data-movement collective and compare every worker with NumPy."""
        nw, groups = self.num_workers, sess.num_groups
        m = nw if not in_group else nw // groups
        big = (m * piece[0], *piece[1:]) if piece else (m,)
        roots = in_group if root_only else None
        if op == "allgather":
            src_shape, dst_shape = piece, big
        elif op == "broadcast":
            src_shape, dst_shape = piece, piece
        elif op == "scatter":
            src_shape, dst_shape = big, piece
        else:  # gather
            src_shape, dst_shape = piece, big
        src = sess.call_packed(
            "ccl_kit.input", src_shape, dtype, seed, roots if op in ("scatter",) else None
        )
        sentinel = seed ^ 0x5A5A
        if op == "gather" and root_only:
            dst = sess.empty(dst_shape, dtype, worker0_only=True, in_group=in_group)
        elif op == "gather":  # non-roots' dst must come back untouched: fill it first
            dst = sess.call_packed("ccl_kit.input", dst_shape, dtype, sentinel)
        else:
            dst = sess.empty(dst_shape, dtype)
        {
            "allgather": sess.allgather,
            "broadcast": sess.broadcast_from_worker0,
            "scatter": sess.scatter_from_worker0,
            "gather": sess.gather_to_worker0,
        }[op](src, dst, in_group=in_group)
        xs = self.inputs(src_shape, dtype, seed)
        for w in range(nw):
            members = _members(w, nw, groups, in_group)
            rank, root = members.index(w), members[0]
            what = f"{op} {dtype} {piece} groups={groups} in_group={in_group} worker {w}"
            if op == "allgather":
                ref = np.concatenate([xs[k].reshape(piece) for k in members]).reshape(dst_shape)
            elif op == "broadcast":
                ref = xs[root]
            elif op == "scatter":
                k = int(np.prod(dst_shape))
                ref = xs[root].reshape(-1)[rank * k : (rank + 1) * k].reshape(dst_shape)
            elif w != root:  # gather leaves the other workers' dst alone
                if root_only:
                    continue
                ref = make_input(dst_shape, dtype, sentinel, w)
                what += " (not the root: its dst must be left as it was)"
            else:
                ref = np.concatenate([xs[k].reshape(piece) for k in members]).reshape(dst_shape)
            assert_bits(dst.debug_get_from_remote(w), ref, what)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("op", ["allgather", "broadcast", "scatter", "gather"])
    def test_data_movement(self, session, op, dtype):
        self.need_dtype(dtype)
        for groups in self.layouts():
            sess = session(groups)
            for in_group in (True, False):
                seed = _seed(op, dtype, groups, in_group)
                self._check_movement(sess, op, dtype, (2, 3), in_group, seed)

    @pytest.mark.parametrize("op", ["scatter", "gather"])
    def test_root_only_buffers(self, session, op):
        """Scatter's src and gather's dst may exist on the roots only (None elsewhere)."""
        for groups in self.layouts():
            sess = session(groups)
            for in_group in (True, False):
                seed = _seed("root_only", op, groups, in_group)
                self._check_movement(sess, op, "int32", (5,), in_group, seed, root_only=True)

    @pytest.mark.parametrize(
        ("op", "size", "dtype"),
        [
            (op, size, dtype)
            for op in ("allgather", "broadcast", "scatter", "gather")
            for size, dtype in ((0, "float32"), (1, "int8"), (3, "float16"), (1001, "float64"))
        ],
    )
    def test_data_movement_sizes(self, session, op, size, dtype):
        self.need_dtype(dtype)
        if size == 0 and not self.supports_empty_arrays:
            pytest.skip("this CCL does not take empty arrays")
        for groups in dict.fromkeys((1, self.grouped())):
            sess = session(groups)
            for in_group in (True, False):
                seed = _seed("sizes", op, size, groups, in_group)
                self._check_movement(sess, op, dtype, (size,), in_group, seed)

    def test_broadcast_in_place_on_root(self, session):
        """The root may pass the same array as src and dst."""
        sess = session()
        seed = _seed("bcast_in_place")
        buf = sess.call_packed("ccl_kit.input", (9,), "float64", seed)
        sess.broadcast_from_worker0(buf, buf, in_group=False)
        ref = make_input((9,), "float64", seed, 0)
        for w, got in _values(buf, range(self.num_workers)).items():
            assert_bits(got, ref, f"worker {w}")

    # ------------------------------------------------------------------ multi-round
    @pytest.mark.parametrize(
        "case",
        [
            "allreduce-sum-float16",
            "allreduce-avg-float32",
            "allreduce-max-int16",
            "allreduce-prod-float64",
            "allgather",
            "broadcast",
            "scatter",
            "gather",
            "sendrecv",
            "recv_from_worker0",
        ],
    )
    def test_multi_round(self, session, case):
        """Arrays larger than one round of the CCL (see ``small_round_options``)."""
        opts = dict(self.small_round_options or {})
        n = self.multi_round_elements
        nw = self.num_workers
        for groups in dict.fromkeys((1, self.grouped())):
            sess = session(groups, **opts)
            if case.startswith("allreduce"):
                _, op, dtype = case.split("-")
                self.need_dtype(dtype)
                seed = _seed(case, groups)
                xs = self.inputs((n,), dtype, seed)
                src = sess.call_packed("ccl_kit.input", (n,), dtype, seed)
                dst = sess.empty((n,), dtype)
                for in_group in (True, False):
                    sess.allreduce(src, dst, op, in_group=in_group)
                    for w, got in _values(dst, range(nw)).items():
                        members = _members(w, nw, groups, in_group)
                        self.check_allreduce(got, [xs[m] for m in members], op, f"{case} w{w}")
            elif case in ("allgather", "broadcast", "scatter", "gather"):
                dtype = "float32" if case != "broadcast" else "int64"
                for in_group in (True, False):
                    seed = _seed(case, groups, in_group)
                    self._check_movement(sess, case, dtype, (n,), in_group, seed)
            elif case == "sendrecv":
                self._check_ring(sess, "float32", (n,), _seed(case, groups))
            else:
                self._check_recv_from_worker0(sess, "float64", (n,), _seed(case, groups))

    # ------------------------------------------------------------------ point to point
    def _check_ring(self, sess, dtype: str, shape: tuple, seed: int) -> None:
        nw = self.num_workers
        buf = sess.call_packed("ccl_kit.input", shape, dtype, seed)
        out = sess.empty(shape, dtype)
        nxt = sess.call_packed("ccl_kit.peer", "next")
        prv = sess.call_packed("ccl_kit.peer", "prev")
        sess.call_packed("ccl_kit.exchange", buf, out, nxt, prv)
        xs = self.inputs(shape, dtype, seed)
        for w, got in _values(out, range(nw)).items():
            assert_bits(got, xs[(w - 1) % nw], f"ring {dtype}{list(shape)}: worker {w}")

    def _check_recv_from_worker0(self, sess, dtype: str, shape: tuple, seed: int) -> None:
        nw = self.num_workers
        buf = sess.call_packed("ccl_kit.input", shape, dtype, seed)
        out = sess.call_packed("ccl_kit.input", shape, dtype, seed + 1)
        sess.call_packed("ccl_kit.send_from_worker0", buf)
        sess.call_packed("disco.recv_from_worker0", out)
        for w, got in _values(out, range(nw)).items():
            ref = make_input(shape, dtype, seed if w else seed + 1, 0)
            assert_bits(got, ref, f"recv_from_worker0 {dtype}: worker {w}")

    def test_a_traced_session_gives_the_same_results(self, session, tmp_path):
        """Under ``disco.trace`` every operation gives what it gives untraced, and each one
        is recorded on every member, alike (the core wraps the CCL: no tracing code here)."""
        dtype = "float32"
        for groups in self.layouts():
            sess = session(groups)
            path = tmp_path / f"ccl-{groups}.json"
            with disco.trace(sess, path):
                seed = _seed("traced", groups)
                xs = self.inputs((4, 3), dtype, seed)
                src = sess.call_packed("ccl_kit.input", (4, 3), dtype, seed)
                dst = sess.empty((4, 3), dtype)
                for in_group in (True, False):
                    sess.allreduce(src, dst, "sum", in_group=in_group)
                    for w, got in _values(dst, range(self.num_workers)).items():
                        members = _members(w, self.num_workers, groups, in_group)
                        self.check_allreduce(got, [xs[m] for m in members], "sum", f"traced allreduce worker {w}")  # fmt: skip
                    for op in ("allgather", "broadcast", "scatter", "gather"):
                        self._check_movement(sess, op, dtype, (2, 3), in_group, seed + 1)
                if self.num_workers >= 2:  # one worker (one GPU) has no peer to send to
                    self._check_ring(sess, dtype, (3, 4), seed + 2)
            data = load_trace(path)
            assert data["otherData"]["dropped"] == [0] * self.num_workers
            by_key: dict[str, list[dict]] = {}
            ops: dict[int, set[str]] = {w: set() for w in range(self.num_workers)}
            for w in range(self.num_workers):
                for e in worker_events(data, w, "collective"):
                    ops[w].add(e["name"])
                    if e["args"]["key"] is not None:
                        by_key.setdefault(e["args"]["key"], []).append(e)
            expected = {"allreduce", "allgather", "broadcast", "scatter", "gather"}
            if self.num_workers >= 2:
                expected |= {"send", "recv"}
            for w, seen in ops.items():
                assert seen >= expected, f"worker {w}'s trace lacks {sorted(expected - seen)}"
            size = self.num_workers // groups
            for key, members in by_key.items():
                if key.startswith("p2p:"):  # a send and its recv
                    assert sorted(e["name"] for e in members) == ["recv", "send"], key
                    continue
                want = self.num_workers if key.startswith("world") else size
                assert len(members) == want, f"{key}: recorded on {len(members)} of {want} members"
                assert len({(e["name"], e["args"]["bytes"]) for e in members}) == 1, key

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_send_recv_ring(self, session, dtype):
        self.need_dtype(dtype)
        self._check_ring(session(), dtype, (3, 4), _seed("ring", dtype))

    @pytest.mark.parametrize("size", [0, 1, 1001])
    def test_send_recv_sizes(self, session, size):
        if size == 0 and not self.supports_empty_arrays:
            pytest.skip("this CCL does not take empty arrays")
        self._check_ring(session(), "float16", (size,), _seed("ring_size", size))

    def test_send_recv_pairs_both_ways(self, session):
        """Workers 0-1, 2-3, ... swap arrays, several times in a row (no stale data)."""
        if self.num_workers % 2:
            pytest.skip("needs an even number of workers")
        sess = session()
        pair = sess.call_packed("ccl_kit.peer", "pair")
        out = sess.empty((17,), "int64")
        for i in range(3):
            seed = _seed("pairs", i)
            buf = sess.call_packed("ccl_kit.input", (17,), "int64", seed)
            sess.call_packed("ccl_kit.exchange", buf, out, pair, pair)
            xs = self.inputs((17,), "int64", seed)
            for w, got in _values(out, range(self.num_workers)).items():
                assert_bits(got, xs[w ^ 1], f"round {i}, worker {w}")

    def test_send_recv_builtins_from_controller(self, session):
        """``disco.send_to_worker(buf, receiver_id)`` then ``disco.recv_from_worker(buf, sender_id)``."""
        if self.buffered_send_bytes < 64:
            pytest.skip("sends of this CCL wait for the receiver")
        sess = session()
        nw = self.num_workers
        seed = _seed("builtins_p2p")
        buf = sess.call_packed("ccl_kit.input", (8,), "float32", seed)
        out = sess.empty((8,), "float32")
        nxt = sess.call_packed("ccl_kit.peer", "next")
        prv = sess.call_packed("ccl_kit.peer", "prev")
        sess.get_global_func("disco.send_to_worker")(buf, nxt)
        sess.get_global_func("disco.recv_from_worker")(out, prv)
        xs = self.inputs((8,), "float32", seed)
        for w, got in _values(out, range(nw)).items():
            assert_bits(got, xs[(w - 1) % nw], f"worker {w}")

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "bool"])
    def test_recv_from_worker0(self, session, dtype):
        self.need_dtype(dtype)
        self._check_recv_from_worker0(session(), dtype, (4, 5), _seed("rfw0", dtype))

    @pytest.mark.parametrize("num_workers", [2, None])
    def test_several_messages_to_one_worker_arrive_in_order(self, session, num_workers):
        """Every worker sends several small messages to the next one and receives as many
        from the one before: each arrives, in order. With ``buffered_sends`` of 2 or more,
        every worker sends them all before it receives any (two workers that each sent
        twice to the other before receiving waited for the timeout on a CCL that held one
        message a pair); else even workers send first."""
        sess = session(num_workers=num_workers)
        nw = sess.num_workers
        shape = (max(self.buffered_sends, 3), 4)
        seed = _seed("several_sends", nw)
        buf = sess.call_packed("ccl_kit.input", shape, "float32", seed)
        out = sess.call_packed("ccl_kit.input", shape, "float32", seed + 1)
        nxt = sess.call_packed("ccl_kit.peer", "next")
        prv = sess.call_packed("ccl_kit.peer", "prev")
        sess.call_packed("ccl_kit.send_several", buf, out, nxt, prv, self.buffered_sends >= 2)
        xs = [make_input(shape, "float32", seed, w) for w in range(nw)]
        for w, got in _values(out, range(nw)).items():
            assert_bits(got, xs[(w - 1) % nw], f"{nw} workers: worker {w}")

    def test_send_to_next_group(self, session):
        nw = self.num_workers
        layouts = [g for g in self.layouts() if g > 1]
        if not layouts:
            pytest.skip("needs more than one group")
        for groups in layouts:
            sess = session(groups)
            gs = nw // groups
            seed = _seed("next_group", groups)
            buf = sess.call_packed("ccl_kit.input", (11,), "float32", seed)
            out = sess.call_packed("ccl_kit.input", (11,), "float32", seed + 1)
            sess.call_packed("ccl_kit.pipeline", buf, out)
            for w, got in _values(out, range(nw)).items():
                ref = make_input(
                    (11,), "float32", seed if w >= gs else seed + 1, w - gs if w >= gs else w
                )
                assert_bits(got, ref, f"groups={groups} worker {w}")

    # ------------------------------------------------------------------ barrier
    @pytest.mark.parametrize("in_group", [False, True])
    def test_barrier(self, session, in_group):
        nw = self.num_workers
        groups = self.grouped() if in_group else 1
        sess = session(groups)
        sess.call_packed("disco.barrier", in_group)  # the built-in, TVM-style call
        times = _values(sess.call_packed("ccl_kit.barrier_times", in_group, 0.05), range(nw))
        for comm in _comms(nw, groups, in_group):
            last_arrival = max(times[w][0] for w in comm)
            for w in comm:
                assert times[w][1] >= last_arrival, (
                    f"worker {w} left the barrier before worker(s) of {comm} arrived"
                )

    # ------------------------------------------------------------------ controller conveniences
    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "uint8", "bool"])
    def test_controller_broadcast(self, session, dtype):
        self.need_dtype(dtype)
        nw = self.num_workers
        for groups in self.layouts():
            sess = session(groups)
            host = make_input((3, 5), dtype, _seed("cb", dtype, groups), 99)
            keep = host.copy()
            for in_group in (True, False):
                dst = sess.broadcast(host, in_group=in_group)
                for w, got in _values(dst, range(nw)).items():
                    assert_bits(got, keep, f"broadcast groups={groups} in_group={in_group} w{w}")
            given = sess.empty((3, 5), dtype)
            assert sess.broadcast(host, given) is given
            for w, got in _values(given, range(nw)).items():
                assert_bits(got, keep, f"broadcast into dst, groups={groups} w{w}")
            assert_bits(host, keep, "the host array must not change")

    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "uint8", "bool"])
    def test_controller_scatter(self, session, dtype):
        """``in_group=False``: ``src[w]`` to worker ``w``; ``in_group=True`` (the default):
        ``src`` has one row per group member and every group gets the same rows."""
        self.need_dtype(dtype)
        nw = self.num_workers
        for groups in self.layouts():
            sess = session(groups)
            size = nw // groups
            host = make_input((nw, 3, 2), dtype, _seed("cs", dtype, groups), 99)
            dst = sess.scatter(host, in_group=False)
            for w, got in _values(dst, range(nw)).items():
                assert_bits(got, host[w], f"scatter groups={groups} in_group=False w{w}")
            shards = make_input((size, 3, 2), dtype, _seed("cs-g", dtype, groups), 98)
            keep = shards.copy()
            for dst in (sess.scatter(shards, in_group=True), sess.scatter(shards)):
                for w, got in _values(dst, range(nw)).items():
                    assert_bits(got, keep[w % size], f"scatter groups={groups} in_group w{w}")
            given = sess.empty((3, 2), dtype)
            assert sess.scatter(shards, given) is given
            for w, got in _values(given, range(nw)).items():
                assert_bits(got, keep[w % size], f"scatter into dst, groups={groups} w{w}")
            assert_bits(shards, keep, "the host array must not change")

    def test_controller_scatter_wrong_first_dim(self, session):
        sess = session()
        nw = self.num_workers
        for bad in (np.zeros((nw + 1, 2), "float32"), np.zeros((), "float32"), np.zeros(0)):
            for in_group in (True, False):
                with pytest.raises(ValueError, match="first dimension|workers"):
                    sess.scatter(bad, in_group=in_group)
        self.assert_usable(sess)
        groups = self.grouped()
        if groups > 1:  # in groups the first dimension is the group size
            sess = session(groups)
            with pytest.raises(ValueError, match="group size"):
                sess.scatter(np.zeros((nw, 2), "float32"))
            with pytest.raises(ValueError, match="number of workers"):
                sess.scatter(np.zeros((nw // groups, 2), "float32"), in_group=False)
            self.assert_usable(sess)

    def test_controller_one_element(self, session):
        sess = session(self.layouts()[-1])
        nw = self.num_workers
        host = np.array([2.5], "float64")
        for w, got in _values(sess.broadcast(host), range(nw)).items():
            assert_bits(got, host, f"worker {w}")
        small = "int16" if "int16" in self.dtypes else "int8"  # 2 bytes, or the least a CCL has
        host2 = np.arange(nw, dtype=small)
        for w, got in _values(sess.scatter(host2, in_group=False), range(nw)).items():
            assert_bits(got, host2[w], f"worker {w}")
        size = nw // self.layouts()[-1]
        for w, got in _values(sess.scatter(host2[:size]), range(nw)).items():
            assert_bits(got, host2[w % size], f"worker {w}, in its group")

    # ------------------------------------------------------------------ wrong use
    @pytest.mark.parametrize("kind", ["shape", "dtype"])
    @pytest.mark.parametrize("op", ["allreduce", "allgather", "broadcast", "scatter", "gather"])
    def test_mismatched_buffers(self, session, op, kind):
        """One worker (via ``ccl_kit.replace_on``) passes a different array: all members fail."""
        sess = session()
        nw = self.num_workers
        odd = nw - 1
        other = (
            (lambda shape: np.zeros((shape[0] + 1,), "float32"))
            if kind == "shape"
            else (lambda shape: np.zeros(shape, "int32"))
        )
        src_shape = {"scatter": (nw * 3,)}.get(op, (3,))
        dst_shape = {"allgather": (nw * 3,), "gather": (nw * 3,)}.get(op, (3,))
        src = sess.call_packed("ccl_kit.input", src_shape, "float32", 1)
        dst = sess.empty(dst_shape, "float32")
        if op == "allreduce":
            src = _put(sess, src, odd, other(src_shape))
            dst = _put(sess, dst, odd, other(dst_shape))
        elif op in ("allgather", "gather"):
            src = _put(sess, src, odd, other(src_shape))
        else:  # broadcast, scatter: a non-root's dst differs from the root's
            dst = _put(sess, dst, odd, other(dst_shape))
        fn = {
            "allreduce": lambda: sess.allreduce(src, dst, "sum", in_group=False),
            "allgather": lambda: sess.allgather(src, dst, in_group=False),
            "broadcast": lambda: sess.broadcast_from_worker0(src, dst, in_group=False),
            "scatter": lambda: sess.scatter_from_worker0(src, dst, in_group=False),
            "gather": lambda: sess.gather_to_worker0(src, dst, in_group=False),
        }[op]
        fn()
        pattern = (
            r"shape|differ|match|hold|size|\[4\]" if kind == "shape" else r"dtype|int32|differ"
        )
        self.expect_ccl_error(sess, range(nw), pattern)
        self.assert_usable(sess)

    def test_mismatch_in_one_group_only(self, session):
        """A bad call in one group fails that group only; the other groups finish correctly."""
        groups = next((g for g in self.layouts() if 1 < g < self.num_workers), None)
        if groups is None:
            pytest.skip("needs groups of two or more workers, and several groups")
        nw = self.num_workers
        sess = session(groups)
        seed = _seed("one_group")
        src = sess.call_packed("ccl_kit.input", (4,), "float64", seed)
        dst = sess.empty((4,), "float64")
        src = _put(sess, src, nw - 1, np.zeros(5))
        dst = _put(sess, dst, nw - 1, np.zeros(5))
        sess.allreduce(src, dst, "max", in_group=True)
        last = _comms(nw, groups, True)[-1]
        errors = self.expect_ccl_error(sess, last, r"shape|differ|match|\[5\]")
        assert {e.worker_id for e in errors} == set(last), "other groups must not fail"
        xs = self.inputs((4,), "float64", seed)
        for comm in _comms(nw, groups, True)[:-1]:
            for w in comm:
                got = dst.debug_get_from_remote(w)
                self.check_allreduce(got, [xs[m] for m in comm], "max", f"worker {w}")
        self.assert_usable(sess)

    def test_mismatched_operations(self, session):
        """Workers disagree on the reduction: every worker raises."""
        sess = session()
        nw = self.num_workers
        src = sess.call_packed("ccl_kit.input", (4,), "float32", 3)
        dst = sess.empty((4,), "float32")
        ops = ("sum",) * (nw - 1) + ("max",)
        sess.call_packed("ccl_kit.allreduce_per_worker_op", src, dst, ops, False)
        self.expect_ccl_error(sess, range(nw), r"mismatch|differ|max")
        self.assert_usable(sess)

    def test_not_an_array(self, session):
        """A collective given something that is not an array: CCLError on every member."""
        sess = session()
        dst = sess.empty((4,), "float32")
        sess.call_packed("disco.allreduce", 5, "sum", False, dst)
        self.expect_ccl_error(sess, range(self.num_workers), r"array")
        self.assert_usable(sess)

    def test_scatter_not_divisible(self, session):
        sess = session()
        nw = self.num_workers
        src = sess.call_packed("ccl_kit.input", (nw * 3 + 1,), "float32", 1)
        dst = sess.empty((3,), "float32")
        sess.scatter_from_worker0(src, dst, in_group=False)
        self.expect_ccl_error(sess, range(nw), r"divis|split|piece|size")
        self.assert_usable(sess)

    def test_allgather_dst_too_small(self, session):
        sess = session()
        nw = self.num_workers
        src = sess.call_packed("ccl_kit.input", (3,), "float32", 1)
        dst = sess.empty((nw * 3 - 1,), "float32")
        sess.allgather(src, dst, in_group=False)
        self.expect_ccl_error(sess, range(nw), r"hold|small|size|dst")
        self.assert_usable(sess)

    def test_gather_root_without_dst(self, session):
        sess = session()
        src = sess.call_packed("ccl_kit.input", (3,), "float32", 1)
        # the worker function itself: Session.gather_to_worker0 refuses None at the call
        sess.call_packed(sess.get_global_func("disco.gather_to_worker0"), src, False, None)
        self.expect_ccl_error(sess, range(self.num_workers), r"dst|root")
        self.assert_usable(sess)

    def test_avg_of_bool_is_an_error(self, session):
        self.need_dtype("bool")
        sess = session()
        src = sess.call_packed("ccl_kit.input", (4,), "bool", 1)
        dst = sess.empty((4,), "bool")
        sess.allreduce(src, dst, "avg", in_group=False)
        self.expect_ccl_error(sess, range(self.num_workers), r"avg")
        self.assert_usable(sess)

    @pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8"])
    def test_avg_of_integers_truncates_toward_zero(self, session, dtype):
        """NCCL's ``ncclAvg`` on integers: the sum divided by the member count, truncated
        toward zero (-1/n is 0, not -1), exact even where float64 would round."""
        self.need_dtype(dtype)
        nw = self.num_workers
        sess = session()
        big = {"int64": 2**60 + 13}.get(dtype, 100)  # float64(2**60 + 13) loses the 13
        first = [-1, 1, -7, 7, -(2 * nw + 1), 2 * nw + 1, -big, big]
        if dtype.startswith("u"):
            first = [abs(v) for v in first]
        host = np.zeros((nw, len(first)), dtype)
        host[0] = first
        src = sess.scatter(host, in_group=False)
        dst = sess.empty((len(first),), dtype)
        sess.allreduce(src, dst, "avg", in_group=False)
        want = np.array([abs(v) // nw * (1 if v >= 0 else -1) for v in first], dtype)
        for w, got in _values(dst, range(nw)).items():
            assert_bits(got, want, f"avg of {dtype}, worker {w}")

    def test_unknown_reduce_op(self, session):
        sess = session()
        src = sess.call_packed("ccl_kit.input", (4,), "float32", 1)
        dst = sess.empty((4,), "float32")
        with pytest.raises(ValueError, match="median"):
            sess.allreduce(src, dst, "median")
        sess.call_packed("disco.allreduce", src, "median", False, dst)
        self.expect_ccl_error(sess, range(self.num_workers), r"median|op")
        self.assert_usable(sess)

    @pytest.mark.parametrize("direction", ["send", "recv"])
    def test_self_send(self, session, direction):
        sess = session()
        buf = sess.call_packed("ccl_kit.input", (4,), "float32", 1)
        me = sess.call_packed("ccl_kit.peer", "self")
        name = "disco.send_to_worker" if direction == "send" else "disco.recv_from_worker"
        sess.call_packed(name, buf, me)
        self.expect_ccl_error(sess, range(self.num_workers), r"itself|self")
        self.assert_usable(sess)

    @pytest.mark.parametrize("direction", ["send", "recv"])
    @pytest.mark.parametrize("peer", ["-1", "num_workers", "1000"])
    def test_out_of_range_peer(self, session, peer, direction):
        sess = session()
        nw = self.num_workers
        value = {"-1": -1, "num_workers": nw, "1000": 1000}[peer]
        buf = sess.call_packed("ccl_kit.input", (4,), "float32", 1)
        name = "disco.send_to_worker" if direction == "send" else "disco.recv_from_worker"
        sess.call_packed(name, buf, value)
        self.expect_ccl_error(sess, range(nw), r"range|invalid|peer")
        self.assert_usable(sess)

    @pytest.mark.parametrize("kind", ["size", "dtype"])
    def test_recv_buffer_mismatch(self, session, kind):
        """Worker 0 sends 5 float32; worker 1 receives into a wrong buffer: worker 1 fails."""
        sess = session()
        buf = sess.call_packed("ccl_kit.input", (5,), "float32", 1)
        out = sess.empty((4,), "float32") if kind == "size" else sess.empty((5,), "int32")
        sess.call_packed("ccl_kit.call_on", (0,), "send_to_worker", buf, 1)
        sess.call_packed("ccl_kit.call_on", (1,), "recv_from_worker", out, 0)
        self.expect_ccl_error(sess, [1], r"sent|size|dtype|buffer|match")
        self._check_ring(sess, "float32", (6,), _seed("after recv mismatch"))
        self.assert_usable(sess)

    @pytest.mark.parametrize("side", ["send", "recv"])
    def test_send_recv_with_a_register_that_holds_nothing(self, session, side):
        """A ``worker0_only`` register holds None on the other workers. Sending it, or
        receiving into it, is a CCL error at once (a send of None left its receiver
        waiting for the CCL's timeout; a receive into None left the message behind,
        and the next receive from that sender got it instead of its own data)."""
        sess = session()
        victim = self.num_workers - 1
        nothing = sess.empty((4,), "float32", worker0_only=True)
        old = sess.call_packed("ccl_kit.input", (4,), "float32", _seed("nothing", 1))
        out = sess.empty((4,), "float32")
        sender, receiver = (victim, 0) if side == "send" else (0, victim)
        sent = nothing if side == "send" else old
        into = out if side == "send" else nothing
        sess.call_packed("ccl_kit.call_on", (sender,), "send_to_worker", sent, receiver)
        sess.call_packed("ccl_kit.call_on", (receiver,), "recv_from_worker", into, sender)
        failed = [sender, receiver] if side == "send" else [receiver]
        self.expect_ccl_error(sess, failed, r"None|must be a")
        seed = _seed("nothing", 2)
        new = sess.call_packed("ccl_kit.input", (4,), "float32", seed)
        sess.call_packed("ccl_kit.call_on", (sender,), "send_to_worker", new, receiver)
        sess.call_packed("ccl_kit.call_on", (receiver,), "recv_from_worker", out, sender)
        want = self.inputs((4,), "float32", seed)[sender]
        assert_bits(_values(out, [receiver])[receiver], want, "the next message")
        self.assert_usable(sess)

    @pytest.mark.parametrize("op", ["allreduce", "allgather", "send"])
    def test_an_array_in_the_other_byte_order(self, session, op):
        """``>f4`` on a little-endian machine: its dtype is named float32, as the
        descriptors say, but its bytes are not a float32's; moved or reduced as such it
        was garbage, silently. A worker's such array is refused on every member (a GPU
        CCL refuses it as a host array)."""
        sess = session()
        nw = self.num_workers
        last = nw - 1
        src = sess.call_packed("ccl_kit.input", (6,), "float32", _seed("order", op))
        swapped = sess.call_packed("ccl_kit.other_byte_order", src, last)
        pattern = r"byte order|CuPy|GPU"
        if op == "allreduce":
            sess.allreduce(swapped, sess.empty((6,), "float32"), "sum", in_group=False)
            self.expect_ccl_error(sess, range(nw), pattern)
        elif op == "allgather":
            sess.allgather(swapped, sess.empty((6 * nw,), "float32"), in_group=False)
            self.expect_ccl_error(sess, range(nw), pattern)
        else:
            out = sess.empty((6,), "float32")
            sess.call_packed("ccl_kit.call_on", (last,), "send_to_worker", swapped, 0)
            sess.call_packed("ccl_kit.call_on", (0,), "recv_from_worker", out, last)
            self.expect_ccl_error(sess, [0, last], pattern)
        self.assert_usable(sess)

    @pytest.mark.parametrize(
        ("op", "bad"),
        [
            ("allreduce", "src"),
            ("allreduce", "dst"),
            ("allgather", "src"),
            ("broadcast", "dst"),
            ("broadcast", "root-src"),
            ("scatter", "dst"),
            ("scatter", "root-src"),
            ("gather", "src"),
            ("gather", "root-dst"),
            ("send", "src"),
            ("recv", "dst"),
        ],
    )
    def test_collective_on_failed_register(self, session, op, bad):
        """A register that failed to compute on one worker: the others fail too, none waits."""
        sess = session()
        nw = self.num_workers
        victim = 0 if bad.startswith("root") else nw - 1
        shape = {"scatter": (nw * 2,)}.get(op, (2,))
        out_shape = {"allgather": (nw * 2,), "gather": (nw * 2,)}.get(op, (2,))
        good_src = sess.call_packed("ccl_kit.input", shape, "float32", 1)
        good_dst = sess.empty(out_shape, "float32")
        failed_src = sess.call_packed("ccl_kit.fail_on", victim, shape, "float32")
        failed_dst = sess.call_packed("ccl_kit.fail_on", victim, out_shape, "float32")
        src = failed_src if bad.endswith("src") else good_src
        dst = failed_dst if bad.endswith("dst") else good_dst
        expected: Sequence[int] = range(nw)
        if op == "allreduce":
            sess.allreduce(src, dst, "sum", in_group=False)
        elif op == "allgather":
            sess.allgather(src, dst, in_group=False)
        elif op == "broadcast":
            sess.broadcast_from_worker0(src, dst, in_group=False)
        elif op == "scatter":
            sess.scatter_from_worker0(src, dst, in_group=False)
        elif op == "gather":
            sess.gather_to_worker0(src, dst, in_group=False)
        elif op == "send":  # worker nw-1 sends a failed register to worker 0
            sess.call_packed("ccl_kit.call_on", (victim,), "send_to_worker", src, 0)
            sess.call_packed("ccl_kit.call_on", (0,), "recv_from_worker", dst, victim)
            expected = [0, victim]
        else:  # worker 0 sends to worker nw-1, whose receive buffer failed
            sess.call_packed("ccl_kit.call_on", (0,), "send_to_worker", src, victim)
            sess.call_packed("ccl_kit.call_on", (victim,), "recv_from_worker", dst, 0)
            expected = [victim]
        errors = self.expect_ccl_error(sess, expected, r"")
        assert any(e.worker_id == victim and e.exc_type == "ValueError" for e in errors), (
            "the original failure must be reported too"
        )
        self.assert_usable(sess)

    @pytest.mark.parametrize("name", ["send_to_next_group", "recv_from_prev_group"])
    def test_no_next_or_previous_group(self, session, name):
        """``send_to_next_group`` on the last group (``recv_from_prev_group`` on the first)."""
        nw = self.num_workers
        for groups in self.layouts():
            sess = session(groups)
            buf = sess.call_packed("ccl_kit.input", (3,), "float32", 1)
            comms = _comms(nw, groups, True)
            edge = comms[-1] if name == "send_to_next_group" else comms[0]
            if groups == 1:  # every worker is in the last (and first) group: the plain built-in
                sess.get_global_func(f"disco.{name}")(buf)
            else:
                sess.call_packed("ccl_kit.call_on", tuple(edge), name, buf)
            errors = self.expect_ccl_error(sess, edge, r"group")
            assert {e.worker_id for e in errors} == set(edge)
            self.assert_usable(sess)

    def test_collective_without_init_ccl(self):
        """A collective on a session with no CCL: CCLError at the call site (a core rule)."""
        with disco.ThreadedSession(2) as bare:
            a = bare.empty((3,), "float32")
            b = bare.empty((6,), "float32")
            calls = [
                lambda: bare.allreduce(a, a),
                lambda: bare.allgather(a, b),
                lambda: bare.broadcast_from_worker0(a, a),
                lambda: bare.scatter_from_worker0(b, a),
                lambda: bare.gather_to_worker0(a, b),
                lambda: bare.broadcast(np.zeros(3, "float32")),
                lambda: bare.scatter(np.zeros((2, 3), "float32")),
            ]
            for call in calls:
                with pytest.raises(disco.CCLError, match="init_ccl"):
                    call()
            # The built-in called directly fails on every worker, naming the cure.
            bare.get_global_func("disco.allreduce")(a, "sum", False, a)
            with pytest.raises(disco.WorkerError, match="init_ccl") as info:
                bare.sync_worker_0()
            assert {info.value.worker_id, *(e.worker_id for e in info.value.others)} == {0, 1}
            bare.sync_worker_0()

    # ------------------------------------------------------------------ death and timeouts
    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("op", ["allreduce", "barrier", "recv"])
    def test_worker_death_during_collective(self, fresh_session, op):
        """A worker exits while the others wait in a collective: WorkerDiedError, fast."""
        if not self.workers_are_processes:
            pytest.skip("this session's workers are not separate processes")
        before = _resources()
        sess = fresh_session()
        nw = self.num_workers
        victim = nw - 1
        src = sess.call_packed("ccl_kit.input", (8,), "float32", 1)
        dst = sess.empty((8,), "float32")
        _sync(sess)
        args = {
            "allreduce": ("allreduce", src, "sum", False, dst),
            "barrier": ("barrier", False),
            "recv": ("recv_from_worker", dst, victim),
        }[op]
        delay = 0.3
        t0 = time.monotonic()
        sess.call_packed("ccl_kit.die_or_call", victim, os.getpid(), delay, *args)
        # Worker 0 waits in the collective meanwhile, on whatever thread runs it: the
        # wait is watched from here, so a CCL that never notices the death fails the
        # case in seconds instead of hanging it.
        outcome = _bounded(sess.sync_worker_0, self.death_timeout + delay)
        took = time.monotonic() - t0
        assert outcome is not _STILL_WAITING, (
            f"worker 0 was still waiting in {op} {took:.1f} s after worker {victim} died: "
            "the CCL must fail a wait whose peer is gone (Rendezvous.abort, or the peer's "
            "connection closing)"
        )
        assert isinstance(outcome, disco.WorkerDiedError), (
            f"expected WorkerDiedError, got {outcome!r}"
        )
        assert victim in outcome.worker_ids
        t1 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t1 < 15, "shutdown after a death took too long"
        assert_nothing_left(
            before, f"after a worker died in {op} and the session shut down", fds=False
        )

    @pytest.mark.timeout(60)
    def test_frozen_worker_during_collective(self, fresh_session, monkeypatch):
        """A worker freezes (SIGSTOP) while its peers wait in a barrier: they time out,
        the controller names the frozen worker, and shutdown leaves nothing behind."""
        if not self.workers_are_processes:
            pytest.skip("this session's workers are not separate processes")
        if self.timeout_options is None:
            pytest.skip("no timeout option for this CCL")
        monkeypatch.setenv("DISCO_GATHER_TIMEOUT", "3")
        before = _resources()
        nw = self.num_workers
        victim = nw - 1
        sess = fresh_session(nw, 1, **self.timeout_options)
        victim_pid = sess.call_packed("ccl_kit.pid").debug_get_from_remote(victim)
        sess.call_packed("ccl_kit.stop_or_call", victim, os.getpid(), 0.2, "barrier", False)
        try:
            outcome = _bounded(lambda: _sync(sess), 30.0)
            assert outcome is not _STILL_WAITING, (
                "the controller was still waiting 30 s after a worker froze in a barrier "
                "(the waiting members must time out)"
            )
            assert isinstance(outcome, (disco.WorkerError, disco.WorkerDiedError)), outcome
            if isinstance(outcome, disco.WorkerDiedError):
                assert victim in outcome.worker_ids, outcome
            t1 = time.monotonic()
            sess.shutdown()
            assert time.monotonic() - t1 < 15, "shutdown after a frozen worker took too long"
        finally:
            try:
                os.kill(victim_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert_nothing_left(
            before, "after a worker froze in a barrier and the session shut down", fds=False
        )

    # ------------------------------------------------------------------ odd sizes
    def _odd(self) -> int:
        n = self.odd_num_workers
        if n is None:
            pytest.skip("this CCL's sessions cannot have an odd worker count here (one GPU each)")
        return n

    @pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
    def test_odd_worker_count_allreduce(self, session, dtype):
        """Every op with an odd member count (``avg`` as ``x * (1/n)`` is inexact for 3)."""
        self.need_dtype(dtype)
        n = self._odd()
        sess = session(1, num_workers=n)
        for op in self.reduce_ops(dtype):
            seed = _seed("odd", op, dtype)
            src = sess.call_packed("ccl_kit.input", (33,), dtype, seed)
            dst = sess.empty((33,), dtype)
            sess.allreduce(src, dst, op, in_group=False)
            xs = [make_input((33,), dtype, seed, w) for w in range(n)]
            for w, got in _values(dst, range(n)).items():
                self.check_allreduce(
                    got, xs, op, f"allreduce {op} {dtype}, {n} workers, worker {w}"
                )

    @pytest.mark.parametrize("op", ["allgather", "broadcast", "scatter", "gather"])
    def test_odd_worker_count_data_movement(self, session, op):
        n = self._odd()
        sess = session(1, num_workers=n)
        seed = _seed("odd", op)
        piece = (2, 3)
        big = (n * 2, 3)
        src_shape = {"scatter": big}.get(op, piece)
        dst_shape = {"allgather": big, "gather": big}.get(op, piece)
        src = sess.call_packed("ccl_kit.input", src_shape, "float32", seed)
        dst = sess.call_packed("ccl_kit.input", dst_shape, "float32", seed ^ 0x5A5A)
        {
            "allgather": sess.allgather,
            "broadcast": sess.broadcast_from_worker0,
            "scatter": sess.scatter_from_worker0,
            "gather": sess.gather_to_worker0,
        }[op](src, dst, in_group=False)
        xs = [make_input(src_shape, "float32", seed, w) for w in range(n)]
        for w in range(n):
            if op in ("allgather", "gather"):
                ref = np.concatenate(xs)
                if op == "gather" and w:
                    ref = make_input(dst_shape, "float32", seed ^ 0x5A5A, w)
            elif op == "broadcast":
                ref = xs[0]
            else:
                ref = xs[0][2 * w : 2 * w + 2]
            assert_bits(dst.debug_get_from_remote(w), ref, f"{op}, {n} workers, worker {w}")

    # ------------------------------------------------------------------ what is left behind
    @pytest.mark.timeout(120)
    def test_nothing_left_across_sessions(self, make_session):
        """Sessions made and shut down one after another leave no thread, fd, memfd,
        child process or /dev/shm segment behind (a CCL's ``close`` releases everything)."""

        def one() -> None:
            sess = make_session(self.num_workers, 1)
            try:
                sess.import_python_module(FUNCS_MODULE)
                self.assert_usable(sess)
                sess.call_packed("disco.barrier", False)
                self._check_movement(sess, "allgather", "float32", (4,), False, 3)
            finally:
                sess.shutdown()

        one()  # the first session may load libraries and caches for good
        before = _resources()
        for _ in range(3):
            one()
        assert_nothing_left(before, "after 3 sessions were made and shut down")

    # ------------------------------------------------------------------ construction
    @pytest.fixture
    def make_bare_session(self, make_session):
        """``make_bare_session(num_workers) -> (session, ccl name, fixed init_ccl options)``:
        a session of the same kind with no CCL yet. Derived from a ``make_session``
        built by :func:`session_maker`; a subclass with its own ``make_session`` may
        override this fixture."""
        cls = getattr(make_session, "session_cls", None)
        if cls is None:
            pytest.skip("make_session was not built by session_maker: override make_bare_session")
        made: list[disco.Session] = []

        def get(num_workers: int):
            sess = cls(num_workers)
            made.append(sess)
            return sess, make_session.ccl, make_session.fixed_options

        yield get
        for sess in made:
            sess.shutdown()

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("where", ["first", "last"])
    def test_constructor_fails_on_one_worker(self, make_bare_session, where):
        """One worker's CCL constructor raises while the others construct theirs (and may
        wait for it): ``init_ccl`` raises that failure within seconds, naming the worker,
        and the session is still usable."""
        nw = self.num_workers
        sess, base, fixed = make_bare_session(nw)
        victim = 0 if where == "first" else nw - 1
        name = register_faulty_ccl(base, victim)
        sess.import_python_module(FUNCS_MODULE)
        sess.call_packed("ccl_kit.register_faulty_ccl", base, victim)
        _sync(sess)
        t0 = time.monotonic()
        options = {**fixed, **self.construction_options}
        outcome = _bounded(lambda: sess.init_ccl(name, **options), 10.0)
        took = time.monotonic() - t0
        assert outcome is not _STILL_WAITING, (
            f"init_ccl was still waiting {took:.0f} s after worker {victim}'s constructor "
            "failed: the others must be released (Rendezvous.abort) instead of waiting for it"
        )
        assert isinstance(outcome, disco.WorkerError), f"expected WorkerError, got {outcome!r}"
        assert outcome.worker_id == victim and "on purpose" in outcome.remote_message, (
            f"the constructor's failure must be the error raised, got worker "
            f"{outcome.worker_id}: {outcome.remote_message}"
        )
        assert took < 10, f"init_ccl took {took:.1f} s to report a constructor failure"
        if self.reinit_after_failed_init:
            # Nothing of the failed attempt stays: the real CCL can be initialised now.
            sess.init_ccl(base, **fixed)
            self.assert_usable(sess)
        else:  # the control plane still works
            assert sess.call_packed("ccl_kit.peer", "self").debug_get_from_remote(nw - 1) == nw - 1

    @pytest.mark.timeout(60)
    def test_ccl_missing_on_a_worker(self, make_bare_session):
        """The controller has the CCL, a worker process does not (its environment lacks
        the plugin): ``init_ccl`` names that worker and the missing CCL, at once."""
        if not self.workers_are_processes:
            pytest.skip("this session's workers are not separate processes")
        nw = self.num_workers
        sess, base, fixed = make_bare_session(nw)
        name = register_faulty_ccl(base, nw + 1)  # fails nowhere; registered here only
        t0 = time.monotonic()
        options = {**fixed, **self.construction_options}
        outcome = _bounded(lambda: sess.init_ccl(name, **options), 10.0)
        assert outcome is not _STILL_WAITING, "init_ccl waited for workers that lack the CCL"
        assert isinstance(outcome, disco.WorkerError), f"expected WorkerError, got {outcome!r}"
        missing = {e.worker_id for e in [outcome, *outcome.others]}
        assert missing == set(range(1, nw)), missing
        assert name in outcome.remote_message and "install" in outcome.remote_message
        assert time.monotonic() - t0 < 10
        assert faulty_ccl_name(base, nw + 1) == name

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("who", ["worker0", "others"])
    def test_collective_timeout(self, fresh_session, who):
        """Some workers enter a barrier the others never call: they time out quickly."""
        if self.timeout_options is None:
            pytest.skip("no timeout option for this CCL")
        nw = self.num_workers
        sess = fresh_session(nw, 1, **self.timeout_options)
        waiting = (0,) if who == "worker0" else tuple(range(1, nw))
        t0 = time.monotonic()
        sess.call_packed("ccl_kit.call_on", waiting, "barrier", False)
        with pytest.raises(disco.WorkerError) as info:
            _sync(sess)
        took = time.monotonic() - t0
        errors = [info.value, *info.value.others]
        timed_out = {e.worker_id for e in errors if e.exc_type.endswith("CCLTimeoutError")}
        assert timed_out == set(waiting), [(e.worker_id, e.exc_type) for e in errors]
        assert took < 20, f"the timeout surfaced after {took:.1f} s"
        # The session (its control plane) still works.
        _sync(sess)
        assert sess.call_packed("ccl_kit.peer", "const", 5).debug_get_from_remote(nw - 1) == 5

    @pytest.mark.timeout(60)
    def test_collective_after_timeout_fails_everywhere(self, fresh_session):
        """After one member timed out, the next collective fails on every member, promptly.

        (It must not complete on the others against what the timed-out member left behind.)
        """
        if self.timeout_options is None:
            pytest.skip("no timeout option for this CCL")
        nw = self.num_workers
        sess = fresh_session(nw, 1, **self.timeout_options)
        sess.call_packed("ccl_kit.call_on", (nw - 1,), "barrier", False)
        with pytest.raises(disco.WorkerError):
            _sync(sess)
        t0 = time.monotonic()
        sess.call_packed("disco.barrier", False)
        with pytest.raises(disco.WorkerError) as info:
            _sync(sess)
        self.check_ccl_error(info.value, range(nw), timeout_ok=True)
        assert time.monotonic() - t0 < 20

    @pytest.mark.timeout(60)
    def test_shutdown_while_waiting_in_a_collective(self, fresh_session):
        """Workers stuck in a collective (default timeout) do not delay shutdown."""
        nw = self.num_workers
        sess = fresh_session()
        sess.call_packed("ccl_kit.call_on", tuple(range(nw - 1)), "barrier", False)
        sess.call_packed("ccl_kit.peer", "self")
        time.sleep(0.2)
        t0 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t0 < 10, "shutdown waited for the stuck collective"
