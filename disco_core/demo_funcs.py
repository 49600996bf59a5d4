"""Worker functions of ``disco demo``: one shard of a tensor-parallel transformer MLP.

Imported on every worker with ``session.import_python_module("disco_core.demo_funcs")``.
The controller uses the same :func:`gelu` for its single-process reference, so the
only difference between the two computations is how the matrix products are split
and summed.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .registry import register_func

__all__ = ["gelu", "mlp_reference", "mlp_shard", "blas_threads", "MLP_SHARD", "BLAS_THREADS"]

#: The global name of :func:`mlp_shard`.
MLP_SHARD = "disco_demo.mlp_shard"
#: The global name of :func:`blas_threads`.
BLAS_THREADS = "disco_demo.blas_threads"

_SQRT_2_OVER_PI = 0.7978845608028654


def gelu(h: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (as in GPT-2 and Megatron-LM), computed in place.

    ``0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 * h**3)))``, in ``h``'s dtype.
    Returns ``h``.
    """
    t = h * h
    t *= 0.044715
    t += 1.0
    t *= h
    t *= _SQRT_2_OVER_PI
    np.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    h *= t
    return h


def mlp_reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The whole MLP block in one process: ``gelu(x @ w1) @ w2``."""
    return gelu(x @ w1) @ w2


@register_func(MLP_SHARD)
def mlp_shard(x: np.ndarray, w1_shard: np.ndarray, w2_shard: np.ndarray, out: np.ndarray) -> None:
    """This worker's part of the MLP block, written into ``out``.

    ``w1_shard`` is a block of columns of W1 (column-parallel) and ``w2_shard`` the
    matching block of rows of W2 (row-parallel), so ``gelu`` applies elementwise to
    this worker's slice of the hidden layer and no communication is needed until the
    partial outputs are summed with an allreduce.
    """
    if x.shape[1] != w1_shard.shape[0] or w1_shard.shape[1] != w2_shard.shape[0]:
        raise ValueError(
            f"mlp_shard: shapes do not chain: x {x.shape}, w1 shard {w1_shard.shape}, "
            f"w2 shard {w2_shard.shape}"
        )
    if out.shape != (x.shape[0], w2_shard.shape[1]):
        raise ValueError(
            f"mlp_shard: out has shape {out.shape}, expected {(x.shape[0], w2_shard.shape[1])}"
        )
    np.matmul(gelu(x @ w1_shard), w2_shard, out=out)


# ---------------------------------------------------------------------------- BLAS threads
# Each worker of a tensor-parallel step should use its share of the cores: a BLAS
# that starts one thread per core in every worker oversubscribes the machine (with
# OpenBLAS's spinning threads, 10x slower). threadpoolctl does this properly when it
# is installed; otherwise we talk to OpenBLAS / MKL found among the loaded libraries.
_SETTERS = (
    ("openblas", "openblas_get_num_threads", "openblas_set_num_threads"),
    ("openblas", "openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("openblas", "scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("openblas", "scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
    ("mkl_rt", "MKL_Get_Max_Threads", "MKL_Set_Num_Threads"),
)


def _blas_libraries() -> list[tuple[object, object]]:
    """(getter, setter) pairs of the BLAS libraries loaded in this process (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if ".so" in line})
    except OSError:
        return []
    found = []
    for path in paths:
        base = os.path.basename(path).lower()
        for tag, get_name, set_name in _SETTERS:
            if tag not in base:
                continue
            try:
                lib = ctypes.CDLL(path)
                getter, setter = getattr(lib, get_name), getattr(lib, set_name)
            except (OSError, AttributeError):
                continue
            getter.restype = ctypes.c_int
            found.append((getter, setter))
            break
    return found


@register_func(BLAS_THREADS)
def blas_threads(num_threads: int | None = None) -> int | None:
    """Set the BLAS thread count of this process (``None``: only ask); return the old one.

    Returns ``None`` when no BLAS library could be controlled. In a ProcessSession,
    worker 0 shares the controller's process, so this changes the controller's BLAS.
    """
    try:
        import threadpoolctl  # type: ignore[import-not-found]
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
        if infos:
            old = int(infos[0]["num_threads"])
            if num_threads is not None:
                threadpoolctl.threadpool_limits(int(num_threads), user_api="blas")
            return old
    libs = _blas_libraries()
    if not libs:
        return None
    old = int(libs[0][0]())
    if num_threads is not None:
        for _, setter in libs:
            setter(int(num_threads))
    return old
