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


@pytest.mark.timeout(60)
def test_a_reply_the_controller_cannot_hold_ends_the_link_not_the_reader(monkeypatch):
    """The reply reader stopped by anything (here a MemoryError for a reply's declared
    buffer, which a network peer can make up to 1 TiB) ends that worker's link and the
    waiting call gets a WorkerDiedError. Before, only EOFError, OSError and ValueError did:
    the one reader thread of every link died and every later call waited for good
    (outside check, F1; the rpc channel's replies use the same reader)."""
    import time

    import numpy as np

    from disco_core.net import framing

    real = framing.unfilled_bytearray

    def alloc(n):
        if n >= 1 << 20:
            raise MemoryError(f"cannot allocate {n} bytes")
        return real(n)

    monkeypatch.setattr(framing, "unfilled_bytearray", alloc)
    with disco.ProcessSession(2) as sess:
        sess.import_python_module("disco_core.testing.funcs")
        ref = sess.get_global_func("testing.echo")(np.ones(1 << 18))  # 2 MiB on each worker
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerDiedError, match="worker 1"):
            ref.debug_get_from_remote(1)
        assert time.monotonic() - t0 < 5
