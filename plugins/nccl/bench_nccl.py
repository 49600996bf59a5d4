"""GPU benchmark of disco-nccl: allreduce/allgather bandwidth and host<->device copies,
beside CuPy's own copy bandwidth (the physical reference), printed side by side.

    python plugins/nccl/bench_nccl.py [--workers 1] [--sizes 1,16,64]   # MiB

NCCL runs one rank per GPU: on a one-GPU machine the collectives run with 1 rank
(their cost is NCCL's launch plus a device copy) and the copy numbers are the point.
A second table gives the time a small allreduce costs the controller (calls queued,
one sync at the end), with and without the argument check, beside CuPy's own NCCL
call in this process (one rank only: more ranks need a process each).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import disco_core as disco


def _cupy_copy_bandwidth(nbytes: int, reps: int) -> tuple[float, float]:
    import cupy as cp

    host = np.ones(nbytes // 4, np.float32)
    pinned = cp.cuda.alloc_pinned_memory(nbytes)
    pinned_arr = np.frombuffer(pinned, np.float32, nbytes // 4)
    pinned_arr[...] = host
    dev = cp.empty_like(cp.asarray(host))
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dev.set(host)
    cp.cuda.runtime.deviceSynchronize()
    h2d = nbytes * reps / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(reps):
        dev.get(out=host)
    cp.cuda.runtime.deviceSynchronize()
    d2h = nbytes * reps / (time.perf_counter() - t)
    return h2d, d2h


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sizes", default="1,16,64", help="MiB, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes.split(",")]
    n = args.workers
    print(f"disco-nccl on {n} GPU(s); GB/s = 1e9 bytes/s; busbw as in nccl-tests")
    print(f"{'op':<22}{'MiB':>6}{'time ms':>10}{'algbw':>8}{'busbw':>8}{'CuPy ref':>10}")
    with disco.ProcessSession(n) as sess:
        sess.init_ccl("nccl", *range(n))
        for nbytes in sizes:
            host = np.ones(nbytes // 4, np.float32)
            h2d_ref, d2h_ref = _cupy_copy_bandwidth(nbytes, args.reps)
            x = sess.empty(host.shape, "float32")
            sess.sync_worker_0()
            t = time.perf_counter()
            for _ in range(args.reps):
                sess.copy_to_worker_0(host, x)
            dt = (time.perf_counter() - t) / args.reps
            print(
                f"{'copy_to_worker_0':<22}{nbytes >> 20:>6}{dt * 1e3:>10.3f}{nbytes / dt / 1e9:>8.2f}{'':>8}{h2d_ref / 1e9:>10.2f}"
            )
            t = time.perf_counter()
            for _ in range(args.reps):
                sess.copy_from_worker_0(host, x)
            dt = (time.perf_counter() - t) / args.reps
            print(
                f"{'copy_from_worker_0':<22}{nbytes >> 20:>6}{dt * 1e3:>10.3f}{nbytes / dt / 1e9:>8.2f}{'':>8}{d2h_ref / 1e9:>10.2f}"
            )
            y = sess.empty(host.shape, "float32")
            g = sess.empty((n * host.size,), "float32")
            for name, run, factor, size in (
                (
                    "allreduce",
                    lambda x=x, y=y: sess.allreduce(x, y),
                    2 * (n - 1) / n if n > 1 else 1,
                    nbytes,
                ),
                (
                    "allgather",
                    lambda x=x, g=g: sess.allgather(x, g),
                    (n - 1) / n if n > 1 else 1,
                    n * nbytes,
                ),
            ):
                run()
                sess.sync_worker_0()
                t = time.perf_counter()
                for _ in range(args.reps):
                    run()
                sess.sync_worker_0()
                dt = (time.perf_counter() - t) / args.reps
                alg = size / dt / 1e9
                print(
                    f"{name:<22}{nbytes >> 20:>6}{dt * 1e3:>10.3f}{alg:>8.2f}{alg * factor:>8.2f}{'':>10}"
                )
    small_allreduce_table(n)


def _small_allreduce_us(n: int, validate: bool, count: int, calls: int) -> float:
    with disco.ProcessSession(n) as sess:
        sess.init_ccl("nccl", *range(n), validate=validate)
        x = sess.empty((count,), "float32")
        y = sess.empty((count,), "float32")
        for _ in range(200):
            sess.allreduce(x, y)
        sess.sync_worker_0()
        t = time.perf_counter()
        for _ in range(calls):
            sess.allreduce(x, y)
        sess.sync_worker_0()
        return (time.perf_counter() - t) / calls * 1e6


def _cupy_small_allreduce_us(count: int, calls: int) -> float:
    import cupy as cp
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    a = cp.ones(count, cp.float32)
    b = cp.empty_like(a)
    stream = cp.cuda.get_current_stream()

    def run(k: int) -> None:
        for _ in range(k):
            comm.allReduce(a.data.ptr, b.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)  # fmt: skip

    run(200)
    stream.synchronize()
    t = time.perf_counter()
    run(calls)
    stream.synchronize()
    us = (time.perf_counter() - t) / calls * 1e6
    comm.destroy()
    return us


def small_allreduce_table(n: int, calls: int = 2000) -> None:
    count = 1024  # 4 KiB of float32
    print(f"\nallreduce of 4 KiB, {calls} calls queued then one sync: us per call")
    print(f"{'what':<44}{'us':>8}")
    for validate in (True, False):
        us = _small_allreduce_us(n, validate, count, calls)
        print(f"{f'disco ProcessSession({n}), validate={validate}':<44}{us:>8.1f}")
    if n == 1:
        print(f"{'CuPy NCCL call, 1 rank, this process':<44}{_cupy_small_allreduce_us(count, calls):>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
