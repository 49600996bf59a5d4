"""A worker process's command read polls a moment before it sleeps (``_poll_first``)."""

from __future__ import annotations

import os
import threading
import time

import pytest

import disco_core as disco
from disco_core.worker import _poll_first

pytestmark = pytest.mark.timeout(60)


def test_spin_setting(monkeypatch):
    monkeypatch.delenv("DISCO_WORKER_SPIN_US", raising=False)
    assert _poll_first.spin_seconds() == pytest.approx(200e-6)
    monkeypatch.setenv("DISCO_WORKER_SPIN_US", "0")
    assert _poll_first.spin_seconds() == 0
    monkeypatch.setenv("DISCO_WORKER_SPIN_US", "50")
    assert _poll_first.spin_seconds() == pytest.approx(50e-6)
    for bad in ("fast", "-1", "nan", "1e9"):
        monkeypatch.setenv("DISCO_WORKER_SPIN_US", bad)
        with pytest.warns(RuntimeWarning, match="DISCO_WORKER_SPIN_US"):
            assert _poll_first.spin_seconds() == pytest.approx(200e-6)


@pytest.mark.parametrize("spin", [0.0, 200e-6, 0.05])
def test_the_read_returns_what_arrives_and_costs_no_cpu_while_idle(spin):
    """Bytes written now or later are read; a read that waits 0.4 s polls for the spin
    at most, then sleeps (its thread's CPU time stays near the spin, not the wait)."""
    r, w = os.pipe()
    try:
        read = _poll_first.reader_of(r, spin)
        os.write(w, b"now")
        assert read(16) == b"now"
        got: dict = {}

        def reader() -> None:
            t0 = time.thread_time()
            got["data"] = read(16)
            got["cpu"] = time.thread_time() - t0

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.4)
        os.write(w, b"later")
        t.join(10)
        assert got["data"] == b"later"
        assert got["cpu"] < spin + 0.03, got  # a busy wait would have used ~0.4 s
    finally:
        os.close(r)
        os.close(w)


def test_no_polling_where_the_parent_and_the_worker_share_one_cpu(monkeypatch):
    """Polling could only take turns from the controller there."""
    mine = os.sched_getaffinity(0)
    monkeypatch.setattr(os, "getppid", os.getpid)  # "the parent": this process
    alone = _poll_first._AloneOnOneCpu()
    assert alone() == (len(mine) <= 1)
    cpu = min(mine)
    os.sched_setaffinity(0, {cpu})
    try:
        alone.checked = -1e9  # look again now
        assert alone() is True
    finally:
        os.sched_setaffinity(0, mine)
    alone.checked = -1e9
    assert alone() == (len(mine) <= 1)


@pytest.mark.parametrize("spin", ["0", "200"])
def test_worker_processes_answer_with_and_without_polling(monkeypatch, spin):
    monkeypatch.setenv("DISCO_WORKER_SPIN_US", spin)
    with disco.ProcessSession(3) as sess:
        f = sess.get_global_func("disco.worker_id")
        for _ in range(50):
            sess._sync_worker(2)
        assert [int(f().debug_get_from_remote(w)) for w in range(3)] == [0, 1, 2]
        time.sleep(0.05)  # idle: every worker polled, then slept
        assert int(f().debug_get_from_remote(1)) == 1
