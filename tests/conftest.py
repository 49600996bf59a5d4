"""Shared fixtures of the core's tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import disco_core  # noqa: F401  (the built-ins are registered before any test runs)
from disco_core.testing import procfs
from disco_core.testing.leftovers import (  # noqa: F401  (hooks: a run's own TMPDIR; leftovers fail it)
    pytest_configure,
    pytest_sessionfinish,
    pytest_unconfigure,
)
from disco_core.testing.procfs import children_of

#: the core's own process probes (tests and the chaos harness use them by these names)
pid_gone = procfs.gone
wait_gone = procfs.wait_gone


def run_python(
    code: str, env: dict | None = None, timeout: float = 60, **kw
) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with the test interpreter; capture its output."""
    full_env = dict(os.environ)
    full_env.pop("DISCO_PLUGINS", None)
    full_env.pop("DISCO_DISABLE_PLUGIN_AUTOLOAD", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@pytest.fixture
def no_leftover_children():
    """Fail a test that leaves a child process of this one running."""
    before = children_of(os.getpid())
    yield
    deadline = time.monotonic() + 5
    extra = children_of(os.getpid()) - before
    while extra and time.monotonic() < deadline:
        time.sleep(0.05)
        extra = children_of(os.getpid()) - before
    assert not extra, f"child processes left behind: {sorted(extra)}"


@pytest.fixture
def python_run():
    """``python_run(code, env=None, timeout=60)``: run code in a fresh interpreter."""
    return run_python


@pytest.fixture
def procs():
    """Process helpers: ``procs.pid_gone``, ``procs.wait_gone``, ``procs.children_of``."""
    import types

    return types.SimpleNamespace(pid_gone=pid_gone, wait_gone=wait_gone, children_of=children_of)


# ---------------------------------------------------------------- the chaos suite (tests/chaos)
# Options live here, not in tests/chaos/conftest.py: pytest only takes options from the
# conftest files it loads at start-up, and `bash scripts/test.sh` starts from the root.
CHAOS_CI_ITERATIONS = 3
CHAOS_LONG_ITERATIONS = 200


def pytest_addoption(parser):
    group = parser.getgroup("chaos", "the chaos suite (tests/chaos)")
    group.addoption(
        "--chaos-iterations",
        type=int,
        default=None,
        help=f"iterations of each chaos scenario, the first a warm-up (default {CHAOS_CI_ITERATIONS})",
    )
    group.addoption(
        "--long",
        action="store_true",
        default=False,
        help=f"the chaos suite's long mode: {CHAOS_LONG_ITERATIONS} iterations of each scenario",
    )
    group.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help="seed of the chaos suite's random choices (default: random, printed)",
    )
