"""Control-plane benchmark of disco_core, side by side with TVM's Disco when installed.

Measures, for ThreadedSession and ProcessSession with 2 and 4 workers:

* round trip: one ``call_packed`` + ``sync_worker_0`` (median over many);
* async: 10,000 ``call_packed`` (results dropped) followed by one ``sync_worker_0``,
  reported per call;
* ``copy_to_worker_0`` / ``copy_from_worker_0`` at 1, 16, 64 MiB (GB/s, 2 workers);
* ProcessSession start-up (constructor until every worker has answered) and
  shutdown, for 2 and 4 workers;
* register leak check: 1,000,000 ``call_packed`` with dropped results, the largest
  ``disco.register_count`` seen on any worker.

Run: ``python bench/bench_core.py [--quick]`` (or ``python bench/run_all.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import (
    MiB,
    fmt_num,
    fmt_size,
    fmt_time,
    gc_paused,
    load_tvm,
    machine_summary,
    print_table,
    ratio,
    save_json,
)
from _placement import PLACEMENTS, Placement, floor, load_average, placements

import disco_core as disco

try:
    import psutil
except ImportError:  # optional: only for "all worker processes exited" after shutdown
    psutil = None


# ---------------------------------------------------------------------------- implementations
class Impl:
    """One runtime under test: how to make a session and wrap host arrays."""

    name = "?"
    func_name = "?"

    def session(self, kind: str, n: int) -> Any:
        raise NotImplementedError

    def host(self, arr: np.ndarray) -> Any:
        return arr

    def to_numpy(self, arr: Any) -> np.ndarray:
        return arr

    def empty0(self, sess: Any, nelem: int) -> Any:
        return sess.empty((nelem,), "float32", worker0_only=True)

    def shutdown(self, sess: Any) -> None:
        sess.shutdown()

    def copy_to(self, sess: Any, host: Any, remote: Any) -> None:
        sess.copy_to_worker_0(host, remote)  # ours returns once worker 0 holds the data

    def copy_from(self, sess: Any, host: Any, remote: Any) -> None:
        sess.copy_from_worker_0(host, remote)  # ours returns once host holds the data


class Ours(Impl):
    name = "ours"
    func_name = "disco.worker_id"

    def session(self, kind: str, n: int) -> Any:
        cls = disco.ThreadedSession if kind == "threaded" else disco.ProcessSession
        return cls(n)


class TVM(Impl):
    name = "TVM"
    func_name = "runtime.disco.worker_id"

    def __init__(self, tvm_disco: Any) -> None:
        import tvm

        self.tvm = tvm
        self.mod = tvm_disco

    def session(self, kind: str, n: int) -> Any:
        cls = self.mod.ThreadedSession if kind == "threaded" else self.mod.ProcessSession
        return cls(num_workers=n)

    def host(self, arr: np.ndarray) -> Any:
        return self.tvm.runtime.tensor(arr)

    def shutdown(self, sess: Any) -> None:
        # TVM 0.27 aborts the process ("Write Error: Broken pipe") when a cached
        # DPackedFunc of a ProcessSession is freed after shutdown: free them first.
        cache = getattr(sess, "_cache", None)
        if cache:
            cache.clear()
        sess.shutdown()

    def to_numpy(self, arr: Any) -> np.ndarray:
        return arr.numpy()

    # TVM's copies only enqueue the command: the data is in place after a sync.
    def copy_to(self, sess: Any, host: Any, remote: Any) -> None:
        sess.copy_to_worker_0(host, remote)
        sess.sync_worker_0()

    def copy_from(self, sess: Any, host: Any, remote: Any) -> None:
        sess.copy_from_worker_0(host, remote)
        sess.sync_worker_0()


# ---------------------------------------------------------------------------- measurements
def wait_all_workers(sess: Any, func: Any) -> None:
    """Return once every worker has run a command (public API only, both runtimes)."""
    ref = func()
    for w in range(sess.num_workers):
        ref.debug_get_from_remote(w)


def round_trip_samples(sess: Any, func: Any, reps: int) -> list[float]:
    """Wall times of ``reps`` round trips (call_packed + sync_worker_0)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        func()
        sess.sync_worker_0()
        times.append(time.perf_counter() - t0)
    return times


def worker1_samples(sess: Any, func: Any, reps: int, call: bool) -> list[float]:
    """Wall times of ``reps`` syncs with worker 1 (a worker process): ``_sync_worker(1)``,
    after a ``call_packed`` when ``call`` (TVM's private method of the same name)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if call:
            func()
        sess._sync_worker(1)
        times.append(time.perf_counter() - t0)
    return times


def async_sample(sess: Any, func: Any, calls: int) -> float:
    """Seconds per call of ``calls`` async call_packed (results dropped) + one sync."""
    t0 = time.perf_counter()
    for _ in range(calls):
        func()
    sess.sync_worker_0()
    return (time.perf_counter() - t0) / calls


def interleaved(
    subjects: dict[str, Any], sample: Callable[[Any], list[float]], rounds: int
) -> dict[str, float]:
    """Median of samples taken in alternating rounds, so the machine's drifting
    load hits every runtime alike."""
    samples: dict[str, list[float]] = {name: [] for name in subjects}
    with gc_paused():
        for _ in range(rounds):
            for name, subject in subjects.items():
                samples[name] += sample(subject)
    return {name: statistics.median(v) for name, v in samples.items()}


def bench_copies(runs: dict[str, tuple], sizes: list[int], quick: bool) -> dict:
    """GB/s of copy_to/from_worker_0 per size, sampled alternately across runtimes."""
    out: dict[str, dict] = {name: {} for name in runs}
    for nbytes in sizes:
        nelem = nbytes // 4
        data = np.random.default_rng(0).random(nelem, dtype=np.float32)
        bufs = {}
        for name, (impl, sess, _) in runs.items():
            host = impl.host(data)
            host_out = impl.host(np.zeros(nelem, dtype=np.float32))
            bufs[name] = (impl, sess, host, host_out, impl.empty0(sess, nelem))
        reps = 3 if quick else max(5, min(30, (256 * MiB) // nbytes))

        def sample_to(b: tuple) -> list[float]:
            impl, sess, host, _, remote = b
            t0 = time.perf_counter()
            impl.copy_to(sess, host, remote)
            return [time.perf_counter() - t0]

        def sample_from(b: tuple) -> list[float]:
            impl, sess, _, host_out, remote = b
            t0 = time.perf_counter()
            impl.copy_from(sess, host_out, remote)
            return [time.perf_counter() - t0]

        interleaved(bufs, sample_to, 1)  # warm-up (page faults of fresh buffers)
        interleaved(bufs, sample_from, 1)
        t_to = interleaved(bufs, sample_to, reps)
        t_from = interleaved(bufs, sample_from, reps)
        for name, (impl, _, _, host_out, _) in bufs.items():
            if not np.array_equal(impl.to_numpy(host_out), data):
                raise AssertionError(f"{name}: copy round trip of {fmt_size(nbytes)} is wrong")
            out[name][nbytes] = {"to_s": t_to[name], "from_s": t_from[name]}
        del bufs
    return out


def open_sessions(impls: list[Impl], kind: str, n: int) -> dict[str, tuple]:
    """``{name: (impl, session, worker_id function)}``, every worker ready."""
    runs: dict[str, tuple] = {}
    try:
        for impl in impls:
            sess = impl.session(kind, n)
            runs[impl.name] = (impl, sess, sess.get_global_func(impl.func_name))
            wait_all_workers(sess, runs[impl.name][2])
    except BaseException:
        close_sessions(runs)
        raise
    return runs


def close_sessions(runs: dict[str, tuple]) -> None:
    # Free every handle before its session shuts down (TVM aborts otherwise).
    while runs:
        _, (impl, sess, _) = runs.popitem()
        impl.shutdown(sess)


def children_pids() -> list[int]:
    if psutil is None:
        return []
    return [p.pid for p in psutil.Process().children(recursive=True)]


def bench_startup(impl: Impl, n: int, reps: int, p: Placement) -> dict:
    starts, stops, gone = [], [], []
    for _ in range(reps):
        before = set(children_pids())
        t0 = time.perf_counter()
        with p.spawning():
            sess = impl.session("process", n)
        func = sess.get_global_func(impl.func_name)
        wait_all_workers(sess, func)
        starts.append(time.perf_counter() - t0)
        kids = [p for p in children_pids() if p not in before]
        del func
        t0 = time.perf_counter()
        impl.shutdown(sess)
        # Dropping the session at once is part of shutting down: TVM's destructor waits
        # for its workers (and aborts the process when they have already exited).
        del sess
        stops.append(time.perf_counter() - t0)
        if psutil is not None:
            procs = []
            for pid in kids:
                try:
                    procs.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=10)
            gone.append(time.perf_counter() - t0 if not alive else float("inf"))
        gc.collect()
    return {
        "start_s": statistics.median(starts),
        "shutdown_s": statistics.median(stops),
        "exited_s": statistics.median(gone) if gone else None,
    }


def bench_leak(sess: Any, func: Any, calls: int) -> dict:
    count = sess.get_global_func("disco.register_count")

    def counts() -> list[int]:
        ref = count()
        return [int(ref.debug_get_from_remote(w)) for w in range(sess.num_workers)]

    sess.sync_worker_0()
    baseline = max(counts())
    peak = baseline
    chunk = min(100_000, calls)
    t0 = time.perf_counter()
    done = 0
    with gc_paused():
        while done < calls:
            for _ in range(min(chunk, calls - done)):
                func()
            done += chunk
            sess.sync_worker_0()
            peak = max(peak, *counts())
    elapsed = time.perf_counter() - t0
    final = max(counts())
    return {
        "calls": calls,
        "baseline": baseline,
        "max": peak,
        "final": final,
        "calls_per_s": calls / elapsed,
    }


def versus(ours: dict, tvm: dict | None, key: str) -> list[str]:
    """Table cells for ``key``: ours, TVM's (``-`` without TVM) and their ratio."""
    t = tvm and tvm[key]
    return [fmt_time(ours[key]), fmt_time(t), fmt_num(ratio(ours[key], t))]


# ---------------------------------------------------------------------------- driver
KINDS = ("threaded", "process")
SIZES = (2, 4)


def measure_placement(
    p: Placement, impls: list[Impl], quick: bool, leak_calls: int | None
) -> dict[str, Any]:
    """Every comparison of this benchmark under placement ``p`` (inside ``with p:``)."""
    rt_reps = 300 if quick else 2000
    async_calls, async_reps = 10_000, (1 if quick else 3)
    copy_sizes = [1 * MiB, 16 * MiB, 64 * MiB]
    out: dict[str, Any] = {"floor": floor(p), "load": os.getloadavg()[0]}
    ctl: dict = {}
    copies: dict = {}
    leak: dict = {}
    for kind in KINDS:
        for n in SIZES:
            # Every runtime's session of this shape is open at once, measured in turns.
            with p.spawning():
                runs = open_sessions(impls, kind, n)
            try:
                interleaved(runs, lambda r: round_trip_samples(r[1], r[2], 50), 1)  # warm-up
                rt = interleaved(runs, lambda r: round_trip_samples(r[1], r[2], rt_reps // 10), 10)
                interleaved(runs, lambda r: [async_sample(r[1], r[2], async_calls)], 1)
                per_call = interleaved(
                    runs, lambda r: [async_sample(r[1], r[2], async_calls)], async_reps
                )
                for name in runs:
                    ctl[(kind, n, name)] = {
                        "round_trip_s": rt[name],
                        "async_per_call_s": per_call[name],
                    }
                if kind == "process" and n == 2:
                    for call, key in ((True, "call_sync1_s"), (False, "sync1_s")):
                        interleaved(runs, lambda r, c=call: worker1_samples(r[1], r[2], 50, c), 1)
                        got = interleaved(
                            runs,
                            lambda r, c=call: worker1_samples(r[1], r[2], rt_reps // 10, c),
                            10,
                        )
                        for name in runs:
                            ctl[(kind, n, name)][key] = got[name]
                if n == 2:
                    for name, v in bench_copies(runs, copy_sizes, quick).items():
                        copies[(kind, name)] = v
                    if leak_calls:
                        leak[kind] = bench_leak(runs["ours"][1], runs["ours"][2], leak_calls)
            finally:
                close_sessions(runs)
    startup: dict = {}
    reps = 1 if quick else 3
    for n in SIZES:
        for impl in impls:
            startup[(n, impl.name)] = bench_startup(impl, n, reps, p)
    out.update(ctl=ctl, copies=copies, leak=leak, startup=startup, copy_sizes=copy_sizes)
    return out


def targets(res: dict[str, Any], tvm: bool) -> list[tuple[str, float | None, bool]]:
    """The targets of the speed issues, checked in one placement's results."""
    ctl, copies, startup = res["ctl"], res["copies"], res["startup"]
    checks: list[tuple[str, float | None, bool]] = []

    def versus_tvm(label: str, key: str, n: int) -> None:
        o = ctl[("process", n, "ours")][key]
        t = ctl.get(("process", n, "TVM"), {}).get(key)
        r = ratio(o, t)
        checks.append((label, r, r is not None and r <= 1.0))

    if tvm:
        versus_tvm("process round trip n=2 <= 1.0x TVM", "round_trip_s", 2)
        versus_tvm("process round trip n=4 <= 1.0x TVM", "round_trip_s", 4)
        versus_tvm("process async/call n=2 <= 1.0x TVM", "async_per_call_s", 2)
        versus_tvm("process async/call n=4 <= 1.0x TVM", "async_per_call_s", 4)
    for kind in KINDS:
        cps = 1 / ctl[(kind, 2, "ours")]["async_per_call_s"]
        checks.append((f"{kind} async >= 100k calls/s (n=2)", cps, cps >= 100_000))
    for kind in KINDS:
        t = copies.get((kind, "TVM"))
        if t:
            o = copies[(kind, "ours")]
            speedups = [t[s][d] / o[s][d] for s in res["copy_sizes"] for d in ("to_s", "from_s")]
            geo = float(np.exp(np.mean(np.log(speedups))))
            # Copies are memory-bound in both runtimes: allow 5% for this machine's noise.
            checks.append((f"{kind} copies >= TVM bandwidth (geomean ours/TVM)", geo, geo >= 0.95))
    # A ratio: the absolute time is four Python start-ups, on one CPU in two placements.
    ready4 = startup[(4, "ours")]["start_s"]
    if tvm and (4, "TVM") in startup:
        r = ratio(ready4, startup[(4, "TVM")]["start_s"])
        checks.append(
            ("4-worker ProcessSession ready <= 0.25x TVM", r, r is not None and r <= 0.25)
        )
    return checks


def run(quick: bool = False, tvm: bool = True, only: list[str] | None = None) -> dict:
    impls: list[Impl] = [Ours()]
    tvm_disco = load_tvm() if tvm else None
    if tvm_disco is not None:
        impls.append(TVM(tvm_disco))
    names = [i.name for i in impls]
    leak_calls = 100_000 if quick else 1_000_000
    results: dict[str, Any] = {"machine": machine_summary(), "impls": names, "quick": quick}

    print(f"bench_core: {machine_summary()}; {load_average()}")
    print(f"runtimes: {', '.join(names)}; disco_core {disco.__version__}")
    per: dict[str, dict] = {}
    for p in placements(only):
        with p:
            print(f"... placement {p.describe()}", flush=True)
            # the leak check is no comparison: once, in the first placement
            per[p.name] = measure_placement(p, impls, quick, leak_calls if not per else None)
    have_tvm = "TVM" in names

    print_table(
        "the physical floor in each placement (this run)",
        ["placement", "load avg", "pipe ping-pong", "socket ping-pong", "memcpy GB/s"],
        [
            [
                name,
                f"{r['load']:.2f}",
                fmt_time(r["floor"]["pipe_rt_s"]),
                fmt_time(r["floor"]["socket_rt_s"]),
                fmt_num(r["floor"]["memcpy_GBps"], 1),
            ]
            for name, r in per.items()
        ],
    )

    rows = []
    for name, r in per.items():
        ctl = r["ctl"]
        for kind in KINDS:
            for n in SIZES:
                o = ctl[(kind, n, "ours")]
                t = ctl.get((kind, n, "TVM"))
                ours, tvm, ratio_ = versus(o, t, "async_per_call_s")
                rows.append(
                    [
                        f"{name:8s} {kind:8s} n={n}",
                        *versus(o, t, "round_trip_s"),
                        ours,
                        f"{1 / o['async_per_call_s'] / 1e3:.0f}k",
                        tvm,
                        ratio_,
                    ]
                )
    print_table(
        "control plane (medians; ratio = ours/TVM time, < 1 is faster)",
        [
            "placement session",
            "rt ours",
            "rt TVM",
            "rt ratio",
            "async/call ours",
            "calls/s",
            "async/call TVM",
            "async ratio",
        ],
        rows,
    )

    rows = []
    for name, r in per.items():
        o = r["ctl"][("process", 2, "ours")]
        t = r["ctl"].get(("process", 2, "TVM"))
        rows.append(
            [f"{name:8s} process  n=2", *versus(o, t, "call_sync1_s"), *versus(o, t, "sync1_s")]
        )
    print_table(
        "sync with a worker process (medians; no target: worker 0's round trip is the row above)",
        [
            "placement session",
            "call+sync(1) ours",
            "TVM",
            "ratio",
            "sync(1) ours",
            "TVM",
            "ratio",
        ],
        rows,
    )

    rows = []
    for name, r in per.items():
        copies = r["copies"]
        for kind in KINDS:
            for nbytes in r["copy_sizes"]:
                o = copies[(kind, "ours")][nbytes]
                t = copies.get((kind, "TVM"), {}).get(nbytes)
                o_to, o_from = nbytes / o["to_s"] / 1e9, nbytes / o["from_s"] / 1e9
                t_to = t and nbytes / t["to_s"] / 1e9
                t_from = t and nbytes / t["from_s"] / 1e9
                rows.append(
                    [
                        f"{name:8s} {kind:8s} {fmt_size(nbytes):>6s}",
                        fmt_num(o_to),
                        fmt_num(t_to),
                        fmt_num(ratio(o_to, t_to)),
                        fmt_num(o_from),
                        fmt_num(t_from),
                        fmt_num(ratio(o_from, t_from)),
                    ]
                )
    print_table(
        "copies to/from worker 0, 2 workers, GB/s (ratio = ours/TVM, > 1 is faster)",
        [
            "placement session size",
            "to ours",
            "to TVM",
            "to ratio",
            "from ours",
            "from TVM",
            "from ratio",
        ],
        rows,
    )

    rows = []
    for name, r in per.items():
        startup = r["startup"]
        for n in SIZES:
            o = startup[(n, "ours")]
            t = startup.get((n, "TVM"))
            rows.append(
                [
                    f"{name:8s} process n={n}",
                    fmt_time(o["start_s"]),
                    fmt_time(t and t["start_s"]),
                    fmt_num(ratio(o["start_s"], t and t["start_s"])),
                    fmt_time(o["shutdown_s"]),
                    fmt_time(t and t["shutdown_s"]),
                    fmt_time(o["exited_s"]),
                    fmt_time(t and t["exited_s"]),
                ]
            )
    print_table(
        "ProcessSession start-up and shutdown (median; ratio = ours/TVM)",
        [
            "placement session",
            "ready ours",
            "ready TVM",
            "ratio",
            "shutdown ours",
            "shutdown TVM",
            "exited ours",
            "exited TVM",
        ],
        rows,
    )

    leak = next(iter(per.values()))["leak"]
    rows = [
        [
            f"{kind:8s} n=2",
            f"{r['calls']:,}",
            r["baseline"],
            r["max"],
            r["final"],
            f"{r['calls_per_s'] / 1e3:.0f}k",
            "ok" if r["max"] - r["baseline"] <= 64 else "LEAK?",
        ]
        for kind, r in leak.items()
    ]
    print_table(
        "register leak check: call_packed with dropped results (disco.register_count, max over workers)",
        ["session", "calls", "registers before", "max seen", "after", "calls/s", "verdict"],
        rows,
    )

    # -- targets: met only when met in every placement -----------------------------------
    checked = {name: targets(r, have_tvm) for name, r in per.items()}
    labels = [c[0] for c in next(iter(checked.values()))]
    rows = []
    all_met = True
    for i, label in enumerate(labels):
        cells = []
        met = True
        for name in per:
            _, v, ok = checked[name][i]
            cells.append("-" if v is None else f"{v:,.3g}{'' if ok else ' (NO)'}")
            met = met and ok and v is not None
        all_met = all_met and met
        rows.append([label, *cells, "yes" if met else "NO"])
    print_table(
        "targets (a value is ours/TVM or ours; met = met in every placement)",
        ["target", *per, "met"],
        rows,
    )
    print(f"\nall targets met in every placement: {'yes' if all_met else 'NO'}")

    def keyed(d: dict) -> dict:
        return {"/".join(map(str, k)): v for k, v in d.items()}

    results["placements"] = {
        name: {
            "floor": r["floor"],
            "load": r["load"],
            "control": keyed(r["ctl"]),
            "copies": keyed(r["copies"]),
            "startup": keyed(r["startup"]),
            "targets": [{"target": c[0], "value": c[1], "met": c[2]} for c in checked[name]],
        }
        for name, r in per.items()
    }
    results["leak"] = leak
    results["all_targets_met"] = all_met
    path = save_json("bench_core.json", results)
    print(f"\nresults written to {path}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about 4x faster)")
    ap.add_argument("--no-tvm", action="store_true", help="skip TVM even when installed")
    ap.add_argument(
        "--placements",
        default=",".join(PLACEMENTS),
        help=f"comma-separated CPU placements to run (default: all of {', '.join(PLACEMENTS)})",
    )
    args = ap.parse_args(argv)
    run(quick=args.quick, tvm=not args.no_tvm, only=args.placements.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
