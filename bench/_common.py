"""Helpers shared by the benchmarks: timing, table printing, optional peers."""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
MiB = 1 << 20
KiB = 1 << 10

# Workers import ``_bench_funcs`` the way the controller does: process workers get
# the controller's sys.path (DISCO_SYS_PATH), so putting bench/ on it is enough.
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


def now() -> float:
    return time.perf_counter()


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class gc_paused:
    """Pause the cyclic garbage collector around a timed region."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was:
            gc.enable()


def fmt_size(nbytes: int) -> str:
    if nbytes >= MiB:
        return f"{nbytes // MiB} MiB"
    if nbytes >= KiB:
        return f"{nbytes // KiB} KiB"
    return f"{nbytes} B"


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a plain-text table with right-aligned columns (first column left-aligned)."""
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    print()
    print(f"== {title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))
    sys.stdout.flush()


def machine_summary() -> str:
    return (
        f"{platform.node()} | {platform.machine()} | {os.cpu_count()} CPUs | "
        f"Python {platform.python_version()} | NumPy {np.__version__}"
    )


def memcpy_bandwidth(nbytes: int = 64 * MiB, reps: int = 7) -> float:
    """Bytes per second of ``np.copyto`` between two large float32 arrays (median)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    t = median_time(lambda: np.copyto(dst, src), reps, warmup=2)
    return nbytes / t


def load_tvm() -> Any | None:
    """``tvm.runtime.disco`` ready for use, or None (with the reason printed)."""
    if os.environ.get("BENCH_NO_TVM"):
        return None
    try:
        import tvm  # noqa: F401
        import tvm_ffi

        # apache-tvm 0.27 does not register the disco FFI functions by itself.
        tvm_ffi.init_ffi_api("runtime.disco", "tvm.runtime.disco._ffi_api")
        import tvm.runtime.disco as tvm_disco
    except Exception as exc:  # not installed, or a build without disco
        print(
            f"(TVM not available: {type(exc).__name__}: {exc}; pip install apache-tvm cloudpickle psutil)"
        )
        return None
    return tvm_disco


def save_json(name: str, payload: Any) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
