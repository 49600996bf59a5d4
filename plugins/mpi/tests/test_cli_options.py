"""``disco-mpi``: --version, -v/--log-level, help with defaults, a missing launcher (issue 17)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from disco_core.testing.commands import assert_documented
from disco_mpi import cli


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "disco_mpi.cli", *args], capture_output=True, text=True, timeout=30
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("--version",), ("run", "--version"), ("info", "--version")])
def test_version(args):
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"disco-mpi {version('disco-mpi')}"


def test_every_option_has_help_and_the_common_ones():
    assert_documented(cli.build_parser())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("launcher", "why"),
    [
        ("/missing/mpiexec", "no such file"),
        ("no-such-mpiexec-here", "not found on PATH"),
        ("/", "not an executable file"),
    ],
)
def test_missing_launcher_is_one_line(tmp_path, launcher, why):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    r = _run("run", "-n", "2", "--launcher", launcher, str(script))
    assert r.returncode == 2
    assert r.stderr == f"disco-mpi: --launcher {launcher!r}: {why}\n"
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.timeout(60)
def test_a_missing_script_is_one_line(tmp_path):
    # (mpiexec ran it: every rank's Python said "can't open file", once per rank)
    missing = str(tmp_path / "nosuch.py")
    r = _run("run", "-n", "2", missing)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"disco-mpi: no such script: {missing!r}\n"


@pytest.mark.timeout(60)
def test_common_options_before_and_after_run(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    r = _run("-v", "run", "-n", "2", "--launcher", sys.executable, "--dry-run", str(script))
    assert r.returncode == 0 and r.stdout.startswith(sys.executable)
    r = _run("run", "-n", "1", "--log-level", "loud", str(script))
    assert r.returncode == 2 and "unknown log level 'loud'" in r.stderr


@pytest.mark.timeout(60)
def test_run_usage_errors_name_run_and_only_what_is_missing():
    """``run -n 2`` said "script, args" were required (args are optional), and ``-n 0``
    came with the top-level usage (an outside check)."""
    r = _run("run", "-n", "2")
    assert r.returncode == 2 and "required: script\n" in r.stderr, r.stderr
    assert r.stderr.startswith("usage: disco-mpi run")
    r = _run("run", "-n", "0", "x.py")
    assert r.returncode == 2 and r.stderr.startswith("usage: disco-mpi run"), r.stderr
    r = _run("run", "-n", "2", "--dry-run", "x.py", "a", "--b")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("x.py a --b"), r
