"""The chaos suite's fixtures: its environment, the iteration count, the seed, timeouts.

The resource snapshots, the watchdog and the scenarios are in ``chaos_harness.py``
(shared with ``bench/chaos.py``). Options (``--chaos-iterations N``, ``--long``,
``--chaos-seed S``) are declared in ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chaos_harness  # noqa: E402

CI_ITERATIONS = 3
LONG_ITERATIONS = 200


def chaos_iterations(config) -> int:
    n = config.getoption("--chaos-iterations", default=None)
    if n is not None:
        return max(1, n)
    return LONG_ITERATIONS if config.getoption("--long", default=False) else CI_ITERATIONS


def pytest_collection_modifyitems(config, items):
    # pytest-timeout on every chaos test, scaled to its iterations; the harness's own
    # per-iteration watchdog fires long before (with every thread's stack).
    n = chaos_iterations(config)
    for item in items:
        name = item.callspec.params.get("scenario") if hasattr(item, "callspec") else None
        if name in chaos_harness.SCENARIOS and item.get_closest_marker("timeout") is None:
            deadline = chaos_harness.SCENARIOS[name][1]
            item.add_marker(pytest.mark.timeout(int(60 + n * (deadline + 15))))


@pytest.fixture(scope="session")
def chaos_seed(request) -> int:
    seed = request.config.getoption("--chaos-seed", default=None)
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    return seed


@pytest.fixture(scope="session")
def chaos_iterations_count(request) -> int:
    return chaos_iterations(request.config)


@pytest.fixture(autouse=True)
def chaos_env():
    """Small liveness, gather, heartbeat and shutdown timeouts, for the sessions the test starts."""
    old = chaos_harness.set_env()
    yield
    chaos_harness.restore_env(old)
