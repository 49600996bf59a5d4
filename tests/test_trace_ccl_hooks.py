"""The recording operations a trace puts on a worker's CCL instance (``ccl_hooks``).

They replace, while a trace runs, the class's recording wrapper (``ccl.base``),
which packs and unpacks every call's arguments: they must write the very records
that wrapper writes, for every operation and every way of calling it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pytest

import disco_core as disco
from disco_core.ccl.base import CCL, WAITING_OPS
from disco_core.tracing import ccl_hooks
from disco_core.tracing.recorder import Recorder
from disco_core.worker import WorkerContext

pytestmark = pytest.mark.timeout(120)


class Ops(CCL):
    """Operations that do nothing but log their calls (one fails on request)."""

    name = "ops"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.log: list[tuple] = []

    def allreduce(self, src, dst, op, in_group):
        if op == "fail":
            raise ValueError("asked to fail")
        self.log.append(("allreduce", op, in_group))

    def allgather(self, src, dst, in_group):
        self.log.append(("allgather", in_group))

    def broadcast(self, src, dst, in_group):
        self.log.append(("broadcast", in_group))

    def scatter(self, src, dst, in_group):
        self.log.append(("scatter", in_group))

    def gather(self, src, dst, in_group):
        self.log.append(("gather", in_group))

    def send(self, buf, peer):
        self.log.append(("send", peer))

    def recv(self, buf, peer):
        self.log.append(("recv", peer))

    def barrier(self, in_group=False):
        self.log.append(("barrier", in_group))


def _program(ccl: Ops) -> None:
    a, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    c = np.ones(3, np.int64)
    for _ in range(2):  # the second time from the caches
        ccl.allreduce(a, b, "sum", False)
        ccl.allreduce(src=c, dst=c, op="max", in_group=True)
        ccl.allgather(a, b, False)
        ccl.gather(a, None, in_group=True)
        ccl.broadcast(None, b, False)
        ccl.scatter(src=None, dst=c, in_group=False)
        ccl.send(a, 1)
        ccl.recv(buf=c, peer=0)
        ccl.barrier()
        ccl.barrier(True)
        ccl.allreduce([1, 2], b, "sum", False)  # no dtype: the slow way, still recorded
    with pytest.raises(ValueError, match="asked to fail"):
        ccl.allreduce(a, b, "fail", False)


def _records(hooks: bool) -> tuple[list, list, list]:
    handed: list[int] = []
    ctx = WorkerContext(worker_id=1, num_workers=4, num_groups=2)
    ctx.hand_over = lambda: handed.append(1)
    ccl = Ops(ctx)
    rec = Recorder(1024)
    ctx.tracer = rec
    names = ccl_hooks.install(ccl, rec) if hooks else []
    assert names == (list(WAITING_OPS) if hooks else [])
    _program(ccl)
    ccl_hooks.uninstall(ccl, names)
    assert not set(vars(ccl)) & set(WAITING_OPS)  # the class's own again
    out = rec.export()
    rows = [(out["names"][r[1]], r[4], r[5], out["names"][r[7]]) for r in out["events"].tolist()]
    return rows, ccl.log, handed


def test_the_hooks_write_what_the_class_wrapper_writes():
    hooked, log, handed = _records(hooks=True)
    plain, plain_log, plain_handed = _records(hooks=False)
    assert hooked == plain
    assert log == plain_log and len(log) == 22
    assert len(handed) == len(plain_handed) == 23  # every call hands over first, the failed one too
    got = set(hooked)
    assert ("allreduce", 0, 32, "float32|sum|world|0|-1") in got
    assert ("allreduce", 0, 24, "int64|max|group|0|-1") in got  # in_group: its own counter
    assert ("scatter", 3, 24, "int64||world|0|-1") in got  # sized by dst
    assert ("send", 0, 32, "float32||p2p|0|1") in got  # counted per peer
    assert ("barrier", 4, 0, "||world|0|-1") in got and ("barrier", 2, 0, "||group|0|-1") in got
    assert hooked[-1][0] == "allreduce"  # the failed call is recorded too
    world = [r[1] for r in hooked if r[3].endswith("|world|0|-1")]
    assert world == list(range(len(world)))  # one counter for the world, whatever the call


class ExtraParameter(Ops):
    def allreduce(self, src, dst, op, in_group, stream=None):  # not the base's parameters
        self.log.append(("allreduce", op, in_group, stream))


def test_an_operation_with_other_parameters_keeps_the_class_wrapper():
    ctx = WorkerContext(worker_id=0, num_workers=2, num_groups=1)
    ccl = ExtraParameter(ctx)
    rec = Recorder(1024)
    ctx.tracer = rec
    names = ccl_hooks.install(ccl, rec)
    assert "allreduce" not in names and "barrier" in names
    a = np.ones(4, np.float32)
    ccl.allreduce(a, a, "sum", False, stream=7)  # through the class wrapper: recorded
    ccl.barrier()
    out = rec.export()
    assert [out["names"][r[1]] for r in out["events"].tolist()] == ["allreduce", "barrier"]
    assert ccl.log[0] == ("allreduce", "sum", False, 7)


def test_a_trace_takes_its_hooks_off_the_ccl_when_it_stops():
    sess = disco.ProcessSession(2)
    try:
        sess.init_ccl("shm")
        ccl = sess._channel.links[0].worker.ctx.ccl
        x = sess.empty((4,), "float32")
        path = os.path.join(tempfile.mkdtemp(), "t.json")
        with disco.trace(sess, path):
            assert set(WAITING_OPS) <= set(vars(ccl))
            sess.allreduce(x, x)
        assert not set(vars(ccl)) & set(WAITING_OPS)
        sess.allreduce(x, x)
        sess._sync_all()
    finally:
        sess.shutdown()


def test_a_ccl_made_during_a_trace_gets_the_hooks_too():
    """DISCO_TRACE, trace= and the demo's --trace start before init_ccl: the CCL made
    then is recorded through the hooks as well, and left without them at the stop."""
    sess = disco.ProcessSession(2)
    try:
        path = os.path.join(tempfile.mkdtemp(), "t.json")
        with disco.trace(sess, path):
            sess.init_ccl("shm")
            ccl = sess._channel.links[0].worker.ctx.ccl
            assert set(WAITING_OPS) <= set(vars(ccl))
            x = sess.empty((4,), "float32")
            sess.allreduce(x, x)
        assert not set(vars(ccl)) & set(WAITING_OPS)
    finally:
        sess.shutdown()
