"""An SPMD job on the ranks of an MPI launcher (disco-mpi's ``mpi`` channel).

Run from the repository root: ``mpiexec -n 3 python examples/mpi_script.py``, or
``disco-mpi run -n 3 examples/mpi_script.py``, or ``srun ... python examples/mpi_script.py``.
"""

import disco_core as disco


@disco.register_func("my.fill")  # top-level code runs on every rank
def fill(arr, value):
    arr[...] = value


sess = disco.Session.create("mpi")  # or disco_mpi.MPISession(num_groups=...)
# From here on only rank 0 runs: ranks 1..N-1 became workers and exit at shutdown.
sess.init_ccl("mpi")  # uses MPI_COMM_WORLD directly
x = sess.empty((4,), "float32")
sess.get_global_func("my.fill")(x, 1.0)
y = sess.empty((4,), "float32")
sess.allreduce(x, y, op="sum")
print(y.debug_get_from_remote(0), "on", sess.num_workers, "workers")
sess.shutdown()
