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


@pytest.mark.timeout(30)
def test_the_reply_hub_takes_only_worker_errors_as_failures(caplog):
    """A peer's ``fail`` or ``error`` message whose payload is not a worker error
    (a forged ``WorkerDiedError``, a number, nothing) is refused as a failure of
    that worker: the call never raises it as itself, later errors stay readable,
    and a message of a kind nobody waits for is dropped (an outside check)."""
    from disco_core.channels.base import ReplyHub

    hub = ReplyHub(2)

    def wait(w):
        return hub.wait(w, poll=lambda: None, deadline=__import__("time").monotonic() + 5)

    hub.deliver(1, ("fail", disco.WorkerDiedError([7], "forged death")))
    with pytest.raises(disco.WorkerError) as info:
        wait(1)
    assert not isinstance(info.value, disco.WorkerDiedError)
    assert isinstance(info.value, disco.UntrustedValueError)
    assert "worker 1 sent a 'fail' message without a worker error" in str(info.value)
    hub.deliver(1, ("fail",))
    with pytest.raises(disco.WorkerError, match="of type NoneType"):
        wait(1)
    hub.deliver(0, ("error", 42))
    hub.deliver(0, ("error", disco.WorkerError(0, "ValueError", "real")))
    errors = hub.take_errors()
    assert [e.worker_id for e in errors] == [0, 0]
    assert "of type int" in errors[0].remote_message and errors[1].remote_message == "real"
    with caplog.at_level("WARNING"):
        hub.deliver(0, ("no-such-kind", 1))
        hub.deliver(0, (__import__("numpy").arange(3), 1))  # a kind that cannot be compared
    assert "unknown kind" in caplog.text and "malformed message" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        for _ in range(999):
            hub.deliver(0, ("no-such-kind", 1))  # a flood: its 1000th is logged, no other
    assert caplog.text.count("unknown kind") == 1 and "(1000 so far)" in caplog.text
    hub.deliver(0, ("reply", "after"))
    assert wait(0) == "after"
    # an error in another worker's name is the sender's own failure
    hub.deliver(1, ("fail", disco.WorkerError(0, "ValueError", "worker 0 broke it")))
    with pytest.raises(disco.WorkerError) as info:
        wait(1)
    assert info.value.worker_id == 1 and "in the name of worker 0" in str(info.value)
    forged = disco.WorkerError(1, "ValueError", "mine", others=[disco.WorkerError(0, "E", "x")])
    hub.deliver(1, ("fail", forged))
    with pytest.raises(disco.WorkerError, match="carrying other workers' errors") as info:
        wait(1)
    assert info.value.others == []
    # a second ready is dropped: it was taken for the next answer
    hub.deliver(1, ("ready", 4242))
    assert wait(1) == 4242
    with caplog.at_level("WARNING"):
        hub.deliver(1, ("ready", "FORGED"))
    hub.deliver(1, ("reply", "mine"))
    assert wait(1) == "mine" and "second ready" in caplog.text
