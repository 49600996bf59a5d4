"""disco-nccl on a real GPU. Skipped (with the reason) where CuPy or a GPU is missing.

NCCL runs one rank per GPU, so on a one-GPU machine these run 1-worker sessions:
every operation through real NCCL calls, host <-> device copies, torch interop, and
the communicator set-up and tear-down path. On a machine with several GPUs the
2-worker tests run too.
"""

from __future__ import annotations

import numpy as np
import pytest

import disco_core as disco

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda12x)")
try:
    NUM_GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver
    NUM_GPUS = 0
pytestmark = [
    pytest.mark.skipif(NUM_GPUS < 1, reason="no GPU on this machine"),
    pytest.mark.timeout(120),
]


@pytest.fixture(params=["threaded", "process"])
def sess1(request):
    cls = disco.ThreadedSession if request.param == "threaded" else disco.ProcessSession
    with cls(1) as s:
        s.init_ccl("nccl", 0)
        yield s


def test_device_binding_and_empty_on_gpu(sess1):
    dev = sess1.get_global_func("disco.device")()
    assert dev.debug_get_from_remote(0) == disco.Device("cuda", 0)
    x = sess1.empty((3, 4), "float32")
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    sess1.copy_to_worker_0(host, x)
    out = np.zeros_like(host)
    sess1.copy_from_worker_0(out, x)
    np.testing.assert_array_equal(out, host)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
def test_allreduce_one_rank(sess1, op):
    host = np.linspace(-2, 3, 1000).astype(np.float32)
    x = sess1.copy_to_worker_0(host)
    y = sess1.empty((1000,), "float32")
    sess1.allreduce(x, y, op)
    np.testing.assert_array_equal(y.debug_get_from_remote(0), host)


def test_every_collective_one_rank(sess1):
    host = np.arange(8, dtype=np.int32)
    x = sess1.copy_to_worker_0(host)
    g = sess1.empty((8,), "int32")
    sess1.allgather(x, g)
    np.testing.assert_array_equal(g.debug_get_from_remote(0), host)
    b = sess1.broadcast(host.astype(np.float16))
    np.testing.assert_array_equal(b.debug_get_from_remote(0), host.astype(np.float16))
    s = sess1.scatter(host.reshape(1, 8))
    np.testing.assert_array_equal(s.debug_get_from_remote(0), host)
    out = sess1.empty((1, 8), "int32", worker0_only=True)
    sess1.gather_to_worker0(s, out)
    np.testing.assert_array_equal(out.debug_get_from_remote(0), host.reshape(1, 8))
    sess1.call_packed(sess1.get_global_func("disco.barrier"), False)
    sess1.sync_worker_0()


def test_mismatch_is_a_clear_error_and_the_session_survives(sess1):
    x = sess1.empty((4,), "float32")
    y = sess1.empty((5,), "float32")
    sess1.allreduce(x, y)
    with pytest.raises(disco.WorkerError, match="does not match"):
        sess1.sync_worker_0()
    z = sess1.empty((4,), "bool")
    sess1.allreduce(z, z)
    with pytest.raises(disco.WorkerError, match="no datatype for bool"):
        sess1.sync_worker_0()
    ok = sess1.broadcast(np.ones(4, np.float32))
    assert ok.debug_get_from_remote(0).sum() == 4


def test_torch_cuda_tensors_through_dlpack(sess1):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    x = sess1.copy_to_worker_0(t.cpu())
    y = sess1.empty((6,), "float32")
    sess1.allreduce(x, y)
    np.testing.assert_array_equal(y.debug_get_from_remote(0), t.cpu().numpy())


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")
def test_two_ranks_allreduce():
    with disco.ProcessSession(2) as sess:
        sess.init_ccl("nccl", 0, 1)
        x = sess.scatter(np.stack([np.ones(16, np.float32), np.full(16, 2, np.float32)]))
        y = sess.empty((16,), "float32")
        sess.allreduce(x, y)
        np.testing.assert_array_equal(y.debug_get_from_remote(1), np.full(16, 3, np.float32))


@pytest.mark.skipif(
    NUM_GPUS < 3, reason="needs 3 GPUs (a surviving worker process besides worker 0)"
)
def test_a_worker_dying_in_an_allreduce_does_not_hold_up_shutdown():
    """Worker 1, a process, waits in NCCL for worker 2, which dies: it hears of it from
    the session's store and aborts NCCL, so shutdown() finds it reading its commands
    (before, it waited in NCCL until shutdown's timeout ran out and killed it)."""
    import os
    import time

    import disco_core.testing.funcs  # noqa: F401  (registers testing.die)

    sess = disco.ProcessSession(3)
    try:
        sess.init_ccl("nccl", 0, 1, 2)
        x = sess.broadcast(np.ones(1 << 16, np.float32))
        y = sess.empty((1 << 16,), "float32")
        sess.call_packed("testing.die", "exit", 2, os.getpid(), 0.5)
        sess.allreduce(x, y, "sum")
        with pytest.raises(disco.WorkerDiedError) as info:
            sess.sync_worker_0()
            y.debug_get_from_remote(1)
        assert 2 in info.value.worker_ids
    finally:
        t0 = time.monotonic()
        sess.shutdown()
        assert time.monotonic() - t0 < 3.0, "shutdown waited for a worker stuck in NCCL"


# The core's CCL conformance kit on the real thing: one worker per GPU present.
from _nccl_contract import NCCLContract, threaded_nccl  # noqa: E402


class TestContractThreadedOnEveryGPU(NCCLContract):
    num_workers = max(1, NUM_GPUS)
    odd_num_workers = 3 if NUM_GPUS >= 3 else None  # one GPU per worker

    @pytest.fixture
    def make_session(self):
        return threaded_nccl
