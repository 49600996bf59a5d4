"""Run every benchmark: ``python bench/run_all.py [--quick] [--no-peers]``.

Runs ``bench_core`` (control plane, beside TVM's Disco when installed) and
``bench_ccl`` (the shm CCL, beside gloo and MPICH when installed); prints their
tables and writes JSON and a PNG plot to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import sys
import time

import bench_ccl
import bench_core


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (about a minute in all)")
    ap.add_argument("--no-peers", action="store_true", help="skip TVM, gloo and MPICH")
    ap.add_argument("--only", choices=("core", "ccl"), help="run one of the two benchmarks")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.only in (None, "core"):
        bench_core.run(quick=args.quick, tvm=not args.no_peers)
        print()
    if args.only in (None, "ccl"):
        bench_ccl.run(quick=args.quick, peers=not args.no_peers)
    print(f"\nall benchmarks done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
