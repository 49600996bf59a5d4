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
