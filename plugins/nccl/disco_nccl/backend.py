"""Where the NCCL bindings come from: CuPy (CUDA build for NCCL, ROCm build for RCCL).

Kept apart so that everything else imports without CuPy and so that a unit test can
hand the CCL a stand-in module (the tests that do so say that they do).
"""

from __future__ import annotations

from types import ModuleType

from disco_core.errors import CCLError

__all__ = ["load", "INSTALL_HINT"]

INSTALL_HINT = {
    "nccl": "pip install 'disco-nccl[cuda12]' (CuPy for CUDA 12: cupy-cuda12x)",
    "rccl": "pip install disco-rccl with the CuPy build for your ROCm (cupy-rocm-*)",
}


def load(name: str = "nccl") -> tuple[ModuleType, ModuleType]:
    """Return ``(cupy, cupy.cuda.nccl)``, or raise a :class:`CCLError` saying what is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise CCLError(
            f"init_ccl({name!r}) needs CuPy, which is not installed: {INSTALL_HINT[name]}"
        ) from exc
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # CuPy without its NCCL/RCCL library
        raise CCLError(
            f"init_ccl({name!r}): CuPy {cupy.__version__} cannot load the {name.upper()} library "
            f"({exc}); install it (e.g. pip install nvidia-nccl-cu12) or {INSTALL_HINT[name]}"
        ) from exc
    if not getattr(nccl, "available", True):
        raise CCLError(
            f"init_ccl({name!r}): CuPy was built without {name.upper()} support; {INSTALL_HINT[name]}"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        raise CCLError(f"init_ccl({name!r}) needs a GPU, and none is usable here: {exc}") from exc
    if count < 1:
        raise CCLError(f"init_ccl({name!r}) needs a GPU, and this machine has none")
    return cupy, nccl
