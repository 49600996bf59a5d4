"""Shared libraries (``.so``) loaded through ctypes; functions are called by name.

Arguments are converted by type: ``int`` -> ``int64_t``, ``float`` -> ``double``,
``bool`` -> ``int``, ``str``/``bytes`` -> ``const char*``, ``None`` -> ``NULL`` and
arrays -> a pointer to their data (the C function may write through it). The
result is a C ``int`` unless ``restype`` says otherwise: one of ``"int"``,
``"int32"``, ``"int64"``, ``"uint64"``, ``"float"``, ``"double"``, ``"void"``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import numpy as np

from disco_core import DiscoKeyError, DiscoTypeError, DiscoValueError

__all__ = ["CtypesModule", "CFunction", "load_so", "RESTYPES"]

RESTYPES = {
    "int": ctypes.c_int,
    "int32": ctypes.c_int32,
    "int64": ctypes.c_int64,
    "uint64": ctypes.c_uint64,
    "float": ctypes.c_float,
    "float32": ctypes.c_float,
    "double": ctypes.c_double,
    "float64": ctypes.c_double,
    "void": None,
}


def _arg(a: Any) -> Any:
    if isinstance(a, bool):
        return ctypes.c_int(int(a))
    if isinstance(a, (int, np.integer)):
        return ctypes.c_int64(int(a))
    if isinstance(a, (float, np.floating)):
        return ctypes.c_double(float(a))
    if isinstance(a, str):
        return ctypes.c_char_p(a.encode())
    if isinstance(a, bytes):
        return ctypes.c_char_p(a)
    if a is None:
        return ctypes.c_void_p(None)
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise DiscoValueError("arrays passed to C functions must be C-contiguous")
        return ctypes.c_void_p(a.ctypes.data)
    if isinstance(a, bytearray):
        return (ctypes.c_char * len(a)).from_buffer(a)
    if hasattr(a, "data") and hasattr(a.data, "ptr"):  # CuPy: the device pointer
        return ctypes.c_void_p(a.data.ptr)
    raise DiscoTypeError(f"cannot pass a {type(a).__name__} to a C function")


class CFunction:
    """A C function of a shared library, called with converted arguments."""

    def __init__(self, cfunc: Any, name: str, restype: Any = "int") -> None:
        if isinstance(restype, str):
            if restype not in RESTYPES:
                raise DiscoValueError(f"unknown restype {restype!r}; known: {', '.join(RESTYPES)}")
            restype = RESTYPES[restype]
        self.cfunc = cfunc
        self.name = name
        self.restype = restype
        self.__name__ = name

    def __call__(self, *args: Any) -> Any:
        self.cfunc.restype = self.restype
        self.cfunc.argtypes = None
        return self.cfunc(*[_arg(a) for a in args])

    def __repr__(self) -> str:
        return f"<CFunction {self.name}>"


class CtypesModule:
    """A loaded shared library; ``module["fn"]`` is a :class:`CFunction` returning ``int``."""

    def __init__(self, lib: Any, path: str) -> None:
        self.lib = lib
        self.path = path

    def get_function(self, name: str, restype: Any = "int") -> CFunction:
        try:
            return CFunction(getattr(self.lib, name), name, restype)
        except AttributeError:
            raise DiscoKeyError(f"{os.path.basename(self.path)} has no symbol {name!r}") from None

    def __getitem__(self, name: str) -> CFunction:
        return self.get_function(name)

    def __repr__(self) -> str:
        return f"<CtypesModule {self.path}>"


#: Symbols of a library TVM compiled (``tvm.compile(...).export_library``): its
#: functions take TVM's calling convention, and its ``main`` is a Relax VM's.
_TVM_MARKERS = ("__tvm_ffi__library_bin", "__tvm_dev_mblob", "__tvm_module_ctx", "__tvm_ffi__library_ctx")  # fmt: skip


def load_so(path: str, device: Any = None) -> CtypesModule:
    """Load a shared library with ``ctypes.CDLL`` (module loader for ``.so``).

    Raises
    ------
    DiscoValueError
        The library is one TVM compiled: it loaded, and its first call failed with
        "has no symbol 'main'", which read as a model without ``main`` (an outside
        check running TVM's own ``test_vm_module``).
    """
    if _compiled_by_tvm(path):  # before dlopen, which fails on TVM's runtime symbols
        raise DiscoValueError(
            f"{os.path.basename(path)} is a module compiled by TVM (tvm.compile(...)."
            "export_library): Disco for Python does not run TVM's VM executables. Load a "
            ".py module, a .pt2 program (torch.export) or a plain C shared library"
        )
    return CtypesModule(ctypes.CDLL(os.path.abspath(path)), path)


def _compiled_by_tvm(path: str) -> bool:
    """Whether the library's symbol names hold one of TVM's (read, not loaded: without
    TVM's runtime in the process, ``dlopen`` fails first on an undefined symbol)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return any(m.find(marker.encode() + b"\0") != -1 for marker in _TVM_MARKERS)
    except (OSError, ValueError):  # unreadable, empty: dlopen says why
        return False
