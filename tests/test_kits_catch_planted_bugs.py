"""The conformance kits catch the mistakes plugin authors make, within seconds.

Each case runs a few of the kit's own tests, in a fresh pytest process, against a
CCL or channel with one planted bug (``tests/planted/planted_plugin.py``), and
asserts that they fail, saying what is wrong, well before the kit's own 60 s
per-case timeout. The same selection run against the real ``shm`` CCL (or
``process`` channel) passes: the failures are the bugs', not the selection's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CCL_TEST = """
import pytest
import disco_core as disco
from disco_core.testing import CCLContract, session_maker


class TestPlanted(CCLContract):
    num_workers = {num_workers}
    workers_are_processes = {processes}
    timeout_options = {{"timeout": 1}}

    @pytest.fixture
    def make_session(self):
        return session_maker(disco.{session}, {ccl!r})
"""

_CHANNEL_TEST = """
import pytest
import disco_core as disco
from disco_core.testing import ChannelContract


class TestPlanted(ChannelContract):
    workers_are_processes = True

    @pytest.fixture
    def make_session(self):
        return lambda n, g=1: disco.Session.create({channel!r}, num_workers=n, num_groups=g)
"""

#: (bug, CCL or channel, session class, kit tests (-k), what the failure must say, bound s)
PLANTED = [
    ("avg as x*(1/n)", "planted.avg_by_reciprocal", "ThreadedSession",
     "test_odd_worker_count_allreduce and float32", "avg", 20),
    ("never notices a dead peer", "planted.ignores_abort", "ProcessSession",
     "test_worker_death_during_collective and barrier", "still waiting", 25),
    ("close leaks connections and threads", "planted.leaks_connections", "ThreadedSession",
     "test_nothing_left_across_sessions", "threads left running", 25),
    ("gather overwrites non-root dst", "planted.gather_writes_everywhere", "ThreadedSession",
     "test_data_movement and gather and float32", "not the root", 20),
    ("waits instead of refusing a wrong call", "planted.waits_instead_of_refusing",
     "ThreadedSession", "test_mismatched_buffers and allreduce and shape",
     "instead of refusing", 25),
    ("constructor join ignores the abort", "planted.join_ignores_abort", "ProcessSession",
     "test_constructor_fails_on_one_worker and last", "still waiting", 25),
]  # fmt: skip


def _run_kit(tmp_path, source: str, select: str) -> tuple[subprocess.CompletedProcess, float]:
    path = tmp_path / "test_planted_kit.py"
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ)
    env["DISCO_PLUGINS"] = "planted_plugin"
    env["TMPDIR"] = str(tmp_path)  # the planted join's files: gone with tmp_path
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(HERE, "planted"), env.get("PYTHONPATH", "")) if p
    )
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", str(path), "-q", "-x", "-p", "no:cacheprovider",
         "-W", "ignore::UserWarning", "-k", select],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    return r, time.monotonic() - t0


def _ccl_source(ccl: str, session: str) -> str:
    processes = session == "ProcessSession"
    return _CCL_TEST.format(num_workers=4, processes=processes, session=session, ccl=ccl)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("bug", "ccl", "session", "select", "says", "bound"), PLANTED, ids=[p[0] for p in PLANTED]
)
def test_the_ccl_kit_catches(tmp_path, bug, ccl, session, select, says, bound):
    r, took = _run_kit(tmp_path, _ccl_source(ccl, session), select)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and " failed" in r.stdout, (
        f"the kit let {bug!r} through:\n{out[-3000:]}"
    )
    assert says in out, f"the kit failed {bug!r} without saying {says!r}:\n{out[-3000:]}"
    assert took < bound, f"the kit took {took:.0f} s to catch {bug!r}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("session", "select"),
    sorted({(p[2], p[3]) for p in PLANTED}),
)
def test_the_same_cases_pass_on_shm(tmp_path, session, select):
    r, _ = _run_kit(tmp_path, _ccl_source("shm", session), select)
    assert r.returncode == 0 and " passed" in r.stdout, (r.stdout + r.stderr)[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("channel", "fails"), [("planted.nameless", True), ("process", False)])
def test_the_channel_kit_checks_what_a_channel_says_it_is(tmp_path, channel, fails):
    r, took = _run_kit(tmp_path, _CHANNEL_TEST.format(channel=channel), "test_channel_facts")
    out = r.stdout + r.stderr
    if fails:
        assert r.returncode == 1 and "set Channel.kind" in out, out[-3000:]
        assert took < 20
    else:
        assert r.returncode == 0 and " passed" in r.stdout, out[-3000:]


def test_the_ccl_kit_judges_files_in_dev_shm_not_folders_others_make_there():
    """A segment left in /dev/shm is a leak; a folder another program made there while
    the kit ran is not (a tester's folder there failed two suites of a fresh clone)."""
    import tempfile

    from disco_core.testing import ccl_kit

    before = ccl_kit._resources()
    folder = tempfile.mkdtemp(dir="/dev/shm", prefix="disco-kit-test-")
    fd, segment = tempfile.mkstemp(dir="/dev/shm", prefix="disco-kit-test-")
    os.close(fd)
    try:
        leaks = " ".join(ccl_kit._leaks(before, fds=False))
        assert os.path.basename(segment) in leaks
        assert os.path.basename(folder) not in leaks
    finally:
        os.unlink(segment)
        os.rmdir(folder)
