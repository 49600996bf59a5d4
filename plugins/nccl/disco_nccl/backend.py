"""Where the NCCL bindings come from: CuPy (CUDA build for NCCL, ROCm build for RCCL).

Kept apart so that everything else imports without CuPy and so that a unit test can
hand the CCL a stand-in module (the tests that do so say that they do).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from disco_core import CCLError

__all__ = ["load", "device_count", "can_split", "communicator", "uid_bytes", "INSTALL_HINT"]

# disco-nccl and disco-rccl are installed from a clone of the repository: nobody has
# published them, so a hint naming them on the package index would point at whoever
# registers the name first.
INSTALL_HINT = {
    "nccl": "pip install './plugins/nccl[cuda12]' from a clone of the Disco repository "
    "(not yet on PyPI; the extra brings CuPy for CUDA 12: cupy-cuda12x)",
    "rccl": "pip install ./plugins/nccl './plugins/rccl[rocm7]' from a clone of the Disco repository "
    "(not yet on PyPI; the extra brings CuPy for ROCm 7: cupy-rocm-7-0; [rocm5] for ROCm 5)",
}
# ncclCommSplit arrived in NCCL 2.18.1 (CuPy >= 13 binds it as NcclCommunicator.commSplit).
_SPLIT_VERSION = 21801


def load(name: str = "nccl", need_gpu: bool = True) -> tuple[ModuleType, ModuleType]:
    """Return ``(cupy, cupy.cuda.nccl)``, or raise a :class:`CCLError` saying what is missing.

    Parameters
    ----------
    name : str
        ``"nccl"`` or ``"rccl"``: which CuPy build (CUDA or ROCm) is needed.
    need_gpu : bool
        Also require a usable GPU. The controller does not need one (it only makes
        the NCCL unique ids, as TVM's does); the workers do.
    """
    try:
        import cupy
    except ImportError as exc:
        raise CCLError(
            f"init_ccl({name!r}) needs CuPy, which is not installed: {INSTALL_HINT[name]}"
        ) from exc
    is_hip = bool(getattr(cupy.cuda.runtime, "is_hip", False))
    if is_hip != (name == "rccl"):
        build, other = ("ROCm", "rccl") if is_hip else ("CUDA", "nccl")
        raise CCLError(
            f"init_ccl({name!r}): the installed CuPy {cupy.__version__} is its {build} build; "
            f"use init_ccl({other!r}) here, or {INSTALL_HINT[name]}"
        )
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
    if need_gpu:
        count = device_count(cupy)
        if count is None:
            try:
                cupy.cuda.runtime.getDeviceCount()
            except Exception as exc:  # no driver, no device: say which
                raise CCLError(
                    f"init_ccl({name!r}) needs a GPU, and none is usable here: {exc}"
                ) from exc
            raise CCLError(f"init_ccl({name!r}) needs a GPU, and this machine has none")
    return cupy, nccl


def device_count(cupy: Any) -> int | None:
    """The number of GPUs this process sees, or None when there is none (or no driver)."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return None
    return count or None


def can_split(nccl: Any) -> bool:
    """True when ``ncclCommSplit`` is usable: NCCL >= 2.18.1 and a CuPy that binds it."""
    if not hasattr(getattr(nccl, "NcclCommunicator", None), "commSplit"):
        return False
    try:
        return int(nccl.get_version()) >= _SPLIT_VERSION
    except Exception:
        return False


def communicator(nccl: Any, size: int, uid: bytes, rank: int) -> Any:
    """``ncclCommInitRank``; ``uid`` is the id's 128 bytes.

    CuPy >= 14 takes the id as bytes, older CuPy as a tuple of (signed) chars; the
    controller's and a worker's CuPy may differ when the workers run on other nodes.
    """
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    except TypeError:
        signed = tuple(b - 256 if b > 127 else b for b in uid)
        return nccl.NcclCommunicator(size, signed, rank)


def uid_bytes(uid: Any) -> bytes:
    """The 128 bytes of an NCCL unique id, whichever form this CuPy returned it in."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(b & 0xFF for b in uid)
