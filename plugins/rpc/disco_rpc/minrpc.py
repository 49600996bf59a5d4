"""``rpc.with_minrpc``: package a build and a stdlib-only server into one runnable zipapp."""

from __future__ import annotations

import os
import tempfile
import zipfile
from typing import Any

from disco_core import DiscoFileNotFoundError, DiscoValueError

__all__ = ["with_minrpc", "MINRPC_SERVER", "PROTOCOL", "PROTOCOL_NAME"]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The source of the minimal server (the zipapp's ``__main__``).
MINRPC_SERVER = os.path.join(_HERE, "minrpc_server.py")
#: The protocol's numbers (:mod:`disco_rpc.protocol`), which the minimal server imports.
PROTOCOL = os.path.join(_HERE, "protocol.py")
#: The name of :data:`PROTOCOL`'s module in a zipapp, beside its ``__main__``.
PROTOCOL_NAME = "disco_rpc_protocol"


def _files(build: Any) -> list[str]:
    if build is None:
        return []
    if isinstance(build, (str, os.PathLike)):
        build = [build]
    out = []
    for item in build:
        path = os.fspath(item)
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isfile(full):
                    out.append(full)
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise DiscoFileNotFoundError(f"{path} does not exist")
    names = [os.path.basename(p) for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise DiscoValueError(f"two files of the build share the name(s) {sorted(dup)}")
    return out


def with_minrpc(build: Any = None, output: str | os.PathLike | None = None, *, interpreter: str = "/usr/bin/env python3") -> str:  # fmt: skip
    """Write one runnable file: the minimal server plus ``build``; return its path.

    Parameters
    ----------
    build : path or list of paths, optional
        Files (or folders of files) to ship: ``.py`` files are imported at start
        (their ``disco_core.register_func`` calls register global functions, through
        a stand-in when disco_core is not installed on the device), ``.so`` files are
        loaded and their symbols reach ``system_lib()``; every file can also be
        loaded by name with ``load_module``.
    output : path, optional
        Where to write the zipapp (a temporary ``.pyz`` by default).
    interpreter : str
        The ``#!`` line's interpreter: any Python 3.8+, nothing else installed.

    The file is executable: ``rpc.PopenSession(path)`` starts it and speaks the
    protocol over its stdin/stdout. See :mod:`disco_rpc.minrpc_server` for what
    the minimal server supports (no arrays: it has no NumPy).

    Unlike TVM's ``with_minrpc(compile_func)``, which links a C++ server into a
    binary, this packages Python: the device needs a Python interpreter.
    """
    files = _files(build)
    if output is None:
        fd, output = tempfile.mkstemp(prefix="disco-minrpc-", suffix=".pyz")
        os.close(fd)
    output = os.fspath(output)
    with open(output, "wb") as raw:
        raw.write(b"#!" + interpreter.encode("utf-8") + b"\n")
        with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.write(MINRPC_SERVER, "__main__.py")
            z.write(PROTOCOL, PROTOCOL_NAME + ".py")  # the server imports it
            for path in files:
                z.write(path, "build/" + os.path.basename(path))
    os.chmod(output, 0o755)
    return output
