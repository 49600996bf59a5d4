"""Benchmark: the ``mpi`` CCL beside raw mpi4py, same MPI, same processes, same run.

``python plugins/mpi/bench_mpi.py [--workers 2] [--repeat 20] [--json out.json]``

A ProcessSession with ``init_ccl("mpi")``; on every worker a timing function runs
each operation ``repeat`` times through the plugin (``ctx.ccl.allreduce`` ..., which
adds the descriptor exchange and the polling wait) and through raw mpi4py on the very
communicator the plugin uses (``comm.Allreduce`` ...), and reports the median
per-call time of worker 0. "session" is the controller-driven call
(``sess.allreduce(...)`` + ``sync_worker_0``), control plane included.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import disco_core as disco
from disco_core.worker import current

SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]
OPS = ["allreduce", "allgather", "broadcast"]


@disco.register_func("bench_mpi.time", override=True)
def _time(op: str, nbytes: int, repeat: int) -> dict:
    from mpi4py import MPI

    ctx = current()
    ccl = ctx.ccl
    comm = ccl.world
    n = comm.Get_size()
    count = nbytes // 4
    src = np.ones(count, np.float32)
    dst = np.empty(count * (n if op == "allgather" else 1), np.float32)

    def plugin():
        if op == "allreduce":
            ccl.allreduce(src, dst, "sum", False)
        elif op == "allgather":
            ccl.allgather(src, dst, False)
        else:
            ccl.broadcast(src, dst[:count], False)

    def raw():
        if op == "allreduce":
            comm.Allreduce(src, dst, MPI.SUM)
        elif op == "allgather":
            comm.Allgather(src, dst)
        else:
            comm.Bcast(dst[:count], root=0)

    out = {}
    for name, fn in (("raw", raw), ("plugin", plugin), ("raw2", raw), ("plugin2", plugin)):
        comm.Barrier()
        fn()
        times = []
        for _ in range(repeat):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = float(np.median(times))
    return {
        "raw": min(out["raw"], out["raw2"]),
        "plugin": min(out["plugin"], out["plugin2"]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--max-bytes", type=int, default=1 << 26)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    with disco.ProcessSession(args.workers) as sess:
        sess.import_python_module("bench_mpi")
        sess.init_ccl("mpi")
        from mpi4py import MPI

        lib = MPI.Get_library_version().splitlines()[0].strip()
        print(f"# {lib}; {args.workers} workers; median of {args.repeat}; worker 0's time")
        print(
            f"{'op':10} {'bytes':>9} {'raw mpi4py':>12} {'plugin':>12} {'overhead':>10} {'session':>12}"
        )
        timer = sess.get_global_func("bench_mpi.time")
        for op in OPS:
            for nbytes in [s for s in SIZES if s <= args.max_bytes]:
                r = timer(op, nbytes, args.repeat).debug_get_from_remote(0)
                count = nbytes // 4
                x = sess.empty((count,), "float32")
                y = sess.empty((count * (args.workers if op == "allgather" else 1),), "float32")
                ts = []
                for _ in range(max(3, args.repeat // 2)):
                    t = time.perf_counter()
                    if op == "allreduce":
                        sess.allreduce(x, y, "sum")
                    elif op == "allgather":
                        sess.allgather(x, y)
                    else:
                        sess.broadcast_from_worker0(x, x)
                    sess.sync_worker_0()
                    ts.append(time.perf_counter() - t)
                row = {"op": op, "bytes": nbytes, **r, "session": float(np.median(ts))}
                rows.append(row)
                over = row["plugin"] - row["raw"]
                pct = 100 * over / row["raw"] if row["raw"] else 0
                print(
                    f"{op:10} {nbytes:>9} {row['raw'] * 1e6:>10.1f}us {row['plugin'] * 1e6:>10.1f}us "
                    f"{over * 1e6:>+7.1f}us ({pct:+.0f}%) {row['session'] * 1e6:>10.1f}us",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
