"""The main job (``disco demo``) against plain NumPy, in the three CPU placements.

Runs the demo's own measurement (``disco_core.demo``: each Disco step taken in turn
with a NumPy step in the controller, so both see the same machine) for 1 and 2
process workers in each placement of ``_placement.py``; the worker processes are
started on the placement's worker CPUs, worker 0 runs in the controller's process.

Targets, met only when met in every placement: 1 worker >= 0.95x the speed
of NumPy in one process; 2 workers (1 BLAS thread each) >= 0.9x NumPy with all the
cores' BLAS threads.

Beside the 2-worker rows, the **split floor**: the same two shards computed by two plain
processes placed as the Disco job's (one where the controller runs, one where the
workers do), with the same BLAS threads, no Disco and no communication at all. It is
what splitting the work across processes costs in that placement before any
runtime is involved: on one CPU, two processes time-sliced on it.

Run: ``python bench/bench_demo.py [--steps 20] [--placements unpinned,split]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
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


def _floor_process(
    rank: int, cpus: set[int], threads: int, x, w1s, w2s, steps: int, start, out
) -> None:
    """One process of the split floor: its shard, ``steps`` times, from a common start."""
    os.sched_setaffinity(0, cpus)
    demo_funcs.blas_threads(threads)
    part = demo_funcs.np.empty((x.shape[0], w2s.shape[1]), x.dtype)
    for _ in range(2):  # warm-up, as the demo's
        demo_funcs.mlp_shard(x, w1s, w2s, part)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(steps):
        demo_funcs.mlp_shard(x, w1s, w2s, part)
    out.put((rank, t0, time.perf_counter()))


def split_floor(p: Placement, n: int, steps: int, blocks: int = 3) -> float:
    """Seconds per step of the demo's work split over ``n`` plain processes (no Disco),
    placed as the Disco job's: rank 0 on the controller's CPUs, the others on the
    workers'; the median of ``blocks`` runs (each from a common start to the last
    process's end)."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    x, w1, w2 = demo._make_problem(args)
    w1_shards, w2_shards = demo.shard_weights(w1, w2, n)
    threads = max(1, len(job_cpus(p, n)) // n)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with BLAS threads
    per_step = []
    for _ in range(blocks):
        start, out = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(
                target=_floor_process,
                args=(r, p.rank_cpus(r), threads, x, w1_shards[r], w2_shards[r], steps, start, out),
                daemon=True,
            )
            for r in range(n)
        ]
        for proc in procs:
            proc.start()
        try:
            ends = [out.get(timeout=120) for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        t0 = min(e[1] for e in ends)
        per_step.append((max(e[2] for e in ends) - t0) / steps)
    return statistics.median(per_step)


def run(steps: int = 20, only: list[str] | None = None) -> dict:
    print(f"bench_demo: {os.cpu_count()} CPUs; {load_average()}")
    per: dict[str, dict] = {}
    for p in placements(only):
        with p:
            print(f"... placement {p.describe()}", flush=True)
            fl = floor(p, 1000)
            rows = measure(p, steps)
            splits = {n: split_floor(p, n, steps) for n in rows if n > 1}
            per[p.name] = {"floor": fl, "load": os.getloadavg()[0], "rows": rows, "split": splits}
    print_table(
        "disco demo against NumPy, steps taken in turn (ms per step, medians)",
        ["placement", "workers", "disco", "numpy", "overhead", "speed vs numpy", "target",
         "split floor", "floor vs numpy"],
        [
            [
                name,
                n,
                f"{r.median * 1e3:.2f}",
                f"{r.numpy_median * 1e3:.2f}",
                f"{r.overhead * 1e3:.2f}",
                f"{r.speedup:.2f}x",
                f">= {TARGETS[n]}x {'yes' if r.speedup >= TARGETS[n] else 'NO'}",
                f"{res['split'][n] * 1e3:.2f}" if n in res["split"] else None,
                f"{r.numpy_median / res['split'][n]:.2f}x" if n in res["split"] else None,
            ]
            for name, res in per.items()
            for n, r in res["rows"].items()
        ],
    )  # fmt: skip
    print(
        "split floor = the same shards in plain processes placed as the Disco job's, with "
        "no Disco and no communication (ms per step); floor vs numpy = the speed that "
        "leaves for Disco's own work, against the same NumPy median"
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
                    "split_floor_ms": res["split"][n] * 1e3 if n in res["split"] else None,
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
