"""The ``mpi`` channel under ``mpiexec -n 3``, and the ``disco-mpi`` command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import disco_mpi
from disco_core.testing.procfs import wait_gone

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "channel_script.py")


def _run(argv, **env):
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(120)
def test_channel_under_mpiexec():
    exe = disco_mpi.launcher()
    assert exe, "mpiexec comes with the mpich wheel"
    r = _run([exe, "-n", "3", sys.executable, SCRIPT])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("MPI CHANNEL OK 3") == 1  # rank 0 only goes past the session


@pytest.mark.timeout(120)
def test_disco_mpi_run_with_groups():
    r = _run([sys.executable, "-m", "disco_mpi", "run", "-n", "4", SCRIPT], GROUPS="2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MPI CHANNEL OK 4" in r.stdout


@pytest.mark.timeout(60)
def test_disco_mpi_run_dry_run_and_info():
    r = _run([sys.executable, "-m", "disco_mpi", "run", "-n", "2", "--dry-run", "x.py", "a"])
    assert r.returncode == 0
    assert " -n 2 " in r.stdout and r.stdout.strip().endswith("x.py a")
    r = _run([sys.executable, "-m", "disco_mpi", "info"])
    assert r.returncode == 0 and "MPICH" in r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_channel_size_mismatch():
    code = (
        "import disco_core as disco\n"
        "try:\n"
        "    disco.Session.create('mpi', num_workers=3)\n"
        "except disco.DiscoError as e:\n"
        "    print('REFUSED', e)\n"
    )
    r = _run([disco_mpi.launcher(), "-n", "1", sys.executable, "-c", code])
    assert "REFUSED" in r.stdout and "mpiexec -n 3" in r.stdout, r.stdout + r.stderr


def test_plugin_registered():
    from disco_core import plugins

    assert plugins.lookup("ccl", "mpi") is disco_mpi.MPICCL
    assert plugins.lookup("channel", "mpi") is disco_mpi.MPIChannel


ROGUE = os.path.join(HERE, "rogue_script.py")
FREEZE = os.path.join(HERE, "freeze_script.py")


@pytest.mark.timeout(120)
def test_replies_no_worker_sends_are_dropped_and_one_goodbye_counts_per_rank():
    """An empty reply and a rank's second goodbye once killed the reply reader, or
    stopped it while other ranks still answered: every later call waited for good."""
    r = _run([disco_mpi.launcher(), "-n", "3", sys.executable, ROGUE, "garbage"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ROGUE GARBAGE DROPPED" in r.stdout, r.stdout + r.stderr


def _refused(tmp_path, mode: str) -> str:
    """What rank 0's call raised when rank 1 sent ``mode``'s reply (rogue_script.py)."""
    out = tmp_path / "raised.txt"
    r = _run([disco_mpi.launcher(), "-n", "3", sys.executable, ROGUE, mode, str(out)])
    assert out.exists(), r.stdout + r.stderr
    return out.read_text()


@pytest.mark.timeout(120)
def test_a_malformed_reply_head_ends_the_session_with_the_reason(tmp_path):
    raised = _refused(tmp_path, "bad-head")
    assert raised.startswith("ROGUE HEAD REFUSED") and "4294967295 buffers" in raised, raised


@pytest.mark.timeout(120)
def test_a_reply_whose_buffer_never_comes_ends_the_session_with_the_reason(tmp_path):
    """The reader waited for the announced buffer for good, and every rank's replies
    with it (an outside check)."""
    raised = _refused(tmp_path, "missing-buffer")
    assert "announced buffers that did not come within 1 s" in raised, raised


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_unresponsive_and_the_job_is_aborted_at_exit(tmp_path):
    """A rank stopped (SIGSTOP) while rank 0 waited for it hung the job for good: MPI
    ends a job only when a rank dies. Its heartbeats stop now: the call raises
    WorkerUnresponsiveError, the shutdown does not wait for it, and rank 0 ends the
    job with MPI_Abort when it exits, saying why; no process is left behind."""
    out = tmp_path / "raised.txt"
    r = _run(
        [disco_mpi.launcher(), "-n", "3", sys.executable, FREEZE, str(out)],
        DISCO_LIVENESS_TIMEOUT="2",
    )
    assert out.exists(), r.stdout + r.stderr
    raised, shutdown, pids = out.read_text().splitlines()
    assert raised.startswith("WorkerUnresponsiveError [1] after "), raised
    assert float(raised.split(" after ")[1].split()[0]) < 2 + 4, raised
    assert float(shutdown.split()[1]) < 2.0, shutdown
    assert r.returncode != 0
    assert "disco-mpi: aborting the MPI job" in r.stderr and "MPI rank(s) [1]" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr  # (no thread of rank 0's died)
    # (the launcher's SIGKILLs land as it returns)
    assert wait_gone([int(p) for p in pids.split()[1:]], 10.0) == [], "rank processes left behind"


@pytest.mark.timeout(120)
def test_a_rank_busy_at_the_shutdown_is_waited_for_not_aborted(tmp_path):
    """A rank still running a long function as the session shuts down keeps its
    heartbeat: the job waits for it and ends normally (only a silent rank aborts it)."""
    out = tmp_path / "busy.txt"
    r = _run(
        [disco_mpi.launcher(), "-n", "3", sys.executable, FREEZE, str(out), "busy"],
        DISCO_LIVENESS_TIMEOUT="2",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_text().startswith("busy"), r.stdout + r.stderr
    assert "aborting" not in r.stderr and "Traceback" not in r.stderr, r.stderr
