"""Run under ``mpiexec -n 3``: the ``mpi`` channel end to end (used by test_mpi_channel)."""

import os
import sys

import numpy as np

import disco_core as disco

sys.path.insert(0, os.path.dirname(__file__))
import mpi_test_funcs  # noqa: E402,F401  (every rank registers the test functions)
from mpi_test_funcs import make  # noqa: E402

sess = disco.Session.create("mpi", num_groups=int(os.environ.get("GROUPS", "1")))
n = sess.num_workers
sess.init_ccl("mpi")
assert sess.call_packed("mpi_test.ccl_name").debug_get_from_remote(n - 1) == "mpi"
src = sess.call_packed("mpi_test.make", (5,), "float64", 1)
dst = sess.empty((5,), "float64")
sess.allreduce(src, dst, "max", in_group=False)
want = np.maximum.reduce([make((5,), "float64", 1, w) for w in range(n)])
for w in range(n):
    np.testing.assert_array_equal(dst.debug_get_from_remote(w), want)
ag = sess.empty((5 * n,), "float64")
sess.allgather(src, ag, in_group=False)
np.testing.assert_array_equal(
    ag.debug_get_from_remote(n - 1), np.concatenate([make((5,), "float64", 1, w) for w in range(n)])
)
host = np.arange(n * 2, dtype="int32").reshape(n, 2)
sc = sess.scatter(host, in_group=False)
assert sc.debug_get_from_remote(2).tolist() == host[2].tolist()
wid = sess.get_global_func("disco.worker_id")()
assert [wid.debug_get_from_remote(w) for w in range(n)] == list(range(n))
try:
    sess.call_packed("mpi_test.shape_by_worker", "float32")
    bad = sess.call_packed("mpi_test.shape_by_worker", "float32")
    sess.allreduce(bad, bad, "sum", in_group=False)
    sess.sync_worker_0()
    wid.debug_get_from_remote(1)
    raise SystemExit("a mismatched allreduce did not fail")
except disco.WorkerError as exc:
    assert "differ" in str(exc), exc
sess.shutdown()
print(f"MPI CHANNEL OK {n}", flush=True)
