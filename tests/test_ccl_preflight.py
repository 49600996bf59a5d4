"""``CCL.preflight``: worker-side checks that run everywhere before a blocking initialisation."""

from __future__ import annotations

import threading
import time

import pytest

import disco_core as disco
from disco_core import plugins
from disco_core.ccl.base import CCL, Rendezvous
from disco_core.errors import CCLError

pytestmark = pytest.mark.timeout(60)


def _unused(self, *args):
    raise NotImplementedError("only initialisation is tested here")


class _JoinAllCCL(CCL):
    """Like NCCL's init: construction waits until every worker has joined."""

    allreduce = allgather = broadcast = scatter = gather = send = recv = barrier = _unused

    name = "join-all"
    preflights: list[int] = []
    barriers: dict[int, threading.Barrier] = {}  # payloads are pickled: keep it here

    @classmethod
    def rendezvous(cls, channel, device_ids, **options):
        key = len(cls.barriers)
        cls.barriers[key] = threading.Barrier(channel.num_workers, timeout=20)
        return Rendezvous(key)

    @classmethod
    def preflight(cls, ctx, payload, device_ids, **options):
        cls.preflights.append(ctx.worker_id)
        if ctx.worker_id in options.get("broken_on", ()):
            raise CCLError(f"worker {ctx.worker_id} lacks the library")

    def __init__(self, ctx, payload, device_ids=(), **options):
        super().__init__(ctx, payload, device_ids)
        self.barriers[payload].wait()  # a worker that failed here would leave the others waiting


class _PlainCCL(_JoinAllCCL):
    name = "plain"
    preflight = CCL.preflight  # the default: no extra round trip


class _Provides:
    @disco.hookimpl
    def disco_register_ccls(self):
        return {"join-all": _JoinAllCCL, "plain": _PlainCCL}


@pytest.fixture
def registered():
    name = plugins.register_plugin(_Provides(), "preflight-test")
    _JoinAllCCL.preflights = []
    yield
    plugins.unregister_plugin(name)


def test_a_failing_preflight_stops_init_before_anyone_waits(registered):
    with disco.ThreadedSession(4) as sess:
        t0 = time.monotonic()
        with pytest.raises(disco.WorkerError, match="worker 2 lacks the library"):
            sess.init_ccl("join-all", broken_on=(2,))
        assert time.monotonic() - t0 < 5, "the other workers waited in the initialisation"
        assert sorted(_JoinAllCCL.preflights) == [0, 1, 2, 3]
        sess.init_ccl("shm")  # nothing was left half-made
        x = sess.broadcast(__import__("numpy").ones(2, "float32"))
        assert x.debug_get_from_remote(3).tolist() == [1.0, 1.0]


def test_preflight_passes_then_every_worker_initialises(registered):
    with disco.ThreadedSession(3) as sess:
        sess.init_ccl("join-all")
        assert sorted(_JoinAllCCL.preflights) == [0, 1, 2]


def test_a_ccl_without_preflight_skips_the_extra_step(registered):
    with disco.ThreadedSession(2) as sess:
        sess.init_ccl("plain")
        assert _JoinAllCCL.preflights == []
