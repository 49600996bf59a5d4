"""The ``shm`` CCL: the conformance kit on threaded and process sessions, plus its own rules.

Its own rules: the segment is a memfd, so nothing is ever left in ``/dev/shm``
(after shutdown, a worker's crash, or the controller's); ``init_ccl`` options are
checked; sessions whose workers span machines are refused.
"""

from __future__ import annotations

import os
import signal
import time
import types
import warnings

import numpy as np
import pytest

import disco_core as disco
from disco_core.ccl.shm import ShmCCL
from disco_core.testing.ccl_kit import CCLContract, assert_bits, make_input, session_maker
from disco_core.testing.divergence import check_skip_onto_the_other_communicator
from disco_core.testing.p2p_steps import run_p2p_steps
from disco_core.testing.procfs import shm_in_use
from disco_core.worker import current

CCL_FUNCS = "disco_core.testing.ccl_funcs"


# ---------------------------------------------------------------------------- helpers
def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm on this system
        return set()


def _leftovers(before: set[str]) -> set[str]:
    """New entries of /dev/shm that nobody uses (other programs may create their own)."""
    new = _dev_shm() - before
    if not new:
        return set()
    new = {n for n in new if os.path.exists(f"/dev/shm/{n}")}
    return new - shm_in_use(new)


def _memfds(pid: int | str = "self") -> int:
    """How many mappings and descriptors of ``pid`` point at a disco-shm memfd."""
    count = 0
    with open(f"/proc/{pid}/maps") as f:
        count += sum("memfd:disco-shm" in line for line in f)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += "memfd:disco-shm" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return count


def _allreduce_ok(sess: disco.Session) -> None:
    nw = sess.num_workers
    src = sess.call_packed("ccl_kit.input", (6,), "float32", 5)
    dst = sess.empty((6,), "float32")
    sess.allreduce(src, dst, "sum", in_group=False)
    xs = [make_input((6,), "float32", 5, w) for w in range(nw)]
    ref = xs[0]
    for x in xs[1:]:
        ref = ref + x
    for w in range(nw):
        assert_bits(dst.debug_get_from_remote(w), ref, f"worker {w}")


def _pids(sess: disco.Session) -> list[int]:
    sess.import_python_module("disco_core.testing.funcs")
    ref = sess.get_global_func("testing.pid")()
    return [ref.debug_get_from_remote(w) for w in range(sess.num_workers)]


# ---------------------------------------------------------------------------- leftovers
@pytest.mark.timeout(60)
def test_no_leftovers_after_shutdown():
    before_shm, before_fds = _dev_shm(), _memfds()
    sess = disco.ProcessSession(3)
    sess.init_ccl("shm")
    sess.import_python_module(CCL_FUNCS)
    _allreduce_ok(sess)
    pids = _pids(sess)
    # The data plane is the memfd segment, mapped by the controller and every worker.
    assert _memfds() > before_fds
    for pid in pids[1:]:
        assert _memfds(pid) > 0, f"worker process {pid} does not map the segment"
    sess.shutdown()
    assert _memfds() == before_fds, "the segment is still mapped or open after shutdown"
    assert _leftovers(before_shm) == set()


@pytest.mark.timeout(60)
def test_no_leftovers_after_shutdown_threaded():
    before_shm, before_fds = _dev_shm(), _memfds()
    with disco.ThreadedSession(4, 2) as sess:
        sess.init_ccl("shm", slot_bytes=4096)
        sess.import_python_module(CCL_FUNCS)
        _allreduce_ok(sess)
        assert _memfds() > before_fds
    assert _memfds() == before_fds, "the segment is still mapped or open after shutdown"
    assert _leftovers(before_shm) == set()


@pytest.mark.timeout(60)
def test_no_leftovers_after_worker_crash(procs):
    before_shm, before_fds = _dev_shm(), _memfds()
    sess = disco.ProcessSession(3)
    try:
        sess.init_ccl("shm")
        sess.import_python_module(CCL_FUNCS)
        pids = _pids(sess)
        src = sess.call_packed("ccl_kit.input", (64,), "float32", 1)
        sess.call_packed(
            "ccl_kit.die_or_call", 2, os.getpid(), 0.2, "allreduce", src, "sum", False, src
        )
        with pytest.raises(disco.WorkerDiedError):
            sess.sync_worker_0()
    finally:
        sess.shutdown()
    assert procs.wait_gone(pids[1:], 10) == []
    assert _memfds() == before_fds
    assert _leftovers(before_shm) == set()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("waiting", [False, True])
def test_no_leftovers_after_controller_crash(python_run, procs, waiting):
    """The controller is SIGKILLed (its workers possibly waiting in a collective)."""
    before_shm = _dev_shm()
    code = f"""
import os, signal
import disco_core as disco
sess = disco.ProcessSession(3)
sess.init_ccl("shm")
sess.import_python_module("disco_core.testing.funcs")
sess.import_python_module("{CCL_FUNCS}")
pid = sess.get_global_func("testing.pid")()
pids = [pid.debug_get_from_remote(w) for w in range(3)]
a = sess.call_packed("ccl_kit.input", (16,), "float32", 1)
sess.allreduce(a, a, "sum", in_group=False)
a.debug_get_from_remote(2)
if {waiting!r}:
    sess.call_packed("ccl_kit.call_on", (1, 2), "barrier", False)  # never completes
    sess.call_packed("testing.sleep", 0.3)
    sess.sync_worker_0()
print(" ".join(map(str, pids)), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    res = python_run(code, timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr
    pids = [int(p) for p in res.stdout.split()]
    assert len(pids) == 3
    alive = procs.wait_gone(pids[1:], 10)
    for pid in alive:  # do not leave them behind for the rest of the run
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert alive == [], "worker processes outlived their killed controller"
    assert _leftovers(before_shm) == set()


# ---------------------------------------------------------------------------- init_ccl rules
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [disco.ThreadedSession, disco.ProcessSession])
def test_init_ccl_twice_is_an_error(kind):
    with kind(2) as sess:
        sess.init_ccl("shm")
        with pytest.raises(disco.CCLError, match="already"):
            sess.init_ccl("shm")
        sess.import_python_module(CCL_FUNCS)
        _allreduce_ok(sess)


@pytest.mark.timeout(60)
def test_init_ccl_options_are_checked():
    with disco.ThreadedSession(2) as sess:
        with pytest.raises(TypeError, match="no_such_option"):
            sess.init_ccl("shm", no_such_option=1)
        with pytest.raises(TypeError, match="slotbytes"):
            sess.init_ccl("shm", slotbytes=4096)
        for bad in (
            {"slot_bytes": 100}, {"mailbox_bytes": 0}, {"timeout": 0}, {"timeout": -1},
            {"timeout": float("nan")},  # (was accepted: nan <= 0 is False)
        ):  # fmt: skip
            (name,) = bad
            with pytest.raises(disco.DiscoValueError, match=f"{name} must be"):
                sess.init_ccl("shm", **bad)
        # device ids were ignored (a GPU user's init_ccl("shm", 0, 1) got CPU collectives)
        with pytest.raises(disco.DiscoValueError, match=r"takes no device ids, got \(0, 1\)"):
            sess.init_ccl("shm", 0, 1)
        # Nothing was initialised by the failed calls: a good one works.
        sess.init_ccl("shm", timeout=30, slot_bytes=8192, mailbox_bytes=4096)
        sess.import_python_module(CCL_FUNCS)
        _allreduce_ok(sess)


@pytest.mark.timeout(60)
def test_unknown_ccl_name():
    with disco.ThreadedSession(2) as sess:
        with pytest.raises(disco.PluginNotFoundError):
            sess.init_ccl("no-such-ccl")
        sess.init_ccl("shm")


@pytest.mark.timeout(30)
def test_multi_node_sessions_are_refused():
    machines = types.SimpleNamespace(
        num_workers=4, num_groups=1, num_nodes=2, kind="socket", shares_memory=False
    )
    with pytest.raises(disco.CCLError, match="one machine") as info:
        ShmCCL.rendezvous(machines, ())
    assert "mpi" in str(info.value)
    no_sharing = types.SimpleNamespace(
        num_workers=2, num_groups=1, num_nodes=1, kind="rpc", shares_memory=False
    )
    with pytest.raises(disco.CCLError):
        ShmCCL.rendezvous(no_sharing, ())


@pytest.mark.timeout(60)
def test_unusable_after_a_timeout_says_so():
    """After a timeout the shm CCL is broken on that worker, and says so clearly."""
    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("shm", timeout=0.5)
        sess.import_python_module(CCL_FUNCS)
        sess.call_packed("ccl_kit.call_on", (1,), "barrier", False)
        with pytest.raises(disco.WorkerError) as info:
            sess.call_packed("ccl_kit.peer", "self").debug_get_from_remote(1)
        assert info.value.exc_type == "CCLTimeoutError"
        assert "timeout" in str(info.value)
        sess.get_global_func("disco.barrier")(False)
        with pytest.raises(disco.WorkerError, match="unusable|new session"):
            sess.call_packed("ccl_kit.peer", "self").debug_get_from_remote(1)


@disco.register_func("test_shm.poisoned", override=True)
def _poisoned() -> str:
    return current().ccl.poisoned


@pytest.mark.timeout(60)
def test_timeout_poisons_every_workers_ccl_before_it_is_reported():
    """The session tells every worker's CCL (``CCL.poison``) before the user sees a timeout.

    So no CCL, whatever it does itself, runs a later collective against an operation
    that a timed-out member abandoned (MPI and NCCL would otherwise match it).
    """
    with disco.ThreadedSession(3) as sess:
        sess.init_ccl("shm", timeout=0.5)
        sess.import_python_module(CCL_FUNCS)
        before = sess.call_packed("test_shm.poisoned")
        assert [before.debug_get_from_remote(w) for w in range(3)] == ["", "", ""]
        sess.call_packed("ccl_kit.call_on", (2,), "barrier", False)
        with pytest.raises(disco.WorkerError) as info:
            sess.call_packed("ccl_kit.peer", "self").debug_get_from_remote(2)
        assert info.value.exc_type == "CCLTimeoutError"
        after = sess.call_packed("test_shm.poisoned")
        for w in range(3):
            assert "timed out on worker 2" in after.debug_get_from_remote(w)
        x = sess.empty((4,), "float32")
        sess.allreduce(x, x, "sum")
        with pytest.raises(disco.WorkerError, match="unusable after an earlier failure") as info:
            sess.sync_worker_0()
        assert {e.worker_id for e in [info.value, *info.value.others]} == {0, 1, 2}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_worker_that_fails_before_a_collective_its_peers_entered_ends_their_wait(kind, bad):
    """A call that raised on one worker while the others entered an allreduce held the
    controller for the whole CCL timeout (300 s by default; an outside check), with the
    cause in the error's tail. Their waits fail at once now, naming the error."""
    with disco.Session.create(kind, num_workers=3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm")  # the default timeout: 300 s
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerError) as info:
            sess.get_global_func("testing.raise_or_allreduce")(bad).debug_get_from_remote(0)
        assert time.monotonic() - t0 < 20
        errors = [info.value, *info.value.others]
        assert {e.worker_id for e in errors} == {0, 1, 2}
        root = next(e for e in errors if e.worker_id == bad)
        assert root.exc_type == "RuntimeError"
        peers = [e for e in errors if e.worker_id != bad and e.exc_type.endswith("CCLError")]
        assert peers and all(f"worker {bad} failed in the same call" in str(e) for e in peers)
        assert "fails before the collective" in str(peers[0])
        # the session goes on; its shm CCL says it is unusable
        assert sess.get_global_func("testing.echo")(5).debug_get_from_remote(2) == 5
        x = sess.empty((4,), "float32")
        sess.allreduce(x, x, "sum")
        with pytest.raises(disco.WorkerError, match="unusable"):
            sess._sync_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_a_failed_call_leaves_later_collectives_alone_and_never_pairs_calls(kind):
    """A call that failed on one worker without any collective leaves the CCL as it was;
    a failed worker's next call, sent right behind, never meets its peers' collective of
    the call it failed in (its arrival would have been taken for that one's)."""
    with disco.Session.create(kind, num_workers=3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm")
        with pytest.raises(disco.WorkerError, match="raised on purpose"):
            sess.get_global_func("testing.raise_on")(1).debug_get_from_remote(1)
        x, y = sess.empty((4,), "float32"), sess.empty((4,), "float32")
        sess.get_global_func("testing.fill")(x, 1.0)
        sess.allreduce(x, y, "sum")
        assert [y.debug_get_from_remote(w).tolist() for w in range(3)] == [[3.0] * 4] * 3
        sess.get_global_func("testing.raise_or_allreduce")(1)
        sess.allreduce(x, y, "sum")  # right behind it, in worker 1's stream
        with pytest.raises(disco.WorkerError, match="worker 1 (failed in the same call|skipped a collective)"):  # fmt: skip
            sess._sync_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
@pytest.mark.parametrize("skipper", [0, 1])
def test_code_that_skips_a_collective_on_one_worker_is_an_error_not_a_mixed_value(kind, skipper):
    """No call fails, but one worker's code skips an allreduce that the others run: its
    next allreduce was paired with theirs (one value from two collectives), and their
    next waited for the CCL timeout (30 s here), before the calls were compared without
    a failure. Every member now fails naming the two calls, within the timeout, and
    the CCL says it is unusable. (Inside one call a divergence cannot be seen: see the
    README.)"""
    with disco.Session.create(kind, num_workers=3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        t0 = time.monotonic()
        skipped = sess.get_global_func("testing.allreduce_unless")(skipper)
        after = sess.get_global_func("testing.allreduce_unless")(-1)
        got = []
        for ref, workers in ((skipped, [w for w in range(3) if w != skipper]), (after, range(3))):
            for w in workers:
                try:
                    got.append(ref.debug_get_from_remote(w).tolist())
                except disco.WorkerError as exc:
                    got.append(str(exc))
        assert time.monotonic() - t0 < 20
        assert all(isinstance(g, str) for g in got), got
        assert any("the workers ran different collectives" in g for g in got), got
        assert any(
            f"worker {skipper} from call" in g or f"worker {skipper} reached" in g for g in got
        ), got
        with pytest.raises(disco.WorkerError, match="unusable"):
            sess.get_global_func("testing.allreduce_unless")(-1).debug_get_from_remote(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
@pytest.mark.parametrize("fails_again", [False, True])
def test_a_slow_peer_never_pairs_with_a_failed_workers_next_call(kind, fails_again):
    """Worker 1 fails before a collective that worker 0 reaches late (after 0.5 s); worker
    1's next collective came first and took worker 0's skipped-call data: 101 returned
    as a value (2 workers), and when worker 1 failed again between them, its one failure
    record was overwritten and the pairing went both ways (a re-check of the first fix)."""
    with disco.Session.create(kind, num_workers=2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm")
        first = sess.get_global_func("testing.raise_or_allreduce")
        slow = sess.get_global_func("testing.sleep")
        slow(0.5, 0)  # worker 0 comes late to the failing call's allreduce
        r1 = first(1)
        if fails_again:
            sess.get_global_func("testing.raise_on")(1)
        r3 = first(-1)  # an allreduce of ones on both: [2.0] * 4
        t0 = time.monotonic()
        for ref in (r1, r3):
            for w in (0, 1):
                try:
                    got = ref.debug_get_from_remote(w)
                except disco.WorkerError:
                    continue
                # a value may only be what that call computes
                assert ref is r3 and got.tolist() == [2.0] * 4, (w, got)
        assert time.monotonic() - t0 < 20


def _received(ref, receiver):
    """What a ``testing.p2p_pair`` call's receive returned, or the error's text."""
    try:
        return ref.debug_get_from_remote(receiver).tolist()
    except disco.WorkerError as exc:
        return str(exc)


# Point-to-point pairs after failed calls (the steps: disco_core.testing.p2p_steps). A
# receive must return its own send's value, or an error, long before the CCL's timeout
# (30 s); "large" sends two pieces of the 4 KiB mailbox.
_P2P_SCENARIOS = {
    # the sender fails before its send; the late receive took its next call's message
    "same call, sender fails": [("nap",), ("pair", 1, 1), ("pair", 2, -1), ("pair", 3, -1)],
    # the receiver fails before its receive; its next receive took the stale message
    "same call, receiver fails": [("pair", 1, 0), ("pair", 2, -1), ("pair", 3, -1)],
    "same call, receiver fails twice": [("pair", 1, 0), ("pair", 2, 0), ("pair", 3, -1)],
    # a message of two pieces: its send waited for the CCL's timeout
    "same call, large, receiver fails": [("pair", 1, 0, "large"), ("pair", 2, -1, "large")],
    "same call, large, receiver fails, no receive after": [("pair", 1, 0, "large")],
    # split pairs, send first: a failed send shifted every later pair by one
    "split, send first, sender fails": [
        ("send", 1, 1), ("recv", 1, -1), ("send", 2, -1), ("recv", 2, -1),
        ("send", 3, -1), ("recv", 3, -1),
    ],
    # the same, as the last step: no later send, so the receive waited for its timeout
    "split, send first, sender fails, last step": [("send", 1, 1), ("recv", 1, -1)],
    # split pairs, receive first, the sender failing between them (not in either)
    "split, receive first, sender fails between": [
        ("recv", 1, -1), ("fail", 1), ("send", 1, -1), ("recv", 2, -1), ("send", 2, -1),
    ],
    # the same, the message in two pieces: its send waited for the CCL's timeout
    "split, receive first, receiver fails, large": [
        ("recv", 1, 0, "large"), ("send", 1, -1, "large"),
    ],
    # a pipeline (each command receives what the one before sent, and sends the next):
    # after a skipped send, a message of the receive's own call was taken as its value
    "pipeline, sender fails": [
        ("send", 1, -1), ("pipe", 2, 1), ("pipe", 3, -1), ("pipe", 4, -1), ("recv", 4, -1),
    ],
    "pipeline, receiver fails": [("send", 1, -1), ("pipe", 2, 0), ("pipe", 3, -1), ("recv", 3, -1)],
    "split, receive first, receiver fails": [
        ("recv", 1, 0), ("send", 1, -1), ("recv", 2, -1), ("send", 2, -1),
    ],
}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["threaded", "process"])
@pytest.mark.parametrize("scenario", sorted(_P2P_SCENARIOS))
def test_after_a_failed_call_a_receive_returns_its_own_sends_value_or_an_error(kind, scenario):
    """Outside checks found receives that returned another call's message as a value
    (6 of 6), the next pair's value after an unrelated failure, and sends that waited
    for the CCL's timeout. Where it cannot be told which receive a message is for, the
    pair's mailbox is given up: errors, never another send's value."""
    with disco.Session.create(kind, num_workers=2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30, mailbox_bytes=4096)
        pair = sess.get_global_func("testing.p2p_pair")
        t0 = time.monotonic()
        receives = run_p2p_steps(sess, _P2P_SCENARIOS[scenario])  # ("large": two pieces)
        for step, value, ref in receives:
            got = _received(ref, 0)
            assert isinstance(got, str) or got == [value] * len(got), (scenario, step, got)
        assert time.monotonic() - t0 < 20, scenario
        # the other direction is a pair of its own, untouched; a failed send or receive
        # is a failed call of its worker, so the rules apply to a pair in the next call
        sess.get_global_func("testing.sleep")(0.0, 0)
        back = pair(0, 1, 42.0)
        assert _received(back, 1) == [42.0] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_sends_and_receives_still_pair_across_calls(kind):
    """A send in one command and its receive in the next (TVM's send_to_next_group and
    recv_from_prev_group as commands of their own) still pair, also after a failure of
    another worker."""
    with disco.Session.create(kind, num_workers=3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        pair = sess.get_global_func("testing.p2p_pair")
        for failed_before in (False, True):
            if failed_before:
                with pytest.raises(disco.WorkerError, match="raised on purpose"):
                    sess.get_global_func("testing.raise_on")(2).debug_get_from_remote(2)
            pair(1, 0, 5.0, -1, 0.0, "send")
            assert _received(pair(1, 0, 0.0, -1, 0.0, "recv"), 0) == [5.0] * 4
            late = pair(1, 0, 0.0, -1, 0.0, "recv")  # the receive first, then the send
            pair(1, 0, 6.0, -1, 0.0, "send")
            assert _received(late, 0) == [6.0] * 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_a_member_that_raises_inside_an_in_place_allreduce_waits_for_its_peers_to_leave_its_arrays(kind):  # fmt: skip
    """Worker 1's share of an in-place (arena) allreduce raised (an overflow NumPy was told
    to raise on): it returned at once, its arrays' blocks went to its next call, and
    worker 0 went on writing its share into them: millions of elements of the next
    call's fresh arrays changed (an outside check, 11 of 12 runs). Its peers fail too:
    their results lack its share (a first fix let them return them: a re-check)."""
    with disco.Session.create(kind, num_workers=2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        for _ in range(2):
            failed = sess.get_global_func("testing.inplace_overflow")()
            victim = sess.get_global_func("testing.arena_victim")(0.3)
            for w in (0, 1):  # the peer's result lacks that share: an error, not a value
                with pytest.raises(disco.WorkerError, match="FloatingPointError|overflow"):
                    failed.debug_get_from_remote(w)
            assert [victim.debug_get_from_remote(w) for w in (0, 1)] == [0, 0]


@pytest.mark.timeout(60)
def test_timeout_from_environment(monkeypatch):
    """``DISCO_CCL_TIMEOUT`` sets the default collective timeout."""
    monkeypatch.setenv("DISCO_CCL_TIMEOUT", "0.5")
    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("shm")
        sess.import_python_module(CCL_FUNCS)
        t0 = time.monotonic()
        sess.call_packed("ccl_kit.call_on", (0,), "barrier", False)
        with pytest.raises(disco.WorkerError) as info:
            sess.sync_worker_0()
        assert info.value.exc_type == "CCLTimeoutError"
        assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_bool_sum_and_prod_follow_numpy():
    """On bool arrays NumPy's add is logical or and multiply logical and; shm does the same."""
    with disco.ThreadedSession(3) as sess:
        sess.init_ccl("shm")
        sess.import_python_module(CCL_FUNCS)
        xs = [make_input((9,), "bool", 11, w) for w in range(3)]
        src = sess.call_packed("ccl_kit.input", (9,), "bool", 11)
        dst = sess.empty((9,), "bool")
        for op, ref in (("sum", xs[0] | xs[1] | xs[2]), ("prod", xs[0] & xs[1] & xs[2])):
            sess.allreduce(src, dst, op, in_group=False)
            for w in range(3):
                assert_bits(dst.debug_get_from_remote(w), ref, f"{op} worker {w}")


@pytest.mark.timeout(60)
def test_large_allreduce_default_slots():
    """A few MiB: several default-size (1 MiB) rounds, on processes."""
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        sess.import_python_module(CCL_FUNCS)
        n = (3 << 20) // 4 + 5
        src = sess.call_packed("ccl_kit.input", (n,), "float32", 2)
        dst = sess.empty((n,), "float32")
        sess.allreduce(src, dst, "sum", in_group=False)
        ref = make_input((n,), "float32", 2, 0) + make_input((n,), "float32", 2, 1)
        assert_bits(dst.debug_get_from_remote(1), ref, "worker 1")
        out = np.empty(n, "float32")
        sess.copy_from_worker_0(out, dst)
        assert_bits(out, ref, "worker 0")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["byteorder", "ndim", "object"])
def test_a_refused_send_is_never_taken_for_a_good_message(kind):
    """A send of an array in the other byte order (or of 9 dimensions) packs the same
    refusal as a send of the receive's buffer would: a receive that recognised a
    message by its descriptor returned what an earlier message left in the ring as
    its value (an outside check, 8 of 8). It raises the sender's refusal now, and the
    pair goes on. An ``object`` array raised NumPy's "Cannot change data-type for
    array of references" in the send, a failure without a send that gave the pair up:
    it is refused by name."""
    with disco.ThreadedSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=10)
        pair = sess.get_global_func("testing.p2p_pair")
        for value in range(1, 9):  # the ring's 8 pieces hold earlier messages
            assert pair(1, 0, float(value)).debug_get_from_remote(0).tolist() == [value] * 4
        ref = sess.get_global_func("testing.p2p_refused")(kind)
        why = "cannot live in a worker array" if kind == "object" else "worker 1 failed to send"
        with pytest.raises(disco.WorkerError, match=why):
            ref.debug_get_from_remote(0)
        sess.get_global_func("testing.sleep")(0.0, 0)  # (a call in between: see the README)
        assert pair(1, 0, 9.0).debug_get_from_remote(0).tolist() == [9.0] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mailbox", [4096, 4100, 5000, 1000000])
@pytest.mark.parametrize("messages", [1, 8])
def test_the_ring_holds_mailbox_bytes_in_one_message_or_eight(mailbox, messages):
    """Two workers each send the other ``mailbox_bytes`` (one message, or 8 of an eighth
    each) before receiving: the ring holds it all. Pieces were rounded down to 64
    bytes, so with a size that is no multiple of 512 both waited for the timeout (an
    outside check)."""
    with disco.ThreadedSession(2) as sess:
        sess.import_python_module("disco_core.testing.ccl_funcs")
        sess.init_ccl("shm", timeout=5, mailbox_bytes=mailbox)
        shape = (messages, mailbox // messages)
        buf = sess.call_packed("ccl_kit.input", shape, "uint8", 7)
        out = sess.call_packed("ccl_kit.input", shape, "uint8", 8)
        other = sess.call_packed("ccl_kit.peer", "pair")
        sess.call_packed("ccl_kit.send_several", buf, out, other, other, True)
        for w in (0, 1):
            assert_bits(out.debug_get_from_remote(w), make_input(shape, "uint8", 7, 1 - w), f"worker {w}")  # fmt: skip


# ---------------------------------------------------------------------------- the kit
class ShmContract(CCLContract):
    small_round_options = {"slot_bytes": 4096, "mailbox_bytes": 4096}
    buffered_send_bytes = 1 << 20  # the default mailbox
    buffered_sends = 8  # pieces of a mailbox
    timeout_options = {"timeout": 1}


class TestShmThreaded4(ShmContract):
    num_workers = 4
    workers_are_processes = False

    @pytest.fixture
    def make_session(self):
        return session_maker(disco.ThreadedSession, "shm")


class TestShmThreaded2(ShmContract):
    num_workers = 2
    workers_are_processes = False

    @pytest.fixture
    def make_session(self):
        return session_maker(disco.ThreadedSession, "shm")


class TestShmProcess4(ShmContract):
    num_workers = 4
    workers_are_processes = True

    @pytest.fixture
    def make_session(self):
        return session_maker(disco.ProcessSession, "shm")


class TestShmProcess2(ShmContract):
    num_workers = 2
    workers_are_processes = True

    @pytest.fixture
    def make_session(self):
        return session_maker(disco.ProcessSession, "shm")


@pytest.mark.timeout(60)
def test_a_communicator_of_one_copies_and_still_checks():
    """Groups of one (the n == 1 fast path): the result is the array itself, and a
    mismatched call is still an error naming it."""
    with disco.ProcessSession(2, num_groups=2) as sess:
        sess.init_ccl("shm")
        x = sess.empty((6,), "float32")
        for w in range(2):
            x.debug_copy_from(w, np.arange(6, dtype=np.float32) + w)
        y = sess.empty((6,), "float32")
        sess.allreduce(x, y, "sum", in_group=True)
        for w in range(2):
            np.testing.assert_array_equal(y.debug_get_from_remote(w), np.arange(6) + w)
        b = sess.broadcast(np.full(6, 7, np.float32), y)
        for w in range(2):
            np.testing.assert_array_equal(b.debug_get_from_remote(w), np.full(6, 7))
        wrong = sess.empty((5,), "float32")
        with pytest.raises(disco.WorkerError, match="allreduce"):
            sess.allreduce(x, wrong, "sum", in_group=True)
            sess._sync_all()


@disco.register_func("test_shm.read_only", override=True)
def _read_only(arr: np.ndarray) -> None:
    arr.flags.writeable = False


@disco.register_func("test_shm.kept", override=True)
def _kept() -> int:
    return len(current().ccl._small)


@pytest.mark.timeout(120)
def test_a_kept_small_allreduce_checks_its_arrays_again():
    """A small allreduce of arrays seen before runs from kept views (ShmCCL._small):
    a dst made read-only since is still refused on every worker, never written; and
    at most 32 pairs of arrays are kept."""
    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("shm")
        src, dst = sess.empty((8,), "float32"), sess.empty((8,), "float32")
        for w in range(2):
            src.debug_copy_from(w, np.full(8, w + 1, np.float32))
        for _ in range(3):
            sess.allreduce(src, dst, "sum", in_group=False)
        np.testing.assert_array_equal(dst.debug_get_from_remote(1), np.full(8, 3))
        assert sess.call_packed("test_shm.kept").debug_get_from_remote(0) == 1
        for w in range(2):
            src.debug_copy_from(w, np.full(8, 10 * (w + 1), np.float32))
        sess.call_packed("test_shm.read_only", dst)
        with pytest.raises(disco.WorkerError, match="(?i)read-only|writ") as info:
            sess.allreduce(src, dst, "sum", in_group=False)
            sess._sync_all()
        assert {info.value.worker_id, *(e.worker_id for e in info.value.others)} == {0, 1}
        np.testing.assert_array_equal(dst.debug_get_from_remote(0), np.full(8, 3))  # untouched
    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("shm")
        pairs = [(sess.empty((4,), "int32"), sess.empty((4,), "int32")) for _ in range(40)]
        for a, b in pairs:
            sess.allreduce(a, b, "max", in_group=False)
        assert 1 <= sess.call_packed("test_shm.kept").debug_get_from_remote(0) <= 32


@disco.register_func("test_shm.change_in_place", override=True)
def _change_in_place(arr: np.ndarray, how: str) -> None:
    with warnings.catch_warnings():  # NumPy 2.4 deprecates setting strides
        warnings.simplefilter("ignore", DeprecationWarning)
        if how == "dtype":
            arr.dtype = np.dtype(np.int32)  # the same itemsize: NumPy says nothing
        else:
            arr.strides = (0,)  # every element is the first: no longer contiguous


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["dtype", "strides"])
def test_a_kept_small_allreduce_sees_its_dst_changed_in_place(how):
    """``dst.dtype = int32`` on a kept float32 pair (an outside check): the next call
    wrote float32 bits into the int32 array, where a fresh pair is refused. Changed
    strides would have been written through the old layout. Now both are refused on
    every worker."""
    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("shm")
        src = sess.broadcast(np.full(8, 1.5, np.float32))
        dst = sess.empty((8,), "float32")
        for _ in range(2):
            sess.allreduce(src, dst, "sum", in_group=False)
        sess.call_packed("test_shm.change_in_place", dst, how)
        with pytest.raises(disco.WorkerError, match="does not match|C-contiguous") as info:
            sess.allreduce(src, dst, "sum", in_group=False)
            sess._sync_all()
        assert {info.value.worker_id, *(e.worker_id for e in info.value.others)} == {0, 1}
        want = np.full(8, 3.0, np.float32)  # untouched (with strides 0: its first, 8 times)
        got = dst.debug_get_from_remote(1)
        np.testing.assert_array_equal(got, want.view(np.int32) if how == "dtype" else want)


@pytest.mark.timeout(60)
def test_a_host_array_in_the_other_byte_order_as_a_collectives_src():
    """``sess.allreduce(np.arange(4, dtype=">f4"), dst)`` reduced the big-endian bytes
    as float32 (an outside check): garbage, silently. The controller now sends a host
    src in this machine's byte order, as ``broadcast`` and ``copy_to_worker_0`` do."""
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        x = np.arange(4, dtype=">f4")
        y = sess.empty((4,), "float32")
        sess.allreduce(x, y, "sum")
        np.testing.assert_array_equal(y.debug_get_from_remote(1), [0, 2, 4, 6])
        g = sess.empty((8,), "float32")
        sess.allgather(x, g)
        np.testing.assert_array_equal(g.debug_get_from_remote(1), [0, 1, 2, 3] * 2)
        d = sess.empty((4,), "float32")
        sess.broadcast_from_worker0(x, d)
        np.testing.assert_array_equal(d.debug_get_from_remote(1), [0, 1, 2, 3])
        assert x.dtype.str == ">f4"  # the caller's array is left as it was


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["process", "threaded"])
def test_a_call_checked_in_a_group_is_checked_again_for_the_world(kind):
    """The checked-calls cache did not say which communicator: an allgather that was
    right within a group of 2 skipped the check for the 4 workers of the world, and
    failed with a bare ValueError (an outside check)."""
    sess = disco.Session.create(kind, num_workers=4, num_groups=2)
    try:
        sess.init_ccl("shm")
        a = sess.broadcast(np.arange(4, dtype="float32"))
        g = sess.empty((8,), "float32")
        sess.allgather(a, g, in_group=True)
        assert g.debug_get_from_remote(3).tolist() == [0, 1, 2, 3] * 2
        with pytest.raises(disco.CCLError, match="must hold 4 x src"):
            sess.allgather(a, g, in_group=False)
            sess.sync_worker_0()
    finally:
        sess.shutdown()


def test_a_segment_too_large_to_make_names_its_sizes():
    """slot_bytes=10**15 raised a bare OSError (an outside check); the session goes on."""
    sess = disco.ThreadedSession(2)
    try:
        with pytest.raises(disco.CCLError, match="slot_bytes=1000000000000000"):
            sess.init_ccl("shm", slot_bytes=10**15)
        sess.init_ccl("shm")
    finally:
        sess.shutdown()


@pytest.mark.timeout(60)
def test_a_receive_whose_sender_failed_after_sending_takes_the_message(monkeypatch):
    """A receive waiting for a sender that sends and then raises in the same call must
    take the message. The wait looked at the message, then at the sender's failure
    record: a send and a failure between the two looks gave a good pair up (an outside
    check: 1 in ~4,700 calls; every time with the record read 20 ms late, as here)."""
    real = ShmCCL._failure

    def late_failure_record(self, w):
        time.sleep(0.02)
        return real(self, w)

    monkeypatch.setattr(ShmCCL, "_failure", late_failure_record)
    with disco.ThreadedSession(3) as sess:  # (workers are threads: the patch reaches them)
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=20)
        send_then_raise = sess.get_global_func("testing.send_then_raise")
        for value in (1.0, 2.0, 3.0):
            # (a call in between: a pair right after a failed call of an end is given up)
            sess.get_global_func("testing.sleep")(0.0, 0)
            ref = send_then_raise(1, 2, value, 0.01)
            for _ in range(3):  # worker 1's own failure comes first, once per call
                try:
                    got = ref.debug_get_from_remote(2).tolist()
                    break
                except disco.WorkerError as exc:
                    assert "worker 2" not in str(exc).split("\n")[0], str(exc)
            assert got == [value] * 4


def test_a_collective_mismatch_names_the_same_two_workers_on_every_member():
    """The member that called the odd collective compared each descriptor with its own
    operation, so its error named worker 0 twice ("worker 0 called allreduce:sum, worker
    0 called allreduce:sum": an outside check); every member names worker 0 and the odd
    one now."""
    from disco_core.ccl import validate

    x = np.zeros(4, "float32")
    ops = ["allreduce:sum", "allreduce:sum", "allreduce:max"]
    descs = [validate.describe(op, x, x) for op in ops]
    for mine in ops:
        with pytest.raises(disco.CCLError) as err:
            validate.check(mine, descs, [0, 1, 2])
        assert "worker 0 called allreduce:sum, worker 2 called allreduce:max" in str(err.value)


def _values_or_errors(ref, workers):
    out = []
    for w in workers:
        try:
            out.append(ref.debug_get_from_remote(w).tolist())
        except disco.WorkerError as exc:
            out.append(str(exc))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
@pytest.mark.parametrize("first_in_group", [False, True])
def test_a_skipped_collective_followed_by_one_on_the_other_communicator_fails_at_once(kind, first_in_group):  # fmt: skip
    """Worker 1 skips a world (group) allreduce, and its next call runs a group (world)
    one: it never arrives where its peers wait, which waited for the CCL's timeout.
    Each worker says the call of its latest collective on any communicator, in full:
    its peers see it went on, and every member fails, naming it."""
    with disco.Session.create(kind, num_workers=4, num_groups=2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        check_skip_onto_the_other_communicator(sess, first_in_group)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_calls_past_2_to_the_24_never_read_as_a_skip(kind):
    """An arrival word holds 24 bits of its call: an earlier check that compared them
    took a late member's arrival from before the wrap for a later call's and gave a
    correct program up (an outside check). The call a member went on to is read in
    full."""
    with disco.Session.create(kind, num_workers=2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        sess.get_global_func("testing.bump_calls")((1 << 24) - 6)
        unless = sess.get_global_func("testing.allreduce_unless")
        nap = sess.get_global_func("testing.sleep")
        for _ in range(6):  # worker 1 comes late (its peer sleeps in the futex meanwhile)
            nap(0.02, 1)
            ref = unless(-1)
            assert ref.debug_get_from_remote(1).tolist() == [2.0] * 4


class _SlowLookups(list):
    """A list whose lookups of another worker than 0 take 20 ms: on worker 0, a pause
    between two reads of the segment."""

    def __getitem__(self, i):
        if i != 0:
            time.sleep(0.02)
        return super().__getitem__(i)


@disco.register_func("test_shm.slow_latest_reads", override=True)
def _slow_latest_reads(worker: int) -> None:
    ctx = current()
    if ctx.worker_id == worker:
        ctx.ccl._latest = _SlowLookups(ctx.ccl._latest)


@pytest.mark.timeout(60)
def test_a_member_that_arrives_and_goes_on_while_read_is_never_taken_for_a_skip(monkeypatch):
    """A member that arrives, ends the collective and enters the next call's between a
    waiter's reads was taken for one that skipped (an earlier check: 4 of 4 runs of
    20,000 barriers of 4 processes, with waits that sleep at once). Here worker 0's
    read of a member's latest call waits 20 ms (a stand-in for a preempted waiter) while
    worker 1, 2 ms late to each barrier, arrives and goes on: its arrival is read again
    after its latest call, so the program runs."""
    monkeypatch.setenv("DISCO_SHM_SPIN_US", "0")
    with disco.ThreadedSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        sess.get_global_func("test_shm.slow_latest_reads")(0)
        barrier, nap = sess.get_global_func("disco.barrier"), sess.get_global_func("testing.sleep")
        for _ in range(20):
            nap(0.002, 1)
            barrier(False)
        sess._sync_all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_world_and_group_barriers_that_sleep_at_once_run_without_a_false_skip(kind, monkeypatch):  # fmt: skip
    """Barriers alternating world and group, whose waits sleep at once (where the read
    race above showed): 3,000 of them run."""
    monkeypatch.setenv("DISCO_SHM_SPIN_US", "0")
    with disco.Session.create(kind, num_workers=4, num_groups=2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        barrier = sess.get_global_func("disco.barrier")
        for i in range(3000):
            barrier(i % 3 == 0)
        sess._sync_all()


@pytest.mark.timeout(60)
def test_a_skipped_collective_is_not_blamed_on_an_older_failed_call():
    """Worker 1 failed once, long before it skipped a collective in code that differs
    between workers: the error blamed that old failure ("skipped a collective after a
    call of it failed (RuntimeError: ...)": an outside check)."""
    with disco.ThreadedSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        with pytest.raises(disco.WorkerError, match="raised on purpose"):
            sess.get_global_func("testing.raise_on")(1).debug_get_from_remote(1)
        unless = sess.get_global_func("testing.allreduce_unless")
        for _ in range(5):
            assert unless(-1).debug_get_from_remote(1).tolist() == [2.0] * 4
        skipped, after = unless(1), unless(-1)
        got = _values_or_errors(skipped, [0]) + _values_or_errors(after, [0, 1])
        assert all(isinstance(g, str) for g in got), got
        assert any("ran different collectives" in g for g in got), got
        assert not any("after a call of it failed" in g for g in got), got
