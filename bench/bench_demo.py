"""The main job (``disco demo``) against plain NumPy, in the three CPU placements.

Runs the demo's own measurement (``disco_core.demo``: each Disco step taken in turn
with a NumPy step in the controller, so both see the same machine) for 1 and 2
process workers in each placement of ``_placement.py``; the worker processes are
started on the placement's worker CPUs, worker 0 runs in the controller's process.

Targets, met only when met in every placement: 1 worker >= 0.95x the speed
of NumPy in one process; 2 workers (1 BLAS thread each) >= 0.9x NumPy with all the
cores' BLAS threads.

Run: ``python bench/bench_demo.py [--steps 20] [--placements unpinned,split]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from _common import print_table, save_json
from _placement import PLACEMENTS, Placement, floor, load_average, placements

from disco_core import demo, demo_funcs

TARGETS = {1: 0.95, 2: 0.9}


def job_cpus(p: Placement, n: int) -> set[int]:
    """The CPUs a job of ``n`` workers runs on: NumPy gets the same ones, all of them."""
    return set(p.controller_cpus) if n == 1 else p.controller_cpus | p.worker_cpus


def measure(p: Placement, steps: int) -> dict[int, Any]:
    """The demo's rows for 1 and 2 workers under placement ``p`` (inside ``with p:``).

    Fair in every placement: the NumPy steps run on the CPUs the Disco job uses
    (worker 0's for 1 worker, everyone's for 2), with one BLAS thread per CPU;
    each Disco worker gets its share of its own CPUs.
    """
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--steps", str(steps)])
    x, w1, w2 = demo._make_problem(args)
    ref = demo_funcs.mlp_reference(x, w1, w2)
    opener, numpy_steps = demo._open_session, demo._numpy_steps

    def open_placed(kind: str, n: int) -> Any:
        with p.spawning():
            return opener(kind, n)

    demo._open_session = open_placed
    controller_threads = demo_funcs.blas_threads()
    try:
        rows = {}
        for n in TARGETS:
            cpus = job_cpus(p, n)

            def placed_numpy_steps(x, w1, w2, threads, count, cpus=cpus):
                p.move(cpus)  # for the whole block: a move per step costs a migration
                try:
                    return numpy_steps(x, w1, w2, len(cpus), count)
                finally:
                    p.move(p.controller_cpus)

            demo._numpy_steps = placed_numpy_steps
            args.blas_threads = max(1, len(cpus) // n)
            rows[n] = demo._run_session(x, w1, w2, args, ref, n)
            if controller_threads is not None:
                demo_funcs.blas_threads(controller_threads)
        return rows
    finally:
        demo._open_session, demo._numpy_steps = opener, numpy_steps


def run(steps: int = 20, only: list[str] | None = None) -> dict:
    print(f"bench_demo: {os.cpu_count()} CPUs; {load_average()}")
    per: dict[str, dict] = {}
    for p in placements(only):
        with p:
            print(f"... placement {p.describe()}", flush=True)
            fl = floor(p, 1000)
            per[p.name] = {"floor": fl, "load": os.getloadavg()[0], "rows": measure(p, steps)}
    print_table(
        "disco demo against NumPy, steps taken in turn (ms per step, medians)",
        ["placement", "workers", "disco", "numpy", "overhead", "speed vs numpy", "target"],
        [
            [
                name,
                n,
                f"{r.median * 1e3:.2f}",
                f"{r.numpy_median * 1e3:.2f}",
                f"{r.overhead * 1e3:.2f}",
                f"{r.speedup:.2f}x",
                f">= {TARGETS[n]}x {'yes' if r.speedup >= TARGETS[n] else 'NO'}",
            ]
            for name, res in per.items()
            for n, r in res["rows"].items()
        ],
    )
    met = {n: all(res["rows"][n].speedup >= t for res in per.values()) for n, t in TARGETS.items()}
    for n, t in TARGETS.items():
        print(
            f"target: {n} worker(s) >= {t}x NumPy in every placement: {'yes' if met[n] else 'NO'}"
        )
    out = {
        name: {
            "floor": res["floor"],
            "load": res["load"],
            "rows": {
                n: {
                    "ms": r.median * 1e3,
                    "numpy_ms": r.numpy_median * 1e3,
                    "overhead_ms": r.overhead * 1e3,
                    "speedup": r.speedup,
                }
                for n, r in res["rows"].items()
            },
        }
        for name, res in per.items()
    }
    path = save_json("bench_demo.json", {"placements": out, "met": met})
    print(f"results written to {path}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row (default 20)")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated")
    args = ap.parse_args(argv)
    run(args.steps, args.placements.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
