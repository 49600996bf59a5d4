"""Benchmark: the ``mpi`` CCL beside raw mpi4py, same MPI, same processes, same run.

``python plugins/mpi/bench_mpi.py [--workers 2] [--repeat 20] [--ops ...] [--json out.json]``

A ProcessSession with ``init_ccl("mpi")``; on every worker a timing function runs
each operation through the plugin (``ctx.ccl.allreduce`` ..., which adds the
descriptor exchange and the polling wait) and through raw mpi4py on the very
communicator the plugin uses (``comm.Allreduce`` ...), *interleaved*: every
iteration times both, in alternating order, each after an ``MPI_Barrier``, so the
two see the same machine (other jobs, caches, memory). Reported: the medians of
worker 0's per-call times, and the overhead as the median of the per-iteration
differences (plugin - raw), with its interquartile range.

The raw counterparts do what the plugin's call does:

* ``allreduce``: ``Allreduce(src, dst, SUM)`` vs ``ccl.allreduce(src, dst, "sum")``;
* ``allgather``: ``Allgather(src, dst)`` vs ``ccl.allgather(src, dst)``;
* ``broadcast``: ``Bcast(buf)`` vs ``ccl.broadcast(buf, buf)`` (in place, what
  ``sess.broadcast_from_worker0(x, x)`` does);
* ``broadcast2``: src and dst differ, so the root also copies src into dst:
  ``Bcast(src)`` + ``np.copyto(dst, src)`` on the root vs ``ccl.broadcast(src, dst)``.

"session" is the controller-driven call (``sess.allreduce(...)`` +
``sync_worker_0``), control plane included.
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
OPS = ["allreduce", "allgather", "broadcast", "broadcast2"]


@disco.register_func("bench_mpi.time", override=True)
def _time(op: str, nbytes: int, repeat: int) -> dict:
    from mpi4py import MPI

    ctx = current()
    ccl = ctx.ccl
    comm = ccl.world
    n = comm.Get_size()
    root = comm.Get_rank() == 0
    count = nbytes // 4
    src = np.ones(count, np.float32)
    dst = np.ones(count * (n if op == "allgather" else 1), np.float32)

    if op == "allreduce":

        def plugin():
            ccl.allreduce(src, dst, "sum", False)

        def raw():
            comm.Allreduce(src, dst, MPI.SUM)

    elif op == "allgather":

        def plugin():
            ccl.allgather(src, dst, False)

        def raw():
            comm.Allgather(src, dst)

    elif op == "broadcast":

        def plugin():
            ccl.broadcast(dst, dst, False)

        def raw():
            comm.Bcast(dst, root=0)

    else:  # broadcast2: src is not dst

        def plugin():
            ccl.broadcast(src, dst, False)

        def raw():
            if root:
                comm.Bcast(src, root=0)
                np.copyto(dst, src)
            else:
                comm.Bcast(dst, root=0)

    def timed(fn) -> float:
        comm.Barrier()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    raw()
    plugin()
    t_raw, t_plugin = [], []
    for i in range(repeat):
        if i % 2:
            t_plugin.append(timed(plugin))
            t_raw.append(timed(raw))
        else:
            t_raw.append(timed(raw))
            t_plugin.append(timed(plugin))
    diff = np.subtract(t_plugin, t_raw)
    return {
        "raw": float(np.median(t_raw)),
        "plugin": float(np.median(t_plugin)),
        "overhead": float(np.median(diff)),
        "overhead_iqr": [float(np.percentile(diff, 25)), float(np.percentile(diff, 75))],
        "raw_iqr": [float(np.percentile(t_raw, 25)), float(np.percentile(t_raw, 75))],
        "plugin_iqr": [float(np.percentile(t_plugin, 25)), float(np.percentile(t_plugin, 75))],
        "repeat": repeat,
    }


def _us(x: float) -> str:
    return f"{x * 1e6:.1f}us"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20, help="iterations at >= 4 MiB (x10 below)")
    p.add_argument("--max-bytes", type=int, default=1 << 26)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {OPS}")
    p.add_argument("--no-session", action="store_true", help="skip the controller-driven column")
    p.add_argument("--json")
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}")
    rows = []
    with disco.ProcessSession(args.workers) as sess:
        sess.import_python_module("bench_mpi")
        sess.init_ccl("mpi")
        from mpi4py import MPI

        lib = MPI.Get_library_version().splitlines()[0].strip()
        print(f"# {lib}; {args.workers} workers; worker 0's times; interleaved raw/plugin")
        print(
            f"{'op':10} {'bytes':>9} {'raw mpi4py':>12} {'plugin':>12} "
            f"{'overhead (median, IQR)':>36} {'session':>12}"
        )
        timer = sess.get_global_func("bench_mpi.time")
        for op in ops:
            for nbytes in [s for s in SIZES if s <= args.max_bytes]:
                repeat = args.repeat if nbytes >= 1 << 22 else 10 * args.repeat
                r = timer(op, nbytes, repeat).debug_get_from_remote(0)
                row = {"op": op, "bytes": nbytes, **r, "session": None}
                if not args.no_session:
                    count = nbytes // 4
                    x = sess.empty((count,), "float32")
                    ny = count * (args.workers if op == "allgather" else 1)
                    y = sess.empty((ny,), "float32")
                    ts = []
                    for _ in range(max(3, args.repeat // 2)):
                        t = time.perf_counter()
                        if op == "allreduce":
                            sess.allreduce(x, y, "sum")
                        elif op == "allgather":
                            sess.allgather(x, y)
                        elif op == "broadcast":
                            sess.broadcast_from_worker0(x, x)
                        else:
                            sess.broadcast_from_worker0(x, y)
                        sess.sync_worker_0()
                        ts.append(time.perf_counter() - t)
                    row["session"] = float(np.median(ts))
                rows.append(row)
                over = row["overhead"]
                lo, hi = row["overhead_iqr"]
                pct = 100 * over / row["raw"] if row["raw"] else 0
                ses = _us(row["session"]) if row["session"] is not None else "-"
                print(
                    f"{op:10} {nbytes:>9} {_us(row['raw']):>12} {_us(row['plugin']):>12} "
                    f"{over * 1e6:>+10.1f}us ({pct:+4.0f}%) [{lo * 1e6:+.0f}, {hi * 1e6:+.0f}]"
                    f"{'':>4}{ses:>12}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
