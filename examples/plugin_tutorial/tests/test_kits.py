"""The conformance kits, run against the tutorial's plugin (installed: pip install -e .)."""

from __future__ import annotations

import logging

import pytest

import disco_core as disco
from disco_core.testing import CCLContract, ChannelContract, session_maker


class TestThreadCCL(CCLContract):
    num_workers = 4  # every divisor (1, 2, 4) is also tested as a group count
    buffered_send_bytes = 1 << 20  # a send never waits for its receive (any size)
    buffered_sends = 8
    timeout_options = {"timeout": 1}  # for the kit's timeout tests

    @pytest.fixture
    def make_session(self):
        return session_maker(disco.ThreadedSession, "threads")


class TestTraceChannel(ChannelContract):
    workers_are_processes = False  # its inner channel is "threaded"

    @pytest.fixture
    def make_session(self):
        def make(num_workers, num_groups=1):
            return disco.Session.create("trace", num_workers=num_workers, num_groups=num_groups)

        return make


@pytest.mark.timeout(30)
def test_trace_logs_commands(caplog):
    with caplog.at_level(logging.DEBUG, logger="disco_tutorial.trace"):
        with disco.Session.create("trace", num_workers=2) as sess:
            sess.empty((4,), "float32").debug_get_from_remote(1)
    assert "call_packed" in caplog.text and "debug_get_from_remote" in caplog.text


@pytest.mark.timeout(30)
def test_threads_ccl_refuses_worker_processes():
    with disco.ProcessSession(2) as sess:
        with pytest.raises(disco.WorkerError, match="threads of the controller's process"):
            sess.init_ccl("threads")
