"""Module loaders: ``.py`` source files (core) and ``.pt2`` torch.export archives."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from typing import Any

__all__ = ["PyModule", "load_py", "Pt2Module", "load_pt2", "torch_available"]

# Worker threads of one process load modules one at a time: neither importlib's
# sys.modules dance nor torch.export.load is safe to run concurrently.
_LOAD_LOCK = threading.Lock()


class PyModule:
    """A Python source file loaded as a module; ``module["fn"]`` is any top-level callable."""

    def __init__(self, module: Any, path: str) -> None:
        self.module = module
        self.path = path

    def __getitem__(self, name: str) -> Any:
        func = getattr(self.module, name, None)
        if func is None or not callable(func):
            names = sorted(
                n for n, v in vars(self.module).items() if callable(v) and not n.startswith("_")
            )
            raise KeyError(
                f"{self.path} has no function {name!r}; it has: {', '.join(names) or 'none'}"
            )
        return func

    def __repr__(self) -> str:
        return f"<PyModule {self.path}>"


def load_py(path: str, device: Any = None) -> PyModule:
    """Load a Python source file (its top-level code runs, once per worker)."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    name = f"_disco_module_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    with _LOAD_LOCK:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    return PyModule(module, path)


class Pt2Module:
    """A ``torch.export`` archive; ``module["main"]`` (or ``"forward"``) runs the program."""

    def __init__(self, program: Any, path: str, device: Any) -> None:
        self.program = program
        self.path = path
        self._callable = program.module()

    def __getitem__(self, name: str) -> Any:
        if name in ("main", "forward", "__call__"):
            return self._call
        raise KeyError(f"{self.path}: a .pt2 archive exposes 'main' (or 'forward'), not {name!r}")

    def __repr__(self) -> str:
        return f"<Pt2Module {self.path}>"

    def _call(self, *args: Any) -> Any:
        # NumPy inputs become tensors sharing their memory; outputs stay tensors
        # (a register may hold them; debug_get_from_remote returns NumPy).
        import numpy as np
        import torch

        return self._callable(
            *[torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
        )


def load_pt2(path: str, device: Any = None) -> Pt2Module:
    """Load a ``torch.export`` archive (``torch.export.save``)."""
    import torch

    with _LOAD_LOCK:
        return Pt2Module(torch.export.load(path), path, device)


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None
