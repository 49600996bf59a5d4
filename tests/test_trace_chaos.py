"""A trace's stop meets deaths, stopped workers, Ctrl-C and another thread's shutdown.

Each test is an outside check's reproduction (a chaos run against the tracing of
deaths). What must hold: the file is written, with every live worker's track; the
notes say true things; nothing hangs past the documented bounds; and the session's
next calls get their own answers.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import threading
import time

import pytest

import disco_core as disco
from disco_core.tracing import session_trace
from disco_core.tracing.format import worker_tid

FUNCS = "disco_core.testing.funcs"


def _tracks(path) -> set[int]:
    data = json.loads(open(path).read())
    return {e["tid"] for e in data["traceEvents"] if e.get("cat") == "command"}


def _notes(path) -> list[str]:
    return json.loads(open(path).read())["otherData"]["notes"]


def _kill(sess, w: int) -> None:
    pid = sess.channel.links[w].proc.pid
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead for sure (not reaped)
    except ChildProcessError:
        pass  # the channel reaped it already: dead for sure


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["clocks at the end", "after worker 0's events"])
def test_a_death_late_in_the_stop_keeps_the_live_tracks(tmp_path, monkeypatch, when):
    """Worker 1 dies while the stop measures the clocks again, or after it fetched
    worker 0's events: workers 0, 2 and 3 keep their tracks (they were all lost, or
    2 and 3 were), and the block raises the death (news to the program)."""
    path = tmp_path / "t.json"
    calls = {"clocks": 0, "exports": 0}
    measure, export = session_trace.Trace._measure_clocks, session_trace._checked_export

    with disco.ProcessSession(4) as sess:
        sess.import_python_module(FUNCS)

        def measure_then_kill(self):
            calls["clocks"] += 1
            if when == "clocks at the end" and calls["clocks"] == 2:
                _kill(sess, 1)
            return measure(self)

        def export_then_kill(value, capacity):
            out = export(value, capacity)
            calls["exports"] += 1
            if when == "after worker 0's events" and calls["exports"] == 1:
                _kill(sess, 1)
            return out

        monkeypatch.setattr(session_trace.Trace, "_measure_clocks", measure_then_kill)
        monkeypatch.setattr(session_trace, "_checked_export", export_then_kill)
        echo = sess.get_global_func("testing.echo")
        with pytest.raises(disco.WorkerDiedError):
            with disco.trace(sess, path):
                for i in range(20):
                    echo(i)
    assert {worker_tid(0), worker_tid(2), worker_tid(3)} <= _tracks(path)
    notes = _notes(path)
    assert "worker 1: no events (it died)" in notes
    assert not any(n.startswith(("worker 0", "worker 2", "worker 3")) for n in notes), notes


@pytest.mark.timeout(60)
def test_a_stopped_worker_does_not_use_up_the_others_time(tmp_path, monkeypatch):
    """Worker 1 dead, worker 2 stopped (SIGSTOP), worker 3 idle with a large track:
    the live workers are asked at once, so worker 3's events arrive (they were asked
    after worker 2's wait had used up the whole bound, and were lost)."""
    monkeypatch.setenv("DISCO_SHUTDOWN_TIMEOUT", "2")
    path = tmp_path / "t.json"
    with disco.ProcessSession(4) as sess:
        sess.import_python_module(FUNCS)
        echo = sess.get_global_func("testing.echo")
        stopped = sess.channel.links[2].proc.pid
        try:
            with pytest.raises(disco.WorkerDiedError):
                with disco.trace(sess, path):
                    for i in range(20000):
                        echo(i)
                    sess._sync_all()
                    os.kill(stopped, signal.SIGSTOP)
                    _kill(sess, 1)
                    sess._sync_all()
        finally:
            os.kill(stopped, signal.SIGCONT)
    assert {worker_tid(0), worker_tid(3)} <= _tracks(path)
    notes = _notes(path)
    assert "worker 1: no events (it died)" in notes
    assert any(n.startswith("worker 2: no events (it did not answer within") for n in notes)
    assert not any(n.startswith("worker 3") for n in notes), notes


class _CtrlC:
    """``with _CtrlC() as ctrl_c: ...; ctrl_c.after(s); ...``: Ctrl-C (``KeyboardInterrupt``
    in the main thread, as ``_thread.interrupt_main`` raises it) ``s`` seconds after
    ``after``, expected to end the block; the timer never outlives it."""

    def __init__(self) -> None:
        self.timer: threading.Timer | None = None
        self.raises = pytest.raises(KeyboardInterrupt)

    def after(self, seconds: float) -> None:
        self.timer = threading.Timer(seconds, _thread.interrupt_main)
        self.timer.start()

    def __enter__(self) -> _CtrlC:
        self.raises.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool:
        try:
            return bool(self.raises.__exit__(*exc))  # type: ignore[arg-type]
        finally:
            if self.timer is not None:
                self.timer.cancel()


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_stop_waits_still_writes_the_file(tmp_path):
    """The block ends while worker 1 is busy (2 s); Ctrl-C in the stop's wait: the file
    is written (it was lost, silently), with every track (worker 1 answers within the
    bound that follows), and the KeyboardInterrupt goes on."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        sess.import_python_module(FUNCS)
        echo, sleep = sess.get_global_func("testing.echo"), sess.get_global_func("testing.sleep")
        with _CtrlC() as ctrl_c:
            with disco.trace(sess, path):
                echo(1)
                sleep(2.0, 1)
                ctrl_c.after(0.5)
        assert os.path.exists(path)
        assert {worker_tid(w) for w in range(3)} <= _tracks(path)
        assert any("interrupted (KeyboardInterrupt)" in n for n in _notes(path))
        assert echo(8).debug_get_from_remote(1) == 8  # its own answer, not a stale one


@pytest.mark.timeout(60)
def test_ctrl_c_in_a_traced_block_leaves_the_replies_in_step(tmp_path):
    """Ctrl-C while the block waits for busy worker 1: the trace keeps every track and
    the program's next call to worker 1 gets its own answer (it got the trace's
    events dict, and the trace worker 1's stale reply)."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        sess.import_python_module(FUNCS)
        echo, sleep = sess.get_global_func("testing.echo"), sess.get_global_func("testing.sleep")
        with _CtrlC() as ctrl_c:
            with disco.trace(sess, path):
                sleep(2.0, 1)
                ctrl_c.after(0.5)
                echo(7).debug_get_from_remote(1)
        assert {worker_tid(w) for w in range(3)} <= _tracks(path)
        assert not any(n.startswith("worker") for n in _notes(path)), _notes(path)
        assert [echo(v).debug_get_from_remote(1) for v in (8, 9)] == [8, 9]


@pytest.mark.timeout(60)
def test_a_shutdown_from_another_thread_waits_for_a_running_stop(tmp_path):
    """While one thread's stop gathers (the block ended with worker 1 busy for 1 s),
    another thread shuts the session down: the shutdown waits for the file instead
    of closing the channel under it (every track was lost)."""
    path = tmp_path / "t.json"
    sess = disco.ProcessSession(3)
    sess.import_python_module(FUNCS)
    sleep = sess.get_global_func("testing.sleep")
    t = session_trace.Trace(sess, path).start()
    sleep(1.0, 1)
    stopper = threading.Thread(target=t.stop)
    stopper.start()
    time.sleep(0.2)  # the stop waits for worker 1
    sess.shutdown()
    stopper.join(30)
    assert not stopper.is_alive()
    assert {worker_tid(w) for w in range(3)} <= _tracks(path)
    assert not any(n.startswith("worker") for n in _notes(path)), _notes(path)


@pytest.mark.timeout(60)
def test_a_death_as_the_block_ends_is_raised_after_the_file_is_written(tmp_path):
    """The block's last command kills worker 2: the block raises WorkerDiedError (it
    ended quietly, the death only a note), after writing the live workers' tracks."""
    path = tmp_path / "t.json"
    with disco.ProcessSession(3) as sess:
        sess.import_python_module(FUNCS)
        die = sess.get_global_func("testing.die")
        with pytest.raises(disco.WorkerDiedError):
            with disco.trace(sess, path):
                die("sigkill", 2, os.getpid())
        assert {worker_tid(0), worker_tid(1)} <= _tracks(path)
        assert "worker 2: no events (it died)" in _notes(path)
