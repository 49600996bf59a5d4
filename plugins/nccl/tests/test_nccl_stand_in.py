"""disco-nccl's own logic on 4-worker ThreadedSessions, with a STAND-IN for CuPy and NCCL.

Every test here runs on ``_nccl_stand_in`` (see its docstring): not CuPy, not NCCL,
no GPU. They check what disco-nccl adds on top of NCCL: the rendezvous and the
group communicators (``ncclCommSplit`` or separate ids), scatter/gather offsets,
argument agreement, point-to-point framing, GPU binding and the communicator life
cycle. ``test_nccl_gpu.py`` runs the real thing where a GPU is present.
"""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest
from _nccl_stand_in import NcclCommunicator, make_modules

import disco_core as disco
from disco_core import register_func
from disco_core.errors import CCLError
from disco_core.spi import ControllerStore
from disco_core.testing import ccl_funcs  # noqa: F401  (registers ccl_kit.*)
from disco_core.worker import WorkerContext, current
from disco_nccl import ccl as nccl_ccl
from disco_nccl.ccl import NCCLCCL

pytestmark = pytest.mark.timeout(60)

N = 4


@register_func("nccl_test.gpu_of", override=True)
def _gpu_of(arr) -> int:
    """The (stand-in) GPU an array lives on, and the worker's default device's id."""
    return (arr.device.id, current().device.device_id)


@pytest.fixture
def stand_in(monkeypatch):
    """Install the stand-in as ``cupy`` for this test (``install(gpus=, split=, old_ids=)``)."""

    def install(**kw):
        for name, mod in make_modules(**kw).items():
            monkeypatch.setitem(sys.modules, name, mod)
        return sys.modules["cupy"]

    return install


@pytest.fixture
def session(stand_in):
    """``session(groups=1, *device_ids, split=True, old_ids=False, gpus=4, **options)``."""
    made = []

    def make(groups=1, *ids, split=True, old_ids=False, gpus=N, **options):
        stand_in(gpus=gpus, split=split, old_ids=old_ids)
        sess = disco.ThreadedSession(N, num_groups=groups)
        made.append(sess)
        sess.init_ccl("nccl", *ids, **options)
        return sess

    yield make
    for sess in made:
        sess.shutdown()


def _members(w: int, groups: int, in_group: bool) -> range:
    if not in_group:
        return range(N)
    size = N // groups
    return range(w // size * size, (w // size + 1) * size)


def _sync_all(sess) -> None:
    """Wait for every worker (raising their pending errors), not only worker 0."""
    ref = sess.call_packed("ccl_kit.peer", "self")
    for w in range(N):
        assert ref.debug_get_from_remote(w) == w


def _host(value):
    return value.get() if hasattr(value, "get") else np.asarray(value)


def _get(ref, w):
    return _host(ref.debug_get_from_remote(w))


LAYOUTS = [(1, True), (2, True), (2, False), (4, True)]


# --------------------------------------------------------------------- collectives
@pytest.mark.parametrize(("groups", "split"), LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_allreduce_every_op_in_world_and_groups(session, groups, split, dtype):
    sess = session(groups, split=split)
    host = (np.arange(N * 6).reshape(N, 6) % 7 - 3).astype(dtype)
    x = sess.scatter(host, in_group=False)  # through ncclSend/ncclRecv from worker 0
    for w in range(N):
        np.testing.assert_array_equal(_get(x, w), host[w])
    y = sess.empty((6,), dtype)
    ops = ["sum", "prod", "min", "max", "avg"]
    # ncclAvg on integers: the sum divided by the member count, truncated toward zero
    avg = np.trunc if dtype.startswith("int") else np.asarray
    for in_group in (False, True):
        for op in ops:
            sess.allreduce(x, y, op, in_group=in_group)
            for w in range(N):
                part = host[list(_members(w, groups, in_group))]
                ref = {
                    "sum": part.sum(0),
                    "prod": part.prod(0),
                    "min": part.min(0),
                    "max": part.max(0),
                    "avg": avg(part.sum(0) / len(part)),
                }[op].astype(dtype)
                np.testing.assert_array_equal(_get(y, w), ref, err_msg=f"{op} {in_group} w{w}")


@pytest.mark.parametrize(("groups", "split"), LAYOUTS)
def test_allgather_broadcast_scatter_gather(session, groups, split):
    sess = session(groups, split=split)
    host = np.arange(N * 3, dtype=np.float64).reshape(N, 3)
    x = sess.scatter(host, in_group=False)
    g = sess.empty((N * 3,), "float64")
    sess.allgather(x, g, in_group=False)
    for w in range(N):
        np.testing.assert_array_equal(_get(g, w), host.reshape(-1))
    gs = sess.empty((N // groups * 3,), "float64")
    sess.allgather(x, gs, in_group=True)
    for w in range(N):
        np.testing.assert_array_equal(
            _get(gs, w), host[list(_members(w, groups, True))].reshape(-1)
        )
    b = sess.broadcast(np.array([1.5, -2.0], np.float16))
    for w in range(N):
        np.testing.assert_array_equal(_get(b, w), np.array([1.5, -2.0], np.float16))
    out = sess.empty((N, 3), "float64", worker0_only=True)
    sess.gather_to_worker0(x, out, in_group=False)
    np.testing.assert_array_equal(_get(out, 0), host)
    # In groups: each group root scatters its own rows and gathers them back.
    size = N // groups
    rows = sess.empty((size, 3), "float64")
    sess.copy_to_worker_0(host[:size], rows)
    mine = sess.empty((3,), "float64")
    sess.scatter_from_worker0(rows, mine, in_group=True)
    np.testing.assert_array_equal(_get(mine, 0), host[0])
    if size > 1:
        np.testing.assert_array_equal(_get(mine, 1), host[1])


def test_point_to_point_rings_pairs_and_groups(session):
    sess = session(2)
    host = np.arange(N * 5, dtype=np.int64).reshape(N, 5)
    x = sess.scatter(host, in_group=False)
    out = sess.empty((5,), "int64")
    nxt = sess.call_packed("ccl_kit.peer", "next")
    prv = sess.call_packed("ccl_kit.peer", "prev")
    sess.call_packed("ccl_kit.exchange", x, out, nxt, prv)
    for w in range(N):
        np.testing.assert_array_equal(_get(out, w), host[(w - 1) % N])
    piped = sess.empty((5,), "int64")
    sess.call_packed("ccl_kit.pipeline", x, piped)  # group 0 -> group 1
    for w in (2, 3):
        np.testing.assert_array_equal(_get(piped, w), host[w - 2])
    sess.call_packed("ccl_kit.send_from_worker0", x)
    got = sess.empty((5,), "int64")
    sess.call_packed(sess.get_global_func("disco.recv_from_worker0"), got)
    for w in range(1, N):
        np.testing.assert_array_equal(_get(got, w), host[0])


@pytest.mark.parametrize("kind", ["size", "dtype"])
def test_a_receiver_with_the_wrong_buffer_fails_and_takes_the_message_off_the_wire(session, kind):
    sess = session()
    x = sess.scatter(np.arange(N * 4, dtype=np.float32).reshape(N, 4), in_group=False)
    wrong = sess.empty((3,), "float32") if kind == "size" else sess.empty((4,), "int32")
    sess.call_packed("ccl_kit.call_on", (0,), "send_to_worker", x, 1)
    sess.call_packed("ccl_kit.call_on", (1,), "recv_from_worker", wrong, 0)
    with pytest.raises(disco.WorkerError, match=r"worker 0 sent float32\[4\] but the receive"):
        _sync_all(sess)
    # Nothing was left queued between 0 and 1: the next message is the next one sent.
    right = sess.empty((4,), "float32")
    sess.call_packed("ccl_kit.call_on", (0,), "send_to_worker", x, 1)
    sess.call_packed("ccl_kit.call_on", (1,), "recv_from_worker", right, 0)
    assert _get(right, 1).tolist() == [0.0, 1.0, 2.0, 3.0]


# --------------------------------------------------------------------- agreement
def test_mismatched_calls_fail_on_every_worker_with_the_same_error(session):
    sess = session()
    x = sess.scatter(np.ones((N, 4), np.float32), in_group=False)
    y = sess.empty((4,), "float32")
    ops = ("sum",) * (N - 1) + ("max",)
    sess.call_packed("ccl_kit.allreduce_per_worker_op", x, y, ops, False)
    with pytest.raises(disco.WorkerError) as info:
        _sync_all(sess)
    errors = [info.value, *info.value.others]
    assert {e.worker_id for e in errors} == set(range(N))
    assert all("CCLError" in e.exc_type for e in errors)
    sess.allreduce(x, y)
    assert _get(y, 2).tolist() == [4.0] * 4


@pytest.mark.parametrize(
    ("make_src", "pattern"),
    [
        (lambda s: s.empty((4,), "bool"), "no datatype for bool"),
        (lambda s: s.empty((4,), "float32", device="cpu"), "must be a CuPy array"),
    ],
)
def test_arrays_nccl_cannot_take_are_refused_on_every_worker(session, make_src, pattern):
    sess = session()
    src = make_src(sess)
    sess.allreduce(src, src)
    with pytest.raises(disco.WorkerError, match=pattern) as info:
        _sync_all(sess)
    assert {e.worker_id for e in [info.value, *info.value.others]} == set(range(N))


def test_validate_false_skips_the_descriptor_exchange(session):
    sess = session(validate=False)
    x = sess.scatter(np.ones((N, 2), np.float32), in_group=False)
    y = sess.empty((2,), "float32")
    _sync_all(sess)
    before = [list(c.calls) for c in NcclCommunicator.made]
    sess.allreduce(x, y)
    _sync_all(sess)
    added = [c.calls[len(b) :] for c, b in zip(NcclCommunicator.made, before)]
    assert sorted(map(tuple, added)) == [("allReduce",)] * N
    assert _get(y, 1).tolist() == [4.0, 4.0]


# --------------------------------------------------------------------- set-up
def test_each_worker_binds_its_gpu_and_allocates_there(session):
    sess = session(1, 3, 2, 1, 0)
    dev = sess.get_global_func("disco.device")()
    assert [dev.debug_get_from_remote(w) for w in range(N)] == [
        disco.Device("cuda", g) for g in (3, 2, 1, 0)
    ]
    arr = sess.empty((2,), "float32")
    where = sess.call_packed("nccl_test.gpu_of", arr)
    assert [tuple(where.debug_get_from_remote(w)) for w in range(N)] == [
        (g, g) for g in (3, 2, 1, 0)
    ]


def test_collectives_run_on_the_workers_gpu_whatever_the_controller_made_current(session):
    sess = session(1, 3, 2, 1, 0)
    import cupy

    cupy.cuda.Device(1).use()  # the controller's thread may run worker 0's commands
    x = sess.scatter(np.ones((N, 2), np.float32), in_group=False)
    y = sess.empty((2,), "float32")
    sess.allreduce(x, y)  # the stand-in refuses an operation with another GPU current
    assert _get(y, 0).tolist() == [4.0, 4.0]


@pytest.mark.parametrize("split", [True, False])
def test_group_communicators_come_from_comm_split_or_their_own_ids(session, split):
    sess = session(2, split=split)
    comms = list(NcclCommunicator.made)
    world = [c for c in comms if c.ndev == N]
    group = [c for c in comms if c.ndev == 2]
    assert sorted(c.rank for c in world) == [0, 1, 2, 3]
    assert sorted(c.rank for c in group) == [0, 0, 1, 1]
    if split:  # ncclCommSplit of the world communicator, colour = group id
        assert {c.key for c in group} == {(world[0].key, 0), (world[0].key, 1)}
    else:  # one unique id per group, none shared with the world
        assert len({c.key for c in group}) == 2 and world[0].key not in {c.key for c in group}
    sess.shutdown()
    assert [c.destroyed for c in comms] == [1] * len(comms)


def test_one_group_shares_the_world_communicator_and_destroys_it_once(session):
    sess = session(1)
    comms = list(NcclCommunicator.made)
    assert len(comms) == N
    sess.shutdown()
    assert [c.destroyed for c in comms] == [1] * N


def test_cupy_before_14_takes_ids_as_tuples(session):
    sess = session(2, split=False, old_ids=True)
    x = sess.scatter(np.arange(N, dtype=np.float32).reshape(N, 1), in_group=False)
    y = sess.empty((1,), "float32")
    sess.allreduce(x, y, in_group=True)
    assert [_get(y, w).item() for w in range(N)] == [1.0, 1.0, 5.0, 5.0]


def test_the_controller_checks_gpus_only_when_the_workers_are_local(stand_in):
    stand_in(gpus=0)
    remote = types.SimpleNamespace(num_workers=4, num_groups=1, num_nodes=2, shares_memory=False)
    rv = NCCLCCL.rendezvous(remote, (0, 1))  # a GPU-less controller of GPU nodes
    assert rv.payload["device_ids"] == (0, 1)
    local = types.SimpleNamespace(num_workers=2, num_groups=1, num_nodes=1, shares_memory=True)
    with pytest.raises(CCLError, match="needs a GPU, and this machine has none"):
        NCCLCCL.rendezvous(local, ())
    stand_in(gpus=2)
    with pytest.raises(CCLError, match=r"no GPU \[2, 3\]"):
        NCCLCCL.rendezvous(types.SimpleNamespace(**{**vars(local), "num_workers": 4}), ())


def test_a_worker_given_a_gpu_its_machine_lacks_says_so(stand_in):
    stand_in(gpus=1)
    payload = {"token": 0, "device_ids": (0, 1), "world_uid": b"\0" * 128, "split": False,
               "group_uids": None, "validate": True}  # fmt: skip
    with pytest.raises(CCLError, match="worker 1 was given GPU 1, but its machine has 1"):
        NCCLCCL(WorkerContext(1, 2, 1), payload)


def test_ids_are_made_only_for_the_communicators_that_use_them(stand_in):
    channel = types.SimpleNamespace(num_workers=4, num_groups=2, num_nodes=1, shares_memory=True)
    stand_in(split=True)
    p = NCCLCCL.rendezvous(channel, ()).payload
    assert p["split"] and p["group_uids"] is None  # each unused id would keep an NCCL thread
    assert isinstance(p["world_uid"], bytes) and len(p["world_uid"]) == 128
    stand_in(split=False)
    p = NCCLCCL.rendezvous(channel, ()).payload
    assert not p["split"] and len(p["group_uids"]) == 2


@pytest.mark.parametrize(("name", "hip", "pattern"), [
    ("nccl", True, r"ROCm build; use init_ccl\('rccl'\)"),
    ("rccl", False, r"CUDA build; use init_ccl\('nccl'\)"),
])  # fmt: skip
def test_the_wrong_cupy_build_is_named(stand_in, name, hip, pattern):
    stand_in().cuda.runtime.is_hip = hip
    with disco.ThreadedSession(1) as sess:
        with pytest.raises(CCLError, match=pattern):
            sess.init_ccl(name)


def test_a_worker_whose_machine_lacks_its_gpu_fails_before_anyone_enters_nccl(stand_in):
    cupy = stand_in(gpus=4)

    def gpus_here() -> int:  # worker 2 stands for a node with a single GPU
        try:
            return 1 if current().worker_id == 2 else 4
        except disco.DiscoError:  # the controller's own thread
            return 4

    cupy.cuda.runtime.getDeviceCount = gpus_here
    with disco.ThreadedSession(N) as sess:
        t0 = time.monotonic()
        with pytest.raises(
            disco.WorkerError, match="worker 2 was given GPU 2, but its machine has 1"
        ):
            sess.init_ccl("nccl")
        assert time.monotonic() - t0 < 5, "the other workers waited inside ncclCommInitRank"
        assert NcclCommunicator.made == []  # nobody started NCCL's initialisation
        sess.init_ccl("shm")  # and nothing was left half-made


_GPU_TESTS_ON_STAND_IN = """
import sys
import threading
sys.path.insert(0, {tests!r})
import _nccl_stand_in
sys.modules.update(_nccl_stand_in.make_modules(gpus=1))
import pytest
sys.exit(pytest.main([{gpu_tests!r}, "-q", "-k", "threaded", "-p", "no:cacheprovider"]))
"""


def test_the_gpu_tests_themselves_hold_on_the_stand_in(tmp_path):
    """test_nccl_gpu.py's threaded cases, run on the stand-in: keeps that file from rotting
    between GPU runs (its flows and expected messages); it says nothing about NCCL."""
    import subprocess
    from pathlib import Path

    tests = Path(__file__).parent
    code = _GPU_TESTS_ON_STAND_IN.format(
        tests=str(tests), gpu_tests=str(tests / "test_nccl_gpu.py")
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout


def _local(workers: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_workers=workers, num_groups=1, num_nodes=1, shares_memory=True)


def _abort_later(rv, reason: str, after: float = 0.3) -> threading.Timer:
    timer = threading.Timer(after, rv.abort, (reason,))
    timer.start()
    return timer


def test_init_waiting_for_a_dead_peer_gives_up_when_the_session_aborts(stand_in):
    stand_in(gpus=2)
    rv = NCCLCCL.rendezvous(_local(2), ())
    _abort_later(rv, "worker(s) [1] died: killed")
    t0 = time.monotonic()
    with pytest.raises(CCLError, match=r"aborted: worker\(s\) \[1\] died"):
        NCCLCCL(WorkerContext(0, 2, 1), rv.payload)  # rank 1 never joins
    assert time.monotonic() - t0 < 5
    rv.close()


def test_a_wait_on_the_gpu_gives_up_and_aborts_nccl_when_the_session_aborts(stand_in):
    cupy = stand_in(gpus=1)
    rv = NCCLCCL.rendezvous(_local(1), ())
    ccl = NCCLCCL(WorkerContext(0, 1, 1), rv.payload)
    never = types.SimpleNamespace(ptr=0, done=False)  # a kernel waiting for a dead peer
    cupy.cuda.get_current_stream = lambda: never
    _abort_later(rv, "worker(s) [1] died: killed")
    t0 = time.monotonic()
    with pytest.raises(CCLError, match=r"synchronize aborted: worker\(s\) \[1\] died"):
        ccl.synchronize()
    assert time.monotonic() - t0 < 5
    assert [c.aborted for c in NcclCommunicator.made] == [1]  # ncclCommAbort ends the kernels
    with pytest.raises(CCLError, match="closed"):
        ccl.allreduce(None, None, "sum", False)
    rv.close()


def _in_a_process_of_its_own(monkeypatch, worker_id: int, num_workers: int):
    """A worker context as a worker process has it, with the session's store.

    The store is the controller's own (``ControllerStore``) rather than the client a
    worker process reaches it through, and ``_asks_store`` is told the worker is in a
    process of its own: what is checked is that disco-nccl asks the store, and gives
    up when the session aborts it (as it does when it loses a worker).
    """
    monkeypatch.setattr(nccl_ccl, "_asks_store", lambda ctx: True)
    ctx = WorkerContext(worker_id, num_workers, 1)
    ctx.store = ControllerStore()
    return ctx


def test_init_in_another_process_gives_up_when_the_sessions_store_aborts(stand_in, monkeypatch):
    """The abort flag is per process: a worker process learns of a dead peer from the store."""
    stand_in(gpus=2)
    rv = NCCLCCL.rendezvous(_local(2), ())
    ctx = _in_a_process_of_its_own(monkeypatch, 1, 2)
    threading.Timer(0.3, ctx.store.abort, ("worker(s) [0] died: killed",)).start()
    t0 = time.monotonic()
    with pytest.raises(CCLError, match=r"aborted: .*worker\(s\) \[0\] died"):
        NCCLCCL(ctx, rv.payload)  # rank 0 never joins
    assert time.monotonic() - t0 < 5
    assert rv.token not in nccl_ccl._ABORTED  # the store told it, not the flag
    rv.close()


def test_a_wait_in_another_process_gives_up_when_the_sessions_store_aborts(stand_in, monkeypatch):
    cupy = stand_in(gpus=1)
    rv = NCCLCCL.rendezvous(_local(1), ())
    ctx = _in_a_process_of_its_own(monkeypatch, 0, 1)
    ccl = NCCLCCL(ctx, rv.payload)
    never = types.SimpleNamespace(ptr=0, done=False)  # a kernel waiting for a dead peer
    cupy.cuda.get_current_stream = lambda: never
    threading.Timer(0.3, ctx.store.abort, ("worker(s) [1] died: killed",)).start()
    t0 = time.monotonic()
    with pytest.raises(CCLError, match=r"synchronize aborted: .*worker\(s\) \[1\] died"):
        ccl.synchronize()
    assert time.monotonic() - t0 < 5
    assert [c.aborted for c in NcclCommunicator.made] == [1]  # ncclCommAbort ends the kernels
    rv.close()


def test_a_short_wait_does_not_ask_the_store(stand_in, monkeypatch):
    """The store is a round trip to the controller: asked only once a wait is long."""
    cupy = stand_in(gpus=1)
    rv = NCCLCCL.rendezvous(_local(1), ())
    ctx = _in_a_process_of_its_own(monkeypatch, 0, 1)
    asked = []
    real_wait = ctx.store.wait
    monkeypatch.setattr(ctx.store, "wait", lambda *a, **k: (asked.append(a), real_wait(*a, **k)))
    ccl = NCCLCCL(ctx, rv.payload)
    stream = types.SimpleNamespace(ptr=0, done=False)
    cupy.cuda.get_current_stream = lambda: stream
    threading.Timer(0.05, setattr, (stream, "done", True)).start()
    ccl.synchronize()
    assert asked == []
    stream.done = False
    threading.Timer(0.7, setattr, (stream, "done", True)).start()
    ccl.synchronize()
    assert 1 <= len(asked) <= 4  # every 0.25 s, from 0.25 s on
    rv.close()
