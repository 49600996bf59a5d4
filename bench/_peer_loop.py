"""The timing loop shared by the peer scripts (gloo, MPI): same method as ours.

Each measurement: two warm-up calls, one calibration call on every rank (the slowest rank's time sets
the iteration count, so every rank runs the same count), warm-up, barrier,
``iters`` back-to-back operations, barrier; the result is the slowest rank's mean
time per operation. Rank 0 prints one JSON document on stdout.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

# (op, total bytes); allgather's size is the gathered output, as in nccl-tests.
Plan = list[tuple[str, int]]


def parse_plan(text: str) -> Plan:
    plan = []
    for item in text.split(","):
        op, nbytes = item.split(":")
        plan.append((op, int(nbytes)))
    return plan


def iterations(seconds_per_op: float, budget: float) -> int:
    return int(max(3, min(1000, budget / max(seconds_per_op, 1e-9))))


def run_plan(
    plan: Plan,
    make_op: Callable[[str, int], Callable[[], Any]],
    barrier: Callable[[], None],
    max_all: Callable[[float], float],
    rank: int,
    budget: float,
    repeats: int,
    meta: dict,
) -> None:
    results = []
    for op, nbytes in plan:
        run = make_op(op, nbytes)
        for _ in range(2):  # warm-up (first touch of the buffers)
            run()
        barrier()
        t0 = time.perf_counter()
        run()  # calibration
        iters = iterations(max_all(time.perf_counter() - t0), budget)
        times = []
        for _ in range(repeats):
            barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            barrier()
            times.append(max_all((time.perf_counter() - t0) / iters))
        times.sort()
        results.append(
            {"op": op, "bytes": nbytes, "iters": iters, "time_s": times[len(times) // 2]}
        )
    if rank == 0:
        json.dump({"meta": meta, "results": results}, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
