"""Benchmark: the ``mpi`` channel's control plane in three CPU placements.

``python plugins/mpi/bench_mpi_channel.py [--ranks 2,3] [--calls 1000] [--rounds 5]``

Runs itself under ``mpiexec -n N`` (the launcher of the ``mpich`` wheel) with the
ranks unpinned, all on one CPU (``taskset -c 0`` around the launcher) and split
(rank ``r`` bound to CPU ``r % cpus``, ``-bind-to user:...``), and prints per run
the median over rounds of:

* ``round trip``: ``call_packed`` + ``debug_get_from_remote(N - 1)`` (a command to
  every rank and a value back from the last one), per call;
* ``async call``: ``call_packed`` without waiting, per call (1000 of them, then one
  sync of every worker).

No peer: TVM's Disco has no MPI channel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _measure(calls: int, rounds: int) -> None:
    """Rank 0's side (every rank runs this: ranks other than 0 become workers)."""
    import disco_core as disco

    sess = disco.Session.create("mpi")
    last = sess.num_workers - 1
    f = sess.get_global_func("disco.worker_id")
    for _ in range(200):
        f().debug_get_from_remote(last)
    trips, asyncs = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f().debug_get_from_remote(last)
        trips.append((time.perf_counter() - t0) / calls * 1e6)
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        sess._sync_all()
        asyncs.append((time.perf_counter() - t0) / calls * 1e6)
    print(f"RESULT {statistics.median(trips):.1f} {statistics.median(asyncs):.1f}", flush=True)
    sess.shutdown()


def _launch(ranks: int, placement: str, calls: int, rounds: int) -> tuple[float, float] | None:
    import disco_mpi

    exe = disco_mpi.launcher()
    argv = [exe, "-n", str(ranks)]
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "split":
        argv += ["-bind-to", "user:" + ",".join(str(cpus[r % len(cpus)]) for r in range(ranks))]
    argv += [sys.executable, os.path.abspath(__file__), "--child", str(calls), str(rounds)]
    if placement == "one CPU":
        argv = ["taskset", "-c", str(cpus[0]), *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            trip, call = line.split()[1:3]
            return float(trip), float(call)
    print(f"  ({placement}, {ranks} ranks) failed: {r.stderr[-500:]}", file=sys.stderr)
    return None


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _measure(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,3", help="comma-separated job sizes (default 2,3)")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {len(os.sched_getaffinity(0))} CPUs")
    print(f"{'placement':<10} {'ranks':>5} {'round trip us':>14} {'async call us':>14}")
    for placement in ("unpinned", "one CPU", "split"):
        for ranks in (int(x) for x in args.ranks.split(",")):
            got = _launch(ranks, placement, args.calls, args.rounds)
            if got is not None:
                print(f"{placement:<10} {ranks:>5} {got[0]:>14.1f} {got[1]:>14.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
