"""Ctrl-C while the controller waits for a worker's answer, then carrying on (what a
notebook user does): every later call gets its own answer.

Once, the interrupted call's answer arrived later and was taken for the next call's,
and every later reply of that worker was the previous call's (outside check: asked for
8, 9 and 10, the session returned 7, 8 and 9). ``_thread.interrupt_main`` raises
``KeyboardInterrupt`` in the main thread as Ctrl-C does.
"""

from __future__ import annotations

import _thread
import threading

import pytest

import disco_core as disco


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["process", "threaded"])
@pytest.mark.parametrize("worker", [0, 1])
def test_an_interrupted_wait_leaves_no_answer_for_the_next_call(kind, worker):
    sess = disco.ProcessSession(2) if kind == "process" else disco.ThreadedSession(2)
    with sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo, sleep = sess.get_global_func("testing.echo"), sess.get_global_func("testing.sleep")
        sleep(1.0, worker)
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                echo(7).debug_get_from_remote(worker)
        finally:
            timer.cancel()
        # A worker that runs in this process ran the sleep on this thread: the sleep
        # itself was interrupted, and says so once (as a failed command does).
        try:
            first = echo(8).debug_get_from_remote(worker)
        except disco.WorkerError as exc:
            assert "KeyboardInterrupt" in str(exc) and "testing.sleep" in str(exc)
            first = echo(8).debug_get_from_remote(worker)
        assert first == 8
        assert [echo(v).debug_get_from_remote(worker) for v in (9, 10)] == [9, 10]
        other = 1 - worker
        assert echo(11).debug_get_from_remote(other) == 11
        sess._sync_all()


@pytest.mark.timeout(60)
def test_a_command_that_could_not_be_sent_is_not_waited_for():
    """An answered command that never left (its value cannot be sent) is not counted:
    counted, it made the answer of the call after an interrupted one stale, and that
    call waited for good."""
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        echo, sleep = sess.get_global_func("testing.echo"), sess.get_global_func("testing.sleep")
        ref = echo(1)
        with pytest.raises(TypeError):
            ref.debug_copy_from(1, threading.Lock())  # cannot be pickled: never sent
        assert ref.debug_get_from_remote(1) == 1
        sleep(1.0, 1)
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                echo(7).debug_get_from_remote(1)
        finally:
            timer.cancel()
        assert [echo(v).debug_get_from_remote(1) for v in (8, 9)] == [8, 9]
