"""Worker functions of the collective benchmark (imported on every worker).

``bench.collective_loop`` times a built-in collective inside the workers, the way
nccl-tests and the MPI benchmarks do: warm up, barrier, run the operation ``iters``
times back to back, barrier, and return the mean time per operation on this worker.
"""

from __future__ import annotations

import time

import numpy as np

from disco_core import builtins, register_func
from disco_core.worker import current


def _operation(op: str, src, dst):
    if op == "allreduce":
        return lambda: builtins.allreduce(src, "sum", False, dst)
    if op == "allgather":
        return lambda: builtins.allgather(src, False, dst)
    if op == "broadcast":
        return lambda: builtins.broadcast_from_worker0(src, False, dst)
    if op == "pingpong":  # workers 0 and 1; the others wait at the barriers
        me = current().worker_id
        if me == 0:
            return lambda: (builtins.send_to_worker(src, 1), builtins.recv_from_worker(dst, 1))
        if me == 1:
            return lambda: (builtins.recv_from_worker(dst, 0), builtins.send_to_worker(src, 0))
        return lambda: None
    raise ValueError(f"unknown collective {op!r}")


@register_func("bench.fill", override=True)
def fill(arr, value: float) -> None:
    """Touch every page of ``arr`` (so page faults stay out of the timings)."""
    if arr is not None:
        np.copyto(arr, value, casting="unsafe")


@register_func("bench.collective_loop", override=True)
def collective_loop(op: str, src, dst, iters: int, warmup: int) -> float:
    """Seconds per ``op`` on this worker, averaged over ``iters`` back-to-back calls."""
    run = _operation(op, src, dst)
    for _ in range(warmup):
        run()
    builtins.barrier(False)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    builtins.barrier(False)
    return (time.perf_counter() - t0) / iters
