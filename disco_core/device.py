"""Devices, dtypes and the host/GPU array helpers (NumPy on cpu, CuPy on cuda/rocm)."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from .errors import DiscoTypeError, DiscoValueError

__all__ = [
    "Device",
    "as_device",
    "as_dtype",
    "as_shape",
    "dtype_name",
    "empty",
    "to_host",
    "as_array",
    "is_array",
]

# TVM's DLDeviceType codes, so ``Device(2, 0)`` means cuda:0 as it does there.
_TYPE_CODES = {
    "cpu": 1, "cuda": 2, "cuda_host": 3, "opencl": 4, "vulkan": 7, "metal": 8,
    "vpi": 9, "rocm": 10, "rocm_host": 11, "ext_dev": 12, "cuda_managed": 13,
    "oneapi": 14, "webgpu": 15, "hexagon": 16,
}  # fmt: skip
_ALIASES = {"llvm": "cpu", "c": "cpu", "gpu": "cuda", "cl": "opencl", "nvptx": "cuda"}
_NAMES = {code: name for name, code in _TYPE_CODES.items()}


class Device:
    """A device: a type name and an index, ``Device("cuda", 1)`` or ``Device("cuda:1")``.

    Parameters
    ----------
    device_type : str or int
        ``"cpu"``, ``"cuda"``, ``"rocm"``, ... (TVM's names), a TVM type code, or a
        string with the index, ``"cuda:1"``.
    device_id : int
        The index among devices of that type.
    """

    __slots__ = ("device_type", "device_id")

    def __init__(self, device_type: str | int = "cpu", device_id: int | None = None) -> None:
        if isinstance(device_type, Device):
            device_type, device_id = (
                device_type.device_type,
                device_type.device_id if device_id is None else device_id,
            )
        elif isinstance(device_type, str) and ":" in device_type:
            name, _, idx = device_type.partition(":")
            if device_id is not None:
                raise DiscoValueError(f"Device({device_type!r}, {device_id}): index given twice")
            try:
                device_id = int(idx)
            except ValueError:
                raise DiscoValueError(
                    f"bad device string {device_type!r}; expected 'TYPE:INDEX', e.g. 'cuda:1'"
                ) from None
            device_type = name
        if isinstance(device_type, int) and not isinstance(device_type, bool):
            if device_type not in _NAMES:
                raise DiscoValueError(f"unknown device type code {device_type}")
            device_type = _NAMES[device_type]
        if not isinstance(device_type, str):
            raise DiscoTypeError(
                f"device type must be a str or int, got {type(device_type).__name__}"
            )
        name = _ALIASES.get(device_type.strip().lower(), device_type.strip().lower())
        if name not in _TYPE_CODES:
            raise DiscoValueError(
                f"unknown device type {device_type!r}; known: {', '.join(sorted(_TYPE_CODES))}"
            )
        device_id = 0 if device_id is None else device_id
        if (
            not isinstance(device_id, (int, np.integer))
            or isinstance(device_id, bool)
            or device_id < 0
        ):
            raise DiscoValueError(f"device index must be an int >= 0, got {device_id!r}")
        self.device_type = name
        self.device_id = int(device_id)

    @property
    def device_type_code(self) -> int:
        """TVM's integer code of the device type."""
        return _TYPE_CODES[self.device_type]

    @property
    def is_gpu(self) -> bool:
        return self.device_type in ("cuda", "rocm")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = Device(other)
            except (ValueError, TypeError):
                return False
        return isinstance(other, Device) and (self.device_type, self.device_id) == (
            other.device_type,
            other.device_id,
        )

    def __hash__(self) -> int:
        return hash((self.device_type, self.device_id))

    def __repr__(self) -> str:
        return f"Device({self.device_type!r}, {self.device_id})"

    def __str__(self) -> str:
        return f"{self.device_type}:{self.device_id}"

    def __reduce__(self):
        return (Device, (self.device_type, self.device_id))


def as_device(device: Any) -> Device | None:
    """Normalise ``None``, a :class:`Device`, a string or a ``(type, id)`` pair."""
    if device is None or isinstance(device, Device):
        return device
    if isinstance(device, (tuple, list)) and len(device) == 2:
        return Device(*device)
    if isinstance(device, (str, int)):
        return Device(device)
    # torch.device, cupy.cuda.Device and friends
    dtype = getattr(device, "type", None)
    if isinstance(dtype, str):
        return Device(dtype, getattr(device, "index", None) or 0)
    raise DiscoTypeError(
        f"cannot interpret {device!r} as a device; use disco.Device('cpu', 0) or 'cuda:0'"
    )


_BF16: Any = None


def _bfloat16():
    global _BF16
    if _BF16 is None:
        if importlib.util.find_spec("ml_dtypes") is None:
            raise DiscoTypeError(
                "dtype 'bfloat16' needs the ml_dtypes package: pip install ml_dtypes"
            )
        import ml_dtypes

        _BF16 = np.dtype(ml_dtypes.bfloat16)
    return _BF16


def as_dtype(dtype: Any) -> np.dtype:
    """Parse a dtype (``"float32"``, ``np.float16``, ``"bfloat16"``), with a clear error.

    A dtype of the other byte order is given in this machine's (a worker's array is).
    """
    if isinstance(dtype, np.dtype):
        if dtype.isnative and dtype.kind in "biufc?":  # the common case: nothing to check
            return dtype
        return _native_checked(dtype)
    if isinstance(dtype, str) and dtype.strip().lower() in ("bfloat16", "bf16"):
        return _bfloat16()
    if dtype is None:
        raise DiscoTypeError("dtype must be given, e.g. 'float32'")
    torch_name = getattr(dtype, "is_floating_point", None) and str(dtype)
    if torch_name and torch_name.startswith("torch."):
        return as_dtype(torch_name[len("torch.") :])
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError, OverflowError, RecursionError):
        # NumPy parses a name with a comma as Python (ast.literal_eval): SyntaxError
        custom = _ml_dtype(dtype)
        if custom is None:
            raise DiscoTypeError(
                f"unknown dtype {dtype!r}; use a NumPy dtype name such as 'float32' or 'int64'"
            ) from None
        return custom
    return _native_checked(dt)


def _ml_dtype(name: Any) -> np.dtype | None:
    """The ml_dtypes dtype called ``name`` (``"float8_e4m3fn"``), or None. NumPy knows
    those names only once ml_dtypes is imported: a worker process had not, and refused
    a dtype the controller had taken (an outside check)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return None
    if importlib.util.find_spec("ml_dtypes") is None:
        return None
    import ml_dtypes

    found = getattr(ml_dtypes, name, None)
    if not isinstance(found, type) or not found.__module__.startswith("ml_dtypes"):
        return None
    dt = np.dtype(found)
    # a class of ml_dtypes that is no scalar type (finfo) makes an object dtype
    return dt if dt.type is found else None


# NumPy 2's ``dtype.name`` is a Python property that costs about 2 us (more than the
# rest of a small collective's bookkeeping); a dict lookup on the dtype costs 25 ns.
_DTYPE_NAMES: dict[np.dtype, str] = {}
_MAX_DTYPE_NAMES = 4096  # structured dtypes can be made without end: stop caching there


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name`` (``"float32"``, ``"bfloat16"``), cached per dtype.

    Parameters
    ----------
    dtype : numpy.dtype
        The dtype of an array (``x.dtype``).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = dtype.name
        if len(_DTYPE_NAMES) < _MAX_DTYPE_NAMES:
            _DTYPE_NAMES[dtype] = name
        return name


def _native_checked(dt: np.dtype) -> np.dtype:
    """``dt`` in this machine's byte order if a worker array may hold it, else a
    :class:`DiscoTypeError`."""
    if not dt.isnative:
        dt = dt.newbyteorder("=")
    custom = type(dt.type).__module__.startswith("ml_dtypes") or dt.type.__module__.startswith(
        "ml_dtypes"
    )
    if dt.hasobject or dt.kind in "OUSMm" or (dt.kind == "V" and not custom):
        raise DiscoTypeError(
            f"dtype {dt} cannot live in a worker array; use a numeric or bool dtype"
        )
    return dt


def _max_dims() -> int:
    """The most dimensions a NumPy array may have (64 from NumPy 2, 32 before)."""
    try:
        np.empty((0,) * 64)
    except ValueError:
        return 32
    return 64


# The most dimensions a shape may have (NumPy's own limit).
_MAX_DIMS = _max_dims()


def as_shape(shape: Any, dtype: Any = None) -> tuple[int, ...]:
    """Parse a shape (an int or a sequence of ints >= 0), with a clear error.

    Parameters
    ----------
    shape : int or sequence of int
        The shape.
    dtype : numpy.dtype, optional
        When given, the shape is also checked to be one an array of this dtype can
        have: its size in bytes (zero-length axes aside, as NumPy counts) must fit a
        pointer-sized integer. A shape that cannot exist is refused here rather than
        by every worker later.
    """
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise DiscoTypeError(f"shape must be a tuple of ints, got {shape!r}") from None
    if len(dims) > _MAX_DIMS:
        raise DiscoValueError(f"shape has {len(dims)} dimensions; an array has at most {_MAX_DIMS}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise DiscoTypeError(f"shape must be a tuple of ints, got {shape!r}")
        if d < 0:
            raise DiscoValueError(f"shape dimensions must be >= 0, got {shape!r}")
        out.append(int(d))
    if dtype is not None:
        nbytes = np.dtype(dtype).itemsize
        for d in out:
            nbytes *= max(d, 1)
        if nbytes > _MAX_BYTES:
            raise DiscoValueError(
                f"shape {tuple(out)} of {np.dtype(dtype).name} is too large for any array "
                f"({nbytes:,} bytes; the most is {_MAX_BYTES:,})"
            )
    return tuple(out)


# An array's size in bytes is a pointer-sized signed integer.
_MAX_BYTES = int(np.iinfo(np.intp).max)


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "GPU arrays need CuPy (pip install cupy-cuda12x, or cupy-rocm-*)"
        ) from exc
    return cupy


def empty(shape: Any, dtype: Any, device: Device | None = None) -> Any:
    """Allocate an uninitialised array on ``device`` (NumPy on cpu, CuPy on GPUs)."""
    dtype = as_dtype(dtype)
    shape = as_shape(shape, dtype)
    device = as_device(device)
    if device is None or device.device_type == "cpu":
        return np.empty(shape, dtype)
    if device.is_gpu:
        cp = _cupy()
        with cp.cuda.Device(device.device_id):
            return cp.empty(shape, dtype)
    raise DiscoValueError(
        f"cannot allocate arrays on {device}: only cpu, cuda and rocm are supported"
    )


def is_array(value: Any) -> bool:
    """True for NumPy arrays and anything exposing ``__dlpack__`` or ``__array__``."""
    return isinstance(value, np.ndarray) or hasattr(value, "__dlpack__")


def as_array(value: Any, what: str = "") -> Any:
    """View ``value`` as a NumPy (host) or CuPy (GPU) array without copying where possible.

    ``what`` names the argument in the error (``"copy_to_worker_0: host_array"``).
    """
    if isinstance(value, np.ndarray):
        return value
    mod = type(value).__module__.split(".")[0]
    if mod == "cupy":
        return value
    if mod == "torch" and getattr(value, "requires_grad", False):
        value = value.detach()
    if hasattr(value, "__dlpack_device__"):
        dev_type, _ = value.__dlpack_device__()
        if int(dev_type) in (2, 10):  # kDLCUDA, kDLROCM
            return _cupy().from_dlpack(value)
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError):
            pass
        if mod == "torch" and str(getattr(value, "dtype", "")) == "torch.bfloat16":
            return _torch_bfloat16(value)
    if hasattr(value, "__array__"):
        return np.asarray(value)
    raise DiscoTypeError(
        f"{what + ': ' if what else ''}expected an array (NumPy, CuPy or anything with "
        f"__dlpack__), got {type(value).__name__}"
    )


def _torch_bfloat16(tensor: Any) -> np.ndarray:
    """A CPU ``torch.bfloat16`` tensor as a NumPy bfloat16 array on the same memory (NumPy
    takes no bfloat16 through DLPack, and torch's ``__array__`` refuses it: an outside
    check met torch's bare "Got unsupported ScalarType BFloat16" in every call that
    takes a host array). Its bits, seen as int16, then as ml_dtypes' bfloat16."""
    import torch

    return np.from_dlpack(tensor.view(torch.int16)).view(_bfloat16())


def to_host(value: Any) -> Any:
    """Return ``value`` with GPU and DLPack arrays turned into NumPy arrays (a copy for GPU)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__") or type(value).__module__.split(".")[0] == "cupy":
        arr = as_array(value)
        if not isinstance(arr, np.ndarray):
            return arr.get()
        return arr
    return value
