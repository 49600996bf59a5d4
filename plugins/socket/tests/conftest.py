"""Fixtures of disco-socket's tests: sessions whose nodes are agent processes on loopback."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _socket_helpers import Cluster, layout

import disco_core as disco
from disco_core.testing.leftovers import (  # noqa: F401  (hooks: a run's own TMPDIR; leftovers fail it)
    pytest_configure,
    pytest_sessionfinish,
    pytest_unconfigure,
)


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


@pytest.fixture
def make_socket_session(cluster) -> Callable[..., disco.Session]:
    def make(num_workers: int, num_groups: int = 1, per_node: int = 2) -> disco.Session:
        nodes, per = layout(num_workers, per_node)
        return cluster.session(nodes, per, num_groups)

    return make
