"""The suites' leftover watch (``disco_core.testing.leftovers``) fails a run that leaves
the runtime's temporary files behind, and only for those."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

CONFTEST = "from disco_core.testing.leftovers import pytest_sessionfinish, pytest_sessionstart  # noqa: F401\n"  # fmt: skip


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
        import tempfile
        def test_leaves():
            tempfile.mkdtemp(prefix="disco-rpc-session-")
            open(tempfile.gettempdir() + "/disco-trace-example.json", "w").close()  # a user's
        """,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "left behind by this run (1)" in r.stdout
    left = [line.strip() for line in r.stdout.splitlines() if "disco-rpc-session-" in line]
    assert len(left) == 1
    shutil.rmtree(left[0])
    os.unlink(os.path.join(os.path.dirname(left[0]), "disco-trace-example.json"))


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
