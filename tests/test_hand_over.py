"""How commands reach the workers: held back, handed over in batches, never forgotten.

A sync with worker 0 (in the controller's process) runs its commands on the
controller's thread and hands nothing to the other workers; the others get theirs
in batches, one frame per batch. These tests check that this costs nothing in
correctness: a worker that waits for the others (a collective) first hands the
held-back commands over, and commands nobody syncs on still run within
``FLUSH_DELAY`` (the flusher thread).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import disco_core as disco
from disco_core import registry
from disco_core.ccl.base import CCL, WAITING_OPS
from disco_core.channels import base
from disco_core.worker import current

pytestmark = pytest.mark.timeout(60)

KINDS = {"threaded": disco.ThreadedSession, "process": disco.ProcessSession}


@pytest.fixture
def slow_flusher(monkeypatch):
    """The flusher waits 30 s: only a sync, a wait or ``ctx.hand_over`` hands commands over."""
    monkeypatch.setattr(base, "FLUSH_DELAY", 30.0)


def test_sync_with_worker0_hands_nothing_to_worker_processes(slow_flusher):
    with disco.ProcessSession(2) as sess:
        f = sess.get_global_func("disco.worker_id")
        sess._sync_worker(1)  # everything so far is out
        writes = []
        link = sess.channel._link_of[1]
        real = link._write
        link._write = lambda data: (writes.append(len(data)), real(data))[1]
        for _ in range(10):
            r = f()
            sess.sync_worker_0()
            assert r.debug_get_from_remote(0) == 0
        assert writes == []  # ten round trips with worker 0, no write to worker 1
        assert len(sess.channel._batch) >= 10  # held back, not lost
        assert r.debug_get_from_remote(1) == 1  # a wait for worker 1 hands them over
        assert len(writes) == 1  # ... in one frame
        assert not sess.channel._batch


def test_a_batch_is_one_write_per_worker_process(slow_flusher):
    with disco.ProcessSession(3) as sess:
        f = sess.get_global_func("disco.worker_id")
        sess._sync_all()
        counts = {}
        for w in (1, 2):
            link = sess.channel._link_of[w]
            real = link._write

            def counted(data, w=w, real=real):
                counts[w] = counts.get(w, 0) + 1
                real(data)

            link._write = counted
        refs = [f() for _ in range(100)]
        sess._sync_all()
        assert counts == {1: 1, 2: 1}
        assert [int(refs[-1].debug_get_from_remote(w)) for w in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_worker0_in_a_collective_hands_the_others_their_commands(slow_flusher, kind):
    """Worker 0 runs the allreduce on the controller's thread at the sync: without
    ``ctx.hand_over`` worker 1 would get its command only when the flusher wakes (30 s)."""
    with KINDS[kind](2) as sess:
        sess.init_ccl("shm")
        x = sess.empty((4,), "float32")
        for w in range(2):
            x.debug_copy_from(w, np.full(4, w + 1, dtype=np.float32))
        t0 = time.monotonic()
        sess.allreduce(x, x)
        sess.sync_worker_0()
        assert time.monotonic() - t0 < 10
        np.testing.assert_array_equal(x.debug_get_from_remote(0), np.full(4, 3, np.float32))
        np.testing.assert_array_equal(x.debug_get_from_remote(1), np.full(4, 3, np.float32))


_RAN: list[int] = []


@registry.register_func("test.hand_over.note", override=True)
def _note(value: int) -> None:
    _RAN.append((current().worker_id, value))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_commands_run_without_a_sync(kind):
    """Nobody syncs: worker 0 (and a thread worker 1) still run the command, soon."""
    _RAN.clear()
    with KINDS[kind](2) as sess:
        note = sess.get_global_func("test.hand_over.note")
        note(7)
        want = {(0, 7)} if kind == "process" else {(0, 7), (1, 7)}
        deadline = time.monotonic() + 5
        while set(_RAN) != want and time.monotonic() < deadline:
            time.sleep(0.001)
        assert set(_RAN) == want


def test_ccl_subclasses_hand_over_before_every_waiting_operation():
    calls = []

    class Probe(CCL):
        name = "probe"

        def allreduce(self, src, dst, op, in_group):
            calls.append("allreduce")

        def allgather(self, src, dst, in_group):
            calls.append("allgather")

        def broadcast(self, src, dst, in_group):
            calls.append("broadcast")

        def scatter(self, src, dst, in_group):
            calls.append("scatter")

        def gather(self, src, dst, in_group):
            calls.append("gather")

        def send(self, buf, peer):
            calls.append("send")

        def recv(self, buf, peer):
            calls.append("recv")

        def barrier(self, in_group=False):
            calls.append("barrier")

    class Ctx:
        def hand_over(self):
            calls.append("hand_over")

    ccl = Probe(Ctx(), None)
    ccl.allreduce(1, 1, "sum", False)
    ccl.allgather(1, 1, False)
    ccl.broadcast(1, 1, False)
    ccl.scatter(1, 1, False)
    ccl.gather(1, 1, False)
    ccl.send(1, 0)
    ccl.recv(1, 0)
    ccl.barrier()
    assert calls == [x for op in WAITING_OPS for x in ("hand_over", op)]

    class Sub(Probe):  # wrapped once, not twice, when a subclass keeps the method
        pass

    calls.clear()
    Sub(Ctx(), None).barrier()
    assert calls == ["hand_over", "barrier"]


def test_hand_over_from_another_thread_while_the_controller_sends():
    """A flusher-like thread hands over all the time while the controller sends:
    every worker still sees every command once, in order."""
    with disco.ProcessSession(3) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        lst = sess.get_global_func("testing.new_list")()
        append = sess.get_global_func("testing.append")
        stop = threading.Event()

        def hammer():
            while not stop.is_set():
                sess.channel.flush()

        t = threading.Thread(target=hammer)
        t.start()
        try:
            for i in range(3000):
                append(lst, i)
        finally:
            stop.set()
            t.join()
        for w in range(3):
            assert list(lst.debug_get_from_remote(w)) == list(range(3000))


@registry.register_func("test.hand_over.waits_for_worker_1", override=True)
def _waits_for_worker_1(path: str) -> int:
    """Worker 0 waits for a file that worker 1 writes: no CCL, so it hands over itself."""
    ctx = current()
    if ctx.worker_id == 1:
        with open(path, "w") as f:
            f.write("1")
        return 1
    ctx.hand_over()
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("worker 1 never ran its command")
        time.sleep(0.001)
    return 0


def test_a_user_function_hands_over_by_itself(slow_flusher, tmp_path):
    with disco.ThreadedSession(2) as sess:
        f = sess.get_global_func("test.hand_over.waits_for_worker_1")
        t0 = time.monotonic()
        r = f(str(tmp_path / "flag"))
        sess.sync_worker_0()
        assert time.monotonic() - t0 < 10
        assert r.debug_get_from_remote(0) == 0


def test_hand_over_does_nothing_where_nothing_is_held():
    from disco_core.worker import WorkerContext

    WorkerContext(1, 2, 1).hand_over()  # a worker process's context: a no-op


@pytest.mark.parametrize("n", [1, 2])
def test_worker0_run_by_the_controller_does_not_wake_its_own_thread(slow_flusher, n):
    """A collective that the controller's thread runs for worker 0 (at a sync) hands
    over: that wakes the other in-process workers, never worker 0's own thread, which
    would only wait for the lock the controller holds (and take the GIL from it on the
    way: ~3 thread switches a step of a 1-worker session before)."""
    with disco.ProcessSession(n) as sess:
        sess.init_ccl("shm")
        x = sess.empty((16,), "float32")
        for w in range(n):
            x.debug_copy_from(w, np.zeros(16, np.float32))
        sess._sync_all()
        link = next(lk for lk in sess.channel.links if type(lk) is base.ThreadWorkerLink)
        tokens = link.tokens
        woken_by = []

        class Counted:  # the worker's thread waits in tokens.get() as before
            get = tokens.get

            def put(self, item):
                woken_by.append(threading.current_thread().name)
                tokens.put(item)

        link.tokens = Counted()
        try:
            for _ in range(50):
                # held back, then run on this thread by the sync: the allreduce hands
                # over with the next command still waiting
                sess.allreduce(x, x, "sum")
                sess.allreduce(x, x, "sum")
                sess.sync_worker_0()
        finally:
            link.tokens = tokens
        assert threading.main_thread().name not in woken_by
        assert link.runner is None  # nobody runs worker 0's commands between calls
        # ... while a wait for another worker still wakes it (see the test above)
        if n == 2:
            sess.allreduce(x, x, "sum")
            sess._sync_worker(1)
            np.testing.assert_array_equal(x.debug_get_from_remote(1), np.zeros(16, np.float32))


_MARKS: list[str] = []


@registry.register_func("test.hand_over.mark", override=True)
def _mark(tag: str) -> None:
    _MARKS.append(tag)  # worker 0's, in this process


def test_commands_behind_a_collective_cut_by_ctrl_c_still_run(slow_flusher):
    """Ctrl-C cuts worker 0's allreduce, which the controller's thread runs at a sync:
    the command queued behind it still runs, with no further call and long before the
    flusher (30 s here). Its hand-over had not woken worker 0's thread (the drain was
    to look at the queue again, and the interrupt ended the drain first): the command
    waited for the flusher, or, with DISCO_FLUSH_DELAY=inf, for an unrelated later
    call (outside check)."""
    import _thread

    _MARKS.clear()
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("shm")
        sess.import_python_module("disco_core.testing.funcs")
        x = sess.empty((4,), "float32")
        sess._sync_all()
        sess.call_packed("testing.sleep", 1.0, 1)  # worker 1 comes to the allreduce late
        sess.allreduce(x, x, "sum")
        sess.call_packed("test.hand_over.mark", "after")
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                sess.sync_worker_0()
        finally:
            timer.cancel()
        deadline = time.monotonic() + 5
        while "after" not in _MARKS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _MARKS == ["after"]


def test_a_sync_with_a_worker_process_does_not_wake_the_flusher():
    """The sync's own command is written by the wait that follows it: waking the
    flusher thread for it cost two wake-ups of this process a sync (~9 us of 68 us on
    one CPU). Commands sent without a wait still wake it (or nothing would send them)."""
    with disco.ProcessSession(2) as sess:
        f = sess.get_global_func("disco.worker_id")
        sess._sync_all()
        channel = sess.channel
        real = channel._wake_flusher
        marked = []

        class Counted:  # the flusher thread waits in the real queue's get() as before
            get = real.get

            def put(self, item):
                marked.append(item)
                real.put(item)

        channel._wake_flusher = Counted()
        try:
            channel._flush_due = False  # as after the flusher's last round
            for _ in range(20):
                sess._sync_worker(1)
            assert marked == []
            r = f()  # no wait follows: the flusher must send it
            assert marked == [None]
        finally:
            channel._wake_flusher = real
        deadline = time.monotonic() + 10
        while channel._batch and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not channel._batch  # the flusher sent it, nobody synced
        assert r.debug_get_from_remote(1) == 1


def test_a_sync_cut_short_before_its_wait_still_sends_its_command(monkeypatch):
    """Ctrl-C between the sync's send and its wait (which would have flushed): the
    command held back goes out with the flusher, as any other does (outside check)."""
    with disco.ProcessSession(2) as sess:
        sess._sync_all()
        time.sleep(0.1)  # the flusher is idle
        link = sess.channel._link_of[1]
        real = base.LinkChannel.recv
        calls = []

        def interrupted(self, worker_id, timeout=None):
            if not calls:
                calls.append(worker_id)
                raise KeyboardInterrupt
            return real(self, worker_id, timeout)

        monkeypatch.setattr(base.LinkChannel, "recv", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sess._sync_worker(1)
        monkeypatch.setattr(base.LinkChannel, "recv", real)
        deadline = time.monotonic() + 10
        while link.outbox and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == [1] and not link.outbox  # written, with no other send or sync
        f = sess.get_global_func("disco.worker_id")
        assert int(f().debug_get_from_remote(1)) == 1  # its answer is not taken for this


def test_an_endless_flush_delay_keeps_the_flusher_alive(monkeypatch):
    """DISCO_FLUSH_DELAY=inf (or past time.sleep's limit) made the flusher's sleep raise
    and end its thread (outside check); it now waits an hour between kicks at most."""
    monkeypatch.setattr(base, "FLUSH_DELAY", float("inf"))
    with disco.ProcessSession(2) as sess:
        f = sess.get_global_func("disco.worker_id")
        r = f()  # wakes the flusher, which then sleeps
        time.sleep(0.2)
        flusher = sess.channel._flusher
        assert flusher is not None and flusher.is_alive()
        assert int(r.debug_get_from_remote(1)) == 1  # a wait still hands it over
