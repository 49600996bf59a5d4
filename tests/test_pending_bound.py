"""A controller that never syncs keeps its memory bounded: the commands waiting for a
worker of its own process (worker 0 of a ProcessSession, every worker of a
ThreadedSession) are at most ``PENDING_COMMANDS``; past it the controller runs them
itself before it goes on, as a full pipe makes it wait for a worker in another process.

Before the bound, 1,000,000 asynchronous calls raised a ProcessSession controller's
peak memory from 48 to 177 MB (about 200 bytes a waiting command).
"""

from __future__ import annotations

import numpy as np
import pytest

import disco_core as disco
import disco_core.testing.funcs  # noqa: F401  (registers testing.*)
from disco_core.channels import base

pytestmark = pytest.mark.timeout(120)

LIMIT = 300


@pytest.mark.parametrize("kind", ["process", "threaded"])
def test_waiting_commands_of_an_in_process_worker_are_bounded(kind, monkeypatch):
    monkeypatch.setattr(base, "PENDING_COMMANDS", LIMIT)
    sess = disco.ProcessSession(2) if kind == "process" else disco.ThreadedSession(2)
    try:
        links = [link for link in sess._channel.links if type(link) is base.ThreadWorkerLink]
        assert links, "this session has no worker in the controller's process"
        sess.import_python_module("disco_core.testing.funcs")
        add = sess.get_global_func("testing.add")
        sess._sync_all()
        for link in links:
            # The worker's own thread is never woken: only the bound (or a sync) runs
            # its commands, so the bound is what is checked, not the thread's speed.
            monkeypatch.setattr(link, "flush", lambda: None)
        peak = 0
        refs = []
        for i in range(5 * LIMIT):
            refs.append(add(i, 1))  # kept: no register is freed, one command a call
            peak = max(peak, *(len(link.pending) for link in links))
        assert peak <= LIMIT + 1, f"{peak} commands waited for one in-process worker"
        assert peak > LIMIT // 2  # they did wait: the bound, not the worker's thread, ran them
        # Nothing was lost or reordered on the way.
        last = [r.debug_get_from_remote(0) for r in refs[-3:]]
        assert last == [5 * LIMIT - 2, 5 * LIMIT - 1, 5 * LIMIT]
        assert refs[0].debug_get_from_remote(1) == 1
    finally:
        sess.shutdown()


@pytest.mark.parametrize("kind", ["process", "threaded"])
def test_the_bound_runs_collectives_with_the_other_workers(kind, monkeypatch):
    """The commands the controller runs itself may be collectives: worker 0 then waits
    for the other workers, whose commands must reach them first (in a ThreadedSession,
    every worker's queue must hold the command before anyone runs it: checking the
    bound after the first queue had it deadlocked)."""
    monkeypatch.setattr(base, "PENDING_COMMANDS", LIMIT)
    sess = disco.ProcessSession(3) if kind == "process" else disco.ThreadedSession(3)
    try:
        sess.init_ccl("shm")
        x = sess.empty((4,), "float32")
        link = next(lk for lk in sess._channel.links if type(lk) is base.ThreadWorkerLink)
        sess._sync_all()
        monkeypatch.setattr(link, "flush", lambda: None)
        ones = sess.broadcast(np.ones(4, np.float32))
        peak = 0
        for _ in range(5 * LIMIT):
            sess.allreduce(ones, x, "sum")
            peak = max(peak, len(link.pending))
        assert peak <= LIMIT + 2  # one call over: its kill of a freed register and itself
        monkeypatch.undo()  # worker 0's thread is woken again (a wait for worker 2 does)
        np.testing.assert_array_equal(x.debug_get_from_remote(2), np.full(4, 3, np.float32))
    finally:
        sess.shutdown()
