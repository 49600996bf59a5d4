"""The suites' leftover watch (``disco_core.testing.leftovers``) fails a run that leaves
the runtime's temporary files behind, and only for those."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CONFTEST = "from disco_core.testing.leftovers import pytest_configure, pytest_sessionfinish, pytest_unconfigure  # noqa: F401\n"  # fmt: skip


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_it.py").write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.timeout(90)
def test_a_run_that_leaves_a_folder_of_the_runtime_fails_and_names_it(tmp_path):
    r = _run(
        tmp_path,
        """
        import os, subprocess, sys, tempfile
        def test_leaves():
            own = tempfile.gettempdir()
            assert os.path.basename(own).startswith("disco-tests-")  # the run's own
            tempfile.mkdtemp(prefix="disco-rpc-session-")
            open(os.path.join(own, "disco-trace-example.json"), "w").close()  # a user's
            # a child process's too: it inherits the run's TMPDIR
            code = "import tempfile; tempfile.mkdtemp(prefix='disco-socket-node1-')"
            subprocess.run([sys.executable, "-c", code], check=True)
        """,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "left behind by this run (2)" in r.stdout
    left = [line.strip() for line in r.stdout.splitlines() if line.startswith("  /")]
    assert sorted(os.path.basename(p).rsplit("-", 1)[0] for p in left) == [
        "disco-rpc-session", "disco-socket-node1",
    ]  # fmt: skip
    assert not any(os.path.exists(p) for p in left)  # (the run's folder went with them)


@pytest.mark.timeout(90)
def test_a_run_that_cleans_up_passes(tmp_path):
    r = _run(
        tmp_path,
        """
        import shutil, tempfile
        def test_cleans():
            shutil.rmtree(tempfile.mkdtemp(prefix="disco-mpi-"))
        """,
    )
    assert r.returncode == 0 and "left behind" not in r.stdout, r.stdout + r.stderr


def test_a_left_folder_with_an_owner_lock_says_who_holds_it(tmp_path):
    """A flaky leftover of the rpc suite (a server's scratch folder) said nothing of
    why no later server had removed it: the report now says whether its owner lock is
    free (its owners died) or held, and by which processes."""
    import fcntl

    from disco_core.testing import leftovers

    folder = tmp_path / "disco-rpc-server-x"
    folder.mkdir()
    assert leftovers._who_holds(str(folder)) == ""  # no lock file: nothing to say
    lock = folder / ".disco-owner.lock"
    lock.write_text("")
    assert "its lock is free" in leftovers._who_holds(str(folder))
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert f"its lock is held by: pid {os.getpid()} " in leftovers._who_holds(str(folder))
    finally:
        os.close(fd)
