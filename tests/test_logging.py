"""The core logs its lifecycle, never per command, and worker processes only when asked (issue 17)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

import disco_core as disco
from disco_core.commandline import LOG_LEVEL_ENV

SCRIPT = textwrap.dedent(
    """
    import disco_core as disco
    with disco.ProcessSession(3) as sess:
        sess.init_ccl("shm")
        sess.get_global_func("disco.worker_id")().debug_get_from_remote(2)
    """
)


def _messages(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


@pytest.mark.timeout(60)
def test_threaded_session_lifecycle(caplog):
    caplog.set_level(logging.INFO, logger="disco_core")
    with disco.ThreadedSession(4, num_groups=2) as sess:
        sess.init_ccl("shm")
        sess.sync_worker_0()
    session = _messages(caplog, "disco_core.session")
    assert "session started: threaded channel, 4 worker(s) in 2 group(s)" in session
    assert "CCL 'shm' initialised: 4 worker(s) in 2 group(s) of 2" in session
    assert "session shutting down: threaded channel" in session
    channels = _messages(caplog, "disco_core.channels")
    for w in range(4):
        assert f"worker {w} started (thread disco-worker-{w})" in channels
        assert f"worker {w} stopped" in channels
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith("disco_core"))


@pytest.mark.timeout(60)
def test_process_session_lifecycle_in_the_controller(caplog):
    caplog.set_level(logging.INFO, logger="disco_core")
    with disco.ProcessSession(3) as sess:
        pids = [link.proc.pid for link in sess._channel.procs]
    channels = _messages(caplog, "disco_core.channels")
    assert f"started 2 worker process(es) running disco_core.worker: pids {pids}" in channels
    assert "session started: process channel, 3 worker(s) in 1 group(s)" in _messages(
        caplog, "disco_core.session"
    )


def _run_script(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, **env_extra},
    )


@pytest.mark.timeout(90)
def test_worker_processes_log_to_stderr_when_a_level_is_set():
    r = _run_script({LOG_LEVEL_ENV: "INFO"})
    assert r.returncode == 0, r.stderr
    for w in (1, 2):
        started = re.search(
            rf"disco_core\.worker\[(\d+)\] INFO worker {w} of 3 started \(pid (\d+)", r.stderr
        )
        assert started and started.group(1) == started.group(2), r.stderr
        assert f"INFO worker {w} exiting: shutdown command" in r.stderr
    # the controller's user configured nothing: its own records are not shown
    assert "session started" not in r.stderr
    # plugins are loaded by every worker, said at DEBUG there (the controller says it once)
    assert "loaded plugin" not in r.stderr


@pytest.mark.timeout(90)
def test_worker_processes_are_silent_without_a_level():
    r = _run_script({})
    assert r.returncode == 0, r.stderr
    assert "disco_core" not in r.stderr


@pytest.mark.timeout(90)
def test_workers_follow_the_controllers_logging_configuration():
    script = (
        "import logging, sys\nlogging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        + SCRIPT
    )
    env = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "INFO:disco_core.session:session started: process channel" in r.stderr
    assert re.search(r"disco_core\.worker\[\d+\] INFO worker 2 of 3 started", r.stderr), r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [disco.ThreadedSession, disco.ProcessSession])
def test_no_logging_call_on_the_command_path(monkeypatch, kind):
    """Not even a disabled one: the control plane is hot."""
    calls: list[str] = []
    original = logging.Logger.isEnabledFor

    def counting(self, level):
        if self.name.startswith("disco_core"):
            calls.append(self.name)
        return original(self, level)

    with kind(2) as sess:
        f = sess.get_global_func("disco.worker_id")
        x = sess.empty((4,), "float32")
        sess.sync_worker_0()
        monkeypatch.setattr(logging.Logger, "isEnabledFor", counting)
        for _ in range(200):
            r = f()
            sess.copy_to_worker_0(x.debug_get_from_remote(0), x)
        assert r.debug_get_from_remote(1) == 1
        sess.sync_worker_0()
        assert calls == []
