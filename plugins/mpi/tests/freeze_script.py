"""Rank 1 is stopped (``SIGSTOP``) while rank 0 waits for its answer.

Run with ``mpiexec -n 3`` and ``DISCO_LIVENESS_TIMEOUT=2``; argv[1] is the file where
rank 0 writes what the call raised and how long the shutdown took (the job is then
aborted at rank 0's exit, which races anything printed to stdout). With argv[2]
``busy``, rank 1 is not stopped but busy in a 6 s function as the session shuts down:
it is waited for, and the job ends normally.
"""

import os
import signal
import sys
import time

import disco_core as disco

sess = disco.Session.create("mpi")
sess.import_python_module("disco_core.testing.funcs")
pid = sess.call_packed("testing.pid").debug_get_from_remote(1)
worker2 = sess.call_packed("testing.pid").debug_get_from_remote(2)
if sys.argv[2:] == ["busy"]:
    sess.get_global_func("testing.sleep")(6.0, 1)
    t0 = time.monotonic()
    sess.shutdown()
    with open(sys.argv[1], "w") as f:
        f.write(f"busy\nshutdown {time.monotonic() - t0:.1f} s\npids {pid} {worker2}\n")
    sys.exit(0)
time.sleep(1.0)  # idle a while: the liveness watch runs between calls too
os.kill(pid, signal.SIGSTOP)
t0 = time.monotonic()
try:
    sess.call_packed("testing.pid").debug_get_from_remote(1)
    raised = "nothing"
except disco.DiscoError as exc:
    raised = f"{type(exc).__name__} {exc.worker_ids} after {time.monotonic() - t0:.1f} s: {exc}"
t0 = time.monotonic()
sess.shutdown()
with open(sys.argv[1], "w") as f:
    f.write(f"{raised}\nshutdown {time.monotonic() - t0:.1f} s\npids {pid} {worker2}\n")
