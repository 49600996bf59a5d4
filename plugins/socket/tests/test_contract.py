"""The core's channel conformance kit run against the socket channel.

Every kit session is a real multi-node session on loopback: node agents run as
separate processes (``python -m disco_socket join ...``). The kit's sessions have
2, 3 or 4 workers; they are laid out as 2 workers per node where the count allows
(4 workers: 2 nodes x 2) and as one worker per node otherwise (3 workers: 3 nodes).
"""

from __future__ import annotations

import pytest

from disco_core.testing import ChannelContract


class TestSocketChannelContract(ChannelContract):
    workers_are_processes = True
    death_timeout = 3.0

    @pytest.fixture
    def make_session(self, make_socket_session):
        return make_socket_session
