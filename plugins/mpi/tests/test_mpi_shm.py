"""``init_ccl("mpi")`` leaves nothing in /dev/shm.

MPICH creates a segment ``/dev/shm/mpich_shm_<world id>_<node id>`` (about 1 MiB) in
``MPI_Init`` and removes it only in ``MPI_Finalize``, which a Disco controller and
its workers never reach; the plugin removes the name right after ``MPI_Init``
(``disco_mpi._runtime.release_shm``). Each scenario runs in a child process:

* where this machine allows it (``unshare``: root, or unprivileged user namespaces),
  in a mount namespace of its own with a fresh tmpfs on /dev/shm, so the check is
  "/dev/shm is empty afterwards", whatever else runs on the machine;
* in every case, the controller and the workers report the /dev/shm files they map:
  each must already be unlinked ("PATH (deleted)") while the session runs, and none
  of those names may exist afterwards (a shared /dev/shm cannot be checked for "no
  new file at all": other programs on the machine may create files meanwhile).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

import disco_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "shm_script.py")
WRAP = (
    'mount -t tmpfs -o size=512m,mode=1777 disco-test-shm /dev/shm || exit 97; "$@"; rc=$?; '
    'printf "SHM-LEFT:"; ls -A /dev/shm | tr "\\n" " "; echo; exit $rc'
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm, /proc")


@functools.lru_cache(maxsize=1)
def _unshare() -> list[str] | None:
    """The ``unshare`` prefix that gives a private /dev/shm here, or None."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for args in (["-m", "--propagation", "private"], ["-Urm", "--propagation", "private"]):
        if args[0] == "-m" and os.geteuid() != 0:
            continue
        cmd = [exe, *args, "--", "sh", "-c", WRAP, "sh", "true"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and "SHM-LEFT:\n" in r.stdout:
            return [exe, *args]
    return None


def _run(argv: list[str]) -> tuple[str, set[str] | None]:
    """Run ``argv`` (isolated when possible); its output, and what it left in /dev/shm."""
    prefix = _unshare()
    if prefix is not None:
        argv = [*prefix, "--", "sh", "-c", WRAP, "sh", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    left = None
    if prefix is not None:
        line = next(x for x in r.stdout.splitlines() if x.startswith("SHM-LEFT:"))
        left = set(line[len("SHM-LEFT:") :].split())
    return out, left


def _scenario(mode: str) -> None:
    before = set(os.listdir("/dev/shm"))
    out, left = _run([sys.executable, SCRIPT, mode])
    line = next(x for x in out.splitlines() if x.startswith("MAPPED "))
    mapped = json.loads(line[len("MAPPED ") :])
    ours = [m for m in mapped if "/mpich_" in m]
    assert ours, f"no MPICH segment was seen: {mapped}"  # else the test proves nothing
    linked = [m for m in mapped if not m.endswith(" (deleted)")]
    assert not linked, f"segments still linked while the session ran: {linked}"
    names = {os.path.basename(m.removesuffix(" (deleted)")) for m in mapped}
    if left is not None:
        assert not left, f"left in the session's private /dev/shm: {sorted(left)}"
    else:
        after = set(os.listdir("/dev/shm"))
        assert not (names & (after - before)), sorted(names & (after - before))


@pytest.mark.timeout(180)
def test_process_session_leaves_nothing():
    _scenario("process")


@pytest.mark.timeout(240)
def test_sessions_in_a_row_leave_nothing():
    _scenario("loop")


@pytest.mark.timeout(180)
def test_sigkilled_worker_leaves_nothing():
    _scenario("killed")


@pytest.mark.timeout(180)
def test_socket_session_leaves_nothing():
    pytest.importorskip("disco_socket")
    _scenario("socket")


@pytest.mark.timeout(180)
def test_mpi_channel_leaves_nothing():
    if _unshare() is None:
        pytest.skip("needs a private /dev/shm (unshare) to attribute the files")
    exe = disco_mpi.launcher()
    assert exe
    out, left = _run([exe, "-n", "3", sys.executable, os.path.join(HERE, "channel_script.py")])
    assert "MPI CHANNEL OK 3" in out
    assert not left, sorted(left)
