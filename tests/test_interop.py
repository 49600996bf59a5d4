"""Interop with torch: DLPack arrays where host arrays go, torch tensors in registers
and collectives, and the ``.pt2`` (torch.export) module loader."""

from __future__ import annotations

import numpy as np
import pytest

import disco_core as disco

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed (scripts/test.sh installs a CPU build of torch only where "
    "one is reachable without CUDA packages)",
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["threaded", "process"])
def sess(request):
    cls = disco.ThreadedSession if request.param == "threaded" else disco.ProcessSession
    with cls(2) as s:
        yield s


def test_torch_tensor_where_host_array_goes(sess):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ref = sess.copy_to_worker_0(t)
    out = np.zeros((3, 4), np.float32)
    sess.copy_from_worker_0(out, ref)
    np.testing.assert_array_equal(out, t.numpy())
    ref.debug_copy_from(1, torch.ones(5, dtype=torch.int64))
    got = ref.debug_get_from_remote(1)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.sum() == 5


def test_torch_tensors_in_collectives(sess):
    sess.init_ccl("shm")
    b = sess.broadcast(torch.full((4,), 3.0))
    assert np.array_equal(b.debug_get_from_remote(1), np.full(4, 3.0, np.float32))
    sc = sess.scatter(torch.arange(8, dtype=torch.int32).reshape(2, 4))
    assert np.array_equal(sc.debug_get_from_remote(1), np.arange(4, 8, dtype=np.int32))
    # registers holding torch tensors take part in collectives through DLPack
    make = sess.get_global_func("disco.empty")
    src = make((4,), "float32", None, False, True)
    src.debug_copy_from(0, torch.ones(4))
    src.debug_copy_from(1, torch.full((4,), 2.0))
    dst = sess.empty((4,), "float32")
    sess.allreduce(src, dst, "sum")
    assert np.array_equal(dst.debug_get_from_remote(0), np.full(4, 3.0, np.float32))


def test_torch_bfloat16_tensors_where_host_arrays_go(sess):
    """A CPU ``torch.bfloat16`` tensor (the usual dtype of model weights) failed wherever a
    host array goes, with torch's bare "Got unsupported ScalarType BFloat16" (an outside
    check): NumPy takes no bfloat16 through DLPack. Its memory is seen as ml_dtypes'
    bfloat16 now, without a copy."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    sess.init_ccl("shm")
    values = torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16)
    want = values.float().numpy()
    b = sess.broadcast(values)
    got = b.debug_get_from_remote(1)
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32), want)
    ref = sess.copy_to_worker_0(values[::2])  # a strided view too
    assert np.array_equal(ref.debug_get_from_remote(0).astype(np.float32), want[::2])
    out = torch.zeros(4, dtype=torch.bfloat16)
    sess.copy_from_worker_0(out, b)  # written in place, into the tensor's own memory
    assert torch.equal(out, values)
    b.debug_copy_from(1, torch.ones(4, dtype=torch.bfloat16))
    assert np.array_equal(b.debug_get_from_remote(1).astype(np.float32), np.ones(4, np.float32))


def test_pt2_module_loader(sess, tmp_path):
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.lin(x))

    model = Mlp()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,))
    path = tmp_path / "mlp.pt2"
    torch.export.save(program, str(path))
    mod = sess.load_vm_module(str(path))
    y = mod["main"](x.numpy())
    expected = model(x).detach().numpy()
    for w in range(sess.num_workers):
        np.testing.assert_allclose(y.debug_get_from_remote(w), expected, rtol=1e-6)


def test_pt2_unknown_function_is_a_worker_error(sess, tmp_path):
    program = torch.export.export(torch.nn.ReLU(), (torch.randn(2),))
    path = tmp_path / "relu.pt2"
    torch.export.save(program, str(path))
    mod = sess.load_vm_module(path)
    bad = mod["nope"]
    with pytest.raises(disco.WorkerError, match="nope"):
        bad.debug_get_from_remote(0)
