"""Worker functions of ``disco demo``: one shard of a tensor-parallel transformer MLP.

Imported on every worker with ``session.import_python_module("disco_core.demo_funcs")``.
The controller uses the same :func:`gelu` for its single-process reference, so the
only difference between the two computations is how the matrix products are split
and summed.
"""

from __future__ import annotations

import time

import numpy as np
from threadpoolctl import ThreadpoolController

from .registry import register_func

__all__ = [
    "gelu",
    "mlp_reference",
    "mlp_shard",
    "blas_threads",
    "blas_controller",
    "MLP_SHARD",
    "BLAS_THREADS",
]

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
def mlp_shard(x: np.ndarray, w1_shard: np.ndarray, w2_shard: np.ndarray, out: np.ndarray) -> float:
    """This worker's part of the MLP block, written into ``out``; returns its seconds.

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
    t0 = time.perf_counter()
    np.matmul(gelu(x @ w1_shard), w2_shard, out=out)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- BLAS threads
# Each worker of a tensor-parallel step should use its share of the cores: a BLAS
# that starts one thread per core in every worker oversubscribes the machine (with
# OpenBLAS's spinning threads, 10x slower). threadpoolctl knows every BLAS and
# OpenMP runtime NumPy may have loaded, and how to set each.
_CONTROLLER: ThreadpoolController | None = None


def blas_controller() -> ThreadpoolController:
    """This process's :class:`threadpoolctl.ThreadpoolController` (made once, after NumPy loaded its BLAS)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER


@register_func(BLAS_THREADS)
def blas_threads(num_threads: int | None = None) -> int | None:
    """Set the BLAS thread count of this process (``None``: only ask); return the old one.

    Returns ``None`` when no BLAS library could be found. In a ProcessSession,
    worker 0 shares the controller's process, so this changes the controller's BLAS.
    """
    blas = blas_controller().select(user_api="blas")
    if not blas.lib_controllers:
        return None
    old = int(blas.lib_controllers[0].num_threads)
    if num_threads is not None:
        blas.limit(limits=int(num_threads))  # stays set: the context is never left
    return old
