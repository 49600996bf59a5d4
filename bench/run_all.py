"""Run every benchmark: ``python bench/run_all.py [--quick] [--no-peers]``.

Runs ``bench_core`` (control plane, beside TVM's Disco when installed, in three CPU
placements), ``bench_demo`` (the main job against NumPy, in three placements) and
``bench_ccl`` (the shm CCL, beside gloo and MPICH when installed); prints their
tables and writes JSON and a PNG plot to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import sys
import time

import bench_ccl
import bench_core
import bench_demo
from _placement import PLACEMENTS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="shorter runs (about 1.5 minutes in all on 2 cores, against 3.5)",
    )
    ap.add_argument("--no-peers", action="store_true", help="skip TVM, gloo and MPICH")
    ap.add_argument("--only", choices=("core", "demo", "ccl"), help="run one benchmark")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated")
    args = ap.parse_args(argv)
    only = args.placements.split(",")
    t0 = time.perf_counter()
    if args.only in (None, "core"):
        bench_core.run(quick=args.quick, tvm=not args.no_peers, only=only)
        print()
    if args.only in (None, "demo"):
        bench_demo.run(steps=10 if args.quick else 20, only=only)
        print()
    if args.only in (None, "ccl"):
        bench_ccl.run(quick=args.quick, peers=not args.no_peers)
    print(f"\nall benchmarks done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
