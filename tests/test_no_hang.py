"""Frozen workers, collective timeouts and late errors: every wait of the controller ends.

Regression tests of issue 14's findings 1-3: a stopped worker is reported as
``WorkerUnresponsiveError`` instead of hanging the controller; a collective
timeout is a ``CCLTimeoutError``; a worker's error surfaces at the sync that
follows it, every time.
"""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest

import disco_core as disco
from disco_core.testing import procfs
from disco_core.testing.procfs import freeze
from disco_core.wire_values import decode_untrusted, encode_for_network

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def liveness(monkeypatch):
    """Short liveness and gather bounds (read when a session starts)."""

    def set_bounds(liveness: float = 2.0, gather: float = 60.0) -> None:
        monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", str(liveness))
        monkeypatch.setenv("DISCO_GATHER_TIMEOUT", str(gather))

    return set_bounds


def _stop_worker(sess: disco.Session, worker_id: int) -> int:
    pid = sess.channel.procs[worker_id - 1].proc.pid
    freeze(pid)
    return pid


def _shutdown_promptly(sess: disco.Session, pids: list[int]) -> None:
    start = time.monotonic()
    sess.shutdown()
    assert time.monotonic() - start < 3.0, "shutdown waited for a worker that answers nothing"
    assert procfs.wait_gone(pids, 5.0) == [], "a stopped worker outlived its session"


def test_frozen_worker_in_a_collective_is_unresponsive(liveness, no_leftover_children):
    liveness(2.0)
    sess = disco.ProcessSession(3)
    sess.init_ccl("shm", timeout=30)
    x = sess.empty((8,), "float32")
    sess.allreduce(x, x)
    sess.sync_worker_0()
    pid = _stop_worker(sess, 2)
    start = time.monotonic()
    with pytest.raises(disco.WorkerUnresponsiveError) as info:
        sess.allreduce(x, x)
        sess.sync_worker_0()
    took = time.monotonic() - start
    assert info.value.worker_ids == [2]
    assert isinstance(info.value, disco.WorkerDiedError)
    assert "DISCO_LIVENESS_TIMEOUT" in str(info.value)
    assert 1.5 < took < 10, took
    with pytest.raises(disco.WorkerDiedError):  # the session is over for good
        sess.sync_worker_0()
    _shutdown_promptly(sess, [pid])


def test_frozen_worker_after_a_collective_timeout(liveness, no_leftover_children):
    """Issue 14, finding 1: the collective times out first; the gathering that follows ends."""
    liveness(4.0)
    sess = disco.ProcessSession(3)
    sess.init_ccl("shm", timeout=1)
    x = sess.empty((8,), "float32")
    pid = _stop_worker(sess, 2)
    start = time.monotonic()
    with pytest.raises(disco.WorkerUnresponsiveError) as info:
        sess.allreduce(x, x)
        sess.sync_worker_0()
    assert time.monotonic() - start < 15
    assert info.value.worker_ids == [2]
    # what was gathered before giving up: the timeouts of the workers that waited
    assert info.value.errors, "the collective timeouts were lost"
    assert all(isinstance(e, disco.CCLTimeoutError) for e in info.value.errors)
    assert {e.worker_id for e in info.value.errors} <= {0, 1}
    _shutdown_promptly(sess, [pid])


def test_idle_frozen_worker_is_noticed_without_a_ccl(liveness, no_leftover_children):
    liveness(1.5)
    sess = disco.ProcessSession(2)
    ref = sess.empty((4,), "float32")
    pid = _stop_worker(sess, 1)
    with pytest.raises(disco.WorkerUnresponsiveError) as info:
        ref.debug_get_from_remote(1)
    assert info.value.worker_ids == [1]
    _shutdown_promptly(sess, [pid])


def test_a_busy_worker_is_not_unresponsive(liveness):
    """A worker function that runs longer than the liveness bound is no frozen worker."""
    liveness(1.0)
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.call_packed("testing.sleep", 3.0)
        sess._sync_all()  # waits the 3 s; the heartbeats say the workers live
        big = sess.call_packed("testing.arange", 1 << 24, "float64")  # 128 MiB back
        assert big.debug_get_from_remote(1)[-1] == ((1 << 24) - 1) * 2


def test_collective_timeout_is_a_ccl_timeout_error(no_leftover_children):
    """Issue 14, finding 2: ``except disco.CCLTimeoutError`` catches a worker's timeout."""
    with disco.ProcessSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=0.5)
        x = sess.empty((8,), "float32")
        sess.call_packed("testing.sleep", 2.0, 2)  # worker 2 comes late
        sess.allreduce(x, x)
        with pytest.raises(disco.CCLTimeoutError) as info:
            sess.sync_worker_0()
        err = info.value
        assert isinstance(err, disco.WorkerError) and isinstance(err, TimeoutError)
        assert err.worker_id in (0, 1) and err.exc_type == "CCLTimeoutError"
        assert "remote traceback" in str(err)


def test_worker_errors_of_disco_types_keep_their_type():
    timeout = disco.WorkerError(3, "CCLTimeoutError", "waited", "Traceback ...")
    assert isinstance(timeout, disco.CCLTimeoutError) and isinstance(timeout, disco.CCLError)
    assert timeout.worker_id == 3 and "waited" in str(timeout)
    for rebuilt in (
        pickle.loads(pickle.dumps(timeout)),
        decode_untrusted(*encode_for_network(("fail", timeout)))[1],
    ):
        assert type(rebuilt) is type(timeout) and rebuilt.worker_id == 3
    assert isinstance(disco.WorkerError(0, "DiscoValueError", "m"), ValueError)
    # anything that is not a Disco error of an imported module stays a plain WorkerError
    for name in ("ValueError", "os.system", "no.such.Module", "WorkerDiedError", "1bad"):
        assert type(disco.WorkerError(0, name, "m")) is disco.WorkerError


def test_worker_died_error_says_given_up_and_keeps_it_through_pickle():
    gone = disco.WorkerDiedError([2, 1], "its command stream was cut", given_up=True)
    assert str(gone).startswith("workers 1, 2 were given up: its command stream was cut")
    one = disco.WorkerDiedError([1], "killed")
    assert str(one).startswith("worker 1 died: killed") and not one.given_up
    for err in (gone, one, disco.WorkerUnresponsiveError([3], "silent")):
        rebuilt = pickle.loads(pickle.dumps(err))
        assert type(rebuilt) is type(err) and str(rebuilt) == str(err)
        assert rebuilt.given_up == err.given_up


def test_init_ccl_on_a_session_with_a_dead_worker_says_the_worker_died(no_leftover_children):
    """A chaos check's F9: a second init_ccl on a dead session said "already initialised"."""
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm", timeout=30)
        sess.channel.procs[0].proc.kill()
        sess.channel.procs[0].proc.wait(10)
        with pytest.raises(disco.WorkerDiedError, match="worker 1 died"):
            sess.init_ccl("shm")


def test_error_surfaces_at_the_sync_that_follows_it(no_leftover_children):
    """Issue 14, finding 3: worker 1 fails, joins an allreduce; the next sync raises it."""
    with disco.ProcessSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        sess.init_ccl("shm", timeout=30)
        x = sess.empty((8,), "float32")
        sess.call_packed("testing.fill", x, 0.0)
        late = []
        for i in range(200):
            failing = i % 10 == 0
            if failing:
                sess.call_packed("testing.raise_on", 1)
            else:
                sess.call_packed("testing.echo", i)
            sess.allreduce(x, x)
            try:
                sess.sync_worker_0()
            except disco.WorkerError as exc:
                assert failing, f"an error surfaced late, at call {i}: {exc}"
                assert exc.worker_id == 1
            else:
                if failing:
                    late.append(i)
        assert late == [], f"errors of calls {late} did not surface at the next sync"


def test_gathering_after_an_error_is_bounded(liveness):
    """A worker thread stuck in its function cannot hold the controller past the bound."""
    liveness(gather=1.0)
    sess = disco.ThreadedSession(2)
    sess.import_python_module("disco_core.testing.funcs")
    sess.call_packed("testing.sleep", 3.0, 1)  # worker 1 is busy for 3 s
    sess.call_packed("testing.raise_on", 0)
    start = time.monotonic()
    with pytest.raises(disco.WorkerUnresponsiveError) as info:
        sess.sync_worker_0()
    assert time.monotonic() - start < 2.5
    assert info.value.worker_ids == [1]
    assert [e.worker_id for e in info.value.errors] == [0]
    assert "DISCO_GATHER_TIMEOUT" in str(info.value)
    start = time.monotonic()
    sess.shutdown()
    assert time.monotonic() - start < 6


def test_no_child_left_after_unresponsive(liveness, procs):
    liveness(1.0)
    before = procs.children_of(os.getpid())
    sess = disco.ProcessSession(3)
    pid = _stop_worker(sess, 1)
    with pytest.raises(disco.WorkerUnresponsiveError):
        sess._sync_all()
    _shutdown_promptly(sess, [pid])
    assert procs.wait_gone(procs.children_of(os.getpid()) - before, 5.0) == []


def test_a_full_pipe_to_a_frozen_worker_ends(liveness, no_leftover_children):
    """Found by the chaos suite: a command with MiBs of data by value to a stopped worker.

    Its command pipe fills up; the write used to block for ever, outside any wait
    the liveness watch looks at. The write now checks the worker while it waits.
    """
    liveness(2.0)
    sess = disco.ProcessSession(2)
    sess.import_python_module("disco_core.testing.funcs")
    pid = _stop_worker(sess, 1)
    start = time.monotonic()
    with pytest.raises(disco.WorkerUnresponsiveError) as info:
        for _ in range(20):  # 4 MiB each: more than any pipe holds
            sess.call_packed("testing.checksum", np.ones(1 << 20, "float32"))
    assert time.monotonic() - start < 8
    assert info.value.worker_ids == [1]
    _shutdown_promptly(sess, [pid])


def test_reader_gate():
    """The gate a sync looks at: quiet only when nothing waits undelivered."""
    from disco_core.spi import ReaderGate

    assert ReaderGate().quiet()  # no descriptor at all (a channel with no reader)
    r, w = os.pipe()
    try:
        held = []
        gate = ReaderGate()
        gate.add(r, lambda: bool(held))
        assert gate.quiet()
        os.write(w, b"x")
        assert not gate.quiet()  # bytes in the pipe
        assert not gate.settled(time.monotonic() + 0.05)
        os.read(r, 1)
        held.append(1)  # taken by the reader, not yet delivered
        assert not gate.quiet()
        held.clear()
        taken, done = threading.Event(), threading.Event()

        def deliver() -> None:  # the reader (a thread of its own) is delivering
            with gate.lock:
                taken.set()
                done.wait(10)

        reader = threading.Thread(target=deliver)
        reader.start()
        try:
            assert taken.wait(10)
            assert not gate.quiet()
        finally:
            done.set()
            reader.join(10)
        assert gate.settled(time.monotonic() + 0.05)
        gate.remove(r)
        os.write(w, b"y")
        assert gate.quiet()  # no longer watched
    finally:
        os.close(r)
        os.close(w)


def test_a_worker_that_never_beats_is_not_judged(liveness, tmp_path, monkeypatch):
    """A worker of an older version sends no heartbeat: its silence proves nothing.

    Only a worker whose first heartbeat arrived (it goes before "ready") is judged by
    its silence; one that never announced them is waited for as before.
    """
    (tmp_path / "silent_worker_entry.py").write_text(
        "import disco_core.worker as w\n"
        "w.HeartbeatSender.start = lambda self: self  # as a worker without heartbeats\n"
        "w.main()\n"
    )
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))
    liveness(1.0)
    with disco.ProcessSession(2, entrypoint="silent_worker_entry") as sess:
        assert 1 not in sess.channel.hub.beating
        sess.import_python_module("disco_core.testing.funcs")
        sess.call_packed("testing.sleep", 2.5)
        sess._sync_all()  # 2.5 s of silence from worker 1, more than the bound
    with disco.ProcessSession(2) as sess:
        assert sess.channel.hub.beating == {1}


@pytest.mark.timeout(30)
def test_a_heartbeat_that_finds_the_reply_link_gone_calls_on_lost():
    # a socket node's worker whose agent froze for good: its commands never end, and
    # only its heartbeat can see that the controller closed its reply connection
    from disco_core.worker import HeartbeatSender

    sent: list = []
    lost: list = []
    gone = threading.Event()

    def send(msg):
        if gone.is_set():
            raise BrokenPipeError(32, "Broken pipe")
        sent.append(msg)

    beats = HeartbeatSender(send, interval=0.05, on_lost=lost.append).start()
    time.sleep(0.3)
    assert len(sent) >= 3  # beating while the link holds
    gone.set()
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(lost) == 1 and isinstance(lost[0], BrokenPipeError)
    time.sleep(0.2)
    assert len(lost) == 1  # and the beats stopped
    assert beats.lock.acquire(blocking=False)  # (not left held)


_UNDECODABLE_FUNCS = """
import os, sys
import disco_core as disco
from disco_core.worker import current

class Bad:
    def __init__(self, exc):
        self.exc = exc
    def __reduce__(self):
        return (_boom, (self.exc,))

def _boom(exc):
    raise {"value": ValueError, "oserror": FileNotFoundError, "type": TypeError}[exc]("no")

@disco.register_func("undecodable.value")
def value(kind):
    if not current().worker_id:
        return None
    if kind == "foreign":  # a class this (the controller's) process cannot import
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers_only"))
        import foreign_mod
        return foreign_mod.Thing()
    return Bad(kind)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["foreign", "value", "oserror", "type"])
def test_a_reply_the_controller_cannot_rebuild_fails_the_call_not_the_session(
    tmp_path, monkeypatch, kind, no_leftover_children
):
    # (an outside check: the reply thread died and the sync waited for ever; or the
    # worker was declared dead, "closed its reply pipe")
    (tmp_path / "undecodable_funcs.py").write_text(_UNDECODABLE_FUNCS)
    (tmp_path / "workers_only").mkdir()
    (tmp_path / "workers_only" / "foreign_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DISCO_SYS_PATH", str(tmp_path))
    monkeypatch.setenv("DISCO_LIVENESS_TIMEOUT", "5")
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("undecodable_funcs")
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerError, match="could not be rebuilt in the controller") as info:  # fmt: skip
            sess.get_global_func("undecodable.value")(kind).debug_get_from_remote(1)
        assert time.monotonic() - t0 < 3 and info.value.worker_id == 1
        assert not isinstance(info.value, disco.WorkerDiedError)
        sess.init_ccl("shm")
        x = sess.broadcast(np.arange(3.0))  # the session goes on, worker 1 with it
        np.testing.assert_array_equal(x.debug_get_from_remote(1), [0.0, 1.0, 2.0])
