"""Tracing a socket session (agents on loopback): the core's traced-session checks.

Workers on two nodes need a CCL that crosses machines: MPI (disco-mpi), when installed.
"""

from __future__ import annotations

import pytest

from disco_core.testing import trace_checks

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _needs_mpi():
    pytest.importorskip("disco_mpi", reason="the mpi CCL plugin (disco-mpi) is not installed")


@pytest.mark.parametrize("token", [None, "trace-token"], ids=["plain", "sealed"])
def test_a_traced_socket_session_records_every_worker_and_names_the_straggler(
    cluster, tmp_path, token
):
    """4 workers on 2 nodes (the controller's and one agent), MPI between them."""
    sess = cluster.session(2, 2, token=token)
    sess.init_ccl("mpi")
    path = tmp_path / "socket.json"
    trace_checks.traced_demo(sess, path, late_worker=3, late_s=0.2)
    data = trace_checks.check_trace(path, 4)
    assert data["otherData"]["session"]["channel"] == "socket"
    trace_checks.check_straggler(path, 3, 0.2)


def test_remote_clock_offsets_are_measured_when_the_kernel_clock_is_not_shared(
    cluster, tmp_path, monkeypatch
):
    """As for agents on other machines: offsets from round trips, within their precision."""
    from disco_core.tracing import session_trace

    monkeypatch.setattr(session_trace, "clock_identity", lambda: "another machine")
    sess = cluster.session(2, 2)
    sess.init_ccl("mpi")
    path = tmp_path / "remote.json"
    trace_checks.traced_demo(sess, path)
    data = trace_checks.check_trace(path, 4)
    clock = data["otherData"]["clock"]
    for offset, precision in zip(clock["offset_us"], clock["precision_us"]):
        assert precision > 0
        assert abs(offset) <= precision + 1.0  # one machine: the truth is 0
