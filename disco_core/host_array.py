"""``HostArray``: the NumPy array a controller gets back, with TVM's ``.numpy()`` too."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["HostArray", "with_numpy_method"]


class HostArray(np.ndarray):
    """A NumPy array (a subclass: no copy) that also answers TVM's ``Tensor.numpy()``.

    ``DRef.debug_get_from_remote`` returns one for an array register, so code
    written for TVM (``ref.debug_get_from_remote(0).numpy()``) runs unchanged.
    """

    def numpy(self) -> np.ndarray:
        """This array as a plain ``numpy.ndarray`` (a view, as TVM's returns a host copy)."""
        return self.view(np.ndarray)


def with_numpy_method(value: Any) -> Any:
    """``value`` with its NumPy arrays viewed as :class:`HostArray` (inside tuples and lists too)."""
    if type(value) is np.ndarray:
        return value.view(HostArray)
    if type(value) in (tuple, list) and value:
        return type(value)(with_numpy_method(v) for v in value)
    return value
