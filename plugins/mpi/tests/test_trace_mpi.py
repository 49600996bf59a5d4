"""Tracing a session whose CCL is MPI: the core's traced-session checks, on real MPI."""

from __future__ import annotations

import pytest

import disco_core as disco
from disco_core.testing import trace_checks

pytestmark = pytest.mark.timeout(120)


def test_a_traced_mpi_session_records_every_worker_and_names_the_straggler(tmp_path):
    path = tmp_path / "mpi.json"
    with disco.ProcessSession(4) as sess:
        sess.init_ccl("mpi")
        # 0.5 s: on a loaded 2-CPU machine (a suite run beside two chaos runs) the other
        # workers' scheduling delays summed to 0.29 s over 14 collectives, more than 0.2
        trace_checks.traced_demo(sess, path, late_worker=1, late_s=0.5)
    data = trace_checks.check_trace(path, 4)
    collectives = [
        e for e in data["traceEvents"] if e.get("cat") == "collective" and e["ph"] == "X"
    ]
    assert {e["name"] for e in collectives} >= {"allreduce", "broadcast", "scatter"}
    trace_checks.check_straggler(path, 1, 0.5)
