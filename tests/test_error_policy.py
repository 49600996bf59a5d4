"""Every exception a plugin raises is a DiscoError, and every exception class's name ends in Error.

Walks the plugins' sources with ``ast``: a ``raise`` of a bare built-in exception
(``raise ValueError(...)``) fails, so does an exception class that does not derive
from :class:`disco_core.DiscoError` or whose name does not end in ``Error``. Control
flow that never reaches a user is allowed: end of stream (``EOFError``),
``StopIteration``, ``SystemExit``, ``KeyboardInterrupt``, ``NotImplementedError`` in
abstract methods, and private classes (a leading underscore).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pathlib

import pytest

import disco_core as disco

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The packages held to the rule.
PACKAGES = {
    "disco_mpi": ROOT / "plugins/mpi/disco_mpi",
    "disco_socket": ROOT / "plugins/socket/disco_socket",
    "disco_nccl": ROOT / "plugins/nccl/disco_nccl",
    "disco_rccl": ROOT / "plugins/rccl/disco_rccl",
    "disco_rpc": ROOT / "plugins/rpc/disco_rpc",
}
#: Files held to no part of the rule: the minimal RPC server is shipped as a
#: self-contained program on the standard library alone, so it raises built-in
#: exceptions (it cannot import disco_core).
EXEMPT = {
    ROOT / "plugins/rpc/disco_rpc/minrpc_server.py",
}
ALLOWED_BUILTINS = {
    "EOFError",
    "StopIteration",
    "SystemExit",
    "KeyboardInterrupt",
    "NotImplementedError",
    "GeneratorExit",
}
BUILTIN_EXCEPTIONS = {
    name
    for name in dir(builtins)
    if isinstance(getattr(builtins, name), type)
    and issubclass(getattr(builtins, name), BaseException)
}


def _modules():
    for pkg, path in PACKAGES.items():
        for f in sorted(path.rglob("*.py")):
            if f in EXEMPT:
                continue
            rel = f.relative_to(path).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield pkg, ".".join([pkg, *parts]), f


@pytest.mark.parametrize("pkg, module, path", list(_modules()), ids=lambda v: str(v))
def test_plugin_raises_only_disco_errors(pkg, module, path):
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else None
            if name in BUILTIN_EXCEPTIONS and name not in ALLOWED_BUILTINS:
                bad.append(f"{path.name}:{node.lineno}: raise {name}(...)")
    assert not bad, (
        "raise a DiscoError subclass (e.g. disco.DiscoValueError) instead:\n" + "\n".join(bad)
    )


@pytest.mark.parametrize("pkg, module, path", list(_modules()), ids=lambda v: str(v))
def test_plugin_exception_classes(pkg, module, path):
    tree = ast.parse(path.read_text(), str(path))
    names = [
        n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")
    ]
    if not names:
        return
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # e.g. disco_nccl's GPU modules without CuPy
        pytest.skip(f"{module} does not import here: {exc}")
    for name in names:
        cls = getattr(mod, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            assert issubclass(cls, disco.DiscoError), f"{module}.{name} is not a DiscoError"
            assert name.endswith("Error"), f"{module}.{name}: exception names end in Error"
