"""``disco demo``: a tensor-parallel transformer MLP block, checked against NumPy.

The block is ``y = gelu(x @ W1) @ W2`` with ``W1`` of shape ``(d_model, d_ff)`` and
``W2`` of shape ``(d_ff, d_model)``, split Megatron-style over ``n`` workers:

* ``W1`` is split by columns (column-parallel): worker ``w`` holds
  ``W1[:, w*f:(w+1)*f]`` with ``f = d_ff / n``;
* ``W2`` is split by rows (row-parallel): worker ``w`` holds ``W2[w*f:(w+1)*f, :]``;
* every worker computes ``gelu(x @ W1_w) @ W2_w``, a partial output of the full
  shape, with no communication (GELU acts elementwise on its own hidden columns);
* an ``allreduce`` (sum) of the partial outputs gives every worker ``y``.

The weights are made on the controller and sent to the workers with
``Session.scatter``; each step broadcasts the batch with ``Session.broadcast``,
runs the shard function (``disco_core.demo_funcs.mlp_shard``), allreduces and copies the
result back from worker 0. The result is compared with the single-process NumPy
computation; the command fails (exit code 1) when the error is above tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from . import _procfs, demo_funcs
from .errors import DiscoError
from .tracing import session_trace as tracing

__all__ = ["add_arguments", "run", "main", "DemoResult"]

_DEFAULT_TOL = {"float32": 1e-4, "float64": 1e-10}
#: timed steps of NumPy, then of Disco, per block (see ``_run_session``)
_BLOCK = 5


@dataclass
class DemoResult:
    """One row of the demo's table."""

    label: str
    workers: int | None
    step_times: list[float] = field(default_factory=list)
    start_s: float | None = None
    setup_s: float | None = None
    errors: dict[int, float] = field(default_factory=dict)
    failure: str | None = None
    blas: str = "default"
    #: NumPy steps taken in turn with this row's steps (same machine state)
    numpy_times: list[float] = field(default_factory=list)
    #: per step: the step's time minus worker 0's time in the matrix products and GELU
    overheads: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def numpy_median(self) -> float:
        return statistics.median(self.numpy_times) if self.numpy_times else float("nan")

    @property
    def overhead(self) -> float:
        return statistics.median(self.overheads) if self.overheads else float("nan")

    @property
    def speedup(self) -> float:
        """NumPy's time over this row's, from the steps taken in turn."""
        return self.numpy_median / self.median

    @property
    def max_error(self) -> float:
        return max(self.errors.values()) if self.errors else float("nan")


def _worker_counts(values: list[str]) -> list[int]:
    counts: list[int] = []
    for value in values:
        text = str(value).strip()
        if re.search(r"(^|,)\s*(,|$)", text):  # "1,,2", ",2", "2,": a count left out
            raise argparse.ArgumentTypeError(
                f"--workers: {value!r} has an empty count between commas (give '1,2,4')"
            )
        for part in text.replace(",", " ").split():
            try:
                n = int(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"--workers takes integers such as '1,2,4' or '1 2 4', got {part!r}"
                ) from None
            if n < 1:
                raise argparse.ArgumentTypeError(f"--workers: a worker count must be >= 1, got {n}")
            if n not in counts:
                counts.append(n)
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (used by ``disco demo``)."""
    parser.add_argument(
        "--d-model", type=int, default=1024, metavar="N", help="model width (default: 1024)"
    )
    parser.add_argument(
        "--d-ff",
        type=int,
        default=4096,
        metavar="N",
        help="hidden width of the MLP; must be divisible by every worker count (default: 4096)",
    )
    parser.add_argument(
        "--batch", type=int, default=64, metavar="N", help="tokens per step (default: 64)"
    )
    parser.add_argument(
        "--workers",
        nargs="+",
        default=["1,2,4"],
        metavar="N",
        help="worker counts to run, as '1,2,4' or '1 2 4' (default: 1,2,4)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        metavar="N",
        help="timed steps per configuration (default: 20)",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, metavar="N", help="untimed steps first (default: 2)"
    )
    parser.add_argument(
        "--session",
        choices=("process", "threaded"),
        default="process",
        help="process: worker 0 in this process, the others child processes (default); "
        "threaded: every worker a thread of this process",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="(default: float32)"
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=None,
        help="largest accepted max abs error against NumPy "
        "(default: 1e-4 for float32, 1e-10 for float64)",
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        metavar="N",
        help="BLAS threads per worker (default: CPU cores / workers, at least 1; "
        "0: leave the BLAS alone)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--trace",
        default=None,
        metavar="FILE.json",
        help="trace every session into this file (one per worker count: FILE.<n>w.json when "
        "several run); read it with 'disco trace summary FILE' or open it in Perfetto",
    )


def _say(text: str) -> None:
    print(text, flush=True)


def _validate(args: argparse.Namespace) -> list[int]:
    counts = _worker_counts(args.workers)
    if not counts:
        raise ValueError("--workers: give at least one worker count")
    for name in ("d_model", "d_ff", "batch", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.tol is not None and not 0 <= args.tol < math.inf:  # NaN: none could pass; inf: all
        raise ValueError(f"--tol must be a finite number >= 0, got {args.tol}")
    if args.blas_threads is not None and args.blas_threads < 0:
        raise ValueError(
            f"--blas-threads must be >= 0 (0: leave the BLAS alone), got {args.blas_threads}"
        )
    if args.trace is not None and not args.trace.strip():
        raise ValueError("--trace: give a file name (FILE.json)")
    if args.seed < 0:  # NumPy's generator takes none
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.trace:
        tracing.Trace.check_path(args.trace)
        for n in counts:  # each row's own file (FILE.<n>w.json), before any row runs
            tracing.Trace.check_path(trace_path(args, n))
    bad = [n for n in counts if args.d_ff % n]
    if bad:
        raise ValueError(
            f"--d-ff {args.d_ff} is not divisible by worker count(s) {bad}: each worker "
            "holds d_ff / workers columns of W1 and rows of W2"
        )
    return counts


def _make_problem(args: argparse.Namespace):
    rng = np.random.default_rng(args.seed)
    dtype = np.dtype(args.dtype)
    # Scaled so that the hidden layer and the output are O(1), as in a trained model.
    x = rng.standard_normal((args.batch, args.d_model)).astype(dtype)
    w1 = (rng.standard_normal((args.d_model, args.d_ff)) / np.sqrt(args.d_model)).astype(dtype)
    w2 = (rng.standard_normal((args.d_ff, args.d_model)) / np.sqrt(args.d_ff)).astype(dtype)
    return x, w1, w2


def shard_weights(w1: np.ndarray, w2: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack the shards along a new first axis of length ``n`` (what ``scatter`` wants).

    Returns ``(w1_shards, w2_shards)`` with ``w1_shards[w] == W1[:, w*f:(w+1)*f]`` and
    ``w2_shards[w] == W2[w*f:(w+1)*f, :]``.
    """
    d_model, d_ff = w1.shape
    f = d_ff // n
    w1_shards = np.ascontiguousarray(w1.reshape(d_model, n, f).transpose(1, 0, 2))
    w2_shards = np.ascontiguousarray(w2.reshape(n, f, d_model))
    return w1_shards, w2_shards


def _run_numpy(x, w1, w2, args, ref) -> DemoResult:
    res = DemoResult("numpy (1 process, no Disco)", None)
    threads = demo_funcs.blas_threads()
    res.blas = "?" if threads is None else str(threads)
    for _ in range(args.warmup):
        demo_funcs.mlp_reference(x, w1, w2)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        y = demo_funcs.mlp_reference(x, w1, w2)
        res.step_times.append(time.perf_counter() - t0)
    res.numpy_times = res.step_times
    res.overheads = [0.0]
    res.errors[0] = float(np.max(np.abs(y - ref)))
    return res


def _numpy_steps(x, w1, w2, threads: int | None, count: int) -> list[float]:
    """``count`` NumPy steps with the controller's BLAS threads set to ``threads``; their seconds.

    Worker 0 shares this process (and its BLAS), so the caller sets worker 0's share
    back afterwards.
    """
    if threads is not None:
        demo_funcs.blas_threads(threads)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        demo_funcs.mlp_reference(x, w1, w2)
        times.append(time.perf_counter() - t0)
    return times


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> str:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    busy = ": other work is running, timings will be noisy" if load >= 0.5 * _cores() else ""
    return f" (load average {load:.1f}{busy})"


def _open_session(kind: str, n: int):
    from .session import ProcessSession, ThreadedSession

    return ProcessSession(n) if kind == "process" else ThreadedSession(n)


def trace_path(args: argparse.Namespace, n: int) -> str | None:
    """The trace file of the ``n``-worker row (None without ``--trace``)."""
    if not args.trace:
        return None
    counts = _worker_counts(args.workers)
    if len(counts) == 1:
        return args.trace
    stem, ext = os.path.splitext(args.trace)
    return f"{stem}.{n}w{ext or '.json'}"


@contextlib.contextmanager
def _traced(sess, args: argparse.Namespace, n: int) -> Iterator[str | None]:
    path = trace_path(args, n)
    if path is None:
        yield None
        return
    with tracing.trace(sess, path):
        yield path


def _run_session(x, w1, w2, args, ref, n: int) -> DemoResult:
    tag = f"[{_workers(n)}]"
    res = DemoResult(f"disco {args.session}, {_workers(n)}", n)
    kind = "ProcessSession" if args.session == "process" else "ThreadedSession"
    _say(f"{tag} starting {kind}({n}) ...")
    t0 = time.perf_counter()
    with _open_session(args.session, n) as sess, _traced(sess, args, n) as trace_path:
        res.start_s = time.perf_counter() - t0
        _say(f"{tag} workers ready in {res.start_s:.2f} s")
        if trace_path:
            _say(f"{tag} tracing into {trace_path}")

        t0 = time.perf_counter()
        sess.init_ccl("shm")
        sess.import_python_module("disco_core.demo_funcs")
        mlp = sess.get_global_func(demo_funcs.MLP_SHARD)
        threads = args.blas_threads if args.blas_threads is not None else max(1, _cores() // n)
        numpy_threads = None
        if threads > 0:
            # Every worker gets its share of the cores (one BLAS thread pool per core
            # would oversubscribe the machine n times over).
            old = sess.call_packed(demo_funcs.BLAS_THREADS, threads).debug_get_from_remote(0)
            res.blas = str(threads) if old is not None else "?"
            numpy_threads = old  # the controller's own, for its NumPy steps
        w1_shards, w2_shards = shard_weights(w1, w2, n)
        w1_ref = sess.scatter(w1_shards)  # worker w: (d_model, d_ff/n), columns of W1
        w2_ref = sess.scatter(w2_shards)  # worker w: (d_ff/n, d_model), rows of W2
        x_ref = sess.empty(x.shape, x.dtype)
        # summed in place, as torch.distributed's all_reduce does: no second buffer,
        # and one copy of the output a step fewer
        partial = sess.empty(ref.shape, ref.dtype)
        sess.sync_worker_0()
        res.setup_s = time.perf_counter() - t0
        mib = (w1.nbytes + w2.nbytes) / 2**20
        _say(
            f"{tag} init_ccl('shm') + scatter of W1, W2 ({mib:.1f} MiB) done in "
            f"{res.setup_s:.2f} s; BLAS threads per worker: {res.blas}; "
            f"running {args.warmup} warm-up + {args.steps} timed steps ..."
        )

        y = np.empty(ref.shape, ref.dtype)

        def disco_step() -> tuple[float, float]:
            t0 = time.perf_counter()
            sess.broadcast(x, x_ref)
            compute = mlp(x_ref, w1_ref, w2_ref, partial)
            sess.allreduce(partial, partial, "sum")
            sess.copy_from_worker_0(y, partial)
            step_s = time.perf_counter() - t0
            return step_s, step_s - float(compute.debug_get_from_remote(0))

        _numpy_steps(x, w1, w2, numpy_threads, args.warmup)
        if numpy_threads is not None:
            demo_funcs.blas_threads(threads)  # worker 0's share again
        for _ in range(args.warmup):
            disco_step()
        # NumPy and Disco in blocks of steps taken in turn, so that both see the same
        # machine (a small VM's speed drifts by tens of percent from one second to the
        # next). Before each block the threads the other side left spinning are given
        # time to stop (OpenBLAS's idle threads poll for ~0.1 s after NumPy's steps);
        # the first step of a block is not timed.
        done = 0
        while done < args.steps:
            k = min(_BLOCK, args.steps - done)
            _procfs.wait_until_idle()
            res.numpy_times += _numpy_steps(x, w1, w2, numpy_threads, k + 1)[1:]
            if numpy_threads is not None:
                demo_funcs.blas_threads(threads)
            _procfs.wait_until_idle()
            for i in range(k + 1):
                step_s, overhead_s = disco_step()
                if i:
                    res.step_times.append(step_s)
                    res.overheads.append(overhead_s)
            done += k
        # Worker 0's copy came back with the last step; every other worker must agree.
        res.errors[0] = float(np.max(np.abs(y - ref)))
        for w in range(1, n):
            other = np.asarray(partial.debug_get_from_remote(w))
            res.errors[w] = float(np.max(np.abs(other - ref)))
    return res


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1e3:.2f}"


def _table(results: list[DemoResult], flops: float) -> str:
    header = (
        "configuration",
        "BLAS thr",
        "start s",
        "setup s",
        "ms/step",
        "numpy ms",
        "overhead ms",
        "GFLOP/s",
        "speedup",
        "max |err|",
    )
    rows = [header]
    for r in results:
        if r.failure:
            rows.append((r.label, r.blas, "-", "-", "-", "-", "-", "-", "-", "FAILED"))
            continue
        med = r.median
        rows.append(
            (
                r.label,
                r.blas,
                "-" if r.start_s is None else f"{r.start_s:.2f}",
                "-" if r.setup_s is None else f"{r.setup_s:.2f}",
                _fmt_ms(med),
                _fmt_ms(r.numpy_median),
                _fmt_ms(r.overhead),
                f"{flops / med / 1e9:.1f}",
                f"{r.speedup:.2f}x",
                "reference" if r.workers is None else f"{r.max_error:.2e}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; return the process exit code."""
    try:
        counts = _validate(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"disco demo: error: {exc}", file=sys.stderr)
        return 2
    tol = args.tol if args.tol is not None else _DEFAULT_TOL[args.dtype]
    flops = 4.0 * args.batch * args.d_model * args.d_ff  # two matmuls, 2 flops per MAC

    _say("Disco demo: Megatron-style tensor-parallel transformer MLP block, y = gelu(x @ W1) @ W2")
    _say(
        f"  x: {args.batch} x {args.d_model}, W1: {args.d_model} x {args.d_ff} (split by columns), "
        f"W2: {args.d_ff} x {args.d_model} (split by rows), {args.dtype}"
    )
    _say(
        f"  {args.session} session, shm CCL, workers {', '.join(map(str, counts))}; "
        f"{args.warmup} warm-up + {args.steps} timed steps each; {_cores()} CPU cores{_load()}"
    )
    _say(
        "  a step = broadcast x, shard MLP on every worker, allreduce(sum), copy y back from "
        "worker 0"
    )

    x, w1, w2 = _make_problem(args)
    ref = demo_funcs.mlp_reference(x, w1, w2)
    _say("[numpy] single-process reference ...")
    base = _run_numpy(x, w1, w2, args, ref)
    _say(f"[numpy] {_fmt_ms(base.median)} ms/step")
    results = [base]

    controller_threads = demo_funcs.blas_threads()
    for n in counts:
        try:
            res = _run_session(x, w1, w2, args, ref, n)
        except Exception as exc:
            res = DemoResult(f"disco {args.session}, {_workers(n)}", n)
            res.failure = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, DiscoError):  # not a runtime error we explain: show where
                traceback.print_exc()
            _say(f"[{_workers(n)}] FAILED: {res.failure}")
        else:
            worst = max(res.errors, key=lambda w: res.errors[w])
            verdict = "ok" if res.max_error <= tol else "ABOVE TOLERANCE"
            _say(
                f"[{_workers(n)}] {_fmt_ms(res.median)} ms/step (NumPy in turn: "
                f"{_fmt_ms(res.numpy_median)} ms, overhead {_fmt_ms(res.overhead)} ms); "
                f"max abs error {res.max_error:.2e} (worker {worst}) {verdict}"
            )
        finally:
            # Worker 0 runs in this process: give the controller its BLAS threads back.
            if controller_threads is not None:
                demo_funcs.blas_threads(controller_threads)
        results.append(res)

    _say("")
    _say(_table(results, flops))
    _say("")
    _say(
        "BLAS thr = BLAS threads per worker (cores / workers, at least 1; NumPy: the "
        "process's own); start = constructor until every worker is ready; setup = init_ccl "
        "+ scatter of the weights; ms/step = median; numpy ms = the median of NumPy steps "
        f"taken in blocks of {_BLOCK} in turn with that row's (all cores' BLAS threads; each "
        "block starts once the other side's threads stopped spinning), and speedup = numpy "
        "ms / ms/step; overhead = a step's time outside worker 0's matrix products and GELU "
        "(broadcast, allreduce, copy back, waiting for the other workers, control plane)."
    )

    failed = [r for r in results if r.failure]
    above = [r for r in results if not r.failure and not r.max_error <= tol]
    if failed or above:
        for r in failed:
            _say(f"CHECK FAILED: {r.label}: {r.failure}")
        for r in above:
            _say(f"CHECK FAILED: {r.label}: max abs error {r.max_error:.3e} > tolerance {tol:.1e}")
        return 1
    if args.trace:
        files = [trace_path(args, n) for n in counts]
        _say(f"traces written: {', '.join(f for f in files if f)}; read one with "
             f"'disco trace summary {files[-1]}' (or open it in https://ui.perfetto.dev)")  # fmt: skip
    worst_error = max(r.max_error for r in results)
    _say(f"check passed: max abs error {worst_error:.2e} <= tolerance {tol:.1e} on every worker")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m disco_core.demo``: the same as ``disco demo``."""
    parser = argparse.ArgumentParser(prog="disco demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
