"""The ``mpi`` CCL over ProcessSession, with the MPI from PyPI (mpich + mpi4py).

The plugin's own checks beside the core's conformance kit (test_mpi_contract.py):
MPI's own (unordered) reduction order against NumPy with a tolerance, more dtypes
(complex), in-place and overlapping buffers, groups as sub-communicators, and a
worker dying mid-collective.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from mpi_test_funcs import aliased_input, make

import disco_core as disco
from disco_core.errors import CCLError, WorkerDiedError, WorkerError
from disco_core.testing.divergence import check_skip_onto_the_other_communicator
from disco_core.testing.p2p_steps import run_p2p_steps

pytestmark = pytest.mark.timeout(120)

UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
SHAPES = [(2, 3)]


def _session(n: int, groups: int = 1, **opts):
    sess = disco.ProcessSession(n, num_groups=groups)
    try:
        sess.import_python_module("mpi_test_funcs")
        sess.init_ccl("mpi", **opts)
    except BaseException:
        sess.shutdown()
        raise
    return sess


@pytest.fixture(scope="module", params=[(2, 1), (4, 1), (4, 2)], ids=["2w", "4w", "4w2g"])
def sess(request):
    n, g = request.param
    s = _session(n, g)
    yield s
    s.shutdown()


def _members(sess, w, in_group):
    if not in_group:
        return list(range(sess.num_workers))
    size = sess.num_workers // sess.num_groups
    start = w // size * size
    return list(range(start, start + size))


def _dt(name):
    if name == "bfloat16":
        ml = pytest.importorskip("ml_dtypes")
        return np.dtype(ml.bfloat16)
    return np.dtype(name)


def _reduce(xs, op, dt):
    ufunc = UFUNC["sum" if op == "avg" else op]
    acc = xs[0].copy()
    for x in xs[1:]:
        ufunc(acc, x, out=acc)
    if op == "avg" and acc.dtype.kind in "iu":  # NCCL's: truncated toward zero, exactly
        n = len(xs)
        flat = [abs(v) // n * (1 if v >= 0 else -1) for v in acc.reshape(-1).tolist()]
        acc = np.array(flat, acc.dtype).reshape(acc.shape)
    elif op == "avg":
        np.true_divide(acc, len(xs), out=acc, casting="unsafe")
    return acc


DTYPES = [
    "float32",
    "float64",
    "int32",
    "int64",
    "uint8",
    "int8",
    "float16",
    "bool",
    "complex64",
    "bfloat16",
]


# Every (dtype, op) that is defined: avg needs a number (bool is an error, tested by
# the kit). Complex min/max is NumPy's lexicographic order, as the shm CCL's (MPI has
# none: it was a raw "Invalid MPI_Op", an outside check).
ALLREDUCE_CASES = [
    (d, o) for o in ("sum", "prod", "min", "max", "avg") for d in DTYPES
    if not (o == "avg" and d == "bool")
]  # fmt: skip


@pytest.mark.parametrize("in_group", [True, False])
@pytest.mark.parametrize("dtype,op", ALLREDUCE_CASES)
def test_allreduce(sess, dtype, op, in_group):
    dt = _dt(dtype)
    seed = hash((dtype, op, in_group)) % 1000
    shape = (2, 3)
    src = sess.call_packed("mpi_test.make", shape, dtype, seed)
    dst = sess.empty(shape, dt)
    sess.allreduce(src, dst, op=op, in_group=in_group)
    for w in range(sess.num_workers):
        xs = [make(shape, dtype, seed, m) for m in _members(sess, w, in_group)]
        want = _reduce(xs, op, dt)
        got = dst.debug_get_from_remote(w)
        assert got.dtype == dt
        floating = dt.kind in "fc" or dtype == "bfloat16"
        if floating and len(xs) > 2 and op in ("sum", "prod", "avg"):
            tol = {2: 5e-2}.get(dt.itemsize, 1e-5)
            np.testing.assert_allclose(
                got.astype(np.complex128), want.astype(np.complex128), rtol=tol, atol=tol
            )
        else:
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("in_group", [True, False])
def test_allgather_broadcast_scatter_gather(sess, in_group):
    n = sess.num_workers
    src = sess.call_packed("mpi_test.make", (3,), "float64", 5)
    m = len(_members(sess, 0, in_group))
    dst = sess.empty((m * 3,), "float64")
    sess.allgather(src, dst, in_group=in_group)
    for w in range(n):
        want = np.concatenate([make((3,), "float64", 5, k) for k in _members(sess, w, in_group)])
        np.testing.assert_array_equal(dst.debug_get_from_remote(w), want)

    b = sess.empty((3,), "float64")
    sess.broadcast_from_worker0(src, b, in_group=in_group)
    for w in range(n):
        root = _members(sess, w, in_group)[0]
        np.testing.assert_array_equal(b.debug_get_from_remote(w), make((3,), "float64", 5, root))

    big = sess.call_packed("mpi_test.make", (m, 2), "int32", 9)
    piece = sess.empty((2,), "int32")
    sess.scatter_from_worker0(big, piece, in_group=in_group)
    for w in range(n):
        members = _members(sess, w, in_group)
        full = make((m, 2), "int32", 9, members[0])
        np.testing.assert_array_equal(piece.debug_get_from_remote(w), full[members.index(w)])

    gathered = sess.empty((m * 3,), "float64", worker0_only=True, in_group=in_group)
    sess.gather_to_worker0(src, gathered, in_group=in_group)
    roots = {_members(sess, w, in_group)[0] for w in range(n)}
    for r in roots:
        want = np.concatenate([make((3,), "float64", 5, k) for k in _members(sess, r, in_group)])
        np.testing.assert_array_equal(gathered.debug_get_from_remote(r), want)


def test_session_broadcast_and_scatter(sess):
    n = sess.num_workers
    size = n // sess.num_groups
    host = np.arange(n * 4, dtype="float32").reshape(n, 4)
    for in_group in (True, False):
        d = sess.broadcast(host, in_group=in_group)
        for w in range(n):
            np.testing.assert_array_equal(d.debug_get_from_remote(w), host)
    s = sess.scatter(host, in_group=False)
    g = sess.scatter(host[:size])  # in_group=True: every group gets the same rows
    for w in range(n):
        np.testing.assert_array_equal(s.debug_get_from_remote(w), host[w])
        np.testing.assert_array_equal(g.debug_get_from_remote(w), host[w % size])


def test_large_allreduce(sess):
    x = sess.broadcast(np.ones(3 << 20, dtype="float32"))  # 12 MiB
    y = sess.empty((3 << 20,), "float32")
    sess.allreduce(x, y, "sum", in_group=False)
    got = y.debug_get_from_remote(sess.num_workers - 1)
    assert got.shape == (3 << 20,) and np.all(got == sess.num_workers)


@pytest.mark.parametrize("in_group", [True, False])
def test_in_place_and_overlapping_buffers(sess, in_group):
    res = sess.call_packed("mpi_test.aliased", in_group)
    for w in range(sess.num_workers):
        got = res.debug_get_from_remote(w)
        members = _members(sess, w, in_group)
        root = members[0]
        np.testing.assert_array_equal(
            got["allreduce_same"], sum(aliased_input(m, 6) for m in members)
        )
        np.testing.assert_array_equal(
            got["allreduce_overlap"], np.max([aliased_input(m)[0:6] for m in members], axis=0)
        )
        slots = np.concatenate([aliased_input(m, 3) for m in members])
        np.testing.assert_array_equal(got["allgather_slot"], slots)
        np.testing.assert_array_equal(got["allgather_first"], slots)
        np.testing.assert_array_equal(got["broadcast_overlap"], aliased_input(root)[0:6])
        if w == root:
            np.testing.assert_array_equal(got["gather_root_slot"], slots)
        index = members.index(w)
        np.testing.assert_array_equal(got["scatter_root_slot"], np.full(3, index + 100.0 * root))


def test_point_to_point(sess):
    n = sess.num_workers
    buf = sess.call_packed("mpi_test.make", (4,), "int64", 3)
    out = sess.empty((4,), "int64")
    sess.call_packed("mpi_test.p2p", buf, out)
    for w in range(n):
        np.testing.assert_array_equal(out.debug_get_from_remote(w), make((4,), "int64", 3, w ^ 1))


def test_send_to_next_group():
    with _session(4, 2) as sess:
        buf = sess.call_packed("mpi_test.make", (5,), "float32", 4)
        out = sess.empty((5,), "float32")
        sess.call_packed("mpi_test.pipeline", buf, out)
        for w in (2, 3):
            np.testing.assert_array_equal(
                out.debug_get_from_remote(w), make((5,), "float32", 4, w - 2)
            )


def test_ordered_bit_identical():
    with _session(4, ordered=True) as sess:
        src = sess.call_packed("mpi_test.make", (1000,), "float32", 11)
        dst = sess.empty((1000,), "float32")
        sess.allreduce(src, dst, "sum", in_group=False)
        xs = [make((1000,), "float32", 11, w) for w in range(4)]
        want = functools.reduce(lambda a, b: a + b, xs)
        for w in range(4):
            assert dst.debug_get_from_remote(w).tobytes() == want.tobytes()


def test_two_workers_bit_identical():
    with _session(2) as sess:
        _two_workers_bit_identical(sess)


def _two_workers_bit_identical(sess):
    src = sess.call_packed("mpi_test.make", (1000,), "float32", 12)
    dst = sess.empty((1000,), "float32")
    sess.allreduce(src, dst, "sum")
    want = make((1000,), "float32", 12, 0) + make((1000,), "float32", 12, 1)
    assert dst.debug_get_from_remote(1).tobytes() == want.tobytes()


def test_mismatch_fails_everywhere_and_session_survives(sess):
    n = sess.num_workers
    src = sess.call_packed("mpi_test.shape_by_worker", "float32")
    dst = sess.call_packed("mpi_test.shape_by_worker", "float32")
    sess.allreduce(src, dst, "sum", in_group=False)
    with pytest.raises(WorkerError) as info:
        sess.sync_worker_0()
    err = info.value
    ids = {err.worker_id, *(e.worker_id for e in err.others)}
    assert ids == set(range(n))
    assert "differ" in str(err) and err.exc_type == "CCLError"
    # still usable
    x = sess.broadcast(np.ones(3, "float32"))
    y = sess.empty((3,), "float32")
    sess.allreduce(x, y, "max")
    np.testing.assert_array_equal(y.debug_get_from_remote(n - 1), np.ones(3))


def test_missing_register_and_bad_recv(sess):
    y = sess.empty((3,), "float32")
    sess.allgather(sess.empty((3,), "float32"), y)  # dst too small for n x src
    with pytest.raises(WorkerError, match="must hold"):
        sess.sync_worker_0()
    # (a call in between: a pair right after a failed call of an end is given up)
    sess.call_packed("disco.barrier", False)
    r = sess.call_packed("mpi_test.bad_recv")
    with pytest.raises(WorkerError, match="receive buffer"):
        r.debug_get_from_remote(1)
    sess.call_packed("disco.barrier", False)
    sess.sync_worker_0()


def test_threaded_session_refused():
    with disco.ThreadedSession(2) as sess:
        with pytest.raises(CCLError, match="one process per worker"):
            sess.init_ccl("mpi")


def test_unknown_option():
    with disco.ProcessSession(2) as sess:
        with pytest.raises(TypeError, match="unknown options"):
            sess.init_ccl("mpi", bogus=1)
        # device ids were ignored (a GPU user's init_ccl("mpi", 0, 1) got host collectives)
        with pytest.raises(disco.DiscoValueError, match=r"takes no device ids, got \(0, 1\)"):
            sess.init_ccl("mpi", 0, 1)


@pytest.mark.timeout(60)
def test_worker_dies_during_collective():
    """The survivors, left waiting in the collective, hear the loss through MPI (worker
    0's alarm): shutdown() finds them reading its command, not stuck until its timeout
    (5 s) runs out and it kills them (a chaos check: every such shutdown took 5.0 s)."""
    sess = _session(4)
    try:
        x = sess.broadcast(np.ones(1 << 16, "float32"))
        y = sess.empty((1 << 16,), "float32")
        sess.call_packed("mpi_test.die_on", 2, 0.3)
        t0 = time.monotonic()
        sess.allreduce(x, y, "sum")
        with pytest.raises(WorkerDiedError) as info:
            sess.sync_worker_0()
            y.debug_get_from_remote(0)
        assert 2 in info.value.worker_ids
        assert time.monotonic() - t0 < 15
    finally:
        t1 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t1 < 3.0, "shutdown waited for workers stuck in MPI"


def test_workers_left_in_a_collective_are_not_only_blamed(monkeypatch):
    """Found by a chaos check: after worker 0 failed, workers that did not catch up within
    DISCO_GATHER_TIMEOUT were called "stuck, frozen or far behind", though with MPI they
    are most likely alive, waiting in a collective that worker 0 left (MPI has no timeout
    of its own). The error says so. Here worker 1 is simply busy in a function."""
    monkeypatch.setenv("DISCO_GATHER_TIMEOUT", "1")
    s = _session(2)
    try:
        s.import_python_module("disco_core.testing.funcs")
        s.call_packed("testing.sleep", 3.0, 1)  # worker 1 busy for 3 s
        s.call_packed("testing.raise_on", 0)
        with pytest.raises(disco.WorkerUnresponsiveError) as info:
            s.sync_worker_0()
        assert info.value.worker_ids == [1]
        text = str(info.value)
        assert "waiting in a collective that worker 0 left" in text and "'mpi'" in text, text
    finally:
        s.shutdown()


def test_a_call_checked_in_a_group_is_checked_again_for_the_world():
    """The checked-calls cache did not say which communicator: a call right within a
    group of 2 skipped the check for the 4 workers of the world (an outside check of
    the shm CCL, whose cache this one shares the pattern of)."""
    sess = _session(4, 2)
    try:
        a = sess.broadcast(np.arange(4, dtype="float32"))
        g = sess.empty((8,), "float32")
        sess.allgather(a, g, in_group=True)
        assert g.debug_get_from_remote(3).tolist() == [0, 1, 2, 3] * 2
        with pytest.raises(WorkerError, match="must hold 4 x src"):
            sess.allgather(a, g, in_group=False)
            sess.sync_worker_0()
    finally:
        sess.shutdown()


# --------------------------------------------------------------------- failed calls
def _outcomes(ref, workers):
    """Each worker's value of ``ref`` (a list), or its error's text."""
    out = []
    for w in workers:
        try:
            out.append(ref.debug_get_from_remote(w).tolist())
        except WorkerError as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_worker_that_fails_before_a_collective_ends_its_peers_wait(bad):
    """Worker ``bad`` raises before an allreduce its peers entered: they waited the whole
    CCL timeout (300 s by default; TVM waits for ever). They fail at once now, naming
    its error, and no later collective is paired with the one it skipped."""
    sess = _session(3, timeout=60)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        t0 = time.monotonic()
        failed = sess.get_global_func("testing.raise_or_allreduce")(bad)
        got = _outcomes(failed, range(3))
        assert time.monotonic() - t0 < 20, got
        assert all(isinstance(g, str) for g in got), got
        peer = 0 if bad else 1
        assert f"worker {bad} fails before the collective" in got[peer], got
        again = _outcomes(sess.get_global_func("testing.raise_or_allreduce")(-1), range(3))
        for g in again:  # the sum of three ones, or an error (the CCL may be given up)
            assert g == [3.0] * 4 or isinstance(g, str), again
    finally:
        sess.shutdown()


@pytest.mark.parametrize("slow", [0.0, 0.5])
def test_a_failed_call_without_collectives_leaves_the_ccl_usable_and_calls_unpaired(slow):
    """A call that raised on worker 1 where no collective ran leaves the CCL as it
    was; worker 1's next collective waits until every member is past the failed call,
    so a slow member (``slow`` s late into the next call) is never paired wrongly."""
    sess = _session(3, timeout=60)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        for _ in range(2):
            raised = sess.get_global_func("testing.raise_on")(1)
            sess.get_global_func("testing.sleep")(slow, 0)
            ok = sess.get_global_func("testing.raise_or_allreduce")(-1)
            assert isinstance(_outcomes(raised, [1])[0], str)
            assert _outcomes(ok, range(3)) == [[3.0] * 4] * 3
    finally:
        sess.shutdown()


def test_a_collective_one_worker_skipped_never_pairs_with_its_next_one():
    """Worker 1 skips an allreduce (code that differs between workers: no call failed,
    so nobody was told): its next allreduce was matched with the one it skipped, and
    both returned sums as values. Each member's exchange carries its call now: every
    member sees the mismatch and fails, naming worker 1, and the CCL is given up (the
    members are out of step) rather than left to wait for the timeout."""
    sess = _session(3, timeout=60)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        t0 = time.monotonic()
        skipped = sess.get_global_func("testing.allreduce_unless")(1)
        after = sess.get_global_func("testing.allreduce_unless")(-1)
        got = _outcomes(skipped, [0, 2]) + _outcomes(after, range(3))
        assert all(isinstance(g, str) for g in got), got
        assert any("worker(s) [1] reached this allreduce from call" in g for g in got), got
        assert time.monotonic() - t0 < 20
    finally:
        sess.shutdown()


@pytest.mark.parametrize("first_in_group", [False, True])
def test_a_skipped_collective_followed_by_one_on_the_other_communicator_fails_at_once(first_in_group):  # fmt: skip
    """Worker 1 skips a world (group) allreduce, and its next call runs a group (world)
    one: no exchange of calls meets the two, and they waited for the CCL's timeout. A
    collective that waits past 50 ms tells the others where it waits: they see that
    worker 1 went on, and fail, naming it."""
    sess = _session(4, 2, timeout=30)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        check_skip_onto_the_other_communicator(sess, first_in_group)
    finally:
        sess.shutdown()


def test_late_workers_in_world_and_group_collectives_are_never_taken_for_a_skip():
    """A correct program whose workers come late by turns (each wait then tells the
    others where it waits): 60 calls of world and group allreduces, barriers and calls
    without a collective, every value right."""
    sess = _session(4, 2, timeout=30)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        unless = sess.get_global_func("testing.allreduce_unless")
        nap = sess.get_global_func("testing.sleep")
        refs = []
        for i in range(60):
            nap(0.06, i % 4)  # (past the 50 ms after which a wait says where it is)
            if i % 5 == 4:
                continue  # a call without a collective
            refs.append((unless(-1, i % 3 == 0), i % 3 == 0))
        for ref, in_group in refs:
            want = [2.0 if in_group else 4.0] * 4
            assert _outcomes(ref, range(4)) == [want] * 4
    finally:
        sess.shutdown()


# Point-to-point pairs after failed calls (the steps: disco_core.testing.p2p_steps).
_P2P_SCENARIOS = {
    # each returned another send's value as a value before messages carried their calls
    "same call, receiver fails": [("pair", 1, 0), ("pair", 2, -1), ("pair", 3, -1)],
    "same call, large, receiver fails": [("pair", 1, 0, "large"), ("pair", 2, -1, "large")],
    "split, send first, sender fails": [
        ("send", 1, 1), ("recv", 1, -1), ("send", 2, -1), ("recv", 2, -1),
        ("send", 3, -1), ("recv", 3, -1),
    ],
    # a pipeline (each command receives what the one before sent, and sends the next):
    # after a skipped send, a message of the receive's own call was taken as its value
    "pipeline, sender fails": [
        ("send", 1, -1), ("pipe", 2, 1), ("pipe", 3, -1), ("pipe", 4, -1), ("recv", 4, -1),
    ],
    "pipeline, receiver fails": [("send", 1, -1), ("pipe", 2, 0), ("pipe", 3, -1), ("recv", 3, -1)],
    "same call, sender fails, late receive": [("nap",), ("pair", 1, 1), ("pair", 2, -1)],
}  # fmt: skip


@pytest.mark.parametrize("scenario", sorted(_P2P_SCENARIOS))
def test_after_a_failed_call_a_receive_returns_its_own_sends_value_or_an_error(scenario):
    """A receive after a failed call took the next send's message as its value (1.0 for
    2.0, 2.0 for 3.0: the probe of 2026-11-29). A message carries the call it was sent
    in and its sender's last failed call; where it cannot be told which receive a
    message is for, the pair is given up: errors, never another send's value; the other
    direction still pairs. The sessions run one after another in this process, as
    stale messages of one session's CCL reached the next one's receives (see
    ``_P2P_TAGS``)."""
    sess = _session(2, timeout=15)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        pair = sess.get_global_func("testing.p2p_pair")
        t0 = time.monotonic()
        receives = run_p2p_steps(sess, _P2P_SCENARIOS[scenario])
        got = [(step, value, _outcomes(ref, [0])[0]) for step, value, ref in receives]
        assert all(isinstance(g, str) or g == [v] * len(g) for _s, v, g in got), got
        assert any(isinstance(g, str) and "may be another" in g for _s, _v, g in got), got
        # (a large send whose receiver failed without taking it fails at once too)
        assert time.monotonic() - t0 < 10
        # the other direction pairs (a call later: a given-up receive is a failed
        # call of its worker, and the rules apply to a pair in the next call)
        sess.get_global_func("testing.sleep")(0.0, 0)
        assert _outcomes(pair(0, 1, 42.0), [1])[0] == [42.0] * 4
    finally:
        sess.shutdown()


@pytest.mark.parametrize(
    "case",
    [
        "sender fails",
        "sender fails, receiver late",
        "receiver fails, large send",
        "sender fails the call before",
        "receiver fails the call before, large send",
    ],
)
def test_a_pair_whose_other_end_failed_without_its_part_fails_at_once(case):
    """A receive whose sender failed in its call without sending, and a large send
    (MPI completes small ones without their receive) whose receiver failed without
    taking it, waited for the CCL's timeout (15 s here). The failed call's notice says
    how many messages its worker had sent to and taken from each peer: they fail at
    once, naming the failure, and later sends and receives of that pair too; the other
    direction still pairs, and so does the session's next collective."""
    sess = _session(2, timeout=15)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        pair = sess.get_global_func("testing.p2p_pair")
        t0 = time.monotonic()
        waited, failed = (1, 0) if case.startswith("receiver") else (0, 1)
        if case == "sender fails, receiver late":
            ref = pair(1, 0, 1.0, 1, 0.5)
        elif case == "sender fails":
            ref = pair(1, 0, 1.0, 1)
        elif case == "receiver fails, large send":
            ref = pair(1, 0, 1.0, 0, 0.0, "both", 1 << 20)  # 4 MiB
        else:  # (the failed call, then the other end's half alone: its peer ends that call)
            first = pair(1, 0, 1.0, failed, 0.0, "recv" if failed == 0 else "send")
            assert "fails before" in _outcomes(first, [failed])[0]
            if failed == 1:
                ref = pair(1, 0, 0.0, -1, 0.0, "recv")
            else:
                ref = pair(1, 0, 1.0, -1, 0.0, "send", 1 << 20)
        got = _outcomes(ref, [waited] if "before" in case else [waited, failed])
        assert time.monotonic() - t0 < 10, got
        want = "without taking" if waited == 1 else "without sending the message of call"
        assert want in got[0] and "RuntimeError" in got[0], got
        if "before" in case:
            assert "and ended call" in got[0], got
        else:
            assert "fails before" in got[1], got
        again = _outcomes(pair(1, 0, 2.0), [waited])[0]
        assert "were given up" in again, again
        assert time.monotonic() - t0 < 10
        sess.get_global_func("testing.sleep")(0.0, 0)  # (a call in between: see the README)
        assert _outcomes(pair(0, 1, 42.0), [1])[0] == [42.0] * 4
        assert _outcomes(sess.get_global_func("testing.allreduce_unless")(-1), [0, 1]) == [[2.0] * 4] * 2  # fmt: skip
    finally:
        sess.shutdown()


@pytest.mark.parametrize("nbytes", [0, 1 << 20], ids=["receive", "large send"])
def test_a_collective_before_the_wait_keeps_the_notice_of_the_call_before(nbytes):
    """Worker 1 failed in call A; in call B it does nothing, and worker 0 runs a
    (group) collective, then waits for a message from worker 1 (or for it to take a
    large send). The collective forgot notices of calls before B, so the wait lasted
    the CCL's timeout (an outside check); the notice of the call before is kept."""
    sess = _session(2, groups=2, timeout=15)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        failed = sess.get_global_func("testing.raise_on")(1)
        assert "raised on purpose" in _outcomes(failed, [1])[0]
        t0 = time.monotonic()
        ref = sess.get_global_func("mpi_test.barrier_then_p2p")(nbytes)
        got = _outcomes(ref, [0])[0]
        assert time.monotonic() - t0 < 10, got
        assert "and ended call" in got, got
    finally:
        sess.shutdown()


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_a_message_sent_before_its_senders_failure_is_still_received(delay):
    """A sender that sent, then raised: its notice can overtake its message (they go on
    two communicators), but it counts the message, so the receive waits for it and
    returns it, never gives it up; with the receive first (``delay``) or the send."""
    sess = _session(2, timeout=15)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        for value in (1.0, 2.0, 3.0):
            sess.get_global_func("testing.sleep")(0.0, 0)  # (see the README: the price)
            ref = sess.get_global_func("testing.send_then_raise")(1, 0, value, delay)
            got = _outcomes(ref, [1, 0])  # (the call's failure first, then worker 0's value)
            assert "fails after its send" in got[0] and got[1] == [value] * 4, got
    finally:
        sess.shutdown()


def test_split_pairs_still_pair_without_failures_and_after_a_third_workers():
    """A send in one command and its receive in the next pair, before and after a call
    that failed on a worker that is neither end."""
    sess = _session(3, timeout=30)
    try:
        sess.import_python_module("disco_core.testing.funcs")
        pair = sess.get_global_func("testing.p2p_pair")
        for failed_before in (False, True):
            if failed_before:
                raised = sess.get_global_func("testing.raise_on")(2)
                assert isinstance(_outcomes(raised, [2])[0], str)
            got = []
            pair(1, 0, 5.0, -1, 0.0, "send")
            for value in (6.0, 7.0):
                got.append(_outcomes(pair(1, 0, 0.0, -1, 0.0, "recv"), [0])[0])
                pair(1, 0, value, -1, 0.0, "send")
            got.append(_outcomes(pair(1, 0, 0.0, -1, 0.0, "recv"), [0])[0])
            assert got == [[5.0] * 4, [6.0] * 4, [7.0] * 4], (failed_before, got)
            assert _outcomes(pair(0, 1, 42.0), [1])[0] == [42.0] * 4
    finally:
        sess.shutdown()


def test_a_message_an_earlier_session_left_unreceived_never_reaches_the_next_one():
    """Worker 0 lives in the controller's process, whose MPI gives a freed
    communicator's context to the next one made: a message that one session's worker
    1 sent and worker 0 never received was taken by the next session's receive, as
    its value. Each CCL's point-to-point messages have tags of their own now."""
    for value in (1.0, 2.0):
        sess = _session(2, timeout=15)
        try:
            sess.import_python_module("disco_core.testing.funcs")
            pair = sess.get_global_func("testing.p2p_pair")
            if value == 1.0:  # sent, never received
                pair(1, 0, 99.0, -1, 0.0, "send")
                sess._sync_all()
            else:
                assert _outcomes(pair(1, 0, value), [0])[0] == [value] * 4
        finally:
            sess.shutdown()
