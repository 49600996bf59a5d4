"""The channel conformance kit run against the core's threaded and process channels."""

from __future__ import annotations

import pytest

import disco_core as disco
from disco_core.testing import ChannelContract


class TestThreadedChannel(ChannelContract):
    workers_are_processes = False

    @pytest.fixture
    def make_session(self):
        return lambda num_workers, num_groups=1: disco.ThreadedSession(num_workers, num_groups)


class TestProcessChannel(ChannelContract):
    workers_are_processes = True

    @pytest.fixture
    def make_session(self):
        return lambda num_workers, num_groups=1: disco.ProcessSession(num_workers, num_groups)
