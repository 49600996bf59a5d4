"""The chaos suite: random SIGKILL/SIGSTOP of workers, agents and the controller during
collectives and copies; raising and hanging worker functions.

Each scenario runs ``--chaos-iterations`` iterations (3 by default, 200 with ``--long``);
the scenarios, their assertions and the leak checks are in ``chaos_harness.py``. A
failure prints its seed: replay with ``--chaos-seed SEED -k SCENARIO``.
"""

from __future__ import annotations

import importlib.util

import pytest
from chaos_harness import SCENARIOS, run_scenario

HAS_SOCKET = importlib.util.find_spec("disco_socket") is not None


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_chaos(scenario, chaos_seed, chaos_iterations_count):
    if scenario.startswith("socket") and not HAS_SOCKET:
        pytest.skip("disco-socket is not installed")
    stats = run_scenario(scenario, chaos_iterations_count, chaos_seed)
    replay = f"replay: pytest tests/chaos -k {scenario} --chaos-seed {chaos_seed}"
    assert stats.ok, (
        f"{scenario}: {len(stats.failures)} failure(s), {stats.hangs} hang(s), "
        f"{stats.orphans} orphan(s), {stats.leaks} leak(s) in {stats.iterations} iteration(s); "
        f"{replay}\n" + "\n".join(stats.failures)
    )
