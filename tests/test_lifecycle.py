"""Session life cycle: shapes, creation by name, start-up failures, no child left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import disco_core as disco

SESSIONS = [disco.ThreadedSession, disco.ProcessSession]


@pytest.mark.parametrize("cls", SESSIONS, ids=["threaded", "process"])
@pytest.mark.parametrize(
    "num_workers, num_groups, exc",
    [
        (0, 1, ValueError),
        (-2, 1, ValueError),
        (4, 3, ValueError),
        (4, 0, ValueError),
        (2.0, 1, TypeError),
        ("2", 1, TypeError),
        (True, 1, TypeError),
        (2, None, TypeError),
    ],
)
def test_bad_shapes(cls, num_workers, num_groups, exc, no_leftover_children):
    with pytest.raises(exc):
        cls(num_workers, num_groups)


@pytest.mark.parametrize("channel", ["threaded", "process"])
@pytest.mark.parametrize(
    "options",
    [{"num_workers": 0}, {"num_workers": 4, "num_groups": 3}],
    ids=["zero-workers", "groups-do-not-divide"],
)
def test_create_checks_shapes(channel, options):
    sess = None
    try:
        with pytest.raises((ValueError, TypeError)):
            sess = disco.Session.create(channel, **options)
    finally:
        if sess is not None:
            sess.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("channel", ["threaded", "process"])
def test_create_by_name(channel, no_leftover_children):
    with disco.Session.create(channel, num_workers=4, num_groups=2) as sess:
        assert isinstance(sess, disco.Session)
        assert (sess.num_workers, sess.num_groups) == (4, 2)
        gid = sess.get_global_func("disco.group_id")()
        assert [gid.debug_get_from_remote(w) for w in range(4)] == [0, 0, 1, 1]
    with pytest.raises(disco.SessionClosedError):
        sess.sync_worker_0()


def test_single_worker_sessions():
    for cls in SESSIONS:
        with cls(1) as sess:
            assert sess.get_global_func("disco.world_size")().debug_get_from_remote(0) == 1


@pytest.mark.timeout(30)
def test_no_child_left_after_shutdown(no_leftover_children, procs):
    sess = disco.ProcessSession(3)
    sess.import_python_module("disco_core.testing.funcs")
    pids = [sess.get_global_func("testing.pid")().debug_get_from_remote(w) for w in (1, 2)]
    assert set(pids) <= procs.children_of(os.getpid())
    sess.shutdown()
    assert procs.wait_gone(pids, 5) == []
    assert not set(pids) & procs.children_of(os.getpid())


@pytest.mark.timeout(30)
def test_no_child_left_after_dropping_the_session(no_leftover_children, procs):
    import gc

    sess = disco.ProcessSession(2)
    pid = sess.channel.procs[0].proc.pid if hasattr(sess.channel, "procs") else None
    del sess
    gc.collect()
    if pid is not None:
        assert procs.wait_gone([pid], 5) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["process", "threaded"])
def test_a_dropped_session_is_closed_when_dropped_not_by_the_garbage_collector(kind, procs):
    """After ``init_ccl`` (or any built-in the session keeps a handle to), the session
    was in a reference cycle: a dropped one kept its worker processes, threads and
    pipes until the garbage collector ran (an outside check: 12 dropped sessions held
    12 worker processes). With the collector off, ``del`` alone closes it now."""
    import gc
    import threading
    import weakref

    import numpy as np

    gc.collect()
    threads_before = threading.active_count()
    gc.disable()
    try:
        sess = disco.Session.create(kind, num_workers=2)
        sess.init_ccl("shm")
        x = sess.broadcast(np.arange(4, dtype="float32"))
        y = sess.empty((4,), "float32")
        sess.allreduce(x, y)
        sess.allgather(x, sess.empty((8,), "float32"))
        sess.gather_to_worker0(x, sess.empty((8,), "float32", worker0_only=True))
        sess.scatter(np.arange(4, dtype="float32").reshape(2, 2))
        sess.copy_from_worker_0(np.empty(4, "float32"), sess.copy_to_worker_0(np.ones(4, "float32")))  # fmt: skip
        sess.import_python_module("disco_core.testing.funcs")
        assert y.debug_get_from_remote(1).tolist() == [0, 2, 4, 6]
        pids = [link.proc.pid for link in getattr(sess.channel, "procs", [])]
        gone = weakref.ref(sess)
        del sess, x, y
        assert gone() is None, "the session outlived its last reference"
        assert procs.wait_gone(pids, 5) == []
        deadline = time.monotonic() + 5
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= threads_before, [t.name for t in threading.enumerate()]
    finally:
        gc.enable()


def test_a_kept_function_handle_outliving_its_session_says_so():
    """The handles a session keeps name it weakly: one used after the session is gone
    raised an AttributeError on None (an outside check); dropping it is quiet."""
    import gc

    sess = disco.ThreadedSession(2)
    kept = sess._get_cached_method("disco.worker_id")
    sess.shutdown()
    del sess
    gc.collect()
    with pytest.raises(disco.SessionClosedError, match="is gone"):
        kept.debug_get_from_remote(0)
    del kept  # its __del__ finds no session: nothing raised, nothing printed


@pytest.mark.timeout(30)
def test_worker_that_cannot_start(no_leftover_children):
    t0 = time.monotonic()
    with pytest.raises(disco.DiscoError) as info:
        disco.ProcessSession(2, entrypoint="disco_core.no_such_entrypoint_module")
    assert time.monotonic() - t0 < 10
    assert isinstance(info.value, disco.WorkerDiedError)
    # The worker's own words (its stderr) say why, not only its exit code.
    assert "No module named disco_core.no_such_entrypoint_module" in str(info.value)
    with pytest.raises(TypeError):
        disco.ProcessSession(2, entrypoint="")


def test_exit_seen_before_the_pipes_end_still_says_why():
    # The start-up wait polls the processes while the reply reader waits for the
    # pipe's end: when the poll sees the exit first, its reason is the one the user
    # gets, so it must carry the worker's stderr too (under load the poll won 2 times
    # in 30 and the error said only "exited with code 1").
    from types import SimpleNamespace

    from disco_core.channels.process import ProcessWorkerLink

    link = SimpleNamespace(
        dead_reason=None,
        exit_reason=lambda: "worker 1 (pid 7) exited with code 1",
        stderr_tail=lambda wait=0.0: "ModuleNotFoundError: No module named 'nope'\n",
    )
    reason = ProcessWorkerLink.poll(link)
    assert reason == link.dead_reason
    assert reason.startswith("worker 1 (pid 7) exited with code 1")
    assert "No module named 'nope'" in reason


_FEW_FILES = r"""
import os, resource, subprocess, time
import disco_core as disco
resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
before = len(os.listdir("/proc/self/fd"))
try:
    disco.ProcessSession(30)
except disco.DiscoError as exc:
    print("ERROR", type(exc).__name__, exc)
time.sleep(0.5)
children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
print("LEFT", len(children), len(os.listdir("/proc/self/fd")) - before)
sess = disco.ProcessSession(2)  # the session that fits still starts
print("OK", sess.num_workers)
sess.shutdown()
"""


@pytest.mark.timeout(60)
def test_running_out_of_files_is_named_and_leaves_nothing():
    """Before: a raw ``OSError: Too many open files: '/dev/null'`` (an outside check)."""
    r = subprocess.run(
        [sys.executable, "-c", _FEW_FILES], capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 0, r.stderr
    assert "ERROR DiscoError cannot start worker process" in r.stdout, r.stdout
    assert "Too many open files" in r.stdout and "ulimit -n" in r.stdout, r.stdout
    assert "LEFT 0 0" in r.stdout and "OK 2" in r.stdout, r.stdout


_LAST_WORDS = r"""
import os, sys
import disco_core as disco

@disco.register_func("lifecycle.last_words", override=True)
def last_words(worker_id):
    if disco.worker.current().worker_id == worker_id:
        sys.stderr.write("lifecycle: the disk is full, giving up\n")
        sys.stderr.flush()
        os._exit(3)
"""


@pytest.mark.timeout(60)
def test_worker_death_carries_the_end_of_its_stderr(tmp_path, monkeypatch, capfd):
    (tmp_path / "lifecycle_last_words.py").write_text(_LAST_WORDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("lifecycle_last_words")
        sess.get_global_func("lifecycle.last_words")(1)
        with pytest.raises(disco.WorkerDiedError) as info:
            sess.get_global_func("disco.worker_id")().debug_get_from_remote(1)
    message = str(info.value)
    assert "exited with code 3" in message
    assert "the disk is full, giving up" in message
    # ... and the bytes still reach the controller's own stderr.
    assert "the disk is full, giving up" in capfd.readouterr().err


_CONTROLLER = """
import os, sys, time
import disco_core as disco
sess = disco.ProcessSession(3)
sess.import_python_module("disco_core.testing.funcs")
pids = [sess.get_global_func("testing.pid")().debug_get_from_remote(w) for w in (1, 2)]
mode = sys.argv[1]
if mode == "busy":
    sess.get_global_func("testing.sleep")(60.0)  # workers are busy when the controller dies
print("PIDS", *pids, flush=True)
if mode == "raise":
    raise RuntimeError("controller crashed")
if mode == "os_exit":
    os._exit(3)
time.sleep(120)
"""


def _start_controller(mode: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("PIDS"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the controller did not start its workers: {line!r} {err}")
    return proc, [int(p) for p in line.split()[1:]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["idle", "busy"])
def test_workers_exit_when_the_controller_is_killed(mode, procs):
    proc, pids = _start_controller(mode)
    try:
        assert all(not procs.pid_gone(p) for p in pids)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert procs.wait_gone(pids, 5) == [], f"workers outlived their controller ({mode})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if not procs.pid_gone(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["raise", "os_exit"])
def test_workers_exit_when_the_controller_crashes(mode, procs):
    proc, pids = _start_controller(mode)
    try:
        proc.wait(20)
        assert proc.returncode != 0
        assert procs.wait_gone(pids, 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if not procs.pid_gone(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_session_repr_and_channel():
    with disco.ProcessSession(2) as sess:
        assert isinstance(sess.channel, disco.Channel)
        assert "process" in repr(sess)
    assert "closed" in repr(sess)
