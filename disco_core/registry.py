"""The global function registry, shared by sessions and RPC.

One process-wide table from names to Python callables, after TVM's global
function registry (``tvm.register_func`` / ``tvm.get_global_func``).
"""

from __future__ import annotations

import difflib
import os
import threading
import types
from collections.abc import Callable
from typing import Any, Literal, overload

from .errors import DiscoTypeError, DiscoValueError

__all__ = ["register_func", "get_global_func", "list_global_func_names", "remove_global_func"]

_FUNCS: dict[str, Callable[..., Any]] = {}
_LOCK = threading.Lock()


@overload
def register_func(
    name: str, func: None = None, override: bool = False
) -> Callable[[Callable], Callable]: ...
@overload
def register_func(name: str, func: Callable, override: bool = False) -> Callable: ...
@overload
def register_func(name: Callable, func: None = None, override: bool = False) -> Callable: ...


def register_func(name, func=None, override=False):
    """Register a global function.

    Parameters
    ----------
    name : str or callable
        The global name. When a callable is given instead, it is registered under its
        ``__qualname__`` (``@register_func`` without arguments).
    func : callable, optional
        The function. When omitted, a decorator is returned.
    override : bool
        Replace an existing registration instead of raising ``ValueError``. The same
        ``def`` run again (a module loaded again, or by each worker thread) replaces
        its own registration without it.

    Returns
    -------
    callable
        The function itself, or a decorator that registers and returns it.

    Examples
    --------
    .. code-block:: python

        @disco.register_func("my.add")
        def add(a, b):
            return a + b
    """
    if callable(name) and func is None:
        fn = name
        return register_func(fn.__qualname__, fn, override)
    if not isinstance(name, str) or not name:
        raise DiscoTypeError(f"register_func: name must be a non-empty str, got {name!r}")

    def _register(fn: Callable) -> Callable:
        if not callable(fn):
            raise DiscoTypeError(f"register_func({name!r}): {fn!r} is not callable")
        with _LOCK:
            old = _FUNCS.get(name)
            if old is not None and not override and old is not fn and not _same_def(old, fn):
                raise DiscoValueError(
                    f"global function {name!r} is already registered ({_describe(old)}); "
                    "pass override=True to replace it"
                )
            _FUNCS[name] = fn
        return fn

    return _register if func is None else _register(func)


@overload
def get_global_func(name: str, allow_missing: Literal[False] = False) -> Callable[..., Any]: ...
@overload
def get_global_func(name: str, allow_missing: bool) -> Callable[..., Any] | None: ...


def get_global_func(name: str, allow_missing: bool = False) -> Callable[..., Any] | None:
    """Look up a global function.

    Parameters
    ----------
    name : str
        The registered name.
    allow_missing : bool
        Return ``None`` for an unknown name instead of raising ``ValueError``.
    """
    fn = _FUNCS.get(name)
    if fn is None and not allow_missing:
        raise ValueError(missing_message(name))  # (TVM's type: a worker's error says ValueError)
    return fn


def list_global_func_names() -> list[str]:
    """Return the names of every registered global function, sorted."""
    with _LOCK:
        return sorted(_FUNCS)


def remove_global_func(name: str) -> None:
    """Remove a registration (a no-op for an unknown name)."""
    with _LOCK:
        _FUNCS.pop(name, None)


def missing_message(name: str) -> str:
    """The error text for an unknown function name, with close matches."""
    close = difflib.get_close_matches(name, list(_FUNCS), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"global function {name!r} is not registered{hint}"


def _same_def(old: Callable, new: Callable) -> bool:
    """Whether ``new`` comes from the same module-level ``def`` as ``old``, run again by
    another run of its module: a module that runs again (each worker thread of a
    ThreadedSession loading a ``.py`` file, a second session, ``importlib.reload``, a
    file loaded by path and then imported by name) replaces its own registrations
    instead of failing on them.

    Plain functions only (decorated ones are compared by what they wrap), from two runs
    of one file (two module namespaces, or one that ``reload`` runs again), with the
    same qualified name and first line.
    Closures, lambdas, bound methods and code run from a string are made many times by
    one run, so they never match (an outside check: such pairs replaced each other).
    """
    old, new = _unwrapped(old), _unwrapped(new)
    if not isinstance(old, types.FunctionType) or not isinstance(new, types.FunctionType):
        return False
    if old.__globals__ is new.__globals__ and _unwrapped(old.__globals__.get(old.__name__)) is not old:  # fmt: skip
        # one run of one module, two defs; importlib.reload runs the module again in the
        # same namespace, where the name still holds the old def as the new one registers
        return False
    qualname = old.__qualname__
    if qualname != new.__qualname__ or "<" in qualname:  # (<locals>, <lambda>)
        return False
    a, b = old.__code__, new.__code__
    if a.co_firstlineno != b.co_firstlineno or a.co_filename.startswith("<"):
        return False
    if a.co_filename == b.co_filename:
        return True
    try:
        return os.path.samefile(a.co_filename, b.co_filename)
    except OSError:  # a file gone
        return False


def _unwrapped(fn: Any) -> Any:
    """``fn`` without its ``functools.wraps`` decorators (a bounded walk)."""
    for _ in range(100):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or not callable(inner):
            break
        fn = inner
    return fn


def _describe(fn: Callable) -> str:
    mod = getattr(fn, "__module__", "?")
    return f"{mod}.{getattr(fn, '__qualname__', repr(fn))}"
