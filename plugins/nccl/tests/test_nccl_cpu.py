"""disco-nccl without a GPU: registration, the clear error, and the GPU-free logic.

Some tests below hand the CCL a stand-in for CuPy's NCCL module (``FakeNccl``): they
check the rendezvous, group arithmetic and communicator life cycle, not NCCL. The
real thing runs in test_nccl_gpu.py when a GPU is present.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import disco_core as disco
from disco_core import plugins
from disco_core.errors import CCLError
from disco_core.worker import WorkerContext
from disco_nccl import backend, ccl
from disco_nccl.ccl import NCCLCCL, check_device_ids, nccl_dtype, reduce_op


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def test_registered_by_disco_nccl():
    assert plugins.lookup("ccl", "nccl") is NCCLCCL
    assert any(
        i.distribution == "disco-nccl" and "nccl" in i.provides.get("ccl", [])
        for i in plugins.list_plugins()
    )


@pytest.mark.timeout(60)
@pytest.mark.skipif(_has_cupy(), reason="CuPy is installed: this test covers machines without it")
@pytest.mark.parametrize("kind", ["threaded", "process"])
def test_init_ccl_without_cupy_is_a_clear_error_and_the_session_survives(kind):
    cls = disco.ThreadedSession if kind == "threaded" else disco.ProcessSession
    with cls(2) as sess:
        with pytest.raises(CCLError, match=r"needs CuPy.*pip install"):
            sess.init_ccl("nccl")
        with pytest.raises(CCLError, match="no CCL is initialised"):
            sess.allreduce(sess.empty((2,), "float32"), sess.empty((2,), "float32"))
        sess.init_ccl("shm")  # the failed init left nothing behind
        x = sess.broadcast(np.ones(3, np.float32))
        assert x.debug_get_from_remote(1).sum() == 3


def test_device_ids_are_checked():
    assert check_device_ids((), 2, 4) == (0, 1)
    assert check_device_ids((3, 1), 2, 4) == (3, 1)
    with pytest.raises(CCLError, match="2 device ids given for 3 workers"):
        check_device_ids((0, 1), 3, 4)
    with pytest.raises(CCLError, match="repeat a GPU"):
        check_device_ids((1, 1), 2, 4)
    with pytest.raises(CCLError, match=r"no GPU \[5\]"):
        check_device_ids((0, 5), 2, 4)


def test_dtype_and_op_codes_follow_nccl_h():
    assert nccl_dtype(np.float32) == 7 and nccl_dtype("float16") == 6 and nccl_dtype(np.int64) == 4
    assert (
        reduce_op("sum") == 0
        and reduce_op("max") == 2
        and reduce_op("min") == 3
        and reduce_op("avg") == 4
    )
    with pytest.raises(CCLError, match="no datatype for bool"):
        nccl_dtype(np.bool_)
    with pytest.raises(CCLError, match="no datatype for int16"):
        nccl_dtype(np.int16)
    with pytest.raises(CCLError, match="unsupported op"):
        reduce_op("xor")


# --------------------------------------------------------------------- stand-ins
class FakeComm:
    """Stands in for cupy.cuda.nccl.NcclCommunicator (no GPU involved)."""

    made: list = []

    def __init__(self, ndev, uid, rank):
        self.ndev, self.uid, self.rank = ndev, uid, rank
        self.destroyed = 0
        FakeComm.made.append(self)

    def destroy(self):
        self.destroyed += 1


class _FakeDevice:
    """Stands in for cupy.cuda.Device (no GPU involved)."""

    def use(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _fake_backend():
    counter = iter(range(1000))
    nccl = types.SimpleNamespace(
        NcclCommunicator=FakeComm,
        get_unique_id=lambda: (next(counter),) * 128,
        groupStart=lambda: None,
        groupEnd=lambda: None,
        available=True,
    )
    device = _FakeDevice()
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 8),
            Device=lambda i: device,
        )
    )
    return cupy, nccl


@pytest.fixture
def fake(monkeypatch):
    """Unit tests only: a stand-in for CuPy and its NCCL module."""
    monkeypatch.setattr(backend, "load", lambda name="nccl": _fake_backend())
    FakeComm.made = []
    yield


def _channel(workers, groups):
    return types.SimpleNamespace(num_workers=workers, num_groups=groups, num_nodes=1)


def test_rendezvous_makes_world_and_group_ids(fake):
    rv = NCCLCCL.rendezvous(_channel(4, 2), (0, 1, 2, 3))
    p = rv.payload
    assert p["device_ids"] == (0, 1, 2, 3)
    assert len(p["group_uids"]) == 2 and p["world_uid"] not in p["group_uids"]
    assert NCCLCCL.rendezvous(_channel(2, 1), ()).payload["group_uids"] is None
    with pytest.raises(TypeError, match="unknown options"):
        NCCLCCL.rendezvous(_channel(2, 1), (), bogus=1)


def test_workers_build_global_and_group_communicators_as_tvm_does(fake):
    rv = NCCLCCL.rendezvous(_channel(4, 2), (4, 5, 6, 7))
    workers = [NCCLCCL(WorkerContext(w, 4, 2), rv.payload) for w in range(4)]
    for w, c in enumerate(workers):
        assert (c.world.ndev, c.world.rank) == (4, w)
        assert (c.group.ndev, c.group.rank) == (2, w % 2)
        assert c.group.uid == rv.payload["group_uids"][w // 2]
        assert c.ctx.device == disco.Device("cuda", 4 + w)
    assert c.members(True) == range(2, 4) and c.members(False) == range(4)


def test_communicators_are_destroyed_exactly_once(fake):
    rv = NCCLCCL.rendezvous(_channel(2, 1), ())
    c = NCCLCCL(WorkerContext(1, 2, 1), rv.payload)
    assert c.group is c.world  # one group: the group communicator is the global one
    c.close()
    c.close()
    assert [m.destroyed for m in FakeComm.made] == [1]
    with pytest.raises(CCLError, match="closed"):
        c.allreduce(None, None, "sum", False)


def test_abort_from_the_controller_reaches_in_process_workers(fake):
    rv = NCCLCCL.rendezvous(_channel(1, 1), ())
    assert ccl._ABORTED.get(rv.token) is None
    rv.abort("worker 1 died")
    assert ccl._ABORTED[rv.token] == "worker 1 died"
    rv.close()
    assert rv.token not in ccl._ABORTED
